"""MLA replay over latent and index-key pages sharded over the CP ranks (`ShardLatentPages.attend`).

The response's queries, live latents and index keys are the same on every rank (the layers run
replicated); each rank holds its contiguous shard of the prompt's pages.

DSA selection (`sharded_select_topk`): each rank ranks its own shard's index keys for every query
(the last rank also the causal live keys) and proposes its top k as `selection_keys` (score, then the
lower position: `longstraw.kernels.dsa_topk`); one all-gather of the proposals, and every rank takes the
top k of their union. Any key of the global top k is among its owner's top k, and the keys order
(score, position) as the single process's merge does, so the selected set is the single process's
wherever the scores agree bit for bit (they are computed per key the same way; on tie-free scores any
rounding gives the same set).

Attention: dense (no selection) goes through `sharded_attention_over` with the latent pages as keys and
their first kv_lora_rank dims as values. Sparse (`_ShardedSparseLatent`): each rank takes the selected
entries it holds (its pages; the last rank also the live entries), computes its partial (out, lse) with
`sparse_partial`, and every rank merges the all-gathered partials in rank order (a rank holding none of
a query's entries contributes (0, -inf)). Backward: `sparse_partial_backward` on each rank against the
merged out and lse; one all-reduce sums dq (and brings the live entries' gradients from the last rank);
the pages' gradients (exact mode) stay with their owner.

Sampling (`sharded_select_topk_decode`, `sharded_latent_decode_attention`): a decoding step proposes and
merges the same way, each sequence's own generated entries (replicated) counted on the last rank.
"""

from __future__ import annotations

import torch

from longstraw.cp.sharded_attention import merge_ranks, sharded_attention_over
from longstraw.kernels.dsa_topk import key_positions, ranked_decode_keys, ranked_keys
from longstraw.kernels.latent_attention import (
    ROWS_PER_BLOCK,
    sparse_decode_partial,
    sparse_partial,
    sparse_partial_backward,
)
from longstraw.kernels.paged_attention import decode_partial

_NO_KEY = torch.iinfo(torch.int64).min  # pads a proposal shorter than k: below every selection key


@torch.no_grad()
def sharded_select_topk(index, pages) -> torch.Tensor:
    """int64 [T, min(topk, P + T)] global positions (into [prompt ‖ live]) selected for the live index
    queries `index` (`IndexQueries`) over every rank's index pages: `select_topk` of the whole prompt."""
    cp, bounds = pages.cp, pages.bounds
    P, T = bounds[-1][1], index.q_THI.shape[0]
    k = min(index.topk, P + T)
    own_1NI = pages.filled()[1]
    live = (index.key_TI, P) if cp.is_last else (None, P)
    keys_TN = ranked_keys(index.q_THI, index.w_TH, own_1NI[0], bounds[cp.rank][0], *live, k, index.scale)
    return _merge_proposals(cp, keys_TN, T, k)


def sharded_latent_attention(q_1HTE, live_11TE, pages, *, rank: int, scale: float, selection_TK=None):
    """[1, H, T, C] attention-weighted latents of the live queries over every rank's latent pages and
    the causal live entries; only the selected ones (global positions) when `selection_TK` is given."""
    kv_11NE = pages.filled()[0]
    if selection_TK is None:
        return sharded_attention_over(
            q_1HTE, live_11TE, live_11TE[..., :rank], kv_11NE, kv_11NE[..., :rank], scale, pages.cp
        )
    start, end = pages.bounds[pages.cp.rank]
    out_HTC = _ShardedSparseLatent.apply(
        q_1HTE[0],
        kv_11NE[0, 0],
        live_11TE[0, 0],
        selection_TK,
        rank,
        float(scale),
        pages.cp,
        (start, end, pages.bounds[-1][1]),
    )
    return out_HTC[None]


@torch.no_grad()
def sharded_select_topk_decode(index, pages, own) -> torch.Tensor:
    """int64 [B, min(topk, P + N)] positions (into [prompt ‖ the sequence's own N entries]) selected for one
    decoding step of B sequences over every rank's index pages: `select_topk_decode` of the whole prompt."""
    cp, bounds = pages.cp, pages.bounds
    P, B, N = bounds[-1][1], index.q_THI.shape[0], own.length
    k = min(index.topk, P + N)
    own_keys = own.filled()[1] if cp.is_last else None
    keys_BN = ranked_decode_keys(
        index.q_THI, index.w_TH, pages.filled()[1][0], bounds[cp.rank][0], own_keys, P, k, index.scale
    )
    return _merge_proposals(cp, keys_BN, B, k)


