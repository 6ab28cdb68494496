"""Largest prompt that fits: a search over prompt lengths, each probe one GRPO step in a fresh process.

A fresh process per probe gives a clean allocator after an OOM and a process peak RSS that
belongs to that probe alone. A probe fits when it completes and its measured step memory is
under the ceiling:
- CUDA: `peak_allocated_bytes` over all phases; the ceiling is the device itself (a real OOM)
  unless `capacity.ceiling_bytes` sets a lower one.
- CPU: process peak RSS minus RSS after building the weights (and a peer's setup), against `capacity.ceiling_bytes`
  (an emulated ceiling, stated in the result: a 24 GiB machine would not run out at CPU sizes).

Search: double from `min_length` until a probe does not fit (or `max_length`), then bisect
between the last fitting and the first failing length down to `granularity` positions. With
`time_limit_seconds`, no probe starts once that much time has passed: the result then says the
search stopped on time, and the bracket it reached is what was measured. `compare_modes` then
runs those modes' steps at the largest fitting length (the step times the baselines compare).

`responses.probe_members: k` makes each probe of a serial mode (replay, naive) score and replay
only k of its G members (`grpo_step(members=k)`): one member at a time is live, so equal-length
members reach the same peak, and a probe costs k members' time instead of G. The result states
it; `tests/test_step.py` checks that one member's live graph peak equals the full step's, and on
the H200 one naive member's peak at 32,768 positions came within 0.12% of the full G=8 step's.
CUDA only: a CPU probe's measure, process peak RSS, keeps growing over members (freed heap is not
returned), so there one member reads low (205 MiB against the full step's > 256 MiB, tiny-qwen3_5
naive at 6,144 positions).

Report: one row per point (the largest fitting length, the smallest that ran out of memory, the
probes' counts, the ceiling); tables of its own: every probe (`probes`), and the compared modes'
steps beside the searched mode's at its largest fitting length (`comparison`); a note where a
search stopped on its time limit; figures: the largest fitting prompt per mode with every probe
drawn, and the step time of each mode at that length.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from longstraw.config import ConfigError, PointConfig
from longstraw.config.point import check_mode
from longstraw.config.typed import bounded
from longstraw.kinds.spec import Kind
from longstraw.kinds.step import STEP_PHASES
from longstraw.results import (
    ExtraTable,
    as_dict,
    number,
    phase_seconds,
    point_parts,
    ratio,
    rows_of_points,
    status_of,
)


@dataclass
class CapacityConfig:
    """The largest-prompt search (`longstraw.kinds.capacity`)."""

    min_length: int = bounded(1024, min=2)
    max_length: int = bounded(1 << 20, min=2)
    granularity: int = bounded(1024, min=1)
    ceiling_bytes: int | None = bounded(None, min=1)
    time_limit_seconds: float | None = bounded(None, gt=0)
    compare_modes: list[str] = field(default_factory=list)

    def __post_init__(self):
        for mode in self.compare_modes:
            check_mode(mode, "compare_modes")
        if self.min_length > self.max_length:
            raise ValueError(f"min_length {self.min_length} exceeds max_length {self.max_length}")


if TYPE_CHECKING:
    from longstraw.kinds.common import Progress


def _probe(point: PointConfig, length: int, workdir: Path) -> dict:
    from longstraw.kinds.common import run_point_in_fresh_process

    config = dataclasses.replace(
        point,
        kind="step",
        name=f"{point.name}_probe_{length}",
        prompt=dataclasses.replace(point.prompt, length=length),
        capacity=None,  # a step holds no capacity section
    )
    return run_point_in_fresh_process(config, workdir)


def _measured_bytes(result: dict, device_type: str) -> int | None:
    metrics = result.get("metrics") or {}
    if device_type == "cuda":
        return metrics.get("peak_allocated_bytes") or result.get("peak_allocated_bytes")
    # RSS after the weights (a peer's: after its setup too, its imports and trainer), so the step's own is measured
    weights = (metrics.get("peer_setup") or metrics.get("weights") or {}).get("peak_rss_bytes")
    return result["peak_rss_bytes"] - weights if weights is not None and "peak_rss_bytes" in result else None


def run(point: PointConfig, device, progress: Progress) -> dict:
    """Run the search for a point; returns the capacity metrics with every probe."""
    settings = point.capacity
    device_type = device.type
    ceiling = settings.ceiling_bytes
    if device_type != "cuda" and ceiling is None:
        raise ValueError("capacity on CPU needs capacity.ceiling_bytes (an emulated memory ceiling)")
    if device_type != "cuda" and point.responses.probe_members is not None:
        raise ValueError(
            "responses.probe_members is for CUDA capacity searches: on CPU the measured peak RSS "
            "grows over members, so a partial step would read low"
        )
    probes: dict[int, dict] = {}
    started, limit = time.perf_counter(), settings.time_limit_seconds
    stopped_on_time = False

    def out_of_time() -> bool:
        nonlocal stopped_on_time
        stopped_on_time = limit is not None and time.perf_counter() - started > limit
        return stopped_on_time

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)

        def fits(length: int) -> bool:
            probes[length] = _probe_record(point, length, workdir, device_type, progress)
            return probes[length]["status"] == "ok"

        low, high = _search(settings, fits, out_of_time)
        comparison = _compare_modes(point, low, workdir, device_type, progress) if low is not None else {}
    return {
        "mode": point.mode,
        "comparison_at_largest_fitting": comparison,
        "ceiling_bytes": ceiling,
        "memory_measure": "peak_allocated_bytes"
        if device_type == "cuda"
        else "process peak RSS minus RSS after weights (emulated CPU ceiling)",
        "probe_members": point.responses.probe_members,
        "probes": [probes[k] for k in sorted(probes)],
        "largest_fitting": low,
        "first_failing": high,
        "search_capped_at_max_length": high is None and not stopped_on_time,
        "search_stopped_on_time_limit": stopped_on_time,
    }


def _probe_record(point: PointConfig, length: int, workdir: Path, device_type: str, progress: Progress) -> dict:
    """One probe's record: a step at `length` in a fresh process, and whether it fitted under the ceiling."""
    ceiling = point.capacity.ceiling_bytes
    result = _probe(point, length, workdir)
    peak = _measured_bytes(result, device_type)
    status = result["status"]
    if status == "ok" and ceiling is not None and peak is not None and peak > ceiling:
        status = "oom"
    if status == "error":
        raise RuntimeError(f"probe at {length} positions failed: {result.get('error')}")
    progress.line(
        f"capacity {point.mode}: {length:,} positions -> {status}" + (f" ({peak / 2**20:,.1f} MiB)" if peak else "")
    )
    return {
        "prompt_length": length,
        "status": status,
        "peak_bytes": peak,
        "seconds": result.get("wall_seconds"),
        "step_phases": (result.get("metrics") or {}).get("phase_summary"),
    }


