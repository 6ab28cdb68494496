"""The policy a point or a trainer trains, from its `ModelConfig`: a preset with random weights or a
local checkpoint, optionally NF4-quantised, optionally wrapped in a LoRA adapter."""

from __future__ import annotations

import torch

from longstraw.config.sections import ModelConfig
from longstraw.models.presets import build_model, load_pretrained

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def build_policy(cfg: ModelConfig):
    dtype = DTYPES[cfg.dtype]
    if cfg.path:
        model = load_pretrained(cfg.path, dtype=dtype, device=cfg.device, **cfg.overrides)  # over its config.json
    else:
        model = build_model(cfg.preset, seed=cfg.seed, dtype=dtype, device=cfg.device, **cfg.overrides)
    check_finite_weights(model, f"model.path: {cfg.path}" if cfg.path else f"model.preset: {cfg.preset}")
    if cfg.nf4:
        from longstraw.models.quant import quantize_nf4  # bitsandbytes only where a point asks for NF4

        model = quantize_nf4(model, compute_dtype=dtype)
    if cfg.lora is not None:
        from longstraw.models.lora import apply_lora

        model = apply_lora(
            model,
            r=cfg.lora.r,
            alpha=cfg.lora.alpha,
            dropout=cfg.lora.dropout,
            init_random=cfg.lora.init_random,
            targets=cfg.lora.targets,
            dtype=dtype if cfg.lora.dtype == "model" else None,
        )
        if cfg.lora.init is not None:
            from longstraw.models.lora import load_adapter_weights

            load_adapter_weights(model, cfg.lora.init)
    return model


def check_finite_weights(model, source: str) -> None:
    """Refuse a model whose weights hold NaN or inf, naming them: every log-prob through such a weight is NaN,
    and a NaN in a frozen weight would otherwise surface later as a state that matches no model."""
    bad = [
        name
        for name, p in model.named_parameters()
        if p.is_floating_point()
        and p.numel()
        and not bool(torch.isfinite(torch.stack(torch.aminmax(p.detach()))).all())
    ]
    if bad:
        listed = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        raise ValueError(f"{source}: weights hold non-finite values (NaN or inf): {listed}")
