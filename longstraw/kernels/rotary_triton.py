"""Rotary position embedding of the rotate-half form as one Triton launch (CUDA), forward and backward.

    out_BHTD = Rotary.apply(x_BHTD, cos_BTR, sin_BTR)

The first R of D features rotate, the rest pass through, as HF's `apply_rotary_pos_emb` computes them (its reference,
`longstraw.kernels.rotary`): with h = R / 2, out_c = x_c cos_c - x_{c+h} sin_c for c < h, x_c cos_c + x_{c-h} sin_c
for h <= c < R, x_c beyond. HF runs that as eight launches for q and k (two products, a negation and two
concatenations each way), each rounding to bf16; here each feature is computed in float32 from its own and its
partner's value (a second read of the row, served by the cache) and rounded once. The input may be strided (HF's q
and k are [B, T, H, D] tensors seen as [B, H, T, D]); the output is contiguous [B, H, T, D], as HF's concatenation's
is. The backward is the transposed rotation, into a gradient laid out as the input.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ROWS = 32  # positions a program; one program per block of positions and (batch, head)


@triton.jit
def _rotary_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    T,
    H,
    x_sb,
    x_sh,
    x_st,
    c_sb,
    c_st,
    o_sb,
    o_sh,
    o_st,
    D: tl.constexpr,
    R: tl.constexpr,
    BD: tl.constexpr,
    ROWS: tl.constexpr,
    TRANSPOSED: tl.constexpr,
):
    """One block of positions of one (batch, head). TRANSPOSED: the rotation's transpose (the backward), in which
    feature c takes its partner's value with the partner's sine and the opposite sign."""
    i_t, i_bh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // H, i_bh % H
    rows = i_t * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BD)
    half = R // 2
    partner = tl.where(cols < half, cols + half, tl.where(cols < R, cols - half, cols))
    rotated = cols < R
    mask = (rows < T)[:, None] & (cols < D)[None, :]
    x_rows = x_ptr + i_b * x_sb + i_h * x_sh + rows[:, None] * x_st
    x = tl.load(x_rows + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    x_partner = tl.load(x_rows + partner[None, :], mask=mask & rotated[None, :], other=0.0).to(tl.float32)
    angle_rows = i_b * c_sb + rows[:, None] * c_st
    cos = tl.load(cos_ptr + angle_rows + cols[None, :], mask=mask & rotated[None, :], other=1.0).to(tl.float32)
    if TRANSPOSED:
        sin = tl.load(sin_ptr + angle_rows + partner[None, :], mask=mask & rotated[None, :], other=0.0).to(tl.float32)
        sign = tl.where(cols < half, 1.0, -1.0)
    else:
        sin = tl.load(sin_ptr + angle_rows + cols[None, :], mask=mask & rotated[None, :], other=0.0).to(tl.float32)
        sign = tl.where(cols < half, -1.0, 1.0)
    out = x * cos + sign[None, :] * x_partner * sin
    out_rows = out_ptr + i_b * o_sb + i_h * o_sh + rows[:, None] * o_st
    tl.store(out_rows + cols[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def rotate_triton(
    x_BHTD: torch.Tensor, cos_BTR: torch.Tensor, sin_BTR: torch.Tensor, out_BHTD: torch.Tensor, transposed: bool
):
    """Write the rotation (or its transpose) of `x_BHTD` into `out_BHTD` (any strides, last dim contiguous)."""
    B, H, T, D = x_BHTD.shape
    R = cos_BTR.shape[-1]
    if R % 2 or R > D or x_BHTD.stride(-1) != 1 or out_BHTD.stride(-1) != 1 or cos_BTR.stride(-1) != 1:
        raise ValueError(f"rotary: an even rotary width up to the head dim and unit feature strides, got R={R}, D={D}")
    if cos_BTR.dim() != 3 or cos_BTR.shape[0] not in (1, B) or cos_BTR.shape[1] != T or sin_BTR.shape != cos_BTR.shape:
        raise ValueError(f"rotary: cos and sin of [B or 1, T={T}, R], got {tuple(cos_BTR.shape)}")
    if cos_BTR.stride() != sin_BTR.stride():
        raise ValueError("rotary: cos and sin must share one layout")
    if not x_BHTD.numel():
        return out_BHTD
    angle_batch_stride = 0 if cos_BTR.shape[0] == 1 else cos_BTR.stride(0)
    _rotary_kernel[(triton.cdiv(T, ROWS), B * H)](
        x_BHTD, cos_BTR, sin_BTR, out_BHTD, T, H,
        x_BHTD.stride(0), x_BHTD.stride(1), x_BHTD.stride(2),
        angle_batch_stride, cos_BTR.stride(1),
        out_BHTD.stride(0), out_BHTD.stride(1), out_BHTD.stride(2),
        D=D, R=R, BD=triton.next_power_of_2(D), ROWS=ROWS, TRANSPOSED=transposed,
    )  # fmt: skip
    return out_BHTD


class Rotary(torch.autograd.Function):
    """The rotation of x by fixed angles (cos and sin carry no gradient), differentiable in x."""

    @staticmethod
    def forward(ctx, x_BHTD, cos_BTR, sin_BTR):
        ctx.save_for_backward(cos_BTR, sin_BTR)
        # HF's q and k: [B, T, H, D] memory seen as [B, H, T, D]; the gradient goes back in that layout, which the
        # q and k norms' backward reads without a copy
        ctx.heads_inside = x_BHTD.transpose(1, 2).is_contiguous()
        out = torch.empty(x_BHTD.shape, dtype=x_BHTD.dtype, device=x_BHTD.device)
        return rotate_triton(x_BHTD, cos_BTR, sin_BTR, out, transposed=False)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout_BHTD):
        cos_BTR, sin_BTR = ctx.saved_tensors
        if dout_BHTD.stride(-1) != 1:
            dout_BHTD = dout_BHTD.contiguous()
        B, H, T, D = dout_BHTD.shape
        like = dict(dtype=dout_BHTD.dtype, device=dout_BHTD.device)
        dx = torch.empty(B, T, H, D, **like).transpose(1, 2) if ctx.heads_inside else torch.empty(B, H, T, D, **like)
        return rotate_triton(dout_BHTD, cos_BTR, sin_BTR, dx, transposed=True), None, None


rotary = Rotary.apply
