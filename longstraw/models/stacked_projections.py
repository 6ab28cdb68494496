"""Decoding's stacked projections: one GEMM where a decoding step would run several on the same input.

A decoding step is a few rows, and each projection's GEMM a latency-bound kernel (on an H100, 3.3 us for
SmolLM2's 576 x 576 q_proj at 8 rows, whose weight streams in 0.2 us). An attention layer's q, k and v, an MLP's
gate and up read the same input: within `stacked_projections_for_decoding()`, `stacked_linear(linears, x)` is their
outputs side by side from one GEMM over their weights concatenated on the output axis (a LoRA layer's merged weight,
`lora_linear.merged_lora_weight`, as a decoding step computes it unstacked), built once per decode and kept (in a
sampling session's `KeptWeights`, across decodes, refreshed in place).
The cost is memory while sampling: one copy of the stacked weights (beside the model's own for a layer without an
adapter; in place of the merged weights a LoRA layer's decoding builds anyway). The reference is each layer's own call.
`stacked_weight` hands out the kept weight itself (one layer's too: a GEMM that sums into the residual); with
`fold_norms` on it may fold the weight of the RMSNorm the layers read into theirs (`families.folded_norms`).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from longstraw.kernels.rms_norm import foldable_norm
from longstraw.models.lora_linear import KeptWeights, in_place_lora_class, merged_lora_weight, single_plain_adapter

# inside stacked_projections_for_decoding(): the linears' tuple (and a folded norm) -> (weight, bias), or None where
# they do not stack
_stacked: KeptWeights | None = None
_fold_norms = False


@contextmanager
def stacked_projections_for_decoding(enabled: bool = True, kept: KeptWeights | None = None, fold_norms: bool = False):
    """Within the block (when `enabled`), `stacked_linear` stacks; each stacked weight is built once and kept (in
    `kept`, a sampling session's store, when given). `fold_norms`: `stacked_weight(..., norm=)` folds norms in."""
    global _stacked, _fold_norms
    store = KeptWeights() if kept is None else kept
    previous, (_stacked, _fold_norms) = (_stacked, _fold_norms), ((store, fold_norms) if enabled else (None, False))
    try:
        yield
    finally:
        _stacked, _fold_norms = previous


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


def _build(linears, dtype, norm=None):
    parts = [_weight_and_bias(linear, dtype) for linear in linears]
    if any(p is None for p in parts) or len({p[0].dtype for p in parts} | {dtype}) != 1:
        return None
    if norm is not None and any(b is not None for _, b in parts):  # the row scale after the GEMM would scale a bias
        return None
    with torch.no_grad():
        weight = parts[0][0] if len(parts) == 1 else torch.cat([w for w, _ in parts])  # one layer's: no copy
        if norm is not None:  # W diag(w): the norm's weight on the input axis, multiplied wide and rounded once
            wide = torch.promote_types(dtype, torch.float32)
            weight = (weight.to(wide) * norm.weight.to(wide)).to(dtype)
        if all(b is None for _, b in parts):
            return weight, None
        bias = torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in parts])
    return weight, bias


def stacked_weight(linears: tuple, x: torch.Tensor, norm=None) -> tuple | None:
    """(weight, bias) that `linears` stacked multiply x's rows by, built once and kept; with `norm` (the RMSNorm whose
    output they read, `rms_norm.foldable_norm`), W diag(w) for the norm's weight w and no bias, so that the norm's
    output through them is rsqrt(mean(x^2) + eps) times x through it. None outside
    `stacked_projections_for_decoding()` (for a norm: without `fold_norms`), under autograd, where a layer is
    neither a plain linear nor an adopted LoRA layer with one plain adapter in x's dtype, or the norm does not fold."""
    if _stacked is None or torch.is_grad_enabled() or torch.is_autocast_enabled(x.device.type):
        return None
    if norm is not None and not (_fold_norms and foldable_norm(norm, x)):
        return None
    key = linears if norm is None else (linears, norm)
    return _stacked.get(key, functools.partial(_build, linears, x.dtype, norm))


def stacked_linear(linears: tuple, x: torch.Tensor) -> torch.Tensor | None:
    """The outputs of `linears` on `x`, concatenated on the last axis, from one GEMM; None where `stacked_weight`
    is (the caller then runs the layers themselves)."""
    built = stacked_weight(linears, x)
    return None if built is None else F.linear(x, *built)
