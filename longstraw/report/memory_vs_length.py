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

from longstraw.kinds.columns import number
from longstraw.report.aggregate import records
from longstraw.report.store import Tables

FIGURE = "memory_vs_length"
CAPTION = (
    "Peak memory against prompt length (log axis) per model, one line per mode through the largest "
    "peak measured at each length over the step points and sweep steps of every experiment; coloured "
    "dashed lines: a capacity search's probes (on CPU their measure is RSS growth over the weights). "
    "Crosses: out of memory at that length (drawn at the peak the run reached, else at the ceiling). "
    "Black dashed: the ceiling; black dotted: a capacity search's own (on CPU an emulated one). "
    "Diamonds: the paper's operating points (Qwen3.6-27B over 8 GPUs, per rank), on every panel for "
    "scale; read their GB off the right-hand axis. Context-parallel points (per-rank peaks) are in their "
    "own section."
)


def _rows(tables: Tables, name: str) -> list[dict]:
    return records(tables.frame(name)) if name in tables.names else []


def _single_rank(row: dict) -> bool:
    cp = number(row.get("cp_size"))
    return (cp is None or cp <= 1) and number(row.get("rank_peak_bytes_max")) is None


def memory_rows(tables: Tables) -> list[dict]:
    """{experiment, point, model, mode, prompt_length, peak_bytes, status, source} for every
    single-rank measurement of a step's peak at a prompt length, in any experiment."""
    out = []
    for experiment in tables.manifest["experiments"]:
        points = _rows(tables, experiment)
        by_point = {r.get("point"): r for r in points}

        def add(row, point, peak, source):
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


def plot_memory_vs_length(rows: list[dict], ceiling: dict, paper_points=()):
    """One panel per model; None without rows."""
    from longstraw.plotting import draw
    from longstraw.plotting.formatting import format_bytes

    models = list(dict.fromkeys(r["model"] for r in rows if r.get("model")))
    if not models:
        return None
    cols = min(3, len(models))
    lines = math.ceil(len(models) / cols)
    # + 2.5 inches for the legend beside the panels
    fig, axes = draw.plt.subplots(lines, cols, figsize=(6.2 * cols + 2.5, 4.6 * lines), squeeze=False)
    for ax in axes.flat[len(models) :]:
        ax.set_visible(False)
    ceiling_bytes = number((ceiling or {}).get("bytes"))
    values = [r["peak_bytes"] for r in rows if r["model"] in models] + [p["bytes"] for p in paper_points]
    # one axis for every panel: sizes far apart (a CPU run's MiB beside the paper's tens of GB) go log
    axis = draw.memory_axis(values + ([ceiling_bytes] if ceiling_bytes else []))
    scale = axis.scale
    for ax, model in zip(axes.flat, models):
        mine = [r for r in rows if r["model"] == model]
        # capacity probes apart from steps: on CPU they measure RSS growth over the weights, not the peak
        for mode, probe in dict.fromkeys((r["mode"], r["source"] == "capacity probe") for r in mine):
            ok = [
                r
                for r in draw.ok(mine)
                if r["mode"] == mode and (r["source"] == "capacity probe") == probe and r["peak_bytes"] is not None
            ]
            peaks = {}
            for r in ok:
                peaks[r["prompt_length"]] = max(peaks.get(r["prompt_length"], 0), r["peak_bytes"])
            xs = sorted(peaks)
            if xs:
                ax.plot(
                    xs,
                    [peaks[x] / scale for x in xs],
                    marker="s" if probe else "o",
                    markersize=4,
                    linestyle="--" if probe else "-",
                    color=draw.MODE_COLORS.get(mode),
                    label=f"{mode}, capacity search" if probe else str(mode),
                )
        for r in draw.failed(mine):
            y = r["peak_bytes"] if r["peak_bytes"] is not None else ceiling_bytes
            if y is not None:
                ax.plot(
                    [r["prompt_length"]],
                    [y / scale],
                    marker="X",
                    markersize=10,
                    linestyle="none",
                    color=draw.MODE_COLORS.get(r["mode"], "#c44e52"),
                    markeredgecolor="black",
                )
                ax.annotate(
                    f"{str(r['status']).upper()} {r['mode']}",
                    (r["prompt_length"], y / scale),
                    textcoords="offset points",
                    xytext=(4, 4),
                    fontsize=7,
                )
        if ceiling_bytes:
            ax.axhline(
                ceiling_bytes / scale,
                color="black",
                linestyle="--",
                linewidth=1,
                label=f"ceiling {format_bytes(ceiling_bytes)}",
            )
        # a capacity search against a lower, configured ceiling (CPU: an emulated one) draws that one too
        for value in sorted({r["search_ceiling"] for r in mine if r.get("search_ceiling")}):
            ax.axhline(
                value / scale,
                color="black",
                linestyle=":",
                linewidth=1,
                label=f"capacity search ceiling {format_bytes(value)}",
            )
        for i, point in enumerate(paper_points):
            ax.plot(
                [point["positions"]],
                [point["bytes"] / scale],
                marker="D",
                markersize=8,
                linestyle="none",
                markerfacecolor="none",
                markeredgecolor=draw.PAPER_COLOR,
                markeredgewidth=1.6,
                label="paper (per rank)" if i == 0 else None,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt length (positions, log scale)")
        axis.finish(ax)
        ax.set_title(str(model), fontsize=9)
    # one legend beside the panels (the modes, ceilings and paper marks are the same kinds of line in each)
    visible = list(axes.flat[: len(models)])
    draw.legend_outside(axes.flat[cols - 1], *draw.shared_legend(visible))
    fig.suptitle("peak memory against prompt length, up to the ceiling", fontsize=10)
    fig.tight_layout()
    return fig
