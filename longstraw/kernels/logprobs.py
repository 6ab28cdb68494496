"""Per-token log-probs from final hidden states without holding float32 [R, vocab] logits.

Rows go through lm_head in chunks; under autograd each chunk is checkpointed, so only its
hidden rows are saved and its logits are recomputed in backward. Peak extra memory is one
chunk's logits, whatever the response length: by default a chunk holds at most
`LOGITS_PER_CHUNK` float32 logits (256 MB; 270 rows of a 248,320-token vocabulary, 2,048 of 32,768).

On CUDA, for a bias-free linear head of the hidden rows' dtype, each chunk's softmax runs as one Triton pass each
way instead (`logprobs_triton.FusedTokenLogprobs`: the logits stay in the head's dtype, nothing but the hidden rows
and one log-sum-exp per row is kept for the backward, which recomputes the logits as the checkpoint does).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

LOGITS_PER_CHUNK = 1 << 26


def _chunk_logprobs(lm_head, hidden_TH, targets_T):
    logits_TV = lm_head(hidden_TH).float()
    return logits_TV.gather(-1, targets_T[:, None]).squeeze(-1) - torch.logsumexp(logits_TV, dim=-1)


def _fused_usable(hidden_TH, lm_head) -> bool:
    return (
        hidden_TH.is_cuda
        and type(lm_head) is torch.nn.Linear
        and lm_head.bias is None
        and hidden_TH.dtype == lm_head.weight.dtype != torch.float64
        and not torch.is_autocast_enabled("cuda")
    )


def token_logprobs(hidden_TH, lm_head, targets_T, rows_per_chunk: int | None = None):
    """float32 [T]: log softmax(lm_head(hidden))[t, targets[t]]."""
    rows_per_chunk = rows_per_chunk or max(1, LOGITS_PER_CHUNK // lm_head.out_features)
    fused = _fused_usable(hidden_TH, lm_head)
    if fused:
        from longstraw.kernels.logprobs_triton import FusedTokenLogprobs
    pieces = []
    for start in range(0, hidden_TH.shape[0], rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        if fused:
            pieces.append(FusedTokenLogprobs.apply(hidden_TH[rows], lm_head.weight, targets_T[rows]))
        elif torch.is_grad_enabled():
            pieces.append(checkpoint(_chunk_logprobs, lm_head, hidden_TH[rows], targets_T[rows], use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(lm_head, hidden_TH[rows], targets_T[rows]))
    return torch.cat(pieces)


def reference_token_logprobs(hidden_TH, lm_head, targets_T):
    """Plain reference: full float32 logits, then log_softmax."""
    logp_TV = torch.log_softmax(lm_head(hidden_TH).float(), dim=-1)
    return logp_TV.gather(-1, targets_T[:, None]).squeeze(-1)
