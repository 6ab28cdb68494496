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

The reference is `paged_attention.decode_attention` (math, or flash per block of keys, and lse merges); the launch
count is what changes: 2 here against about 20 small ones there, at every layer of every decoding step.

`one_launch=True` runs both passes as one launch (`_one_launch`): each program takes a ticket from a counter as it
starts, the first K * splits do the prefix's splits and count them done per K/V head, the rest are the query rows,
which take their own keys first, wait until their head's splits are done, and merge; the last row zeroes the
counters for the next launch. A row waits only on programs that started before it, so no wait can keep one from
starting (the argument of decoupled look-back scans). The arithmetic is the two launches' (the same functions),
bit for bit at the default warps. Not the default until timed on the GPU (`benchmarks/decode_attention_tune.py`
times both): it saves a launch boundary a layer, and its rows wait inside the launch instead.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# the prefix pass's launch, as `benchmarks/decode_attention_tune.py` measured best on an H100 (G=8 rows over SmolLM2's
# 16K-position pages and hybrid-1b's 1M): 128 keys a loop iteration ([rows, 128] x [128, head dim] tiles) at 4 warps,
# one program per multiprocessor. Against 4 programs of 64 keys it took 12.7 us a layer for 14.5 (SmolLM2: fewer
# partials to write and merge) and 350 us for 364 (hybrid-1b, at the pages' copy bandwidth)
BLOCK_N, WARPS = 128, 4
SPLITS_PER_SM = 1
ONE_LAUNCH = False  # both passes in one launch (`_one_launch`): to be timed on the GPU before it is the default
MAX_ROWS = 128  # B * G rows in one tile (registers: rows x head dim float32 accumulators)
LOG2E = 1.4426950408889634


