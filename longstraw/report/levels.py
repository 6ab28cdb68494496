"""The four validation levels (docs/design.md §8), as far as the results show them: one row per path
(model family x gradient mode x scale: model, prompt positions, device), each level's cell with its
evidence (numbers) and tolerance, and the highest level the path reached.

Two sources, both tables. `validation` points (`longstraw.kinds.validation`) measure V1-V4 for their
paths (their `paths` table: each level's state and evidence). Every
`replay`-mode step point (the LongStraw transaction; hold_all and naive are baselines) is also a
response-only path "<model>, <prompt positions>, <device>" whose V1 (executes) is reached when one of
its points completed with a finite loss and finite gradients in every cycle, the resident state's
fingerprint unchanged after all replays, and its peak under the ceiling (CUDA: peak_allocated_bytes
below the device's total; CPU: the process completed without running out of memory). The paper's
two paths stand beside ours only as its material states them (`paths` in paper.yaml).
"""

from __future__ import annotations

from longstraw import kinds
from longstraw.plotting.formatting import format_bytes, is_missing

# the validation kind's vocabulary: its levels (lowest first), a level's states, a path's scale in words
LEVEL_NAMES = kinds.contributed("levels")
STATE = kinds.contributed("level_state")
scale_text = kinds.contributed("scale_text")

LEVELS = [
    dict(zip(("level", "name", "definition"), entry))
    for entry in (
        (
            "V1",
            "executes",
            "the step completes at the operating point: finite loss and gradients, peak under the "
            "ceiling, resident state fingerprint unchanged after all replays",
        ),
        (
            "V2",
            "conditional-response parity",
            "gradients equal an independent reference (HF forward of the prompt "
            "minus its last token without grad, then the last prompt token and the "
            "response on that cache with grad) within tolerance",
        ),
        (
            "V3",
            "full-sequence parity",
            "gradients equal HF one-pass autograd over p + y; response-only mode reports "
            "its measured gap, exact mode must pass",
        ),
        (
            "V4",
            "policy improvement",
            "GRPO steps raise reward on a verifiable long-context task beyond noise: the paired "
            "gain over the same run at learning rate 0, same prompts and seeds, above 3 "
            "standard errors",
        ),
    )
]
NOT_RUN = "not run in these results (experiments/validation.yaml: longstraw validate experiments/validation.yaml)"


def _value(row, key):
    value = row.get(key)
    return None if is_missing(value) else value


def v1_check(row: dict) -> tuple[bool, str]:
    """(reached, why) for one replay-mode step row."""
    status = _value(row, "status")
    if status != "ok":
        return False, f"status {status}: {_value(row, 'error') or 'no message'}"
    problems = []
    if _value(row, "loss_finite") is not True:
        problems.append("loss not finite" if _value(row, "loss_finite") is False else "no loss recorded")
    if _value(row, "grad_norm_finite") is False:
        problems.append("gradient norm not finite")
    if _value(row, "state_unchanged") is not True:
        problems.append(
            "state changed by replay" if _value(row, "state_unchanged") is False else "no state fingerprint recorded"
        )
    peak, ceiling = _value(row, "peak_memory_bytes"), _value(row, "device_memory_bytes")
    if _value(row, "peak_memory_measure") == "peak_allocated_bytes" and peak is not None and ceiling:
        if peak >= ceiling:
            problems.append(f"peak {format_bytes(peak)} not under the ceiling {format_bytes(ceiling)}")
        memory = f"peak allocated {format_bytes(peak)} under {format_bytes(ceiling)}"
    else:
        memory = f"process peak RSS {format_bytes(peak)}; completed without running out of memory (CPU)"
    if problems:
        return False, "; ".join(problems)
    return True, f"loss and gradients finite, state unchanged after {_value(row, 'replays')} replays, {memory}"


def _path_key(row: dict) -> tuple:
    return (
        _value(row, "family") or "unknown family",
        _value(row, "model_type") or "unknown type",
        _value(row, "model"),
        _value(row, "prompt_positions") or _value(row, "prompt_length"),
        _value(row, "device"),
        _value(row, "dtype"),
    )


def _cells(**given) -> dict:
    """V1-V4 cells ({state, reached, text}); levels not given read "not run"."""
    return {name: given.get(name, {"state": STATE[None], "reached": None, "text": STATE[None]}) for name in LEVEL_NAMES}


def _row(family, model_type, gradient_mode, scale, cells: dict, source: str) -> dict:
    reached = [name for name in LEVEL_NAMES if cells[name]["reached"]]
    return {
        "family": family or "unknown family",
        "model_type": model_type or "unknown type",
        "gradient_mode": gradient_mode,
        "scale": scale,
        "cells": cells,
        "source": source,
        "level": max(reached, key=LEVEL_NAMES.index) if reached else "none",
        "reached": bool(reached),
    }


