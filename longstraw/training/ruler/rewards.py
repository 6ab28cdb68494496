"""RULER's metrics as TRL reward functions (`f(prompts, completions, answer, **kwargs)`), one value in
[0, 1] per completion (RULER reports 100 times the mean). long_context_eval/eval/synthetic/constants.py:
string_match_all for niah and variable tracking, string_match_part for QA; a prediction is first
stripped and its control characters made newlines (eval/evaluate.py, postprocess_pred)."""

from __future__ import annotations

import re

_CONTROL = re.compile(r"[\x00-\x1f]")


def _prediction(completion) -> str:
    # imported here: rewards.py brings torch, which generating prompts does not need
    from longstraw.training.rewards import completion_text

    return _CONTROL.sub("\n", completion_text(completion).strip()).strip().lower()


def _references(answer) -> list[str]:
    refs = [answer] if isinstance(answer, str) else list(answer)
    if not refs:
        raise ValueError("a row's `answer` holds no reference strings")
    return [str(r).lower() for r in refs]


def string_match_all(prompts, completions, answer, **kwargs) -> list[float]:
    """The share of the row's references the completion contains (case-insensitive)."""
    out = []
    for completion, refs in zip(completions, answer):
        text, refs = _prediction(completion), _references(refs)
        out.append(sum(r in text for r in refs) / len(refs))
    return out


def string_match_part(prompts, completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion contains any of the row's references (case-insensitive), else 0.0."""
    return [float(any(r in _prediction(c) for r in _references(refs))) for c, refs in zip(completions, answer)]
