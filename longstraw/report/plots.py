"""Figures (PNG, matplotlib Agg) from the aggregated tables: what a reader would rather look at
than read. Which figures an experiment gets follows from its data, not its name, so a later
experiment with step / capture / capacity points gets the same figures:

- step points: per-phase peak memory against the ceiling; peak memory against G per mode (when
  G varies); time per replayed member; seconds per phase.
- capture points: resident bytes per position, measured against predicted, per model type; capture
  throughput.
- capacity points: the largest prompt that fits per mode, every probe drawn (oom probes as x); with
  comparison steps, the step time of each mode at the searched mode's largest fitting length.
- sweep points (one capture serving steps at several (mode, G)): per-phase peaks of every step
  against the ceiling, with the capture; peak against G per mode when G varies within a mode;
  the paper's peak-memory figures drawn beside ours (`paper.reference_marks`). A sweep's capture
  joins the capture figures where there is more than one capture to compare.
- staleness points (the fresh-prefix oracle): drift per step (relative loss drift in % on a log
  scale with the threshold and the paper's stated band, mean |delta log p|, KL k3, 1 - gradient
  cosine), the parameter drift per step (the trainer's adaptive refresh signal) and the loss drift
  against it, one line per point.

oom and error points are drawn as red / orange markers with a label, never dropped silently.
Memory is `peak_allocated_bytes` on CUDA and the process peak RSS plus autograd graph bytes on
CPU; each plot says which, and where its ceiling comes from.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from longstraw.report.aggregate import (STEP_PHASES, comparison_tables, probe_tables, records,  # noqa: E402
                                        staleness_step_tables, sweep_step_tables, tables)
from longstraw.report.ceiling import memory_ceiling  # noqa: E402
from longstraw.results import atomic_path  # noqa: E402
from longstraw.report.formatting import format_bytes, format_percent  # noqa: E402

PHASE_COLORS = {"weights": "#937860", "capture": "#4c72b0", "old_scoring": "#8c8c8c", "ref_scoring": "#bcbcbc",
                "replay": "#dd8452", "optimizer_step": "#55a868"}
MODE_COLORS = {"replay": "#dd8452", "hold_all": "#4c72b0", "naive": "#c44e52"}
LINE_STYLES = ("-", "--", ":", "-.")  # one per model where a figure's lines span several
PAPER_COLOR = "#8172b3"
FAILED_COLORS = {"oom": "#d62728", "error": "#ff7f0e"}
SHORT_KEYS = {"responses.count": "G", "prompt.length": "L", "model.preset": "", "responses.length": "R"}
POINT_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd")

CAPTIONS = {
    "memory_vs_ceiling": "Per-phase peak memory of each point against the memory ceiling (top), and the autograd "
                         "graph peak beside the resident state, measured and predicted (bottom).",
    "g_sweep_memory": "Peak memory against the group size G, one line per mode: replay should stay flat in G, "
                      "hold_all grows with G.",
    "time_per_member": "Seconds per replayed response (replay phase seconds / replays).",
    "phase_seconds": "Where a point's time goes: seconds per phase, summed over its cycles.",
    "resident_per_position": "Resident state bytes per prompt position, measured (state.nbytes) against the "
                             "analytical prediction from the config, per model type.",
    "capture_throughput": "Capture throughput (positions per second) per model type.",
    "capacity": "Largest prompt that fits under the ceiling per mode (bar); every probed prompt length drawn "
                "(o fits, x out of memory).",
    "capacity_step_time": "One step of each mode at the searched mode's largest fitting prompt: seconds per phase "
                          "(the searched mode's from its search probe, the others from their comparison steps; "
                          "process start and model load left out).",
    "sweep_memory": "Peak allocated memory of each sweep step against G, one line per mode (the OOM step drawn at "
                    "the peak it reached), with the device ceiling and the paper's per-rank figures beside ours.",
    "step_phase_peaks": "Per-phase peak memory of one sweep point: its weights and its one capture, then each step "
                        "it served, against the device ceiling (top); seconds per replayed member per step (bottom).",
    "drift_per_step": "The fresh-prefix oracle, one line per point: at every step the reused (stale) prompt state is "
                      "compared with a fresh capture under the current parameters on the same responses. Top: "
                      "relative loss drift |L_stale - L_fresh| / L_fresh in % (log scale) with the refresh threshold "
                      "and the paper's stated band (its 1M-position oracle: ~0.04-0.12% at steps 1-2; for later "
                      "steps the paper gives no figure, so none is drawn); mean |delta log p| per response token; "
                      "KL k3 (stale || fresh). Bottom: 1 - cosine of the stale and fresh gradients; the parameter "
                      "drift since the capture (the trainer's adaptive refresh signal); and the loss drift against "
                      "that signal, each marker labelled with its step. Step 0 is the capture itself (drift exactly "
                      "zero by construction) and is not drawn on the log scales.",
}


# ---------------------------------------------------------------------------------------- helpers

def _unit(values) -> tuple[float, str]:
    top = max([abs(float(v)) for v in values if v is not None] or [0.0])
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= scale:
            return float(scale), name
    return 1.0, "B"


def point_label(row: dict, grid: list[str]) -> str:
    parts = []
    for key in grid:
        value = row.get(key)
        if value is None:
            continue
        short = SHORT_KEYS.get(key, key.rsplit(".", 1)[-1])
        parts.append(f"{short}={value}" if short else str(value))
    return " ".join(parts) if parts else str(row.get("point"))


def _ok(rows):
    return [r for r in rows if r.get("status") == "ok"]


def _failed(rows):
    return [r for r in rows if r.get("status") != "ok"]


def _mark_failed(ax, x, row, scale=1.0, value_key="peak_memory_bytes"):
    """A red/orange marker with the status: at the recorded peak when there is one, else on the axis."""
    status = row.get("status") or "error"
    color = FAILED_COLORS.get(status, FAILED_COLORS["error"])
    value = row.get(value_key)
    if value is not None and status == "oom":
        ax.plot([x], [value / scale], marker="X", color=color, markersize=11, linestyle="none", zorder=5)
        ax.annotate(status.upper(), (x, value / scale), textcoords="offset points", xytext=(6, 6), color=color,
                    fontsize=8, fontweight="bold")
    else:
        transform = blended_transform_factory(ax.transData, ax.transAxes)
        ax.plot([x], [0.04], marker="X", color=color, markersize=11, transform=transform, clip_on=False, zorder=5)
        ax.text(x, 0.1, status.upper(), transform=transform, color=color, fontsize=8, fontweight="bold",
                ha="center", rotation=90, va="bottom")

def _mark_failed_bars(ax, rows):
    """Bar charts: every point that did not complete gets its status marker on the axis."""
    for i, row in enumerate(rows):
        if row.get("status") != "ok":
            _mark_failed(ax, i, row, value_key="__none__")



def _ceiling_line(ax, ceiling: dict, scale: float, values) -> str:
    """Draw the ceiling where it is in the plot's range; otherwise say it in words."""
    if not ceiling or not ceiling.get("bytes"):
        return "no ceiling known"
    top = max([v for v in values if v is not None] or [0])
    if top and ceiling["bytes"] / top > 25 and ax.get_yscale() != "log":
        return f"ceiling off scale: {ceiling['label']}"
    ax.axhline(ceiling["bytes"] / scale, color="black", linestyle="--", linewidth=1.2,
               label=f"ceiling: {ceiling['label']}")
    return ceiling["label"]


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path


