"""MLA + DeepSeek sparse attention (glm_moe_dsa, deepseek_v32, deepseek_v3): capture + replay
against HF's own forward, cache and autograd (tests/hf_reference.py).

Top-k ties: at random init (std 0.02) the indexer's scores differ by ~1e-4 and are exactly zero where
ReLU removes every head, so HF's one-pass top-k and ours (same set, different float op order) can
pick different keys at the k-th place. Tests therefore either keep `index_topk` (2048) above the
sequence length, so every visible key is selected whatever the scores, or give the indexer
`tie_free` weights (std 0.5: scores spread far apart) when top-k must drop positions.
"""

import pytest
import torch
from float64_reference import hf_float64, to_float64
from state_asserts import assert_same_state
from tolerances import (
    TOL64,
    above,
    close,
    float32_tolerance,
    float64_residue_tolerance,
    logprob_tolerance,
    max_abs,
    within,
)
from transformers import DynamicCache, GenerationConfig

from longstraw import capture, replay, score
from longstraw.core.hf_reference import (
    grads_of,
    hf_caches_latents,
    hf_conditional_logprobs,
    hf_full_logprobs,
    max_relative_error,
)
from longstraw.kernels.dsa_topk import block_scores, index_scores, reference_select_topk, select_topk
from longstraw.kernels.latent_attention import latent_attention, reference_mla_attention
from longstraw.models import TINY_MLA_PRESETS, build_model
from longstraw.models.lora import apply_lora
from longstraw.state.pages import DecodeClock
from longstraw.training.rollout import SamplingConfig, _decode_entries, sample

PROMPT_LEN, RESPONSE_LEN = 23, 7  # prompt spans three 8-position capture chunks
DROP_TOPK = 6  # far below the 29 positions a response token sees: top-k drops most of them
DSA_PRESETS = ["tiny-glm_moe_dsa", "tiny-deepseek_v32"]


