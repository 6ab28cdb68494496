"""The query gradient of attention over keys that take no gradient (Triton, CUDA): replay's prefix backward.

    attention_dq_triton(do_BKMD, q_BKMD, k_BKND, v_BKND, out_BKMD, lse_BKM, scale, dq_BKMD)   # dq_BKMD += dQ

A replay member's queries attend the prompt's resident pages, which take no gradient. cuDNN's and flash's
backward compute dQ, dK and dV: five products a block of keys (S = Q K^T and dP = dO V^T again, then dV = P^T dO,
dK = dS^T Q, dQ = dS K), two of them thrown away here (hybrid-1b's members at 32,768: cuDNN's prefix backward 9.3 ms
of a 70 ms replay on an H100, `hybrid_step_profile_*.json`). Here each program takes a block of query rows of one
K/V head through every key, as a forward does, and computes the three products dQ needs::

    P  = exp(scale Q K^T - lse)          (lse: the GLOBAL row log-sum-exp, prefix and live keys together)
    dS = P * (dO V^T - delta)            (delta = rowsum(dO * O) with the global O)
    dQ = scale dS K

dS is rounded to the keys' dtype where it enters its product, as flash and cuDNN round it; the products accumulate
in float32 and dQ is added into the caller's float32 accumulator (rows of several blocks sum there). The rows are
the caller's [B, K, M = G R, D] queries (GQA: a K/V head's G query heads are rows of one head), so the pages are
never repeated per query head, and one prompt's pages serve B sequences through a zero batch stride. The reference
is `paged_attention._math_block_bwd`'s dq.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longstraw.kernels.tuning import log2_bucket

LOG2E = tl.constexpr(1.4426950408889634)  # a global a jitted function reads must be a constexpr
# one program holds [rows, D] blocks of q, dO and the float32 dq in registers: at 256 (Qwen3.6-27B's head dim) that is
# twice hybrid-1b's, untuned, and those layers keep the library's backward
MAX_HEAD_DIM = 128

# (rows a program, keys a step, warps, stages): those of rows and keys 64 or 128, 4 or 8 warps and 2 or 3 stages that
# spill nothing in the sm_90 build at head dim 128 (`benchmarks/triton_build_report.py`, Triton 3.8: 128 x 128 spills
# 24-32 bytes at 8 warps and kilobytes at 4, 64 x 128 and 128 x 64 at 4 warps 0.3-1.7 KB); `benchmarks/attention_dq.py`
# times each on the GPU against cuDNN's whole backward at replay's shapes (H200, hybrid-1b's member batch: 1.42 ms for
# 128 x 64, 8 warps, 3 stages, to 4.18 for 64 x 64, 8 warps, 2 stages; cuDNN 2.55)
CONFIGS = [(64, 64, 4, 2), (64, 64, 4, 3)] + [
    (bm, bn, 8, s) for bm, bn in ((64, 64), (64, 128), (128, 64)) for s in (2, 3)
]


def _config(bm, bn, w, s):
    return triton.Config({"BM": bm, "BN": bn}, num_warps=w, num_stages=s)


@triton.jit(do_not_specialize=["M", "N", "ROWS_LOG2", "KEYS_LOG2"])
def _dq_kernel(
    do_ptr,
    q_ptr,
    k_ptr,
    v_ptr,
    lse_ptr,
    o_ptr,
    dq_ptr,
    M,
    N,
    ROWS_LOG2,  # read by the autotuner only: `log2_bucket` of the rows
    KEYS_LOG2,  # and of the keys
    stride_kb,
    stride_kh,
    stride_kn,
    stride_vb,
    stride_vh,
    stride_vn,
    scale,
    HEADS: tl.constexpr,
    D: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
):
    """Rows [program_id(0) BM, ...) of K/V head program_id(1) % HEADS of batch program_id(1) // HEADS: q, dO, the
    global output and dq contiguous [B, HEADS, M, D], lse [B, HEADS, M] float32, k and v [B, HEADS, N, D] with their
    strides (page views), the head dim contiguous."""
    i_m, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    i_b, i_h = i_bh // HEADS, i_bh % HEADS
    rows = i_m * BM + tl.arange(0, BM)
    dims = tl.arange(0, D)
    in_rows = rows < M
    at = (i_bh * M + rows)[:, None] * D + dims[None, :]
    q = tl.load(q_ptr + at, mask=in_rows[:, None], other=0.0)
    do = tl.load(do_ptr + at, mask=in_rows[:, None], other=0.0)
    # rows past M: q and dO zeros, so dP and dS are too; their lse 0 keeps P finite
    lse2 = tl.load(lse_ptr + i_bh * M + rows, mask=in_rows, other=0.0) * LOG2E
    out = tl.load(o_ptr + at, mask=in_rows[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * out.to(tl.float32), axis=1)
    scale2 = scale * LOG2E
    keys = tl.arange(0, BN)
    # pointers advance a block at a time (64-bit): offsets from the pages' start pass 2**31 elements past 16M keys
    k_block = k_ptr + i_b * stride_kb + i_h * stride_kh + keys[:, None] * stride_kn + dims[None, :]
    v_block = v_ptr + i_b * stride_vb + i_h * stride_vh + keys[:, None] * stride_vn + dims[None, :]
    acc = tl.zeros([BM, D], dtype=tl.float32)
    whole = N // BN * BN
    for _ in range(0, whole, BN):  # whole blocks of keys: no masks
        k = tl.load(k_block)
        v = tl.load(v_block)
        p = tl.exp2(tl.dot(q, tl.trans(k)) * scale2 - lse2[:, None])
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        acc += tl.dot(ds.to(k.dtype), k)
        k_block += BN * stride_kn
        v_block += BN * stride_vn
    if whole < N:  # the ragged last block: keys past N read as zeros and weigh nothing
        in_keys = whole + keys < N
        k = tl.load(k_block, mask=in_keys[:, None], other=0.0)
        v = tl.load(v_block, mask=in_keys[:, None], other=0.0)
        p = tl.where(in_keys[None, :], tl.exp2(tl.dot(q, tl.trans(k)) * scale2 - lse2[:, None]), 0.0)
        ds = p * (tl.dot(do, tl.trans(v)) - delta[:, None])
        acc += tl.dot(ds.to(k.dtype), k)
    dq_at = dq_ptr + at
    tl.store(dq_at, tl.load(dq_at, mask=in_rows[:, None], other=0.0) + acc * scale, mask=in_rows[:, None])


_tuned_dq_kernel = triton.autotune(
    configs=[_config(*c) for c in CONFIGS], key=["HEADS", "D", "ROWS_LOG2", "KEYS_LOG2"], restore_value=["dq_ptr"]
)(_dq_kernel)


def dq_usable(q_BKMD: torch.Tensor, k_BKND: torch.Tensor) -> bool:
    """Whether `attention_dq_triton` computes this block: CUDA, one 16-bit dtype, a power-of-two head dim of 16 to
    MAX_HEAD_DIM."""
    D = q_BKMD.shape[-1]
    return (
        q_BKMD.is_cuda
        and q_BKMD.dtype in (torch.bfloat16, torch.float16)
        and k_BKND.dtype == q_BKMD.dtype
        and 16 <= D <= MAX_HEAD_DIM
        and not D & (D - 1)
    )


def attention_dq_triton(do_BKMD, q_BKMD, k_BKND, v_BKND, out_BKMD, lse_BKM, scale: float, dq_BKMD, config=None):
    """Add dQ of one block of keys into `dq_BKMD` (float32, contiguous): q, dO and the global output [B, K, M, D] in
    k's dtype, k and v [B, K, N, D] or [1, K, N, D] (one prompt's pages for the B sequences; the head dim
    contiguous), the global lse [B, K, M]. `config` (rows, keys, warps, stages) runs one of CONFIGS instead of the
    autotuner's choice (the benchmark's timings)."""
    B, K, M, D = q_BKMD.shape
    N = k_BKND.shape[2]
    rows_fit = all(x.shape == (B, K, M, D) for x in (do_BKMD, out_BKMD, dq_BKMD))
    pages = k_BKND.shape[0]
    if not rows_fit or pages not in (1, B) or k_BKND.shape[1:] != (K, N, D) or v_BKND.shape != k_BKND.shape:
        raise ValueError(
            f"attention_dq_triton: q {tuple(q_BKMD.shape)}, dO {tuple(do_BKMD.shape)}, out {tuple(out_BKMD.shape)}, "
            f"dq {tuple(dq_BKMD.shape)}, k {tuple(k_BKND.shape)} and v {tuple(v_BKND.shape)} do not fit [B, K, M, D] "
            "rows over [B or 1, K, N, D] keys"
        )
    if dq_BKMD.dtype != torch.float32 or not dq_BKMD.is_contiguous():
        raise ValueError("attention_dq_triton accumulates into a contiguous float32 dq")
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k_BKND, v_BKND))
    do, q, out = do_BKMD.contiguous(), q_BKMD.contiguous(), out_BKMD.contiguous()
    lse = lse_BKM.float().contiguous()
    args = (
        do, q, k, v, lse, out, dq_BKMD, M, N, log2_bucket(M), log2_bucket(N),
        k.stride(0) if pages == B else 0, k.stride(1), k.stride(2),
        v.stride(0) if pages == B else 0, v.stride(1), v.stride(2), float(scale),
    )  # fmt: skip
    if config is None:
        _tuned_dq_kernel[lambda meta: (triton.cdiv(M, meta["BM"]), B * K)](*args, HEADS=K, D=D)
    else:
        bm, bn, warps, stages = config
        _dq_kernel[(triton.cdiv(M, bm), B * K)](*args, HEADS=K, D=D, BM=bm, BN=bn, num_warps=warps, num_stages=stages)
