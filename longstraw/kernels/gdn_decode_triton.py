"""One decoding step of the gated delta rule in one launch (Triton, CUDA): the state updated in place.

    out_B1HV = gdn_decode_step(q_B1HD, k_B1HD, v_B1HV, g_B1H, beta_B1H, state_BHDV)   # state_BHDV written in place

For one token the rule is `recurrent_gated_delta_rule`'s step (`kernels/gdn.py`, the reference): S = S exp(g);
S += k (beta (v - k^T S))^T; out = q^T S, with q scaled by Dk^-0.5, q and k already normalised (the conv's
kernel normalises them), in float32. As torch ops it is about twenty launches a GDN layer at every decoding step;
here a program per (sequence, value head, block of value columns) holds its [Dk, BV] tile of the float32 state,
reads it once and writes it back in place (each program reads its whole tile before writing it, so the state in and
out may be one tensor).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BV = 32  # value columns a program: a [Dk, 32] float32 tile (Dk <= 256: at most 32 KB of registers)


@triton.jit
def _gdn_decode_step(
    q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, out_ptr, H, HV, DV, scale,
    DK: tl.constexpr, BV: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    blocks = tl.cdiv(DV, BV)
    i_v, bh = pid % blocks, pid // blocks
    b, hv = bh // HV, bh % HV
    h = hv // (HV // H)
    d = tl.arange(0, DK)
    cols = i_v * BV + tl.arange(0, BV)
    col_in = cols < DV
    q = tl.load(q_ptr + (b * H + h) * DK + d).to(tl.float32) * scale
    k = tl.load(k_ptr + (b * H + h) * DK + d).to(tl.float32)
    v = tl.load(v_ptr + (b * HV + hv) * DV + cols, mask=col_in, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(g_ptr + b * HV + hv).to(tl.float32))
    beta = tl.load(beta_ptr + b * HV + hv).to(tl.float32)
    at = state_ptr + bh.to(tl.int64) * DK * DV + d[:, None] * DV + cols[None, :]
    S = tl.load(at, mask=col_in[None, :], other=0.0) * decay
    delta = (v - tl.sum(k[:, None] * S, 0)) * beta
    S = S + k[:, None] * delta[None, :]
    tl.store(at, S, mask=col_in[None, :])
    out = tl.sum(q[:, None] * S, 0)
    tl.store(out_ptr + (b * HV + hv) * DV + cols, out.to(out_ptr.dtype.element_ty), mask=col_in)


def decode_step_usable(q_BTHD, v_BTHV, state_BHDV) -> bool:
    """One token, on CUDA, q and k heads of a power-of-two dim up to 256, a float32 contiguous state."""
    Dk = q_BTHD.shape[-1]
    return (
        q_BTHD.is_cuda
        and q_BTHD.shape[1] == 1
        and 16 <= Dk <= 256
        and Dk & (Dk - 1) == 0
        and q_BTHD.dtype != torch.float64
        and state_BHDV is not None
        and state_BHDV.dtype == torch.float32
        and state_BHDV.is_contiguous()
    )


def gdn_decode_step(q_B1HD, k_B1HD, v_B1HV, g_B1H, beta_B1H, state_BHDV, out_state_BHDV=None):
    """The token's output [B, 1, HV, Dv] in q's dtype; the state after it written into `out_state_BHDV` (default:
    `state_BHDV` itself, in place), which is returned with it."""
    B, _, H, DK = q_B1HD.shape
    HV, DV = v_B1HV.shape[2], v_B1HV.shape[3]
    if out_state_BHDV is None:
        out_state_BHDV = state_BHDV
    elif out_state_BHDV is not state_BHDV:
        out_state_BHDV.copy_(state_BHDV)
    q, k, v, g, beta = (t.contiguous() for t in (q_B1HD, k_B1HD, v_B1HV, g_B1H, beta_B1H))
    out = torch.empty(B, 1, HV, DV, dtype=q_B1HD.dtype, device=q_B1HD.device)
    _gdn_decode_step[(B * HV * triton.cdiv(DV, BV),)](
        q, k, v, g, beta, out_state_BHDV, out, H, HV, DV, DK**-0.5, DK=DK, BV=BV, num_warps=4
    )
    return out, out_state_BHDV
