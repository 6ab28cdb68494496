"""Sliding-window attention of live queries over the keys just before them plus their own.

HF's sliding mask (`transformers.masking_utils.sliding_window_overlay`): a query at position p sees the keys
at p - window < j <= p, `window` keys its own included; so a layer's later queries need no more than the last
`window - 1` positions before them (what HF's sliding cache keeps, and `state.pages.WindowKV`).

`window_attention` takes the queries `query_block` at a time (default `window`), each block over the at most
`window - 1 + query_block` keys it can see, through torch's `scaled_dot_product_attention` with the band as
its mask (a memory-efficient kernel on CUDA; autograd for the backward): no [T, prefix + T] score matrix.
Its plain reference is `paged_attention.reference_attention(..., window=)`, one dense masked softmax.

Shape letters as in `paged_attention`: B batch, H query heads, K kv heads, T live length, L prefix length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def window_attention(
    q_BHTD, k_prefix_BKLD, v_prefix_BKLD, k_live_BKTD, v_live_BKTD, *, scale: float, window: int, query_block=None
) -> torch.Tensor:
    """[B, H, T, Dv]: live query t (position L + t, the L prefix keys at 0..L-1) over the keys at
    L + t - window < j <= L + t. A prefix of batch 1 is read by every one of the B sequences."""
    if window < 1:
        raise ValueError(f"window_attention: window must be >= 1, got {window}")
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
        outs.append(
            F.scaled_dot_product_attention(
                q_BHTD[:, :, a:b],
                k_BKND[:, :, keys].repeat_interleave(G, dim=1),
                v_BKND[:, :, keys].repeat_interleave(G, dim=1),
                attn_mask=band,
                scale=scale,
            )
        )
    return torch.cat(outs, dim=2)
