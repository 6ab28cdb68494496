"""The sliding-window family: capture, replay, exact mode and sampling against HF's own forward, cache, autograd
and generate, on each of its members (`MEMBERS`): tiny-gemma3 (gemma3_text: 3 sliding layers of window 16 : 1
global layer) and tiny-gpt-oss (gpt_oss: sliding layers of window 8 and full ones alternating, attention sinks, MoE
2 of 4; its sinks' own kernels: tests/test_gpt_oss.py).

Each prompt crosses several windows and the response (20 tokens) is longer than a window, so the window cuts into
the prompt's pages and into the response's own keys. HF's init leaves Gemma's norms at one scale and gpt-oss's
norms at one and its sinks near zero; they are drawn apart here (`Member.draw_apart`), so a norm swapped for
another shows and the sinks take a large share of each softmax. Everything compared with HF runs in float64
(float64_reference, Gemma's `.float()` norm casts lifted too): what stays float32 is the log-softmax, hence
`logprob_tolerance` and `float64_residue_tolerance`.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
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

RESPONSE_LEN = 20
PROMPT_TERM = 0.05  # the conditional gradient alone is this far off the full-sequence one
SLIDING = "sliding_attention"


def _ids(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def distinct_norms(model, seed=2):
    """Gemma's norm weights (a scale of 1 + w) start at zero: N(0, 0.3) instead."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                module.weight.copy_(torch.randn(module.weight.shape, generator=g) * 0.3)
    return model


