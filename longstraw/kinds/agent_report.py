"""The agent kind's report parts (`longstraw.kinds.agent`): its cells of a point's row, its table of cells, and
its figure of turns per trajectory, reward and memory against G and against the turn budget. Plain Python;
matplotlib only inside `figures`."""

from __future__ import annotations

from longstraw.results import ExtraTable, as_dict, number, point_parts, rows_of_points

CELL_KEYS = [
    "G",
    "max_turns",
    "steps",
    "reward",
    "turns_per_trajectory",
    "done_ratio",
    "action_tokens",
    "trajectory_tokens",
    "longest_trajectory",
    "resident_bytes",
    "graph_bytes_peak",
    "peak_allocated_bytes",
    "memory_bytes",
    "memory_measure",
    "seconds_per_step",
]
SHOWN = [
    "model",
    "prompt_length",
    "task",
    "environment",
    "G",
    "max_turns",
    "steps",
    "reward",
    "turns_per_trajectory",
    "memory_G_ratio",
    "memory_turns_ratio",
    "wall_seconds",
]
EXTRA_TABLES = {
    "cells": ExtraTable(
        "Multi-turn GRPO cells: G and the turn budget",
        ["point", *CELL_KEYS],
        "Each cell: the trainer's steps on one prompt (the same example and sampling seeds in every cell), each row "
        "acting in its own environment. turns_per_trajectory: actions the environment took; action_tokens: the "
        "loss-bearing tokens of a trajectory, trajectory_tokens: its actions and observations. memory_bytes: the "
        "step's CUDA peak allocated (weights included), or on the CPU the resident state's bytes plus the replay "
        "graph's peak (memory_measure says which).",
    )
}
CAPTIONS = {
    "agent_cells": "Top: against the group size G at the largest turn budget; bottom: against the turn budget at "
    "the smallest G. Left to right: turns a trajectory took (mean), reward (mean over the group and steps), and "
    "memory (the step's CUDA peak allocated, or on the CPU the resident state plus the replay graph's peak): flat "
    "in G, since replay holds one member's graph at a time."
}


def _cells(point: dict) -> list[dict]:
    return [as_dict(c) for c in point_parts(point)[1].get("cells") or []]


def _ratio(cells: list[dict], along: str, fixed: str, value) -> float | None:
    """Largest over smallest memory across the cells that vary `along` with `fixed` at `value` (None: fewer than
    two such cells)."""
    memory = [number(c.get("memory_bytes")) for c in cells if c.get(fixed) == value]
    memory = [m for m in memory if m]
    return max(memory) / min(memory) if len(memory) > 1 else None


def columns(point: dict) -> dict:
    cfg, _ = point_parts(point)
    settings, cells = as_dict(cfg.get("agent")), _cells(point)
    task, env = as_dict(settings.get("task")), as_dict(settings.get("environment"))
    gs, turns = settings.get("num_generations") or [], settings.get("max_turns") or []
    rewards = [number(c.get("reward")) for c in cells]
    return {
        "task": task.get("name") + (f" ({task['hops']} hops)" if "hops" in task else "") if task.get("name") else None,
        "environment": env.get("name"),
        "G": " ".join(str(g) for g in gs) or None,
        "max_turns": " ".join(str(t) for t in turns) or None,
        "steps": settings.get("steps"),
        "reward": sum(r for r in rewards if r is not None) / len(rewards) if rewards else None,
        "turns_per_trajectory": max((number(c.get("turns_per_trajectory")) or 0 for c in cells), default=None),
        "memory_G_ratio": _ratio(cells, "G", "max_turns", max(turns)) if turns else None,
        "memory_turns_ratio": _ratio(cells, "max_turns", "G", min(gs)) if gs else None,
    }


def tables(points: list[dict]) -> dict:
    def rows(point):
        return [{"point": point.get("point"), **{k: c.get(k) for k in CELL_KEYS}} for c in _cells(point)]

    return {"cells": rows_of_points([p for p in points if p.get("kind") == "agent"], rows)}


def figures(data, ceiling: dict, marks=()):
    rows = [r for r in data.of_kind("agent") if r.get("status") == "ok"]
    if rows and data.extra.get("cells"):
        yield "agent_cells", plot_cells(rows, data.extra["cells"], data.name)


def _against(cells: list[dict], along: str, fixed: str) -> list[dict]:
    """The cells that vary `along` at the extreme of `fixed` the kind fixes there (the largest turn budget for G,
    the smallest G for the budgets), in order."""
    if not cells:
        return []
    value = max(c[fixed] for c in cells) if fixed == "max_turns" else min(c[fixed] for c in cells)
    return sorted((c for c in cells if c.get(fixed) == value), key=lambda c: c[along])


def plot_cells(rows, cells, title: str):
    from longstraw.plotting import draw

    fig, axes = draw.plt.subplots(2, 3, figsize=(13, 7), squeeze=False)
    scale, unit = draw.unit([c.get("memory_bytes") for c in cells])
    panels = (("turns_per_trajectory", "turns per trajectory"), ("reward", "reward (mean)"), ("memory_bytes", unit))
    for line, (along, fixed, label) in enumerate((("G", "max_turns", "G"), ("max_turns", "G", "turn budget"))):
        for i, row in enumerate(rows):
            mine = _against([c for c in cells if c.get("point") == row.get("point")], along, fixed)
            color = draw.POINT_COLORS[i % len(draw.POINT_COLORS)]
            for ax, (key, ylabel) in zip(axes[line], panels):
                values = [c.get(key) for c in mine]
                values = [v / scale if key == "memory_bytes" and v is not None else v for v in values]
                ax.plot([c[along] for c in mine], values, marker="o", color=color, label=str(row.get("point")))
                ax.set(xlabel=label, ylabel=ylabel, xticks=sorted({c[along] for c in cells}))
    for ax, (key, _) in zip(axes.flat, panels * 2):
        ax.ticklabel_format(axis="y", useOffset=False)  # a flat line reads flat, not as a spread of its last digits
        if key != "reward":  # from 0, with room above the highest value
            top = max((float(max(line.get_ydata(), default=0) or 0) for line in ax.lines), default=0)
            ax.set_ylim(0, 1.15 * top or 1)
        ax.legend(fontsize=7)
    axes[0][2].set_title(f"memory ({cells[0].get('memory_measure')})", fontsize=9)
    fig.suptitle(f"{title}: multi-turn GRPO against G and the turn budget", fontsize=10)
    fig.tight_layout()
    return fig