def _search(settings: CapacityConfig, fits, out_of_time) -> tuple[int | None, int | None]:
    """(largest fitting, first failing) length: doubling from `min_length`, then bisecting to `granularity`."""
    low, high, length = None, None, settings.min_length
    while length <= settings.max_length and not out_of_time():
        if fits(length):
            low, length = length, length * 2
        else:
            high = length
            break
    if low is not None and high is not None:
        while high - low > settings.granularity and not out_of_time():
            middle = (low + high) // 2 // settings.granularity * settings.granularity
            if middle in (low, high):
                break
            low, high = (middle, high) if fits(middle) else (low, middle)
    return low, high


def _compare_modes(point: PointConfig, low: int, workdir: Path, device_type: str, progress: Progress) -> dict:
    """The other modes' whole steps at the largest length this mode fitted (step time beside it)."""
    comparison = {}
    for mode in point.capacity.compare_modes:
        full_step = dataclasses.replace(
            point,
            mode=mode,
            name=f"{point.name}_{mode}",
            responses=dataclasses.replace(point.responses, probe_members=None),
        )
        result = _probe(full_step, low, workdir)
        comparison[mode] = {
            "prompt_length": low,
            "status": result["status"],
            "peak_bytes": _measured_bytes(result, device_type),
            "seconds": result.get("wall_seconds"),
            "error": result.get("error"),
            "step_phases": (result.get("metrics") or {}).get("phase_summary"),
        }
        progress.line(f"comparison {mode} at {low:,} positions -> {result['status']}")
    return comparison