@triton.jit
def _prefix_split(
    q_ptr, k_ptr, v_ptr, o_ptr, l_ptr, head, split,
    stride_qb, stride_qh, stride_kk, stride_kn, stride_vk, stride_vn,
    P, keys_per_split, ROWS, G, K, scale_log2,
    M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One split of the prefix pass: the ROWS rows of K/V head `head` over its keys, (out, lse) into the partials."""
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
def _prefix_partials(
    q_ptr, k_ptr, v_ptr, o_ptr, l_ptr,
    stride_qb, stride_qh, stride_kk, stride_kn, stride_vk, stride_vn,
    P, keys_per_split, ROWS, G, K, scale_log2,
    M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    _prefix_split(
        q_ptr, k_ptr, v_ptr, o_ptr, l_ptr, tl.program_id(0), tl.program_id(1),
        stride_qb, stride_qh, stride_kk, stride_kn, stride_vk, stride_vn,
        P, keys_per_split, ROWS, G, K, scale_log2, M, D, DV, BLOCK_N,
    )  # fmt: skip


@triton.jit
def _own_keys(
    q_ptr, k_ptr, v_ptr, step_ptr, sinks_ptr, b, h, head,
    stride_qb, stride_qh, stride_kb, stride_kk, stride_kn, stride_vb, stride_vk, stride_vn, scale_log2,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    """(out, lse) of query row (b, h) over its sequence's own keys written so far (and its sink logit)."""
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
    return out, lse


@triton.jit
def _merged_into(
    out, lse, o_ptr, l_ptr, out_ptr, folded, head, K, ROWS, SPLITS, DV: tl.constexpr, BLOCK_S: tl.constexpr
):
    """A row's (out, lse) merged with the prefix's partials of it, a block of splits at a time, stored at `out_ptr`.
    The partials are read from L2 (`.cg`): in one launch other programs wrote them."""
    dv = tl.arange(0, DV)
    for s0 in range(0, SPLITS, BLOCK_S):
        s_idx = s0 + tl.arange(0, BLOCK_S)
        s_in = s_idx < SPLITS
        at = (s_idx * K + head) * ROWS + folded
        lse_s = tl.load(l_ptr + at, mask=s_in, other=float("-inf"), cache_modifier=".cg")
        o_s = tl.load(o_ptr + at[:, None] * DV + dv[None, :], mask=s_in[:, None], other=0.0, cache_modifier=".cg")
        out, lse = _merge(out, lse, o_s, lse_s)
    tl.store(out_ptr + dv, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _own_and_merge(
    q_ptr, k_ptr, v_ptr, step_ptr, o_ptr, l_ptr, sinks_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_kk, stride_kn, stride_vb, stride_vk, stride_vn,
    stride_ob, stride_oh, H, G, K, ROWS, SPLITS, scale_log2,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)  # b * H + h
    b, h = row // H, row % H
    head = h // G
    out, lse = _own_keys(
        q_ptr, k_ptr, v_ptr, step_ptr, sinks_ptr, b, h, head,
        stride_qb, stride_qh, stride_kb, stride_kk, stride_kn, stride_vb, stride_vk, stride_vn, scale_log2,
        D, DV, BLOCK_N, SINKS,
    )  # fmt: skip
    folded = b * G + h % G  # the row's index among the prefix pass's rows of its K/V head
    row_out = out_ptr + b * stride_ob + h * stride_oh
    _merged_into(out, lse, o_ptr, l_ptr, row_out, folded, head, K, ROWS, SPLITS, DV, BLOCK_S)


@triton.jit
def _one_launch(
    q_ptr, k_shared_ptr, v_shared_ptr, k_own_ptr, v_own_ptr, step_ptr, o_ptr, l_ptr, sinks_ptr, out_ptr, counters_ptr,
    stride_qb, stride_qh, stride_sk, stride_sn, stride_tk, stride_tn,
    stride_kb, stride_kk, stride_kn, stride_vb, stride_vk, stride_vn, stride_ob, stride_oh,
    P, keys_per_split, H, G, K, ROWS, SPLITS, scale_log2,
    M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_OWN: tl.constexpr,
    BLOCK_S: tl.constexpr, SINKS: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """Both passes in one launch. counters_ptr (int32, zero at the start, zero again at the end): [tickets, each K/V
    head's finished splits, rows done]. A program's ticket, taken as it starts, picks its work: the first K * SPLITS
    a prefix split, the rest a query row, which takes its own keys, waits for its head's splits, then merges. A row
    waits only on tickets taken before its own, by programs already running: no wait can hold one that has not
    started (decoupled look-back's argument)."""
    ticket = tl.atomic_add(counters_ptr, 1)
    prefix = K * SPLITS
    if ticket < prefix:
        head = ticket % K
        _prefix_split(
            q_ptr, k_shared_ptr, v_shared_ptr, o_ptr, l_ptr, head, ticket // K,
            stride_qb, stride_qh, stride_sk, stride_sn, stride_tk, stride_tn,
            P, keys_per_split, ROWS, G, K, scale_log2, M, D, DV, BLOCK_N,
        )  # fmt: skip
        tl.debug_barrier()  # every thread's partials stored before the release below publishes them
        tl.atomic_add(counters_ptr + 1 + head, 1, sem="release")
    else:
        row = ticket - prefix  # b * H + h
        b, h = row // H, row % H
        head = h // G
        out, lse = _own_keys(
            q_ptr, k_own_ptr, v_own_ptr, step_ptr, sinks_ptr, b, h, head,
            stride_qb, stride_qh, stride_kb, stride_kk, stride_kn, stride_vb, stride_vk, stride_vn, scale_log2,
            D, DV, BLOCK_OWN, SINKS,
        )  # fmt: skip
        while tl.atomic_add(counters_ptr + 1 + head, 0, sem="acquire") < SPLITS:
            pass
        tl.debug_barrier()  # no thread reads the partials before the acquire above
        row_out = out_ptr + b * stride_ob + h * stride_oh
        _merged_into(out, lse, o_ptr, l_ptr, row_out, b * G + h % G, head, K, ROWS, SPLITS, DV, BLOCK_S)
        if tl.atomic_add(counters_ptr + 1 + K, 1) == (ROWS // G) * H - 1:  # the last row: every counter is done
            slots = tl.arange(0, BLOCK_C)
            tl.store(counters_ptr + slots, tl.zeros([BLOCK_C], tl.int32), mask=slots < K + 2)


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


_COUNTERS: dict = {}  # (device, K/V heads) -> `_one_launch`'s counters, zero between launches


def _counters(device, heads: int) -> torch.Tensor | None:
    """`_one_launch`'s counters for `heads` K/V heads on `device`, allocated once (zeros; each launch leaves them
    zero): None where the first call is inside a CUDA graph's recording, whose pool would own them. Launches on one
    device share them, so they must not run concurrently (on two streams at once)."""
    key = (device, heads)
    if key not in _COUNTERS:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        _COUNTERS[key] = torch.zeros(heads + 2, dtype=torch.int32, device=device)
    return _COUNTERS[key]


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
    one_launch: bool = ONE_LAUNCH,
) -> torch.Tensor:
    """[B, H, 1, Dv] in q's dtype: each row over the shared prefix and its sequence's own keys at slots
    0..step_1 (see the module doc). The keywords set the prefix pass's launch (`benchmarks/decode_attention_tune.py`
    times them); the defaults are what it measured best. `one_launch`: both passes in one launch (`_one_launch`), the
    same arithmetic at the default warps (where its counters cannot be allocated, in a recording, two launches)."""
    B, H, _, D = q_BHTD.shape
    K, P, Dv = k_shared_1KPD.shape[1], k_shared_1KPD.shape[2], v_shared_1KPD.shape[3]
    G, rows = H // K, B * (H // K)
    scale_log2 = float(scale) * LOG2E
    splits, per_split = _splits(P, K, q_BHTD.device, splits_per_sm, block_n) if P else (0, block_n)
    partial_o = torch.empty(max(splits, 1), K, rows, Dv, dtype=torch.float32, device=q_BHTD.device)
    partial_l = torch.empty(max(splits, 1), K, rows, dtype=torch.float32, device=q_BHTD.device)
    if splits:
        _prefix_partials[(K, splits)](
            q_BHTD, k_shared_1KPD, v_shared_1KPD, partial_o, partial_l,
            q_BHTD.stride(0), q_BHTD.stride(1), k_shared_1KPD.stride(1), k_shared_1KPD.stride(2),
            v_shared_1KPD.stride(1), v_shared_1KPD.stride(2),
            P, per_split, rows, G, K, scale_log2,
            M=max(16, triton.next_power_of_2(rows)), D=D, DV=Dv, BLOCK_N=block_n, num_warps=warps,
            **({} if stages is None else {"num_stages": stages}),
        )  # fmt: skip
    out = torch.empty(B, H, 1, Dv, dtype=q_BHTD.dtype, device=q_BHTD.device)
    counters = _counters(q_BHTD.device, K) if one_launch else None
    if counters is not None:
        _one_launch[(K * splits + B * H,)](
            q_BHTD, k_shared_1KPD, v_shared_1KPD, k_own_BKND, v_own_BKND, step_1, partial_o, partial_l,
            sinks if sinks is not None else q_BHTD, out, counters,
            q_BHTD.stride(0), q_BHTD.stride(1), k_shared_1KPD.stride(1), k_shared_1KPD.stride(2),
            v_shared_1KPD.stride(1), v_shared_1KPD.stride(2),
            k_own_BKND.stride(0), k_own_BKND.stride(1), k_own_BKND.stride(2),
            v_own_BKND.stride(0), v_own_BKND.stride(1), v_own_BKND.stride(2), out.stride(0), out.stride(1),
            P, per_split, H, G, K, rows, splits, scale_log2,
            M=max(16, triton.next_power_of_2(rows)), D=D, DV=Dv, BLOCK_N=block_n, BLOCK_OWN=BLOCK_N, BLOCK_S=32,
            SINKS=sinks is not None, BLOCK_C=triton.next_power_of_2(K + 2), num_warps=warps,
            **({} if stages is None else {"num_stages": stages}),
        )  # fmt: skip
        return out
    _own_and_merge[(B * H,)](
        q_BHTD, k_own_BKND, v_own_BKND, step_1, partial_o, partial_l, sinks if sinks is not None else q_BHTD, out,
        q_BHTD.stride(0), q_BHTD.stride(1), k_own_BKND.stride(0), k_own_BKND.stride(1), k_own_BKND.stride(2),
        v_own_BKND.stride(0), v_own_BKND.stride(1), v_own_BKND.stride(2), out.stride(0), out.stride(1),
        H, G, K, rows, splits, scale_log2,
        D=D, DV=Dv, BLOCK_N=BLOCK_N, BLOCK_S=32, SINKS=sinks is not None, num_warps=WARPS,
    )  # fmt: skip
    return out
