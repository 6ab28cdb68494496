"""The sliding-window family (gemma3_text): capture, replay, exact mode and sampling against HF's own forward,
cache, autograd and generate, on tiny-gemma3 (3 sliding layers of window 16 : 1 global layer).

The prompt (90 tokens) crosses five windows and the response (20 tokens) is longer than one, so the window cuts
into the prompt's pages and into the response's own keys. Gemma's norm weights start at zero (a scale of 1 for
every norm alike); they are drawn apart here (`distinct_norms`), so a norm swapped for another shows. Everything
compared with HF runs in float64 (float64_reference, Gemma's `.float()` norm casts lifted too): what stays float32
is the log-softmax, hence `logprob_tolerance` and `float64_residue_tolerance`.
"""

from types import SimpleNamespace

import pytest
import torch
from float64_reference import hf_float64, to_float64
from state_asserts import assert_same_state
from tolerances import TOL64, above, close, float64_residue_tolerance, logprob_tolerance, max_abs, within
from transformers import DynamicCache, GenerationConfig

from longstraw import capture, replay
from longstraw.core.hf_reference import grads_of, hf_conditional_logprobs, hf_full_logprobs, max_relative_error
from longstraw.core.transaction import replay_members
from longstraw.families import adapter_for
from longstraw.families.attention_layer import attention_mix
from longstraw.families.base import unwrap_causal_lm
from longstraw.kernels.paged_attention import reference_attention
from longstraw.kernels.window_attention import window_attention
from longstraw.models import build_model
from longstraw.models.lora import apply_lora
from longstraw.state import AttentionPages
from longstraw.state.pages import WindowKV
from longstraw.training.rollout import SamplingConfig, sample

PROMPT_LEN, RESPONSE_LEN, WINDOW = 90, 20, 16
PROMPT_TERM = 0.05  # the conditional gradient alone is this far off the full-sequence one


def _ids(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def distinct_norms(model, seed=2):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * 0.3)
    return model


def _model(lora=False, **overrides):
    model = to_float64(distinct_norms(build_model("tiny-gemma3", seed=1, **overrides)))
    return apply_lora(model, r=4, init_random=True) if lora else model


@pytest.fixture(scope="module")
def model():
    return _model()


# ---- the kernel against its dense reference


@pytest.mark.numerics
@pytest.mark.parametrize("prefix,live,query_block", [(0, 23, None), (7, 5, None), (15, 40, 6)])
def test_window_attention_equals_the_dense_band_reference(prefix, live, query_block):
    """Forward and gradients in float64, GQA (4 query heads on 1 kv head), 2 sequences over one prefix (batch 1, as
    replayed members read it), queries in blocks smaller and larger than the window."""
    g = torch.Generator().manual_seed(0)
    B, H, K, D, W = 2, 4, 1, 8, 16

    def rnd(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()

    q, k_live, v_live = rnd(B, H, live, D), rnd(B, K, live, D), rnd(B, K, live, D)
    k_prefix, v_prefix = rnd(1, K, prefix, D), rnd(1, K, prefix, D)
    ours = window_attention(q, k_prefix, v_prefix, k_live, v_live, scale=0.3, window=W, query_block=query_block)
    expected = reference_attention(
        q, k_prefix.expand(B, -1, -1, -1), v_prefix.expand(B, -1, -1, -1), k_live, v_live, 0.3, window=W
    )
    close(ours, expected, rtol=TOL64, atol=TOL64, what="window attention")
    inputs = (q, k_prefix, v_prefix, k_live, v_live)
    weights = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    for a, b in zip(
        torch.autograd.grad((ours * weights).sum(), inputs), torch.autograd.grad((expected * weights).sum(), inputs)
    ):
        close(a, b, rtol=TOL64, atol=TOL64 * float(b.abs().max()) if b.numel() else 0.0, what="window gradient")
    if prefix + live > W:  # the band is there: attending every key gives another answer
        unbanded = reference_attention(
            q, k_prefix.expand(B, -1, -1, -1), v_prefix.expand(B, -1, -1, -1), k_live, v_live, 0.3
        )
        above(max_abs(unbanded, expected), 1e-3, "what the window drops")


# ---- capture and replay against HF


@pytest.mark.numerics
@pytest.mark.parametrize("chunk,order", [(5, "chunk"), (16, "chunk"), (40, "layer")])
def test_replay_logprobs_equal_hf_one_pass(model, chunk, order):
    prompt, response = _ids(PROMPT_LEN, 0), _ids(RESPONSE_LEN, 1)
    with hf_float64(model), torch.no_grad():
        state = capture(model, prompt, chunk_size=chunk, order=order)
        ours = replay(model, state, response)
        expected = hf_full_logprobs(model, prompt, response)
    assert ours.dtype == torch.float32 and ours.shape == (RESPONSE_LEN,)
    within(max_abs(ours, expected), logprob_tolerance(256, float(expected.abs().max())), "log-probs")


@pytest.mark.numerics
def test_final_logit_softcapping_is_applied_as_hf_applies_it():
    model = _model(final_logit_softcapping=0.2)  # far below the logits' spread: the cap bends them
    prompt, response = _ids(PROMPT_LEN, 0), _ids(RESPONSE_LEN, 1)
    with hf_float64(model), torch.no_grad():
        ours = replay(model, capture(model, prompt, chunk_size=16), response)
        expected = hf_full_logprobs(model, prompt, response)
        uncapped = hf_full_logprobs(_model(), prompt, response)
    within(max_abs(ours, expected), logprob_tolerance(256, float(expected.abs().max())), "log-probs")
    above(max_abs(uncapped, expected), 1e-3, "what the cap changes")


def test_hf_output_depends_on_the_window():
    """The comparisons above are not vacuous: the same weights with a window past the sequence differ."""
    prompt, response = _ids(PROMPT_LEN, 0), _ids(RESPONSE_LEN, 1)
    with torch.no_grad():
        windowed = hf_full_logprobs(_model(), prompt, response)
        unwindowed = hf_full_logprobs(_model(sliding_window=PROMPT_LEN + RESPONSE_LEN), prompt, response)
    above(max_abs(windowed, unwindowed), 1e-3, "what the window changes")


@pytest.mark.numerics
def test_capture_gives_one_state_whatever_the_chunk_and_holds_what_hf_caches(model):
    """Chunks smaller than, equal to and larger than the window, and the whole prompt at once, give one state,
    and it is HF's cache after the prompt (minus its last token): the last window - 1 K/V on sliding layers
    (DynamicSlidingWindowLayer), every position on the global one."""
    prompt = _ids(PROMPT_LEN, 2)
    with hf_float64(model):
        states = [
            capture(model, prompt, chunk_size=c, order=o) for c, o in [(5, "chunk"), (16, "layer"), (200, "chunk")]
        ]
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt[None, :-1], past_key_values=cache, use_cache=True)
    for other in states[1:]:
        assert_same_state(states[0], other, rtol=TOL64)
    for entry, layer in zip(states[0].layers, cache.layers):
        assert isinstance(entry, WindowKV) == layer.is_sliding
        for ours, hf in zip(entry.filled(), (layer.keys, layer.values)):
            close(ours, hf, rtol=TOL64, atol=TOL64 * float(hf.abs().max()), what="pages")


