"""One decoding step's attention in one launch (Triton, CUDA): B sequences' queries over one prompt's shared pages,
split over the keys (flash-decoding), and each query row over its own sequence's keys, merged by the program that
finishes its K/V head last.

    out_BH1D = decode_attention_triton(q_BH1D, k_1KPD, v_1KPD, k_own_BKND, v_own_BKND, step_1, scale, sinks=None)

A decoding step's queries are few (B sequences times the G query heads of a K/V head) and its prefix long, so a
block kernel over [rows, keys] runs K programs over the whole prefix. Here `_one_launch` runs a program per (K/V
head, j), each writing float32 partials (out, lse in base 2):

- j < splits, a split of the prefix's keys (`_prefix_split`): the B * G rows of that head (every sequence's queries
  folded into one tile, so the prefix is read once for all sequences) against its keys, an online softmax;
- the rest, one a query row of the head (`_own_keys`): that row over its sequence's own keys up to the clock's step
  (`step_1`, read on the device: the launch is the same at every step, so a CUDA graph records it), and its sink
  logit when the layer has them.

Each program then counts itself on its head's counter: a barrier (every thread's partials stored), then an acq_rel
atomic add at GPU scope. The program that counts last has seen every other program's partials of its head: it sets
the counter back to zero for the next launch (a recorded graph replays it), merges the partials of the head's rows
(`_merge_head`, read past the L1, which is not coherent across multiprocessors) and writes them in q's dtype. No
program waits on another, so no schedule can hang it; the merge runs on one program a head, after the last split.

`one_launch=False` (or `decode_launches("two")`) runs the two launches it replaced, the reference beside it
(`benchmarks/decode_attention_tune.py` times both): `_prefix_partials`, the splits, then `_own_and_merge`, a program
a row: its own keys, then the splits' partials merged in blocks. The two merge in other orders (a row at a time in
blocks of splits; all the head's rows at once, a chunk of partials at a time; and past head dim 64 the one launch
takes the own keys in smaller blocks), so they agree to float32 rounding, not bit for bit; each gives the same bits
from run to run, whichever program merges.

The reference is `paged_attention.decode_attention` (math, or flash per block of keys, and lse merges); the launch
count is what changes: 1 here against about 20 small ones there, at every layer of every decoding step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longstraw.kernels.process_setting import ProcessSetting

# the prefix pass's launch, as `benchmarks/decode_attention_tune.py` measured best on an H100 (G=8 rows over SmolLM2's
# 16K-position pages and hybrid-1b's 1M): 128 keys a loop iteration ([rows, 128] x [128, head dim] tiles) at 4 warps,
# one program per multiprocessor. Against 4 programs of 64 keys it took 12.7 us a layer for 14.5 (SmolLM2: fewer
# partials to write and merge) and 350 us for 364 (hybrid-1b, at the pages' copy bandwidth)
BLOCK_N, WARPS = 128, 4
SPLITS_PER_SM = 1
MAX_ROWS = 128  # B * G rows in one tile (registers: rows x head dim float32 accumulators)
LOG2E = 1.4426950408889634
# the default form: one launch (the two launches' boundary and the rows' own keys off the critical path) until
# `benchmarks/decode_attention_tune.py` on the GPU says the one program merging a head's partials costs more
ONE_LAUNCH = True
# the one launch's other tiles, in float32 elements a thread: its program holds the registers of the largest of its
# three paths, so the merge's [rows, head dim] accumulators and [partials, rows, head dim] loads (24 KB in flight at
# SmolLM2's shape) and the own keys' [keys, head dim] blocks stay near the prefix split's (ptxas for sm_90 from
# Triton 3.8: 137 registers against the split's 128 at SmolLM2's shape, no spills there)
MERGE_ROWS_TILE, MERGE_TILE, OWN_TILE = 16, 64, 64

_launches = ProcessSetting("decode attention launches", ("one", "two"), "one" if ONE_LAUNCH else "two")


def decode_launches(name: str):
    """Within the block, `decode_attention_triton` runs in `name` ("one" or "two") launches unless told."""
    return _launches.within(name)


@triton.jit
def _prefix_split(
    q_ptr, k_ptr, v_ptr, o_ptr, l_ptr, head, split,
    stride_qb, stride_qh, stride_kk, stride_kn, stride_vk, stride_vn,
    P, keys_per_split, ROWS, G, K, scale_log2,
    M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """One split of the prefix: the ROWS rows of K/V head `head` over its keys, (out, lse) into the partials."""
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
def _own_keys(
    q_ptr, k_ptr, v_ptr, step_ptr, sinks_ptr, b, h, head,
    stride_qb, stride_qh, stride_kb, stride_kk, stride_kn, stride_vb, stride_vk, stride_vn, scale_log2,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    """(out [DV], lse [1]) of query row (b, h) over its sequence's own keys written so far (the current token's
    included) and, with SINKS, its sink logit."""
    d, dv = tl.arange(0, D), tl.arange(0, DV)
    q = tl.load(q_ptr + b * stride_qb + h * stride_qh + d).to(tl.float32)
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
def _merge(out, lse, out_s, lse_s):
    """(out, lse) of one row merged with partials (out_s [S, DV], lse_s [S], base 2; -inf where empty)."""
    top = tl.maximum(lse, tl.max(lse_s, 0))
    w_s = tl.exp2(lse_s - top)
    w = tl.exp2(lse - top)
    total = w + tl.sum(w_s, 0)
    return (out * w + tl.sum(w_s[:, None] * out_s, 0)) / total, top + tl.log2(total)


@triton.jit
def _prefix_partials(
    q_ptr, k_ptr, v_ptr, o_ptr, l_ptr,
    stride_qb, stride_qh, stride_kk, stride_kn, stride_vk, stride_vn,
    P, keys_per_split, ROWS, G, K, scale_log2,
    M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """The two launches' first: a program per (K/V head, split)."""
    _prefix_split(
        q_ptr, k_ptr, v_ptr, o_ptr, l_ptr, tl.program_id(0), tl.program_id(1),
        stride_qb, stride_qh, stride_kk, stride_kn, stride_vk, stride_vn,
        P, keys_per_split, ROWS, G, K, scale_log2, M, D, DV, BLOCK_N,
    )  # fmt: skip