# ------------------------------------------------------------------------------------------- report

# The search's answer and the ceiling it ran against; every column is in the CSV, the phase seconds
# of the compared steps in their figure.
SHOWN = [
    "model",
    "mode",
    "ceiling_bytes",
    "device_memory_bytes",
    "memory_measure",
    "largest_fitting",
    "largest_fitting_peak_bytes",
    "first_failing",
    "probes",
    "probes_oom",
    "search_stopped_on_time_limit",
    "wall_seconds",
]
COMPARISON_COLUMNS = [
    "point",
    "mode",
    "measured_as",
    "prompt_length",
    "status",
    "peak_bytes",
    "step_seconds",
    "speedup_vs_searched_mode",
    "wall_seconds",
    "error",
    "report_error",
]
PROBE_COLUMNS = ["point", "mode", "prompt_length", "status", "peak_bytes", "seconds"]
EXTRA_TABLES = {
    "comparison": ExtraTable(
        "Step time at the largest fitting length",
        COMPARISON_COLUMNS,
        "The searched mode's step at its largest fitting prompt (its search probe there) beside the compared "
        "modes' steps at the same length. Step seconds: the sum of the step's phase seconds (replay and hold_all "
        "include their capture; naive has none); wall seconds: the probe's whole process, model load included. "
        "speedup_vs_searched_mode: the searched mode's step seconds over this row's.",
        key="comparison",
    ),
    "probes": ExtraTable("Capacity probes", PROBE_COLUMNS, key="probes"),
}
CAPTIONS = {
    "capacity": "Largest prompt that fits under the search's ceiling per mode (bar); every probed prompt length "
    "drawn (o fits, x out of memory). The title states the ceiling and why it is that one: the "
    "configured one (on CPU an emulated one), else the device's memory.",
    "capacity_step_time": "One step of each mode at the searched mode's largest fitting prompt: seconds per phase "
    "(the searched mode's from its search probe, the others from their comparison steps; "
    "process start and model load left out).",
}


def _probes(metrics) -> list[dict]:
    return [p for p in metrics.get("probes") or [] if isinstance(p, dict)]


def columns(point: dict) -> dict:
    cfg, metrics = point_parts(point)
    probes = _probes(metrics)
    fitting, oom = ([p for p in probes if p.get("status") == s] for s in ("ok", "oom"))
    largest = metrics.get("largest_fitting")
    at_largest = next((p for p in fitting if p.get("prompt_length") == largest), {})
    oom_lengths = [p["prompt_length"] for p in oom if number(p.get("prompt_length")) is not None]
    responses = as_dict(cfg.get("responses"))
    return {
        "mode": metrics.get("mode", cfg.get("mode")),
        "G": as_dict(cfg.get("grpo")).get("num_generations"),
        "response_length": responses.get("length"),
        "ceiling_bytes": number(metrics.get("ceiling_bytes")),
        "memory_measure": metrics.get("memory_measure"),
        "largest_fitting": largest,
        "largest_fitting_peak_bytes": number(at_largest.get("peak_bytes")),
        "largest_fitting_seconds": number(at_largest.get("seconds")),
        "smallest_oom": min(oom_lengths) if oom_lengths else None,
        "probes": len(probes),
        "probes_ok": len(fitting),
        "probes_oom": len(oom),
        "peak_memory_bytes": number(at_largest.get("peak_bytes")),
        "peak_memory_measure": metrics.get("memory_measure"),
        "search_stopped_on_time_limit": metrics.get("search_stopped_on_time_limit"),
        "time_limit_seconds": number(as_dict(cfg.get("capacity")).get("time_limit_seconds")),
    }