def test_resident_bytes_are_the_prediction_and_sliding_layers_keep_one_window():
    model = build_model("tiny-gemma3", seed=1)
    kv = 2 * 1 * 16 * 4  # K + V, 1 kv head of 16 dims, float32: per position and layer
    for prompt_len in (10, 90, 400):  # shorter than a window, and 6 and 25 windows long
        state = capture(model, _ids(prompt_len, 3), chunk_size=32)
        positions = prompt_len - 1
        assert state.nbytes == state.predicted_nbytes == kv * (positions + 3 * (WINDOW - 1))
        assert state.nbytes_by_entry()["WindowKV"] == 3 * kv * (WINDOW - 1)  # whatever the prompt's length
    dense = 4 * kv * positions  # every layer's K/V at every position
    assert state.nbytes < 0.3 * dense


# ---- gradients against HF's autograd


def _held_grads(model) -> dict:
    """The gradients the model holds (then cleared)."""
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _weights():
    return torch.linspace(-1.0, 2.0, RESPONSE_LEN, dtype=torch.float64)  # every token's gradient matters


@pytest.mark.numerics
@pytest.mark.parametrize("lora", [False, True])
def test_replay_gradient_equals_conditional_response_reference(lora):
    model = _model(lora)
    prompt, response = _ids(PROMPT_LEN, 4), _ids(RESPONSE_LEN, 5)
    with hf_float64(model):
        state = capture(model, prompt, chunk_size=8)
        before = state.fingerprint()
        ours = grads_of(model, (replay(model, state, response) * _weights()).sum())
        assert state.fingerprint() == before
        expected = grads_of(model, (hf_conditional_logprobs(model, prompt, response) * _weights()).sum())
    assert len(expected) > 0 and set(ours) == set(expected)
    within(max_relative_error(ours, expected), float64_residue_tolerance(gdn=False), "max relative gradient error")


@pytest.mark.numerics
@pytest.mark.parametrize("lora,chunk", [(False, 8), (True, 40)])  # capture chunks shorter and longer than the window
def test_exact_mode_equals_hf_full_sequence_gradient(lora, chunk):
    model = _model(lora)
    prompt, response = _ids(PROMPT_LEN, 7), _ids(RESPONSE_LEN, 8)
    with hf_float64(model):
        state = capture(model, prompt, prefix_grad=True, chunk_size=chunk)
        before = state.fingerprint()
        model.zero_grad(set_to_none=True)
        (replay(model, state, response) * _weights()).sum().backward()
        conditional = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        state.backward_prefix()
        ours = _held_grads(model)  # what the replay and backward_prefix left
        expected = grads_of(model, (hf_full_logprobs(model, prompt, response) * _weights()).sum())
    assert state.fingerprint() == before
    within(max_relative_error(ours, expected), float64_residue_tolerance(gdn=False), "max relative gradient error")
    above(max_relative_error(conditional, expected), PROMPT_TERM, "prompt-side term")