def _ids(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def tie_free(model, seed=3):
    """Indexer weights with well-separated scores (see the module doc)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__.endswith("Indexer"):
                for linear in (module.wq_b, module.wk, module.weights_proj):
                    linear.weight.copy_(torch.randn(linear.weight.shape, generator=g) * 0.5)
    return model


def _model(preset, topk=None, lora=False):
    model = build_model(preset, seed=1, **({"index_topk": topk} if topk else {}))
    model = tie_free(model) if topk else model
    return apply_lora(model, r=4, init_random=True) if lora else model


PROMPT_TERM = 0.05  # the conditional gradient alone is this far off the full-sequence one


CASES = [(p, None) for p in TINY_MLA_PRESETS] + [(p, DROP_TOPK) for p in DSA_PRESETS]


@pytest.mark.numerics
@pytest.mark.parametrize("preset,topk", CASES)
def test_replay_logprobs_equal_hf_one_pass(preset, topk):
    # float64 (float64_reference): the two sides differ by the float32 log-softmax each keeps
    model = to_float64(_model(preset, topk))
    prompt, response = _ids(PROMPT_LEN, 0), _ids(RESPONSE_LEN, 1)
    with hf_float64(model), torch.no_grad():
        state = capture(model, prompt, chunk_size=8)
        ours = replay(model, state, response)
        expected = hf_full_logprobs(model, prompt, response)
    assert ours.dtype == torch.float32 and ours.shape == (RESPONSE_LEN,)
    tol = logprob_tolerance(model.config.vocab_size, float(expected.abs().max()))
    within(max_abs(ours, expected), tol, "log-probs")


@pytest.mark.parametrize("preset", DSA_PRESETS)
def test_topk_drops_positions_and_replay_follows(preset):
    """The drop cases above are not vacuous: HF's output with top-k 6 differs from keeping every key."""
    prompt, response = _ids(PROMPT_LEN, 0), _ids(RESPONSE_LEN, 1)
    with torch.no_grad():
        sparse = hf_full_logprobs(_model(preset, DROP_TOPK), prompt, response)
        dense = hf_full_logprobs(_model(preset, 10_000), prompt, response)
    assert (sparse - dense).abs().max() > 1e-3


# every model type with and without LoRA while top-k keeps everything; the drop cases once each
GRADIENT_CASES = [(p, None, lora) for p in TINY_MLA_PRESETS for lora in (False, True)] + [
    ("tiny-glm_moe_dsa", DROP_TOPK, True),
    ("tiny-deepseek_v32", DROP_TOPK, False),
]


@pytest.mark.numerics
@pytest.mark.parametrize("preset,topk,lora", GRADIENT_CASES)
def test_replay_gradient_equals_conditional_response_reference(preset, topk, lora):
    # float64 (float64_reference): in float32 the two measured up to 6.8e-6 apart (tiny-glm_moe_dsa, LoRA)
    model = to_float64(_model(preset, topk, lora))
    prompt, response = _ids(PROMPT_LEN, 4), _ids(RESPONSE_LEN, 5)
    # a non-uniform loss so every token's gradient matters
    weights = torch.linspace(-1.0, 2.0, RESPONSE_LEN, dtype=torch.float64)
    with hf_float64(model):
        state = capture(model, prompt, chunk_size=8)
        before = state.fingerprint()
        ours = grads_of(model, (replay(model, state, response) * weights).sum())
        assert state.fingerprint() == before
        expected = grads_of(model, (hf_conditional_logprobs(model, prompt, response) * weights).sum())
    assert len(expected) > 0 and set(ours) == set(expected)
    if not hf_caches_latents(model, prompt):
        # HF's state is then the expanded K/V, computed without grad: kv_b_proj gets no gradient through
        # the prompt positions there, while ours (state = latents) expands them under autograd, as 5.23 does
        ours, expected = ({n: g for n, g in d.items() if "kv_b_proj" not in n} for d in (ours, expected))
    within(max_relative_error(ours, expected), float64_residue_tolerance(gdn=False), "max relative gradient error")


@pytest.mark.parametrize("preset", TINY_MLA_PRESETS)
def test_resident_bytes_are_latents_not_expanded_kv(preset):
    model = _model(preset)
    state = capture(model, _ids(PROMPT_LEN, 3), chunk_size=8)
    config = model.config
    index_layers = sum(getattr(layer.self_attn, "indexer", None) is not None for layer in model.model.layers)
    per_position = 4 * (
        config.num_hidden_layers * (config.kv_lora_rank + config.qk_rope_head_dim)
        + index_layers * getattr(config, "index_head_dim", 0)
    )
    assert state.nbytes == state.predicted_nbytes == per_position * (PROMPT_LEN - 1)
    assert {"glm_moe_dsa": 2, "deepseek_v32": 4, "deepseek_v3": 0}[config.model_type] == index_layers


@pytest.mark.numerics
@pytest.mark.parametrize("preset", DSA_PRESETS)
def test_pages_hold_what_hf_caches(preset):
    """transformers >= 5.23 caches the normed latent, the rotated rope key and the index key: our pages
    must hold exactly those, position by position. In float64, HF's float32 casts included
    (float64_reference): in float32 chunked and one-pass shapes round differently, up to 0.55 of the
    bound per element by kernel path; in float64 <= 1e-9 of it."""
    model = to_float64(_model(preset))
    prompt = _ids(PROMPT_LEN, 6)
    if not hf_caches_latents(model, prompt):
        pytest.skip("this transformers caches expanded per-head K/V (5.17), not latents")
    with hf_float64(model):
        state = capture(model, prompt, chunk_size=8)
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=prompt[None, :-1], past_key_values=cache, use_cache=True)
    for pages, layer in zip(state.layers, cache.layers):
        C = model.config.kv_lora_rank
        pairs = [(pages.kv_11PE[..., :C], layer.keys), (pages.kv_11PE[..., C:], layer.values)]
        pairs += [(pages.index_1PI, layer.indexer_keys)] if pages.index_1PI is not None else []
        for ours, hf in pairs:
            close(ours, hf, rtol=TOL64, atol=TOL64 * float(hf.abs().max()), what="pages")


@pytest.mark.numerics
@pytest.mark.parametrize("preset", ["tiny-glm_moe_dsa"])
def test_capture_orders_give_identical_state_with_index_sharing(preset):
    # float64 as in test_replay's capture-order test: float32 reached 0.61 of the bound, float64 1e-9
    model = to_float64(_model(preset, DROP_TOPK))
    prompt = _ids(PROMPT_LEN, 2)
    with hf_float64(model):
        a = capture(model, prompt, chunk_size=8, order="chunk")
        b = capture(model, prompt, chunk_size=5, order="layer")
    assert_same_state(a, b, rtol=TOL64)


