"""Absorbed multi-head latent attention (MLA) over resident latent pages, dense or top-k sparse.

MLA keys and values are per-head expansions of one latent c (kv_lora_rank C) per position:
k_h = [W_UK_h c ‖ r] (r: the shared rotated rope key, R dims), v_h = W_UV_h c. Absorbing W_UK into
the query (q_lat_h = W_UK_h^T q_nope_h) gives q_h . k_h = [q_lat_h ‖ q_rot_h] . [c ‖ r], so every
head attends the pages [c ‖ r] directly (one shared kv head, E = C + R) and the per-head value is
W_UV_h applied to the attention-weighted latent. The prompt's latents are never expanded.

    w_uk_HNC, w_uv_HVC = split_kv_b(attn.kv_b_proj, H, N, V, latent_1TC)
    q_1HTE = torch.cat([absorb_query(q_nope_1HTN, w_uk_HNC), q_rot_1HTR], dim=-1)
    out_1HTC = latent_attention(q_1HTE, pages_11PE, live_11TE, rank=C, scale=attn.scaling)          # dense
    out_1HTC = latent_attention(q_1HTE, pages_11PE, live_11TE, rank=C, scale=s, selection_TK=idx)   # DSA
    out_1HTV = expand_output(out_1HTC, w_uv_HVC)
    out_BH1C = latent_decode_attention(q_BH1E, shared_11PE, own_B1NE, rank=C, scale=s, selection_BK=idx)  # sampling

Dense attention goes through `longstraw.kernels.paged_attention.paged_attention` (exact LSE blocks + merge, with
its own backward); values are the first C dims of the same pages (a view, no copy). Sparse
attention gathers each query's selected entries (T x k rows, never a [T, P] mask) and runs one
softmax per query, `rows_per_block` queries at a time, in an autograd op that keeps only the
indices for its backward (the gathered rows are gathered again there). Host-resident pages reach
both on the device (`LatentPages.on_device`, one layer at a time); their graphs keep only the host
pages, which their backward brings to the device again.
"""

from __future__ import annotations

import torch

from longstraw.kernels.paged_attention import decode_attention, paged_attention

ROWS_PER_BLOCK = 256


def split_kv_b(kv_b_proj, heads: int, nope: int, v_dim: int, like_TC: torch.Tensor):
    """(W_UK [H, N, C], W_UV [H, V, C]) of `kv_b_proj` as its forward computes it, LoRA or NF4
    included: the module applied to the identity (minus its bias), in the dtype and on the device
    of the latents `like_TC`, under autograd."""
    rank = like_TC.shape[-1]
    eye_CC = torch.eye(rank, dtype=like_TC.dtype, device=like_TC.device)
    w_CX = kv_b_proj(eye_CC) - kv_b_proj(torch.zeros_like(eye_CC[:1]))
    w_HXC = w_CX.transpose(0, 1).reshape(heads, nope + v_dim, rank)
    return w_HXC[:, :nope], w_HXC[:, nope:]


def absorb_query(q_nope_1HTN, w_uk_HNC):
    return torch.einsum("bhtn,hnc->bhtc", q_nope_1HTN, w_uk_HNC)


def expand_output(out_1HTC, w_uv_HVC):
    return torch.einsum("bhtc,hvc->bhtv", out_1HTC, w_uv_HVC)


def latent_attention(
    q_1HTE,
    pages_11PE,
    live_11TE,
    *,
    rank: int,
    scale: float,
    selection_TK=None,
    rows_per_block: int = ROWS_PER_BLOCK,
    resident_11PE=None,
):
    """Attention-weighted latents [1, H, T, C] of T live queries over P page entries and the causal
    live entries; only the selected ones (indices into [pages ‖ live]) when `selection_TK` is given.
    `pages_11PE` are on the queries' device; `resident_11PE`, where they differ, the host-resident
    pages they were copied from, which the backward reads again (the graph keeps no device copy)."""
    streamed = resident_11PE is not None and resident_11PE.device != pages_11PE.device
    if selection_TK is None:
        return paged_attention(
            q_1HTE,
            pages_11PE,
            pages_11PE[..., :rank],
            live_11TE,
            live_11TE[..., :rank],
            scale=scale,
            prefix_again=_streamed_again(resident_11PE, q_1HTE.device, rank) if streamed else None,
        )
    out_HTC = _SparseLatentAttention.apply(
        q_1HTE[0],
        pages_11PE[0, 0],
        live_11TE[0, 0],
        selection_TK,
        rank,
        float(scale),
        int(rows_per_block),
        (resident_11PE if streamed else pages_11PE)[0, 0],
    )
    return out_HTC[None]


