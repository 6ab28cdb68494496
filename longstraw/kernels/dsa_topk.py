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

Ties: candidates are ranked by one int64 key per (score, position) (`selection_keys`): the higher
score first, and among equal scores (masked keys, keys every head's ReLU zeroes) the lower position.
The selected set is then one function of the scores, whatever the order the keys are scored and
merged in: a context-parallel rank's top k of its own keys (`top_keys`), merged with the other
ranks', is the single process's selection (`longstraw.cp.sharded_latent`).
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
def select_topk(
    q_THI,
    w_TH,
    k_prefix_PI,
    k_live_TI,
    *,
    topk: int,
    scale: float,
    block_size: int | None = None,
    query_block: int = QUERY_BLOCK,
):
    """int64 [T, min(topk, P + T)] indices of the selected keys per query (see module doc).
    Queries go `query_block` at a time; each keeps a running top-k over the live keys (later ones
    masked: a row with fewer than k visible keys also gets masked ones, as in HF) and the prefix."""
    P = k_prefix_PI.shape[0]
    k = min(topk, P + q_THI.shape[0])
    return key_positions(ranked_keys(q_THI, w_TH, k_prefix_PI, 0, k_live_TI, P, k, scale, block_size, query_block))


@torch.no_grad()
def ranked_keys(
    q_THI,
    w_TH,
    k_NI,
    first: int,
    k_live_TI,
    live_first: int,
    k: int,
    scale: float,
    block_size: int | None = None,
    query_block: int = QUERY_BLOCK,
):
    """int64 [T, min(k, candidates)] `selection_keys` of the top k among the keys `k_NI` at positions
    first..first+N-1 and, when `k_live_TI` is given, the T live keys at positions live_first.. (query t
    sees live keys up to its own). A context-parallel rank passes its own shard's keys (`first` its
    shard's start) and only the last rank the live keys: the ranks' keys merged give `select_topk`."""
    T = q_THI.shape[0]
    out_TK = None
    for qs in range(0, T, query_block):
        qe = min(T, qs + query_block)
        keys_TK = None
        if k_live_TI is not None:
            live_TL = block_scores(q_THI[qs:qe], w_TH[qs:qe], k_live_TI, scale)
            future_TL = torch.arange(T, device=q_THI.device)[None] > torch.arange(qs, qe, device=q_THI.device)[:, None]
            live_TL.masked_fill_(future_TL, float("-inf"))
            keys_TK = merge_top_keys(None, live_TL, torch.arange(live_first, live_first + T, device=q_THI.device), k)
        keys_TK = top_keys(
            q_THI[qs:qe], w_TH[qs:qe], k_NI, first, k, scale, block_size or max(1, SCORE_ELEMENTS // (qe - qs)), keys_TK
        )
        if out_TK is None:
            out_TK = torch.empty(T, keys_TK.shape[1], dtype=torch.long, device=q_THI.device)
        out_TK[qs:qe] = keys_TK
    return out_TK


@torch.no_grad()
def select_topk_decode(q_BHI, w_BH, k_prefix_PI, k_own_BNI, *, topk: int, scale: float, block_size: int | None = None):
    """One decoding step of B sequences sharing one prefix: int64 [B, min(topk, P + N)] indices into
    [prefix ‖ the sequence's own N keys] for each sequence's single query. Every key is visible (the
    own keys precede the query or are its own), so no mask; the prefix is scored once for all B."""
    P = k_prefix_PI.shape[0]
    k = min(topk, P + k_own_BNI.shape[1])
    return key_positions(ranked_decode_keys(q_BHI, w_BH, k_prefix_PI, 0, k_own_BNI, P, k, scale, block_size))


@torch.no_grad()
def ranked_decode_keys(
    q_BHI, w_BH, k_NI, first: int, k_own_BNI, own_first: int, k: int, scale: float, block_size: int | None = None
):
    """`ranked_keys` for one decoding step: the top k among the shared keys `k_NI` at positions first..
    and, when `k_own_BNI` is given, each sequence's own keys at positions own_first.. (all visible)."""
    keys_BK = None
    if k_own_BNI is not None:
        own_BN = index_scores(q_BHI, w_BH, k_own_BNI, scale)
        keys_BK = merge_top_keys(
            None, own_BN, torch.arange(own_first, own_first + own_BN.shape[1], device=q_BHI.device), k
        )
    return top_keys(q_BHI, w_BH, k_NI, first, k, scale, block_size or max(1, SCORE_ELEMENTS // q_BHI.shape[0]), keys_BK)


def top_keys(q_THI, w_TH, k_NI, first: int, k, scale, block_size, keys_TK=None):
    """The running top-k keys `keys_TK` (or none yet) merged with the keys `k_NI` at positions
    first..first+N-1, scored `block_size` at a time."""
    for start in range(0, k_NI.shape[0], block_size):
        block_TN = block_scores(q_THI, w_TH, k_NI[start : start + block_size], scale)
        positions_N = torch.arange(first + start, first + start + block_TN.shape[1], device=q_THI.device)
        keys_TK = merge_top_keys(keys_TK, block_TN, positions_N, k)
    return keys_TK


_LOW = 0x7FFFFFFF  # positions below 2**31 fit the key's low half


def selection_keys(scores_TN, positions_N):
    """int64 keys ordered as the selection ranks (score, position): by the float32 score, then the lower
    position first. The score's bits, made monotone as a signed integer, fill the high half."""
    bits = (scores_TN + 0.0).view(torch.int32)  # + 0.0: -0 and +0 are one score
    ordered = torch.where(bits >= 0, bits, bits ^ _LOW).to(torch.int64)
    return (ordered << 32) | (_LOW - positions_N)


def key_positions(keys_TK):
    """The positions of `selection_keys`."""
    return _LOW - (keys_TK & 0xFFFFFFFF)


def merge_top_keys(keys_TK, scores_TN, positions_N, k):
    """The top min(k, candidates) keys of the running selection and one block of scored keys, in key
    order (the highest first)."""
    cand_TN = selection_keys(scores_TN, positions_N)
    if keys_TK is not None:
        cand_TN = torch.cat([keys_TK, cand_TN], dim=1)
    return cand_TN.topk(min(k, cand_TN.shape[1]), dim=1).values


def reference_select_topk(q_THI, w_TH, k_prefix_PI, k_live_TI, *, topk: int, scale: float):
    """Plain reference: one [T, P + T] score matrix, causal mask, one top-k (HF's own order)."""
    T, P = q_THI.shape[0], k_prefix_PI.shape[0]
    scores_TS = index_scores(q_THI, w_TH, torch.cat([k_prefix_PI, k_live_TI]), scale)
    allowed_TS = torch.arange(P + T, device=q_THI.device)[None] <= P + torch.arange(T, device=q_THI.device)[:, None]
    return scores_TS.masked_fill(~allowed_TS, float("-inf")).topk(min(topk, P + T), dim=1).indices
