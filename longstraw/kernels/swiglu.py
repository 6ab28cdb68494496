"""A decoder layer's gated MLP, down(silu(gate(x)) * up(x)): on CUDA with a fused silu-and-multiply, else HF's module.

HF's MLP runs silu and the product as two elementwise passes over the [rows, intermediate] activations, each way;
`swiglu_triton.SwiGLU` is one launch forward and one backward. The projections stay the module's own calls (they may
be peft LoRA layers). Any other MLP (another activation, an MoE block), CPU, float64 or no Triton runs the module
itself, the plain reference.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from transformers.activations import ACT2FN

from longstraw.kernels.optional_import import optional_function
from longstraw.kernels.rms_norm import rms_scale

# the classes an HF config's hidden_act "silu" builds (transformers' own SiLUActivation in 5.x), and torch's
SILU_CLASSES = (torch.nn.SiLU, type(ACT2FN["silu"]))


# `swiglu_triton.swiglu` (gate, up) -> silu(gate) * up, or None when Triton does not import
_load_swiglu = functools.partial(optional_function, "longstraw.kernels.swiglu_triton", "swiglu")
_load_swiglu_stacked = functools.partial(optional_function, "longstraw.kernels.swiglu_triton", "swiglu_stacked_triton")
_load_swiglu_scaled = functools.partial(
    optional_function, "longstraw.kernels.swiglu_triton", "swiglu_stacked_scaled_triton"
)


def silu_gated(mlp) -> bool:
    """Whether `mlp` is down(silu(gate(x)) * up(x)) (HF's gated MLP with a SiLU)."""
    return all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")) and isinstance(
        getattr(mlp, "act_fn", None), SILU_CLASSES
    )


def _fused_usable(mlp, x: torch.Tensor) -> bool:
    return x.is_cuda and x.numel() > 0 and x.dtype != torch.float64 and silu_gated(mlp) and _load_swiglu() is not None


def add_linear_(residual: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """residual + x W^T into the residual's storage (returned): one GEMM, cuBLAS's beta = 1, the sum rounded once
    (HF rounds the projection, then the sum). No autograd: the caller gives the residual away."""
    rows = residual.reshape(-1, residual.shape[-1])
    return rows.addmm_(x.reshape(-1, x.shape[-1]), weight.t()).view_as(residual)


def swiglu_rms_scaled(gate_up: torch.Tensor, x: torch.Tensor, eps: float) -> torch.Tensor:
    """silu(r gate) * (r up) from rows of [gate | up], r = rsqrt(mean(x^2) + eps) of x's matching row: a SiLU-gated
    MLP's product where its RMSNorm is folded into the stacked projection (`families.folded_norms`). One launch on
    CUDA (`swiglu_stacked_scaled_triton`); elsewhere, or in float64, its torch reference, in float32 or wider and
    rounded once."""
    if gate_up.is_cuda and gate_up.dtype != torch.float64 and _load_swiglu_scaled() is not None:
        return _load_swiglu_scaled()(gate_up, x, eps)
    scale = rms_scale(x, eps)
    gate, up = (gate_up.to(scale.dtype) * scale).chunk(2, -1)
    return (F.silu(gate) * up).to(gate_up.dtype)


def mlp_forward(mlp, x: torch.Tensor, residual: torch.Tensor | None = None, stacked_gate_up=None) -> torch.Tensor:
    """`mlp(x)` (the first of what it returns, for an MoE block that also returns router logits), plus `residual`
    if given, differentiable in x, the residual and the weights: the fused silu-and-multiply between the module's
    own projections on CUDA for a SiLU-gated MLP, the module itself otherwise. On the fused path a plain bias-free
    down projection (not a LoRA or quantised layer) takes the residual into its GEMM (cuBLAS's beta = 1: the sum
    rounds once, where HF rounds the projection and then the sum); without grad the GEMM accumulates into the
    residual's own storage, which the result then is: the caller gives the residual away. On the fused path,
    `stacked_gate_up()` (where given: a decoding step's `models.stacked_projections`) may return the gate and up
    projections' outputs side by side from one GEMM, in place of the module's two calls (None: it does not apply)."""
    if not _fused_usable(mlp, x):
        out = mlp(x)
        out = out[0] if isinstance(out, tuple) else out
    else:
        # the kernel computes silu(gate) * up in float32 from the bf16 projections and rounds once; HF's
        # F.silu(gate) * up rounds silu's output to bf16 first: the two differ within bf16 rounding
        gate_up = stacked_gate_up() if stacked_gate_up is not None else None
        if gate_up is not None:
            product = _load_swiglu_stacked()(gate_up)
        else:
            product = _load_swiglu()(mlp.gate_proj(x), mlp.up_proj(x))
        down = mlp.down_proj
        if residual is not None and type(down) is torch.nn.Linear and down.bias is None:
            rows, product = residual.reshape(-1, residual.shape[-1]), product.reshape(-1, product.shape[-1])
            if torch.is_grad_enabled():
                return torch.addmm(rows, product, down.weight.t()).view_as(residual)
            # no graph keeps the residual: the sum goes into it (C = D), where addmm first copies it into a new
            # output (hybrid-1b's 32,768-row capture: 15 copies of 128 MB)
            return add_linear_(residual, product, down.weight)
        out = down(product)
    return out if residual is None else residual + out
