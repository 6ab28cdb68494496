"""A Gated DeltaNet forward's state scan with the output computed inside it (Triton, CUDA; capture's no-grad path).

    o_BTHV, final_BHKV = chunk_scan_output_triton(q, k, w, u, g, initial_state, scale)

fla's chunk forward runs the scan over chunks (`chunk_gated_delta_rule_fwd_h`) and then the output
(`chunk_fwd_o`) as two kernels: the scan writes every chunk's start state and its delta-corrected values, and the
output kernel reads them back (at hybrid-1b's capture, 32,768 tokens and 32 value heads of 128, 537 MB of states and
268 MB of values a layer, each written and read: fwd_h 8.2 ms and chunk_o 6.9 ms of the capture's 151 ms of
kernels over 12 layers). Here one program per (sequence, value head, block of value columns) carries the state
through the chunks as fla's scan does and computes each chunk's output where its state and values already are:
nothing but the output and the final state is written. With G the within-chunk cumulative log2 decay (fla's
`chunk_local_cumsum` with scale 1 / ln 2), W and U the chunk's WY representation (fla's
`chunk_gated_delta_rule_fwd_intra`) and S the state at the chunk's start, per chunk::

    V' = U - W S                                       (the delta rule's corrected values)
    O  = scale (diag(2^G) Q S + (Q K^T * 2^(G_i - G_j), j <= i) V')
    S  = 2^(G_last) S + K^T (V' * 2^(G_last - G))

as fla's two kernels compute it, operand for operand (S, V' and the masked scores rounded to the inputs' dtype
where they enter a product, as fla stores them). The scores P = Q K^T * 2^(G_i - G_j) (j <= i) do not depend on the
state: a first kernel computes every chunk's at once (`_chunk_scores_kernel`, one program a chunk and value head) and
the scan reads them: four products a chunk in the sequential loop instead of five, and the one left out is the
largest (BT x BT x K), which each of a head's value-block programs computed again.
The reference is the token-by-token rule in `longstraw.kernels.gdn`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from longstraw.kernels.tuning import log2_bucket


def _blocks_within_head(configs, named_args, **kwargs):
    """The configurations whose value block fits the head: one wider than V would launch no program (V // BV = 0)
    and write nothing, the fastest candidate the autotuner could meet (at value heads of 32)."""
    head_dim = {**named_args, **kwargs}["V"]
    return [config for config in configs if config.kwargs["BV"] <= head_dim]


@triton.jit
def _chunk_scores_kernel(
    q_ptr,
    k_ptr,
    g_ptr,
    p_ptr,
    T,
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    BT: tl.constexpr,
):
    """Chunk `program_id(0)` of value head i_h of sequence i_n: P = Q K^T * 2^(G_i - G_j) where j <= i (zeros above
    the diagonal and at rows or columns past T), rounded to q's dtype, into p [N, HV, NT, BT, BT]."""
    i_t, i_nh = tl.program_id(0).to(tl.int64), tl.program_id(1).to(tl.int64)
    i_n, i_h = i_nh // HV, i_nh % HV
    i_qk = i_h // (HV // H)
    keys = tl.arange(0, K)
    in_chunk = tl.arange(0, BT)
    rows = i_t * BT + in_chunk
    valid = rows < T
    tokens = i_n * T + rows
    q = tl.load(q_ptr + (tokens[:, None] * H + i_qk) * K + keys[None, :], mask=valid[:, None], other=0.0)
    k_t = tl.load(k_ptr + (tokens[None, :] * H + i_qk) * K + keys[:, None], mask=valid[None, :], other=0.0)
    g = tl.load(g_ptr + tokens * HV + i_h, mask=valid, other=0.0)
    scores = tl.dot(q, k_t) * tl.exp2(g[:, None] - g[None, :])
    keep = (in_chunk[:, None] >= in_chunk[None, :]) & valid[:, None] & valid[None, :]
    scores = tl.where(keep, scores, 0.0)
    at = ((i_nh * tl.num_programs(0) + i_t) * BT + in_chunk[:, None]) * BT + in_chunk[None, :]
    tl.store(p_ptr + at, scores.to(p_ptr.dtype.element_ty))


# On an H100 at hybrid-1b's capture shape, with the scores computed inside the scan, the autotuner chose 32-wide
# blocks, 4 warps, 3 stages (1.18 ms a layer); 16-wide blocks (twice the programs, each computing the scores again)
# took 1.41-1.98 ms, 64-wide at 8 warps 2.18-2.34: `benchmarks/gdn_capture_scan.py`. Without the scores
# on the sequential path, 16-wide blocks (two programs an SM) are offered again
@triton.autotune(
    configs=[
        triton.Config({"BV": bv}, num_warps=w, num_stages=s) for bv in (16, 32, 64) for w in (4, 8) for s in (2, 3)
    ],
    key=["H", "HV", "K", "V", "BT", "CHUNKS_LOG2"],
    prune_configs_by={"early_config_prune": _blocks_within_head},
)
@triton.jit(do_not_specialize=["T", "CHUNKS_LOG2"])
def _scan_output_kernel(
    q_ptr,
    k_ptr,
    p_ptr,
    w_ptr,
    u_ptr,
    g_ptr,
    h0_ptr,
    o_ptr,
    ht_ptr,
    scale,
    T,
    CHUNKS_LOG2,  # read by the autotuner only: `log2_bucket` of the chunk count
    H: tl.constexpr,
    HV: tl.constexpr,
    K: tl.constexpr,
    V: tl.constexpr,
    BT: tl.constexpr,
    BV: tl.constexpr,
    HAS_INITIAL_STATE: tl.constexpr,
):
    """Value columns [i_v BV, (i_v + 1) BV) of value head i_h of sequence i_n, through every chunk. q and k
    [N, T, H, K] (value head h reads q/k head h // (HV / H)), p [N, HV, NT, BT, BT] (`_chunk_scores_kernel`),
    w [N, T, HV, K], u and o [N, T, HV, V], g [N, T, HV] (float32), the states [N, HV, K, V] (float32)."""
    pid = tl.program_id(0).to(tl.int64)
    NV = V // BV
    i_v, i_nh = pid % NV, pid // NV
    i_n, i_h = i_nh // HV, i_nh % HV
    i_qk = i_h // (HV // H)
    dtype = w_ptr.dtype.element_ty
    keys = tl.arange(0, K)
    values = i_v * BV + tl.arange(0, BV)
    in_chunk = tl.arange(0, BT)
    scores_at = (i_nh * tl.cdiv(T, BT) * BT + in_chunk[:, None]) * BT + in_chunk[None, :]

    state = tl.zeros([K, BV], dtype=tl.float32)
    state_at = (i_nh * K + keys[:, None]) * V + values[None, :]
    if HAS_INITIAL_STATE:
        state += tl.load(h0_ptr + state_at)

    for i_t in range(tl.cdiv(T, BT)):
        rows = i_t * BT + in_chunk
        valid = rows < T
        tokens = i_n * T + rows  # row index into the [N * T, ...] tensors
        q = tl.load(q_ptr + (tokens[:, None] * H + i_qk) * K + keys[None, :], mask=valid[:, None], other=0.0)
        k_t = tl.load(k_ptr + (tokens[None, :] * H + i_qk) * K + keys[:, None], mask=valid[None, :], other=0.0)
        w = tl.load(w_ptr + (tokens[:, None] * HV + i_h) * K + keys[None, :], mask=valid[:, None], other=0.0)
        u = tl.load(u_ptr + (tokens[:, None] * HV + i_h) * V + values[None, :], mask=valid[:, None], other=0.0)
        g = tl.load(g_ptr + tokens * HV + i_h, mask=valid, other=0.0)
        g_last = tl.load(g_ptr + (i_n * T + tl.minimum((i_t + 1) * BT, T) - 1) * HV + i_h)

        state_in = state.to(dtype)
        corrected = u.to(tl.float32) - tl.dot(w, state_in)  # V' = U - W S
        corrected_in = corrected.to(dtype)
        scores = tl.load(p_ptr + scores_at + i_t * BT * BT)
        out = tl.dot(q, state_in) * tl.exp2(g)[:, None] + tl.dot(scores, corrected_in)
        o_at = (tokens[:, None] * HV + i_h) * V + values[None, :]
        tl.store(o_ptr + o_at, (out * scale).to(o_ptr.dtype.element_ty), mask=valid[:, None])

        decayed = corrected * tl.where(valid, tl.exp2(g_last - g), 0.0)[:, None]
        state = state * tl.exp2(g_last) + tl.dot(k_t, decayed.to(dtype))

    tl.store(ht_ptr + state_at, state)


def chunk_scan_output_triton(
    q_NTHK: torch.Tensor,
    k_NTHK: torch.Tensor,
    w_NTHK: torch.Tensor,
    u_NTHV: torch.Tensor,
    g_NTH: torch.Tensor,
    initial_state_NHKV: torch.Tensor | None,
    scale: float,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(o [N, T, HV, V] in u's dtype, the final state [N, HV, K, V] in float32) of the chunked scan from
    `initial_state_NHKV` (zeros if None), `g_NTH` the within-chunk cumulative log2 decay. K and V powers of two."""
    N, T, H, K = q_NTHK.shape
    HV, V = u_NTHV.shape[2:]
    if K & (K - 1) or V & (V - 1) or V < 32 or HV % H or k_NTHK.shape != q_NTHK.shape:
        raise ValueError(f"the fused scan needs power-of-two head dims (V >= 32) and HV a multiple of H, got {K}, {V}")
    q, k, w, u = (t.contiguous() for t in (q_NTHK, k_NTHK, w_NTHK, u_NTHV))
    o = torch.empty_like(u)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=u.device)
    initial = None if initial_state_NHKV is None else initial_state_NHKV.float().contiguous()
    g = g_NTH.float().contiguous()
    chunks = triton.cdiv(T, chunk_size)
    scores = torch.empty(N, HV, chunks, chunk_size, chunk_size, dtype=w.dtype, device=u.device)
    _chunk_scores_kernel[(chunks, N * HV)](q, k, g, scores, T, H=H, HV=HV, K=K, BT=chunk_size, num_warps=4)
    _scan_output_kernel[lambda meta: (V // meta["BV"] * N * HV,)](
        q, k, scores, w, u, g, initial, o, final, scale, T, log2_bucket(chunks),
        H=H, HV=HV, K=K, V=V, BT=chunk_size, HAS_INITIAL_STATE=initial is not None,
    )  # fmt: skip
    return o, final