def _gather(pages_PE, live_TE, idx_TK):
    """Rows `idx` of [pages ‖ live] without concatenating the pages: [T, K, E] (pages on the
    queries' device)."""
    P = pages_PE.shape[0]
    if P == 0:
        return live_TE[idx_TK]
    kv_TKE = pages_PE.index_select(0, idx_TK.clamp(max=P - 1).flatten()).view(*idx_TK.shape, -1)
    from_live = idx_TK >= P
    kv_TKE[from_live] = live_TE[idx_TK[from_live] - P]
    return kv_TKE


def _gathered_softmax(q_HTE, kv_TKE, visible_TK, rank, scale):
    """(attention-weighted latents [H, T, C], lse [H, T]) of each query over its own gathered rows."""
    s_HTK = torch.einsum("hte,tke->htk", q_HTE, kv_TKE) * scale
    if visible_TK is not None:
        s_HTK.masked_fill_(~visible_TK, float("-inf"))
    lse_HT = torch.logsumexp(s_HTK, dim=-1)
    weights_HTK = torch.exp(s_HTK - lse_HT.nan_to_num(neginf=0.0)[..., None])  # a row of no visible entry: 0
    return torch.einsum("htk,tkc->htc", weights_HTK, kv_TKE[..., :rank]), lse_HT


@torch.no_grad()
def latent_decode_attention(q_BH1E, shared_11PE, own_B1NE, *, rank: int, scale: float, selection_BK=None):
    """One decoding step of B sequences on one shared prompt: attention-weighted latents [B, H, 1, C]
    of each sequence's query over the shared prompt pages (read in place, never copied per sequence)
    and its own N generated entries (the current one included); over the selected entries only
    (indices into [prompt pages ‖ own entries], `select_topk_decode`) when `selection_BK` is given."""
    if selection_BK is None:
        return decode_attention(
            q_BH1E, shared_11PE, shared_11PE[..., :rank], own_B1NE, own_B1NE[..., :rank], scale=scale
        )
    out_HBC, _ = sparse_decode_partial(q_BH1E, shared_11PE, own_B1NE, selection_BK, None, rank=rank, scale=scale)
    return out_HBC.transpose(0, 1)[:, :, None].to(q_BH1E.dtype)


def sparse_decode_partial(q_BH1E, shared_11PE, own_B1NE, idx_BK, visible_BK, *, rank: int, scale: float):
    """(attention-weighted latents [H, B, C], lse [H, B]) in the accumulation dtype of each sequence's query
    over its entries `idx_BK` of [prompt pages ‖ its own entries] (those `visible_BK` marks, all when
    None); a row with none visible comes out as (0, -inf) (a context-parallel rank's share)."""
    B, N, P = own_B1NE.shape[0], own_B1NE.shape[2], shared_11PE.shape[2]
    # own entries laid out sequence after sequence behind the pages: sequence b's entry j is row P + b N + j
    offset_B1 = torch.arange(B, device=idx_BK.device)[:, None] * N
    rows_BK = torch.where(idx_BK >= P, idx_BK + offset_B1, idx_BK)
    acc = torch.float64 if q_BH1E.dtype == torch.float64 else torch.float32
    kv_BKE = _gather(shared_11PE[0, 0], own_B1NE.reshape(B * N, -1), rows_BK).to(acc)
    return _gathered_softmax(q_BH1E[:, :, 0].transpose(0, 1).to(acc), kv_BKE, visible_BK, rank, scale)


