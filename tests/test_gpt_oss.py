"""gpt-oss (gpt_oss): attention sinks in the kernels against hand references, and capture, replay, exact mode and
sampling against HF's own forward, cache, autograd and generate, on tiny-gpt-oss (sliding-window (8) and full
attention layers alternating, MoE 2 of 4).

The prompt (40 tokens) crosses several windows and the response (20 tokens) is longer than two. HF's init leaves
every norm at one and every sink near zero; here both are drawn apart (`_model`): a norm swapped for another shows,
and the sinks take a large share of each softmax, so an attention without them fails every comparison with HF
(`test_hf_output_depends_on_the_sinks_and_the_window`). The sinks require grad here (HF's default), so the
full-parameter gradients hold theirs to HF's too. Everything compared with HF runs in float64 (float64_reference):
what stays float32 is the log-softmax, hence `logprob_tolerance` and `float64_residue_tolerance`.
"""

import math
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
from longstraw.kernels.paged_attention import decode_attention, paged_attention, reference_attention
from longstraw.kernels.window_attention import window_attention
from longstraw.models import build_model
from longstraw.models.lora import apply_lora
from longstraw.state.pages import WindowKV
from longstraw.training.rollout import SamplingConfig, sample

PROMPT_LEN, RESPONSE_LEN, WINDOW = 40, 20, 8
PROMPT_TERM = 0.05  # the conditional gradient alone is this far off the full-sequence one


