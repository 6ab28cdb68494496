"""Exact mode: conditional replay gradients plus backward_prefix equal HF's one-pass autograd over
prompt + response (the full-sequence gradient), for every family (attention pages and GDN states)."""

import pytest
import torch

from longstraw.core.hf_reference import global_relative_error, hf_full_logprobs, max_relative_error
from longstraw import capture, replay
from longstraw.models.lora import apply_lora
from longstraw.models import TINY_PRESETS, build_model


def _grads(model):
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    return grads


def _ids(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.numerics
@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("preset", TINY_PRESETS)
@pytest.mark.parametrize("prompt_len,chunk", [(150, 32), (40, 64), (1, 16)])  # several chunks, one, none
def test_exact_mode_equals_hf_full_sequence_gradient(preset, lora, prompt_len, chunk):
    model = build_model(preset, seed=1)
    if lora:
        model = apply_lora(model, r=4, init_random=True)
    prompt, responses = _ids(prompt_len, 0), [_ids(20, 1), _ids(13, 2)]
    weights = [torch.linspace(-1.0, 2.0, r.numel()) for r in responses]
    state = capture(model, prompt, prefix_grad=True, chunk_size=chunk)
    before = state.fingerprint()
    for y, w in zip(responses, weights):  # serial replay, one backward each
        (replay(model, state, y) * w).sum().backward()
    conditional = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    state.backward_prefix()
    ours = _grads(model)
    sum((hf_full_logprobs(model, prompt, y) * w).sum() for y, w in zip(responses, weights)).backward()
    expected = _grads(model)
    assert global_relative_error(ours, expected) < 1e-4
    assert state.fingerprint() == before
    if prompt_len > 1:  # the prompt-side term is real: the conditional gradient alone is far off
        assert global_relative_error(conditional, expected) > 0.05


def test_a_second_exact_pass_starts_from_zero():
    model = build_model("tiny-llama", seed=1)
    prompt, y = _ids(70, 0), _ids(10, 1)
    state = capture(model, prompt, prefix_grad=True, chunk_size=32)
    runs = []
    for _ in range(2):
        replay(model, state, y).sum().backward()
        state.backward_prefix()
        runs.append(_grads(model))
    assert max_relative_error(runs[1], runs[0]) < 1e-6