def _scatter_(grad_pages_PE, grad_live_TE, P, idx_TK, grad_TKE):
    """Add each gathered row's gradient to its source row: a page (index < P) or a live entry."""
    flat_idx, flat_grad = idx_TK.flatten(), grad_TKE.flatten(0, 1)
    is_live = flat_idx >= P
    if grad_live_TE is not None:
        grad_live_TE.index_add_(0, flat_idx[is_live] - P, flat_grad[is_live])
    if grad_pages_PE is not None:
        grad_pages_PE.index_add_(0, flat_idx[~is_live], flat_grad[~is_live])


def _on_device(pages_PE, device):
    """Pages on `device` for one backward (a host-resident layer's pages, whole), dropped after it."""
    return pages_PE.to(device, non_blocking=True)


def _streamed_again(resident_11PE, device, rank: int):
    """For the dense backward: host-resident pages on `device` again, as (keys, values = the first
    `rank` dims)."""

    def again():
        pages_11PE = _on_device(resident_11PE, device)
        return pages_11PE, pages_11PE[..., :rank]

    return again


def sparse_partial(q_HTE, pages_PE, live_TE, idx_TK, visible_TK, rank: int, scale: float, rows: int):
    """(attention-weighted latents [H, T, C], lse [H, T]) in the accumulation dtype, of each query over its
    visible gathered rows of [pages ‖ live] (`idx_TK`, `visible_TK`), `rows` queries at a time. A row with
    no visible entry comes out as (0, -inf), which a log-sum-exp merge ignores (a context-parallel
    rank's share of a selection: `longstraw.cp.sharded_latent`)."""
    H, T, _ = q_HTE.shape
    acc = torch.float64 if q_HTE.dtype == torch.float64 else torch.float32
    out_HTC = torch.empty(H, T, rank, dtype=acc, device=q_HTE.device)
    lse_HT = torch.empty(H, T, dtype=acc, device=q_HTE.device)
    for r in range(0, T, rows):
        blk = slice(r, r + rows)
        kv_TKE = _gather(pages_PE, live_TE, idx_TK[blk]).to(acc)
        out_HTC[:, blk], lse_HT[:, blk] = _gathered_softmax(q_HTE[:, blk].to(acc), kv_TKE, visible_TK[blk], rank, scale)
    return out_HTC, lse_HT


def sparse_partial_backward(
    dout_HTC,
    q_HTE,
    pages_PE,
    live_TE,
    idx_TK,
    visible_TK,
    out_HTC,
    lse_HT,
    rank: int,
    scale: float,
    rows: int,
    need_pages: bool,
    need_live: bool,
):
    """(dq, d_pages or None, d_live or None) in the accumulation dtype of `sparse_partial`'s rows, fed the
    output and lse of the whole softmax (these rows' share of a merged one, as ring attention does):
    gathers each row block again, recomputes P = exp(S - lse) and scatters the entries' gradients back."""
    acc = lse_HT.dtype
    dq_HTE = torch.zeros(q_HTE.shape, dtype=acc, device=q_HTE.device)
    d_pages = torch.zeros(pages_PE.shape, dtype=acc, device=pages_PE.device) if need_pages else None
    d_live = torch.zeros(live_TE.shape, dtype=acc, device=live_TE.device) if need_live else None
    delta_HT = (dout_HTC.to(acc) * out_HTC.to(acc)).sum(-1)
    for r in range(0, q_HTE.shape[1], rows):
        blk = slice(r, r + rows)
        kv_TKE = _gather(pages_PE, live_TE, idx_TK[blk]).to(acc)
        q_blk, do_HTC = q_HTE[:, blk].to(acc), dout_HTC[:, blk].to(acc)
        s_HTK = torch.einsum("hte,tke->htk", q_blk, kv_TKE) * scale
        p_HTK = torch.exp(s_HTK.masked_fill(~visible_TK[blk], float("-inf")) - lse_HT[:, blk, None])
        dp_HTK = torch.einsum("htc,tkc->htk", do_HTC, kv_TKE[..., :rank])
        ds_HTK = p_HTK * (dp_HTK - delta_HT[:, blk, None]) * scale
        dq_HTE[:, blk] = torch.einsum("htk,tke->hte", ds_HTK, kv_TKE)
        if need_pages or need_live:
            dkv_TKE = torch.einsum("htk,hte->tke", ds_HTK, q_blk)
            dkv_TKE[..., :rank] += torch.einsum("htk,htc->tkc", p_HTK, do_HTC)
            _scatter_(d_pages, d_live, pages_PE.shape[0], idx_TK[blk], dkv_TKE)
    return dq_HTE, d_pages, d_live


