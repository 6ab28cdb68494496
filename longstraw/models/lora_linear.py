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

Capture (`merged_lora_for_capture()`, which `longstraw.capture` enters) runs a graph-free many-row call on the merged
weight W + scaling B A instead: one GEMM, where the update's two side GEMMs read the input again and read and
write the [rows, out] output once more (on a 32,768-row capture of hybrid-1b, 10 ms of LoRA against 0.19 s). It
pays when rows (in + 2 out) >= 2 in out, the merge's own pass over W (`merge_pays`: one read and one write, as
`lora_merge_triton` builds it on CUDA; addmm's copy of W first is the reference). Only capture takes it:
scoring and replay keep the unmerged forward, so the log-probs GRPO compares come from one computation. The
merged weight rounds once to the base's dtype; the unmerged sum rounds the base's output and the update instead.
`models.quant` merges LoRA over NF4 bases the same way, and `merged_weights_kept()` keeps each layer's merged
weight while a layer-major capture runs its chunks.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from longstraw.kernels.optional_import import optional_function
from longstraw.kernels.process_setting import ProcessSetting


def single_plain_adapter(layer) -> str | None:
    """The one active vanilla LoRA adapter of peft's LoRA `layer` with no active dropout, or None."""
    if layer.disable_adapters or layer.merged or len(layer.active_adapters) != 1:
        return None
    name = layer.active_adapters[0]
    if name not in layer.lora_A or name in layer.lora_variant:
        return None
    dropout = layer.lora_dropout[name]
    return name if isinstance(dropout, nn.Identity) or not dropout.training or dropout.p == 0 else None


class KeptWeights:
    """Weights built once and kept under a key (a LoRA layer's merged weight, a stacked projection), each beside the
    function that built it. `refresh` writes what they would be now into the same tensors: a sampling session's
    recorded decoding step reads them at their addresses, and the optimizer moves the parameters they come from."""

    def __init__(self):
        self._built: dict = {}  # key -> (value: a tensor, a tuple of tensors or None, or None; its build)

    def get(self, key, build):
        """The value kept under `key`, built by `build()` (and kept with it) the first time."""
        if key not in self._built:
            self._built[key] = (build(), build)
        return self._built[key][0]

    def refresh(self) -> None:
        """Rebuild every value from the parameters as they are now, written in place."""
        with torch.no_grad():
            for value, build in self._built.values():
                for kept, now in zip(_tensors(value), _tensors(build()), strict=True):
                    kept.copy_(now)


def _tensors(value) -> list[torch.Tensor]:
    return [t for t in (value if isinstance(value, tuple) else (value,)) if t is not None]


_merging = False  # inside merged_lora_for_capture()
_kept: KeptWeights | None = None  # inside merged_weights_kept(): each layer's merged weight, built once
_decoding = False  # inside merged_lora_for_decoding(): every graph-free call merges, whatever its rows


@contextmanager
def merged_lora_for_capture():
    """Graph-free many-row calls of LoRA layers run on their merged weight (see the module doc)."""
    global _merging
    previous, _merging = _merging, True
    try:
        yield
    finally:
        _merging = previous


@contextmanager
def merged_weights_kept(kept: KeptWeights | None = None):
    """Inside a capture, build each LoRA layer's merged weight once and reuse it for every call until the context
    ends. A layer-major capture enters it per layer: one layer's merged weights are kept while that layer runs all
    its chunks, instead of being rebuilt per chunk. `kept`: the store to keep them in (a sampling session's, which
    outlives the context); None, a new one."""
    global _kept
    previous, _kept = _kept, KeptWeights() if kept is None else kept
    try:
        yield
    finally:
        _kept = previous


@contextmanager
def merged_lora_for_decoding(kept: KeptWeights | None = None):
    """Sampling: every graph-free call of a LoRA layer runs on its merged weight, built once per layer for the
    whole decode and kept until the context ends (or in `kept`, a sampling session's store, across decodes). A
    decoding step is a few rows and launch-bound: the update's two side GEMMs and its add are three more launches a
    layer every step, the merge one pass over W per decode."""
    global _decoding
    previous, _decoding = _decoding, True
    try:
        with merged_lora_for_capture(), merged_weights_kept(kept):
            yield
    finally:
        _decoding = previous


