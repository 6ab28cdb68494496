"""Decoding's stacked projections: one GEMM where a decoding step would run several on the same input.

A decoding step is a few rows, and each projection's GEMM a latency-bound kernel (on an H100, 3.3 us for
SmolLM2's 576 x 576 q_proj at 8 rows, whose weight streams in 0.2 us). An attention layer's q, k and v, an MLP's
gate and up read the same input: within `stacked_projections_for_decoding()`, `stacked_linear(linears, x)` is their
outputs side by side from one GEMM over their weights concatenated on the output axis (a LoRA layer's merged weight,
`lora_linear.merged_lora_weight`, as a decoding step computes it unstacked), built once per decode and kept (in a
sampling session's `KeptWeights`, across decodes, refreshed in place).
The cost is memory while sampling: one copy of the stacked weights (beside the model's own for a layer without an
adapter; in place of the merged weights a LoRA layer's decoding builds anyway). The reference is each layer's own call.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from longstraw.models.lora_linear import KeptWeights, in_place_lora_class, merged_lora_weight, single_plain_adapter

# inside stacked_projections_for_decoding(): the linears' tuple -> (weight, bias), or None where they do not stack
_stacked: KeptWeights | None = None


@contextmanager
def stacked_projections_for_decoding(enabled: bool = True, kept: KeptWeights | None = None):
    """Within the block (when `enabled`), `stacked_linear` stacks; each stacked weight is built once and kept (in
    `kept`, a sampling session's store, when given)."""
    global _stacked
    store = KeptWeights() if kept is None else kept
    previous, _stacked = _stacked, (store if enabled else None)
    try:
        yield
    finally:
        _stacked = previous


def _weight_and_bias(linear, dtype):
    """What `linear(x)` multiplies a decoding step's rows by: a plain `nn.Linear`'s weight and bias, an adopted
    LoRA layer's merged weight (one plain adapter, no bias on lora_B) and its base's bias; None for anything else."""
    if type(linear) is nn.Linear:
        return linear.weight, linear.bias
    name = single_plain_adapter(linear) if type(linear) is in_place_lora_class() else None
    if name is None:
        return None
    base, lora_A, lora_B = linear.base_layer, linear.lora_A[name], linear.lora_B[name]
    if lora_B.bias is not None or base.weight.dtype != dtype:
        return None
    return merged_lora_weight(base.weight, lora_A.weight, lora_B.weight, linear.scaling[name], dtype), base.bias


def _build(linears, dtype):
    parts = [_weight_and_bias(linear, dtype) for linear in linears]
    if any(p is None for p in parts) or len({p[0].dtype for p in parts} | {dtype}) != 1:
        return None
    with torch.no_grad():
        weight = torch.cat([w for w, _ in parts])
        if all(b is None for _, b in parts):
            return weight, None
        bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts])
    return weight, bias


def stacked_linear(linears: tuple, x: torch.Tensor) -> torch.Tensor | None:
    """The outputs of `linears` on `x`, concatenated on the last axis, from one GEMM; None outside
    `stacked_projections_for_decoding()`, under autograd, or where a layer is neither a plain linear nor an adopted
    LoRA layer with one plain adapter in x's dtype (the caller then runs the layers themselves)."""
    if _stacked is None or torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
        return None
    built = _stacked.get(linears, functools.partial(_build, linears, x.dtype))
    return None if built is None else F.linear(x, *built)
