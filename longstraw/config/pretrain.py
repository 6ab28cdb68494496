"""Pretraining a preset from random initialisation on a synthetic task (`longstraw pretrain`,
`longstraw.training.pretrain`). Defaults: the CPU recipe measured for `learn-tiny-hybrid`."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from longstraw.config.sections import DEVICE_PATTERN, Dtype
from longstraw.config.typed import bounded


@dataclass
class PretrainConfig:
    model: str = "learn-tiny-hybrid"  # a preset of longstraw.models.PRESETS
    # continue from this checkpoint (a `save_pretrained` folder, e.g. an earlier run's OUT/checkpoint) instead of
    # a random initialisation; `model` then only names the preset it was made from (model_overrides must be empty)
    init: str | None = None
    model_overrides: dict = field(default_factory=dict)  # config fields over the preset's
    dtype: Dtype = "float32"  # parameter (master) dtype
    autocast: Dtype | None = None  # e.g. "bfloat16" on CUDA: forward/backward in bf16, fp32 master weights
    device: str = bounded("cpu", pattern=DEVICE_PATTERN)
    seed: int = 0  # model init, length draws, and the training seed range
    # HF's torch GDN kernel instead of fla's (whose chunk backward fails on Hopper with Triton 3.4-3.7);
    # None: on CUDA only (on CPU HF takes its torch kernel anyway)
    hf_torch_gdn: bool | None = None
    # task (its `length` is set per batch from `lengths`)
    task: dict = field(
        default_factory=lambda: {"name": "mqar", "num_needles": 4, "value_length": 2, "answer_marker": 0.5}
    )
    # curriculum: [{"until": step, "lengths": [...] (optional), **task overrides}, ...]; a step before a stage's
    # `until` (the first such stage) trains on the task with that stage's overrides (and lengths), later steps
    # on `task` and `lengths` themselves. Default: no ANSWER marker and no filler first (28 = 4 needles of 6
    # tokens, the query and one spare token), then half-marked without filler, then with filler
    stages: list[dict] = field(
        default_factory=lambda: [
            {"until": 800, "answer_marker": 0.0, "lengths": [28]},
            {"until": 1600, "lengths": [28]},
        ]
    )
    # warm-up data mixed in: each step trains on `aux_task` with probability `aux_fraction` (a stage may set
    # its own "aux_fraction"); e.g. {"name": "periodic"} (look-back heads)
    aux_task: dict | None = None
    aux_fraction: float = bounded(0.0, min=0.0, max=1.0)
    lengths: list[int] = field(default_factory=lambda: [32, 64, 128, 256])
    batch_size: int = bounded(64, min=1)
    batch_tokens: int | None = bounded(2048, min=1)  # when set, batch = max(1, batch_tokens // length)
    # optimisation
    steps: int = bounded(2500, min=1)
    # stop after the step that passes this many training seconds (a run that must fit one command); the curve
    # says where it stopped. The schedule still counts to `steps`, so a cosine decay is cut short, not squeezed
    time_limit_seconds: float | None = bounded(None, gt=0.0)
    lr: float = bounded(1e-3, gt=0.0)
    warmup_steps: int = bounded(20, min=0)
    min_lr_ratio: float = bounded(1.0, min=0.0, max=1.0)  # cosine decays to lr * min_lr_ratio (1: constant)
    weight_decay: float = bounded(0.0, min=0.0)
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    grad_clip: float = bounded(1.0, gt=0.0)
    loss: Literal["answer", "next_token"] = "answer"
    # evaluation
    eval_every: int = bounded(500, min=0)  # 0: only at the end
    # default: kv_retrieval with the task's needles and value length (the task GRPO trains on)
    eval_task: dict | None = field(
        default_factory=lambda: {"name": "kv_retrieval", "num_needles": 4, "value_length": 2}
    )
    eval_lengths: list[int] | None = field(default_factory=lambda: [256, 1024, 2048])  # None: training lengths
    eval_examples: int = bounded(128, min=1)
    eval_batch_size: int = bounded(32, min=1)
    # output: OUT/checkpoint and OUT/curve.json; None writes nothing
    out: str | None = None
    progress: bool = True

    def __post_init__(self):
        if not self.lengths or min(self.lengths) < 2:
            raise ValueError(f"lengths: a non-empty list of prompt lengths >= 2, got {self.lengths}")
        if self.init is not None and self.model_overrides:
            raise ValueError("model_overrides: a run that starts from `init` takes the checkpoint's config as it is")
        if len(self.betas) != 2:
            raise ValueError(f"betas: two numbers, got {self.betas}")
