"""Chunked, checkpointed log-probs equal the plain full-logits reference, values and gradients (both
return float32 log-probs: they differ by float32 rounding of logsumexp against log_softmax, ~1e-7)."""

import pytest
import torch

from longstraw.kernels.logprobs import reference_token_logprobs, token_logprobs


@pytest.mark.numerics
@pytest.mark.parametrize("rows_per_chunk", [1, 3, 7, 64])
def test_chunked_logprobs_equal_the_reference(rows_per_chunk):
    g = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False).double()
    hidden = torch.randn(7, 16, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (7,), generator=g)
    ours = token_logprobs(hidden, head, targets, rows_per_chunk=rows_per_chunk)
    ours_grads = torch.autograd.grad((ours * torch.arange(1.0, 8.0, dtype=torch.float64)).sum(),
                                     (hidden, head.weight))
    expected = reference_token_logprobs(hidden, head, targets)
    expected_grads = torch.autograd.grad((expected * torch.arange(1.0, 8.0, dtype=torch.float64)).sum(),
                                         (hidden, head.weight))
    assert torch.allclose(ours, expected, rtol=0, atol=1e-6)
    for a, b in zip(ours_grads, expected_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # graph-free scoring takes the same path without checkpoints
        assert torch.allclose(token_logprobs(hidden, head, targets, rows_per_chunk=rows_per_chunk), expected, rtol=0, atol=1e-6)
