"""Chunked, checkpointed log-probs equal the plain full-logits reference, values and gradients (both
return float32 log-probs from float64 hidden states and head here: they differ by float32 rounding of
logsumexp against log_softmax, measured <= 4.8e-7, 4 EPS32, on every kernel path and thread count)."""

import pytest
import torch
from tolerances import EPS32, SAFETY, close, logprob_tolerance, max_abs, within

from longstraw.kernels.logprobs import reference_token_logprobs, token_logprobs

VOCAB = 50
# the gradients are float64 from float32 log-softmax gradients (softmax - onehot, each within EPS32 of itself
# and of the other formula's): relative EPS32 per element, |grad| floored at the largest element's
GRAD_RTOL = SAFETY * 4 * EPS32  # SAFETY x the 4 float32 roundings of softmax's backward (exp, sum, divide, subtract)


@pytest.mark.numerics
@pytest.mark.parametrize("rows_per_chunk", [1, 3, 7, 64])
def test_chunked_logprobs_equal_the_reference(rows_per_chunk):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, VOCAB, bias=False).double()
    hidden = torch.randn(7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, VOCAB, (7,), generator=g)
    ours = token_logprobs(hidden, head, targets, rows_per_chunk=rows_per_chunk)
    ours_grads = torch.autograd.grad((ours * torch.arange(1.0, 8.0, dtype=torch.float64)).sum(), (hidden, head.weight))
    expected = reference_token_logprobs(hidden, head, targets)
    expected_grads = torch.autograd.grad(
        (expected * torch.arange(1.0, 8.0, dtype=torch.float64)).sum(), (hidden, head.weight)
    )
    tol = logprob_tolerance(VOCAB, float(expected.detach().abs().max()))
    within(max_abs(ours, expected), tol, "log-probs")
    for a, b in zip(ours_grads, expected_grads):
        close(a, b, rtol=GRAD_RTOL, atol=GRAD_RTOL * float(b.detach().abs().max()), what="gradient")
    with torch.no_grad():  # graph-free scoring takes the same path without checkpoints
        within(
            max_abs(token_logprobs(hidden, head, targets, rows_per_chunk=rows_per_chunk), expected),
            tol,
            "graph-free log-probs",
        )
