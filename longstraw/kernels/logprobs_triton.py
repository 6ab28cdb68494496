"""Per-token log-probs of a chunk of rows through the LM head, softmax in one Triton pass each way (CUDA).

    logp_T = FusedTokenLogprobs.apply(hidden_TH, weight_VH, targets_T)   # float32, differentiable in hidden

The plain path (`longstraw.kernels.logprobs._chunk_logprobs`, under checkpoint) copies the logits to float32, then
gathers the target's and runs torch's logsumexp (a max, an exp, a sum, a log: passes over [rows, vocab] float32),
and its backward recomputes all of that and walks the float32 logits again for softmax's gradient: 3.9 ms of
logsumexp alone in hybrid-1b's two members. Here the forward keeps the logits in the head's dtype and one kernel reads
each row once (an online max and sum of exponentials in float32, and the target's logit), saving only the hidden
rows and each row's log-sum-exp; the backward recomputes the logits with the head's GEMM and one kernel overwrites
them with their gradient g (onehot - softmax), rounded once to the head's dtype, as the plain path's float32 gradient
is rounded where it enters the head's backward GEMM.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 4096  # vocabulary entries a program reads per step


@triton.jit
def _logsumexp_target_kernel(logits_ptr, targets_ptr, logp_ptr, lse_ptr, V: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * V
    running_max = tl.full((), float("-inf"), tl.float32)
    running_sum = tl.zeros((), tl.float32)
    for start in range(0, V, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(base + offsets, mask=offsets < V, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    target = tl.load(targets_ptr + row)
    tl.store(lse_ptr + row, lse)
    tl.store(logp_ptr + row, tl.load(base + target).to(tl.float32) - lse)


@triton.jit
def _logprob_grad_kernel(logits_ptr, targets_ptr, lse_ptr, grad_ptr, V: tl.constexpr, BLOCK: tl.constexpr):
    """Overwrite row `row` of the logits with g (onehot(target) - exp(logit - lse))."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * V
    lse, g, target = tl.load(lse_ptr + row), tl.load(grad_ptr + row), tl.load(targets_ptr + row)
    for start in range(0, V, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        mask = offsets < V
        x = tl.load(base + offsets, mask=mask, other=0.0).to(tl.float32)
        grad = g * (tl.where(offsets == target, 1.0, 0.0) - tl.exp(x - lse))
        tl.store(base + offsets, grad.to(logits_ptr.dtype.element_ty), mask=mask)


class FusedTokenLogprobs(torch.autograd.Function):
    """float32 [T] log softmax(hidden W^T)[t, targets[t]] for a bias-free head `weight` [V, H]; differentiable in
    `hidden` (and in `weight` when it needs a gradient)."""

    @staticmethod
    def forward(ctx, hidden_TH, weight_VH, targets_T):
        logits_TV = hidden_TH @ weight_VH.t()
        T, V = logits_TV.shape
        logp_T = torch.empty(T, dtype=torch.float32, device=hidden_TH.device)
        lse_T = torch.empty_like(logp_T)
        targets_T = targets_T.contiguous()
        if T:
            _logsumexp_target_kernel[(T,)](logits_TV, targets_T, logp_T, lse_T, V, BLOCK=BLOCK_V, num_warps=8)
        ctx.save_for_backward(hidden_TH, weight_VH, targets_T, lse_T)
        return logp_T

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_T):
        hidden_TH, weight_VH, targets_T, lse_T = ctx.saved_tensors
        grad_logits_TV = hidden_TH @ weight_VH.t()  # recomputed, then overwritten with its gradient
        T, V = grad_logits_TV.shape
        if T:
            _logprob_grad_kernel[(T,)](
                grad_logits_TV, targets_T, lse_T, grad_T.float().contiguous(), V, BLOCK=BLOCK_V, num_warps=8
            )
        grad_hidden = grad_logits_TV @ weight_VH if ctx.needs_input_grad[0] else None
        grad_weight = grad_logits_TV.t() @ hidden_TH if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_weight, None