@triton.jit
def _own_and_merge(
    q_ptr, k_ptr, v_ptr, step_ptr, o_ptr, l_ptr, sinks_ptr, out_ptr,
    stride_qb, stride_qh, stride_kb, stride_kk, stride_kn, stride_vb, stride_vk, stride_vn,
    stride_ob, stride_oh, H, G, K, ROWS, SPLITS, scale_log2,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_S: tl.constexpr, SINKS: tl.constexpr,
):  # fmt: skip
    """The two launches' second: a program per query row, its own keys, then the prefix's partials of it merged."""
    row = tl.program_id(0)  # b * H + h
    b, h = row // H, row % H
    head = h // G
    folded = b * G + h % G  # the row's index among the prefix pass's rows of its K/V head
    dv = tl.arange(0, DV)
    out, lse = _own_keys(
        q_ptr, k_ptr, v_ptr, step_ptr, sinks_ptr, b, h, head,
        stride_qb, stride_qh, stride_kb, stride_kk, stride_kn, stride_vb, stride_vk, stride_vn, scale_log2,
        D, DV, BLOCK_N, SINKS,
    )  # fmt: skip
    for s0 in range(0, SPLITS, BLOCK_S):  # a block of splits at a time
        s_idx = s0 + tl.arange(0, BLOCK_S)
        s_in = s_idx < SPLITS
        at = (s_idx * K + head) * ROWS + folded
        lse_s = tl.load(l_ptr + at, mask=s_in, other=float("-inf"))
        o_s = tl.load(o_ptr + at[:, None] * DV + dv[None, :], mask=s_in[:, None], other=0.0)
        out, lse = _merge(out, lse, o_s, lse_s)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dv, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _merge_head(
    o_ptr, l_ptr, out_ptr, head, K, ROWS, G, PARTS, stride_ob, stride_oh,
    DV: tl.constexpr, RB: tl.constexpr, SB: tl.constexpr,
):  # fmt: skip
    """Each of K/V head `head`'s ROWS rows, the merge of its PARTS partials, written to out in its dtype: RB rows at
    a time, SB partials at a time (an online softmax over them). The partials are read past the L1 (`.cg`): other
    programs wrote them in this launch, and a multiprocessor's L1 is not kept coherent with their stores."""
    dv = tl.arange(0, DV)
    for r0 in range(0, ROWS, RB):
        rows = r0 + tl.arange(0, RB)
        row_in = rows < ROWS
        m_i = tl.full([RB], float("-inf"), tl.float32)
        l_i = tl.zeros([RB], tl.float32)
        acc = tl.zeros([RB, DV], tl.float32)
        for p0 in range(0, PARTS, SB):
            p = p0 + tl.arange(0, SB)
            at = (p[:, None] * K + head) * ROWS + rows[None, :]  # [SB, RB]
            ok = (p < PARTS)[:, None] & row_in[None, :]
            lse = tl.load(l_ptr + at, mask=ok, other=float("-inf"), cache_modifier=".cg")
            lse = tl.where(row_in[None, :], lse, 0.0)  # a padded row's: finite, so no -inf - -inf nor 0 / 0
            o = tl.load(o_ptr + at[:, :, None] * DV + dv, mask=ok[:, :, None], other=0.0, cache_modifier=".cg")
            m_new = tl.maximum(m_i, tl.max(lse, 0))
            w = tl.exp2(lse - m_new[None, :])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(w, 0)
            acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, 0)
            m_i = m_new
        b, h = rows // G, head * G + rows % G
        out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + b[:, None] * stride_ob + h[:, None] * stride_oh + dv[None, :], out, mask=row_in[:, None])


