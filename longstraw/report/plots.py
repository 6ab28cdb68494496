"""Figures (PNG, matplotlib Agg) from the aggregated tables: what a reader would rather look at
than read. Which figures an experiment gets follows from its data, not its name, so a later
experiment with step / capture / capacity points gets the same figures:

- step points: per-phase peak memory against the ceiling; peak memory against G per mode (when
  G varies); time per replayed member; seconds per phase.
- capture points: resident bytes per position, measured against predicted, per model type; capture
  throughput.
- capacity points: the largest prompt that fits per mode, every probe drawn (oom probes as x).

oom and error points are drawn as red / orange markers with a label, never dropped silently.
Memory is `peak_allocated_bytes` on CUDA and the process peak RSS plus autograd graph bytes on
CPU; each plot says which, and where its ceiling comes from.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from longstraw.report.aggregate import STEP_PHASES, probe_tables, records, tables  # noqa: E402
from longstraw.report.ceiling import memory_ceiling  # noqa: E402
from longstraw.results import atomic_path  # noqa: E402
from longstraw.report.formatting import format_bytes  # noqa: E402

PHASE_COLORS = {"capture": "#4c72b0", "old_scoring": "#8c8c8c", "ref_scoring": "#bcbcbc", "replay": "#dd8452",
                "optimizer_step": "#55a868"}
MODE_COLORS = {"replay": "#dd8452", "hold_all": "#4c72b0", "naive": "#c44e52"}
FAILED_COLORS = {"oom": "#d62728", "error": "#ff7f0e"}
SHORT_KEYS = {"responses.count": "G", "prompt.length": "L", "model.preset": "", "responses.length": "R"}

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
    modes: dict[str, list[dict]] = {}
    for row in rows:
        modes.setdefault(str(row.get("mode")), []).append(row)
    return modes


def plot_g_sweep_memory(rows, ceiling, cuda: bool, title: str):
    panels = [("peak_memory_bytes", "peak allocated (CUDA)" if cuda else "process peak RSS (CPU)"),
              ("graph_bytes_peak", "autograd graph peak (saved tensors)")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    for ax, (key, name) in zip(axes, panels):
        values = [r.get(key) for r in rows]
        scale, unit = _unit(values)
        for mode, members in _by_mode(rows).items():
            ok = sorted((r for r in _ok(members) if r.get(key) is not None), key=lambda r: r["G"])
            if ok:
                ax.plot([r["G"] for r in ok], [r[key] / scale for r in ok], marker="o", label=mode,
                        color=MODE_COLORS.get(mode))
        for row in _failed(rows):
            if row.get("G") is not None:
                _mark_failed(ax, row["G"], row, scale, value_key=key)
        if key == "peak_memory_bytes" and cuda:
            name += f"\n{_ceiling_line(ax, ceiling, scale, [r.get(key) for r in _ok(rows)])}"
        ax.set_xscale("log", base=2)
        gs = sorted({r["G"] for r in rows if r.get("G") is not None})
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
        for mode, members in _by_mode(rows).items():
            ok = sorted((r for r in _ok(members) if r.get("seconds_per_member") is not None), key=lambda r: r["G"])
            if ok:
                ax.plot([r["G"] for r in ok], [r["seconds_per_member"] for r in ok], marker="o", label=mode,
                        color=MODE_COLORS.get(mode))
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
        for i, row in enumerate(rows):
            if row.get("status") != "ok":
                _mark_failed(ax, i, row, value_key="__none__")
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
    for i, row in enumerate(rows):
        if row.get("status") != "ok":
            _mark_failed(ax, i, row, value_key="__none__")
    ax.set_xticks(range(len(rows)), [point_label(r, grid) for r in rows], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("seconds (s), summed over cycles")
    ax.set_title(f"{title}: seconds per phase", fontsize=10)
    ax.legend(fontsize=7, ncols=3)
    return fig


# --------------------------------------------------------------------------------- capture figures

def _capture_label(row, grid):
    label = row.get("model_type") or point_label(row, grid)
    return f"{label}\n{row.get('prompt_length')} pos" if row.get("prompt_length") is not None else str(label)


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
    for i, row in enumerate(rows):
        if row.get("status") != "ok":
            _mark_failed(ax, i, row, value_key="__none__")
    ax.set_xticks(range(len(rows)), [_capture_label(r, grid) for r in rows], fontsize=8)
    ax.set_ylabel(f"{unit} per prompt position")
    ax.set_title(f"{title}: resident bytes per position, measured against predicted", fontsize=10)
    ax.legend(fontsize=7)
    return fig


def plot_capture_throughput(rows, grid, title: str):
    fig, ax = plt.subplots(figsize=(max(7, 1.1 * len(rows) + 3), 4.5))
    ax.bar(range(len(rows)), [(r.get("positions_per_second") or 0) if r.get("status") == "ok" else 0 for r in rows],
           color="#4c72b0")
    for i, row in enumerate(rows):
        if row.get("status") != "ok":
            _mark_failed(ax, i, row, value_key="__none__")
    ax.set_xticks(range(len(rows)), [_capture_label(r, grid) for r in rows], fontsize=8)
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
            ax.annotate(f"{int(largest):,}", (i, largest), textcoords="offset points", xytext=(0, 3), ha="center",
                        fontsize=8)
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


# ---------------------------------------------------------------------------------------- dispatch

def _grid(df: pd.DataFrame) -> list[str]:
    fixed = {"point", "kind", "status", "error"}
    columns = list(df.columns)
    end = columns.index("status") if "status" in columns else 0
    return [c for c in columns[:end] if c not in fixed]


def plots_for_experiment(name: str, df: pd.DataFrame, probes: pd.DataFrame | None, ceiling: dict,
                         out_dir) -> dict[str, Path]:
    """Every figure this experiment's data supports: {"<experiment>/<figure>": png path}."""
    out_dir, grid, figures = Path(out_dir), _grid(df), {}
    rows = records(df) if len(df) else []
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
    captured = [r for r in rows if r.get("kind") == "capture"]
    if captured:
        save("resident_per_position", plot_resident_per_position(captured, grid, title))
        save("capture_throughput", plot_capture_throughput(captured, grid, title))
    capacity = [r for r in rows if r.get("kind") == "capacity"]
    if capacity:
        save("capacity", plot_capacity(capacity, records(probes) if probes is not None else [], title))
    return figures


def make_plots(tables_or_points, out_dir, probes: dict | None = None, ceiling: dict | None = None) -> dict[str, Path]:
    """Figures for every experiment. Takes the points (list of result dicts) or the tables from
    `aggregate.tables` (then pass `probes` for capacity probes). Returns {"<experiment>/<figure>": path}."""
    if isinstance(tables_or_points, dict):
        frames, points = tables_or_points, []
    else:
        points = list(tables_or_points)
        frames, probes = tables(points), probe_tables(points)
    ceiling = ceiling or memory_ceiling(points)
    figures: dict[str, Path] = {}
    for name, df in frames.items():
        figures.update(plots_for_experiment(name, df, (probes or {}).get(name), ceiling, out_dir))
    return figures


def figure_caption(figure_name: str) -> str:
    return CAPTIONS.get(figure_name.rsplit("/", 1)[-1], "")
