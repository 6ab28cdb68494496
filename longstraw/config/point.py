"""An experiment point's config: what one `longstraw run` measures (kinds: `longstraw.kinds`).

    cfg = resolve_point(yaml.safe_load(open("experiments/examples/step_cpu.yaml")), "step_cpu.yaml")
    cfg.grpo.num_generations, cfg.model.preset, to_mapping(cfg)     # typed; the plain dict results record

A point is resolved once, when the plan is made (`longstraw.harness.plan`), and carried to the
point as its resolved mapping; resolving that mapping again gives the same config.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field
from typing import Literal, Optional

from longstraw.config.grpo import GROUP_SIZE, OLD_GROUP_SIZES, GRPOConfig, grouped_objective
from longstraw.config.pretrain import PretrainConfig
from longstraw.config.sections import CaptureConfig, ModelConfig, OptimizerConfig, ReplayConfig
from longstraw.config.typed import ConfigError, bounded, from_mapping, to_mapping

KINDS = ("step", "capture", "capacity", "sweep", "staleness", "validation", "pretrain", "length_curve", "learning")
OUR_MODES = ("replay", "hold_all", "naive")  # `longstraw.core.step`
# the peers' modes: each peer's name, added when it is registered (`longstraw.peers`, above the config)
PEER_MODES: list[str] = []
VALIDATION_MODES = ("response-only", "exact")
VALIDATION_LEVELS = ("V1", "V2", "V3", "V4")


def check_mode(mode: str, key: str) -> None:
    """Refuse a mode that is neither ours nor a registered peer's (`key`: the field the message names)."""
    modes = [*OUR_MODES, *PEER_MODES]
    if mode not in modes:
        raise ValueError(f"{key}: must be one of {modes}, got {mode!r}")


@dataclass
class PromptConfig:
    """A seeded random prompt of `length` tokens (memory and time need shapes, not meaning)."""

    length: int = bounded(1024, min=1)
    seed: int = 0


@dataclass
class ResponsesConfig:
    """G (`grpo.num_generations`) seeded random responses of `length` tokens; `probe_members: k` replays only the
    first k.

    `source: rollouts` (kind step): the responses are the GRPO trainer's instead, every cycle sampled from
    the resident state (at most `length` tokens) and rewarded by `task`, whose example (length
    prompt.length, from the trainer's seed prompt.seed) is the prompt."""

    length: int = bounded(32, min=1)
    seed: int = 1
    probe_members: Optional[int] = bounded(None, min=1)
    source: Literal["seeded", "rollouts"] = "seeded"
    task: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.source == "rollouts" and not self.task:
            raise ValueError("task: rollouts are rewarded by a task (e.g. {name: kv_retrieval})")
        if self.source == "rollouts" and self.probe_members is not None:
            raise ValueError("probe_members: a memory probe replays seeded responses (source: seeded)")


@dataclass
class CapacityConfig:
    """The largest-prompt search (`longstraw.kinds.capacity`)."""

    min_length: int = bounded(1024, min=2)
    max_length: int = bounded(1 << 20, min=2)
    granularity: int = bounded(1024, min=1)
    ceiling_bytes: Optional[int] = bounded(None, min=1)
    time_limit_seconds: Optional[float] = bounded(None, gt=0)
    compare_modes: list[str] = field(default_factory=list)

    def __post_init__(self):
        for mode in self.compare_modes:
            check_mode(mode, "compare_modes")
        if self.min_length > self.max_length:
            raise ValueError(f"min_length {self.min_length} exceeds max_length {self.max_length}")


@dataclass
class SweepConfig:
    """One capture serving steps at these group sizes: replay's, then hold_all's."""

    replay: list[int] = field(default_factory=lambda: [2, 8])
    hold_all: list[int] = field(default_factory=lambda: [2, 4, 8])

    def __post_init__(self):
        for mode in ("replay", "hold_all"):
            if any(g < 1 for g in getattr(self, mode)):
                raise ValueError(f"{mode}: group sizes must be >= 1, got {getattr(self, mode)}")


@dataclass
class MeasureConfig:
    kernel_rates: bool = False  # also time torch's SDPA and our attention/GEMM kernels on this device
    sdpa_positions: int = bounded(1 << 20, min=1)  # the causal SDPA rate's length (27B heads: 25 s at 1M)
    # CUDA: which allocation sites hold the memory at a sweep step's peak (allocator history; slows the step, so a
    # group size repeated in the sweep is traced on its first step only)
    allocation_sites: bool = False


