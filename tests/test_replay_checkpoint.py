"""Replay under whole-layer activation checkpointing (`replay(..., checkpoint_layers=True)`): the same
log-probs and gradients as HF's own autograd (conditional-response, and full-sequence in exact mode), with a
smaller live autograd graph."""

import pytest
import torch
from float64_reference import float64_gdn_states, float64_model, has_gdn, hf_float64
from tolerances import float64_residue_tolerance, logprob_tolerance, max_abs, within

from longstraw import capture, replay
from longstraw.core.hf_reference import (
    global_relative_error,
    grads_of,
    hf_caches_latents,
    hf_conditional_logprobs,
    hf_full_logprobs,
    max_relative_error,
)
from longstraw.measure.memory import GraphBytesMeter
from longstraw.models import TINY_MLA_PRESETS, TINY_PRESETS, build_model
from longstraw.models.lora import apply_lora

PRESETS = TINY_PRESETS + TINY_MLA_PRESETS


def _ids(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.numerics
@pytest.mark.parametrize("preset", PRESETS)
def test_checkpointed_replay_gives_hfs_conditional_gradient(preset):
    # float64 with HF's float32 casts (float64_reference), as the plain replay's own test
    net = apply_lora(float64_model(preset, seed=1), r=4, init_random=True)
    prompt, response = _ids(37, 4), _ids(6, 5)
    weights = torch.linspace(-1.0, 2.0, 6, dtype=torch.float64)
    with hf_float64(net):
        state = capture(net, prompt, chunk_size=8)
        before = state.fingerprint()
        logp = replay(net, state, response, checkpoint_layers=True)
        ours = grads_of(net, (logp * weights).sum())
        assert state.fingerprint() == before  # the recompute in the backward writes nothing
        expected_logp = hf_conditional_logprobs(net, prompt, response)
        expected = grads_of(net, (expected_logp * weights).sum())
    tol = logprob_tolerance(net.config.vocab_size, float(expected_logp.detach().abs().max()))
    within(max_abs(logp, expected_logp), tol, "log-probs")
    assert len(expected) > 0
    if preset in TINY_MLA_PRESETS and not hf_caches_latents(net, prompt):  # HF conditions on expanded K/V there
        ours, expected = ({n: g for n, g in d.items() if "kv_b_proj" not in n} for d in (ours, expected))
    within(max_relative_error(ours, expected), float64_residue_tolerance(has_gdn(net)), "max relative gradient error")


@pytest.mark.numerics
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3_5"])
def test_checkpointed_replay_in_exact_mode_gives_hfs_full_sequence_gradient(preset):
    # float64 (float64_reference), as tests/test_prefix_grad.py (2.6e-6 apart in float32)
    model = apply_lora(float64_model(preset, seed=1), r=4, init_random=True)
    prompt, responses = _ids(150, 0), [_ids(20, 1), _ids(13, 2)]
    weights = [torch.linspace(-1.0, 2.0, r.numel(), dtype=torch.float64) for r in responses]
    with hf_float64(model), float64_gdn_states():
        state = capture(model, prompt, prefix_grad=True, chunk_size=32)
        for y, w in zip(responses, weights):
            (replay(model, state, y, checkpoint_layers=True) * w).sum().backward()
        state.backward_prefix()  # the page gradients arrived through the recomputed layers
        ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        sum((hf_full_logprobs(model, prompt, y) * w).sum() for y, w in zip(responses, weights)).backward()
        expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    tol = float64_residue_tolerance(has_gdn(model))
    within(global_relative_error(ours, expected), tol, "relative gradient error")
    within(max_relative_error(ours, expected), tol, "max relative gradient error")


def _graph_peak(model, state, response, checkpoint_layers):
    exclude = list(model.parameters()) + [t for e in state.layers for t in e.tensors()]
    with GraphBytesMeter(exclude=exclude) as meter:
        replay(model, state, response, checkpoint_layers=checkpoint_layers).sum().backward()
    model.zero_grad(set_to_none=True)
    return meter.peak


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3_5", "tiny-glm_moe_dsa"])
def test_checkpointing_keeps_one_hidden_state_per_segment_instead_of_its_activations(preset):
    """What a checkpointed replay keeps from its forward for the backward: each segment's input
    [R, hidden], the final norm's and the head's saved tensors, not the layers' activations; against the
    plain replay of the same response. (A segment's recompute in the backward holds its activations
    through checkpoint's own hooks, which the meter does not see: that transient is a phase's CUDA peak.)"""
    from longstraw.families import adapter_for

    model = apply_lora(build_model(preset, seed=1), r=4, init_random=True)
    state = capture(model, _ids(64, 0), chunk_size=16)
    response = _ids(48, 1)
    plain, checkpointed = (_graph_peak(model, state, response, c) for c in (False, True))
    config = model.get_base_model().config
    segments, one_hidden = len(adapter_for(model).checkpoint_segments()), 48 * config.hidden_size * 4
    assert checkpointed < plain / 5, (checkpointed, plain)
    assert segments * one_hidden <= checkpointed <= (segments + 3) * one_hidden + 2 * 48 * config.vocab_size * 4


def test_mla_index_layers_and_their_sharers_are_recomputed_together():
    from longstraw.families import adapter_for

    adapter = adapter_for(build_model("tiny-glm_moe_dsa", seed=1))
    adapter.shares = [False, True, True, False, True, False]  # by hand: 0 feeds 1-2, 3 feeds 4, 5 alone
    adapter.layers = [None] * 6
    assert [list(r) for r in adapter.checkpoint_segments()] == [[0, 1, 2], [3, 4], [5]]


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3_5"])
def test_checkpointed_recompute_reuses_the_forwards_prefix_attention(preset, monkeypatch):
    """The recompute in the backward takes each paged-attention output from its forward (ForwardMemo)
    instead of attending over the prefix again: as many attention passes as the plain replay makes
    (without the memo, twice as many). The gradients are checked against HF's above."""
    from longstraw.kernels import paged_attention as attention

    model = apply_lora(build_model(preset, seed=1), r=4, init_random=True)
    state = capture(model, _ids(64, 0), chunk_size=16)
    calls, real = [], attention.attention_partial
    monkeypatch.setattr(attention, "attention_partial", lambda *a: calls.append(a[0].shape) or real(*a))
    passes = {}
    for checkpoint_layers in (False, True):
        calls.clear()
        replay(model, state, _ids(12, 1), checkpoint_layers=checkpoint_layers).sum().backward()
        passes[checkpoint_layers] = len(calls)
    from longstraw.state.pages import AttentionPages

    attention_layers = sum(isinstance(e, AttentionPages) for e in state.layers)
    assert attention_layers > 0 and passes[False] == attention_layers and passes[True] == attention_layers


def test_a_tensor_excluded_after_the_meter_starts_is_not_graph_memory():
    # x * w saves both operands for the backward (both need a gradient): x (4 x 3 floats, 48 bytes) counts, w (12
    # bytes) no longer once excluded
    x, w = torch.ones(4, 3, requires_grad=True), torch.ones(3, requires_grad=True)
    with GraphBytesMeter() as meter:
        meter.exclude([w])
        (x * w).sum().backward()
    assert meter.peak == x.numel() * x.element_size()
