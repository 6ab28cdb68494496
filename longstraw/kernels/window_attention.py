"""Sliding-window attention of live queries over the keys just before them plus their own.

HF's sliding mask (`transformers.masking_utils.sliding_window_overlay`): a query at position p sees the keys
at p - window < j <= p, `window` keys its own included; so a layer's later queries need no more than the last
`window - 1` positions before them (what HF's sliding cache keeps, and `state.pages.WindowKV`).

`window_attention` takes the queries `query_block` at a time (default `window`), each block over the at most
`window - 1 + query_block` keys it can see, through torch's `scaled_dot_product_attention` with the band as
its mask (a memory-efficient kernel on CUDA; autograd for the backward): no [T, prefix + T] score matrix.
Its plain reference is `paged_attention.reference_attention(..., window=)`, one dense masked softmax.

Attention sinks (`sinks`, one logit per query head: `paged_attention`'s module doc) join each block as one more
key of value 0 whose score is the sink: a zero key (score 0) with the sink added by a float mask, so torch's
attention and its autograd (the sinks' gradient included, through the mask) compute HF's sink column exactly.

Shape letters as in `paged_attention`: B batch, H query heads, K kv heads, T live length, L prefix length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from longstraw.kernels.paged_attention import check_sinks


def window_attention(
    q_BHTD,
    k_prefix_BKLD,
    v_prefix_BKLD,
    k_live_BKTD,
    v_live_BKTD,
    *,
    scale: float,
    window: int,
    query_block=None,
    sinks=None,
) -> torch.Tensor:
    """[B, H, T, Dv]: live query t (position L + t, the L prefix keys at 0..L-1) over the keys at
    L + t - window < j <= L + t (and the `sinks`, when given). A prefix of batch 1 is read by every one of the B
    sequences."""
    if window < 1:
        raise ValueError(f"window_attention: window must be >= 1, got {window}")
    check_sinks(sinks, q_BHTD, "window_attention")
    B, H, T, _ = q_BHTD.shape
    L, G = k_prefix_BKLD.shape[2], H // k_live_BKTD.shape[1]
    if L >= window:
        raise ValueError(f"window_attention: {L} prefix keys, but a query sees only the {window - 1} before it")
    # the prefix is at most window - 1 positions: joining it to the live keys copies little
    k_BKND = torch.cat([k_prefix_BKLD.expand(B, -1, -1, -1), k_live_BKTD], dim=2)
    v_BKND = torch.cat([v_prefix_BKLD.expand(B, -1, -1, -1), v_live_BKTD], dim=2)
    block = query_block or window
    outs = []
    for a in range(0, T, block):
        b = min(a + block, T)
        first = max(0, L + a - window + 1)  # the first key the block's first query sees
        keys = slice(first, L + b)
        query_pos = torch.arange(L + a, L + b, device=q_BHTD.device)[:, None]
        key_pos = torch.arange(first, L + b, device=q_BHTD.device)[None]
        band = (key_pos <= query_pos) & (key_pos > query_pos - window)
        k_BHND, v_BHND = (t[:, :, keys].repeat_interleave(G, dim=1) for t in (k_BKND, v_BKND))
        if sinks is not None:
            k_BHND, v_BHND, band = _with_sinks(k_BHND, v_BHND, band, sinks)
        outs.append(F.scaled_dot_product_attention(q_BHTD[:, :, a:b], k_BHND, v_BHND, attn_mask=band, scale=scale))
    return torch.cat(outs, dim=2)


def _with_sinks(k_BHND, v_BHND, band_QN, sinks_H):
    """The block's keys and values with one zero key and value appended, and the band as a float mask [H, Q, N + 1]
    whose last column is each head's sink: that key's score is then 0 * scale + sinks[h]."""
    H, (Q, N) = sinks_H.shape[0], band_QN.shape
    k_BHND, v_BHND = (
        torch.cat([t, t.new_zeros(()).expand(*t.shape[:2], 1, t.shape[3])], dim=2) for t in (k_BHND, v_BHND)
    )
    mask_QN = torch.zeros(band_QN.shape, dtype=k_BHND.dtype, device=band_QN.device).masked_fill(~band_QN, float("-inf"))
    sink_HQ1 = sinks_H.to(k_BHND.dtype)[:, None, None].expand(H, Q, 1)
    return k_BHND, v_BHND, torch.cat([mask_QN.expand(H, Q, N), sink_HQ1], dim=-1)
