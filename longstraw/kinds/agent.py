"""Kind `agent`: multi-turn GRPO on one resident history (issue 61): how many turns the trajectories take, what
they earn, and what a step's memory does against the group size G and against the turn budget.

Each cell (G, turn budget) runs the trainer with an environment (`longstraw.training.agent_step`) for
`agent.steps` steps on one prompt of `agent.task` at `prompt.length` positions (the same example and sampling seeds
in every cell), each trajectory within `responses.length` tokens (actions and observations) and the environment's
`max_action_tokens` a turn. The cells: every G of `agent.num_generations` at the largest budget of
`agent.max_turns`, and every budget at the smallest G. Per cell: the mean reward, turns per trajectory, action and
trajectory tokens, the resident and replay-graph bytes, on CUDA the step's peak allocated memory (weights
included), and seconds per step. The replay holds one member's graph at a time, so a step's memory should stay
flat in G (only the sampling rows' own pages grow with it) and grow with the turns a trajectory takes.

Report (`kinds/agent_report.py`): one row per point, one row per cell in a table of its own, and a figure of
turns per trajectory, reward and memory against G and against the turn budget."""

from __future__ import annotations

import gc
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from longstraw.config import ConfigError, PointConfig
from longstraw.config.sections import EnvironmentConfig
from longstraw.config.typed import bounded
from longstraw.kinds.agent_report import CAPTIONS, EXTRA_TABLES, SHOWN, columns, figures, tables
from longstraw.kinds.checks import check_task
from longstraw.kinds.spec import Kind
from longstraw.results import phase_peaks

if TYPE_CHECKING:
    from longstraw.kinds.common import Progress


@dataclass
class AgentSection:
    """Multi-turn GRPO cells (`longstraw.kinds.agent`): `task` gives the prompt (its example's `info` resets each
    row's `environment`, whose own `max_turns` each cell replaces), `num_generations` the group sizes and
    `max_turns` the turn budgets the cells take."""

    task: dict = field(default_factory=dict)
    environment: EnvironmentConfig = field(default_factory=lambda: EnvironmentConfig(name="ruler_lookup"))
    num_generations: list[int] = field(default_factory=lambda: [2, 4])
    max_turns: list[int] = field(default_factory=lambda: [1, 2, 4])
    steps: int = bounded(1, min=1)
    temperature: float = bounded(1.0, min=0.0)
    seed: int = 0

    def __post_init__(self):
        if not self.task:
            raise ValueError("task: the task the prompt comes from (e.g. {name: ruler_lookup, tokenizer: ...})")
        for name in ("num_generations", "max_turns"):
            values = getattr(self, name)
            if not values or min(values) < 1:
                raise ValueError(f"{name}: a non-empty list of integers >= 1, got {values}")


def cells(section: AgentSection) -> list[tuple[int, int]]:
    """(G, turn budget) of every cell: each G at the largest budget, then each other budget at the smallest G."""
    most, fewest = max(section.max_turns), min(section.num_generations)
    by_g = [(g, most) for g in sorted(set(section.num_generations))]
    return by_g + [(fewest, t) for t in sorted(set(section.max_turns)) if t != most]


def check(cfg: PointConfig, source: str) -> None:
    from longstraw.training.agent_step import check_environment

    a = cfg.agent
    check_task(a.task, cfg.prompt.length, f"{source}: agent.task")
    check_environment(a.environment, a.task, cfg.responses.length, f"{source}: agent.environment", "responses.length")
    if cfg.cp_size > 1:
        raise ConfigError(f"{source}: cp_size: the agent kind samples trajectories in one process (cp_size 1)")


def cell_mapping(cfg: PointConfig, num_generations: int, max_turns: int, out_dir) -> dict:
    """One cell's `longstraw train` config: the point's model, objective (its group size the cell's), capture,
    replay and optimizer; the agent section's task, environment (its turn budget the cell's) and seeds."""
    from longstraw.config.point import trainer_sections
    from longstraw.config.typed import to_mapping

    a = cfg.agent
    sections = trainer_sections(cfg, out_dir)
    return {
        **sections,
        "grpo": {**sections["grpo"], "num_generations": num_generations},
        "task": {**a.task, "length": cfg.prompt.length},
        "environment": {**to_mapping(a.environment), "max_turns": max_turns},
        "steps": a.steps,
        "steps_per_prompt": a.steps,
        "seed": a.seed,
        "sampling": {"max_new_tokens": cfg.responses.length, "temperature": a.temperature},
        "optimizer": to_mapping(cfg.optimizer),
        "refresh": {"policy": "every", "every": 1},
    }


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    import torch

    from longstraw.training.trainer import Trainer

    rows = []
    with tempfile.TemporaryDirectory(prefix="longstraw-agent-") as tmp:
        for g, turns in cells(cfg.agent):
            mapping = cell_mapping(cfg, g, turns, Path(tmp) / f"G{g}-turns{turns}")
            trainer = Trainer(mapping, source=f"{cfg.name} [G {g}, max_turns {turns}]")
            rows.append(cell_row(g, turns, trainer.run(resume=False), device))
            del trainer
            gc.collect()
            if torch.device(device).type == "cuda":
                torch.cuda.empty_cache()
            progress.line(
                f"agent G {g}, max_turns {turns}: reward {rows[-1]['reward']:.3f}, "
                f"{rows[-1]['turns_per_trajectory']:.2f} turns a trajectory, memory {rows[-1]['memory_bytes']:,} B"
            )
            progress.partial({"cells": rows})
    return {"cells": rows, "prompt_positions": cfg.prompt.length}


def _mean(values) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def cell_row(num_generations: int, max_turns: int, records: list[dict], device) -> dict:
    """One cell's summary of its trainer steps' records (module docstring); `memory_bytes`: the step's CUDA
    peak allocated, else (CPU) the resident state's bytes plus the replay graph's peak."""
    transactions = [r.get("transaction", {}) for r in records]
    peaks = [phase_peaks(t.get("phases", {})) for t in transactions]
    peak = max((p for p in peaks if p is not None), default=None)
    resident = max(t.get("resident_bytes", 0) for t in transactions)
    graph = max(t.get("graph_bytes_peak", 0) for t in transactions)
    trajectories = [n for r in records for n in r.get("trajectory_tokens", [])]
    return {
        "G": num_generations,
        "max_turns": max_turns,
        "steps": len(records),
        "reward": _mean(r.get("reward_mean") for r in records),
        "turns_per_trajectory": _mean(r.get("turns/mean") for r in records),
        "done_ratio": _mean(r.get("done_ratio") for r in records),
        "action_tokens": _mean(n for r in records for n in r.get("response_tokens", [])),
        "trajectory_tokens": _mean(trajectories),
        "longest_trajectory": max(trajectories, default=None),
        "resident_bytes": resident,
        "graph_bytes_peak": graph,
        "peak_allocated_bytes": peak,
        "memory_bytes": peak if peak is not None else resident + graph,
        "memory_measure": "peak allocated" if peak is not None else "resident + replay graph",
        "seconds_per_step": _mean(r.get("seconds") for r in records),
    }


KIND = Kind(
    "agent",
    run=run,
    section=AgentSection,
    check=check,
    tasks=lambda cfg: [("agent.task", cfg.agent.task, [cfg.prompt.length], "prompt.length")],
    host_pages=False,
    shards_state=False,
    columns=columns,
    tables=tables,
    extra_tables=EXTRA_TABLES,
    shown=SHOWN,
    figures=figures,
    captions=CAPTIONS,
)
