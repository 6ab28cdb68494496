"""Kind `length_curve`: where a task-trained model (`model.path`) breaks with prompt length: greedy
success per (prompt length, needle depth) on held-out examples, each captured and decoded from its
resident state (`longstraw.training.length_curve`). It tells the length at which GRPO has
something to improve (success low but not zero). With `length_curve.adapter` (a LoRA adapter a GRPO run
trained) it is a held-out evaluation: the curve with the adapter and, on the same examples, without it (the
base policy), so what the training changed is read against length.

Report: one row per point (the lengths, the task's chance, the longest length still above chance
by 3 standard errors); one row per cell in a table of its own; figure: success against prompt
length (log axis), one line per depth, with standard-error bars and the chance level."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from numbers import Real
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from longstraw.config import PointConfig
from longstraw.config.typed import bounded
from longstraw.kinds.checks import check_task
from longstraw.kinds.spec import Kind
from longstraw.results import ExtraTable, as_dict, number, point_parts, rows_of_points
from longstraw.training.depths import check_depths, depth_label


@dataclass
class LengthCurveConfig:
    """Where a task-trained model (`model.path`) breaks with prompt length (`longstraw.training.length_curve`)."""

    task: dict = field(default_factory=lambda: {"name": "kv_retrieval", "num_needles": 4, "value_length": 2})
    lengths: list[int] = field(default_factory=lambda: [256, 1024, 4096])
    # the queried needle's depth per cell: a fraction, or a band [lo, hi] each example draws its own depth from
    # (`training/depths.py`; RULER's niah puts every example of one fixed depth in the same place); None: random
    depths: list[float | list[float]] | None = None
    examples: int = bounded(32, min=2)  # held-out examples per (length, depth) cell
    method: Literal["capture", "forward"] = "capture"
    # a trained LoRA adapter (a peft folder: a trainer checkpoint's `adapter/`): the curve of the model with it and,
    # beside it on the same held-out examples, of the model without it (the base policy)
    adapter: str | None = None

    def __post_init__(self):
        if not self.lengths or min(self.lengths) < 2:
            raise ValueError(f"lengths: a non-empty list of prompt lengths >= 2, got {self.lengths}")
        check_depths(self.depths)


def check(cfg: PointConfig, source: str) -> None:
    check_task(cfg.length_curve.task, cfg.prompt.length, f"{source}: length_curve.task")
    if cfg.length_curve.adapter is not None:  # its folder: `harness/inputs.py`, as every loaded adapter's
        if cfg.model.lora is not None:
            raise ValueError(
                f"{source}: length_curve.adapter: the model also asks for a new LoRA adapter (model.lora); "
                "evaluate a trained adapter on the plain model (drop model.lora)"
            )


if TYPE_CHECKING:
    from longstraw.kinds.common import Progress


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    from longstraw.measure.memory import PhaseRecorder
    from longstraw.models.checks import ADAPTER_WEIGHTS
    from longstraw.models.lora import load_adapter
    from longstraw.models.policy import build_policy
    from longstraw.training.length_curve import length_curve
    from longstraw.wheels import sha256_of

    recorder = PhaseRecorder(device)
    s = cfg.length_curve
    # the record names the adapter's weights by their hash, not only by a folder a later run may fill again
    trained = None if s.adapter is None else {"path": s.adapter, "sha256": sha256_of(Path(s.adapter) / ADAPTER_WEIGHTS)}
    with recorder.phase("weights"):
        model = build_policy(cfg.model)
        if s.adapter is not None:
            model = load_adapter(model, s.adapter)

    def curve(key: str, done: dict):
        return length_curve(
            model,
            s.task,
            s.lengths,
            s.depths,
            s.examples,
            method=s.method,
            chunk_size=cfg.capture.chunk_size,
            beyond_max_positions=cfg.capture.beyond_max_positions,
            on_row=lambda rows: progress.partial({**done, key: rows, "task": dict(s.task)}),
        )

    with recorder.phase("length_curve"):
        result = curve("rows", {})
    if s.adapter is not None:
        with recorder.phase("length_curve_base"), model.disable_adapter():
            result["base_rows"] = curve("base_rows", {"rows": result["rows"]})["rows"]
    return {**result, "phases": recorder.phases, **({"adapter": trained} if trained else {})}


def above_chance(rows: list[dict], chance) -> int | None:
    """The longest length whose pooled success (over its depths) exceeds chance by 3 standard errors."""
    found = None
    for length in sorted({r["length"] for r in rows}):
        cells = [r for r in rows if r["length"] == length]
        n = sum(r["n"] for r in cells)
        p = sum(r["success"] * r["n"] for r in cells) / n
        if chance is not None and p > chance + 3 * math.sqrt(max(p * (1 - p), 1e-12) / n):
            found = length
    return found


# ------------------------------------------------------------------------------------------- report

SHOWN = [
    "model",
    "adapter",
    "lengths",
    "depths",
    "examples",
    "chance",
    "longest_above_chance",
    "longest_above_chance_base",
    "seconds",
    "wall_seconds",
]
EXTRA_TABLES = {
    "cells": ExtraTable(
        "Greedy success by prompt length and needle depth",
        ["point", "policy", "length", "depth", "success", "stderr", "n", "seconds"],
        "Held-out examples, each captured and decoded greedily from its resident state; stderr = sqrt(p (1 - p) / n). "
        "policy: the model, the model with a trained adapter, or the base (the same model without it). "
        "A band's examples draw their depths from their seeds: example s sits at the same share of every band, "
        "with the same key and value, so bands are paired over one set of examples, not independent draws.",
    )
}
CAPTIONS = {
    "length_curve": "Greedy success against prompt length (log axis), one line per needle depth, "
    "standard-error bars; a trained adapter's point draws its base policy dashed in grey; dotted: the task's "
    "chance level."
}


def columns(point: dict) -> dict:
    cfg, metrics = point_parts(point)
    settings, rows = as_dict(cfg.get("length_curve")), metrics.get("rows") or []
    chance = number(as_dict(metrics.get("chance")).get("value"))
    base = metrics.get("base_rows") or []
    return {
        "adapter": settings.get("adapter"),
        "lengths": " ".join(str(n) for n in settings.get("lengths") or []) or None,
        "depths": " ".join(str(depth_label(d)) for d in settings.get("depths") or []) or "random",
        "examples": settings.get("examples"),
        "chance": chance,
        "longest_above_chance": above_chance(rows, chance) if rows else None,
        "longest_above_chance_base": above_chance(base, chance) if base else None,
        "seconds": number(metrics.get("seconds")),
    }


def tables(points: list[dict]) -> dict:
    def cells(point):
        config, metrics = point_parts(point)
        policy = "adapter" if as_dict(config.get("length_curve")).get("adapter") else "model"
        return [
            {
                "point": point.get("point"),
                "policy": name,
                **{k: r.get(k) for k in ("length", "success", "stderr", "n", "seconds")},
                "depth": depth_label(r.get("depth")),
            }
            for name, rows in ((policy, metrics.get("rows")), ("base", metrics.get("base_rows")))
            for r in rows or []
        ]

    return {"cells": rows_of_points([p for p in points if p.get("kind") == "length_curve"], cells)}


def figures(data, ceiling: dict, marks=()):
    rows = [r for r in data.of_kind("length_curve") if r.get("status") == "ok"]
    if rows and data.extra.get("cells"):
        yield "length_curve", plot_length_curve(rows, data.extra["cells"], data.name)


def _depth_order(depth) -> tuple:
    """Cells' depths in order: numbers and bands (`lo-hi`) by where they start, random last."""
    if depth is None or (isinstance(depth, float) and math.isnan(depth)):
        return (1, 0.0)
    return (0, float(depth) if isinstance(depth, Real) else float(re.match(r"[\d.]+(e[-+]?\d+)?", str(depth))[0]))