def probe_rows(point: dict) -> list[dict]:
    """One row per prompt length the search tried."""
    cfg, metrics = point_parts(point)
    return [
        {
            "point": point.get("point"),
            "mode": metrics.get("mode", cfg.get("mode")),
            "prompt_length": probe.get("prompt_length"),
            "status": probe.get("status"),
            "peak_bytes": number(probe.get("peak_bytes")),
            "seconds": number(probe.get("seconds")),
            "memory_measure": metrics.get("memory_measure"),
            "ceiling_bytes": number(metrics.get("ceiling_bytes")),
        }
        for probe in _probes(metrics)
    ]


def comparison_rows(point: dict) -> list[dict]:
    """The searched mode's step at its largest fitting length (its search probe there) and each
    compared mode's step at that same length, with step seconds side by side; empty without a
    comparison. `speedup_vs_searched_mode`: the searched mode's step seconds over this row's."""
    cfg, metrics = point_parts(point)
    compared = as_dict(metrics.get("comparison_at_largest_fitting"))
    if not compared:
        return []
    largest = metrics.get("largest_fitting")
    probe = next((p for p in _probes(metrics) if p.get("prompt_length") == largest and p.get("status") == "ok"), {})
    entries = [(metrics.get("mode", cfg.get("mode")), "search probe", probe)]
    entries += [(mode, "comparison step", as_dict(record)) for mode, record in compared.items()]
    rows = []
    for mode, measured_as, record in entries:
        phases = as_dict(record.get("step_phases"))
        row = {
            "point": point.get("point"),
            "mode": mode,
            "measured_as": measured_as,
            "prompt_length": record.get("prompt_length", largest),
            "status": status_of(record.get("status")),
            "error": record.get("error") or (None if record else "no ok probe at the largest fitting length"),
            "peak_bytes": number(record.get("peak_bytes")),
            "step_seconds": phase_seconds(phases),
            "wall_seconds": number(record.get("seconds")),
        }
        for name in list(STEP_PHASES) + sorted(set(phases) - set(STEP_PHASES)):
            row[f"{name}_seconds"] = number(as_dict(phases.get(name)).get("seconds"))
        rows.append(row)
    for row in rows:
        row["speedup_vs_searched_mode"] = ratio(rows[0]["step_seconds"], row["step_seconds"])
    return rows


def tables(points: list[dict]) -> dict[str, list[dict]]:
    return {"comparison": rows_of_points(points, comparison_rows), "probes": rows_of_points(points, probe_rows)}


def notes(row: dict, grid) -> list[str]:
    """A search cut off by its time limit: its largest fitting length is how far it got."""
    if not row.get("search_stopped_on_time_limit"):
        return []
    from longstraw.plotting.formatting import format_value

    limit = (
        f" ({format_value('time_limit_seconds', row['time_limit_seconds'])})"
        if row.get("time_limit_seconds") is not None
        else ""
    )
    ran_out = "none ran out of memory" if not row.get("probes_oom") else f"{row['probes_oom']} ran out of memory"
    return [
        f"{row.get('point')} ({row.get('mode')}): the search stopped on its time limit{limit}; of the "
        f"probes it ran ({row.get('probes')}), {ran_out}, so its largest fitting length, "
        f"{format_value('largest_fitting', row.get('largest_fitting'))} positions, is how far it got, "
        "not where memory runs out." + _probe_members_note(row)
    ]


