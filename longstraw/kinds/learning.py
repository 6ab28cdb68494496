"""Kind `learning`: does GRPO improve a task-trained policy at long context (validation level V4)?

The GRPO trainer (`longstraw.training.trainer`: rollouts sampled from the resident state, task
rewards, serial replay, the optimizer step) starts from the checkpoint at `model.path` and trains
`learning.steps` steps on `learning.task` at `prompt.length` positions, recapturing every step; once
per gradient mode of `learning.gradients` at `optimizer.lr` (`response-only`: the paper's
conditional-response gradient; `exact`: the full-sequence one) and once at learning rate 0. All
runs share the seed, so they visit the same prompts with the same sampling seeds. V4 is reached
for a gradient mode when its mean reward over the prompts of the last `learning.window` steps
exceeds the lr-0 run's on the same prompts by more than 3 standard errors of the per-prompt
differences (`longstraw.training.improvement.paired_gain`).

A point longer than one command resumes: under the CLI the runs write into OUT.work with a checkpoint
every `RESUME_EVERY` steps (and the probe's result), and the same command run again goes on from there.

Report: one row per point (per gradient mode: the gain, its standard error, reached); every
step's rewards per run in a table of its own; figure: reward per step per run, the mean over a
window of prompts with its standard-error band."""

from __future__ import annotations

import json
import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from longstraw.config import ConfigError, PointConfig, point_mapping
from longstraw.config.typed import bounded
from longstraw.kinds.checks import check_task
from longstraw.kinds.spec import Kind
from longstraw.results import (
    SKIPPED,
    ExtraTable,
    as_dict,
    number,
    point_parts,
    rows_of_points,
    strict_json,
    write_text_atomic,
)


@dataclass
class LearningProbe:
    """Train where the base model succeeds sometimes: before training, greedy success of the base policy on
    `examples` held-out examples at each of `lengths` (longest first); the runs train at the longest length
    whose success lies in [`success[0]`, `success[1]`] (none: no training, the probe recorded)."""

    lengths: list[int] = field(default_factory=list)
    examples: int = bounded(16, min=2)
    success: list[float] = field(default_factory=lambda: [0.1, 0.9])

    def __post_init__(self):
        if not self.lengths or min(self.lengths) < 2:
            raise ValueError(f"lengths: a non-empty list of prompt lengths >= 2, got {self.lengths}")
        if len(self.success) != 2 or not 0 <= self.success[0] <= self.success[1] <= 1:
            raise ValueError(f"success: [low, high] within [0, 1], got {self.success}")


@dataclass
class LearningConfig:
    """Does GRPO improve the policy at long context (`longstraw.kinds.learning`)? The trainer from
    `model.path` on `task` at `prompt.length` positions, once per gradient mode at `optimizer.lr`
    and once at learning rate 0 (response-only), with the same seeds and prompts; the gain over the
    lr-0 run on the prompts of the last `window` steps (`longstraw.training.improvement`)."""

    task: dict = field(default_factory=lambda: {"name": "kv_retrieval", "num_needles": 4, "value_length": 2})
    steps: int = bounded(16, min=2)
    steps_per_prompt: int = bounded(1, min=1)
    seed: int = 0
    temperature: float = bounded(1.0, min=0.0)
    gradients: list[Literal["response-only", "exact"]] = field(default_factory=lambda: ["response-only"])
    window: int = bounded(8, min=2)  # the last `window` steps' prompts are compared
    probe: LearningProbe | None = None  # choose the length from the base model's success (else prompt.length)

    def __post_init__(self):
        if self.window > self.steps:
            raise ValueError(f"window: {self.window} is more than the {self.steps} steps")
        if not self.gradients:
            raise ValueError("gradients: at least one gradient mode")


def check(cfg: PointConfig, source: str) -> None:
    check_task(cfg.learning.task, cfg.prompt.length, f"{source}: learning.task")


if TYPE_CHECKING:
    from longstraw.kinds.common import Progress

UNTRAINED = "lr0"