def plot_length_curve(rows, cells, title: str):
    from longstraw.plotting import draw

    styles = ["-", "--", ":", "-."]
    fig, ax = draw.plt.subplots(figsize=(8, 4.8))
    chances = set()
    for i, row in enumerate(rows):
        mine = [c for c in cells if c.get("point") == row.get("point")]
        depths = sorted({c.get("depth") for c in mine}, key=_depth_order)
        for policy in sorted({c.get("policy") for c in mine}, key=lambda p: p == "base"):
            base = policy == "base"
            for j, depth in enumerate(depths):
                at = [c for c in mine if c.get("depth") == depth and c.get("policy") == policy]
                at = sorted(at, key=lambda c: c["length"])
                shift = 1.04 ** (j - (len(depths) - 1) / 2)  # depths side by side on the log axis, not on top
                name = f"{row.get('point')}{' (base)' if base else ''}"
                ax.errorbar(
                    [c["length"] * shift for c in at],
                    [c["success"] for c in at],
                    yerr=[c["stderr"] for c in at],
                    marker="os^Dv"[j % 5],
                    capsize=3,
                    linestyle="--" if base else styles[j % len(styles)],
                    color="#9a9a9a" if base else draw.POINT_COLORS[i % len(draw.POINT_COLORS)],
                    label=f"{name}: depth {'random' if depth is None else depth}",
                )
        if row.get("chance") is not None and row["chance"] not in chances:
            chances.add(row["chance"])
            ax.axhline(row["chance"], color="#8c8c8c", linestyle=":", label=f"chance {row['chance']:.2f}")
    ax.set(
        xscale="log",
        xlabel="prompt length (positions)",
        ylabel="greedy success",
        ylim=(-0.02, 1.02),
        title=f"{title}: where the model breaks with prompt length",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


KIND = Kind(
    "length_curve",
    run=run,
    section=LengthCurveConfig,
    check=check,
    longest_runs=lambda cfg: [("length_curve.lengths", max(cfg.length_curve.lengths), None, 0)],  # greedy answers
    tasks=lambda cfg: [
        ("length_curve.task", cfg.length_curve.task, list(cfg.length_curve.lengths), "length_curve.lengths")
    ],
    adapters_in=lambda cfg: [("length_curve.adapter", cfg.length_curve.adapter)] if cfg.length_curve.adapter else [],
    host_pages=False,
    columns=columns,
    tables=tables,
    extra_tables=EXTRA_TABLES,
    shown=SHOWN,
    figures=figures,
    captions=CAPTIONS,
)