def merging() -> bool:
    """Whether a LoRA layer's call here may run on its merged weight: inside a capture, and graph-free."""
    return _merging and not torch.is_grad_enabled()


def kept_or_built(layer, build):
    """`layer`'s merged weight: the one `merged_weights_kept()` holds, else `build()` (kept if a context holds)."""
    return _kept.get(layer, build) if _kept is not None else build()


# `lora_merge_triton`'s merge and its applicability test, or None where Triton does not import
_load_merge = functools.partial(optional_function, "longstraw.kernels.lora_merge_triton", "merge_lora_triton")
_load_merge_usable = functools.partial(optional_function, "longstraw.kernels.lora_merge_triton", "merge_usable")


def merged_lora_weight(weight, lora_A, lora_B, scaling: float, dtype) -> torch.Tensor:
    """weight + scaling * lora_B @ lora_A in `dtype`, summed in float32 and rounded once: on CUDA with one 16-bit
    dtype throughout, one Triton pass that reads the weight and writes the sum (`lora_merge_triton`); else one GEMM
    into a copy of the weight when the three share a dtype (a GEMM accumulates in float32 and rounds its sum once),
    else in float32 copies."""
    usable = _load_merge_usable() if weight.dtype == dtype else None
    if usable is not None and usable(weight, lora_A, lora_B):
        return _load_merge()(weight, lora_A, lora_B, scaling)
    if not weight.dtype == lora_A.dtype == lora_B.dtype:
        weight, lora_A, lora_B = weight.float(), lora_A.float(), lora_B.float()
    return torch.addmm(weight, lora_B, lora_A, alpha=scaling).to(dtype)


def merge_pays(rows: int, base: nn.Linear) -> bool:
    """Whether one pass over the merged weight (written once, read by the GEMM: 2 in out) costs less than the
    unmerged update's extra passes over the rows (lora_A reads the input, lora_B reads and writes the output)."""
    return rows * (base.in_features + 2 * base.out_features) >= 2 * base.in_features * base.out_features


def _lora_forward(x2d, weight, bias, lora_A, lora_B, scaling):
    """[rows, out] = x W^T + b + scaling (x A^T) B^T, and x A^T: three GEMM kernels (bias in the first)."""
    out = F.linear(x2d, weight, bias)
    a = x2d @ lora_A.t()
    return out.addmm_(a, lora_B.t(), alpha=scaling), a


def _adapter_gradients(ctx, gy, t, x2d, a, lora_A, lora_B):
    """(gA, gB) = (scaling t^T x, scaling gy^T a) with t = gy B and a = x A^T, each a GEMM with the scaling inside
    (beta = 0 ignores the unread first operand), or None where the adapter takes no gradient."""
    s = ctx.scaling
    gA = torch.addmm(lora_A, t.t(), x2d, beta=0, alpha=s) if ctx.needs_input_grad[3] else None
    gB = torch.addmm(lora_B, gy.t(), a, beta=0, alpha=s) if ctx.needs_input_grad[4] else None
    return gA, gB


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
        return gx, None, None, *_adapter_gradients(ctx, gy, t, x2d, a, lora_A, lora_B), None


class _MergedLoraLinear(torch.autograd.Function):
    """A frozen base's layer on its merged weight W' = W + scaling B A (`merged_lora_weight`, one rounding) under
    autograd: forward out = x W'^T + b and a = x A^T; backward gx = gy W', gA = scaling (gy B)^T x, gB = scaling gy^T
    a. Against `_FusedLoraLinear` no pass adds the update into the output or scaling (gy B) A into gx (each reads and
    writes [rows, out] or [rows, in]), for one pass over the weight (the merge) and W' held until the backward."""

    @staticmethod
    def forward(ctx, x2d, weight, bias, lora_A, lora_B, scaling):
        merged = merged_lora_weight(weight, lora_A, lora_B, scaling, x2d.dtype)
        out = F.linear(x2d, merged, bias)
        a = x2d @ lora_A.t()
        ctx.save_for_backward(x2d, a, merged, lora_A, lora_B)
        ctx.scaling = scaling
        return out

    @staticmethod
    def backward(ctx, gy):
        x2d, a, merged, lora_A, lora_B = ctx.saved_tensors
        gx = gy @ merged if ctx.needs_input_grad[0] else None
        return gx, None, None, *_adapter_gradients(ctx, gy, gy @ lora_B, x2d, a, lora_A, lora_B), None


