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

With `learning.curriculum` the point is a length curriculum (`longstraw.kinds.learning_curriculum`): stage n
trains at its length, with its RoPE scaling, from stage n-1's trained LoRA adapter (without `model.lora`: its
trained weights), each stage with its own probe, lr-0 control from the same policy, V4 gains and held-out length
curves (the training task's and each of `learning.curriculum.eval_tasks`').

A point longer than one command resumes: under the CLI the runs write into OUT.work with a checkpoint
every `RESUME_EVERY` steps (and the probe's result), and the same command run again goes on from there.

Report: one row per point (per gradient mode: the gain, its standard error, reached); every
step's rewards per run in a table of its own; figure: reward per step per run, the mean over a
window of prompts with its standard-error band. A curriculum adds a table of its stages, one of its held-out
cells, and a figure of held-out greedy success against length, the base model and each stage's adapter, one panel
per task."""

from __future__ import annotations

import json
import math
import statistics
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from longstraw.config import ConfigError, PointConfig, point_mapping
from longstraw.config.sections import EnvironmentConfig
from longstraw.config.train import RefreshConfig
from longstraw.config.typed import bounded
from longstraw.kinds.checks import check_task
from longstraw.kinds.learning_runs import (
    UNTRAINED,
    gains,
    gradient_gap,
    probe_lengths,
    remembered,
    success_by_depth,
    task_label,
    train_runs,
)
from longstraw.kinds.spec import Built, Kind
from longstraw.results import (
    ExtraTable,
    as_dict,
    number,
    point_parts,
    rows_of_points,
    write_text_atomic,
)
from longstraw.training.depths import depth_label
from longstraw.training.improvement import first_visits


@dataclass
class LearningProbe:
    """Train where the base model succeeds sometimes: before training, greedy success of the base policy on
    `examples` held-out examples at each of `lengths` (longest first); the runs train at the longest length
    whose success lies in [`success[0]`, `success[1]`] (none: no training, the probe recorded)."""

    lengths: list[int] = field(default_factory=list)  # a curriculum's probe: none (each stage's own length)
    examples: int = bounded(16, min=2)
    success: list[float] = field(default_factory=lambda: [0.1, 0.9])

    def __post_init__(self):
        if self.lengths and min(self.lengths) < 2:
            raise ValueError(f"lengths: prompt lengths >= 2, got {self.lengths}")
        if len(self.success) != 2 or not 0 <= self.success[0] <= self.success[1] <= 1:
            raise ValueError(f"success: [low, high] within [0, 1], got {self.success}")


@dataclass
class CurriculumStage:
    """One stage of a length curriculum: `steps` GRPO steps at `length` positions, the model built with `overrides`
    over `model.overrides` (the RoPE scaling the length needs: `rope_parameters`, `max_position_embeddings`), each
    prompt's group of `num_generations` rollouts (None: `grpo.num_generations`; more where rewards grow sparse)."""

    length: int = bounded(1024, min=2)
    steps: int = bounded(16, min=2)
    overrides: dict = field(default_factory=dict)
    num_generations: int | None = bounded(None, min=1)


@dataclass
class LearningCurriculum:
    """`stages` in order of increasing length, each from the one before's trained adapter; after each, the length
    curve of its adapter and of the base model (the same model, adapter off) at every stage length so far, on
    `eval_examples` held-out examples a length, for the training task and each of `eval_tasks`. The adapter
    carried on is the first of `learning.gradients`'s."""

    stages: list[CurriculumStage] = field(default_factory=list)
    eval_examples: int = bounded(16, min=2)
    # more tasks (specs as `learning.task`'s) each stage's held-out curves are measured on, e.g. one the base model
    # is weak at; each its own `task_label`
    eval_tasks: list[dict] = field(default_factory=list)
    # a folder the stages' carried policies are kept in (`kept`); None: they go with the work folder
    out: str | None = None

    def kept(self, index: int, name: str) -> Path:
        """Where stage `index`'s carried policy is kept under `out`: `stage-<index>/adapter` (a LoRA adapter) or
        `stage-<index>/model` (the whole model, as `save_pretrained` wrote it)."""
        return Path(self.out) / f"stage-{index}" / name

    def __post_init__(self):
        if not self.stages:
            raise ValueError("stages: at least one stage")
        for i in range(1, len(self.stages)):
            if self.stages[i].length <= self.stages[i - 1].length:
                raise ValueError(
                    f"stages: stages[{i}].length {self.stages[i].length} is not longer than stages[{i - 1}].length "
                    f"{self.stages[i - 1].length}; a curriculum's lengths increase"
                )


@dataclass
class LearningConfig:
    """Does GRPO improve the policy at long context (`longstraw.kinds.learning`)? The trainer from
    `model.path` on `task` at `prompt.length` positions, once per gradient mode at `optimizer.lr`
    and once at learning rate 0 (response-only), with the same seeds and prompts; the gain over the
    lr-0 run on the prompts first visited in the last `window` steps, each prompt's first step
    (`longstraw.training.improvement`)."""

    task: dict = field(default_factory=lambda: {"name": "kv_retrieval", "num_needles": 4, "value_length": 2})
    steps: int = bounded(16, min=2)  # a curriculum: each stage's own
    steps_per_prompt: int = bounded(1, min=1)
    # when a prompt is captured again within its steps (the trainer's `refresh`): every step by default; every k
    # steps reuses the state captured k - 1 updates before (prefix reuse), a capture per prompt when k is its steps
    refresh: RefreshConfig = field(default_factory=RefreshConfig)
    seed: int = 0
    temperature: float = bounded(1.0, min=0.0)
    gradients: list[Literal["response-only", "exact"]] = field(default_factory=lambda: ["response-only"])
    window: int = bounded(8, min=2)  # the prompts first visited in the last `window` steps are compared
    probe: LearningProbe | None = None  # choose the length from the base model's success (else prompt.length)
    curriculum: LearningCurriculum | None = None  # stages of increasing length (else one length)
    # multi-turn rollouts in an environment (`longstraw.training.agent_step`): the trainer's `environment`; the
    # trajectory's token budget is `responses.length`, and the probe's success a greedy trajectory's
    environment: EnvironmentConfig | None = None

    def __post_init__(self):
        if self.probe is not None and self.curriculum is None and not self.probe.lengths:
            raise ValueError("probe: lengths: the prompt lengths to probe (a non-empty list)")
        if self.probe is not None and self.curriculum is not None and self.probe.lengths:
            raise ValueError("probe: lengths: a curriculum probes each stage at its own length; drop probe.lengths")
        for i, stage in enumerate(self.curriculum.stages if self.curriculum else []):
            if self.window > stage.steps:
                raise ValueError(f"window: {self.window} is more than the {stage.steps} steps of curriculum stage {i}")
        if self.curriculum is None and self.window > self.steps:  # a curriculum's stages have steps of their own
            raise ValueError(f"window: {self.window} is more than the {self.steps} steps")
        if not self.gradients:
            raise ValueError("gradients: at least one gradient mode")
        if "exact" in self.gradients and (self.refresh.policy, self.refresh.every) != ("every", 1):
            raise ValueError("refresh: the exact gradient needs a capture with the current parameters every step")
        lengths = [stage.steps for stage in self.curriculum.stages] if self.curriculum else [self.steps]
        if min(first_visits(steps, self.window, self.steps_per_prompt) for steps in lengths) < 2:
            raise ValueError(
                f"window: {self.window} steps hold fewer than 2 prompts' first steps at {self.steps_per_prompt} "
                "steps a prompt; V4 pairs prompts"
            )
        labels = [task_label(self.task)] + [
            task_label(t) for t in (self.curriculum.eval_tasks if self.curriculum else [])
        ]
        for i, label in enumerate(labels[1:]):
            if label in labels[: i + 1]:
                raise ValueError(
                    f"curriculum: eval_tasks[{i}]: {label!r} is the name of the training task or an earlier eval task; "
                    "each task's held-out curves are recorded under its name"
                )


def check(cfg: PointConfig, source: str) -> None:
    check_task(cfg.learning.task, cfg.prompt.length, f"{source}: learning.task")
    for i, spec in enumerate(cfg.learning.curriculum.eval_tasks if cfg.learning.curriculum else []):
        check_task(spec, cfg.prompt.length, f"{source}: learning.curriculum.eval_tasks[{i}]")
    if cfg.learning.environment is not None:
        check_learning_environment(cfg, source)


def check_learning_environment(cfg: PointConfig, source: str) -> None:
    """`learning.environment` against the task and `responses.length` (`agent_step.check_environment`); a
    curriculum's held-out curves are single-turn, so not beside one yet."""
    from longstraw.training.agent_step import check_environment

    if cfg.learning.curriculum is not None:
        raise ConfigError(f"{source}: learning.environment: not with a curriculum yet (its held-out curves: one turn)")
    check_environment(
        cfg.learning.environment,
        cfg.learning.task,
        cfg.responses.length,
        f"{source}: learning.environment",
        "responses.length",
    )


if TYPE_CHECKING:
    from longstraw.kinds.common import Progress

RESUME_EVERY = 5  # a run's checkpoint interval in a work folder (steps): what a command cut off loses at most


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    length = cfg.prompt.length
    with work_folder(cfg, progress.work_dir) as (work, resumable):
        if cfg.learning.curriculum is not None:
            from longstraw.kinds.learning_curriculum import run_curriculum

            return run_curriculum(cfg, device, progress, work, RESUME_EVERY)
        probe = None
        if cfg.learning.probe is not None:
            probe = remembered(work / "probe.json", lambda: probe_lengths(cfg, progress, cfg.learning.probe.lengths))
            length = probe["chosen_length"]
            if length is None:
                return {"runs": {}, "gains": {}, "probe": probe, "prompt_positions": None}
        runs, resumed_at, optimizers = train_runs(cfg, work, RESUME_EVERY if resumable else 0, length, progress)
    # resumed_at: the step each run went on from in this process (0: it ran whole here); the result's
    # wall_seconds are this process's, the steps' own seconds cover every command's
    return {
        "runs": runs,
        "gains": gains(runs, cfg.learning.steps - cfg.learning.window),
        "prompt_positions": length,
        "resumed_at": resumed_at,
        "run_optimizer": optimizers,
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
    "curriculum",
    "train_seconds",
    "wall_seconds",
]
EXTRA_TABLES = {
    "steps": ExtraTable(
        "Reward per step, per run",
        ["point", "run", "step", "prompt", "reward_mean", "grad_norm", "seconds"],
        "Every run visits the same prompts with the same sampling seeds; lr0 is the same trainer at learning rate 0.",
    ),
    "stages": ExtraTable(
        "Length curriculum: one row per stage",
        [
            "point",
            "stage",
            "length",
            "steps",
            "rope",
            "start_adapter",
            "probe_success",
            "response-only_gain",
            "response-only_gain_se",
            "exact_gain",
            "exact_gain_se",
            "exact_minus_response_only",
            "exact_minus_response_only_se",
            "lr0_mean",
            "heldout_success",
            "heldout_base_success",
            "heldout_vs_start",
            "heldout_eval_tasks",
            "lr0_by_depth",
            "window_by_depth",
            "step_seconds",
            "step_peak_bytes",
        ],
        "Each stage starts every run (lr0 too) from the adapter the stage before carried on (its sha256); held-out: "
        "greedy success at the stage's length on the length curve's seeds, with the stage's adapter and without it "
        "(eval tasks: each of learning.curriculum.eval_tasks, the adapter's success and the base's); held-out vs "
        "start: the same held-out examples as the stage's probe of the policy it started from, those the adapter "
        "gained and lost, with the exact two-sided sign test; "
        "exact minus response-only: the two trained runs' paired difference on the stage's last window of prompts; "
        "lr0 by depth: the starting policy's sampled success on each prompt's first step, by where the answer's "
        "needle sits (0: the context's start), each band's prompt count in brackets; window by depth: the same over "
        "the V4 window's prompts only, the response-only run's success beside lr 0's on the same prompts; "
        "step seconds: the "
        "response-only run's median step after its first (capture, sampling, replay, update); step peak: its "
        "steps' highest CUDA peak allocated (weights included; none on the CPU).",
    ),
    "heldout": ExtraTable(
        "Length curriculum: held-out greedy success per stage, task and length",
        ["point", "task", "trained", "stage", "policy", "length", "success", "stderr", "n"],
        "After each stage, on the length curve's held-out seeds at every stage length so far: the stage's carried "
        "adapter and the base model (the same model, the stage's RoPE overrides, the adapter off); trained: the task "
        "the curriculum trains on, else one of learning.curriculum.eval_tasks.",
    ),
}
CAPTIONS = {
    "reward_per_step": "Reward per step of each run (mean over a window of consecutive prompts, band: one "
    "standard error over those prompts); lr0: the same trainer at learning rate 0.",
    "heldout_by_stage": "Held-out greedy success against prompt length (log2 axis), one panel per task (the one "
    "trained on, then each eval task): each stage's carried adapter at every stage length so far, and the base model "
    "(dashed, grey: the adapter off, with the last stage's RoPE overrides); bars: one standard error.",
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
    stages = [as_dict(s) for s in metrics.get("stages") or []]
    if stages:  # a curriculum: its stages in a cell, the stage that reached furthest in the gain columns
        shown = reported_stage(stages)
        out["curriculum"] = "; ".join(stage_text(s) for s in stages)
        probes = [probe_text(as_dict(s["probe"]), skipped=bool(s.get("skipped"))) for s in stages if s.get("probe")]
        out["probe"] = "; ".join(probes) or None
        out.update(run_columns(shown, shown.get("steps"), settings.get("window")) if shown else {})
        out["trained_length"] = shown.get("length") if shown else None
        out["steps"] = shown.get("steps") if shown else None  # the shown stage's (learning.steps does not apply)
        out["G"] = (shown or {}).get("num_generations") or out["G"]  # a stage may set its own group size
        seconds = [
            number(step.get("seconds")) for s in stages for run in as_dict(s.get("runs")).values() for step in run
        ]
        out["train_seconds"] = sum(v for v in seconds if v is not None) if seconds else None
        return out
    probe = as_dict(metrics.get("probe"))
    if probe:  # the base model's greedy success per probed length, and where it trained
        out["probe"] = probe_text(probe)
        out["trained_length"] = probe.get("chosen_length")
    return {**out, **run_columns(metrics, settings.get("steps"), settings.get("window"))}


def probe_text(probe: dict, skipped: bool = False) -> str:
    """A probe's greedy success per length, and where it trained (a curriculum stage above the range: skipped)."""
    chosen = probe.get("chosen_length")
    outcome = " -> above the range: skipped" if skipped else " -> none in range: not trained"
    rows = "; ".join(f"{r['length']:,}: {r['success']:.2f}" for r in probe.get("rows", []))
    return rows + (f" -> trained at {chosen:,}" if chosen else outcome)


def reported_stage(stages: list[dict]) -> dict | None:
    """The curriculum stage whose gains a row's columns give: the longest that reached V4 in a gradient mode, else the
    longest that trained (None: none did)."""
    trained = [s for s in stages if s.get("runs")]
    reached = [s for s in trained if any(as_dict(g).get("reached") is True for g in as_dict(s.get("gains")).values())]
    return (reached or trained or [None])[-1]


def stage_text(stage: dict) -> str:
    """One stage in a cell: its length and each gradient mode's gain +- SE, or why it did not train."""
    gains_ = as_dict(stage.get("gains"))
    if stage.get("skipped"):
        return f"{stage.get('length'):,}: skipped, its adapter carried on ({stage['skipped']})"
    if not gains_:
        return f"{stage.get('length'):,}: not trained (probe out of range)"
    listed = ", ".join(
        f"{name} {number(g.get('gain')):+.3f} +- {number(g.get('standard_error')):.3f}" for name, g in gains_.items()
    )
    return f"{stage.get('length'):,}: {listed}"


def run_columns(part: dict, steps, window) -> dict:
    """The gain columns of one set of runs (a point's, or a curriculum stage's of `steps` steps)."""
    out = {}
    for name, gain in as_dict(part.get("gains")).items():
        out.update(
            {
                f"{name}_gain": number(gain.get("gain")),
                f"{name}_gain_se": number(gain.get("standard_error")),
                f"{name}_reached": gain.get("reached"),
                f"{name}_mean": number(gain.get("trained_mean")),
                "lr0_mean": number(gain.get("untrained_mean")),
            }
        )
    runs = as_dict(part.get("runs"))
    gap = gradient_gap(runs, steps - window) if runs and steps is not None and window is not None else None
    if gap is not None:  # what the exact gradient learned beyond the response-only one, on the same prompts
        out.update(exact_minus_response_only=gap["gain"], exact_minus_response_only_se=gap["standard_error"])
    # every run's steps, over all the commands a resumed point took (wall_seconds: the last command's)
    seconds = [number(s.get("seconds")) for run in runs.values() for s in run]
    out["train_seconds"] = sum(v for v in seconds if v is not None) if seconds else None
    return out


def tables(points: list[dict]) -> dict:
    def steps(point):
        metrics = point_parts(point)[1]
        parts = [("", metrics)] + [(f"{as_dict(s).get('length')}:", as_dict(s)) for s in metrics.get("stages") or []]
        return [
            {
                "point": point.get("point"),
                "run": f"{prefix}{name}",
                **{k: s.get(k) for k in ("step", "prompt", "reward_mean", "grad_norm", "seconds")},
            }
            for prefix, part in parts
            for name, run in as_dict(part.get("runs")).items()
            for s in run
        ]

    def stages(point):
        return [
            {"point": point.get("point"), **stage_row(as_dict(s))} for s in point_parts(point)[1].get("stages") or []
        ]

    mine = [p for p in points if p.get("kind") == "learning"]
    return {
        "steps": rows_of_points(mine, steps),
        "stages": rows_of_points(mine, stages),
        "heldout": rows_of_points(mine, heldout_rows),
    }


def heldout_curves(point: dict) -> list[tuple[dict, str, bool, dict]]:
    """(stage, task label, trained on, curve) of every held-out curve a curriculum point's stages recorded."""
    config, metrics = point_parts(point)
    trained = task_label(as_dict(as_dict(config.get("learning")).get("task")))
    return [
        (stage, label, label == trained, as_dict(curve))
        for stage in map(as_dict, metrics.get("stages") or [])
        if stage.get("heldout")
        for label, curve in [(trained, stage["heldout"])] + [(as_dict(c).get("label"), c) for c in stage_tasks(stage)]
    ]


def heldout_rows(point: dict) -> list[dict]:
    """A curriculum point's held-out cells: per stage, task, policy (the stage's adapter, the base) and length."""
    return [
        {
            "point": point.get("point"),
            "task": label,
            "trained": trained,
            "stage": stage.get("stage"),
            "policy": policy,
            **{k: r.get(k) for k in ("length", "success", "stderr", "n")},
        }
        for stage, label, trained, curve in heldout_curves(point)
        for policy, rows in (("adapter", curve.get("rows")), ("base", curve.get("base_rows")))
        for r in rows or []
    ]


def stage_row(stage: dict) -> dict:
    """A curriculum stage's row: its length and RoPE, the adapter it started from, its probe, each gradient mode's
    gain, and the held-out greedy success at its length with its adapter and without (the base)."""
    start, heldout = as_dict(stage.get("start_adapter")), as_dict(stage.get("heldout"))
    rope = as_dict(as_dict(stage.get("overrides")).get("rope_parameters"))
    length = stage.get("length")
    row = {
        "stage": stage.get("stage"),
        "length": stage.get("length"),
        "steps": stage.get("steps"),
        "rope": f"{rope.get('rope_type')} x{rope.get('factor')}" if rope else "native",
        "start_adapter": (
            f"stage {start.get('stage')} {start.get('run')} {str(start.get('sha256'))[:12]}"
            if start.get("stage") is not None
            else f"model.lora.init {str(start.get('sha256'))[:12]}"
        )
        if start
        else "model.path"
        if stage.get("carries") == "weights"
        else "model.lora",
        "probe_success": next((r.get("success") for r in as_dict(stage.get("probe")).get("rows", [])), None),
        "heldout_success": success_at(heldout.get("rows"), length),
        "heldout_base_success": success_at(heldout.get("base_rows"), length),
        "heldout_vs_start": heldout_change(stage),
        "heldout_eval_tasks": eval_cell(stage),
    }
    for name in ("response-only", "exact"):
        gain = as_dict(as_dict(stage.get("gains")).get(name))
        row.update({f"{name}_gain": number(gain.get("gain")), f"{name}_gain_se": number(gain.get("standard_error"))})
    row["lr0_mean"] = next((number(g.get("untrained_mean")) for g in as_dict(stage.get("gains")).values()), None)
    runs, steps, window = as_dict(stage.get("runs")), stage.get("steps"), stage.get("window")
    gap = gradient_gap(runs, steps - window) if runs and steps is not None and window is not None else None
    row["exact_minus_response_only"] = gap["gain"] if gap else None
    row["exact_minus_response_only_se"] = gap["standard_error"] if gap else None
    row["lr0_by_depth"] = depth_text(runs.get(UNTRAINED) or [])
    row["window_by_depth"] = (
        window_depth_text(runs, steps - window) if steps is not None and window is not None else None
    )
    seconds = [number(s.get("seconds")) for s in (runs.get("response-only") or [])[1:]]
    row["step_seconds"] = statistics.median(seconds) if seconds and None not in seconds else None
    peaks = [number(s.get("peak_allocated_bytes")) for s in runs.get("response-only") or []]
    row["step_peak_bytes"] = max((p for p in peaks if p is not None), default=None)
    return row


def heldout_change(stage: dict) -> str | None:
    """What the stage's training changed on held-out examples, paired: its probe (the starting policy) and its
    adapter's held-out curve at its length score the same seeds, so `+gained -lost of n (sign test p)`."""
    from longstraw.training.improvement import paired_change

    length, probe, heldout = stage.get("length"), as_dict(stage.get("probe")), as_dict(stage.get("heldout"))
    probed = next((r for r in probe.get("rows") or [] if r.get("length") == length), None)
    after = next((r for r in heldout.get("rows") or [] if r.get("length") == length), None)
    # records before the probe kept its seeds drew the same ones (the length curve's held-out range)
    seeds_differ = probe.get("seed_base", heldout.get("seed_base")) != heldout.get("seed_base")
    if not probed or not after or probed.get("depth") != after.get("depth") or seeds_differ:
        return None
    change = paired_change(probed.get("rewards") or [], after.get("rewards") or [])
    return f"+{change['gained']} -{change['lost']} of {change['examples']} (p {change['p']:.3f})"


def depth_text(steps: list[dict]) -> str | None:
    """A run's first-visit success by needle depth in one cell (None: its steps carry no depth)."""
    rows = success_by_depth(steps) if steps else None
    if rows is None:
        return None
    return "; ".join(f"{depth_label(r['depths'])}: {_success_cell(r['success'])} ({r['prompts']})" for r in rows)


def _success_cell(value) -> str:
    return "-" if value is None else format(value, ".2f")


def window_depth_text(runs: dict, first_step: int) -> str | None:
    """The response-only run's and lr 0's first-visit success by needle depth over the V4 window (steps from
    `first_step`), on the same prompts: `band: trained / lr 0 (prompts)`. None without both runs or their depths."""
    trained, untrained = (
        success_by_depth(runs[name], first_step=first_step) if runs.get(name) else None
        for name in ("response-only", UNTRAINED)
    )
    if trained is None or untrained is None:
        return None
    return "; ".join(
        f"{depth_label(t['depths'])}: {_success_cell(t['success'])} / {_success_cell(u['success'])} ({t['prompts']})"
        for t, u in zip(trained, untrained)
    )


def success_at(rows, length) -> float | None:
    """The greedy success of a held-out curve's rows at `length`, pooled over its depths (None: not measured)."""
    at = [r for r in rows or [] if r.get("length") == length]
    return sum(r["success"] * r["n"] for r in at) / sum(r["n"] for r in at) if at else None


def stage_tasks(stage: dict) -> list:
    """A curriculum stage's held-out curves of its eval tasks, in `learning.curriculum.eval_tasks`' order."""
    tasks = stage.get("heldout_tasks")
    return tasks if isinstance(tasks, list) else []


def eval_cell(stage: dict) -> str | None:
    """The eval tasks' held-out greedy success at the stage's length in one cell: the adapter's, then the base's."""

    def shown(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    length = stage.get("length")
    parts = [
        f"{c.get('label')}: {shown(success_at(c.get('rows'), length))} "
        f"(base {shown(success_at(c.get('base_rows'), length))})"
        for c in map(as_dict, stage_tasks(stage))
    ]
    return "; ".join(parts) or None


def figures(data, ceiling: dict, marks=()):
    rows = [r for r in data.of_kind("learning") if r.get("status") == "ok"]
    # a curriculum's stages restart the step count, so their runs would overlay on one axis: its held-out figure and
    # stages table show it, its steps table has every step
    single = [r for r in rows if not r.get("curriculum")]
    if single and data.extra.get("steps"):
        yield "reward_per_step", plot_rewards(single, data.extra["steps"], data.name)
    if rows and data.extra.get("heldout"):
        yield "heldout_by_stage", plot_heldout(rows, data.extra["heldout"], data.name)


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
            run_name = name.rsplit(":", 1)[-1]  # a curriculum stage's runs: "LENGTH:NAME"
            color = colors.get(run_name, "#55a868")
            lr = (row.get("lr") or 0) if run_name != UNTRAINED else 0
            ax.plot(x, mean, color=color, label=f"{name} (lr {lr:g})")
            ax.fill_between(
                x, [m - e for m, e in zip(mean, se)], [m + e for m, e in zip(mean, se)], color=color, alpha=0.2
            )
        ax.set(xlabel="step", ylabel="reward (mean of G samples)", ylim=(-0.02, 1.02))
        ax.set_title(f"{row.get('point')}: {row.get('prompt_length')} positions", fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


HELDOUT_COLUMNS = 4  # panels a line of the held-out figure


def plot_heldout(rows, cells, title: str):
    """One panel per curriculum point and task (a point's trained task first), `HELDOUT_COLUMNS` a line:
    `heldout_panel`."""
    from longstraw.plotting import draw

    points = [r.get("point") for r in rows if any(c.get("point") == r.get("point") for c in cells)]
    panels = [(p, task) for p in points for task in dict.fromkeys(c["task"] for c in cells if c.get("point") == p)]
    cols = min(HELDOUT_COLUMNS, len(panels))
    lines = -(-len(panels) // cols)
    fig, axes = draw.plt.subplots(lines, cols, figsize=(4.2 * cols, 2.9 * lines), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (point, task) in zip(axes.flat, panels):
        mine = [c for c in cells if c.get("point") == point and c.get("task") == task]
        heldout_panel(ax, mine, draw)
        trained = " (trained on)" if any(c.get("trained") is True for c in mine) else " (eval task)"
        ax.set_title(f"{point}\n{task}{trained}", fontsize=8)
    fig.suptitle(f"{title}: held-out greedy success, base model and each stage's adapter", fontsize=10)
    fig.tight_layout()
    return fig


def heldout_panel(ax, cells: list[dict], draw) -> None:
    """One task's held-out success against length: the last stage's base model (dashed, grey), each stage's
    adapter (a colour each, labelled with the length it trained at), the lines side by side at each length."""
    stages = sorted({int(c["stage"]) for c in cells})
    lines = [(f"base model (stage {stages[-1]}'s RoPE)", stages[-1], "base", "#8c8c8c", "--")]
    lines += [
        (f"stage {s} adapter", s, "adapter", draw.POINT_COLORS[i % len(draw.POINT_COLORS)], "-")
        for i, s in enumerate(stages)
    ]
    for j, (label, stage, policy, color, style) in enumerate(lines):
        at = [c for c in cells if int(c["stage"]) == stage and c.get("policy") == policy]
        at = sorted(at, key=lambda c: c["length"])
        if not at:
            continue
        shift = 1.03 ** (j - (len(lines) - 1) / 2)  # side by side on the log axis, not on top of each other
        trained_at = f" (trained at {at[-1]['length']:,})" if policy == "adapter" else ""
        ax.errorbar(
            [c["length"] * shift for c in at],
            [c["success"] for c in at],
            yerr=[c["stderr"] for c in at],
            marker="o",
            capsize=3,
            color=color,
            linestyle=style,
            label=label + trained_at,
        )
    lengths = sorted({int(c["length"]) for c in cells})
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [f"{n:,}" for n in lengths])
    ax.minorticks_off()
    ax.set(xlabel="prompt length (positions)", ylabel="greedy success", ylim=(-0.02, 1.02))
    ax.legend(fontsize=7)


def longest_runs(cfg: PointConfig) -> list | None:
    """With a probe, it trains at one of the probed lengths (a curriculum's stages: `models`)."""
    probe = cfg.learning.probe
    if probe is None or cfg.learning.curriculum is not None:
        return None
    return [("learning.probe.lengths", max(probe.lengths), "responses.length", cfg.responses.length)]


def models(cfg: PointConfig) -> list | None:
    """A curriculum builds the point's model once per stage, with the stage's overrides, for the stage's length."""
    if cfg.learning.curriculum is None:
        return None
    m = cfg.model
    return [
        Built(
            m.preset,
            m.path,
            {**m.overrides, **stage.overrides},
            overrides_key=f"learning.curriculum.stages[{i}].overrides",
            dtype=m.dtype,
            runs=((f"learning.curriculum.stages[{i}].length", stage.length, "responses.length", cfg.responses.length),),
        )
        for i, stage in enumerate(cfg.learning.curriculum.stages)
    ]


def tasks(cfg: PointConfig) -> list:
    probe, curriculum = cfg.learning.probe, cfg.learning.curriculum
    if curriculum is not None:
        lengths = ([s.length for s in curriculum.stages], "learning.curriculum.stages")
    elif probe is not None:
        lengths = (list(probe.lengths), "learning.probe.lengths")
    else:
        lengths = ([cfg.prompt.length], "prompt.length")
    evaluated = curriculum.eval_tasks if curriculum is not None else []
    return [("learning.task", cfg.learning.task, *lengths)] + [
        (f"learning.curriculum.eval_tasks[{i}]", spec, *lengths) for i, spec in enumerate(evaluated)
    ]


def kept_adapters(cfg: PointConfig) -> str | None:
    """The folder a curriculum with LoRA keeps its stages' adapters in (its `out`); one without keeps models."""
    curriculum = cfg.learning.curriculum
    return curriculum.out if curriculum is not None and cfg.model.lora is not None else None


def kept_models(cfg: PointConfig) -> dict[str, dict]:
    """The whole models a curriculum without LoRA keeps in its `out`, each stage's written with the stage's
    overrides over the model's."""
    curriculum = cfg.learning.curriculum
    if curriculum is None or curriculum.out is None or cfg.model.lora is not None:
        return {}
    return {str(curriculum.kept(i, "model")): stage.overrides for i, stage in enumerate(curriculum.stages)}


KIND = Kind(
    "learning",
    run=run,
    section=LearningConfig,
    trains=True,
    check=check,
    check_work=check_work,
    longest_runs=longest_runs,
    models=models,
    tasks=tasks,
    exact_key=lambda cfg: "learning.gradients" if "exact" in cfg.learning.gradients else None,
    adapters_out=kept_adapters,
    checkpoints_out=kept_models,
    columns=columns,
    tables=tables,
    extra_tables=EXTRA_TABLES,
    shown=SHOWN,
    figures=figures,
    captions=CAPTIONS,
)