def _bar_positions(n: int, k: int, width: float = 0.8):
    step = width / max(k, 1)
    return [[i - width / 2 + step * (j + 0.5) for i in range(n)] for j in range(k)], step


# ------------------------------------------------------------------------------------ step figures

def plot_memory_vs_ceiling(rows, grid, ceiling, cuda: bool, title: str):
    measure = "peak_allocated_bytes" if cuda else "peak_rss_bytes"
    phases = [p for p in STEP_PHASES if any(r.get(f"{p}_{measure}") is not None for r in rows)]
    labels = [point_label(r, grid) for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(min(18, 5 + 0.75 * len(rows) * max(1, len(phases)) / 3), 8.5))
    peaks = [r.get(f"{p}_{measure}") for r in rows for p in phases] + [r.get("peak_memory_bytes") for r in rows]
    ok_peaks = [r.get(f"{p}_{measure}") for r in _ok(rows) for p in phases] + [r.get("peak_memory_bytes")
                                                                               for r in _ok(rows)]
    # A ceiling far above every bar: log scale, so both the bars and the ceiling stay readable.
    log = bool(ceiling.get("bytes")) and max([v for v in ok_peaks if v] or [1]) * 25 < ceiling["bytes"]
    scale, unit = _unit(peaks + [ceiling.get("bytes")] if not log else peaks)
    xs, width = _bar_positions(len(rows), len(phases))
    for j, phase in enumerate(phases):
        heights = [(r.get(f"{phase}_{measure}") or 0) / scale if r.get("status") == "ok" else 0 for r in rows]
        top.bar(xs[j], heights, width, label=phase, color=PHASE_COLORS.get(phase))
    if log:
        top.set_yscale("log")
    stated = _ceiling_line(top, ceiling, scale, peaks)
    for i, row in enumerate(rows):
        if row.get("status") != "ok":
            _mark_failed(top, i, row, scale)
    what = "peak allocated (torch.cuda.max_memory_allocated per phase)" if cuda else \
        "process peak RSS up to the end of each phase (CPU; monotone over a run)"
    top.set_ylabel(f"{unit}" + (" (log scale)" if log else ""))
    top.set_title(f"{title}: {what}\nceiling: {stated}", fontsize=9)
    top.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    top.legend(fontsize=7, loc="best", ncols=3)

    series = [("graph_bytes_peak", "autograd graph peak", "#dd8452"), ("resident_bytes", "resident state (measured)",
                                                                        "#4c72b0")]
    values = [r.get(k) for r in rows for k, _, _ in series] + [r.get("predicted_resident_bytes") for r in rows]
    scale2, unit2 = _unit(values)
    xs2, width2 = _bar_positions(len(rows), len(series))
    for j, (key, name, color) in enumerate(series):
        bottom.bar(xs2[j], [(r.get(key) or 0) / scale2 if r.get("status") == "ok" else 0 for r in rows], width2,
                   label=name, color=color)
    predicted = [(i, r["predicted_resident_bytes"] / scale2) for i, r in enumerate(rows)
                 if r.get("status") == "ok" and r.get("predicted_resident_bytes") is not None]
    if predicted:
        bottom.plot([xs2[1][i] for i, _ in predicted], [v for _, v in predicted], linestyle="none", marker="_",
                    markersize=18, markeredgewidth=2.5, color="black", label="resident state (predicted)")
    positive = [v for v in values if v]
    if positive and max(positive) / min(positive) > 50:
        bottom.set_yscale("log")
        unit2 += " (log scale)"
    for i, row in enumerate(rows):
        if row.get("status") != "ok":
            _mark_failed(bottom, i, row, value_key="__none__")
    bottom.set_ylabel(unit2)
    bottom.set_title("autograd saved-tensor peak and resident state per point (naive mode has no resident state)",
                     fontsize=9)
    bottom.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    bottom.legend(fontsize=7, loc="best")
    return fig