@dataclass
class StalenessConfig:
    """The fresh-prefix oracle (`longstraw.training.oracle`)."""

    steps: int = bounded(8, min=1)
    threshold: float = bounded(1.0e-3, gt=0)
    # L2 norm of the random parameter perturbation that measures the numerical floor (None: not measured)
    floor_perturbation: Optional[float] = bounded(None, gt=0)
    # a task spec: the prompt is its example (seed prompt.seed, length prompt.length) and the rewards are
    # its rewards; empty: a seeded random prompt and uniform random rewards (a model no task reward moves)
    task: dict = field(default_factory=dict)
    # with a task: how many prompt seeds (from prompt.seed on) to try for one whose first group's rewards
    # differ, so that the first step updates the parameters (1: prompt.seed whatever its rewards)
    prompt_search: int = bounded(1, min=1)


@dataclass
class ValidationConfig:
    """The validation levels (`longstraw.kinds.validation`): gradient modes and levels per path;
    `presets`: the models (empty: `model` alone); `tolerance`: V2/V3's (None: by dtype); `window`:
    V4's k steps; `train`: V4's trainer settings (a `longstraw train` config without model, grpo
    and capture, which are the point's)."""

    modes: list[Literal["response-only", "exact"]] = field(default_factory=lambda: ["response-only", "exact"])
    levels: list[Literal["V1", "V2", "V3", "V4"]] = field(default_factory=lambda: ["V1", "V2", "V3"])
    presets: list[str] = field(default_factory=list)
    tolerance: Optional[float] = bounded(None, gt=0)
    weights_seed: int = 0
    window: int = bounded(8, min=2)  # V4 pairs the last `window` steps' prompts (at least 2)
    train: dict = field(default_factory=dict)

    def __post_init__(self):
        if not self.modes or not self.levels:
            raise ValueError("modes and levels must not be empty")
        if "V4" in self.levels and not self.train:
            raise ValueError("train: level V4 needs the trainer's settings (task, steps, sampling, ...)")


@dataclass
class LengthCurveConfig:
    """Where a task-trained model (`model.path`) breaks with prompt length (`longstraw.training.length_curve`)."""

    task: dict = field(default_factory=lambda: {"name": "kv_retrieval", "num_needles": 4, "value_length": 2})
    lengths: list[int] = field(default_factory=lambda: [256, 1024, 4096])
    depths: Optional[list[float]] = None  # the queried needle's depth per cell (None: random, as trained)
    examples: int = bounded(32, min=2)  # held-out examples per (length, depth) cell
    method: Literal["capture", "forward"] = "capture"
    # a trained LoRA adapter (a peft folder: a trainer checkpoint's `adapter/`): the curve of the model with it and,
    # beside it on the same held-out examples, of the model without it (the base policy)
    adapter: Optional[str] = None

    def __post_init__(self):
        if not self.lengths or min(self.lengths) < 2:
            raise ValueError(f"lengths: a non-empty list of prompt lengths >= 2, got {self.lengths}")
        if self.depths is not None and not all(0 <= d <= 1 for d in self.depths):
            raise ValueError(f"depths: fractions in [0, 1], got {self.depths}")


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
    probe: Optional[LearningProbe] = None  # choose the length from the base model's success (else prompt.length)

    def __post_init__(self):
        if self.window > self.steps:
            raise ValueError(f"window: {self.window} is more than the {self.steps} steps")
        if not self.gradients:
            raise ValueError("gradients: at least one gradient mode")


# the kinds with a section of their own, named after the kind, and its type: a point holds its own kind's and no
# other
SECTION_TYPES = {
    "capacity": CapacityConfig,
    "sweep": SweepConfig,
    "staleness": StalenessConfig,
    "validation": ValidationConfig,
    "pretrain": PretrainConfig,
    "length_curve": LengthCurveConfig,
    "learning": LearningConfig,
}
KIND_SECTIONS = tuple(SECTION_TYPES)


@dataclass
class PointConfig:
    name: str = "unnamed"
    kind: Literal[KINDS] = "step"  # Literal of a tuple: one value per kind
    cp_size: int = bounded(1, min=1)  # context-parallel ranks; > 1 runs under `torchrun --nproc-per-node cp_size`
    # bitwise-reproducible capture, scoring and replay (`longstraw.core.determinism`), at a cost in time
    deterministic: bool = False
    model: ModelConfig = field(default_factory=ModelConfig)
    prompt: PromptConfig = field(default_factory=PromptConfig)
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)
    mode: str = "replay"  # ours or a peer's (`check_mode`)
    cycles: int = bounded(1, min=1)
    # kind step, replay/hold_all: capture the prompt anew every cycle (warm steps as a peer runs them: the prompt
    # each step), instead of one capture serving every cycle (prefix reuse)
    recapture: bool = False
    # num_generations is the group size G (a sweep sets it per step; a learning point's runs sample G each step)
    grpo: GRPOConfig = field(default_factory=lambda: GRPOConfig(num_generations=GROUP_SIZE, beta=0.04))
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)
    # the kinds' own sections (KIND_SECTIONS): the point's kind's is set (its defaults where the file gives
    # none), every other one is None
    capacity: Optional[CapacityConfig] = None
    sweep: Optional[SweepConfig] = None
    staleness: Optional[StalenessConfig] = None
    validation: Optional[ValidationConfig] = None
    pretrain: Optional[PretrainConfig] = None
    length_curve: Optional[LengthCurveConfig] = None
    learning: Optional[LearningConfig] = None

    def __post_init__(self):
        check_mode(self.mode, "mode")
        others = [s for s in KIND_SECTIONS if s != self.kind and getattr(self, s) is not None]
        if others:
            raise ValueError(f"{others[0]}: a section of kind {others[0]}; this point is kind {self.kind}")
        if self.kind in KIND_SECTIONS and getattr(self, self.kind) is None:
            setattr(self, self.kind, SECTION_TYPES[self.kind]())