def test_blocked_topk_equals_one_pass_topk():
    g = torch.Generator().manual_seed(0)
    T, P, H, I = 5, 37, 4, 8
    q, w = torch.randn(T, H, I, generator=g), torch.randn(T, H, generator=g)
    k_prefix, k_live = torch.randn(P, I, generator=g), torch.randn(T, I, generator=g)
    for topk in (3, 20, 100):
        expected = reference_select_topk(q, w, k_prefix, k_live, topk=topk, scale=0.3)
        for query_block in (2, 5):  # queries split across blocks see their own causal live keys
            ours = select_topk(q, w, k_prefix, k_live, topk=topk, scale=0.3, block_size=7, query_block=query_block)
            assert torch.equal(ours.sort(dim=1).values, expected.sort(dim=1).values)


@pytest.mark.numerics
def test_head_by_head_scores_equal_hf_formula():
    g = torch.Generator().manual_seed(2)
    q, w, k = torch.randn(6, 4, 8, generator=g), torch.randn(6, 4, generator=g), torch.randn(11, 8, generator=g)
    expected = index_scores(q, w, k, 0.3)
    tol = float32_tolerance(8, 4)  # float32 sums over the 8 index dims, then over the 4 heads, in another order
    close(block_scores(q, w, k, 0.3), expected, rtol=tol, atol=tol * float(expected.abs().max()), what="scores")


@pytest.mark.numerics
@pytest.mark.cuda
def test_fused_cuda_index_scores_and_selection_equal_the_float32_formula():
    g = torch.Generator().manual_seed(3)
    T, P, H, I = 300, 5000, 32, 128
    q, k_prefix, k_live = (torch.randn(*shape, generator=g).bfloat16().cuda() for shape in [(T, H, I), (P, I), (T, I)])
    w = torch.randn(T, H, generator=g).cuda()
    fused = block_scores(q, w, k_prefix, 128**-0.5)
    plain = index_scores(q.float(), w, k_prefix.float(), 128**-0.5)
    torch.testing.assert_close(fused, plain, rtol=1e-4, atol=1e-4 * float(plain.abs().max()))
    ours = select_topk(q, w, k_prefix, k_live, topk=2048, scale=128**-0.5, block_size=1500, query_block=128)
    expected = reference_select_topk(q.float(), w, k_prefix.float(), k_live.float(), topk=2048, scale=128**-0.5)
    same = (ours.sort(dim=1).values == expected.sort(dim=1).values).all(dim=1)
    assert float(same.float().mean()) > 0.99, float(same.float().mean())  # rows that differ hold a near-tie


