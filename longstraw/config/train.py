"""The GRPO trainer's config (`longstraw train CONFIG.yaml`, `longstraw.training.trainer`).

Prompts come from a synthetic token task (`task`) or from a text dataset (`dataset`, with
`tokenizer`, `reward_funcs` and `reward_weights`: `longstraw.training.text_tasks`). Settings that
TRL's `GRPOConfig` also has may be given flat under TRL's name (`learning_rate: 1e-5`,
`num_generations: 8`, ...: `TRL_NAMES`); each is the same setting as its sectioned key here, which
is what the resolved config (and a checkpoint) records. Giving both with different values is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from longstraw.config.grpo import GRPOConfig, grouped_objective
from longstraw.config.sections import CaptureConfig, EnvironmentConfig, ModelConfig, OptimizerConfig, ReplayConfig
from longstraw.config.typed import ConfigError, bounded, from_mapping


@dataclass
class SamplingSettings:
    """Rollouts from the resident state (`longstraw.training.rollout`): grpo.num_generations of them per step."""

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
    threshold: float | None = bounded(None, min=0.0)

    def __post_init__(self):
        if self.policy == "adaptive" and self.threshold is None:
            raise ValueError("threshold: the adaptive policy needs a number")


@dataclass
class OutputConfig:
    dir: str = "runs/train"
    checkpoint_every: int = bounded(0, min=0)  # 0: no checkpoints


@dataclass
class TokenizerConfig:
    """The tokenizer of a text dataset's prompts and completions (a local folder; no hub access)."""

    path: str | None = None  # default: model.path (a checkpoint saved with its tokenizer)
    # a Jinja chat template replacing the tokenizer's own (TRL: `chat_template_path`)
    chat_template: str | None = None
    # extra keyword arguments of `apply_chat_template` (TRL's `chat_template_kwargs`, e.g. enable_thinking)
    chat_template_kwargs: dict = field(default_factory=dict)
    # a string prompt becomes one user message and goes through the chat template (TRL: tokenized as is)
    wrap_text_prompts: bool = False