def point_mapping(cfg: PointConfig) -> dict:
    """The plain nested dict a result records: the shared sections and the point's own kind's."""
    return {k: v for k, v in to_mapping(cfg).items() if not (k in KIND_SECTIONS and v is None)}


def recorded_config(mapping: dict, kind: str) -> dict:
    """A recorded result's config in today's shape. Records before each point held only its own kind's section
    carried every kind's (their defaults): those of other kinds are dropped. Records before the group size had
    one name spelt it `responses.count` (which `grpo.num_generations` followed) or, for a learning point,
    `learning.num_samples`: it moves to `grpo.num_generations`."""
    out = {k: v for k, v in mapping.items() if k not in KIND_SECTIONS or k == kind}
    size = None
    for section, key in OLD_GROUP_SIZES:  # responses.count, then a learning point's own, which wins
        if isinstance(out.get(section), dict) and key in out[section]:
            size = out[section][key]
            out[section] = {k: v for k, v in out[section].items() if k != key}
    if size is not None and isinstance(out.get("grpo"), dict):
        out["grpo"] = {**out["grpo"], "num_generations": size}
    return out


def recorded_grid(grid: dict) -> dict:
    """A recorded result's grid values under today's keys: the group size's old key, `responses.count`, or its
    place in a `responses` mapping the grid set, becomes `grpo.num_generations`."""
    out = {("grpo.num_generations" if k == "responses.count" else k): v for k, v in grid.items()}
    responses = out.get("responses")
    if isinstance(responses, dict) and "count" in responses:
        out["responses"] = {k: v for k, v in responses.items() if k != "count"}
        out["grpo.num_generations"] = responses["count"]
    return out


def resolve_point(raw, source: str = "config") -> PointConfig:
    """A point config from its mapping: defaults filled in, every value checked (`ConfigError` names
    the source and key). The group size is `grpo.num_generations`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the experiment config must be a mapping, got {type(raw).__name__}")
    return from_mapping(PointConfig, grouped_objective(raw, GROUP_SIZE, source), source)


def trainer_sections(cfg: PointConfig, out_dir) -> dict:
    """What a trainer run inside a point takes from the point: its model, objective (its group size too),
    capture and replay settings and CP size; writing under `out_dir`, no checkpoints."""
    return {
        "model": to_mapping(cfg.model),
        "grpo": to_mapping(cfg.grpo),
        "capture": to_mapping(cfg.capture),
        "replay": to_mapping(cfg.replay),
        "cp_size": cfg.cp_size,
        "deterministic": cfg.deterministic,
        "output": {"dir": str(out_dir), "checkpoint_every": 0},
    }


def trainer_mapping(cfg: PointConfig, lr: float, out_dir) -> dict:
    """The trainer's config for a validation point's V4: `trainer_sections` and `lr`, then
    `validation.train` (task, steps, sampling, ...)."""
    train = copy.deepcopy(cfg.validation.train)
    sections = trainer_sections(cfg, out_dir)
    merged = {**sections, **train}
    merged["grpo"] = {**sections["grpo"], **train.get("grpo", {})}  # the trainer's own group size, the point's rest
    merged["optimizer"] = {**train.get("optimizer", {}), "lr": lr}
    merged["output"] = {"dir": str(out_dir), "checkpoint_every": 0}
    return merged


def cycles_mapping(cfg: PointConfig, out_dir) -> dict:
    """The trainer's config for a step point with `responses.source: rollouts`: `cycles` steps on one
    prompt and one capture (refresh never), G samples of at most `responses.length` tokens, the point's
    optimizer."""
    r = cfg.responses
    return {
        **trainer_sections(cfg, out_dir),
        "task": {**r.task, "length": cfg.prompt.length},
        "steps": cfg.cycles,
        "steps_per_prompt": cfg.cycles,
        "seed": cfg.prompt.seed,
        "sampling": {"max_new_tokens": r.length},
        "optimizer": to_mapping(cfg.optimizer),
        "refresh": {"policy": "never"},
    }


def with_group(cfg: GRPOConfig, count: int) -> GRPOConfig:
    """The objective for a group of `count` responses."""
    return dataclasses.replace(cfg, num_generations=count)