def trainer_mapping(cfg: PointConfig, lr: float, gradient: str, out_dir, length: int | None = None) -> dict:
    """One run's `longstraw train` config: the point's model, objective (less the group size) and
    capture settings, the learning section, `lr` and `gradient`, at `length` (default prompt.length),
    writing under `out_dir`."""
    from longstraw.config.point import trainer_sections

    s = cfg.learning
    return {
        **trainer_sections(cfg, out_dir),
        "task": {**s.task, "length": length or cfg.prompt.length},
        "steps": s.steps,
        "steps_per_prompt": s.steps_per_prompt,
        "seed": s.seed,
        "sampling": {
            "max_new_tokens": cfg.responses.length,
            "temperature": s.temperature,
        },
        "optimizer": {"lr": lr, "weight_decay": 0.0},
        "gradient": gradient,
        "refresh": {"policy": "every", "every": 1},
    }


def runs_of(cfg: PointConfig) -> list[tuple[str, float, str]]:
    """(name, learning rate, gradient mode) of every run, the lr-0 baseline last."""
    return [(g, cfg.optimizer.lr, g) for g in cfg.learning.gradients] + [(UNTRAINED, 0.0, "response-only")]


RESUME_EVERY = 5  # a run's checkpoint interval in a work folder (steps): what a command cut off loses at most


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    from longstraw.training.trainer import Trainer

    keep = ("step", "prompt", "reward_mean", "rewards", "loss", "grad_norm", SKIPPED, "response_tokens", "seconds")
    runs, resumed_at, length = {}, {}, cfg.prompt.length
    with work_folder(cfg, progress.work_dir) as (work, resumable):
        probe = None
        if cfg.learning.probe is not None:
            probe = remembered(work / "probe.json", lambda: probe_lengths(cfg, device, progress))
            length = probe["chosen_length"]
            if length is None:
                return {"runs": {}, "gains": {}, "probe": probe, "prompt_positions": None}
        for name, lr, gradient in runs_of(cfg):
            mapping = trainer_mapping(cfg, lr, gradient, work / name, length)
            mapping["output"]["checkpoint_every"] = RESUME_EVERY if resumable else 0
            trainer = Trainer(mapping, source=f"{cfg.name} [{name}]")
            runs[name] = [
                {**{k: step.get(k) for k in keep}, "phase_seconds": seconds_per_phase(step)}
                for step in trainer.run(resume=resumable)
            ]
            resumed_at[name] = trainer.resumed_at  # a torn newest checkpoint: the older one it went on from
            progress.line(
                f"learning {name} (lr {lr:g}): reward per step "
                + " ".join(f"{s['reward_mean']:.2f}" for s in runs[name])
            )
            progress.partial({"runs": runs})
            del trainer
    # resumed_at: the step each run went on from in this process (0: it ran whole here); the result's
    # wall_seconds are this process's, the steps' own seconds cover every command's
    return {
        "runs": runs,
        "gains": gains(runs, cfg.learning.steps - cfg.learning.window),
        "prompt_positions": length,
        "resumed_at": resumed_at,
        **({"probe": probe} if probe else {}),
    }


@contextmanager
def work_folder(cfg: PointConfig, work_dir):
    """(the folder the point's runs write under, whether they resume from it): the point's `work_dir`, which
    a command run again after a cut finds with the same point's checkpoints in it (a folder of another
    config of the point is refused), else a temporary folder and no checkpoints."""
    import tempfile

    if work_dir is None:
        with tempfile.TemporaryDirectory(prefix="longstraw-learning-") as tmp:
            yield Path(tmp), False
        return
    work = Path(work_dir)
    check_work(cfg, work, cfg.name)
    work.mkdir(parents=True, exist_ok=True)
    write_text_atomic(work / WORK_CONFIG, json.dumps(point_mapping(cfg), sort_keys=True))
    yield work, True


WORK_CONFIG = "config.json"  # the point config whose runs a work folder holds


def check_work(cfg: PointConfig, work_dir, source: str) -> None:
    """Refuse, before any work (`harness.runner`), a work folder holding the runs of another config of this
    point, naming the keys that differ; the folder stays as it is."""
    marker = Path(work_dir) / WORK_CONFIG
    if not marker.is_file():
        return
    now = json.loads(json.dumps(point_mapping(cfg)))  # as the marker records it (tuples as lists)
    try:
        before = json.loads(marker.read_text())
    except ValueError:
        raise ConfigError(f"{source}: {marker}: unreadable; remove the folder {work_dir} to start over") from None
    changes = _changed(before, now) if isinstance(before, dict) else {"<top level>": (before, now)}
    if not changes:
        return
    keys = ", ".join(changes)
    listed = "; ".join(f"{k}: {a!r} there, {b!r} here" for k, (a, b) in changes.items())
    raise ConfigError(
        f"{source}: {keys}: {work_dir} holds the runs of another config of this point ({listed}); run that config to "
        "go on from them, or remove the folder to start over"
    )


