"""One decoding step's attention in two launches (Triton, CUDA): B sequences' queries over one prompt's shared pages,
split over the keys (flash-decoding), then each query row over its own sequence's keys, merged with the splits.

    out_BH1D = decode_attention_triton(q_BH1D, k_1KPD, v_1KPD, k_own_BKND, v_own_BKND, step_1, scale, sinks=None)

A decoding step's queries are few (B sequences times the G query heads of a K/V head) and its prefix long, so a
block kernel over [rows, keys] runs K programs over the whole prefix. Here:

- `_prefix_partials`: a program per (K/V head, split of the prefix's keys): the B * G rows of that head (every
  sequence's queries folded into one tile, so the prefix is read once for all sequences) against its keys, an online
  softmax in base 2, its (out, lse) written to float32 partials.
- `_own_and_merge`: a program per query row (sequence b, head h): that row over its sequence's own keys up to the
  clock's step (`step_1`, read on the device: the launch is the same at every step, so a CUDA graph records it), its
  sink logit when the layer has them, and the prefix's partials merged, written in q's dtype.

On Hopper and later the second launch can be a programmatic dependent launch (`kernels.dependent_launch`): the
prefix pass lets it start at once, its rows read their own keys while the prefix's splits run (the own keys and
queries were written by kernels that ended before the prefix pass began), and wait for the prefix pass's end
(`gdc_wait`) only before its partials.

The reference is `paged_attention.decode_attention` (math, or flash per block of keys, and lse merges); the launch
count is what changes: 2 here against about 20 small ones there, at every layer of every decoding step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from longstraw.kernels.dependent_launch import launches_dependent

# the prefix pass's launch, as `benchmarks/decode_attention_tune.py` measured best on an H100 (G=8 rows over SmolLM2's
# 16K-position pages and hybrid-1b's 1M): 128 keys a loop iteration ([rows, 128] x [128, head dim] tiles) at 4 warps,
# one program per multiprocessor. Against 4 programs of 64 keys it took 12.7 us a layer for 14.5 (SmolLM2: fewer
# partials to write and merge) and 350 us for 364 (hybrid-1b, at the pages' copy bandwidth)
BLOCK_N, WARPS = 128, 4
SPLITS_PER_SM = 1
MAX_ROWS = 128  # B * G rows in one tile (registers: rows x head dim float32 accumulators)
LOG2E = 1.4426950408889634


@triton.jit
def _prefix_partials(
    q_ptr, k_ptr, v_ptr, o_ptr, l_ptr,
    stride_qb, stride_qh, stride_kk, stride_kn, stride_vk, stride_vn,
    P, keys_per_split, ROWS, G, K, scale_log2,
    M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    if PDL:  # the merge may start now: it reads these partials only after this launch ends
        gdc_launch_dependents()
    head, split = tl.program_id(0), tl.program_id(1)
    rows = tl.arange(0, M)
    row_in = rows < ROWS
    b, g = rows // G, rows % G
    d, dv = tl.arange(0, D), tl.arange(0, DV)
    q = tl.load(q_ptr + b[:, None] * stride_qb + (head * G + g)[:, None] * stride_qh + d[None, :], mask=row_in[:, None])
    start = split * keys_per_split
    end = tl.minimum(start + keys_per_split, P)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, DV], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_in = n < end
        k = tl.load(k_ptr + head * stride_kk + n[:, None].to(tl.int64) * stride_kn + d[None, :], mask=n_in[:, None])
        v = tl.load(v_ptr + head * stride_vk + n[:, None].to(tl.int64) * stride_vn + dv[None, :], mask=n_in[:, None])
        s = tl.dot(q, tl.trans(k)) * scale_log2
        s = tl.where(n_in[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    at = (split * K + head) * ROWS + rows  # partials [splits, K, rows]
    tl.store(o_ptr + at[:, None] * DV + dv[None, :], acc / l_i[:, None], mask=row_in[:, None])
    tl.store(l_ptr + at, m_i + tl.log2(l_i), mask=row_in)


@triton.jit
def _own_and_merge(
    q_ptr, k_ptr, v_ptr, step_ptr, o_ptr, l_ptr, sinks_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_kk, stride_kn, stride_vb, stride_vk, stride_vn,
    stride_ob, stride_oh, H, G, K, ROWS, SPLITS, scale_log2,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, SINKS: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # b * H + h
    b, h = row // H, row % H
    head = h // G
    folded = b * G + h % G  # the row's index among the prefix pass's rows of its K/V head
    d, dv = tl.arange(0, D), tl.arange(0, DV)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d).to(tl.float32)
    # the row's own keys, those written so far (the current token's included)
    written = tl.load(step_ptr) + 1
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([DV], tl.float32)
    for n0 in range(0, written, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_in = n < written
        k = tl.load(k_ptr + b * stride_kb + head * stride_kk + n[:, None] * stride_kn + d[None, :], mask=n_in[:, None])
        v = tl.load(v_ptr + b * stride_vb + head * stride_vk + n[:, None] * stride_vn + dv[None, :], mask=n_in[:, None])
        s = tl.sum(k.to(tl.float32) * q[None, :], 1) * scale_log2
        s = tl.where(n_in, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), 0)
        m_i = m_new
    lse = m_i + tl.log2(l_i)
    out = acc / l_i
    if SINKS:  # one more key of logit sinks[h] (natural log) and value 0
        sink = tl.load(sinks_ptr + h).to(tl.float32) * 1.4426950408889634
        out, lse = _merge(out, lse, tl.zeros([1, DV], tl.float32), tl.zeros([1], tl.float32) + sink)
    if PDL:  # launched while the prefix pass runs: its partials are whole only once it has ended
        gdc_wait()
    # the prefix's partials of this row, merged a block of splits at a time
    for s0 in range(0, SPLITS, BLOCK_S):
        s_idx = s0 + tl.arange(0, BLOCK_S)
        s_in = s_idx < SPLITS
        at = (s_idx * K + head) * ROWS + folded
        lse_s = tl.load(l_ptr + at, mask=s_in, other=float("-inf"))
        o_s = tl.load(o_ptr + at[:, None] * DV + dv[None, :], mask=s_in[:, None], other=0.0)
        out, lse = _merge(out, lse, o_s, lse_s)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dv, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _merge(out, lse, out_s, lse_s):
    """(out, lse) of one row merged with partials (out_s [S, DV], lse_s [S], base 2; -inf where empty)."""
    top = tl.maximum(lse, tl.max(lse_s, 0))
    w_s = tl.exp2(lse_s - top)
    w = tl.exp2(lse - top)
    total = w + tl.sum(w_s, 0)
    return (out * w + tl.sum(w_s[:, None] * out_s, 0)) / total, top + tl.log2(total)


def decode_usable(q_BHTD, k_shared_1KPD, v_shared_1KPD, k_own_BKND) -> bool:
    """Whether `decode_attention_triton` computes this step: CUDA, 16-bit pages and queries of one dtype, head dims
    powers of two from 16 to 256, at most MAX_ROWS folded rows a K/V head, features contiguous."""
    B, H, T, D = q_BHTD.shape
    K, Dv = k_shared_1KPD.shape[1], v_shared_1KPD.shape[3]
    dims_ok = all(16 <= n <= 256 and n & (n - 1) == 0 for n in (D, Dv))
    return (
        q_BHTD.is_cuda
        and T == 1
        and q_BHTD.dtype in (torch.bfloat16, torch.float16)
        and q_BHTD.dtype == k_shared_1KPD.dtype == v_shared_1KPD.dtype == k_own_BKND.dtype
        and dims_ok
        and H % K == 0
        and B * (H // K) <= MAX_ROWS
        and all(t.stride(-1) == 1 for t in (q_BHTD, k_shared_1KPD, v_shared_1KPD, k_own_BKND))
    )


def _splits(P: int, heads: int, device, splits_per_sm: int, block_n: int) -> tuple[int, int]:
    """(splits, keys per split) of the prefix pass: about `splits_per_sm` programs a multiprocessor, a whole number
    of `block_n` keys each."""
    processors = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1
    wanted = max(1, min(triton.cdiv(P, block_n), triton.cdiv(splits_per_sm * processors, heads)))
    per_split = triton.cdiv(triton.cdiv(P, wanted), block_n) * block_n
    return triton.cdiv(P, per_split), per_split


def decode_attention_triton(
    q_BHTD,
    k_shared_1KPD,
    v_shared_1KPD,
    k_own_BKND,
    v_own_BKND,
    step_1,
    scale: float,
    sinks=None,
    *,
    splits_per_sm: int = SPLITS_PER_SM,
    block_n: int = BLOCK_N,
    warps: int = WARPS,
    stages: int | None = None,
    dependent: bool | None = None,
) -> torch.Tensor:
    """[B, H, 1, Dv] in q's dtype: each row over the shared prefix and its sequence's own keys at slots
    0..step_1 (see the module doc). The keywords set the prefix pass's launch (`benchmarks/decode_attention_tune.py`
    times them; the defaults are what it measured best) and whether the merge launches dependent (None: as
    `dependent_launch.decode_launches` has it; only where the device has it)."""
    B, H, _, D = q_BHTD.shape
    K, P, Dv = k_shared_1KPD.shape[1], k_shared_1KPD.shape[2], v_shared_1KPD.shape[3]
    G, rows = H // K, B * (H // K)
    scale_log2 = float(scale) * LOG2E
    splits, per_split = _splits(P, K, q_BHTD.device, splits_per_sm, block_n) if P else (0, block_n)
    partial_o = torch.empty(max(splits, 1), K, rows, Dv, dtype=torch.float32, device=q_BHTD.device)
    partial_l = torch.empty(max(splits, 1), K, rows, dtype=torch.float32, device=q_BHTD.device)
    dependent = bool(splits) and launches_dependent(q_BHTD.device, dependent)
    if splits:
        _prefix_partials[(K, splits)](
            q_BHTD, k_shared_1KPD, v_shared_1KPD, partial_o, partial_l,
            q_BHTD.stride(0), q_BHTD.stride(1), k_shared_1KPD.stride(1), k_shared_1KPD.stride(2),
            v_shared_1KPD.stride(1), v_shared_1KPD.stride(2),
            P, per_split, rows, G, K, scale_log2,
            M=max(16, triton.next_power_of_2(rows)), D=D, DV=Dv, BLOCK_N=block_n, PDL=dependent, num_warps=warps,
            **({} if stages is None else {"num_stages": stages}),
        )  # fmt: skip
    out = torch.empty(B, H, 1, Dv, dtype=q_BHTD.dtype, device=q_BHTD.device)
    _own_and_merge[(B * H,)](
        q_BHTD, k_own_BKND, v_own_BKND, step_1, partial_o, partial_l, sinks if sinks is not None else q_BHTD, out,
        q_BHTD.stride(0), q_BHTD.stride(1), k_own_BKND.stride(0), k_own_BKND.stride(1), k_own_BKND.stride(2),
        v_own_BKND.stride(0), v_own_BKND.stride(1), v_own_BKND.stride(2), out.stride(0), out.stride(1),
        H, G, K, rows, splits, scale_log2,
        D=D, DV=Dv, BLOCK_N=BLOCK_N, BLOCK_S=32, SINKS=sinks is not None, PDL=dependent, num_warps=WARPS,
        launch_pdl=dependent,
    )  # fmt: skip
    return out