def _probe_members_note(row: dict) -> str:
    from longstraw.plotting.formatting import is_missing

    members = row.get("responses.probe_members")
    if is_missing(members):
        return ""
    return (
        f" Each probe replayed {int(members)} of the G members (a serial mode's peak is one member's; the "
        "targets below take out-of-memory step points of the same mode as the upper end of its bracket)."
    )


def figures(data, ceiling: dict, marks=()):
    capacity = data.of_kind("capacity")
    if capacity:
        yield "capacity", plot_capacity(capacity, data.extra.get("probes", []), data.name)
    if data.extra.get("comparison"):
        yield "capacity_step_time", plot_capacity_step_time(data.extra["comparison"], data.name)


def _stated_ceilings(rows) -> str:
    """The ceiling each search ran against, its measure, and why that one (no configured ceiling on
    CUDA: the device itself, a real OOM)."""
    from longstraw.plotting.ceiling import search_ceiling_reason
    from longstraw.plotting.formatting import format_bytes

    stated = {}
    for row in rows:
        configured = bool(row.get("ceiling_bytes"))
        value = row.get("ceiling_bytes") if configured else row.get("device_memory_bytes")
        if value:
            cuda = str(row.get("memory_measure")).startswith("peak_allocated")
            stated.setdefault(
                f"{format_bytes(value)} on {row.get('memory_measure')}: {search_ceiling_reason(configured, cuda)}", None
            )
    return "; ".join(sorted(stated)) or "not recorded"


def plot_capacity(rows, probes: list[dict], title: str):
    import textwrap

    from longstraw.plotting import draw

    width = max(8, 1.6 * len(rows) + 5)  # 2 inches of it: the legend beside the axes
    fig, ax = draw.plt.subplots(figsize=(width, 4.8))
    labels = [str(r.get("mode") or r.get("point")) for r in rows]
    if len(set(labels)) < len(labels):  # two points of one mode: name them
        labels = [f"{label}\n{r.get('point')}" for label, r in zip(labels, rows)]
    for i, row in enumerate(rows):
        _draw_largest(ax, i, row)
        mine = [p for p in probes if p.get("point") == row.get("point") and p.get("prompt_length")]
        for status, marker, color in (("ok", "o", "#2ca02c"), ("oom", "x", draw.FAILED_COLORS["oom"])):
            lengths = [p["prompt_length"] for p in mine if p.get("status") == status]
            ax.plot(
                [i] * len(lengths),
                lengths,
                linestyle="none",
                marker=marker,
                color=color,
                markersize=7,
                label=f"probe {status}" if i == 0 else None,
            )
    ax.set_yscale("log", base=2)
    ax.margins(y=0.15)  # room above the tallest bar for its label
    ax.set_xticks(range(len(rows)), labels)
    draw.bar_slots(ax, len(rows))
    ax.set_ylabel("prompt length (positions, log2)")
    ax.set_title(
        f"{title}: largest prompt that fits per mode\n"
        + textwrap.fill(f"ceiling {_stated_ceilings(rows)}", int(width * 10)),
        fontsize=9,
    )
    if ax.get_legend_handles_labels()[0]:
        draw.legend_outside(ax)
    return fig


def _draw_largest(ax, i: int, row: dict) -> None:
    """A search's largest fitting length as a bar at slot `i`, or why it has none."""
    from longstraw.plotting import draw

    largest = row.get("largest_fitting")
    if row.get("status") != "ok":
        draw.mark_failed(ax, i, row, value_key=None)
    elif largest:
        ax.bar([i], [largest], color=draw.MODE_COLORS.get(str(row.get("mode")), "#4c72b0"), alpha=0.6, width=0.6)
        # a search cut off by its time limit reached this length; the memory limit lies beyond it
        stopped = "\nsearch stopped on its time limit" if row.get("search_stopped_on_time_limit") else ""
        ax.annotate(
            f"{int(largest):,}{stopped}",
            (i, largest),
            textcoords="offset points",
            xytext=(0, 3),
            ha="center",
            fontsize=8,
        )
    else:
        transform = draw.blended_transform_factory(ax.transData, ax.transAxes)
        ax.text(
            i,
            0.05,
            "no probed length fits",
            transform=transform,
            ha="center",
            fontsize=8,
            rotation=90,
            va="bottom",
            color=draw.FAILED_COLORS["oom"],
        )