# the update under autograd where `fusable`: "fused" (`_FusedLoraLinear`: the update accumulated by lora_B's GEMM) or
# "merged" (`_MergedLoraLinear`, on enough rows: `merged_update_pays`), the default: on the H200's floor point
# (hybrid-1b, bf16 adapters) it took 1.8 ms off the members for 0.9 GB more peak, each merged weight held until its
# backward (up to the adapted layers' bf16 weights once, whatever G or the prompt). Rounding W + s B A to bf16
# keeps a small update on average, as W's own values dither the rounding (tests/test_lora_linear.py: a bf16 capture
# on merged weights is as far from the float64 one as the unmerged capture)
LORA_UPDATES = ("fused", "merged")
_lora_update = ProcessSetting("LoRA update under autograd", LORA_UPDATES, "merged")


def lora_update(name: str):
    """Within the block, a LoRA layer under autograd that `fusable` admits runs `name`: "fused" or "merged"."""
    return _lora_update.within(name)


def merged_update_pays(rows: int, in_features: int, out_features: int) -> bool:
    """Whether the merge's pass over the weight (read once, written once: 2 in out) costs less than the passes the
    fused update makes over the rows (the update added into the output, forward, and into gx, backward: 2 rows (in +
    out))."""
    return rows * (in_features + out_features) >= in_features * out_features


def fused_lora_linear(x, weight, bias, lora_A, lora_B, scaling: float):
    """x W^T + b + scaling (x A^T) B^T over x's last dimension, the update accumulated by lora_B's GEMM (under
    `lora_update("merged")`, on the merged weight where the rows pay, with or without autograd: scoring an old policy
    then runs replay's computation; a capture's calls merge by its own rule, `mergeable`); the base (`weight`, `bias`)
    must be frozen and every tensor of one dtype (`fusable`)."""
    x2d = x.reshape(-1, x.shape[-1])
    merged = _lora_update.value == "merged" and merged_update_pays(x2d.shape[0], weight.shape[1], weight.shape[0])
    if torch.is_grad_enabled() and (x.requires_grad or lora_A.requires_grad or lora_B.requires_grad):
        out = (_MergedLoraLinear if merged else _FusedLoraLinear).apply(x2d, weight, bias, lora_A, lora_B, scaling)
    elif merged and not merging():
        out = F.linear(x2d, merged_lora_weight(weight, lora_A, lora_B, scaling, x2d.dtype), bias)
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


def mergeable(base: nn.Linear, lora_B: nn.Linear, x: torch.Tensor) -> bool:
    """Whether this call runs on the merged weight: a graph-free capture call (`merging`) on enough rows
    (`merge_pays`) or a decoding step's (`merged_lora_for_decoding`), in the base's dtype, no bias on lora_B, no
    autocast."""
    return (
        merging()
        and lora_B.bias is None
        and x.dtype == base.weight.dtype
        and (base.bias is None or base.bias.dtype == x.dtype)
        and not torch.is_autocast_enabled(x.device.type)
        and (_decoding or merge_pays(x.numel() // x.shape[-1], base))
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
            if mergeable(base, lora_B, x):
                # a partial, not a closure over x: a session keeps the build to refresh the weight
                build = functools.partial(
                    merged_lora_weight, base.weight, lora_A.weight, lora_B.weight, scaling, x.dtype
                )
                weight = kept_or_built(self, build)
                return F.linear(x, weight, base.bias)
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