def _by_mode(rows):
    """{line label: (mode, line style, rows)}: one line per mode, and per model where the rows hold
    several (e.g. two sweeps of one experiment on different models), each model its own line style."""
    models = list(dict.fromkeys(str(row.get("model")) for row in rows))
    lines: dict[str, tuple[str, str, list[dict]]] = {}
    for row in rows:
        mode, model = str(row.get("mode")), str(row.get("model"))
        label = mode if len(models) == 1 else f"{mode}, {model}"
        style = LINE_STYLES[models.index(model) % len(LINE_STYLES)]
        lines.setdefault(label, (mode, style, []))[2].append(row)
    return lines


def _draw_paper_points(ax, marks, scale: float) -> None:
    """The paper's per-G figures as hollow diamonds at their G, labelled with the paper's text."""
    for i, mark in enumerate(marks):
        g = mark["where"]["G"]
        ax.plot([g], [mark["bytes"] / scale], marker="D", markersize=9, markerfacecolor="none", linestyle="none",
                markeredgecolor=PAPER_COLOR, markeredgewidth=1.8, label=mark["source"] if i == 0 else None)
        ax.annotate(f"paper: {mark['text']}", (g, mark["bytes"] / scale), textcoords="offset points",
                    xytext=(8, -10 if i else 4), color=PAPER_COLOR, fontsize=7)