def _changed(before: dict, now: dict, path: str = "") -> dict:
    """{dotted key: (before, now)} where two nested mappings differ."""
    out = {}
    for key in sorted(set(before) | set(now), key=str):
        a, b, at = before.get(key), now.get(key), f"{path}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            out.update(_changed(a, b, f"{at}."))
        elif a != b:
            out[at] = (a, b)
    return out


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


def probe_lengths(cfg: PointConfig, device, progress: Progress) -> dict:
    """`learning.probe`: the base policy's greedy success at each probed length (held-out seeds, the length
    curve's), and the longest length whose success lies in the probe's range (None if none does)."""
    from longstraw.models.policy import build_policy
    from longstraw.training.length_curve import length_curve

    p = cfg.learning.probe
    model = build_policy(cfg.model)
    curve = length_curve(
        model,
        cfg.learning.task,
        sorted(p.lengths, reverse=True),
        None,
        p.examples,
        chunk_size=cfg.capture.chunk_size,
        beyond_max_positions=cfg.capture.beyond_max_positions,
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
        "range": [low, high],
        "chosen_length": chosen,
        "rule": f"the longest probed length whose base greedy success is within [{low}, {high}]",
    }


def gains(runs: dict, first_step: int) -> dict:
    """Each trained run's paired gain over the lr-0 run on the prompts of the steps from `first_step` on."""
    from longstraw.training.improvement import paired_gain, per_prompt_means

    baseline = per_prompt_means(runs[UNTRAINED], first_step)
    return {
        name: paired_gain(per_prompt_means(steps, first_step), baseline)
        for name, steps in runs.items()
        if name != UNTRAINED
    }


def gradient_gap(runs: dict, first_step: int) -> dict | None:
    """The exact run's paired gain over the response-only run (the same prompts and sampling seeds: per prompt,
    the difference of the two trained runs' mean rewards, the lr-0 run dropping out), or None unless both ran."""
    from longstraw.training.improvement import paired_gain, per_prompt_means

    if not {"exact", "response-only"} <= set(runs):
        return None
    return paired_gain(per_prompt_means(runs["exact"], first_step), per_prompt_means(runs["response-only"], first_step))


# ------------------------------------------------------------------------------------------- report

SHOWN = [
    "model",
    "prompt_length",
    "probe",
    "trained_length",
    "lr",
    "steps",
    "window",
    "G",
    "response-only_gain",
    "response-only_gain_se",
    "response-only_reached",
    "exact_gain",
    "exact_gain_se",
    "exact_reached",
    "exact_minus_response_only",
    "exact_minus_response_only_se",
    "lr0_mean",
    "train_seconds",
    "wall_seconds",
]
EXTRA_TABLES = {
    "steps": ExtraTable(
        "Reward per step, per run",
        ["point", "run", "step", "prompt", "reward_mean", "grad_norm", "seconds"],
        "Every run visits the same prompts with the same sampling seeds; lr0 is the same trainer at learning rate 0.",
    )
}
CAPTIONS = {
    "reward_per_step": "Reward per step of each run (mean over a window of consecutive prompts, band: one "
    "standard error over those prompts); lr0: the same trainer at learning rate 0."
}
WINDOW = 4  # prompts per point of the figure's rolling mean


def columns(point: dict) -> dict:
    cfg, metrics = point_parts(point)
    settings = as_dict(cfg.get("learning"))
    out = {
        "lr": number(as_dict(cfg.get("optimizer")).get("lr")),
        "steps": settings.get("steps"),
        "window": settings.get("window"),
        "G": as_dict(cfg.get("grpo")).get("num_generations"),
    }
    probe = as_dict(metrics.get("probe"))
    if probe:  # the base model's greedy success per probed length, and where it trained
        chosen = probe.get("chosen_length")
        out["probe"] = "; ".join(f"{r['length']:,}: {r['success']:.2f}" for r in probe.get("rows", [])) + (
            f" -> trained at {chosen:,}" if chosen else " -> none in range: not trained"
        )
        out["trained_length"] = chosen
    for name, gain in as_dict(metrics.get("gains")).items():
        out.update(
            {
                f"{name}_gain": number(gain.get("gain")),
                f"{name}_gain_se": number(gain.get("standard_error")),
                f"{name}_reached": gain.get("reached"),
                f"{name}_mean": number(gain.get("trained_mean")),
                "lr0_mean": number(gain.get("untrained_mean")),
            }
        )
    runs = as_dict(metrics.get("runs"))
    steps, window = settings.get("steps"), settings.get("window")
    gap = gradient_gap(runs, steps - window) if runs and steps is not None and window is not None else None
    if gap is not None:  # what the exact gradient learned beyond the response-only one, on the same prompts
        out.update(exact_minus_response_only=gap["gain"], exact_minus_response_only_se=gap["standard_error"])
    # every run's steps, over all the commands a resumed point took (wall_seconds: the last command's)
    seconds = [number(s.get("seconds")) for run in runs.values() for s in run]
    out["train_seconds"] = sum(v for v in seconds if v is not None) if seconds else None
    return out


