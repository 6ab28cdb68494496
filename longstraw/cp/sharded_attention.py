"""Exact attention over a prompt whose K/V pages are sharded over the CP ranks.

Replay and sampling reuse `longstraw.kernels.paged_attention`'s partial forward (out, lse over blocks) and its backward
fed the global out/lse, and its in-place log-sum-exp merge; only the communication is new.

Capture's attention is `longstraw.cp.balanced_attention` (the work spread evenly over the ranks).

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

from longstraw.kernels.paged_attention import (
    attention_partial,
    attention_partial_backward,
    decode_partial,
    kernel_and_block,
    lse_merge_,
)


def sharded_attention(q_BHRD, k_BKRD, v_BKRD, pages, scale: float) -> torch.Tensor:
    """[B, H, R, Dv] attention of the response's queries over every rank's pages plus the causal
    live keys (replay)."""
    return sharded_attention_over(q_BHRD, k_BKRD, v_BKRD, *pages.filled(), scale, pages.cp)


def sharded_attention_over(q_BHRD, k_BKRD, v_BKRD, k_BKPD, v_BKPD, scale: float, cp) -> torch.Tensor:
    """`sharded_attention` over this rank's pages given as K and V (MLA: the latent pages and their
    first kv_lora_rank dims). Exact mode: pages that are grad-tracking leaves get this rank's share of
    their gradient, which stays on the rank (it owns them)."""
    kernel, block = kernel_and_block("auto", q_BHRD, v_BKRD.shape[-1], None)
    return _ShardedAttention.apply(q_BHRD, k_BKRD, v_BKRD, k_BKPD, v_BKPD, float(scale), block, kernel, cp)


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
    own_kv = own.written() if cp.is_last else (None, None, None)
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
        need_q, need_kl, need_vl, need_kp, need_vp = ctx.needs_input_grad[:5]
        if not (need_q or need_kl or need_vl or need_kp or need_vp):  # the same on every rank
            return (None,) * 9
        dq, dk_p, dv_p, dk_l, dv_l = attention_partial_backward(
            dout_BHRD, q_BHRD, *ctx.pages, *live, out_BHRD, lse_BHR, ctx.scale, ctx.block, ctx.kernel,
            (need_q, need_kp, need_vp, need_kl, need_vl),
        )  # fmt: skip
        acc = lse_BHR.dtype
        # one all-reduce: dq sums every rank's pages' share; the live grads exist on the last rank only
        inputs, needs = (q_BHRD, k_BKRD, v_BKRD), (need_q, need_kl, need_vl)
        shares = [
            (g if g is not None else torch.zeros(x.shape, device=x.device)).to(acc)
            for g, x, need in zip((dq, dk_l, dv_l), inputs, needs)
            if need
        ]
        totals = iter(cp.all_reduce_together(shares) if shares else ())
        out = [next(totals).to(x.dtype) if need else None for x, need in zip(inputs, needs)]
        pages = [g.to(p.dtype) if need else None for g, p, need in zip((dk_p, dv_p), ctx.pages, (need_kp, need_vp))]
        return (*out, *pages, None, None, None, None)
