"""Matplotlib helpers (Agg backend, files only) that every kind's figures use: an axis of sizes
(`memory_axis`: its binary unit, log or linear from zero by one rule, and GB on the right, the unit
the paper writes), a point's short label, markers for points that did not complete (drawn, never
dropped silently, never at a made-up value), the memory ceiling as a line, bar positions and widths,
legends beside the axes rather than over the data, the colours, and atomic PNG files.

Memory is `peak_allocated_bytes` on CUDA and the process peak RSS plus autograd graph bytes on
CPU; each figure says which, and where its ceiling comes from (`longstraw.plotting.ceiling`).
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display, no GUI toolkit
import matplotlib.image  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import LogFormatter  # noqa: E402
from matplotlib.transforms import blended_transform_factory, offset_copy  # noqa: E402

from longstraw.plotting.ceiling import ceiling_reason  # noqa: E402
from longstraw.plotting.formatting import LOG_SPAN, is_nested  # noqa: E402
from longstraw.plotting.styles import MODE_COLORS  # noqa: E402, F401  (the figures' one table of mode colours)
from longstraw.results import atomic_path  # noqa: E402

PHASE_COLORS = {
    "weights": "#937860",
    "capture": "#4c72b0",
    "ref_capture": "#64b5cd",
    "sampling": "#da8bc3",
    "old_scoring": "#8c8c8c",
    "ref_scoring": "#bcbcbc",
    "graph_record": "#c44e52",
    "replay": "#dd8452",
    "forward_backward": "#ccb974",
    "optimizer_step": "#55a868",
}
LINE_STYLES = ("-", "--", ":", "-.")  # one per model where a figure's lines span several
PAPER_COLOR = "#8172b3"
FAILED_COLORS = {"oom": "#d62728", "error": "#ff7f0e"}
POINT_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#937860", "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd")
SHORT_KEYS = {"grpo.num_generations": "G", "prompt.length": "L", "model.preset": "", "responses.length": "R"}


def shade(color: str, which: int) -> str:
    """The `which`-th shade of a colour, for lines of one mode on several models: the colour itself, then darker,
    lighter, darker still."""
    mix = ((0.0, 0.0), (0.0, 0.45), (1.0, 0.45), (0.0, 0.7))[which % 4]  # (towards, how far)
    rgb = matplotlib.colors.to_rgb(color)
    return matplotlib.colors.to_hex([c + (mix[0] - c) * mix[1] for c in rgb])


def unit(values) -> tuple[float, str]:
    """(scale, name) of the binary byte unit that fits the largest of `values`."""
    top = max([abs(float(v)) for v in values if v is not None] or [0.0])
    for scale, name in ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB")):
        if top >= scale:
            return float(scale), name
    return 1.0, "B"


# The decimal unit beside each binary one (the paper writes GB).
DECIMAL_UNITS = {"GiB": (1e9, "GB"), "MiB": (1e6, "MB"), "KiB": (1e3, "kB")}


def _positive(values) -> list[float]:
    return [float(v) for v in values if v is not None and v > 0]


def log_scale(values) -> bool:
    """The one rule for an axis of sizes: log when its largest value is more than LOG_SPAN times the
    median of its positive values."""
    positive = _positive(values)
    return bool(positive) and max(positive) > LOG_SPAN * statistics.median(positive)


def scale_by_span(ax, also=()) -> bool:
    """A y axis of drifts or divergences: log when what is drawn on it (its lines, and `also`: values drawn
    otherwise, e.g. a shaded band) spans at least a decade, else linear from zero, so that a series flat to 3%
    looks flat instead of filling a zoomed log axis. True: log."""
    drawn = [y for line in ax.get_lines() for y in line.get_ydata()] + list(also)
    values = [float(y) for y in drawn if y is not None and float(y) > 0]
    log = bool(values) and max(values) >= 10 * min(values)
    if log:
        ax.set_yscale("log")
    else:
        ax.set_ylim(bottom=0, top=max(values, default=1.0) * 1.15)
    return log


class PlainLogFormatter(LogFormatter):
    """Log ticks as plain numbers (0.5, 20, 100), not 5x10^-1; minor ticks labelled where the range
    is short, as LogFormatter chooses."""

    def __call__(self, x, pos=None):
        return f"{x:g}" if super().__call__(x, pos) else ""


@dataclass(frozen=True)
class MemoryAxis:
    """An axis of sizes: draw `bytes / scale`, then `finish` it. `low`: the smallest positive value
    drawn, in bytes (a log axis starts a decade below it, so its bars keep a height)."""

    scale: float
    unit: str
    log: bool
    low: float | None = None

    def finish(self, ax, what: str = "", left: bool = True, right: bool = True) -> None:
        """Log (said in the label) or linear from zero; the binary unit on the left, the decimal one
        (GB) on the right, so the paper's GB figures read off the same axis. `left` / `right` False: that
        side unlabelled (panels in a row that share the axis, labelled at the row's ends)."""
        if self.log:
            ax.set_yscale("log")
            if self.low:  # bars rise from 0, off a log axis: start it a decade below the smallest
                ax.set_ylim(bottom=10 ** math.floor(math.log10(self.low / self.scale)))
        else:
            ax.set_ylim(bottom=0)
        if left:
            ax.set_ylabel(
                f"{what} ({self.unit}{', log scale' if self.log else ''})"
                if what
                else self.unit + (" (log scale)" if self.log else "")
            )
        axes = [ax]
        if self.unit in DECIMAL_UNITS and right:
            decimal, name = DECIMAL_UNITS[self.unit]
            factor = self.scale / decimal
            right = ax.secondary_yaxis("right", functions=(lambda y: y * factor, lambda y: y / factor))
            right.set_ylabel(name)
            axes.append(right)
        if self.log:
            for one in axes:
                one.yaxis.set_major_formatter(PlainLogFormatter(labelOnlyBase=False))
                one.yaxis.set_minor_formatter(PlainLogFormatter(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


def memory_axis(values) -> MemoryAxis:
    """The axis for `values` (in bytes): every value it draws, the ceiling and the paper's marks too,
    so the unit and the scale fit all of them."""
    return MemoryAxis(*unit(values), log_scale(values), min(_positive(values), default=None))


def _settings(row: dict, grid: list[str]) -> dict:
    """A row's scalar settings by key; a nested one (a dict, or the tables' JSON text of one) by the keys inside
    it (`grpo.num_generations`), a list left out."""
    out = {}

    def add(key, value):
        if isinstance(value, str) and is_nested(value):
            value = json.loads(value)
        if isinstance(value, dict):
            for inner, v in value.items():
                add(f"{key}.{inner}", v)
        elif value is not None and not isinstance(value, list):
            out[key] = value

    for key in grid:
        add(key, row.get(key))
    return out


def point_labels(rows: list[dict], grid: list[str]) -> list[str]:
    """Each row's label: the settings whose values differ among the rows that have them (short keys: G, L, R),
    values of more than 32 characters left out; the point's name where that does not tell a row from the
    others (or says nothing)."""
    settings = [_settings(r, grid) for r in rows]
    keys = list(dict.fromkeys(k for s in settings for k in s))
    differ = [k for k in keys if len({str(s[k]) for s in settings if k in s}) > 1]
    labels = []
    for setting in settings:
        parts = [(SHORT_KEYS.get(k, k.rsplit(".", 1)[-1]), setting[k]) for k in differ if k in setting]
        labels.append(" ".join(f"{short}={v}" if short else str(v) for short, v in parts if len(str(v)) <= 32))
    return [label if label and labels.count(label) == 1 else str(r.get("point")) for label, r in zip(labels, rows)]


def ok(rows):
    return [r for r in rows if r.get("status") == "ok"]


def failed(rows):
    return [r for r in rows if r.get("status") != "ok"]


def mark_failed(ax, x, row, scale=1.0, value_key="peak_memory_bytes"):
    """A red/orange marker with the status: an oom point at the peak it recorded (`value_key`);
    otherwise (an error, or a quantity the point never measured: `value_key` None or absent) on the
    x axis, labelled as having no value, never at a height that would read as one."""
    status = row.get("status") or "error"
    color = FAILED_COLORS.get(status, FAILED_COLORS["error"])
    value = row.get(value_key) if value_key else None
    if value is not None and status == "oom":
        ax.plot([x], [value / scale], marker="X", color=color, markersize=11, linestyle="none", zorder=5)
        ax.annotate(
            status.upper(),
            (x, value / scale),
            textcoords="offset points",
            xytext=(6, 6),
            color=color,
            fontsize=8,
            fontweight="bold",
        )
    else:
        transform = blended_transform_factory(ax.transData, ax.transAxes)
        ax.plot([x], [0], marker="X", color=color, markersize=11, transform=transform, clip_on=False, zorder=5)
        ax.text(
            x,
            0.05,
            f"{status.upper()} (no value)",
            transform=transform,
            color=color,
            fontsize=8,
            fontweight="bold",
            ha="center",
            rotation=90,
            va="bottom",
        )


def mark_failed_bars(ax, rows):
    """Bar charts: every point that did not complete gets its status marker on the axis."""
    for i, row in enumerate(rows):
        if row.get("status") != "ok":
            mark_failed(ax, i, row, value_key=None)


def ceiling_line(ax, ceiling: dict, axis: MemoryAxis, values) -> str:
    """Draw the ceiling where it is in the plot's range (otherwise say it in words); returns which
    ceiling it is and why the figure draws it."""
    if not ceiling or not ceiling.get("bytes"):
        return "no ceiling known"
    top = max([v for v in values if v is not None] or [0])
    if top and ceiling["bytes"] / top > LOG_SPAN and not axis.log:
        return f"ceiling off scale: {ceiling['label']}"
    ax.axhline(
        ceiling["bytes"] / axis.scale,
        color="black",
        linestyle="--",
        linewidth=1.2,
        label=textwrap.fill(f"ceiling: {ceiling['label']}", 44),
    )
    return f"{ceiling['label']}: {ceiling_reason(ceiling)}"


def bar_positions(n: int, k: int, width: float = 0.8):
    """x positions of k bars side by side at each of n places, and one bar's width."""
    step = width / max(k, 1)
    return [[i - width / 2 + step * (j + 0.5) for i in range(n)] for j in range(k)], step


def bar_slots(ax, n: int, at_least: int = 3) -> None:
    """x limits of a bar chart with places 0..n-1: at least `at_least` places wide, so one or two
    bars keep a bar's width instead of spanning the axes."""
    pad = max(0, at_least - n) / 2
    ax.set_xlim(-0.5 - pad, n - 0.5 + pad)


def legend_outside(ax, handles=None, labels=None, **kwargs):
    """The axes' legend to its right, beyond a right-hand (GB) axis, so it covers no data; the
    figure's tight layout makes room for it. `handles`/`labels`: a legend gathered from several axes
    (`shared_legend`)."""
    fig = ax.figure
    renderer = fig.canvas.get_renderer()
    right = max([child.get_tightbbox(renderer).x1 for child in ax.child_axes] + [ax.bbox.x1]) - ax.bbox.x1
    beside = offset_copy(ax.transAxes, fig=fig, x=right * 72 / fig.dpi + 6, units="points")
    args = (handles, labels) if handles is not None else ()
    return ax.legend(
        *args,
        loc="upper left",
        bbox_to_anchor=(1, 1),
        bbox_transform=beside,
        borderaxespad=0,
        fontsize=kwargs.pop("fontsize", 7),
        **kwargs,
    )


def shared_legend(axes) -> tuple[list, list]:
    """(handles, labels) of every labelled artist of `axes`, each label once, in drawing order."""
    seen = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    return list(seen.values()), list(seen)


def layout_problems(fig, drawn: bool = False) -> list[str]:
    """What does not fit on the drawn figure: an axes (with its ticks, labels, title and legend), a
    figure text or a figure legend reaching outside the figure, legends overlapping each other, and
    an annotation inside an axes lying under a legend. `drawn`: the canvas already holds the figure
    as it is (else it is drawn here)."""
    if not drawn:
        fig.canvas.draw()
    renderer, frame = fig.canvas.get_renderer(), fig.bbox
    problems = []
    boxes = [(f"axes {ax.get_title()[:40]!r}", ax.get_tightbbox(renderer)) for ax in fig.axes if ax.get_visible()]
    boxes += [(f"text {t.get_text()[:40]!r}", t.get_window_extent(renderer)) for t in fig.texts if t.get_text()]
    boxes += [("figure legend", legend.get_window_extent(renderer)) for legend in fig.legends]
    for name, box in boxes:
        if box is not None and (
            box.x0 < frame.x0 - 1 or box.y0 < frame.y0 - 1 or box.x1 > frame.x1 + 1 or box.y1 > frame.y1 + 1
        ):
            problems.append(f"{name} reaches outside the figure")
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    extents = [legend.get_window_extent(renderer) for legend in legends]
    for i, one in enumerate(extents):
        problems += ["two legends overlap" for other in extents[i + 1 :] if one.overlaps(other)]
    for ax in fig.axes:
        for text in ax.texts:
            if (
                text.get_visible()
                and text.get_text().strip()
                and any(text.get_window_extent(renderer).overlaps(extent) for extent in extents)
            ):
                problems.append(f"annotation {text.get_text()[:40]!r} under a legend")
    return problems


PNG_DPI = 110


def save_png(fig, path) -> Path:
    """Write the figure as a PNG atomically and close it; say on stderr what does not fit
    (`layout_problems`). The figure is drawn once at `PNG_DPI` after the tight layout, and that canvas is both
    checked and written: what `fig.savefig(..., dpi=PNG_DPI)` writes, without drawing the figure a third time (a
    report draws ~50 figures)."""
    path = Path(path)
    fig.tight_layout()
    fig.set_dpi(PNG_DPI)
    fig.canvas.draw()
    for problem in layout_problems(fig, drawn=True):
        print(f"figure {path.name}: {problem}", file=sys.stderr)
    with atomic_path(path) as tmp:
        matplotlib.image.imsave(tmp, fig.canvas.buffer_rgba(), format="png", origin="upper", dpi=PNG_DPI)
    plt.close(fig)
    return path
