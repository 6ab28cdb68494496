"""A `DecodeSession` (the decoder kept across `sample` calls) against fresh `sample()` calls and HF `generate`: the
same tokens and log-probs after another prompt's state, moved LoRA weights and another seed, the kept tensors
written in place, a new signature built anew, the states passed in never written. Off CUDA the steps are eager:
the graph's side is tests/test_decode_cuda.py."""

import dataclasses

import pytest
import torch
from float64_reference import float64_gdn_states, float64_model, hf_float64
from test_rollout import STOP, _hf_generate

from longstraw import capture
from longstraw.core.transaction import reuse_state
from longstraw.models import build_model
from longstraw.models.lora import apply_lora
from longstraw.training.rollout import DecodeSession, SamplingConfig, sample


def _prompt(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(seed))


def _same(ours, fresh) -> None:
    assert [r.tolist() for r in ours.responses] == [r.tolist() for r in fresh.responses]
    assert all(torch.equal(a, b) for a, b in zip(ours.logprobs, fresh.logprobs, strict=True))
    assert ours.finished == fresh.finished and ours.steps == fresh.steps


def _addresses(session: DecodeSession) -> list[int]:
    """What a recorded step reads at fixed addresses: the decoding entries' tensors, the kept merged and stacked
    weights, the clock and the buffers."""
    decoder = session.decoder
    kept = [v for value, _ in session.kept._built.values() for v in (value if isinstance(value, tuple) else (value,))]
    tensors = [t for e in decoder.entries for t in e.tensors()] + [t for t in kept if t is not None]
    tensors += [decoder.clock.step_1, decoder.tokens_G, decoder.unfinished_G, decoder.tokens_GT, decoder.logps_GT]
    return [t.data_ptr() for t in tensors]


def _move_lora(model) -> None:
    """An optimizer's update as it writes: in place, every adapter weight."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.1 * torch.randn_like(p))


@pytest.mark.numerics
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3_5"])
def test_a_session_samples_what_fresh_calls_sample(preset, stacked):
    """One session, a first call then three: (a) another prompt's state of the same length, (b) the LoRA weights
    moved in place since (the state's reuse declared), (c) another seed, on a third prompt's capture under the moved
    weights. Each is a fresh `sample()`'s tokens and log-probs exactly (one computation, on the session's copies),
    the last HF `generate`'s tokens too (float64: test_rollout's argument); one build, the kept tensors at the same
    addresses, the states unchanged."""
    model = apply_lora(float64_model(preset, seed=1), r=4, init_random=True).double()
    config = SamplingConfig(num_generations=4, max_new_tokens=8, stop_ids=STOP, seed=3, stacked_projections=stacked)
    session = DecodeSession()
    with hf_float64(model), float64_gdn_states():
        states = [capture(model, _prompt(60, seed), chunk_size=32) for seed in (0, 1)]
        prints = [state.fingerprint() for state in states]
        _same(sample(model, states[0], config, session=session), sample(model, states[0], config))
        addresses = _addresses(session)
        assert session.kept._built  # the merged (and stacked) weights a later call refreshes
        _same(sample(model, states[1], config, session=session), sample(model, states[1], config))
        _move_lora(model)
        reuse_state(model, states[1])
        _same(sample(model, states[1], config, session=session), sample(model, states[1], config))
        states.append(capture(model, _prompt(60, 2), chunk_size=32))  # the moved weights' own state, for HF
        prints.append(states[-1].fingerprint())
        reseeded = dataclasses.replace(config, seed=11)
        ours = sample(model, states[-1], reseeded, session=session)
        _same(ours, sample(model, states[-1], reseeded))
        expected = _hf_generate(model, _prompt(60, 2), reseeded)
    for g, response in enumerate(ours.responses):
        assert torch.equal(response, expected[g, : response.numel()])
    assert len({tuple(r.tolist()) for r in ours.responses}) > 1  # seeded, not degenerate
    assert session.records == 1 and _addresses(session) == addresses
    assert [state.fingerprint() for state in states] == prints


@pytest.mark.parametrize("preset", ["tiny-gemma3", "tiny-glm_moe_dsa"])
def test_entries_that_decode_by_a_host_count_start_anew_each_call(preset):
    """A sliding window's ring and MLA's latent pages (`graph_safe = False`, eager) are replaced by the new state's
    decoding entries at each call, not refilled: another prompt's state, moved LoRA weights and another seed give a
    fresh `sample()`'s rollouts, from one build, the states unchanged."""
    model = apply_lora(build_model(preset, seed=1), r=4, init_random=True)
    config = SamplingConfig(num_generations=3, max_new_tokens=5, stop_ids=STOP, seed=3)
    states = [capture(model, _prompt(40, seed), chunk_size=16) for seed in (0, 1)]
    prints = [state.fingerprint() for state in states]
    session = DecodeSession()
    _same(sample(model, states[0], config, session=session), sample(model, states[0], config))
    assert not session.decoder.graph_safe  # no graph: its entries decode eagerly
    _same(sample(model, states[1], config, session=session), sample(model, states[1], config))
    _move_lora(model)
    reuse_state(model, states[1])
    reseeded = dataclasses.replace(config, seed=8)
    _same(sample(model, states[1], reseeded, session=session), sample(model, states[1], reseeded))
    assert session.records == 1 and [state.fingerprint() for state in states] == prints


def test_a_new_signature_builds_anew_and_an_unkept_state_decodes_plainly():
    """Another G, another prompt length, the adapters disabled: a new build each (counted), each call a fresh
    `sample()`'s rollouts; the same signature again keeps the decoder. An exact-mode state (which a recorded step
    cannot follow by its layout) decodes the plain way, the session untouched."""
    model = apply_lora(build_model("tiny-qwen3_5", seed=1), r=4, init_random=True)
    config = SamplingConfig(num_generations=4, max_new_tokens=6, stop_ids=STOP, seed=3)
    three = dataclasses.replace(config, num_generations=3)
    short, long = capture(model, _prompt(40, 0)), capture(model, _prompt(50, 2))
    session = DecodeSession()
    for state, cfg, records in ((short, config, 1), (short, three, 2), (long, three, 3), (long, three, 3)):
        _same(sample(model, state, cfg, session=session), sample(model, state, cfg))
        assert session.records == records
    with model.disable_adapter():  # the reference policy: peft's forward where the graph multiplied merged weights
        _same(sample(model, long, three, session=session), sample(model, long, three))
    assert session.records == 4
    kept, exact = (session.signature, session.decoder), capture(model, _prompt(40, 0), prefix_grad=True)
    _same(sample(model, exact, three, session=session), sample(model, exact, three))
    assert session.records == 4 and (session.signature, session.decoder) == kept