def tables(points: list[dict]) -> dict:
    def steps(point):
        return [
            {
                "point": point.get("point"),
                "run": name,
                **{k: s.get(k) for k in ("step", "prompt", "reward_mean", "grad_norm", "seconds")},
            }
            for name, run in as_dict(point_parts(point)[1].get("runs")).items()
            for s in run
        ]

    return {"steps": rows_of_points([p for p in points if p.get("kind") == "learning"], steps)}


def figures(data, ceiling: dict, marks=()):
    rows = [r for r in data.of_kind("learning") if r.get("status") == "ok"]
    if rows and data.extra.get("steps"):
        yield "reward_per_step", plot_rewards(rows, data.extra["steps"], data.name)


def rolling(values: list[float], window: int) -> tuple[list[float], list[float]]:
    """Mean and standard error over the last `window` values at each position (fewer at the start)."""
    means, errors = [], []
    for i in range(len(values)):
        part = values[max(0, i - window + 1) : i + 1]
        mean = sum(part) / len(part)
        var = sum((v - mean) ** 2 for v in part) / (len(part) - 1) if len(part) > 1 else 0.0
        means.append(mean)
        errors.append(math.sqrt(var / len(part)))
    return means, errors


def plot_rewards(rows, steps, title: str):
    from longstraw.plotting import draw

    colors = {"response-only": "#dd8452", "exact": "#4c72b0", UNTRAINED: "#8c8c8c"}
    cols = min(3, len(rows))
    lines = math.ceil(len(rows) / cols)
    fig, axes = draw.plt.subplots(lines, cols, figsize=(6 * cols, 4.2 * lines), squeeze=False)
    for ax in axes.flat[len(rows) :]:
        ax.set_visible(False)
    for ax, row in zip(axes.flat, rows):
        mine = [s for s in steps if s.get("point") == row.get("point")]
        for name in dict.fromkeys(s["run"] for s in mine):
            run = sorted((s for s in mine if s["run"] == name), key=lambda s: s["step"])
            x = [s["step"] for s in run]
            mean, se = rolling([s["reward_mean"] for s in run], WINDOW)
            color = colors.get(name, "#55a868")
            lr = (row.get("lr") or 0) if name != UNTRAINED else 0
            ax.plot(x, mean, color=color, label=f"{name} (lr {lr:g})")
            ax.fill_between(
                x, [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)], color=color, alpha=0.2
            )
        ax.set(xlabel="step", ylabel="reward (mean of G samples)", ylim=(-0.02, 1.02))
        ax.set_title(f"{row.get('point')}: {row.get('prompt_length')} positions", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def longest_runs(cfg: PointConfig) -> list | None:
    """With a probe, it trains at one of the probed lengths."""
    probe = cfg.learning.probe
    if probe is None:
        return None
    return [("learning.probe.lengths", max(probe.lengths), "responses.length", cfg.responses.length)]


def tasks(cfg: PointConfig) -> list:
    probe = cfg.learning.probe
    lengths = (list(probe.lengths), "learning.probe.lengths") if probe else ([cfg.prompt.length], "prompt.length")
    return [("learning.task", cfg.learning.task, *lengths)]


KIND = Kind(
    "learning",
    run=run,
    section=LearningConfig,
    check=check,
    check_work=check_work,
    longest_runs=longest_runs,
    tasks=tasks,
    exact_key=lambda cfg: "learning.gradients" if "exact" in cfg.learning.gradients else None,
    columns=columns,
    tables=tables,
    extra_tables=EXTRA_TABLES,
    shown=SHOWN,
    figures=figures,
    captions=CAPTIONS,
)