@pytest.mark.numerics
@pytest.mark.parametrize("prefix_grad", [False, True])
def test_members_replayed_as_one_batch_give_the_serial_log_probs_and_gradient(prefix_grad):
    """Three responses of other lengths over one window (batch 1, read in place): what one at a time gives."""
    model = _model(lora=True)
    prompt, responses = _ids(PROMPT_LEN, 9), [_ids(n, 10 + n) for n in (20, 7, 13)]
    runs = []
    with hf_float64(model):
        for batched in (False, True):
            state = capture(model, prompt, prefix_grad=prefix_grad, chunk_size=16)
            model.zero_grad(set_to_none=True)
            logps = replay_members(model, state, responses) if batched else [replay(model, state, y) for y in responses]
            sum(lp.sum() for lp in logps).backward()
            if prefix_grad:
                state.backward_prefix()
            runs.append(([lp.detach() for lp in logps], _held_grads(model)))
    for a, b in zip(runs[0][0], runs[1][0]):
        within(max_abs(a, b), TOL64, "log-probs")
    within(max_relative_error(runs[1][1], runs[0][1]), TOL64, "max relative gradient error")


# ---- sampling: the window slides on while tokens are generated


@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sampling_past_a_window_matches_hf_generate(model, temperature):
    """Up to 24 new tokens after a 40-token prompt: each sequence's ring of 16 wraps, and the prompt's window
    leaves the sliding layers' view entirely, as HF's sliding cache drops it. Both stop at Gemma's EOS (id 1),
    which HF's generate takes from the model's generation config."""
    prompt, stop = _ids(40, 11), (1,)
    config = SamplingConfig(num_samples=3, max_new_tokens=24, temperature=temperature, stop_ids=stop, seed=5)
    generation = GenerationConfig(
        max_new_tokens=24,
        eos_token_id=list(stop),
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **(dict(do_sample=False) if temperature == 0 else dict(do_sample=True, top_k=0, num_return_sequences=3)),
    )
    with hf_float64(model):
        state = capture(model, prompt, chunk_size=16)
        before = state.fingerprint()
        rollouts = sample(model, state, config)
        torch.manual_seed(config.seed)  # HF samples from the global generator
        out = model.generate(prompt[None], generation_config=generation)
    tokens = out.sequences[:, prompt.numel() :].expand(3, -1)
    logits = torch.stack(out.logits, 1).float()
    logps = torch.log_softmax(logits, -1).gather(2, out.sequences[:, prompt.numel() :, None])[..., 0].expand(3, -1)
    tol = logprob_tolerance(256, float(logps.abs().max()))
    for g, response in enumerate(rollouts.responses):
        n = response.numel()
        assert torch.equal(response, tokens[g, :n]) and (rollouts.finished[g] or n == 24)
        within(max_abs(rollouts.logprobs[g], logps[g, :n]), tol, "log-probs against HF's")
    assert max(r.numel() for r in rollouts.responses) > WINDOW  # a sequence decoded past a whole window
    assert state.fingerprint() == before
    if temperature > 0:
        assert len({tuple(r.tolist()) for r in rollouts.responses}) > 1


# ---- refusals, before any work


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(attn_logit_softcapping=50.0), "attn_logit_softcapping=50.0 is set, but HF's Gemma3Attention never"),
        (dict(use_bidirectional_attention=True), "use_bidirectional_attention=True"),
    ],
)
def test_configs_hf_computes_otherwise_are_refused(overrides, message):
    model = build_model("tiny-gemma3", seed=1, **overrides)
    with pytest.raises(ValueError, match=message):
        capture(model, _ids(PROMPT_LEN, 0))


def test_a_context_parallel_capture_is_refused_before_any_work():
    model = build_model("tiny-gemma3", seed=1)
    cp = SimpleNamespace(world=2, rank=0, device=torch.device("cpu"), is_last=False)  # no rank is ever reached
    with pytest.raises(ValueError, match=r"WindowKV \(sliding-window layers\) has no context-parallel form"):
        capture(model, _ids(PROMPT_LEN, 0), cp=cp)


def test_a_sliding_layer_on_an_entry_that_keeps_every_position_is_refused():
    model = build_model("tiny-gemma3", seed=1)
    attn = unwrap_causal_lm(model).model.layers[0].self_attn  # a sliding layer
    pages = AttentionPages.allocate(1, 4, 16, torch.float32, "cpu")
    adapter = adapter_for(model)
    h = adapter.embed(_ids(4, 0)[None])
    with adapter.selected(), pytest.raises(ValueError, match="window 16.* on AttentionPages entries"):
        attention_mix(attn, h, adapter.position_embeddings(h, 0)["sliding_attention"], pages, True)
