"""Exact attention over a prompt whose K/V pages are sharded over the CP ranks.

Both paths reuse `longstraw.attention`'s partial forward (out, lse over blocks) and its backward
fed the global out/lse, and its in-place log-sum-exp merge; only the communication is new.

Capture (`capture_attention`, no autograd): a rank attends its whole shard at once. Its queries
first see their own shard causally, `query_chunk` queries at a time over the pages before them
(as a single-process capture does); then the earlier shards' K/V arrive one shard at a time from
the previous rank, in rank order (rank r receives shards 0..r-1 from rank r-1 and forwards each to
r+1 before merging it, then sends its own): a pipeline of point-to-point sends, holding one
received shard at a time, never the whole prefix.

Replay (`_ShardedAttention`, an autograd Function): the response's queries and live K/V are the
same on every rank. Forward: each rank's partial over its own pages (the last rank also takes the
causal live block: the response follows its shard), one all-gather of (out, lse), and the same
merge in rank order on every rank, so every rank holds the identical global output. Backward:
dO is the same on every rank (the layers after run replicated); each rank recomputes its blocks
against the global out/lse, and one all-reduce sums the dq shares (and brings the live K/V
gradients from the last rank), so every rank continues the backward with the full gradient.

Sampling (`sharded_decode_attention`): a decoding step merges every rank's shared shard the same
way; the tokens generated so far are replicated and count once, on the last rank.
"""

from __future__ import annotations

import torch

from longstraw.attention import (attention_partial, attention_partial_backward, decode_partial, kernel_and_block,
                                 lse_merge_)
from longstraw.cp.state import ShardPages
from longstraw.state import DecodePages


def sharded_attention(q_BHRD, k_BKRD, v_BKRD, pages: ShardPages, scale: float, append: bool) -> torch.Tensor:
    """[B, H, R, Dv] attention of q over every rank's pages plus the causal live keys; `append` =
    capture (q is this rank's whole shard; its K/V are written to the pages)."""
    if append:
        return capture_attention(q_BHRD, k_BKRD, v_BKRD, pages, scale)
    kernel, block = kernel_and_block("auto", q_BHRD, v_BKRD.shape[-1], (q_BHRD, k_BKRD, v_BKRD), None)
    return _ShardedAttention.apply(q_BHRD, k_BKRD, v_BKRD, *pages.filled(), float(scale), block, kernel, pages.cp)


@torch.no_grad()
def capture_attention(q_BHTD, k_BKTD, v_BKTD, pages: ShardPages, scale: float) -> torch.Tensor:
    cp, T = pages.cp, q_BHTD.shape[2]
    if pages.length != 0 or T != pages.k_BKPD.shape[2]:
        raise RuntimeError(f"a context-parallel capture attends the whole shard ({pages.k_BKPD.shape[2]} positions) "
                           f"in one call; got {T} queries with {pages.length} already captured")
    pages.append(k_BKTD, v_BKTD)
    k_BKTD, v_BKTD = pages.filled()
    # queries go `query_chunk` at a time, so a block's scores stay [chunk, block] however long the
    # shard; each chunk gets the kernel a single-process capture would give it
    chunks = [slice(c0, min(c0 + pages.query_chunk, T)) for c0 in range(0, T, pages.query_chunk)]
    q_chunks = [q_BHTD[:, :, c].contiguous() for c in chunks]
    kernels = [kernel_and_block("auto", q_c, v_BKTD.shape[-1], (), None) for q_c in q_chunks]
    parts = [attention_partial(q_c, k_BKTD[:, :, :c.start], v_BKTD[:, :, :c.start], k_BKTD[:, :, c], v_BKTD[:, :, c],
                               scale, block, kernel)
             for c, q_c, (kernel, block) in zip(chunks, q_chunks, kernels)]  # own shard, causal
    out_BHTD, lse_BHT = (torch.cat(x, dim=2) for x in zip(*parts))
    for source in range(cp.rank):  # earlier shards, in rank order, from the previous rank
        start, end = pages.bounds[source]
        k_b = k_BKTD.new_empty(*k_BKTD.shape[:2], end - start, k_BKTD.shape[3])
        v_b = v_BKTD.new_empty(*v_BKTD.shape[:2], end - start, v_BKTD.shape[3])
        cp.recv_((k_b, v_b), cp.rank - 1)
        if not cp.is_last:
            cp.send((k_b, v_b), cp.rank + 1)
        for c, q_c, (kernel, block) in zip(chunks, q_chunks, kernels):
            partial = attention_partial(q_c, k_b, v_b, None, None, scale, block, kernel)
            lse_merge_(out_BHTD[:, :, c], lse_BHT[:, :, c], *partial)
    if not cp.is_last:
        cp.send((k_BKTD, v_BKTD), cp.rank + 1)
    return out_BHTD.to(q_BHTD.dtype)


