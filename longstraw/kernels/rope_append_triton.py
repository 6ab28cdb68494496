"""A decoding step's rotary and own-page write in one Triton launch (CUDA).

    q_BH1D = rope_append_triton(q_B1HD, k_B1KD, v_B1KD, cos_11R, sin_11R, k_own_BKND, v_own_BKND, step_1)

After the stacked q/k/v projection, a decoding step rotates q and k (HF's rotate-half form: the first R of D features,
`rotary_triton`'s formula) and writes k and v into each sequence's own pages at the clock's step: four launches
(two rotations, two `index_copy_`), each 1.4-2.4 us on an H100 for a few kilobytes. Here one program per (sequence,
head) of q, k or v does its part, the step read on the device (the launch is the same at every step, so a CUDA graph
records it). Each rotated feature is computed in float32 and rounded once, as `rotary_triton`'s. The reference is
`families.attention_decode.rope_append_reference` (HF's `apply_rotary_pos_emb`, then `OwnPages.append`).

With `rms_of=(x, eps)` the projection ran on the un-normed rows x with an RMSNorm's weight folded into its weight
(`families.folded_norms`): each program first computes its row's rsqrt(mean(x^2) + eps) in float32
(`rms_norm_triton.row_rms_scale`, a re-read of one row of x) and scales q, k and v by it before rotating and writing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from longstraw.kernels.dependent_launch import launches_dependent
from longstraw.kernels.rms_norm_triton import row_rms_scale


@triton.jit
def _rope_append_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, step_ptr, q_out_ptr, k_own_ptr, v_own_ptr, x_ptr,
    q_sb, q_sh, k_sb, k_sh, v_sb, v_sh, qo_sb, qo_sh, ko_sb, ko_sh, ko_sn, vo_sb, vo_sh, vo_sn, x_sb,
    H, K, X, eps,
    D: tl.constexpr, DV: tl.constexpr, R: tl.constexpr, BD: tl.constexpr, BDV: tl.constexpr,
    SCALED: tl.constexpr, BX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # started while the projection before it ran: everything read here is its output
        gdc_wait()
    b, j = tl.program_id(0).to(tl.int64), tl.program_id(1)
    step = tl.load(step_ptr)
    scale = 1.0  # times 1 in float32: exact, so the unscaled launch writes what it reads
    if SCALED:  # the folded norm's row scale, from the un-normed row the projection read
        scale = row_rms_scale(x_ptr + b * x_sb, X, eps, BX)
    if j < H + K:  # a q head rotated into q_out, or a k head rotated into its own pages at the step
        if j < H:
            src = q_ptr + b * q_sb + j * q_sh
            dst = q_out_ptr + b * qo_sb + j * qo_sh
        else:
            src = k_ptr + b * k_sb + (j - H) * k_sh
            dst = k_own_ptr + b * ko_sb + (j - H) * ko_sh + step * ko_sn
        cols = tl.arange(0, BD)
        half = R // 2
        partner = tl.where(cols < half, cols + half, tl.where(cols < R, cols - half, cols))
        inside, rotated = cols < D, cols < R
        x = tl.load(src + cols, mask=inside, other=0.0).to(tl.float32) * scale
        x_partner = tl.load(src + partner, mask=inside & rotated, other=0.0).to(tl.float32) * scale
        cos = tl.load(cos_ptr + cols, mask=rotated, other=1.0).to(tl.float32)
        sin = tl.load(sin_ptr + cols, mask=rotated, other=0.0).to(tl.float32)
        sign = tl.where(cols < half, -1.0, 1.0)
        tl.store(dst + cols, (x * cos + sign * x_partner * sin).to(dst.dtype.element_ty), mask=inside)
    else:  # a v head copied into its own pages at the step
        c = tl.arange(0, BDV)
        src = v_ptr + b * v_sb + (j - H - K) * v_sh
        dst = v_own_ptr + b * vo_sb + (j - H - K) * vo_sh + step * vo_sn
        v = tl.load(src + c, mask=c < DV).to(tl.float32) * scale
        tl.store(dst + c, v.to(dst.dtype.element_ty), mask=c < DV)


def rope_append_usable(q_B1HD, k_B1KD, v_B1KD, cos_11R, k_own_BKND, v_own_BKND, x_B1X=None) -> bool:
    """CUDA, one token a sequence, unit feature strides, one dtype (not float64), angles [1, 1, R] with R even and at
    most the head dim, own pages of the heads' dims (and the rows `x_B1X` of a folded norm, where given, alike)."""
    B, T, H, D = q_B1HD.shape
    tensors = (q_B1HD, k_B1KD, v_B1KD, cos_11R, k_own_BKND, v_own_BKND) + (() if x_B1X is None else (x_B1X,))
    return (
        q_B1HD.is_cuda
        and T == 1
        and cos_11R.shape[:2] == (1, 1)
        and cos_11R.shape[-1] % 2 == 0
        and cos_11R.shape[-1] <= D == k_B1KD.shape[-1] == k_own_BKND.shape[-1]
        and v_B1KD.shape[-1] == v_own_BKND.shape[-1]
        and all(t.stride(-1) == 1 for t in tensors)
        and len({t.dtype for t in tensors}) == 1
        and q_B1HD.dtype != torch.float64
    )


def rope_append_triton(
    q_B1HD, k_B1KD, v_B1KD, cos_11R, sin_11R, k_own_BKND, v_own_BKND, step_1, rms_of=None, dependent=None
) -> torch.Tensor:
    """q rotated ([B, H, 1, D], contiguous); k rotated and v written into the own pages at slot `step_1`.
    `rms_of` (x [B, 1, X], unit feature stride; eps): q, k and v first scaled by each row's rsqrt(mean(x^2) + eps).
    `dependent` (None: `dependent_launch.decode_launches`'s): a programmatic dependent launch, where the device has
    it."""
    B, _, H, D = q_B1HD.shape
    K, DV, R = k_B1KD.shape[2], v_B1KD.shape[-1], cos_11R.shape[-1]
    x_B1X, eps = rms_of if rms_of is not None else (q_B1HD, 0.0)  # unscaled: x is never read
    q_out = torch.empty(B, H, 1, D, dtype=q_B1HD.dtype, device=q_B1HD.device)
    sin_11R = sin_11R.contiguous()
    pdl = launches_dependent(q_B1HD.device, dependent)
    _rope_append_kernel[(B, H + 2 * K)](
        q_B1HD, k_B1KD, v_B1KD, cos_11R.contiguous(), sin_11R, step_1, q_out, k_own_BKND, v_own_BKND, x_B1X,
        q_B1HD.stride(0), q_B1HD.stride(2), k_B1KD.stride(0), k_B1KD.stride(2), v_B1KD.stride(0), v_B1KD.stride(2),
        q_out.stride(0), q_out.stride(1),
        k_own_BKND.stride(0), k_own_BKND.stride(1), k_own_BKND.stride(2),
        v_own_BKND.stride(0), v_own_BKND.stride(1), v_own_BKND.stride(2), x_B1X.stride(0),
        H, K, x_B1X.shape[-1], float(eps), D=D, DV=DV, R=R, BD=triton.next_power_of_2(D),
        BDV=triton.next_power_of_2(DV), SCALED=rms_of is not None, BX=triton.next_power_of_2(x_B1X.shape[-1]),
        PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return q_out
