"""Config sections shared by experiment points and the trainers: the model, capture, optimizer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from longstraw.config.typed import bounded

DTYPES = ("float32", "bfloat16", "float16", "float64")
Dtype = Literal["float32", "bfloat16", "float16", "float64"]
DEVICE_PATTERN = r"cpu|cuda(:\d+)?"


@dataclass
class LoraConfig:
    """A peft LoRA adapter (`longstraw.models.lora.apply_lora`)."""

    r: int = bounded(16, min=1)
    alpha: int | None = bounded(None, min=1)
    dropout: float = bounded(0.0, min=0.0, max=1.0)  # only 0 runs (see __post_init__)
    # randomise LoRA's B too: peft's zero-B adapter gives the A matrices zero gradient (tests want every path)
    init_random: bool = False
    # which projections get LoRA (`longstraw.models.lora.TARGET_SETS`): attention = attention, MLA and GDN
    # projections; all-linear = those and the MLP ones (dense FFN, MoE shared expert), never routers or lm_head
    targets: Literal["attention", "all-linear"] = "attention"
    # the adapters' dtype: float32 (peft's default: every LoRA product upcasts the activations) or the model's
    # compute dtype (bf16 products; the optimizer then steps float32 master copies, `MasterWeightsAdamW`)
    dtype: Literal["float32", "model"] = "float32"
    # a trained peft adapter folder (a trainer checkpoint's `adapter/`) whose weights this adapter starts from
    # instead of peft's initialisation; its rank and projections must be this config's (a curriculum's stage goes
    # on from the stage before it: `longstraw.kinds.learning_curriculum`)
    init: str | None = None

    def __post_init__(self):
        if self.dropout > 0:  # `longstraw.core.transaction.check_deterministic` refuses it on the model too
            raise ValueError(
                f"dropout: must be 0, got {self.dropout}: dropout makes scoring and replay random, so "
                "the old-policy log-probs would not be the replay's and the on-policy ratio not 1"
            )


@dataclass
class ModelConfig:
    """The policy: a named preset (random weights from `seed`) or a local checkpoint (`path`)."""

    preset: str = "tiny-qwen3_5"
    path: str | None = None
    dtype: Dtype = "float32"
    device: str = bounded("cpu", pattern=DEVICE_PATTERN)
    seed: int = 0
    lora: LoraConfig | None = None
    nf4: bool = False
    overrides: dict = field(
        default_factory=dict
    )  # HF config fields over the preset's (or the checkpoint's config.json)
    # the kernel paged attention's "auto" runs on CUDA (`longstraw.kernels.paged_attention.forward_kernel`): cudnn
    # (fastest in steady state; each new shape builds a plan inside the first call that meets it) or flash (none)
    attention_kernel: Literal["cudnn", "flash"] = "cudnn"


@dataclass
class CaptureConfig:
    """`longstraw.capture` settings; unset ones keep capture's defaults."""

    chunk_size: int | None = bounded(None, min=1)
    order: Literal["auto", "chunk", "layer"] = "auto"
    memory_budget_bytes: int | None = bounded(None, min=0)
    host_pages: bool = False
    # a prompt longer than the model's max_position_embeddings is refused unless this is set
    beyond_max_positions: bool = False

    def kwargs(self) -> dict:
        """The keyword arguments of `capture` this config sets."""
        return {k: v for k, v in vars(self).items() if v not in (None, False) or k == "order"}


@dataclass
class ReplayConfig:
    """How the responses are replayed under autograd (`longstraw.replay`)."""

    # whole-layer activation checkpointing: each layer keeps its input and recomputes in the backward
    checkpoint_layers: bool = False
    # members replayed together, one graph and one backward per batch of k (mode replay); "auto": the first
    # member alone, then as many as its graph bytes fit half the device's free memory (`StepOptions`)
    micro_batch: int | Literal["auto"] = bounded(1, min=1)
    # the members, their losses and their backward as one CUDA graph recorded on the first step and launched on
    # later ones (`longstraw.core.member_graphs`), on CUDA: kind step (mode replay), or the trainer's response-only
    # runs (each sampled group padded to the answer budget, so one graph serves every step; the exact gradient's
    # runs replay eagerly); "auto" micro_batch sized by one member when recording
    cuda_graph: bool = False


def micro_batch_refusal(micro_batch, mode: str, context_parallel: bool) -> str | None:
    """Why members cannot be replayed `micro_batch` at a time here, or None: batches of members are mode
    replay's, on one process. The one rule a step's options (`StepOptions`) and a point's config are checked by."""
    if micro_batch == 1:
        return None
    if mode != "replay":
        return f"micro_batch={micro_batch!r} batches replayed members: mode 'replay' only, not {mode!r}"
    if context_parallel:
        return "micro_batch > 1 is not implemented for a context-parallel state"
    return None


@dataclass
class EnvironmentConfig:
    """Multi-turn rollouts (`longstraw.training.agent_rollout`) in an environment (`longstraw.training.environments`):
    `name` a built-in (`lookup`, `ruler_lookup`) or a class (`package.module:Class`, `path/to/file.py:Class`), as
    reward functions are named, built with the keywords `args`; a trajectory takes at most `max_turns` actions of
    at most `max_action_tokens` tokens each, within the sampling token budget (actions and observations)."""

    name: str = ""
    args: dict = field(default_factory=dict)
    max_turns: int = bounded(4, min=1)
    max_action_tokens: int = bounded(32, min=1)

    def __post_init__(self):
        if not self.name:
            raise ValueError("name: the environment's name (a built-in, or package.module:Class)")


@dataclass
class OptimizerConfig:
    """AdamW (torch's default weight decay unless set)."""

    lr: float = bounded(1.0e-4, min=0.0)
    weight_decay: float = bounded(0.01, min=0.0)
    # float32 master weights for bf16/fp16 trainable parameters (`longstraw.training.optimizer`); null: on
    # exactly when a trainable parameter is low precision (full-parameter training of a bf16 model)
    master_weights: bool | None = None
