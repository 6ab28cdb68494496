"""The learning kind's runs (`longstraw.kinds.learning`): the trainer's config for one run of a point, the runs of
one length (every gradient mode and the lr-0 control, the same prompts and seeds), the probe of a policy's greedy
success, and V4's paired gains; a curriculum's stages (`longstraw.kinds.learning_curriculum`) run the same."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from longstraw.config import PointConfig
from longstraw.results import SKIPPED, phase_peaks, strict_json, write_text_atomic

if TYPE_CHECKING:
    from longstraw.kinds.common import Progress

UNTRAINED = "lr0"


def task_label(spec: dict) -> str:
    """A task spec's name in records and the report: its registered name (or plugin) and a RULER task's own."""
    return " ".join(str(part) for part in (spec.get("name") or spec.get("plugin"), spec.get("task")) if part)


def trainer_mapping(cfg: PointConfig, lr: float, gradient: str, out_dir, length: int | None = None) -> dict:
    """One run's `longstraw train` config: the point's model, objective (less the group size) and
    capture settings, the learning section, `lr`, the point's `optimizer.master_weights` and `gradient`, at
    `length` (default prompt.length), writing under `out_dir`."""
    from longstraw.config.point import trainer_sections
    from longstraw.config.typed import to_mapping

    s = cfg.learning
    agent = {"environment": to_mapping(s.environment)} if s.environment is not None else {}
    return {
        **agent,
        **trainer_sections(cfg, out_dir),
        "task": {**s.task, "length": length or cfg.prompt.length},
        "steps": s.steps,
        "steps_per_prompt": s.steps_per_prompt,
        "seed": s.seed,
        "sampling": {
            "max_new_tokens": cfg.responses.length,
            "temperature": s.temperature,
        },
        # no weight decay (the trainer's default); the point's masters setting: the recorded synthetic points
        # updated their bf16 weights in place (`master_weights: false`), a new point may keep float32 masters
        "optimizer": {"lr": lr, "weight_decay": 0.0, "master_weights": cfg.optimizer.master_weights},
        "gradient": gradient,
        "refresh": to_mapping(s.refresh),
    }


def runs_of(cfg: PointConfig) -> list[tuple[str, float, str]]:
    """(name, learning rate, gradient mode) of every run, the lr-0 baseline last."""
    return [(g, cfg.optimizer.lr, g) for g in cfg.learning.gradients] + [(UNTRAINED, 0.0, "response-only")]


def train_runs(cfg: PointConfig, work: Path, checkpoint_every: int, length: int, progress: Progress):
    """({run name: its steps' records}, {run name: the step it went on from}, {run name: the optimizer it used})
    of every run of `runs_of(cfg)` at `length` positions, each in `work / name` with a checkpoint every
    `checkpoint_every` steps (0: none), going on from the newest one there. The optimizer is read off the
    trainer's (`optimizer.described`): the point's `optimizer.weight_decay` does not reach the runs."""
    from longstraw.training.optimizer import described
    from longstraw.training.trainer import Trainer

    keep = ("step", "prompt", "depth", "refreshed", "reward_mean", "rewards", "loss", "grad_norm", SKIPPED)
    keep += ("response_tokens", "seconds")
    runs, resumed_at, optimizers = {}, {}, {}
    for name, lr, gradient in runs_of(cfg):
        mapping = trainer_mapping(cfg, lr, gradient, work / name, length)
        mapping["output"]["checkpoint_every"] = checkpoint_every
        trainer = Trainer(mapping, source=f"{cfg.name} [{name}]")
        runs[name] = [
            {
                **{k: step.get(k) for k in keep},
                "phase_seconds": seconds_per_phase(step),
                "peak_allocated_bytes": phase_peaks(step.get("transaction", {}).get("phases", {})),  # CUDA only
            }
            for step in trainer.run(resume=checkpoint_every > 0)
        ]
        resumed_at[name] = trainer.resumed_at  # a torn newest checkpoint: the older one it went on from
        optimizers[name] = described(trainer.optimizer)
        progress.line(
            f"learning {name} (lr {lr:g}): reward per step " + " ".join(f"{s['reward_mean']:.2f}" for s in runs[name])
        )
        progress.partial({"runs": runs})
        del trainer
    return runs, resumed_at, optimizers


def remembered(path: Path, compute):
    """`compute()`'s JSON result, kept at `path` so that a resumed point does not measure it again."""
    if path.is_file():
        return json.loads(path.read_text())
    value = compute()
    write_text_atomic(path, strict_json(value))
    return value


def seconds_per_phase(step: dict) -> dict:
    """A trainer step's seconds per phase (capture, sampling, the transaction's own)."""
    return {name: round(phase["seconds"], 4) for name, phase in step.get("transaction", {}).get("phases", {}).items()}


def probe_lengths(cfg: PointConfig, progress: Progress, lengths) -> dict:
    """`learning.probe`: the greedy success of the policy `cfg.model` builds (the base model; a curriculum stage's:
    the adapter it starts from) at each of `lengths` (held-out seeds, the length curve's), and the longest length
    whose success lies in the probe's range (None if none does)."""
    from longstraw.models.policy import build_policy
    from longstraw.training.length_curve import length_curve

    p = cfg.learning.probe
    model = build_policy(cfg.model)
    curve = length_curve(
        model,
        cfg.learning.task,
        sorted(lengths, reverse=True),
        None,
        p.examples,
        chunk_size=cfg.capture.chunk_size,
        beyond_max_positions=cfg.capture.beyond_max_positions,
        agent=None if cfg.learning.environment is None else (cfg.learning.environment, cfg.responses.length),
    )
    del model
    low, high = p.success
    fitting = [r["length"] for r in curve["rows"] if low <= r["success"] <= high]
    chosen = max(fitting) if fitting else None
    progress.line(
        "learning probe: base success "
        + ", ".join(f"{r['success']:.2f} at {r['length']:,}" for r in curve["rows"])
        + f"; training at {chosen}"
    )
    return {
        "rows": curve["rows"],
        "seed_base": curve["seed_base"],  # the held-out curves' seeds: a stage pairs its probe with them
        "range": [low, high],
        "chosen_length": chosen,
        "rule": f"the longest probed length whose base greedy success is within [{low}, {high}]",
    }


def gains(runs: dict, first_step: int) -> dict:
    """Each trained run's paired gain over the lr-0 run (`improvement.first_visit_gain`)."""
    from longstraw.training.improvement import first_visit_gain

    return {
        name: first_visit_gain(steps, runs[UNTRAINED], first_step) for name, steps in runs.items() if name != UNTRAINED
    }


DEPTH_EDGES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


def success_by_depth(steps: list[dict], edges=DEPTH_EDGES, first_step: int = 0) -> list[dict] | None:
    """A run's mean reward on each prompt's first step, by where the task put the answer's needle (`depth`, a share
    of the context: 0 its start): one row per band [lo, hi) (the last closed), with its prompt count; with
    `first_step`, only the prompts first visited from that step on (V4's window). None when the steps carry no depth
    (a task without needles, or a record from before depths were kept)."""
    from longstraw.training.improvement import per_prompt_means

    depth = {s["prompt"]: s.get("depth") for s in steps}
    if not depth or any(d is None for d in depth.values()):
        return None
    means = per_prompt_means(steps, first_step, first_visit=True)
    rows = []
    for i, (lo, hi) in enumerate(zip(edges, edges[1:])):
        last = i == len(edges) - 2
        band = [m for p, m in means.items() if lo <= depth[p] < hi or (last and depth[p] == hi)]
        rows.append({"depths": [lo, hi], "prompts": len(band), "success": sum(band) / len(band) if band else None})
    return rows


def gradient_gap(runs: dict, first_step: int) -> dict | None:
    """The exact run's paired gain over the response-only run (the same prompts and sampling seeds: per prompt,
    the difference of the two trained runs' mean rewards, the lr-0 run dropping out), or None unless both ran."""
    from longstraw.training.improvement import first_visit_gain

    if not {"exact", "response-only"} <= set(runs):
        return None
    return first_visit_gain(runs["exact"], runs["response-only"], first_step)


# ------------------------------------------------------------------------------------------- report
