"""capture + replay against HF's own forward and autograd, for every supported model type."""

import pytest
import torch
from float64_reference import float64_gdn_states, float64_model, has_gdn, hf_float64
from state_asserts import assert_same_state
from tolerances import TOL64, float64_residue_tolerance, logprob_tolerance, max_abs, within

from longstraw import capture, replay
from longstraw.core.hf_reference import grads_of, hf_conditional_logprobs, hf_full_logprobs, max_relative_error
from longstraw.models import TINY_PRESETS, build_model
from longstraw.models.lora import apply_lora

PROMPT_LEN = 37  # spans several 8-position capture chunks and is a multiple of none


def _ids(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=TINY_PRESETS)
def preset(request):
    return request.param


@pytest.fixture(scope="module")
def model(preset):
    return build_model(preset, seed=1)


@pytest.fixture(scope="module")
def model64(preset):
    return float64_model(preset, seed=1)


@pytest.mark.numerics
@pytest.mark.parametrize("response_len", [1, 9])
@pytest.mark.parametrize("order", ["chunk", "layer"])
def test_replay_logprobs_equal_hf_one_pass(model64, response_len, order):
    # float64 (float64_reference): both sides then differ by the float32 log-softmax each keeps (our target logit
    # less a logsumexp against HF's log_softmax), <= 2.4e-7 measured; in float32 the forwards' roundings add theirs
    prompt, response = _ids(PROMPT_LEN, 0), _ids(response_len, 1)
    with hf_float64(model64), float64_gdn_states(), torch.no_grad():
        state = capture(model64, prompt, chunk_size=8, order=order)
        assert state.positions == PROMPT_LEN - 1
        ours = replay(model64, state, response)
        expected = hf_full_logprobs(model64, prompt, response)
    assert ours.dtype == torch.float32 and ours.shape == (response_len,)
    vocab = model64.config.vocab_size
    within(max_abs(ours, expected), logprob_tolerance(vocab, float(expected.abs().max())), "log-probs")


@pytest.mark.numerics
def test_capture_orders_and_chunkings_give_identical_state(model64):
    # float64, HF's float32 casts and the GDN states included (float64_reference): in float32 other chunk shapes
    # round differently, per element up to 0.89 of a 1e-5 bound (tiny-glm4_moe, MKL AVX2); with float32 GDN
    # states (rounded after every chunk) 0.09 of it; in float64 <= 1.1e-14
    prompt = _ids(PROMPT_LEN, 2)
    with hf_float64(model64), float64_gdn_states():
        a = capture(model64, prompt, chunk_size=8, order="chunk")
        b = capture(model64, prompt, chunk_size=64, order="layer")
    assert_same_state(a, b, rtol=TOL64)


def test_measured_resident_bytes_equal_prediction(model):
    state = capture(model, _ids(PROMPT_LEN, 3), chunk_size=16)
    assert state.nbytes == state.predicted_nbytes > 0