def v1_paths(rows_by_experiment: dict[str, list[dict]]) -> list[dict]:
    """One response-only path per (model, prompt positions, device) of the replay-mode step rows,
    with its V1 from the first point that reached it (else every point's reason)."""
    tried: dict[tuple, list] = {}
    for experiment, rows in rows_by_experiment.items():
        for row in rows:
            if row.get("kind") == "step" and row.get("mode") == "replay":
                tried.setdefault(_path_key(row), []).append((f"{experiment}/{row.get('point')}", *v1_check(row)))
    paths = []
    for (family, model_type, model, positions, device, dtype), points in tried.items():
        good = [p for p in points if p[1]]
        text = f"{good[0][0]}: {good[0][2]}" if good else "; ".join(f"{name}: {why}" for name, _, why in points)
        cell = {"state": STATE[bool(good)], "reached": bool(good), "text": text}
        paths.append(
            _row(
                family,
                model_type,
                "response-only",
                scale_text(model, positions, device, dtype),
                _cells(V1=cell),
                ", ".join(name for name, _, _ in points),
            )
        )
    return sorted(paths, key=_order)


def _order(path: dict) -> tuple:
    return path["family"], path["model_type"], path["gradient_mode"], path["scale"]


# ------------------------------------------------------------------------ validation points' levels


def validation_paths(path_rows: list[dict]) -> list[dict]:
    """The validation points' paths from their `paths` table rows (the validation kind's `paths` table)."""
    return [
        _row(
            row.get("family"),
            row.get("model_type"),
            row.get("gradient_mode"),
            row.get("scale"),
            {
                name: {
                    "state": row.get(f"{name}_state"),
                    "reached": row.get(f"{name}_reached"),
                    "text": row.get(f"{name}_text"),
                    "tolerance": _value(row, f"{name}_tolerance"),
                }
                for name in LEVEL_NAMES
            },
            row.get("source"),
        )
        for row in path_rows
    ]


def all_paths(rows_by_experiment: dict[str, list[dict]], path_rows: list[dict]) -> list[dict]:
    """The validation points' paths (`path_rows`: their `paths` tables' rows), then the step
    points' V1-only paths not among them."""
    measured = validation_paths(path_rows)
    keys = {(p["model_type"], p["gradient_mode"], p["scale"]) for p in measured}
    return sorted(
        measured
        + [p for p in v1_paths(rows_by_experiment) if (p["model_type"], p["gradient_mode"], p["scale"]) not in keys],
        key=_order,
    )


def number_rules(paths: list[dict]) -> list[str]:
    """Each distinct tolerance of the paths' cells, once, in order of first use; every cell gets
    `rule`: its tolerance's 1-based number in that list, None without one (the page states the
    rules once)."""
    rules: list[str] = []
    for path in paths:
        for cell in path["cells"].values():
            tolerance = cell.get("tolerance")
            if tolerance and tolerance not in rules:
                rules.append(tolerance)
            cell["rule"] = rules.index(tolerance) + 1 if tolerance else None
    return rules


def levels_table(paths: list[dict], standing: dict) -> list[dict]:
    """The four levels: definition, where we stand, and the paper's stated standing."""
    ours = {}
    for name in LEVEL_NAMES:
        run = [p for p in paths if p["cells"][name]["reached"] is not None]
        reached = sum(1 for p in run if p["cells"][name]["reached"])
        ours[name] = f"reached on {reached} of {len(run)} paths where run (table below)" if run else NOT_RUN
    if any(p["cells"]["V3"]["reached"] is not None and p["gradient_mode"] == "response-only" for p in paths):
        ours["V3"] += "; response-only paths report their gap and are not reached by design"
    return [
        {**level, "ours": ours[level["level"]], "paper": standing.get(level["level"], "not stated")} for level in LEVELS
    ]


def paper_paths(paper: dict) -> list[dict]:
    """The paper's two paths as its material states them; any level it does not state: "not stated"."""
    return [
        {
            "family": p.get("family", "not stated"),
            "model": p.get("model", "not stated"),
            "gradient_mode": p.get("gradient_mode", "not stated"),
            "scale": p.get("scale", "not stated"),
            "highest": p.get("highest", "not stated"),
            **{name: p.get(name, "not stated") for name in LEVEL_NAMES},
        }
        for p in paper.get("paths") or []
        if isinstance(p, dict)
    ]
