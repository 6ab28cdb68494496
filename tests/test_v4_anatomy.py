"""scripts/v4_anatomy.py on a hand-made record: blocks of prompts and the window split by lr 0's unsolved prompts,
each number worked out by hand."""

from __future__ import annotations

import pytest
from script_module import load_script


def _run(rewards):
    return [
        {"step": i, "prompt": i, "rewards": r, "seconds": 3.0 + i, "phase_seconds": {"capture": 1.0 + i}}
        for i, r in enumerate(rewards)
    ]


def test_blocks_and_the_window_split_by_hand():
    runs = {
        "response-only": _run([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [1.0, 1.0]]),
        "lr0": _run([[0.0, 0.0], [0.0, 0.0], [0.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 1.0]]),
    }
    found = load_script("scripts/v4_anatomy.py").anatomy(runs, steps=6, window=4, block=4)
    assert found["equal_reward_steps"] == {"response-only": 4, "lr0": 5} and found["steps"] == {
        "response-only": 6,
        "lr0": 6,
    }
    # by common reward, steps 0-2 then 3-5: trained [0,0] [1,1] | [0,0] [1,1]; lr 0 [0,0] [0,0] | [0,0] [0,0] [1,1]
    assert found["equal_reward_steps_by_reward"] == {
        "response-only": {"first_half": {"0.0": 1, "1.0": 1}, "second_half": {"0.0": 1, "1.0": 1}},
        "lr0": {"first_half": {"0.0": 2}, "second_half": {"0.0": 2, "1.0": 1}},
    }
    # steps 1-5 (the first left out): 4, 5, 6, 7, 8 s and captures of 2-6 s
    assert found["phase_medians"]["lr0"] == {"step": 6.0, "capture": 4.0}
    # prompts 0-3: trained (0 + 0.5 + 1 + 0) / 4, lr 0 (0 + 0 + 0.5 + 0) / 4; prompts 4-5: (0.5 + 1) / 2, (0 + 1) / 2
    assert [(b["prompts"], b["trained"], b["lr0"]) for b in found["blocks"]] == [
        ([0, 3], 0.375, 0.125),
        ([4, 5], 0.75, 0.5),
    ]
    assert found["blocks"][0]["difference"] == pytest.approx(0.25)
    # the window is prompts 2-5; lr 0 never solved 3 and 4; the trained run solved 4 once and half the time
    assert found["window_prompts"] == 4
    assert found["lr0_never_solved"] == {
        "prompts": 2,
        "trained_solved_once": 1,
        "trained_solved_half": 1,
        "trained_mean": 0.25,
    }
    assert found["lr0_solved"] == {"prompts": 2, "trained_mean": 1.0, "lr0_mean": 0.75}
