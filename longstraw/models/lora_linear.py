"""peft's LoRA linear layer with the adapter's update accumulated into the base's output.

peft's `Linear.forward` adds an adapter as `result + lora_B(lora_A(x)) * scaling`, then casts back to the base's
dtype. With its default float32 adapters over bf16 weights that is three float32 [rows, out] tensors beside the
result (lora_B's output, its scaled copy, the sum): at a capture chunk of 8,192 rows through a GDN layer's
in_proj_qkv (8,192 outputs) 0.8 GB, the peak of capture's transient memory. Forward and backward it is 5 and ~10
kernels a layer, and replay's members are launch-bound.

Two paths here, both with peft's `Linear.forward` as their reference:

- adapters in the base's dtype (`model.lora.dtype: model`), with the base frozen: `fused_lora_linear`, where
  lora_B's GEMM accumulates `scaling * (x A^T) B^T` into the base's output (cuBLAS's beta = 1, alpha = scaling)
  and the backward is five GEMMs, the scaling and the input gradient's sum inside them: 3 + 5 kernels, and the
  update rounded once where peft rounds it, scales it and rounds the sum. A power-of-two scaling (peft's
  default alpha = 2r gives 2) commutes with rounding, so the adapters' gradients are the GEMMs peft runs, on the
  same operands; the output and the input gradient are the same sums, rounded once fewer.
- adapters of another dtype (peft's float32 default): the scaling multiplies lora_A's [rows, r] output and
  lora_B's output is added into the base's result in place: one temporary, and two fewer passes over [rows, out].
  Bit-identical to peft at a power-of-two scaling.

A trainable base, a bias on lora_B or autocast take the in-place path. Whatever else peft's layer does (adapters
disabled or merged, several active, a variant such as DoRA, dropout that is active, mixed-batch arguments) runs
peft's own forward; a layer whose base is not an `nn.Linear` is not adopted.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def single_plain_adapter(layer) -> str | None:
    """The one active vanilla LoRA adapter of peft's LoRA `layer` with no active dropout, or None."""
    if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in layer.lora_variant:
        return None
    dropout = layer.lora_dropout[name]
    return name if isinstance(dropout, nn.Identity) or not dropout.training or dropout.p == 0 else None


def _lora_forward(x2d, weight, bias, lora_A, lora_B, scaling):
    """[rows, out] = x W^T + b + scaling (x A^T) B^T, and x A^T: three GEMM kernels (bias in the first)."""
    out = F.linear(x2d, weight, bias)
    a = x2d @ lora_A.t()
    return out.addmm_(a, lora_B.t(), alpha=scaling), a


class _FusedLoraLinear(torch.autograd.Function):
    """`_lora_forward` under autograd, for a frozen base: the backward is gx = gy W + scaling (gy B) A,
    gA = scaling (gy B)^T x, gB = scaling gy^T (x A^T), five GEMMs (beta = 0 ignores the unread first operand)."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, lora_A, lora_B, scaling):
        out, a = _lora_forward(x2d, weight, bias, lora_A, lora_B, scaling)
        ctx.save_for_backward(x2d, a, weight, lora_A, lora_B)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, gy):
        x2d, a, weight, lora_A, lora_B = ctx.saved_tensors
        s = ctx.scaling
        t = gy @ lora_B  # [rows, r]
        gx = (gy @ weight).addmm_(t, lora_A, alpha=s) if ctx.needs_input_grad[0] else None
        gA = torch.addmm(lora_A, t.t(), x2d, beta=0, alpha=s) if ctx.needs_input_grad[3] else None
        gB = torch.addmm(lora_B, gy.t(), a, beta=0, alpha=s) if ctx.needs_input_grad[4] else None
        return gx, None, None, gA, gB, None


def fused_lora_linear(x, weight, bias, lora_A, lora_B, scaling: float):
    """x W^T + b + scaling (x A^T) B^T over x's last dimension, the update accumulated by lora_B's GEMM; the base
    (`weight`, `bias`) must be frozen and every tensor of one dtype (`fusable`)."""
    x2d = x.reshape(-1, x.shape[-1])
    if torch.is_grad_enabled() and (x.requires_grad or lora_A.requires_grad or lora_B.requires_grad):
        out = _FusedLoraLinear.apply(x2d, weight, bias, lora_A, lora_B, scaling)
    else:
        out, _ = _lora_forward(x2d, weight, bias, lora_A, lora_B, scaling)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def fusable(base: nn.Linear, lora_A: nn.Linear, lora_B: nn.Linear, x: torch.Tensor) -> bool:
    """Whether `fused_lora_linear` computes this layer: one dtype throughout, a frozen base, no bias on lora_B,
    no autocast (which would pick other dtypes per op)."""
    dtype = base.weight.dtype
    frozen = not base.weight.requires_grad and (base.bias is None or not base.bias.requires_grad)
    return (
        frozen
        and lora_B.bias is None
        and x.dtype == lora_A.weight.dtype == lora_B.weight.dtype == dtype
        and (base.bias is None or base.bias.dtype == dtype)
        and not torch.is_autocast_enabled(x.device.type)
    )


@functools.cache
def in_place_lora_class():
    from peft.tuners.lora.layer import Linear as LoraLinear

    class InPlaceLoraLinear(LoraLinear):
        def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            adapter = single_plain_adapter(self)
            if adapter is None or args or kwargs:
                return super().forward(x, *args, **kwargs)
            base, lora_A, lora_B = self.base_layer, self.lora_A[adapter], self.lora_B[adapter]
            scaling = self.scaling[adapter]
            if fusable(base, lora_A, lora_B, x):
                return fused_lora_linear(x, base.weight, base.bias, lora_A.weight, lora_B.weight, scaling)
            # on [rows, in]: the base's output is then not a view, and the in-place add has no CopySlices backward
            x2d = x.reshape(-1, x.shape[-1])
            result = base(x2d)
            update = lora_B(lora_A(self._cast_input_dtype(x2d, lora_A.weight.dtype)) * scaling)
            return result.add_(update).reshape(*x.shape[:-1], result.shape[-1])  # the result's dtype, as peft's cast

    return InPlaceLoraLinear


def adopt_in_place_lora(model) -> None:
    """Give peft's LoRA linear layers over an `nn.Linear` (exactly those classes: not subclasses, not 4-bit
    layers) the update of this module, in place."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    for module in model.modules():
        if type(module) is LoraLinear and type(module.base_layer) is nn.Linear:
            module.__class__ = in_place_lora_class()
