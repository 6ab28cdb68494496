"""Exact attention over a prompt whose K/V pages are sharded over the CP ranks.

Both paths reuse `longstraw.kernels.paged_attention`'s partial forward (out, lse over blocks) and its backward
fed the global out/lse, and its in-place log-sum-exp merge; only the communication is new.

Capture (no autograd), one layer at a time over the rank's shard (`longstraw.cp.capture`):
`receive_earlier_shards` takes the earlier shards' K/V of the layer from the previous rank, in rank
order, forwarding each to the next rank as it arrives (a pipeline of point-to-point sends; the
rank holds the earlier shards of this one layer until it is done); then `capture_attention` runs
per capture chunk, as a single-process capture does: the chunk's queries attend the earlier shards
and their own shard causally, and the chunk's K/V then join the pages; `send_own_shard` passes the
rank's finished pages on.

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

from longstraw.kernels.paged_attention import (attention_partial, attention_partial_backward, decode_partial, kernel_and_block,
                                 lse_merge_)


def sharded_attention(q_BHRD, k_BKRD, v_BKRD, pages, scale: float) -> torch.Tensor:
    """[B, H, R, Dv] attention of the response's queries over every rank's pages plus the causal
    live keys (replay)."""
    kernel, block = kernel_and_block("auto", q_BHRD, v_BKRD.shape[-1], None)
    return _ShardedAttention.apply(q_BHRD, k_BKRD, v_BKRD, *pages.filled(), float(scale), block, kernel, pages.cp)


def receive_earlier_shards(pages) -> None:
    """Before a layer's chunks: the earlier ranks' K/V of this layer into `pages.earlier`, each
    forwarded to the next rank as it arrives."""
    cp = pages.cp
    for source in range(cp.rank):
        start, end = pages.bounds[source]
        k_b = pages.k_BKPD.new_empty(*pages.k_BKPD.shape[:2], end - start, pages.k_BKPD.shape[3])
        v_b = pages.v_BKPD.new_empty(*pages.v_BKPD.shape[:2], end - start, pages.v_BKPD.shape[3])
        cp.recv_((k_b, v_b), cp.rank - 1)
        if not cp.is_last:
            cp.send((k_b, v_b), cp.rank + 1)
        pages.earlier.append((k_b, v_b))


def send_own_shard(pages) -> None:
    """After a layer's chunks: this rank's finished pages to the next rank; the earlier shards go."""
    if not pages.cp.is_last:
        pages.cp.send(pages.filled(), pages.cp.rank + 1)
    pages.earlier.clear()


@torch.no_grad()
def capture_attention(q_BHTD, k_BKTD, v_BKTD, pages, scale: float) -> torch.Tensor:
    """One capture chunk: its queries over the earlier shards (`receive_earlier_shards`), their own
    shard's pages so far and the chunk's causal keys (which the caller appends after)."""
    q_BHTD = q_BHTD.contiguous()  # the CUDA kernels take q and out in one layout
    kernel, block = kernel_and_block("auto", q_BHTD, v_BKTD.shape[-1], None, capture=True)
    out_BHTD, lse_BHT = attention_partial(q_BHTD, *pages.filled(), k_BKTD, v_BKTD, scale, block, kernel)
    for k_b, v_b in pages.earlier:
        lse_merge_(out_BHTD, lse_BHT, *attention_partial(q_BHTD, k_b, v_b, None, None, scale, block, kernel))
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
def sharded_decode_attention(q_BHTD, shared, own, scale: float) -> torch.Tensor:
    """One decoding step over a sharded prompt: each rank's `shared` shard (the last rank also takes
    the sequences' `own` keys), merged across ranks as replay merges."""
    cp = shared.cp
    own_kv = own.filled() if cp.is_last else (None, None)
    out_BHTD, _ = merge_ranks(cp, *decode_partial(q_BHTD, *shared.filled(), *own_kv, scale=scale))
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
        ctx.pages = (k_BKPD, v_BKPD)  # references only, as in longstraw.kernels.paged_attention
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