def norms_and_sinks_apart(model, seed=2):
    """gpt-oss's norm weights 1 + N(0, 0.3) and sinks 1 + N(0, 1) (HF's init: ones and N(0, 0.02))."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith("self_attn.sinks"):
                p.copy_(1 + torch.randn(p.shape, generator=g))
    return model


@dataclass(frozen=True)
class Member:
    """A preset of the family and the lengths its tests take (chunks shorter than, as long as and longer than its
    window)."""

    preset: str
    window: int
    prompt_len: int
    draw_apart: Callable
    replay_chunks: tuple  # (chunk, order) of the log-prob parity
    state_chunks: tuple  # (chunk, order) that must give one state
    exact_chunks: tuple  # (full-parameter chunk, LoRA chunk) of exact mode
    batch_chunk: int
    new_tokens: int  # sampled after a 40-token prompt
    decoded_windows: int  # a sampled sequence passes this many whole windows


MEMBERS = [
    Member("tiny-gemma3", 16, 90, distinct_norms, ((5, "chunk"), (16, "chunk"), (40, "layer")),
           ((5, "chunk"), (16, "layer"), (200, "chunk")), (8, 40), 16, 24, 1),
    Member("tiny-gpt-oss", 8, 40, norms_and_sinks_apart, ((5, "chunk"), (8, "chunk"), (16, "layer")),
           ((5, "chunk"), (8, "layer"), (64, "chunk")), (5, 16), 8, 20, 2),
]  # fmt: skip
GEMMA = MEMBERS[0]


@pytest.fixture(scope="module", params=MEMBERS, ids=[m.preset for m in MEMBERS])
def member(request):
    return request.param


def _model(member, lora=False, **overrides):
    model = to_float64(member.draw_apart(build_model(member.preset, seed=1, **overrides)))
    return apply_lora(model, r=4, init_random=True) if lora else model


@pytest.fixture(scope="module")
def model(member):
    return _model(member)


# ---- the kernel against its dense reference


@pytest.mark.numerics
@pytest.mark.parametrize("prefix,live,query_block", [(0, 23, None), (7, 5, None), (15, 40, 6)])
def test_window_attention_equals_the_dense_band_reference(prefix, live, query_block):
    """Forward and gradients in float64, GQA (4 query heads on 1 kv head), 2 sequences over one prefix (batch 1, as
    replayed members read it), queries in blocks smaller and larger than the window."""
    g = torch.Generator().manual_seed(0)
    B, H, K, D, W = 2, 4, 1, 8, GEMMA.window

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
@pytest.mark.parametrize("which", range(3))
def test_replay_logprobs_equal_hf_one_pass(member, model, which):
    chunk, order = member.replay_chunks[which]
    prompt, response = _ids(member.prompt_len, 0), _ids(RESPONSE_LEN, 1)
    with hf_float64(model), torch.no_grad():
        state = capture(model, prompt, chunk_size=chunk, order=order)
        ours = replay(model, state, response)
        expected = hf_full_logprobs(model, prompt, response)
    assert ours.dtype == torch.float32 and ours.shape == (RESPONSE_LEN,)
    within(max_abs(ours, expected), logprob_tolerance(256, float(expected.abs().max())), "log-probs")


@pytest.mark.numerics
def test_final_logit_softcapping_is_applied_as_hf_applies_it():
    model = _model(GEMMA, final_logit_softcapping=0.2)  # far below the logits' spread: the cap bends them
    prompt, response = _ids(GEMMA.prompt_len, 0), _ids(RESPONSE_LEN, 1)
    with hf_float64(model), torch.no_grad():
        ours = replay(model, capture(model, prompt, chunk_size=16), response)
        expected = hf_full_logprobs(model, prompt, response)
        uncapped = hf_full_logprobs(_model(GEMMA), prompt, response)
    within(max_abs(ours, expected), logprob_tolerance(256, float(expected.abs().max())), "log-probs")
    above(max_abs(uncapped, expected), 1e-3, "what the cap changes")


def test_hf_output_depends_on_the_window(member, model):
    """The comparisons with HF are not vacuous: the same weights with a window past the sequence differ."""
    prompt, response = _ids(member.prompt_len, 0), _ids(RESPONSE_LEN, 1)
    with torch.no_grad():
        windowed = hf_full_logprobs(model, prompt, response)
        unwindowed = _model(member, sliding_window=member.prompt_len + RESPONSE_LEN)
        above(max_abs(windowed, hf_full_logprobs(unwindowed, prompt, response)), 1e-3, "what the window changes")


def test_hf_output_depends_on_the_sinks():
    """gpt-oss's sinks matter: the same weights with a sink logit of -inf (what an attention that ignored them
    would compute) give other log-probs."""
    member = MEMBERS[1]
    prompt, response = _ids(member.prompt_len, 0), _ids(RESPONSE_LEN, 1)
    model, unsunk = _model(member), _model(member)
    with torch.no_grad():
        for layer in unsunk.model.layers:
            layer.self_attn.sinks.fill_(-math.inf)
        expected = hf_full_logprobs(model, prompt, response)
        above(max_abs(hf_full_logprobs(unsunk, prompt, response), expected), 1e-2, "what the sinks change")


@pytest.mark.numerics
def test_capture_gives_one_state_whatever_the_chunk_and_holds_what_hf_caches(member, model):
    """Chunks smaller than, equal to and larger than the window, and the whole prompt at once, give one state,
    and it is HF's cache after the prompt (minus its last token): the last window - 1 K/V on sliding layers
    (DynamicSlidingWindowLayer), every position on the full-attention ones."""
    prompt = _ids(member.prompt_len, 2)
    with hf_float64(model):
        states = [capture(model, prompt, chunk_size=c, order=o) for c, o in member.state_chunks]
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt[None, :-1], past_key_values=cache, use_cache=True)
    for other in states[1:]:
        assert_same_state(states[0], other, rtol=TOL64)
    assert [isinstance(e, WindowKV) for e in states[0].layers] == [t == SLIDING for t in model.config.layer_types]
    for entry, layer in zip(states[0].layers, cache.layers):
        assert isinstance(entry, WindowKV) == layer.is_sliding
        for ours, hf in zip(entry.filled(), (layer.keys, layer.values)):
            close(ours, hf, rtol=TOL64, atol=TOL64 * float(hf.abs().max()), what="pages")


def test_resident_bytes_are_the_prediction_and_sliding_layers_keep_one_window(member):
    model = build_model(member.preset, seed=1)
    config = model.config
    kv = 2 * config.num_key_value_heads * config.head_dim * 4  # K + V, float32: per position and layer
    sliding = config.layer_types.count(SLIDING)
    full = len(config.layer_types) - sliding
    for windows in (0.6, 5.5, 25.5):  # a prompt shorter than a window, and about 5 and 25 windows long
        prompt_len = int(windows * member.window)
        state = capture(model, _ids(prompt_len, 3), chunk_size=2 * member.window)
        positions = prompt_len - 1
        held = member.window - 1  # a window's room, however short the prompt
        assert state.nbytes == state.predicted_nbytes == kv * (full * positions + sliding * held)
        assert state.nbytes_by_entry()["WindowKV"] == sliding * kv * held  # whatever the prompt's length
    assert state.nbytes_by_entry()["WindowKV"] < 0.05 * sliding * kv * positions  # the sliding layers, were they full


# ---- gradients against HF's autograd


def _held_grads(model) -> dict:
    """The gradients the model holds (then cleared)."""
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def _weights():
    return torch.linspace(-1.0, 2.0, RESPONSE_LEN, dtype=torch.float64)  # every token's gradient matters


def _trained(model, grads, lora):
    """LoRA trains the adapters only (a sink stays frozen); full-parameter training every sink too."""
    sinks = [n for n, _ in model.named_parameters() if n.endswith("self_attn.sinks")]
    assert not lora or all("lora_" in n for n in grads)
    assert lora or all(n in grads and float(grads[n].abs().max()) > 0 for n in sinks)


@pytest.mark.numerics
@pytest.mark.parametrize("lora", [False, True])
def test_replay_gradient_equals_conditional_response_reference(member, lora):
    model = _model(member, lora)
    prompt, response = _ids(member.prompt_len, 4), _ids(RESPONSE_LEN, 5)
    with hf_float64(model):
        state = capture(model, prompt, chunk_size=8)
        before = state.fingerprint()
        ours = grads_of(model, (replay(model, state, response) * _weights()).sum())
        assert state.fingerprint() == before
        expected = grads_of(model, (hf_conditional_logprobs(model, prompt, response) * _weights()).sum())
    assert len(expected) > 0 and set(ours) == set(expected)
    _trained(model, ours, lora)
    within(max_relative_error(ours, expected), float64_residue_tolerance(gdn=False), "max relative gradient error")


@pytest.mark.numerics
@pytest.mark.parametrize("lora", [False, True])  # capture chunks shorter and longer than the window
def test_exact_mode_equals_hf_full_sequence_gradient(member, lora):
    model = _model(member, lora)
    prompt, response = _ids(member.prompt_len, 7), _ids(RESPONSE_LEN, 8)
    with hf_float64(model):
        state = capture(model, prompt, prefix_grad=True, chunk_size=member.exact_chunks[lora])
        before = state.fingerprint()
        model.zero_grad(set_to_none=True)
        (replay(model, state, response) * _weights()).sum().backward()
        conditional = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        state.backward_prefix()
        ours = _held_grads(model)  # what the replay and backward_prefix left
        expected = grads_of(model, (hf_full_logprobs(model, prompt, response) * _weights()).sum())
    assert state.fingerprint() == before and set(ours) == set(expected)
    _trained(model, ours, lora)
    within(max_relative_error(ours, expected), float64_residue_tolerance(gdn=False), "max relative gradient error")
    above(max_relative_error(conditional, expected), PROMPT_TERM, "prompt-side term")


@pytest.mark.numerics
@pytest.mark.parametrize("prefix_grad", [False, True])
def test_members_replayed_as_one_batch_give_the_serial_log_probs_and_gradient(member, prefix_grad):
    """Three responses of other lengths over one state (batch 1, read in place; on the full layers their rows
    folded over the pages): what one at a time gives."""
    model = _model(member, lora=True)
    prompt, responses = _ids(member.prompt_len, 9), [_ids(n, 10 + n) for n in (20, 7, 13)]
    runs = []
    with hf_float64(model):
        for batched in (False, True):
            state = capture(model, prompt, prefix_grad=prefix_grad, chunk_size=member.batch_chunk)
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
def test_sampling_past_a_window_matches_hf_generate(member, model, temperature):
    """New tokens after a 40-token prompt: each sequence's ring of `window` wraps, and the prompt's window leaves
    the sliding layers' view entirely, as HF's sliding cache drops it. Both stop at id 1 (Gemma's EOS, which HF's
    generate takes from the model's generation config)."""
    prompt, stop, n_new = _ids(40, 11), (1,), member.new_tokens
    config = SamplingConfig(num_generations=3, max_new_tokens=n_new, temperature=temperature, stop_ids=stop, seed=5)
    generation = GenerationConfig(
        max_new_tokens=n_new,
        eos_token_id=list(stop),
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
        **(dict(do_sample=False) if temperature == 0 else dict(do_sample=True, top_k=0, num_return_sequences=3)),
    )
    with hf_float64(model):
        state = capture(model, prompt, chunk_size=member.window)
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
        assert torch.equal(response, tokens[g, :n]) and (rollouts.finished[g] or n == n_new)
        within(max_abs(rollouts.logprobs[g], logps[g, :n]), tol, "log-probs against HF's")
    assert max(r.numel() for r in rollouts.responses) > member.decoded_windows * member.window
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
        capture(model, _ids(GEMMA.prompt_len, 0))


def test_a_context_parallel_capture_is_refused_before_any_work():
    model = build_model("tiny-gemma3", seed=1)
    cp = SimpleNamespace(world=2, rank=0, device=torch.device("cpu"), is_last=False)  # no rank is ever reached
    with pytest.raises(ValueError, match=r"WindowKV \(sliding-window layers\) has no context-parallel form"):
        capture(model, _ids(GEMMA.prompt_len, 0), cp=cp)


def test_a_sliding_layer_on_an_entry_that_keeps_every_position_is_refused():
    model = build_model("tiny-gemma3", seed=1)
    attn = unwrap_causal_lm(model).model.layers[0].self_attn  # a sliding layer
    pages = AttentionPages.allocate(1, 4, 16, torch.float32, "cpu")
    adapter = adapter_for(model)
    h = adapter.embed(_ids(4, 0)[None])
    with adapter.selected(), pytest.raises(ValueError, match="window 16.* on AttentionPages entries"):
        attention_mix(attn, h, adapter.position_embeddings(h, 0)["sliding_attention"], pages, True)
