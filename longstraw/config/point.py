"""An experiment point's config: what one `longstraw run` measures.

    cfg = kinds.resolve_point(yaml.safe_load(open("experiments/examples/step_cpu.yaml")), "step_cpu.yaml")
    cfg.grpo.num_generations, cfg.model.preset, to_mapping(cfg)     # typed; the plain dict results record

`PointConfig` holds the settings every kind shares; each kind's own section is declared by its kind
(`longstraw.kinds`), which builds the class a point resolves to (`point_class`). A point is resolved
once, when the plan is made (`longstraw.harness.plan`), and carried to the point as its resolved
mapping; resolving that mapping again gives the same config.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Literal

from longstraw.config.grpo import OLD_GROUP_SIZES, GRPOConfig, grouped_objective
from longstraw.config.sections import CaptureConfig, ModelConfig, OptimizerConfig, ReplayConfig
from longstraw.config.typed import ConfigError, bounded, from_mapping, to_mapping

OUR_MODES = ("replay", "hold_all", "naive")  # `longstraw.core.step`
# the peers' modes: each peer's name, added when it is registered (`longstraw.peers`, above the config)
PEER_MODES: list[str] = []


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
    probe_members: int | None = bounded(None, min=1)
    source: Literal["seeded", "rollouts"] = "seeded"
    task: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.source == "rollouts" and not self.task:
            raise ValueError("task: rollouts are rewarded by a task (e.g. {name: kv_retrieval})")
        if self.source == "rollouts" and self.probe_members is not None:
            raise ValueError("probe_members: a memory probe replays seeded responses (source: seeded)")


@dataclass
class MeasureConfig:
    kernel_rates: bool = False  # also time torch's SDPA and our attention/GEMM kernels on this device
    sdpa_positions: int = bounded(1 << 20, min=1)  # the causal SDPA rate's length (27B heads: 25 s at 1M)
    # CUDA: which allocation sites hold the memory at a sweep step's peak (allocator history; slows the step, so a
    # group size repeated in the sweep is traced on its first step only)
    allocation_sites: bool = False


@dataclass
class PointConfig:
    name: str = "unnamed"
    kind: str = "step"  # one of the registered kinds (`point_class` narrows it)
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
    grpo: GRPOConfig = field(default_factory=lambda: GRPOConfig(beta=0.04))
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    capture: CaptureConfig = field(default_factory=CaptureConfig)
    replay: ReplayConfig = field(default_factory=ReplayConfig)
    measure: MeasureConfig = field(default_factory=MeasureConfig)

    SECTIONS = ()  # the kinds' own sections (`point_class`): none here


@functools.cache
def point_class(kinds: tuple[str, ...], sections: tuple[tuple[str, type], ...]) -> type[PointConfig]:
    """The point config of these kinds: `kind` one of them, and one optional field per (kind, section type), named
    after its kind: a point's own kind's is set (its defaults where the file gives none), every other one is None."""
    own = dict(sections)

    def __post_init__(self):
        check_mode(self.mode, "mode")
        others = [s for s in own if s != self.kind and getattr(self, s) is not None]
        if others:
            raise ValueError(f"{others[0]}: a section of kind {others[0]}; this point is kind {self.kind}")
        if self.kind in own and getattr(self, self.kind) is None:
            setattr(self, self.kind, own[self.kind]())

    fields = [("kind", Literal[kinds], field(default="step"))]  # Literal of a tuple: one value per kind
    fields += [(name, section | None, field(default=None)) for name, section in sections]
    namespace = {"__post_init__": __post_init__, "SECTIONS": tuple(own), "__module__": __name__}
    return dataclasses.make_dataclass("PointConfig", fields, bases=(PointConfig,), namespace=namespace)


def point_mapping(cfg: PointConfig) -> dict:
    """The plain nested dict a result records: the shared sections and the point's own kind's."""
    return {k: v for k, v in to_mapping(cfg).items() if not (k in cfg.SECTIONS and v is None)}


def recorded_config(mapping: dict, kind: str, sections) -> dict:
    """A recorded result's config in today's shape (`sections`: the kinds' section names). Records before each
    point held only its own kind's section carried every kind's (their defaults): those of other kinds are
    dropped. Records before the group size had one name spelt it `responses.count` (which
    `grpo.num_generations` followed) or, for a learning point, `learning.num_samples`: it moves to
    `grpo.num_generations`."""
    out = {k: v for k, v in mapping.items() if k not in sections or k == kind}
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


def resolve_with(cls: type[PointConfig], raw, source: str = "config") -> PointConfig:
    """A point config of class `cls` (`point_class`) from its mapping: defaults filled in, every value checked
    (`ConfigError` names the source and key). The group size is `grpo.num_generations`."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the experiment config must be a mapping, got {type(raw).__name__}")
    return from_mapping(cls, grouped_objective(raw, source), source)


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


def with_group(cfg: GRPOConfig, num_generations: int) -> GRPOConfig:
    """The objective for a group of `num_generations` responses."""
    return dataclasses.replace(cfg, num_generations=num_generations)