def plot_g_sweep_memory(rows, ceiling, cuda: bool, title: str, marks=()):
    """`marks`: the paper's figures at a G (`paper.reference_marks`), drawn on the peak panel."""
    panels = [("peak_memory_bytes", "peak allocated (CUDA)" if cuda else "process peak RSS (CPU)"),
              ("graph_bytes_peak", "autograd graph peak (saved tensors)")]
    marks = [m for m in marks if isinstance(m["where"].get("G"), (int, float))]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, (key, name) in zip(axes, panels):
        values = [r.get(key) for r in rows] + ([m["bytes"] for m in marks] if key == "peak_memory_bytes" else [])
        scale, unit = _unit(values)
        for label, (mode, style, members) in _by_mode(rows).items():
            ok = sorted((r for r in _ok(members) if r.get(key) is not None), key=lambda r: r["G"])
            if ok:
                ax.plot([r["G"] for r in ok], [r[key] / scale for r in ok], marker="o", label=label,
                        color=MODE_COLORS.get(mode), linestyle=style)
        for row in _failed(rows):
            if row.get("G") is not None:
                _mark_failed(ax, row["G"], row, scale, value_key=key)
        if key == "peak_memory_bytes" and cuda:
            name += f"\n{_ceiling_line(ax, ceiling, scale, [r.get(key) for r in _ok(rows)])}"
        if key == "peak_memory_bytes":
            _draw_paper_points(ax, marks, scale)
        ax.set_xscale("log", base=2)
        gs = sorted({r["G"] for r in rows if r.get("G") is not None} | {m["where"]["G"] for m in marks})
        ax.set_xticks(gs, [str(g) for g in gs])
        ax.set_xlabel("G (responses per prompt)")
        ax.set_ylabel(unit)
        ax.set_title(name, fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: peak memory against G", fontsize=10)
    return fig


def plot_time_per_member(rows, grid, title: str):
    fig, ax = plt.subplots(figsize=(8, 4.5))
    gs = {r.get("G") for r in rows if r.get("G") is not None}
    if len(gs) > 1:
        for label, (mode, style, members) in _by_mode(rows).items():
            ok = sorted((r for r in _ok(members) if r.get("seconds_per_member") is not None), key=lambda r: r["G"])
            if ok:
                ax.plot([r["G"] for r in ok], [r["seconds_per_member"] for r in ok], marker="o", label=label,
                        color=MODE_COLORS.get(mode), linestyle=style)
        for row in _failed(rows):
            if row.get("G") is not None:
                _mark_failed(ax, row["G"], row, value_key="__none__")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(gs), [str(g) for g in sorted(gs)])
        ax.set_xlabel("G (responses per prompt)")
        ax.legend(fontsize=7)
    else:
        ax.bar(range(len(rows)), [r.get("seconds_per_member") or 0 if r.get("status") == "ok" else 0 for r in rows],
               color=[MODE_COLORS.get(str(r.get("mode")), "#4c72b0") for r in rows])
        _mark_failed_bars(ax, rows)
        ax.set_xticks(range(len(rows)), [point_label(r, grid) for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("seconds per replayed member (s)")
    ax.set_title(f"{title}: time per member", fontsize=10)
    return fig


def plot_phase_seconds(rows, grid, title: str):
    phases = [p for p in STEP_PHASES if any(r.get(f"{p}_seconds") is not None for r in rows)]
    fig, ax = plt.subplots(figsize=(min(16, 4 + 0.7 * len(rows)), 4.8))
    base = [0.0] * len(rows)
    for phase in phases:
        heights = [(r.get(f"{phase}_seconds") or 0.0) if r.get("status") == "ok" else 0.0 for r in rows]
        ax.bar(range(len(rows)), heights, bottom=base, label=phase, color=PHASE_COLORS.get(phase))
        base = [b + h for b, h in zip(base, heights)]
    _mark_failed_bars(ax, rows)
    ax.set_xticks(range(len(rows)), [point_label(r, grid) for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("seconds (s), summed over cycles")
    ax.set_title(f"{title}: seconds per phase", fontsize=10)
    if phases:  # points that all failed have no phase to label
        ax.legend(fontsize=7, ncols=3)
    return fig


# --------------------------------------------------------------------------------- capture figures

def _capture_labels(rows, grid) -> list[str]:
    """Model type and prompt length per bar; the model's name instead where two bars share a type
    (a preset and a real model's shape of one family)."""
    types = [r.get("model_type") for r in rows]
    labels = []
    for row in rows:
        label = row.get("model_type") or point_label(row, grid)
        if types.count(row.get("model_type")) > 1 and row.get("model"):
            label = row["model"]
        labels.append(f"{label}\n{row.get('prompt_length')} pos" if row.get("prompt_length") is not None
                      else str(label))
    return labels


def plot_resident_per_position(rows, grid, title: str):
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(rows) + 3), 4.8))
    series = [("bytes_per_position_measured", "measured (state.nbytes / positions)", "#4c72b0"),
              ("bytes_per_position_predicted", "predicted (from the config)", "#bcbcbc")]
    scale, unit = _unit([r.get(k) for r in rows for k, _, _ in series])
    xs, width = _bar_positions(len(rows), len(series))
    for j, (key, name, color) in enumerate(series):
        heights = [(r.get(key) or 0) / scale if r.get("status") == "ok" else 0 for r in rows]
        bars = ax.bar(xs[j], heights, width, label=name, color=color)
        for bar, row in zip(bars, rows):
            if row.get("status") == "ok" and row.get(key) is not None:
                ax.annotate(format_bytes(row[key]), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
    _mark_failed_bars(ax, rows)
    ax.set_xticks(range(len(rows)), _capture_labels(rows, grid), fontsize=8)
    ax.set_ylabel(f"{unit} per prompt position")
    ax.set_title(f"{title}: resident bytes per position, measured against predicted", fontsize=10)
    ax.legend(fontsize=7)
    return fig


def plot_capture_throughput(rows, grid, title: str):
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(rows) + 3), 4.5))
    ax.bar(range(len(rows)), [(r.get("positions_per_second") or 0) if r.get("status") == "ok" else 0 for r in rows],
           color="#4c72b0")
    _mark_failed_bars(ax, rows)
    ax.set_xticks(range(len(rows)), _capture_labels(rows, grid), fontsize=8)
    ax.set_ylabel("positions per second")
    ax.set_title(f"{title}: capture throughput", fontsize=10)
    return fig


# -------------------------------------------------------------------------------- capacity figure