@pytest.mark.numerics
@pytest.mark.parametrize("sparse", [False, True])
def test_absorbed_attention_equals_expanded_reference(sparse):
    """Forward and gradients of the absorbed kernel against per-head expansion (HF's formulation)."""
    g = torch.Generator().manual_seed(1)
    H, T, P, N, R, C, V = 3, 4, 9, 5, 4, 6, 7
    q_nope = torch.randn(1, H, T, N, generator=g, dtype=torch.float64, requires_grad=True)
    q_rot = torch.randn(1, H, T, R, generator=g, dtype=torch.float64, requires_grad=True)
    pages = torch.randn(1, 1, P, C + R, generator=g, dtype=torch.float64, requires_grad=True)
    live = torch.randn(1, 1, T, C + R, generator=g, dtype=torch.float64, requires_grad=True)
    w_uk = torch.randn(H, N, C, generator=g, dtype=torch.float64, requires_grad=True)
    w_uv = torch.randn(H, V, C, generator=g, dtype=torch.float64, requires_grad=True)
    selection = None
    if sparse:  # 5 distinct entries per query, its own position among them (top-k keeps a visible one)
        others = [torch.randperm(P + T, generator=g) for _ in range(T)]
        selection = torch.stack([torch.cat([torch.tensor([P + t]), o[o != P + t][:4]]) for t, o in enumerate(others)])
    q = torch.cat([torch.einsum("bhtn,hnc->bhtc", q_nope, w_uk), q_rot], dim=-1)
    ours = torch.einsum(
        "bhtc,hvc->bhtv",
        latent_attention(q, pages, live, rank=C, scale=0.4, selection_TK=selection, rows_per_block=3),
        w_uv,
    )
    expected = reference_mla_attention(
        q_nope, q_rot, pages, live, w_uk, w_uv, rank=C, scale=0.4, selection_TK=selection
    )
    torch.testing.assert_close(ours, expected)
    inputs = (q_nope, q_rot, pages, live, w_uk, w_uv)
    weights = torch.randn(ours.shape, generator=g, dtype=torch.float64)
    for a, b in zip(
        torch.autograd.grad((ours * weights).sum(), inputs), torch.autograd.grad((expected * weights).sum(), inputs)
    ):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize(
    "preset,topk,lora",
    [("tiny-glm_moe_dsa", DROP_TOPK, True), ("tiny-deepseek_v32", None, False), ("tiny-deepseek_v3", None, True)],
)
@pytest.mark.numerics
def test_exact_mode_equals_hf_full_sequence_gradient(preset, topk, lora):
    """capture(prefix_grad=True) + backward_prefix: HF's one-pass autograd over prompt + response. In float64
    (float64_reference): in float32 the two measured up to 3.4e-6 apart."""
    model = to_float64(_model(preset, topk, lora))
    prompt, response = _ids(PROMPT_LEN, 7), _ids(RESPONSE_LEN, 8)
    weights = torch.linspace(-1.0, 2.0, RESPONSE_LEN, dtype=torch.float64)
    with hf_float64(model):
        state = capture(model, prompt, prefix_grad=True, chunk_size=8)
        before = state.fingerprint()
        model.zero_grad(set_to_none=True)
        (replay(model, state, response) * weights).sum().backward()
        conditional = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        state.backward_prefix()
        ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        expected = grads_of(model, (hf_full_logprobs(model, prompt, response) * weights).sum())
    assert state.fingerprint() == before
    within(max_relative_error(ours, expected), float64_residue_tolerance(gdn=False), "max relative gradient error")
    above(max_relative_error(conditional, expected), PROMPT_TERM, "prompt-side term")


def test_index_share_without_a_preceding_index_layer_is_refused():
    model = build_model("tiny-glm_moe_dsa", seed=1, indexer_types=["shared", "full", "full", "full"])
    with pytest.raises(ValueError, match="layer 0 shares a top-k selection"):
        capture(model, _ids(PROMPT_LEN, 0))


@pytest.mark.parametrize(
    "preset,topk", [("tiny-glm_moe_dsa", DROP_TOPK), ("tiny-deepseek_v3", None)], ids=["sparse", "dense"]
)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_host_resident_pages_give_identical_results(device, preset, topk):
    """On CPU the host is the device: the option must change nothing. On CUDA the pages sit in pinned
    memory and each layer's copy is prefetched on a side stream while the layer before computes; the
    backward (sparse top-k, or dense MLA) streams them again."""
    model = _model(preset, topk).to(device)
    prompt, response = _ids(PROMPT_LEN, 9).to(device), _ids(RESPONSE_LEN, 10).to(device)
    runs = []
    for host in (False, True):
        state = capture(model, prompt, chunk_size=8, host_pages=host)
        logp = replay(model, state, response)
        runs.append((logp.detach(), grads_of(model, logp.sum()), state.nbytes, state))
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][2] == runs[1][2]
    assert all(torch.equal(runs[0][1][n], runs[1][1][n]) for n in runs[0][1])
    host_layers = runs[1][3].layers
    assert all(t.device.type == "cpu" for layer in host_layers for t in layer.tensors())
    assert all(a.next_host is b for a, b in zip(host_layers, host_layers[1:] + [None]))  # prefetch: layer order
    with pytest.raises(ValueError, match="prefix_grad"):
        capture(model, prompt, prefix_grad=True, host_pages=True)
    with pytest.raises(ValueError, match="host-resident"):
        capture(build_model("tiny-llama", seed=1, device=device), prompt, host_pages=True)