def _ids(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _draw_apart(model, seed=2):
    """Norm weights 1 + N(0, 0.3) and sinks 1 + N(0, 1) (HF's init: ones and N(0, 0.02))."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith("self_attn.sinks"):
                p.copy_(1 + torch.randn(p.shape, generator=g))
    return model


def _model(lora=False, **overrides):
    model = to_float64(_draw_apart(build_model("tiny-gpt-oss", seed=1, **overrides)))
    return apply_lora(model, r=4, init_random=True) if lora else model


@pytest.fixture(scope="module")
def model():
    return _model()


# ---- the sinks in the kernels, against a hand reference


def _rnd(g, *shape):
    return torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_()


def hand_reference(q, k, v, allowed_RN, scale, sinks):
    """Per query head: scores over the allowed keys plus the head's sink as one more column, softmax, the sink's
    column dropped (a key of value 0): HF's eager attention, written out. k, v: [B, K, N, D], every key."""
    B, H, R, _ = q.shape
    G = H // k.shape[1]
    heads = []
    for h in range(H):
        scores = torch.einsum("brd,bnd->brn", q[:, h], k[:, h // G]) * scale
        scores = scores.masked_fill(~allowed_RN, -math.inf)
        column = sinks[h].expand(B, R, 1)
        p = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
        heads.append(torch.einsum("brn,bnd->brd", p, v[:, h // G]))
    return torch.stack(heads, dim=1)


def _causal_allowed(R, P, window=None):
    query_pos, key_pos = torch.arange(P, P + R)[:, None], torch.arange(P + R)[None]
    allowed = key_pos <= query_pos
    return allowed if window is None else allowed & (key_pos > query_pos - window)


def _assert_same_gradients(ours, expected, inputs, g, what):
    weights = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    got = torch.autograd.grad((ours * weights).sum(), inputs)
    want = torch.autograd.grad((expected * weights).sum(), inputs)
    for a, b in zip(got, want):
        close(a, b, rtol=TOL64, atol=TOL64 * float(b.abs().max()) if b.numel() else 0.0, what=what)
    above(float(got[-1].abs().max()), 1e-3, "the sinks' gradient")  # the sinks come last: theirs is there


@pytest.mark.numerics
@pytest.mark.parametrize("B,H,K,R,P,block,shared", [(1, 4, 2, 5, 13, 4, False), (3, 4, 1, 6, 9, 4, True)])
def test_paged_attention_with_sinks_equals_the_hand_reference(B, H, K, R, P, block, shared):
    """Forward and gradients (q, prefix and live K/V, sinks) in float64, GQA, prefix blocks, and B sequences over
    one prompt's pages (batch 1) folded over them."""
    g = torch.Generator().manual_seed(0)
    D = 8
    q, k_live, v_live = _rnd(g, B, H, R, D), _rnd(g, B, K, R, D), _rnd(g, B, K, R, D)
    k_prefix, v_prefix = _rnd(g, 1 if shared else B, K, P, D), _rnd(g, 1 if shared else B, K, P, D)
    sinks = (1 + torch.randn(H, generator=g, dtype=torch.float64)).requires_grad_()
    ours = paged_attention(q, k_prefix, v_prefix, k_live, v_live, scale=0.3, block_size=block, sinks=sinks)
    k = torch.cat([k_prefix.expand(B, -1, -1, -1), k_live], dim=2)
    v = torch.cat([v_prefix.expand(B, -1, -1, -1), v_live], dim=2)
    expected = hand_reference(q, k, v, _causal_allowed(R, P), 0.3, sinks)
    close(ours, expected, rtol=TOL64, atol=TOL64, what="paged attention with sinks")
    prefix = (t.expand(B, -1, -1, -1) for t in (k_prefix, v_prefix))
    reference = reference_attention(q, *prefix, k_live, v_live, 0.3, sinks=sinks)
    close(reference, expected, rtol=TOL64, atol=TOL64, what="reference_attention with sinks")
    _assert_same_gradients(ours, expected, (q, k_prefix, v_prefix, k_live, v_live, sinks), g, "paged gradient")
    unsunk = paged_attention(q, k_prefix, v_prefix, k_live, v_live, scale=0.3, block_size=block)
    above(max_abs(unsunk, expected), 1e-2, "what the sinks change")


@pytest.mark.numerics
@pytest.mark.parametrize("prefix,live,query_block", [(0, 11, None), (7, 5, None), (7, 20, 3)])
def test_window_attention_with_sinks_equals_the_hand_reference(prefix, live, query_block):
    g = torch.Generator().manual_seed(1)
    B, H, K, D = 2, 4, 2, 8
    q, k_live, v_live = _rnd(g, B, H, live, D), _rnd(g, B, K, live, D), _rnd(g, B, K, live, D)
    k_prefix, v_prefix = _rnd(g, 1, K, prefix, D), _rnd(g, 1, K, prefix, D)
    sinks = (1 + torch.randn(H, generator=g, dtype=torch.float64)).requires_grad_()
    ours = window_attention(
        q, k_prefix, v_prefix, k_live, v_live, scale=0.3, window=WINDOW, query_block=query_block, sinks=sinks
    )
    k, v = (torch.cat([p.expand(B, -1, -1, -1), t], dim=2) for p, t in ((k_prefix, k_live), (v_prefix, v_live)))
    expected = hand_reference(q, k, v, _causal_allowed(live, prefix, WINDOW), 0.3, sinks)
    close(ours, expected, rtol=TOL64, atol=TOL64, what="window attention with sinks")
    _assert_same_gradients(ours, expected, (q, k_prefix, v_prefix, k_live, v_live, sinks), g, "window gradient")


@pytest.mark.numerics
def test_decode_attention_with_sinks_equals_the_hand_reference():
    """3 sequences, one query each, over one shared prompt (batch 1) and their own 4 keys."""
    g = torch.Generator().manual_seed(2)
    B, H, K, P, N, D = 3, 4, 2, 9, 4, 8
    q, k_own, v_own = _rnd(g, B, H, 1, D), _rnd(g, B, K, N, D), _rnd(g, B, K, N, D)
    k_shared, v_shared = _rnd(g, 1, K, P, D), _rnd(g, 1, K, P, D)
    sinks = 1 + torch.randn(H, generator=g, dtype=torch.float64)
    ours = decode_attention(q, k_shared, v_shared, k_own, v_own, scale=0.3, block_size=4, sinks=sinks)
    k, v = (torch.cat([s.expand(B, -1, -1, -1), o], dim=2) for s, o in ((k_shared, k_own), (v_shared, v_own)))
    with torch.no_grad():
        expected = hand_reference(q, k, v, torch.ones(1, P + N, dtype=torch.bool), 0.3, sinks)
    close(ours, expected, rtol=TOL64, atol=TOL64, what="decode attention with sinks")


@pytest.mark.numerics
def test_no_sinks_is_what_a_sink_of_minus_infinity_gives():
    """sinks=None is plain attention: a sink of score -inf (no weight) changes nothing."""
    g = torch.Generator().manual_seed(3)
    q, k_live, v_live, k_prefix, v_prefix = _rnd(g, 1, 4, 5, 8), *(_rnd(g, 1, 2, n, 8) for n in (5, 5, 9, 9))
    never = torch.full((4,), -math.inf, dtype=torch.float64)
    plain = paged_attention(q, k_prefix, v_prefix, k_live, v_live, scale=0.3)
    close(plain, paged_attention(q, k_prefix, v_prefix, k_live, v_live, scale=0.3, sinks=never), TOL64, TOL64)
    close(plain, reference_attention(q, k_prefix, v_prefix, k_live, v_live, 0.3), TOL64, TOL64)


@pytest.mark.parametrize(
    "sinks,message",
    [(torch.zeros(3), r"one floating-point logit per query head \(4,\), got torch.float32 of shape \(3,\)"),
     (torch.zeros(4, dtype=torch.long), r"one floating-point logit per query head \(4,\), got torch.int64")],
)  # fmt: skip
def test_sinks_that_are_not_one_logit_per_query_head_are_refused(sinks, message):
    q, k = torch.zeros(1, 4, 2, 8), torch.zeros(1, 2, 2, 8)
    with pytest.raises(ValueError, match="paged_attention: sinks must be " + message):
        paged_attention(q, k, k, k, k, scale=0.3, sinks=sinks)
    with pytest.raises(ValueError, match="window_attention: sinks must be " + message):
        window_attention(q, k[:, :, :0], k[:, :, :0], k, k, scale=0.3, window=WINDOW, sinks=sinks)


# ---- capture and replay against HF


@pytest.mark.numerics
@pytest.mark.parametrize("chunk,order", [(5, "chunk"), (8, "chunk"), (16, "layer")])
def test_replay_logprobs_equal_hf_one_pass(model, chunk, order):
    prompt, response = _ids(PROMPT_LEN, 0), _ids(RESPONSE_LEN, 1)
    with hf_float64(model), torch.no_grad():
        state = capture(model, prompt, chunk_size=chunk, order=order)
        ours = replay(model, state, response)
        expected = hf_full_logprobs(model, prompt, response)
    assert ours.dtype == torch.float32 and ours.shape == (RESPONSE_LEN,)
    within(max_abs(ours, expected), logprob_tolerance(256, float(expected.abs().max())), "log-probs")


def test_hf_output_depends_on_the_sinks_and_the_window(model):
    """The comparisons with HF are not vacuous: the same weights without sinks (a sink logit of -inf: what an
    attention that ignored them would compute), and with a window past the sequence, give other log-probs."""
    prompt, response = _ids(PROMPT_LEN, 0), _ids(RESPONSE_LEN, 1)
    unsunk = _model()
    with torch.no_grad():
        for layer in unsunk.model.layers:
            layer.self_attn.sinks.fill_(-math.inf)
        expected = hf_full_logprobs(model, prompt, response)
        above(max_abs(hf_full_logprobs(unsunk, prompt, response), expected), 1e-2, "what the sinks change")
        unwindowed = _model(sliding_window=PROMPT_LEN + RESPONSE_LEN)
        above(max_abs(hf_full_logprobs(unwindowed, prompt, response), expected), 1e-3, "what the window changes")


@pytest.mark.numerics
def test_capture_gives_one_state_whatever_the_chunk_and_holds_what_hf_caches(model):
    """Chunks smaller than, equal to and larger than the window, and the whole prompt at once, give one state, and
    it is HF's cache after the prompt (minus its last token): the last window - 1 K/V on sliding layers, every
    position on full ones."""
    prompt = _ids(PROMPT_LEN, 2)
    with hf_float64(model):
        states = [capture(model, prompt, chunk_size=c, order=o) for c, o in [(5, "chunk"), (8, "layer"), (64, "chunk")]]
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt[None, :-1], past_key_values=cache, use_cache=True)
    for other in states[1:]:
        assert_same_state(states[0], other, rtol=TOL64)
    assert [isinstance(e, WindowKV) for e in states[0].layers] == [True, False, True, False]
    for entry, layer in zip(states[0].layers, cache.layers):
        assert isinstance(entry, WindowKV) == layer.is_sliding
        for ours, hf in zip(entry.filled(), (layer.keys, layer.values)):
            close(ours, hf, rtol=TOL64, atol=TOL64 * float(hf.abs().max()), what="pages")


def test_resident_bytes_are_the_prediction_and_sliding_layers_keep_one_window():
    model = build_model("tiny-gpt-oss", seed=1)
    kv = 2 * 2 * 16 * 4  # K + V, 2 kv heads of 16 dims, float32: per position and layer
    for prompt_len in (5, 40, 300):  # shorter than a window, and 5 and 37 windows long
        state = capture(model, _ids(prompt_len, 3), chunk_size=16)
        positions = prompt_len - 1
        assert state.nbytes == state.predicted_nbytes == kv * (2 * positions + 2 * (WINDOW - 1))
        assert state.nbytes_by_entry()["WindowKV"] == 2 * kv * (WINDOW - 1)  # whatever the prompt's length
    assert state.nbytes_by_entry()["WindowKV"] < 0.03 * kv * 2 * positions  # the two sliding layers, were they full


# ---- gradients against HF's autograd


def _held_grads(model) -> dict:
    """The gradients the model holds (then cleared)."""
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _weights():
    return torch.linspace(-1.0, 2.0, RESPONSE_LEN, dtype=torch.float64)  # every token's gradient matters


def _trained(grads, lora):
    """LoRA trains the adapters only (the sinks stay frozen); full-parameter training the sinks too."""
    sinks = [n for n in grads if n.endswith("self_attn.sinks")]
    assert len(sinks) == (0 if lora else 4) and all(float(grads[n].abs().max()) > 0 for n in sinks)
    assert not lora or all("lora_" in n for n in grads)


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
    _trained(ours, lora)
    within(max_relative_error(ours, expected), float64_residue_tolerance(gdn=False), "max relative gradient error")


@pytest.mark.numerics
@pytest.mark.parametrize("lora,chunk", [(False, 5), (True, 16)])  # capture chunks shorter and longer than the window
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
    assert state.fingerprint() == before and set(ours) == set(expected)
    _trained(ours, lora)
    within(max_relative_error(ours, expected), float64_residue_tolerance(gdn=False), "max relative gradient error")
    above(max_relative_error(conditional, expected), PROMPT_TERM, "prompt-side term")


@pytest.mark.numerics
@pytest.mark.parametrize("prefix_grad", [False, True])
def test_members_replayed_as_one_batch_give_the_serial_log_probs_and_gradient(prefix_grad):
    """Three responses of other lengths over one state (read in place, their rows folded over the full layers'
    pages): what one at a time gives."""
    model = _model(lora=True)
    prompt, responses = _ids(PROMPT_LEN, 9), [_ids(n, 10 + n) for n in (20, 7, 13)]
    runs = []
    with hf_float64(model):
        for batched in (False, True):
            state = capture(model, prompt, prefix_grad=prefix_grad, chunk_size=8)
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
    """Up to 20 new tokens after the prompt: each sequence's ring of 8 wraps, and the prompt's window leaves the
    sliding layers' view entirely, as HF's sliding cache drops it. Both stop at id 1."""
    prompt, stop = _ids(PROMPT_LEN, 11), (1,)
    config = SamplingConfig(num_samples=3, max_new_tokens=20, temperature=temperature, stop_ids=stop, seed=5)
    generation = GenerationConfig(
        max_new_tokens=20,
        eos_token_id=list(stop),
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **(dict(do_sample=False) if temperature == 0 else dict(do_sample=True, top_k=0, num_return_sequences=3)),
    )
    with hf_float64(model):
        state = capture(model, prompt, chunk_size=8)
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
        assert torch.equal(response, tokens[g, :n]) and (rollouts.finished[g] or n == 20)
        within(max_abs(rollouts.logprobs[g], logps[g, :n]), tol, "log-probs against HF's")
    assert max(r.numel() for r in rollouts.responses) > 2 * WINDOW  # a sequence decoded past two windows
    assert state.fingerprint() == before
    if temperature > 0:
        assert len({tuple(r.tolist()) for r in rollouts.responses}) > 1


# ---- refusals, before any work


@pytest.mark.parametrize(
    "overrides,message",
    [
        (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 150_000.0}), "rope_type 'dynamic'"),
        (dict(layer_types=["sliding_attention", "chunked_attention"] * 2), r"layer_types \['chunked_attention'\]"),
        (dict(sliding_window=None), "sliding layers need sliding_window >= 1, got None"),
    ],
)
def test_configs_hf_computes_otherwise_are_refused(overrides, message):
    model = build_model("tiny-gpt-oss", seed=1, **overrides)
    with pytest.raises(ValueError, match="gpt_oss config: " + message):
        capture(model, _ids(PROMPT_LEN, 0))


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({}, r"WindowKV \(sliding-window layers\) has no context-parallel form"),
        (dict(layer_types=["full_attention"] * 4), r"attention sinks \(gpt-oss\) have no context-parallel form"),
    ],
)
def test_a_context_parallel_capture_is_refused_before_any_rank_is_reached(overrides, message):
    model = build_model("tiny-gpt-oss", seed=1, **overrides)
    cp = SimpleNamespace(world=2, rank=0, device=torch.device("cpu"), is_last=False)  # no rank is ever reached
    with pytest.raises(ValueError, match=message):
        capture(model, _ids(PROMPT_LEN, 0), cp=cp)