def plot_capacity(rows, probes: list[dict], title: str):
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(rows) + 3), 4.8))
    labels = [str(r.get("mode") or r.get("point")) for r in rows]
    if len(set(labels)) < len(labels):  # two points of one mode: name them
        labels = [f"{label}\n{r.get('point')}" for label, r in zip(labels, rows)]
    for i, row in enumerate(rows):
        largest = row.get("largest_fitting")
        if row.get("status") != "ok":
            _mark_failed(ax, i, row, value_key="__none__")
        elif largest:
            ax.bar([i], [largest], color=MODE_COLORS.get(str(row.get("mode")), "#4c72b0"), alpha=0.6, width=0.6)
            # a search cut off by its time limit reached this length; the memory limit lies beyond it
            stopped = "\nsearch stopped on its time limit" if row.get("search_stopped_on_time_limit") else ""
            ax.annotate(f"{int(largest):,}{stopped}", (i, largest), textcoords="offset points", xytext=(0, 3),
                        ha="center", fontsize=8)
        else:
            transform = blended_transform_factory(ax.transData, ax.transAxes)
            ax.text(i, 0.05, "no probed length fits", transform=transform, ha="center", fontsize=8, rotation=90,
                    va="bottom", color=FAILED_COLORS["oom"])
        mine = [p for p in probes if p.get("point") == row.get("point") and p.get("prompt_length")]
        for status, marker, color in (("ok", "o", "#2ca02c"), ("oom", "x", FAILED_COLORS["oom"])):
            lengths = [p["prompt_length"] for p in mine if p.get("status") == status]
            ax.plot([i] * len(lengths), lengths, linestyle="none", marker=marker, color=color, markersize=7,
                    label=f"probe {status}" if i == 0 else None)
    ax.set_yscale("log", base=2)
    ax.set_xticks(range(len(rows)), labels)
    ax.set_ylabel("prompt length (positions, log2)")
    # No configured ceiling on CUDA means the device itself is the ceiling (a real OOM).
    ceilings = {(r.get("ceiling_bytes") or r.get("device_memory_bytes"), r.get("memory_measure")) for r in rows
                if r.get("ceiling_bytes") or r.get("device_memory_bytes")}
    stated = "; ".join(f"{format_bytes(c)} on {m}" for c, m in sorted(ceilings, key=str)) or "not recorded"
    ax.set_title(f"{title}: largest prompt that fits per mode\nceiling {stated}", fontsize=9)
    handles, names = ax.get_legend_handles_labels()
    if handles:
        ax.legend(fontsize=7)
    return fig


def plot_capacity_step_time(rows, title: str):
    """Stacked phase seconds per mode at one prompt length (the capacity comparison rows)."""
    phases = [p for p in STEP_PHASES if any(r.get(f"{p}_seconds") is not None for r in rows)]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(rows) + 3), 4.8))
    base = [0.0] * len(rows)
    for phase in phases:
        heights = [(r.get(f"{phase}_seconds") or 0.0) if r.get("status") == "ok" else 0.0 for r in rows]
        ax.bar(range(len(rows)), heights, bottom=base, label=phase, color=PHASE_COLORS.get(phase), width=0.6)
        base = [b + h for b, h in zip(base, heights)]
    for i, row in enumerate(rows):
        if row.get("status") != "ok":
            _mark_failed(ax, i, row, value_key="__none__")
        elif row.get("step_seconds") is not None:
            ax.annotate(f"{row['step_seconds']:,.1f} s", (i, base[i]), textcoords="offset points", xytext=(0, 3),
                        ha="center", fontsize=8)
    ax.set_xticks(range(len(rows)), [f"{r.get('mode')}\n({r.get('measured_as')})" for r in rows], fontsize=8)
    lengths = sorted({r["prompt_length"] for r in rows if r.get("prompt_length") is not None})
    ax.set_ylabel("seconds (s), sum of phases")
    ax.set_title(f"{title}: one step per mode at {', '.join(f'{n:,}' for n in lengths)} positions", fontsize=10)
    ax.legend(fontsize=7, ncols=3)
    return fig


# ---------------------------------------------------------------------------------- sweep figures

def _step_label(step: dict) -> str:
    label = f"#{step.get('step')} {step.get('mode')}\nG={step.get('G')}"
    return label if step.get("status") == "ok" else f"{label} ({str(step.get('status')).upper()})"