@pytest.mark.numerics
@pytest.mark.parametrize("prompt_len", [1, PROMPT_LEN])
@pytest.mark.parametrize("lora", [False, True])
def test_replay_gradient_equals_conditional_response_reference(preset, prompt_len, lora):
    # In float64, HF's own float32 casts included, on both sides (float64_reference; our replay runs HF's
    # norms and MLPs too): in float32 the reference itself is off the exact gradient by up to 1.7e-3 on the
    # GDN presets' decay parameters (4.0e-4 on the LoRA case), so 1e-4 there measured coinciding roundings,
    # not our code. In float64 ours and HF agree to <= 7.4e-7 (every preset, prompt length, LoRA or not);
    # a wrong gradient still fails (dt_bias off by 0.1% in our GDN mixer: >= 8.5e-4 in all 12 GDN cases,
    # against a tolerance of 1.1e-5).
    net = float64_model(preset, seed=1)
    if lora:
        net = apply_lora(net, r=4, init_random=True)
    prompt, response = _ids(prompt_len, 4), _ids(6, 5)
    weights = torch.linspace(-1.0, 2.0, 6, dtype=torch.float64)  # a non-uniform loss so every token's gradient matters
    with hf_float64(net):
        state = capture(net, prompt, chunk_size=8)
        before = state.fingerprint()
        ours = grads_of(net, (replay(net, state, response) * weights).sum())
        assert state.fingerprint() == before
        expected = grads_of(net, (hf_conditional_logprobs(net, prompt, response) * weights).sum())
    assert len(expected) > 0 and all(g.dtype == torch.float64 for g in expected.values())
    within(max_relative_error(ours, expected), float64_residue_tolerance(has_gdn(net)), "max relative gradient error")


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_the_paged_attention_is_selected_on_every_attention_config_the_model_holds(preset):
    """`selected()` reads the configs of the model, the decoder and each layer's `self_attn`, not of every module
    (a walk that cost each capture and replay call milliseconds of host time): for every family, with LoRA, those
    are all the attention configs any module holds (the walk, as the reference), each dispatching to the paged
    implementation inside the block and to its own again after it. The last attention layer gets a config of its
    own (the tiny presets share one), as a model whose layers hold their own would."""
    import copy

    from longstraw.families import adapter_for
    from longstraw.families.attention_layer import IMPLEMENTATION

    adapter = adapter_for(apply_lora(build_model(preset, seed=0), r=4))
    last = [layer.self_attn for layer in adapter.layers if hasattr(layer, "self_attn")][-1]
    last.config = copy.copy(last.config)
    every = {
        id(m.config): m.config
        for m in adapter.lm.modules()
        if hasattr(getattr(m, "config", None), "_attn_implementation_internal")
    }
    own = {key: config._attn_implementation_internal for key, config in every.items()}
    assert id(last.config) in every and IMPLEMENTATION not in own.values()
    with adapter.selected():
        assert {key: config._attn_implementation_internal for key, config in every.items()} == dict.fromkeys(
            every, IMPLEMENTATION
        )
    assert {key: config._attn_implementation_internal for key, config in every.items()} == own


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_capture_runs_neither_the_last_layers_mlp_nor_its_attention(preset, monkeypatch):
    """Nothing reads a capture's last layer's output (no later layer, no logits: the last prompt token is replayed),
    so capture leaves out its MLP and, where its entry is attention pages, its attention (the pages still take the
    K/V: the log-probs test above replays over them against HF). The layer before it runs both, counted by the same
    hooks; a replay runs the last layer's MLP."""
    import longstraw.state.pages as pages
    from longstraw.families import adapter_for
    from longstraw.state import AttentionPages

    model = build_model(preset, seed=0)
    layers = adapter_for(model).layers
    calls = {"last": 0, "before": 0, "attention": 0}
    for name, layer in (("last", layers[-1]), ("before", layers[-2])):
        for module in layer.mlp.modules():
            module.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    attend = pages.paged_attention
    monkeypatch.setattr(
        pages,
        "paged_attention",
        lambda *a, **k: calls.__setitem__("attention", calls["attention"] + 1) or attend(*a, **k),
    )
    chunks = 5  # 37 prompt tokens: 36 positions in chunks of 8
    state = capture(model, _ids(PROMPT_LEN, 6), chunk_size=8, order="chunk")
    paged = sum(type(entry) is AttentionPages for entry in state.layers[:-1])
    assert calls["last"] == 0 and calls["before"] > 0, calls
    assert calls["attention"] == chunks * paged, (calls, paged)
    if type(state.layers[-1]) is AttentionPages:
        assert state.layers[-1].length == state.positions
    replay(model, state, _ids(3, 7))
    assert calls["last"] > 0


@pytest.mark.parametrize("dtype,numel", [(torch.float32, 3 * 65521 + 17), (torch.bfloat16, 65521 + 7)])
def test_chunk_sums_equal_the_position_weighted_word_sums_by_hand(monkeypatch, dtype, numel):
    """A tensor's chunk sums: its raw little-endian 32-bit words (the bytes zero-padded to a word), each times its
    index in its chunk mod 65521 plus 1, summed per chunk and wrapped to int64, computed here in Python's integers.
    Chunks of 100,000 words split the weights' period, and the tail of the last is shorter than one."""
    from longstraw.state import resident

    monkeypatch.setattr(resident, "_FINGERPRINT_CHUNK", 100_000)
    tensor = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(dtype)
    raw = tensor.view(torch.uint8).tolist()
    raw += [0] * (-len(raw) % 4)
    words = [int.from_bytes(bytes(raw[i : i + 4]), "little", signed=True) for i in range(0, len(raw), 4)]

    def wrapped(x: int) -> int:
        return (x + (1 << 63)) % (1 << 64) - (1 << 63)

    chunks = [words[s : s + 100_000] for s in range(0, len(words), 100_000)]
    expected = [wrapped(sum((i % 65521 + 1) * w for i, w in enumerate(chunk))) for chunk in chunks]
    assert resident._chunk_sums(tensor).tolist() == expected


def test_a_states_fingerprint_sees_one_flipped_bit_and_a_swap_of_two_positions():
    # the fingerprint `state_unchanged` rests on: equal for an equal copy, different after one bit of one page
    # flips (the last word of the last layer's first tensor, where a chunked sum could miss it) or after two
    # positions swap (position weights: a plain sum would not see it)
    model = build_model("tiny-llama", seed=0)
    state = capture(model, _ids(40, 1), chunk_size=16)
    before = state.fingerprint()
    page = state.layers[-1].tensors()[0]
    words = page.view(-1).view(torch.int32)
    words[-1] ^= 1
    assert state.fingerprint() != before
    words[-1] ^= 1
    assert state.fingerprint() == before
    flat = page.view(-1)
    flat[[0, 1]] = flat[[1, 0]].clone()
    assert flat[0] != flat[1] and state.fingerprint() != before
