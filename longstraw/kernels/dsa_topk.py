"""DeepSeek sparse attention (DSA): the indexer's top-k selection over resident index-key pages.

HF's indexer (`GlmMoeDsaIndexer`, `DeepseekV32Indexer`; `@torch.no_grad`) scores key t for query s as

    score[s, t] = sum_h w[s, h] * relu(scale * q[s, h] . k[t]),    w = weights_proj(x) * H^-0.5

in float32, masks keys after s and keeps the `index_topk` highest. `select_topk` computes the same
over the prompt's index pages (P keys) followed by the live keys (T, causal), `QUERY_BLOCK` queries
at a time, scoring the prefix `block_size` keys at a time and merging each block into a running
top-k, so no [T, P] score matrix is ever held. Scores accumulate head by head (on CUDA in one fused
kernel), so they equal HF's up to float32 rounding order: the selection is the same set as HF's
whenever the scores have no (near-)ties at the k-th place.

    idx_TK = select_topk(q_THI, w_TH, k_prefix_PI, k_live_TI, topk=2048, scale=I ** -0.5)
    visible_TK = idx_TK <= P + torch.arange(T)[:, None]    # a row with fewer than k visible keys
                                                            # also gets masked ones, as in HF
Indices point into the concatenation [prefix ‖ live]; k = min(topk, P + T). While sampling,
`select_topk_decode` does the same for one query per sequence over the shared prefix and that
sequence's own generated keys.
"""

from __future__ import annotations

import torch

SCORE_ELEMENTS = 1 << 26  # float32 [query block, key block] scores: 256 MiB (+ one per-head temporary)
QUERY_BLOCK = 1024  # queries scored together: a long prefix goes in key blocks of SCORE_ELEMENTS / 1024


def index_scores(q_THI, w_TH, k_NI, scale):
    """float32 [T, N] indexer scores of T queries against N keys (HF's formula and op order); keys
    [T, N, I] give each query its own N keys."""
    s_THN = torch.relu(torch.matmul(q_THI.float(), k_NI.float().transpose(-1, -2)) * scale)
    return torch.matmul(w_TH.float().unsqueeze(1), s_THN).squeeze(1)


def block_scores(q_THI, w_TH, k_NI, scale):
    """`index_scores` one head at a time (never a [T, H, N] tensor), with the positive `scale`
    folded into the head weights: the same values up to float32 rounding order. On CUDA with
    bfloat16 queries and keys, one fused Triton kernel (`longstraw.kernels.dsa_topk_triton`)."""
    if q_THI.is_cuda and q_THI.dtype == k_NI.dtype == torch.bfloat16:
        from longstraw.kernels.dsa_topk_triton import fused_index_scores

        return fused_index_scores(q_THI, w_TH.float() * scale, k_NI)
    w_TH, k_IN = w_TH.float() * scale, k_NI.float().transpose(0, 1)
    scores_TN = torch.zeros(q_THI.shape[0], k_NI.shape[0], dtype=torch.float32, device=q_THI.device)
    for h in range(q_THI.shape[1]):
        scores_TN.addcmul_(torch.matmul(q_THI[:, h].float(), k_IN).relu_(), w_TH[:, h, None])
    return scores_TN


@torch.no_grad()
def select_topk(q_THI, w_TH, k_prefix_PI, k_live_TI, *, topk: int, scale: float, block_size: int | None = None,
                query_block: int = QUERY_BLOCK):
    """int64 [T, min(topk, P + T)] indices of the selected keys per query (see module doc).
    Queries go `query_block` at a time; each keeps a running top-k over the live keys (later ones
    masked: a row with fewer than k visible keys also gets masked ones, as in HF) and the prefix."""
    T, P = q_THI.shape[0], k_prefix_PI.shape[0]
    k = min(topk, P + T)
    out_TK = torch.empty(T, k, dtype=torch.long, device=q_THI.device)
    for qs in range(0, T, query_block):
        qe = min(T, qs + query_block)
        live_TL = block_scores(q_THI[qs:qe], w_TH[qs:qe], k_live_TI, scale)
        future_TL = torch.arange(T, device=q_THI.device)[None] > torch.arange(qs, qe, device=q_THI.device)[:, None]
        live_TL.masked_fill_(future_TL, float("-inf"))
        out_TK[qs:qe] = _topk_with_prefix(q_THI[qs:qe], w_TH[qs:qe], k_prefix_PI, live_TL, k, scale,
                                          block_size or max(1, SCORE_ELEMENTS // (qe - qs)))
    return out_TK


@torch.no_grad()
def select_topk_decode(q_BHI, w_BH, k_prefix_PI, k_own_BNI, *, topk: int, scale: float,
                       block_size: int | None = None):
    """One decoding step of B sequences sharing one prefix: int64 [B, min(topk, P + N)] indices into
    [prefix ‖ the sequence's own N keys] for each sequence's single query. Every key is visible (the
    own keys precede the query or are its own), so no mask; the prefix is scored once for all B."""
    own_BN = index_scores(q_BHI, w_BH, k_own_BNI, scale)
    k = min(topk, k_prefix_PI.shape[0] + own_BN.shape[1])
    return _topk_with_prefix(q_BHI, w_BH, k_prefix_PI, own_BN, k, scale,
                             block_size or max(1, SCORE_ELEMENTS // q_BHI.shape[0]))


def _topk_with_prefix(q_THI, w_TH, k_prefix_PI, live_TN, k, scale, block_size):
    """The top k of the scored live keys (indices P..P+N-1) and the prefix keys, scored
    `block_size` at a time and merged into the running selection."""
    P = k_prefix_PI.shape[0]
    positions_N = torch.arange(P, P + live_TN.shape[1], device=q_THI.device)
    vals_TK, idx_TK = _merge_top(None, None, live_TN, positions_N, k)
    for start in range(0, P, block_size):
        block_TN = block_scores(q_THI, w_TH, k_prefix_PI[start:start + block_size], scale)
        positions_N = torch.arange(start, start + block_TN.shape[1], device=q_THI.device)
        vals_TK, idx_TK = _merge_top(vals_TK, idx_TK, block_TN, positions_N, k)
    return idx_TK


def _merge_top(vals_TK, idx_TK, scores_TN, positions_N, k):
    """The top min(k, candidates) of the running selection and one block of scored keys."""
    cand_idx = positions_N.expand(scores_TN.shape[0], -1)
    if vals_TK is not None:
        scores_TN, cand_idx = torch.cat([vals_TK, scores_TN], dim=1), torch.cat([idx_TK, cand_idx], dim=1)
    vals_TK, sel_TK = scores_TN.topk(min(k, scores_TN.shape[1]), dim=1)
    return vals_TK, cand_idx.gather(1, sel_TK)


def reference_select_topk(q_THI, w_TH, k_prefix_PI, k_live_TI, *, topk: int, scale: float):
    """Plain reference: one [T, P + T] score matrix, causal mask, one top-k (HF's own order)."""
    T, P = q_THI.shape[0], k_prefix_PI.shape[0]
    scores_TS = index_scores(q_THI, w_TH, torch.cat([k_prefix_PI, k_live_TI]), scale)
    allowed_TS = torch.arange(P + T, device=q_THI.device)[None] <= P + torch.arange(T, device=q_THI.device)[:, None]
    return scores_TS.masked_fill(~allowed_TS, float("-inf")).topk(min(topk, P + T), dim=1).indices
