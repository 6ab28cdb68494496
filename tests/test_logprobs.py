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


@pytest.mark.numerics
@pytest.mark.cuda
@pytest.mark.parametrize("weight_grad", [False, True])
def test_fused_logprobs_on_cuda_are_the_bf16_logits_softmax(weight_grad):
    """On CUDA a bf16 head takes the fused kernels (`logprobs_triton`): log-probs and gradients of the hidden rows
    (and of a trainable head) against the float64 reference on the same bf16 values, in chunks of 100 rows of a
    32,768-token vocabulary. Both fused and plain paths round the logits to bf16 (half EPS_BF16 of each, plus a
    float32 sum of H products), so the log-sum-exp and the target's logit move by at most twice the largest logit's
    error; their gradients also round g (onehot - p) to bf16 where it enters the head's backward GEMM. The plain path
    (the fused kernels off) is held to the same bounds, so they are not vacuous."""
    from unittest import mock

    from tolerances import EPS_BF16, relative

    import longstraw.kernels.logprobs as logprobs

    g = torch.Generator().manual_seed(1)
    T, H, V = 300, 256, 32768
    head = torch.nn.Linear(H, V, bias=False, dtype=torch.bfloat16, device="cuda").requires_grad_(weight_grad)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g) / H**0.5)
    hidden = torch.randn(T, H, generator=g).to("cuda", torch.bfloat16)
    targets = torch.randint(0, V, (T,), generator=g).cuda()
    weights = torch.randn(T, generator=g, dtype=torch.float64).cuda()

    def run(fn, hidden, head):
        leaf = hidden.detach().clone().requires_grad_(True)
        head.weight.grad = None
        logp = fn(leaf, head)
        (logp.double() * weights).sum().backward()
        return logp.detach().double(), leaf.grad, head.weight.grad

    assert logprobs._fused_usable(hidden, head)
    fused = run(lambda h, m: token_logprobs(h, m, targets, rows_per_chunk=100), hidden, head)
    with mock.patch.object(logprobs, "_fused_usable", return_value=False):
        plain = run(lambda h, m: token_logprobs(h, m, targets, rows_per_chunk=100), hidden, head)
    head64 = torch.nn.Linear(H, V, bias=False, dtype=torch.float64, device="cuda").requires_grad_(weight_grad)
    with torch.no_grad():
        head64.weight.copy_(head.weight.double())
    expected = run(lambda h, m: reference_token_logprobs(h, m, targets), hidden.double(), head64)
    logits = hidden.double() @ head64.weight.detach().T
    logit_error = EPS_BF16 / 2 * logits.abs() + H * EPS32 * (hidden.double().abs() @ head64.weight.detach().abs().T)
    value_bound = SAFETY * 2 * logit_error.amax(-1)
    # gradients, norm-wise: p moves by at most its own relative 2 x the largest logit error, and g (onehot - p)
    # rounds once to bf16 before the GEMM (half EPS_BF16), which then sums in float32 and rounds once more
    grad_rtol = SAFETY * (2 * float(logit_error.max()) + EPS_BF16)
    for name, path in (("fused", fused), ("plain", plain)):
        error = (path[0] - expected[0]).abs()
        assert (error <= value_bound).all(), f"{name} log-probs: {(error / value_bound).max().item():.3g} of bound"
        for what, ours, reference in zip(("hidden", "head"), path[1:], expected[1:]):
            if reference is not None:
                assert relative(ours, reference) <= grad_rtol, (name, what, relative(ours, reference), grad_rtol)
