"""Sampling from the resident state against HF `generate` on the full prompt (same seed, same
tokens), its log-probs against graph-free rescoring, and the prompt pages shared, not copied."""

import pytest
import torch
from float64_reference import float64_gdn_states, float64_model, hf_float64
from tolerances import logprob_tolerance, max_abs, within
from transformers import GenerationConfig

from longstraw import capture, score
from longstraw.families import adapter_for
from longstraw.models import TINY_PRESETS, build_model
from longstraw.state import AttentionPages
from longstraw.state.pages import DecodeClock
from longstraw.training.rollout import Decoder, SamplingConfig, _decode_entries, sample

STOP = tuple(range(3, 256, 9))  # ~11% of the vocabulary: rows stop at different steps
SETTINGS = [(0.0, 1.0), (1.0, 1.0), (0.7, 0.8)]  # greedy, plain sampling, temperature + top-p


def _hf_generate(model, prompt, config: SamplingConfig):
    kwargs = (
        dict(do_sample=False)
        if config.temperature == 0
        else dict(
            do_sample=True,
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=0,
            num_return_sequences=config.num_generations,
        )
    )
    generation = GenerationConfig(
        max_new_tokens=config.max_new_tokens, eos_token_id=list(config.stop_ids), pad_token_id=config.pad_id, **kwargs
    )
    torch.manual_seed(config.seed)  # HF samples from the global generator
    out = model.generate(prompt[None], generation_config=generation)[:, prompt.numel() :]
    return out.expand(config.num_generations, -1)


def _sampled_as_hf_generates(model, prompt, config: SamplingConfig):
    """The prompt captured and sampled from, each response asserted to be HF `generate`'s from the same seed (up to
    its length); the rollouts. Run inside the caller's float64 context."""
    state = capture(model, prompt, chunk_size=32)
    rollouts = sample(model, state, config)
    expected = _hf_generate(model, prompt, config)
    for g, response in enumerate(rollouts.responses):
        assert torch.equal(response, expected[g, : response.numel()])
    return rollouts


@pytest.mark.numerics
@pytest.mark.parametrize("temperature,top_p", SETTINGS)
@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_sampling_from_state_matches_hf_generate(preset, temperature, top_p):
    # float64 (float64_reference): both sides sample from float32 probabilities of logits that agree to ~EPS64,
    # so a rounding difference cannot move a token across a sampling (or argmax) boundary as it can in float32
    model = float64_model(preset, seed=1)
    prompt = torch.randint(0, 256, (90,), generator=torch.Generator().manual_seed(0))
    config = SamplingConfig(
        num_generations=4, max_new_tokens=10, temperature=temperature, top_p=top_p, stop_ids=STOP, seed=3
    )
    with hf_float64(model), float64_gdn_states():
        state = capture(model, prompt, chunk_size=32)
        before = state.fingerprint()
        rollouts = sample(model, state, config)
        expected = _hf_generate(model, prompt, config)
        scored = [score(model, state, response) for response in rollouts.responses]
    for g, response in enumerate(rollouts.responses):
        assert torch.equal(response, expected[g, : response.numel()])
        stopped = rollouts.finished[g]
        assert stopped == (int(response[-1]) in STOP)
        assert stopped or response.numel() == config.max_new_tokens
        # the log-probs from sampling are the policy's: graph-free rescoring gives the same, but for the float32
        # log-softmax each takes (log_softmax against the target logit less a logsumexp)
        tol = logprob_tolerance(model.config.vocab_size, float(scored[g].abs().max()))
        within(max_abs(rollouts.logprobs[g], scored[g]), tol, "log-probs against scoring")
    assert state.fingerprint() == before
    if temperature > 0:
        assert len({tuple(r.tolist()) for r in rollouts.responses}) > 1  # seeded, not degenerate


def test_sequences_share_the_prompt_pages():
    model = build_model("tiny-qwen3_5", seed=1)
    state = capture(model, torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(0)))
    entries = _decode_entries(state, 8, DecodeClock.allocate(state.positions, 4, "cpu"))
    for entry, decode in zip(state.layers, entries):
        if isinstance(entry, AttentionPages):
            assert decode.shared is entry  # read in place: no per-sequence copy of the prompt
            assert decode.own.k_BKND.shape[:3] == (8, entry.k_BKPD.shape[1], 4)
        else:
            assert decode.recurrent_BHDV.shape[0] == 8


def test_bad_sampling_settings_are_named():
    with pytest.raises(ValueError, match="top_p"):
        SamplingConfig(top_p=0.0)
    with pytest.raises(ValueError, match="num_generations"):
        SamplingConfig(num_generations=0)


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-gemma3", "tiny-qwen3_5", "tiny-gpt-oss", "tiny-deepseek_v3"])
def test_the_rotary_table_decodes_the_per_step_rotarys_tokens_and_logprobs(preset):
    """Sampling through the rotary table (asked for on the CPU) gives the tokens and log-probs of the rotary
    computed at each step, bit for bit: the table's rows are each step's own (tests/test_rotary.py)."""
    model = build_model(preset, seed=1)
    prompt = torch.randint(0, 256, (50,), generator=torch.Generator().manual_seed(0))
    state = capture(model, prompt, chunk_size=32)
    runs = [sample(model, state, SamplingConfig(4, 8, stop_ids=STOP, seed=3, rotary_table=t)) for t in (False, True)]
    for a, b, lp_a, lp_b in zip(runs[0].responses, runs[1].responses, runs[0].logprobs, runs[1].logprobs, strict=True):
        assert torch.equal(a, b) and torch.equal(lp_a, lp_b)
    assert Decoder(adapter_for(model), state, SamplingConfig(4, 8, rotary_table=True)).rotary_table is not None