def plot_step_phase_peaks(row: dict, steps: list[dict], ceiling: dict, title: str, marks=()):
    """One sweep point: weights and capture (once), then each step's phase peaks, against the
    ceiling; the paper's figures that name no G (e.g. its operating point's peak) as dotted lines."""
    groups = [("weights +\ncapture", {p: row.get(f"{p}_peak_allocated_bytes") for p in ("weights", "capture")},
               None)]
    groups += [(_step_label(s), {p: s.get(f"{p}_peak_allocated_bytes") for p in STEP_PHASES[1:]}, s) for s in steps]
    marks = [m for m in marks if "G" not in m["where"]]
    values = [v for _, peaks, _ in groups for v in peaks.values()] + [s.get("peak_memory_bytes") for s in steps]
    scale, unit = _unit(values + [ceiling.get("bytes")] + [m["bytes"] for m in marks])
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(min(18, max(10, 4 + 1.1 * len(groups))), 8.5),
                                      gridspec_kw={"height_ratios": [2, 1]})
    labelled = set()
    for i, (_, peaks, step) in enumerate(groups):
        present = [(p, v) for p, v in peaks.items() if v is not None]
        if step is not None and step.get("status") != "ok":
            _mark_failed(top, i, step, scale)  # the peak the allocator reached when it ran out
            continue
        width = 0.8 / max(len(present), 1)
        for j, (phase, value) in enumerate(present):
            top.bar(i - 0.4 + width * (j + 0.5), value / scale, width, color=PHASE_COLORS.get(phase),
                    label=phase if phase not in labelled else None)
            labelled.add(phase)
    stated = _ceiling_line(top, ceiling, scale, values)
    for mark in marks:
        top.axhline(mark["bytes"] / scale, color=PAPER_COLOR, linestyle=":", linewidth=1.5,
                    label=f"{mark['source']}: {mark['text']}")
    top.set_ylim(0, top.get_ylim()[1] * 1.25)  # room for the legend above the ceiling line
    top.set_xticks(range(len(groups)), [g[0] for g in groups], fontsize=8)
    top.set_ylabel(unit)
    top.set_title(f"{title} / {row.get('point')}: peak allocated per phase "
                  f"(torch.cuda.max_memory_allocated)\nceiling: {stated}", fontsize=9)
    top.legend(fontsize=7, loc="upper left", ncols=3)

    per_member = [s.get("seconds_per_member") if s.get("status") == "ok" else None for s in steps]
    bottom.bar(range(1, len(groups)), [v or 0 for v in per_member],
               color=[MODE_COLORS.get(str(s.get("mode")), "#4c72b0") for s in steps], width=0.6)
    for i, (step, value) in enumerate(zip(steps, per_member), 1):
        if value is not None:
            bottom.annotate(f"{value:.2f} s", (i, value), textcoords="offset points", xytext=(0, 2), ha="center",
                            fontsize=7)
        elif step.get("status") != "ok":
            _mark_failed(bottom, i, step, value_key="__none__")
    bottom.set_xlim(top.get_xlim())
    bottom.set_xticks(range(len(groups)), [g[0] for g in groups], fontsize=8)
    bottom.set_ylabel("s per member")
    capture = row.get("capture_seconds")
    bottom.set_title("seconds per replayed member (replay phase / responses)"
                     + (f"; the one capture took {capture:,.1f} s for {row.get('positions') or 0:,} positions"
                        if capture is not None else ""), fontsize=9)
    return fig


# ------------------------------------------------------------------------------ staleness figure

def _positive(rows, key, scale=1.0):
    """(steps, values) of the rows with a positive value (what a log scale can draw), step >= 1."""
    pairs = [(r["step"], r[key] * scale) for r in rows
             if r.get("step") is not None and r["step"] >= 1 and r.get(key) is not None and r[key] * scale > 0]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _draw_band(ax, band: dict) -> None:
    """The paper's stated drift range over its stated steps, hatched, labelled as the paper's."""
    steps = band["steps"]
    ax.fill_between([min(steps), max(steps)], band["low"] * 100, band["high"] * 100, color=PAPER_COLOR, alpha=0.2,
                    hatch="//", edgecolor=PAPER_COLOR, linewidth=1.2,
                    label=textwrap.fill(f"paper: {band['text']}", 70, subsequent_indent="  "), zorder=1)