@torch.no_grad()
def sharded_latent_decode_attention(q_BH1E, pages, own, *, rank: int, scale: float, selection_BK=None):
    """[B, H, 1, C] one decoding step over every rank's latent pages and each sequence's own entries
    (counted on the last rank), merged across the ranks."""
    cp, kv_11NE = pages.cp, pages.filled()[0]
    own_B1NE = own.filled()[0]
    if selection_BK is None:
        own_kv = (own_B1NE, own_B1NE[..., :rank]) if cp.is_last else (None, None)
        out_BH1C, _ = merge_ranks(cp, *decode_partial(q_BH1E, kv_11NE, kv_11NE[..., :rank], *own_kv, scale=scale))
        return out_BH1C.to(q_BH1E.dtype)
    start, end = pages.bounds[cp.rank]
    local_BK, held_BK = _held(selection_BK, cp, (start, end, pages.bounds[-1][1]), causal=False)
    out_HBC, _ = _merge_partials(
        cp, *sparse_decode_partial(q_BH1E, kv_11NE, own_B1NE, local_BK, held_BK, rank=rank, scale=scale)
    )
    return out_HBC.transpose(0, 1)[:, :, None].to(q_BH1E.dtype)


def _merge_proposals(cp, keys_TN, rows: int, k: int) -> torch.Tensor:
    """The positions of the top k of every rank's proposed keys (each padded to k)."""
    proposal_TK = keys_TN.new_full((rows, k), _NO_KEY)
    proposal_TK[:, : keys_TN.shape[1]] = keys_TN
    return key_positions(torch.cat(cp.all_gather(proposal_TK), dim=1).topk(k, dim=1).values)


def _held(selection_TK, cp, shard, causal: bool = True):
    """The selected entries this rank holds: (indices into [own pages ‖ live], visible mask). Replay's live
    query t sees live entries up to its own (`causal`); a decoding step sees all its sequence's own entries."""
    start, end, P = shard
    own = (selection_TK >= start) & (selection_TK < end)
    live = (selection_TK >= P) & cp.is_last
    local_TK = torch.where(own, selection_TK - start, torch.where(live, selection_TK - P + (end - start), 0))
    held_TK = own | live
    if causal:
        held_TK &= selection_TK <= P + torch.arange(selection_TK.shape[0], device=selection_TK.device)[:, None]
    return local_TK, held_TK


def _merge_partials(cp, out_HTC, lse_HT):
    """Every rank's partial merged by log-sum-exp in rank order, the same on every rank; partials of
    (0, -inf) (a rank holding none of a query's entries) add nothing."""
    C = out_HTC.shape[-1]
    parts = torch.stack(cp.all_gather(torch.cat([out_HTC, lse_HT[..., None]], dim=-1)))
    lse_WHT = parts[..., C]
    lse_HT = torch.logsumexp(lse_WHT, dim=0)
    return (parts[..., :C] * torch.exp(lse_WHT - lse_HT)[..., None]).sum(0), lse_HT


class _ShardedSparseLatent(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_HTE, pages_NE, live_TE, selection_TK, rank, scale, cp, shard):
        local_TK, visible_TK = _held(selection_TK, cp, shard)
        out_HTC, lse_HT = _merge_partials(
            cp, *sparse_partial(q_HTE, pages_NE, live_TE, local_TK, visible_TK, rank, scale, ROWS_PER_BLOCK)
        )
        out_HTC = out_HTC.to(q_HTE.dtype)
        ctx.save_for_backward(q_HTE, live_TE, local_TK, visible_TK, out_HTC, lse_HT)
        ctx.pages = pages_NE  # a reference, as the single process's sparse attention keeps its pages
        ctx.rank, ctx.scale, ctx.cp = rank, scale, cp
        return out_HTC

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout_HTC):
        q_HTE, live_TE, local_TK, visible_TK, out_HTC, lse_HT = ctx.saved_tensors
        need_q, need_pages, need_live = ctx.needs_input_grad[:3]
        dq_HTE, d_pages, d_live = sparse_partial_backward(
            dout_HTC,
            q_HTE,
            ctx.pages,
            live_TE,
            local_TK,
            visible_TK,
            out_HTC,
            lse_HT,
            ctx.rank,
            ctx.scale,
            ROWS_PER_BLOCK,
            need_pages,
            need_live,
        )
        # one all-reduce: dq sums every rank's share; the live entries' gradients come from the last rank
        shared = [g for g, need in ((dq_HTE, need_q), (d_live, need_live)) if need]
        totals = iter(ctx.cp.all_reduce_together(shared) if shared else ())
        dq = next(totals).to(q_HTE.dtype) if need_q else None
        dl = next(totals).to(live_TE.dtype) if need_live else None
        return dq, d_pages.to(ctx.pages.dtype) if need_pages else None, dl, None, None, None, None, None