def plot_capacity_step_time(rows, title: str):
    """Stacked phase seconds per mode at one prompt length (the capacity comparison rows)."""
    from longstraw.plotting import draw

    phases = [p for p in STEP_PHASES if any(r.get(f"{p}_seconds") is not None for r in rows)]
    fig, ax = draw.plt.subplots(figsize=(max(8, 1.6 * len(rows) + 5), 4.8))  # 2 inches of it: the legend
    base = [0.0] * len(rows)
    for phase in phases:
        heights = [(r.get(f"{phase}_seconds") or 0.0) if r.get("status") == "ok" else 0.0 for r in rows]
        ax.bar(range(len(rows)), heights, bottom=base, label=phase, color=draw.PHASE_COLORS.get(phase), width=0.6)
        base = [b + h for b, h in zip(base, heights)]
    for i, row in enumerate(rows):
        if row.get("status") != "ok":
            draw.mark_failed(ax, i, row, value_key=None)
        elif row.get("step_seconds") is not None:
            ax.annotate(
                f"{row['step_seconds']:,.1f} s",
                (i, base[i]),
                textcoords="offset points",
                xytext=(0, 3),
                ha="center",
                fontsize=8,
            )
    ax.set_xticks(range(len(rows)), [f"{r.get('mode')}\n({r.get('measured_as')})" for r in rows], fontsize=8)
    draw.bar_slots(ax, len(rows))
    ax.margins(y=0.08)  # room above the tallest stack for its total
    lengths = sorted({r["prompt_length"] for r in rows if r.get("prompt_length") is not None})
    ax.set_ylabel("seconds (s), sum of phases")
    ax.set_title(f"{title}: one step per mode at {', '.join(f'{n:,}' for n in lengths)} positions", fontsize=10)
    if phases:
        draw.legend_outside(ax)
    return fig


def check_settings(cfg: PointConfig, source: str) -> None:
    """On CPU: an emulated ceiling, and whole steps (a partial step's peak RSS would read low)."""
    if cfg.model.device.startswith("cuda"):
        return
    if cfg.capacity.ceiling_bytes is None:
        raise ConfigError(
            f"{source}: capacity.ceiling_bytes: a capacity search on CPU needs an emulated memory "
            "ceiling (bytes of peak RSS above the weights)"
        )
    if cfg.responses.probe_members is not None:
        raise ConfigError(
            f"{source}: responses.probe_members: for CUDA capacity searches; on CPU the measured "
            "peak RSS grows over members, so a partial step would read low"
        )


def longest_runs(cfg: PointConfig) -> list[tuple[str, int, str | None, int]]:
    """Its probes are steps at lengths up to max_length, which bounds the search (a search may set it to the
    model's limit): the bound within the limit, and the first probe's response after its prompt."""
    c = cfg.capacity
    return [
        ("capacity.max_length", c.max_length, None, 0),
        ("capacity.min_length", c.min_length, "responses.length", cfg.responses.length),
    ]


KIND = Kind(
    "capacity",
    run=run,
    section=CapacityConfig,
    check_settings=check_settings,
    modes=lambda cfg: [cfg.mode, *cfg.capacity.compare_modes],
    longest_runs=longest_runs,
    shards_state=False,
    columns=columns,
    tables=tables,
    extra_tables=EXTRA_TABLES,
    shown=SHOWN,
    notes=notes,
    figures=figures,
    captions=CAPTIONS,
)
