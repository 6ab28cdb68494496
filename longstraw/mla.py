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

Dense attention goes through `longstraw.attention.paged_attention` (exact LSE blocks + merge, with
its own backward); values are the first C dims of the same pages (a view, no copy). Sparse
attention gathers each query's selected entries (T x k rows, never a [T, P] mask) and runs one
softmax per query, `rows_per_block` queries at a time, under plain autograd.
"""

from __future__ import annotations

import torch

from longstraw.attention import paged_attention

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


def latent_attention(q_1HTE, pages_11PE, live_11TE, *, rank: int, scale: float, selection_TK=None,
                     rows_per_block: int = ROWS_PER_BLOCK):
    """Attention-weighted latents [1, H, T, C] of T live queries over P page entries and the causal
    live entries; only the selected ones (indices into [pages ‖ live]) when `selection_TK` is given."""
    if selection_TK is None:
        return paged_attention(q_1HTE, pages_11PE, pages_11PE[..., :rank], live_11TE, live_11TE[..., :rank],
                               scale=scale)
    T, P = q_1HTE.shape[2], pages_11PE.shape[2]
    visible_TK = selection_TK <= P + torch.arange(T, device=q_1HTE.device)[:, None]
    outs = []
    for r in range(0, T, rows_per_block):
        rows = slice(r, r + rows_per_block)
        kv_TKE = _gather(pages_11PE[0, 0], live_11TE[0, 0], selection_TK[rows])
        acc = torch.float64 if q_1HTE.dtype == torch.float64 else torch.float32
        s_HTK = torch.einsum("hte,tke->htk", q_1HTE[0, :, rows].to(acc), kv_TKE.to(acc)) * scale
        p_HTK = torch.softmax(s_HTK.masked_fill(~visible_TK[rows], float("-inf")), dim=-1)
        outs.append(torch.einsum("htk,tkc->htc", p_HTK, kv_TKE[..., :rank].to(acc)))
    return torch.cat(outs, dim=1)[None].to(q_1HTE.dtype)


def _gather(pages_PE, live_TE, idx_TK):
    """Rows `idx` of [pages ‖ live] without concatenating the pages: [T, K, E]. One gather from the
    pages, then the (few) live rows written over it in place (the gather's backward needs no values)."""
    P = pages_PE.shape[0]
    if P == 0:
        return live_TE[idx_TK]
    kv_TKE = pages_PE.index_select(0, idx_TK.clamp(max=P - 1).flatten()).view(*idx_TK.shape, -1)
    from_live = idx_TK >= P
    kv_TKE[from_live] = live_TE[idx_TK[from_live] - P].to(kv_TKE.dtype)
    return kv_TKE


def reference_mla_attention(q_nope_1HTN, q_rot_1HTR, pages_11PE, live_11TE, w_uk_HNC, w_uv_HVC, *, rank, scale,
                            selection_TK=None):
    """Plain reference: expand every latent per head (as HF does), dense [T, P + T] mask, softmax.
    Returns the per-head values [1, H, T, V]."""
    kv_SE = torch.cat([pages_11PE[0, 0], live_11TE[0, 0]])
    c_SC, r_SR = kv_SE[:, :rank], kv_SE[:, rank:]
    k_HSD = torch.cat([torch.einsum("sc,hnc->hsn", c_SC, w_uk_HNC),
                       r_SR.expand(w_uk_HNC.shape[0], -1, -1)], dim=-1)
    v_HSV = torch.einsum("sc,hvc->hsv", c_SC, w_uv_HVC)
    q_HTD = torch.cat([q_nope_1HTN, q_rot_1HTR], dim=-1)[0]
    T, S = q_HTD.shape[1], kv_SE.shape[0]
    allowed_TS = torch.arange(S)[None] <= S - T + torch.arange(T)[:, None]
    if selection_TK is not None:
        allowed_TS &= torch.zeros(T, S, dtype=torch.bool).scatter(1, selection_TK, True)
    s_HTS = (q_HTD @ k_HSD.transpose(1, 2)) * scale
    return (torch.softmax(s_HTS.masked_fill(~allowed_TS, float("-inf")), dim=-1) @ v_HSV)[None]