def plot_staleness_drift(points: list[dict], drift: list[dict], grid, title: str, bands=()):
    """`points`: the staleness point rows (`aggregate.point_row`); `drift`: their oracle steps
    (`aggregate.staleness_steps`); `bands`: the paper's stated drift ranges (`paper.reference_marks`)."""
    fig, axes = plt.subplots(2, 3, figsize=(16, 10))
    (loss_ax, logp_ax, kl_ax), (cos_ax, param_ax, vs_ax) = axes
    labels = {str(r.get("point")): point_label(r, grid) for r in points}
    drawn = [p for p in points if any(d.get("point") == p.get("point") and d.get("step") is not None for d in drift)]
    for i, point in enumerate(drawn):
        name, color = str(point.get("point")), POINT_COLORS[i % len(POINT_COLORS)]
        rows = sorted((d for d in drift if str(d.get("point")) == name and d.get("step") is not None),
                      key=lambda d: d["step"])
        label = labels.get(name, name)
        if point.get("status") != "ok":
            label += f" ({str(point.get('status')).upper()}: partial)"
        for ax, key, scale in ((loss_ax, "relative_loss_drift", 100.0), (logp_ax, "mean_abs_logprob_diff", 1.0),
                               (kl_ax, "kl_k3", 1.0), (cos_ax, "one_minus_grad_cosine", 1.0)):
            xs, ys = _positive(rows, key, scale)
            if xs:
                ax.plot(xs, ys, marker="o", markersize=4, color=color, label=label)
        xs = [r["step"] for r in rows if r.get("param_drift") is not None]
        param_ax.plot(xs, [r["param_drift"] for r in rows if r.get("param_drift") is not None], marker="o",
                      markersize=4, color=color, label=label)
        pairs = [(r["param_drift"], r["relative_loss_drift"] * 100, r["step"]) for r in rows
                 if r["step"] >= 1 and r.get("param_drift") and r.get("relative_loss_drift")]
        if pairs:
            vs_ax.plot([p[0] for p in pairs], [p[1] for p in pairs], marker="o", markersize=4, color=color,
                       label=label)
            for x, y, step in pairs:
                vs_ax.annotate(str(step), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6, color=color)
    for point in points:  # no rows to draw: say so in the legend, never drop it silently
        if point not in drawn:
            status = str(point.get("status") or "error")
            loss_ax.plot([], [], marker="X", linestyle="none", markersize=9,
                         color=FAILED_COLORS.get(status, FAILED_COLORS["error"]),
                         label=f"{labels.get(str(point.get('point')))}: "
                               + ("no per-step rows in the result" if status == "ok"
                                  else f"{status.upper()}, no steps measured"))
    thresholds = sorted({p["drift_threshold"] for p in points if p.get("drift_threshold")})
    for threshold in thresholds:
        for ax in (loss_ax, vs_ax):
            ax.axhline(threshold * 100, color="black", linestyle="--", linewidth=1.1,
                       label=f"threshold {format_percent(threshold)} (refresh interval)" if ax is loss_ax else None)
    for band in bands:
        _draw_band(loss_ax, band)
    panels = ((loss_ax, "relative loss drift (%)", "loss drift per step, log scale"),
              (logp_ax, "mean |Δ log p| (nats per token)", "mean |Δ log p|, stale against fresh"),
              (kl_ax, "KL k3 (nats per token)", "KL(stale || fresh), k3 estimate"),
              (cos_ax, "1 − cos(g_stale, g_fresh)", "1 − gradient cosine"))
    for ax, ylabel, name in panels:
        ax.set_yscale("log")
        ax.set_xlabel("step since the capture")
        ax.set_ylabel(ylabel)
        ax.set_title(name, fontsize=9)
    positions = sorted({p["prompt_positions"] for p in points if p.get("prompt_positions")})
    paper_where = "; ".join(f"paper at {b['positions']:,} positions" for b in bands if b.get("positions"))
    loss_ax.set_title("relative loss drift per step (log scale)\nours at "
                      + (", ".join(f"{n:,}" for n in positions) or "?") + " positions"
                      + (f"; {paper_where}" if paper_where else ""), fontsize=9)
    param_ax.set_xlabel("step since the capture")
    param_ax.set_ylabel("‖θ − θ_capture‖₂ (trainable parameters)")
    param_ax.set_title("parameter drift (the trainer's adaptive refresh signal)", fontsize=9)
    vs_ax.set_xscale("log")
    vs_ax.set_yscale("log")
    vs_ax.set_xlabel("parameter drift ‖θ − θ_capture‖₂ (log)")
    vs_ax.set_ylabel("relative loss drift (%)")
    vs_ax.set_title("measured loss drift against the refresh signal (labels: step)", fontsize=9)
    steps = sorted({d["step"] for d in drift if d.get("step") is not None})
    for ax in (loss_ax, logp_ax, kl_ax, cos_ax, param_ax):
        if steps:
            ax.set_xticks(steps)
    # ticks at 1, 2, 5 x 10^k, plainly labelled (log minor labels overlap on a narrow range)
    vs_ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    vs_ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    vs_ax.xaxis.set_minor_formatter(NullFormatter())
    for ax in axes.flat:
        if ax is not loss_ax and ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    # the loss panel's legend (points, threshold, the paper's band) below it, clear of the lines
    loss_ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=1)
    fig.suptitle(f"{title}: drift of a reused prompt state against a fresh capture, per step", fontsize=10)
    return fig


# ---------------------------------------------------------------------------------------- dispatch

def _grid(df: pd.DataFrame) -> list[str]:
    fixed = {"point", "kind", "status", "error"}
    columns = list(df.columns)
    end = columns.index("status") if "status" in columns else 0
    return [c for c in columns[:end] if c not in fixed]


