"""A Llama-form RMSNorm's forward in one launch (Triton, CUDA), optionally after the residual sum it normalises.

    y = rms_norm_rows(x, weight, eps)                       # HF's LlamaRMSNorm(x)
    y, total = rms_norm_rows(x, weight, eps, residual=r)    # (LlamaRMSNorm(r + x), r + x)

HF's `LlamaRMSNorm` (and Qwen3's, GLM-4 MoE's: `rms_norm.ROUNDED_THEN_WEIGHTED`) upcasts to float32, takes the
rows' mean square, scales, rounds to the input's dtype and multiplies by the weight in that dtype: six launches, and
the sum before it one more. Here a program per row reads x (and the residual, summed and rounded as torch's add rounds),
computes the same in float32 and rounds where HF rounds: the result differs from HF's only by the order of the row's
sum of squares. Forward only (no autograd): decoding runs it (`kernels/rms_norm.py: decoding_norms`).

`row_rms_scale` is the norm's row scale alone, rsqrt(mean(x^2) + eps) in float32, for kernels that apply a norm
folded into the projection before them (`families.folded_norms`: the rotary launch, the stacked SwiGLU).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def row_rms_scale(row_ptr, H, eps, BLOCK: tl.constexpr):
    """rsqrt(mean(x^2) + eps) of the H values at `row_ptr`, summed in float32 as `_rms_norm_rows` sums them."""
    cols = tl.arange(0, BLOCK)
    x = tl.load(row_ptr + cols, mask=cols < H, other=0.0).to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, 0) / H + eps)


@triton.jit
def _rms_norm_rows(x_ptr, r_ptr, w_ptr, y_ptr, total_ptr, H, eps, BLOCK: tl.constexpr, RESIDUAL: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    inside = cols < H
    x = tl.load(x_ptr + row * H + cols, mask=inside, other=0.0)
    if RESIDUAL:  # the sum rounded to the input's dtype, as torch's add
        x = (x.to(tl.float32) + tl.load(r_ptr + row * H + cols, mask=inside, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(total_ptr + row * H + cols, x, mask=inside)
    xf = x.to(tl.float32)
    normed = (xf * tl.rsqrt(tl.sum(xf * xf, 0) / H + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=inside, other=0.0)
    tl.store(y_ptr + row * H + cols, (w.to(tl.float32) * normed.to(tl.float32)).to(x.dtype), mask=inside)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None):
    """HF's Llama-form RMSNorm of x's rows (over its last dimension), or of residual + x with that sum too."""
    H = x.shape[-1]
    y = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else y
    rows = x.numel() // H
    _rms_norm_rows[(rows,)](
        x, residual.contiguous() if residual is not None else x, weight, y, total, H, float(eps),
        BLOCK=triton.next_power_of_2(H), RESIDUAL=residual is not None, num_warps=4 if H <= 4096 else 8,
    )  # fmt: skip
    return y if residual is None else (y, total)