@dataclass
class DatasetConfig:
    """A dataset of prompts with a `prompt` column (TRL's standard or conversational format): a local
    file (`path`: JSONL read here; other suffixes, or `loader: datasets`, through HF `datasets`) or a
    HF `datasets` name (`name`, `config`, `split`)."""

    path: str | None = None
    name: str | None = None  # TRL script: dataset_name
    config: str | None = None  # TRL script: dataset_config
    split: str = "train"  # TRL script: dataset_train_split
    loader: Literal["auto", "jsonl", "datasets"] = "auto"
    # a new seeded order of the rows each pass over the dataset (TRL: shuffle_dataset, on by default)
    shuffle: bool = True

    def __post_init__(self):
        if (self.path is None) == (self.name is None):
            raise ValueError("path: give a dataset file (path) or a HF datasets name (name), one of them")
        if self.name is not None and self.loader == "jsonl":
            raise ValueError("loader: 'jsonl' reads a local file (path), not a datasets name")


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    # a synthetic token task (`longstraw.training.tasks`); unset (null) when `dataset` gives the prompts
    task: dict | None = field(default_factory=lambda: {"name": "kv_retrieval", "length": 1024})
    steps: int = bounded(8, min=1)
    steps_per_prompt: int = bounded(4, min=1)
    seed: int = 0
    cp_size: int = bounded(1, min=1)
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    # num_generations is the group size G: responses sampled per step
    grpo: GRPOConfig = field(default_factory=lambda: GRPOConfig(beta=0.04))
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(weight_decay=0.0))
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    max_grad_norm: float | None = bounded(1.0, gt=0)
    # "exact": the full-sequence gradient (capture with prefix_grad, backward_prefix each step); the
    # prompt-side term needs the current parameters' capture, so the state is captured every step
    gradient: Literal["response-only", "exact"] = "response-only"
    refresh: RefreshConfig = field(default_factory=RefreshConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    # where each step's metrics also go, for watching a run live (TRL's `report_to`; `training.watch`): the JSONL
    # stays the record
    report_to: Literal["none", "tensorboard", "trackio"] = "none"
    # bitwise-reproducible capture, scoring and replay (`longstraw.core.determinism`), at a cost in time
    deterministic: bool = False
    # text prompts (`longstraw.training.text_tasks`): a dataset, its tokenizer, TRL-style reward functions
    # (`package.module:function`, `package.module.function` or `file.py:function`) and their weights
    tokenizer: TokenizerConfig | None = None
    dataset: DatasetConfig | None = None
    reward_funcs: list[str] = field(default_factory=list)
    reward_weights: list[float] | None = None  # default: 1.0 each
    # call each reward function once on the first prompt with G empty completions before any model work
    # (a function that fails, or returns the wrong number of rewards, is named before the run starts)
    check_reward_funcs: bool = True
    # multi-turn rollouts: each of the G rows acts in its own environment, reset on the task's example (its
    # `info`); the rewards are the environment's, the loss is on the actions only (`training.agent_step`)
    environment: EnvironmentConfig | None = None

    def __post_init__(self):
        if self.dataset is None:
            if self.task is None:
                raise ValueError("task: give a synthetic task or a text dataset (dataset)")
            for key in ("tokenizer", "reward_funcs", "reward_weights"):
                if getattr(self, key):
                    raise ValueError(
                        f"{key}: belongs to a text dataset (dataset), and there is none; a synthetic "
                        "task (task) has its own tokens and reward"
                    )
        else:
            if self.task is not None:
                raise ValueError(
                    "task: a synthetic task and a text dataset (dataset) are two sources of prompts; give one"
                )
            if not self.reward_funcs:
                raise ValueError(
                    "reward_funcs: a text dataset needs at least one reward function (package.module:function)"
                )
        if self.reward_weights is not None and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(
                f"reward_weights: {len(self.reward_weights)} weights for {len(self.reward_funcs)} "
                "reward functions (reward_funcs); give one per function, or none (1.0 each)"
            )
        if self.replay.cuda_graph and (not self.model.device.startswith("cuda") or self.cp_size > 1):
            raise ValueError(
                f"replay.cuda_graph: records the members on one CUDA device; model.device is "
                f"{self.model.device!r} and cp_size {self.cp_size}"
            )
        self._check_environment()
        if self.gradient == "exact" and (self.refresh.policy, self.refresh.every) != ("every", 1):
            raise ValueError(
                "gradient: 'exact' needs a capture with the current parameters every step "
                "(refresh: {policy: every, every: 1})"
            )

    def _check_environment(self):
        if self.environment is not None and self.dataset is not None:
            raise ValueError(
                "environment: multi-turn rollouts take their prompts from a task (task), not yet from a text dataset"
            )


# TRL `GRPOConfig` (and TRL script) names -> the key paths here that hold the same setting. TRL's
# `max_completion_length` is both the generation limit and the length dr_grpo normalises by.
TRL_NAMES = {
    "num_generations": [("grpo", "num_generations")],
    "max_completion_length": [("sampling", "max_new_tokens"), ("grpo", "max_completion_length")],
    "temperature": [("sampling", "temperature")],
    "top_p": [("sampling", "top_p")],
    "beta": [("grpo", "beta")],
    "epsilon": [("grpo", "epsilon")],
    "epsilon_high": [("grpo", "epsilon_high")],
    "loss_type": [("grpo", "loss_type")],
    "scale_rewards": [("grpo", "scale_rewards")],
    "learning_rate": [("optimizer", "lr")],
    "weight_decay": [("optimizer", "weight_decay")],
    "max_steps": [("steps",)],
    "shuffle_dataset": [("dataset", "shuffle")],
    "chat_template_kwargs": [("tokenizer", "chat_template_kwargs")],
    "dataset_name": [("dataset", "name")],
    "dataset_config": [("dataset", "config")],
    "dataset_train_split": [("dataset", "split")],
}


def _missing(mapping, path):
    node = mapping
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return True
        node = node[key]
    return False


def _get(mapping, path):
    for key in path:
        mapping = mapping[key]
    return mapping


def apply_trl_names(raw: dict, source: str = "train config") -> dict:
    """`raw` with each flat TRL-named key moved to the key path(s) that hold it here (`TRL_NAMES`);
    a value given both ways must be the same."""
    out = {k: v for k, v in raw.items() if k not in TRL_NAMES}
    out.update({k: dict(v) for k, v in out.items() if isinstance(v, dict)})  # sections copied before writing
    for name, paths in TRL_NAMES.items():
        if name not in raw:
            continue
        value = raw[name]
        for path in paths:
            shown = ".".join(path)
            if len(path) > 1:
                section = out.get(path[0])
                if section is None:
                    section = out[path[0]] = {}
                if not isinstance(section, dict):
                    raise ConfigError(f"{source}: {path[0]}: expected a mapping, got {section!r}")
            if not _missing(out, path) and _get(out, path) != value:
                raise ConfigError(
                    f"{source}: {name}: TRL's name for {shown}, which says {_get(out, path)!r}; "
                    f"got {value!r} (give one of them)"
                )
            if len(path) > 1:
                out[path[0]][path[1]] = value
            else:
                out[path[0]] = value
    return out


def resolve_train(raw, source: str = "train config") -> TrainConfig:
    """A trainer config from its mapping: TRL's flat names moved to their sections (`TRL_NAMES`),
    defaults filled in, every value checked (`ConfigError` names the source and key);
    the group size is `grpo.num_generations`; with a `dataset` there is no task."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the train config must be a mapping, got {type(raw).__name__}")
    raw = apply_trl_names(raw, source)
    if raw.get("dataset") is not None:
        raw.setdefault("task", None)
    return from_mapping(TrainConfig, grouped_objective(raw, source), source)
