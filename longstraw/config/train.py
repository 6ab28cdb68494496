"""The GRPO trainer's config (`longstraw train CONFIG.yaml`, `longstraw.training.trainer`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from longstraw.config.grpo import GRPOConfig, grouped_objective
from longstraw.config.sections import CaptureConfig, ModelConfig, OptimizerConfig, ReplayConfig
from longstraw.config.typed import ConfigError, bounded, from_mapping


@dataclass
class SamplingSettings:
    """Rollouts from the resident state (`longstraw.training.rollout`); num_samples is the group size G."""

    num_samples: int = bounded(4, min=1)
    max_new_tokens: int = bounded(8, min=1)
    temperature: float = bounded(1.0, min=0.0)
    top_p: float = bounded(1.0, gt=0.0, max=1.0)


@dataclass
class ScheduleConfig:
    name: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = bounded(0, min=0)


@dataclass
class RefreshConfig:
    """When the reused prompt state is captured again: every K steps, never (new prompts only), or
    when the trainable parameters have moved `threshold` (L2) since the capture."""

    policy: Literal["every", "adaptive", "never"] = "every"
    every: int = bounded(1, min=1)
    threshold: Optional[float] = bounded(None, min=0.0)

    def __post_init__(self):
        if self.policy == "adaptive" and self.threshold is None:
            raise ValueError("threshold: the adaptive policy needs a number")


@dataclass
class OutputConfig:
    dir: str = "runs/train"
    checkpoint_every: int = bounded(0, min=0)  # 0: no checkpoints


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    task: dict = field(default_factory=lambda: {"name": "kv_retrieval", "length": 1024})
    steps: int = bounded(8, min=1)
    steps_per_prompt: int = bounded(4, min=1)
    seed: int = 0
    cp_size: int = bounded(1, min=1)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    # num_generations is the group size, sampling.num_samples
    grpo: GRPOConfig = field(default_factory=lambda: GRPOConfig(beta=0.04))
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    max_grad_norm: Optional[float] = bounded(1.0, gt=0)
    # "exact": the full-sequence gradient (capture with prefix_grad, backward_prefix each step); the
    # prompt-side term needs the current parameters' capture, so the state is captured every step
    gradient: Literal["response-only", "exact"] = "response-only"
    refresh: RefreshConfig = field(default_factory=RefreshConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    # bitwise-reproducible capture, scoring and replay (`longstraw.core.determinism`), at a cost in time
    deterministic: bool = False

    def __post_init__(self):
        if self.gradient == "exact" and (self.refresh.policy, self.refresh.every) != ("every", 1):
            raise ValueError("gradient: 'exact' needs a capture with the current parameters every step "
                             "(refresh: {policy: every, every: 1})")


def resolve_train(raw, source: str = "train config") -> TrainConfig:
    """A trainer config from its mapping: defaults filled in, every value checked (`ConfigError`
    names the source and key); `grpo.num_generations` follows `sampling.num_samples`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the train config must be a mapping, got {type(raw).__name__}")
    return from_mapping(TrainConfig, grouped_objective(raw, "sampling", "num_samples",
                                                       SamplingSettings.num_samples, source), source)