class _SparseLatentAttention(torch.autograd.Function):
    """Per-query softmax over gathered entries, `rows` queries at a time (`sparse_partial`). Saves q,
    out, lse and the indices (never the gathered [T, K, E] rows): backward (`sparse_partial_backward`)
    gathers each row block again."""

    @staticmethod
    def forward(ctx, q_HTE, pages_PE, live_TE, idx_TK, rank, scale, rows, resident_PE):
        # the resident pages, a reference like paged_attention's prefix (no copy, no version check):
        # host-resident ones come back to the device in backward, so the graph holds no device copy
        ctx.pages = resident_PE
        visible_TK = idx_TK <= pages_PE.shape[0] + torch.arange(q_HTE.shape[1], device=q_HTE.device)[:, None]
        out_HTC, lse_HT = sparse_partial(q_HTE, pages_PE, live_TE, idx_TK, visible_TK, rank, scale, rows)
        out_HTC = out_HTC.to(q_HTE.dtype)
        ctx.save_for_backward(q_HTE, live_TE, idx_TK, visible_TK, out_HTC, lse_HT)
        ctx.rank, ctx.scale, ctx.rows = rank, scale, rows
        return out_HTC

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout_HTC):
        q_HTE, live_TE, idx_TK, visible_TK, out_HTC, lse_HT = ctx.saved_tensors
        pages_PE = _on_device(ctx.pages, q_HTE.device)
        need_q, need_pages, need_live = ctx.needs_input_grad[:3]
        dq_HTE, d_pages, d_live = sparse_partial_backward(
            dout_HTC,
            q_HTE,
            pages_PE,
            live_TE,
            idx_TK,
            visible_TK,
            out_HTC,
            lse_HT,
            ctx.rank,
            ctx.scale,
            ctx.rows,
            need_pages,
            need_live,
        )
        return (
            dq_HTE.to(q_HTE.dtype) if need_q else None,
            d_pages.to(pages_PE.dtype) if need_pages else None,
            d_live.to(live_TE.dtype) if need_live else None,
            None,
            None,
            None,
            None,
            None,
        )


def reference_mla_attention(
    q_nope_1HTN, q_rot_1HTR, pages_11PE, live_11TE, w_uk_HNC, w_uv_HVC, *, rank, scale, selection_TK=None
):
    """Plain reference: expand every latent per head (as HF does), dense [T, P + T] mask, softmax.
    Returns the per-head values [1, H, T, V]."""
    kv_SE = torch.cat([pages_11PE[0, 0], live_11TE[0, 0]])
    c_SC, r_SR = kv_SE[:, :rank], kv_SE[:, rank:]
    k_HSD = torch.cat([torch.einsum("sc,hnc->hsn", c_SC, w_uk_HNC), r_SR.expand(w_uk_HNC.shape[0], -1, -1)], dim=-1)
    v_HSV = torch.einsum("sc,hvc->hsv", c_SC, w_uv_HVC)
    q_HTD = torch.cat([q_nope_1HTN, q_rot_1HTR], dim=-1)[0]
    T, S = q_HTD.shape[1], kv_SE.shape[0]
    dev = q_HTD.device
    allowed_TS = torch.arange(S, device=dev)[None] <= S - T + torch.arange(T, device=dev)[:, None]
    if selection_TK is not None:
        allowed_TS &= torch.zeros(T, S, dtype=torch.bool, device=dev).scatter(1, selection_TK, True)
    s_HTS = (q_HTD @ k_HSD.transpose(1, 2)) * scale
    return (torch.softmax(s_HTS.masked_fill(~allowed_TS, float("-inf")), dim=-1) @ v_HSV)[None]