# Sampling from latent pages. Top-k 6 (tie_free indexer weights, see the module doc) keeps 6 of the 22 prompt
# positions + the generated ones at every decoding step, so each sequence's selection over [prompt keys ‖ its
# own keys] decides the tokens; with the scores spread far apart no two keys tie at the k-th place, so HF's
# one top-k over its cache and ours (prefix blocks merged into the sequence's own keys, another float op order)
# select the same set. deepseek_v3 has no indexer (dense latent attention).
SAMPLE_CASES = [("tiny-glm_moe_dsa", DROP_TOPK), ("tiny-deepseek_v32", DROP_TOPK), ("tiny-deepseek_v3", None)]
SAMPLE_STOP = tuple(range(3, 256, 9))  # ~11% of the vocabulary: sampled rows stop at different steps


def _hf_generate_with_logprobs(model, prompt, config: SamplingConfig):
    """HF `generate` on the full prompt with HF's own cache: tokens [G, T] and the policy log-prob of each
    (log-softmax of HF's raw float32 logits per step)."""
    kwargs = (
        dict(do_sample=False)
        if config.temperature == 0
        else dict(do_sample=True, temperature=config.temperature, top_k=0, num_return_sequences=config.num_generations)
    )
    generation = GenerationConfig(
        max_new_tokens=config.max_new_tokens,
        eos_token_id=list(config.stop_ids),
        pad_token_id=config.pad_id,
        output_logits=True,
        return_dict_in_generate=True,
        **kwargs,
    )
    torch.manual_seed(config.seed)  # HF samples from the global generator
    out = model.generate(prompt[None], generation_config=generation)
    tokens_GT = out.sequences[:, prompt.numel() :]
    logits_GTV = torch.stack(out.logits, 1).float()
    logps_GT = torch.log_softmax(logits_GTV, -1).gather(2, tokens_GT[..., None]).squeeze(2)
    return tokens_GT.expand(config.num_generations, -1), logps_GT.expand(config.num_generations, -1)


@pytest.mark.numerics
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("preset,topk", SAMPLE_CASES)
def test_sampling_from_latent_pages_matches_hf_generate(preset, topk, temperature):
    # float64 (float64_reference): both sides sample from float32 probabilities of logits that agree to ~EPS64, so
    # a float32 rounding difference cannot move a token across a sampling boundary; log-probs as in replay's
    model = to_float64(_model(preset, topk))
    prompt = _ids(PROMPT_LEN, 11)
    config = SamplingConfig(num_generations=4, max_new_tokens=8, temperature=temperature, stop_ids=SAMPLE_STOP, seed=5)
    with hf_float64(model):
        state = capture(model, prompt, chunk_size=8)
        before = state.fingerprint()
        rollouts = sample(model, state, config)
        tokens, logps = _hf_generate_with_logprobs(model, prompt, config)
        scored = [score(model, state, response) for response in rollouts.responses]
    tol = logprob_tolerance(model.config.vocab_size, float(logps.abs().max()))
    for g, response in enumerate(rollouts.responses):
        n = response.numel()
        assert torch.equal(response, tokens[g, :n])
        assert rollouts.finished[g] == (int(response[-1]) in SAMPLE_STOP)
        assert rollouts.finished[g] or n == config.max_new_tokens
        within(max_abs(rollouts.logprobs[g], logps[g, :n]), tol, "log-probs against HF's")
        within(max_abs(rollouts.logprobs[g], scored[g]), tol, "log-probs against scoring")
    assert state.fingerprint() == before
    if temperature > 0:  # distinct sequences: each one's own latents and index keys drive its steps
        assert len({tuple(r.tolist()) for r in rollouts.responses}) > 1


def test_sequences_share_the_prompt_latent_pages():
    model = _model("tiny-glm_moe_dsa")
    state = capture(model, _ids(PROMPT_LEN, 12), chunk_size=8)
    for entry, decode in zip(state.layers, _decode_entries(state, 8, DecodeClock.allocate(state.positions, 4, "cpu"))):
        assert decode.shared is entry  # read in place: no per-sequence copy of the prompt
        assert decode.own.kv_11PE.shape[:3] == (8, 1, 4)
        assert (decode.own.index_1PI is None) == (entry.index_1PI is None)
        if entry.index_1PI is not None:
            assert decode.own.index_1PI.shape[:2] == (8, 4)
