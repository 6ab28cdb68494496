"""scripts/compare_curves.py on hand-made length-curve records: rows paired by example, each count and sign-test p
worked out by hand, and records of different examples refused."""

from __future__ import annotations

import json

import pytest
from script_module import load_script


def _record(rewards_by_depth: dict, seed_base: int = 7) -> dict:
    rows = [
        {
            "length": 1024,
            "depth": list(depth),
            "example_depths": [depth[0] + 0.01 * i for i in range(len(r))],
            "rewards": r,
        }
        for depth, r in rewards_by_depth.items()
    ]
    return {"metrics": {"seed_base": seed_base, "rows": rows}}


BEFORE = {(0.0, 0.5): [0.0, 0.0, 1.0, 0.0], (0.5, 1.0): [1.0, 1.0, 1.0, 0.0]}
AFTER = {(0.0, 0.5): [1.0, 1.0, 1.0, 0.0], (0.5, 1.0): [0.0, 1.0, 0.0, 0.0]}


def test_rows_paired_by_hand():
    rows = load_script("scripts/compare_curves.py").paired_rows(_record(BEFORE)["metrics"], _record(AFTER)["metrics"])
    # first band: 0 -> 1 twice, none lost: p = 2 * (1/2)^2 = 0.5; second: 1 -> 0 twice, the same p
    assert [(r["depth"], r["before"], r["after"], r["gained"], r["lost"], r["p"]) for r in rows[:2]] == [
        ([0.0, 0.5], 1.0, 3.0, 2, 0, 0.5),
        ([0.5, 1.0], 3.0, 1.0, 0, 2, 0.5),
    ]
    # all 8 examples: +2 -2, an even split: p 1
    assert (rows[2]["length"], rows[2]["examples"], rows[2]["gained"], rows[2]["lost"], rows[2]["p"]) == (
        "all",
        8,
        2,
        2,
        1.0,
    )


@pytest.mark.parametrize(
    "after, said",
    [
        (_record(AFTER, seed_base=8), "seed_base differs"),
        (_record({(0.0, 0.5): AFTER[(0.0, 0.5)]}), "rows differ"),
    ],
)
def test_other_examples_refused_exit_2(tmp_path, capsys, after, said):
    before_path, after_path = tmp_path / "before.json", tmp_path / "after.json"
    before_path.write_text(json.dumps(_record(BEFORE)))
    after_path.write_text(json.dumps(after))
    assert load_script("scripts/compare_curves.py").main([str(before_path), str(after_path)]) == 2
    err = capsys.readouterr().err
    assert said in err and str(after_path) in err and err.count("\n") == 1


def test_other_example_depths_refused():
    after = _record(AFTER)
    after["metrics"]["rows"][1]["example_depths"][0] = 0.9
    with pytest.raises(ValueError, match="depth \\[0.5, 1.0\\]: example_depths differ"):
        load_script("scripts/compare_curves.py").paired_rows(_record(BEFORE)["metrics"], after["metrics"])
