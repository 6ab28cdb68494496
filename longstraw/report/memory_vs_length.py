"""The report's central memory figure: peak memory against prompt length, per model and mode, up to
the memory ceiling, with every out-of-memory point where it happened and the paper's operating
points beside ours.

Rows come from every experiment's tables (`memory_rows`): step points (one capture at one length),
sweep steps, and capacity probes (each probe one step at one length in a fresh process). A
context-parallel point's peak is per rank and its state is split, so it is left out here (its own
section plots it). Memory is what each result measured: `peak_allocated_bytes` on CUDA, the process
peak RSS on CPU (a capacity probe's CPU measure is RSS growth over the weights: it is drawn with its
own line, dashed). The paper's points come from `paper.yaml` (`memory_points`).
"""

from __future__ import annotations

import math

from longstraw.report.aggregate import grid_columns, records
from longstraw.report.store import Tables
from longstraw.results import number

FIGURE = "memory_vs_length"
CAPTION = (
    "Peak memory against prompt length (log axis) per model, one line per setting (an experiment's points "
    "that differ in prompt length only; colour: the mode) through the largest peak measured at each length "
    "over the step points and sweep steps of every experiment; coloured dashed lines: a capacity search's "
    "probes (on CPU their measure is RSS growth over the weights). Crosses: out of memory at that length "
    "(drawn at the peak the run reached, else at the ceiling), in the colour of their mode. Black dashed: the "
    "ceiling; black dotted: a capacity search's own (on CPU an emulated one). Diamonds: the paper's "
    "operating points (Qwen3.6-27B over 8 GPUs, per rank), on every panel for scale; read their GB off the "
    "right-hand axis. Context-parallel points (per-rank peaks) are in their own section."
)
WIDTH = 12.0  # inches at the figures' 110 dpi: the page's width at 1,400 px, so it is shown at the size drawn
PANEL_HEIGHT = 2.9  # inches per row of panels
COLUMNS = 3
# grid keys that do not make a setting of their own: the x axis, and the mode (the line's colour)
NOT_SETTINGS = ("prompt.length", "mode")


def _rows(tables: Tables, name: str) -> list[dict]:
    return records(tables.frame(name)) if name in tables.names else []


def _single_rank(row: dict) -> bool:
    cp = number(row.get("cp_size"))
    return (cp is None or cp <= 1) and number(row.get("rank_peak_bytes_max")) is None


def memory_rows(tables: Tables) -> list[dict]:
    """{experiment, point, model, mode, prompt_length, peak_bytes, status, source, search_ceiling, setting} for
    every single-rank measurement of a step's peak at a prompt length, in any experiment."""
    out = []
    for experiment in tables.manifest["experiments"]:
        points = _rows(tables, experiment)
        by_point = {r.get("point"): r for r in points}
        grid = [k for k in grid_columns(tables.frame(experiment).columns) if k not in NOT_SETTINGS]

        def add(row, point, peak, source, experiment=experiment, grid=grid):  # bound: a row of this experiment
            length = number(row.get("prompt_length"))
            if length is None or not _single_rank(point):
                return
            out.append(
                {
                    "experiment": experiment,
                    "point": row.get("point"),
                    "model": point.get("model"),
                    "mode": row.get("mode") or point.get("mode"),
                    "prompt_length": int(length),
                    "peak_bytes": number(peak),
                    "status": row.get("status"),
                    "source": source,
                    "search_ceiling": number(row.get("ceiling_bytes")) if source == "capacity probe" else None,
                    # what the points of one line share: the experiment and its settings but the length
                    "setting": (experiment, source, *(str(point.get(k)) for k in grid)),
                }
            )

        for point in points:
            if point.get("kind") == "step":
                add(point, point, point.get("peak_memory_bytes"), "step")
        for row in _rows(tables, f"{experiment}.steps"):
            if row.get("kind") == "step" and row.get("point") in by_point:
                add(row, {**by_point[row["point"]], **row}, row.get("peak_memory_bytes"), "sweep step")
        for row in _rows(tables, f"{experiment}.probes"):
            if row.get("point") in by_point:
                add(row, by_point[row["point"]], row.get("peak_bytes"), "capacity probe")
    return out


def _failures(ax, rows: list[dict], scale: float, ceiling_bytes) -> None:
    """A cross in the mode's colour at every point that did not complete (at the peak it reached, else at the
    ceiling); the legend says what a cross is, so no label crowds the panel or leaves it."""
    from longstraw.plotting import draw

    statuses = {}
    for r in draw.failed(rows):
        y = r["peak_bytes"] if r["peak_bytes"] is not None else ceiling_bytes
        if y is not None:
            statuses[str(r["status"]).upper()] = True
            ax.plot(
                [r["prompt_length"]],
                [y / scale],
                marker="X",
                markersize=9,
                linestyle="none",
                color=draw.MODE_COLORS.get(r["mode"], "#c44e52"),
                markeredgecolor="black",
            )
    for status in statuses:  # the legend's cross, in no mode's colour (an empty line: it moves no limit)
        ax.plot(
            [],
            [],
            marker="X",
            markersize=9,
            linestyle="none",
            color="white",
            markeredgecolor="black",
            label=f"{status} (colour: its mode)",
        )


