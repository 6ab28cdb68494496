"""Matplotlib helpers (Agg backend, files only) that every kind's figures use: the byte unit of an
axis, a point's short label, markers for points that did not complete (drawn, never dropped
silently), the memory ceiling as a line, bar positions, the colours, and atomic PNG files.

Memory is `peak_allocated_bytes` on CUDA and the process peak RSS plus autograd graph bytes on
CPU; each figure says which, and where its ceiling comes from (`longstraw.plotting.ceiling`).
"""

from __future__ import annotations

import sys

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from longstraw.results import atomic_path  # noqa: E402

PHASE_COLORS = {"weights": "#937860", "capture": "#4c72b0", "ref_capture": "#64b5cd", "sampling": "#da8bc3",
                "old_scoring": "#8c8c8c", "ref_scoring": "#bcbcbc", "replay": "#dd8452", "optimizer_step": "#55a868"}
MODE_COLORS = {"replay": "#dd8452", "hold_all": "#4c72b0", "naive": "#c44e52"}
LINE_STYLES = ("-", "--", ":", "-.")  # one per model where a figure's lines span several
PAPER_COLOR = "#8172b3"
FAILED_COLORS = {"oom": "#d62728", "error": "#ff7f0e"}
POINT_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd")
SHORT_KEYS = {"responses.count": "G", "prompt.length": "L", "model.preset": "", "responses.length": "R"}


def unit(values) -> tuple[float, str]:
    """(scale, name) of the binary byte unit that fits the largest of `values`."""
    top = max([abs(float(v)) for v in values if v is not None] or [0.0])
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= scale:
            return float(scale), name
    return 1.0, "B"


def point_label(row: dict, grid: list[str]) -> str:
    parts = []
    for key in grid:
        value = row.get(key)
        # nested settings and paths make unreadable legends: the point's name says them
        if value is None or isinstance(value, (dict, list)) or len(str(value)) > 32:
            continue
        short = SHORT_KEYS.get(key, key.rsplit(".", 1)[-1])
        parts.append(f"{short}={value}" if short else str(value))
    return " ".join(parts) if parts else str(row.get("point"))


def ok(rows):
    return [r for r in rows if r.get("status") == "ok"]


def failed(rows):
    return [r for r in rows if r.get("status") != "ok"]


def mark_failed(ax, x, row, scale=1.0, value_key="peak_memory_bytes"):
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


def mark_failed_bars(ax, rows):
    """Bar charts: every point that did not complete gets its status marker on the axis."""
    for i, row in enumerate(rows):
        if row.get("status") != "ok":
            mark_failed(ax, i, row, value_key="__none__")


def ceiling_line(ax, ceiling: dict, scale: float, values) -> str:
    """Draw the ceiling where it is in the plot's range; otherwise say it in words."""
    if not ceiling or not ceiling.get("bytes"):
        return "no ceiling known"
    top = max([v for v in values if v is not None] or [0])
    if top and ceiling["bytes"] / top > 25 and ax.get_yscale() != "log":
        return f"ceiling off scale: {ceiling['label']}"
    ax.axhline(ceiling["bytes"] / scale, color="black", linestyle="--", linewidth=1.2,
               label=f"ceiling: {ceiling['label']}")
    return ceiling["label"]


def bar_positions(n: int, k: int, width: float = 0.8):
    """x positions of k bars side by side at each of n places, and one bar's width."""
    step = width / max(k, 1)
    return [[i - width / 2 + step * (j + 0.5) for i in range(n)] for j in range(k)], step


def layout_problems(fig) -> list[str]:
    """What does not fit on the drawn figure: an axes (with its ticks, labels, title and legend), a
    figure text or a figure legend reaching outside the figure, legends overlapping each other, and
    an annotation inside an axes lying under a legend."""
    fig.canvas.draw()
    renderer, frame = fig.canvas.get_renderer(), fig.bbox
    problems = []
    boxes = [(f"axes {ax.get_title()[:40]!r}", ax.get_tightbbox(renderer)) for ax in fig.axes if ax.get_visible()]
    boxes += [(f"text {t.get_text()[:40]!r}", t.get_window_extent(renderer)) for t in fig.texts if t.get_text()]
    boxes += [("figure legend", legend.get_window_extent(renderer)) for legend in fig.legends]
    for name, box in boxes:
        if box is not None and (box.x0 < frame.x0 - 1 or box.y0 < frame.y0 - 1 or box.x1 > frame.x1 + 1
                                or box.y1 > frame.y1 + 1):
            problems.append(f"{name} reaches outside the figure")
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    extents = [legend.get_window_extent(renderer) for legend in legends]
    for i, one in enumerate(extents):
        problems += ["two legends overlap" for other in extents[i + 1:] if one.overlaps(other)]
    for ax in fig.axes:
        for text in ax.texts:
            if text.get_visible() and text.get_text().strip() and any(
                    text.get_window_extent(renderer).overlaps(extent) for extent in extents):
                problems.append(f"annotation {text.get_text()[:40]!r} under a legend")
    return problems


def save_png(fig, path) -> Path:
    """Write the figure as a PNG atomically and close it; say on stderr what does not fit
    (`layout_problems`)."""
    path = Path(path)
    fig.tight_layout()
    for problem in layout_problems(fig):
        print(f"figure {path.name}: {problem}", file=sys.stderr)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return path