def plots_for_experiment(name: str, df: pd.DataFrame, probes: pd.DataFrame | None, ceiling: dict,
                         out_dir, steps: pd.DataFrame | None = None, comparison: pd.DataFrame | None = None,
                         marks=(), drift: pd.DataFrame | None = None) -> dict[str, Path]:
    """Every figure this experiment's data supports: {"<experiment>/<figure>": png path}. `steps`,
    `comparison` and `drift`: its sweep steps, capacity comparisons and staleness oracle steps;
    `marks`: the paper's figures (peak-memory marks with `bytes`, drift bands with `band`)."""
    out_dir, grid, figures = Path(out_dir), _grid(df), {}
    rows = records(df) if len(df) else []
    step_rows = records(steps) if steps is not None and len(steps) else []
    drift_rows = records(drift) if drift is not None and len(drift) else []
    bands = [m["band"] for m in marks if "band" in m]
    marks = [m for m in marks if "bytes" in m]
    title = name

    def save(figure, fig):
        figures[f"{name}/{figure}"] = _save(fig, out_dir / f"{name}.{figure}.png")

    step = [r for r in rows if r.get("kind") == "step"]
    if step:
        cuda = any(r.get("peak_memory_measure") == "peak_allocated_bytes" for r in step)
        save("memory_vs_ceiling", plot_memory_vs_ceiling(step, grid, ceiling, cuda, title))
        if len({r.get("G") for r in step if r.get("G") is not None}) > 1:
            save("g_sweep_memory", plot_g_sweep_memory(step, ceiling, cuda, title))
        save("time_per_member", plot_time_per_member(step, grid, title))
        save("phase_seconds", plot_phase_seconds(step, grid, title))
    captured = [r for r in rows if r.get("kind") == "capture"
                or (r.get("kind") == "sweep" and r.get("positions") is not None)]
    # a lone sweep's capture is stated in its table; a figure is worth it beside other captures
    if captured and (len(captured) > 1 or captured[0].get("kind") == "capture"):
        save("resident_per_position", plot_resident_per_position(captured, grid, title))
        save("capture_throughput", plot_capture_throughput(captured, grid, title))
    capacity = [r for r in rows if r.get("kind") == "capacity"]
    if capacity:
        save("capacity", plot_capacity(capacity, records(probes) if probes is not None else [], title))
    if comparison is not None and len(comparison):
        save("capacity_step_time", plot_capacity_step_time(records(comparison), title))
    gs_per_mode = {}
    for step in step_rows:
        gs_per_mode.setdefault(step.get("mode"), set()).add(step.get("G"))
    if any(len(gs) > 1 for gs in gs_per_mode.values()):
        cuda = any(str(s.get("peak_memory_measure")).startswith("peak_allocated_bytes") for s in step_rows)
        save("sweep_memory", plot_g_sweep_memory([s for s in step_rows if s.get("kind") == "step"], ceiling, cuda,
                                                 title, marks))
    for row in (r for r in rows if r.get("kind") == "sweep"):
        mine = [s for s in step_rows if s.get("point") == row.get("point") and s.get("kind") == "step"]
        save(f"step_phase_peaks.{row.get('point')}", plot_step_phase_peaks(row, mine, ceiling, title, marks))
    staleness = [r for r in rows if r.get("kind") == "staleness"]
    if staleness and any(d.get("step") is not None for d in drift_rows):
        save("drift_per_step", plot_staleness_drift(staleness, drift_rows, grid, title, bands))
    return figures


def make_plots(tables_or_points, out_dir, probes: dict | None = None, ceiling: dict | None = None,
               steps: dict | None = None, comparisons: dict | None = None,
               marks: dict | None = None, drift: dict | None = None) -> dict[str, Path]:
    """Figures for every experiment. Takes the points (list of result dicts) or the tables from
    `aggregate.tables` (then pass `probes`, `steps`, `comparisons` and `drift`, the tables of capacity
    probes, sweep steps, capacity comparisons and staleness oracle steps). `marks`: {experiment: the
    paper's figures to draw} (`paper.reference_marks`). Returns {"<experiment>/<figure>": path}."""
    if isinstance(tables_or_points, dict):
        frames, points = tables_or_points, []
    else:
        points = list(tables_or_points)
        frames, probes = tables(points), probe_tables(points)
        steps, comparisons = sweep_step_tables(points), comparison_tables(points)
        drift = staleness_step_tables(points)
    ceiling = ceiling or memory_ceiling(points)
    figures: dict[str, Path] = {}
    for name, df in frames.items():
        figures.update(plots_for_experiment(name, df, (probes or {}).get(name), ceiling, out_dir,
                                            steps=(steps or {}).get(name), comparison=(comparisons or {}).get(name),
                                            marks=(marks or {}).get(name, ()), drift=(drift or {}).get(name)))
    return figures


def figure_caption(figure_name: str) -> str:
    """A figure's caption by its name (`step_phase_peaks.<point>` has one per sweep point)."""
    return CAPTIONS.get(figure_name.rsplit("/", 1)[-1].split(".", 1)[0], "")