@triton.jit
def _one_launch(
    q_ptr, k_ptr, v_ptr, k_own_ptr, v_own_ptr, step_ptr, sinks_ptr, o_ptr, l_ptr, out_ptr, count_ptr,
    stride_qb, stride_qh, stride_kk, stride_kn, stride_vk, stride_vn,
    stride_okb, stride_okk, stride_okn, stride_ovb, stride_ovk, stride_ovn, stride_outb, stride_outh,
    P, keys_per_split, G, K, ROWS, SPLITS, scale_log2,
    M: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_OWN: tl.constexpr,
    SINKS: tl.constexpr, RB: tl.constexpr, SB: tl.constexpr,
):  # fmt: skip
    """The whole step in one launch, a program per (K/V head, j) (the module doc): j < SPLITS a prefix split, else
    the head's row j - SPLITS over its own keys, into partials [SPLITS + 1, K, ROWS] (the own keys' at SPLITS).
    count_ptr: a counter per K/V head, zero at the start and zero again at the end."""
    head, j = tl.program_id(0), tl.program_id(1)
    if j < SPLITS:
        _prefix_split(
            q_ptr, k_ptr, v_ptr, o_ptr, l_ptr, head, j,
            stride_qb, stride_qh, stride_kk, stride_kn, stride_vk, stride_vn,
            P, keys_per_split, ROWS, G, K, scale_log2, M, D, DV, BLOCK_N,
        )  # fmt: skip
    else:
        row = j - SPLITS  # b * G + g, as the splits fold the head's rows
        b, h = row // G, head * G + row % G
        out, lse = _own_keys(
            q_ptr, k_own_ptr, v_own_ptr, step_ptr, sinks_ptr, b, h, head,
            stride_qb, stride_qh, stride_okb, stride_okk, stride_okn, stride_ovb, stride_ovk, stride_ovn, scale_log2,
            D, DV, BLOCK_OWN, SINKS,
        )  # fmt: skip
        at = (SPLITS * K + head) * ROWS + row
        tl.store(o_ptr + at * DV + tl.arange(0, DV), out)
        tl.store(l_ptr + at + tl.arange(0, 1), lse)
    tl.debug_barrier()  # every thread's partials stored before the release below publishes them
    if tl.atomic_add(count_ptr + head, 1, sem="acq_rel", scope="gpu") == SPLITS + ROWS - 1:
        # the last of the head: every other program's partials are visible (acquire; the atomic's result reaches
        # the other threads through shared memory and a barrier, after it)
        tl.atomic_xchg(count_ptr + head, 0, sem="relaxed", scope="gpu")  # zero for the next launch
        _merge_head(o_ptr, l_ptr, out_ptr, head, K, ROWS, G, SPLITS + 1, stride_outb, stride_outh, DV, RB, SB)


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


_COUNTS: dict = {}  # device -> the one launch's counters, zero between launches


def head_counts(device, heads: int) -> torch.Tensor:
    """The one launch's counters (int32, a K/V head each) on `device`: allocated zero once and shared by every launch
    there, each leaving them zero, so launches must not overlap in time (one stream at a time). A first use inside a
    CUDA graph's recording gets a buffer of its own, zeroed by the recording (the graph's pool owns it)."""
    key = (device.type, device.index)
    counts = _COUNTS.get(key)
    if counts is None or counts.numel() < heads:
        counts = torch.zeros(max(heads, 8), dtype=torch.int32, device=device)
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return counts
        _COUNTS[key] = counts
    return counts


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
    one_launch: bool | None = None,
) -> torch.Tensor:
    """[B, H, 1, Dv] in q's dtype: each row over the shared prefix and its sequence's own keys at slots
    0..step_1 (see the module doc). The keywords set the prefix pass's launch (`benchmarks/decode_attention_tune.py`
    times them); the defaults are what it measured best. `one_launch`: one launch or two (None: `decode_launches`'
    setting, ONE_LAUNCH unless changed)."""
    K, P = k_shared_1KPD.shape[1], k_shared_1KPD.shape[2]
    splits, per_split = _splits(P, K, q_BHTD.device, splits_per_sm, block_n) if P else (0, block_n)
    launch = dict(num_warps=warps, **({} if stages is None else {"num_stages": stages}))
    args = (q_BHTD, k_shared_1KPD, v_shared_1KPD, k_own_BKND, v_own_BKND, step_1, float(scale) * LOG2E, sinks)
    one = _launches.value == "one" if one_launch is None else one_launch
    if one:
        return _in_one_launch(*args, splits, per_split, block_n, launch)
    return _in_two_launches(*args, splits, per_split, block_n, launch)