def plot_memory_vs_length(rows: list[dict], ceiling: dict, paper_points=()):
    """One panel per model, COLUMNS to a row, WIDTH inches wide; None without rows."""
    from longstraw.plotting import draw

    models = list(dict.fromkeys(r["model"] for r in rows if r.get("model")))
    if not models:
        return None
    cols = min(COLUMNS, len(models))
    lines = math.ceil(len(models) / cols)
    fig, axes = draw.plt.subplots(lines, cols, figsize=(WIDTH, PANEL_HEIGHT * lines + 0.5), squeeze=False, sharey=True)
    for ax in axes.flat[len(models) :]:
        ax.set_visible(False)
    ceiling_bytes = number((ceiling or {}).get("bytes"))
    values = [r["peak_bytes"] for r in rows if r["model"] in models] + [p["bytes"] for p in paper_points]
    # one axis for every panel: sizes far apart (a CPU run's MiB beside the paper's tens of GB) go log
    axis = draw.memory_axis(values + ([ceiling_bytes] if ceiling_bytes else []))
    scale = axis.scale
    for index, (ax, model) in enumerate(zip(axes.flat, models)):
        mine = [r for r in rows if r["model"] == model]
        _draw_mode_lines(ax, mine, scale)
        _failures(ax, mine, scale, ceiling_bytes)
        _draw_ceilings(ax, mine, ceiling_bytes, scale)
        _draw_paper_points(ax, paper_points, scale)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (positions)", fontsize=8)
        # one axis for all: its unit on the first column's left and the last column's right only
        axis.finish(ax, left=index % cols == 0, right=index % cols == cols - 1 or index == len(models) - 1)
        for one in [ax, *ax.child_axes]:
            one.tick_params(labelsize=7)
            one.yaxis.label.set_size(8)
        ax.set_title(str(model), fontsize=8)
    visible = list(axes.flat[: len(models)])
    # one legend beside the panels (the modes, ceilings and paper marks are the same kinds of line in each)
    draw.legend_outside(axes.flat[cols - 1], *draw.shared_legend(visible), fontsize=6.5)
    fig.suptitle("peak memory against prompt length, up to the ceiling", fontsize=9)
    fig.tight_layout()
    return fig


def _draw_mode_lines(ax, mine: list[dict], scale: float) -> None:
    """One line per (setting, mode) of a model: the largest peak at each prompt length."""
    from longstraw.plotting import draw

    for line in dict.fromkeys((r["setting"], r["mode"]) for r in mine):
        ok = [r for r in draw.ok(mine) if (r["setting"], r["mode"]) == line and r["peak_bytes"] is not None]
        peaks = {}
        for r in ok:
            peaks[r["prompt_length"]] = max(peaks.get(r["prompt_length"], 0), r["peak_bytes"])
        xs = sorted(peaks)
        if xs:
            mode, probe = ok[0]["mode"], ok[0]["source"] == "capacity probe"
            # capacity probes apart from steps: on CPU they measure RSS growth over the weights, not the peak
            ax.plot(
                xs,
                [peaks[x] / scale for x in xs],
                marker="s" if probe else "o",
                markersize=4,
                linestyle="--" if probe else "-",
                color=draw.MODE_COLORS.get(mode),
                label=f"{mode}, capacity search" if probe else str(mode),
            )


def _draw_ceilings(ax, mine: list[dict], ceiling_bytes, scale: float) -> None:
    """The device's ceiling, and a capacity search's lower, configured one (CPU: an emulated one)."""
    from longstraw.plotting.formatting import format_bytes

    searches = sorted({r["search_ceiling"] for r in mine if r.get("search_ceiling")})
    lines = [("--", "ceiling", ceiling_bytes)] if ceiling_bytes else []
    lines += [(":", "capacity search ceiling", value) for value in searches]
    for style, name, value in lines:
        ax.axhline(value / scale, color="black", linestyle=style, linewidth=1, label=f"{name} {format_bytes(value)}")


def _draw_paper_points(ax, paper_points, scale: float) -> None:
    from longstraw.plotting import draw

    for i, point in enumerate(paper_points):
        ax.plot(
            [point["positions"]],
            [point["bytes"] / scale],
            marker="D",
            markersize=7,
            linestyle="none",
            markerfacecolor="none",
            markeredgecolor=draw.PAPER_COLOR,
            markeredgewidth=1.4,
            label="paper (per rank)" if i == 0 else None,
        )