def merge_ranks(cp, out_BHRD, lse_BHR):
    """Every rank's partial (out, lse), gathered by one all-gather and merged in rank order: the
    same order on every rank, so every rank holds the identical global result."""
    Dv = out_BHRD.shape[-1]
    gathered = cp.all_gather(torch.cat([out_BHRD, lse_BHR.unsqueeze(-1)], dim=-1))
    out_BHRD, lse_BHR = gathered[0][..., :Dv].contiguous(), gathered[0][..., Dv].contiguous()
    for part in gathered[1:]:
        lse_merge_(out_BHRD, lse_BHR, part[..., :Dv], part[..., Dv])
    return out_BHRD, lse_BHR


@torch.no_grad()
def sharded_decode_attention(q_BHTD, pages: DecodePages, scale: float) -> torch.Tensor:
    """One decoding step over a sharded prompt: each rank's shared shard (the last rank also takes
    the sequences' own keys), merged across ranks as replay merges."""
    shared, cp = pages.shared, pages.shared.cp
    own = pages.own.filled() if cp.is_last else (None, None)
    out_BHTD, _ = merge_ranks(cp, *decode_partial(q_BHTD, *shared.filled(), *own, scale=scale))
    return out_BHTD.to(q_BHTD.dtype)


class _ShardedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHRD, k_BKRD, v_BKRD, k_BKPD, v_BKPD, scale, block, kernel, cp):
        if kernel != "math":
            q_BHRD = q_BHRD.contiguous()  # one layout for q, out and dO (the CUDA kernels need it)
        live = (k_BKRD, v_BKRD) if cp.is_last else (None, None)
        out_BHRD, lse_BHR = merge_ranks(cp, *attention_partial(q_BHRD, k_BKPD, v_BKPD, *live, scale, block, kernel))
        out_BHRD = out_BHRD.to(q_BHRD.dtype)
        ctx.save_for_backward(q_BHRD, k_BKRD, v_BKRD, out_BHRD, lse_BHR)
        ctx.pages = (k_BKPD, v_BKPD)  # references only, as in longstraw.attention
        ctx.scale, ctx.block, ctx.kernel, ctx.cp = scale, block, kernel, cp
        return out_BHRD

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout_BHRD):
        q_BHRD, k_BKRD, v_BKRD, out_BHRD, lse_BHR = ctx.saved_tensors
        cp = ctx.cp
        live = (k_BKRD, v_BKRD) if cp.is_last else (None, None)
        need_q, need_kl, need_vl = ctx.needs_input_grad[:3]
        if not (need_q or need_kl or need_vl):  # the same on every rank: collectives stay in step
            return (None,) * 9
        dq, _, _, dk_l, dv_l = attention_partial_backward(
            dout_BHRD, q_BHRD, *ctx.pages, *live, out_BHRD, lse_BHR, ctx.scale, ctx.block, ctx.kernel,
            (need_q, False, False, need_kl, need_vl),
        )  # fmt: skip
        acc = lse_BHR.dtype
        # one all-reduce: dq sums every rank's pages' share; the live grads exist on the last rank only
        inputs, needs = (q_BHRD, k_BKRD, v_BKRD), (need_q, need_kl, need_vl)
        shares = [(g if g is not None else torch.zeros(x.shape, device=x.device)).to(acc)
                  for g, x, need in zip((dq, dk_l, dv_l), inputs, needs) if need]
        totals = iter(cp.all_reduce_together(shares))
        out = [next(totals).to(x.dtype) if need else None for x, need in zip(inputs, needs)]
        return (*out, None, None, None, None, None, None)