def _in_one_launch(q, k_shared, v_shared, k_own, v_own, step_1, scale_log2, sinks, splits, per_split, block_n, launch):
    """`_one_launch` over (K/V heads, splits + rows), its merge's tiles and own keys' block sized to the warps."""
    B, H, _, D = q.shape
    K, P, Dv = k_shared.shape[1], k_shared.shape[2], v_shared.shape[3]
    G, rows = H // K, B * (H // K)
    M, threads = max(16, triton.next_power_of_2(rows)), 32 * launch["num_warps"]
    partial_o = torch.empty(splits + 1, K, rows, Dv, dtype=torch.float32, device=q.device)
    partial_l = torch.empty(splits + 1, K, rows, dtype=torch.float32, device=q.device)
    out = torch.empty(B, H, 1, Dv, dtype=q.dtype, device=q.device)
    merge_rows = min(M, MERGE_ROWS_TILE * threads // Dv)
    merge_parts = min(triton.next_power_of_2(splits + 1), MERGE_TILE * threads // (merge_rows * Dv))
    own_block = min(BLOCK_N, OWN_TILE * threads // D)
    _one_launch[(K, splits + rows)](
        q, k_shared, v_shared, k_own, v_own, step_1, sinks if sinks is not None else q, partial_o, partial_l, out,
        head_counts(q.device, K),
        q.stride(0), q.stride(1), k_shared.stride(1), k_shared.stride(2), v_shared.stride(1), v_shared.stride(2),
        k_own.stride(0), k_own.stride(1), k_own.stride(2), v_own.stride(0), v_own.stride(1), v_own.stride(2),
        out.stride(0), out.stride(1),
        P, per_split, G, K, rows, splits, scale_log2,
        M=M, D=D, DV=Dv, BLOCK_N=block_n, BLOCK_OWN=own_block, SINKS=sinks is not None, RB=merge_rows, SB=merge_parts,
        **launch,
    )  # fmt: skip
    return out


def _in_two_launches(
    q, k_shared, v_shared, k_own, v_own, step_1, scale_log2, sinks, splits, per_split, block_n, launch
):
    """`_prefix_partials` over (K/V heads, splits), then `_own_and_merge` over the rows."""
    B, H, _, D = q.shape
    K, P, Dv = k_shared.shape[1], k_shared.shape[2], v_shared.shape[3]
    G, rows = H // K, B * (H // K)
    partial_o = torch.empty(max(splits, 1), K, rows, Dv, dtype=torch.float32, device=q.device)
    partial_l = torch.empty(max(splits, 1), K, rows, dtype=torch.float32, device=q.device)
    if splits:
        _prefix_partials[(K, splits)](
            q, k_shared, v_shared, partial_o, partial_l,
            q.stride(0), q.stride(1), k_shared.stride(1), k_shared.stride(2), v_shared.stride(1), v_shared.stride(2),
            P, per_split, rows, G, K, scale_log2,
            M=max(16, triton.next_power_of_2(rows)), D=D, DV=Dv, BLOCK_N=block_n, **launch,
        )  # fmt: skip
    out = torch.empty(B, H, 1, Dv, dtype=q.dtype, device=q.device)
    _own_and_merge[(B * H,)](
        q, k_own, v_own, step_1, partial_o, partial_l, sinks if sinks is not None else q, out,
        q.stride(0), q.stride(1), k_own.stride(0), k_own.stride(1), k_own.stride(2),
        v_own.stride(0), v_own.stride(1), v_own.stride(2), out.stride(0), out.stride(1),
        H, G, K, rows, splits, scale_log2,
        D=D, DV=Dv, BLOCK_N=BLOCK_N, BLOCK_S=32, SINKS=sinks is not None, num_warps=WARPS,
    )  # fmt: skip
    return out
