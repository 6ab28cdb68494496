"""Decoding on CUDA (skipped without a GPU): the recorded graph against the eager step it records, the step with the
rotary table and the fused sampler against the plain one, and the decoding kernels (`decode_attention_triton`,
`gdn_decode_triton`, `rms_norm_triton`, `sampling_triton`) against their references on the device. The eager step
itself is held to HF's `generate` on the CPU (tests/test_rollout.py); the kernels' arithmetic to float64 in Triton's
interpreter (tests/test_triton_interpreted.py)."""

import dataclasses
import functools

import pytest
import torch
from tolerances import EPS_BF16, chunked_logprob_bound, float32_tolerance
from torch.utils._pytree import tree_flatten

from longstraw import capture
from longstraw.core.transaction import reuse_state
from longstraw.families import adapter_for
from longstraw.kernels.decode_attention_triton import decode_attention_triton, decode_usable
from longstraw.kernels.dependent_launch import decode_launches
from longstraw.kernels.gdn import recurrent_gated_delta_rule
from longstraw.kernels.gdn_decode_triton import gdn_decode_step
from longstraw.kernels.paged_attention import decode_partial
from longstraw.kernels.rms_norm_triton import rms_norm_rows
from longstraw.kernels.sampling_triton import CHUNK, sample_step_triton
from longstraw.models import build_model
from longstraw.models.lora import apply_lora
from longstraw.state.pages import DecodeClock
from longstraw.training.agent_rollout import AgentConfig, sample_trajectories
from longstraw.training.rollout import (
    DecodeGraph,
    Decoder,
    DecodeSession,
    RotaryTable,
    SamplingConfig,
    decoding,
    sample,
)

pytestmark = pytest.mark.cuda


def _policy(preset: str, dtype):
    model = build_model(preset, seed=1, dtype=dtype, device="cuda", head_dim=64)
    return apply_lora(model, r=8, init_random=True).to("cuda")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3_5"])
@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (1.0, 1.0), (0.7, 0.8)])
def test_graph_decoding_gives_the_eager_steps_tokens_and_logprobs(preset, temperature, top_p, dtype):
    """One seed, the same tokens and log-probs through the recorded graph as through the eager step it records
    (the graph launches the same kernels on the same tensors, and draws from the generator as the eager step
    does), with stop ids that end rows at different steps; in bf16 the decoding kernels of the step run too."""
    model = _policy(preset, dtype)
    prompt = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(0)).cuda()
    state = capture(model, prompt, chunk_size=256)
    before = state.fingerprint()
    runs = {}
    for graph in (False, True):
        config = SamplingConfig(8, 40, temperature, top_p, stop_ids=tuple(range(3, 256, 11)), seed=5, cuda_graph=graph)
        runs[graph] = sample(model, state, config)
    assert runs[True].graphed and not runs[False].graphed
    for eager, graphed, lp_e, lp_g in zip(
        runs[False].responses, runs[True].responses, runs[False].logprobs, runs[True].logprobs
    ):
        assert torch.equal(eager, graphed)
        assert torch.equal(lp_e, lp_g)  # one computation: the same kernels on the same values
    assert runs[True].finished == runs[False].finished
    assert state.fingerprint() == before
    if temperature > 0:
        assert len({tuple(r.tolist()) for r in runs[True].responses}) > 1


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3_5"])
def test_a_sessions_graph_gives_the_fresh_eager_samples(preset):
    """A `DecodeSession` records its graph once and launches it on later calls: on another prompt's state of the same
    length, after the LoRA weights moved in place (the state's reuse declared), with another seed, each call's
    tokens and log-probs are an eager fresh `sample()`'s (the generator re-seeded between launches draws what a new
    one draws; the merged and stacked weights refreshed at their addresses); another G records again; the states
    passed in unchanged (tests/test_decode_session.py holds the same on the CPU, eager, against HF `generate`)."""
    model = _policy(preset, torch.bfloat16)
    prompts = [torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(s)).cuda() for s in (0, 1)]
    states = [capture(model, prompt, chunk_size=256) for prompt in prompts]
    prints = [state.fingerprint() for state in states]
    config = SamplingConfig(8, 40, stop_ids=tuple(range(3, 256, 11)), seed=5)
    session = DecodeSession()

    def same(state, config):
        ours = sample(model, state, config, session=session)
        fresh = sample(model, state, dataclasses.replace(config, cuda_graph=False))
        assert ours.graphed and not fresh.graphed
        for a, b, lp_a, lp_b in zip(ours.responses, fresh.responses, ours.logprobs, fresh.logprobs, strict=True):
            assert torch.equal(a, b) and torch.equal(lp_a, lp_b)
        return ours

    same(states[0], config)
    same(states[1], config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(0.1 * torch.randn_like(p))
    reuse_state(model, states[1])
    same(states[1], config)
    reseeded = same(states[1], dataclasses.replace(config, seed=9))
    assert len({tuple(r.tolist()) for r in reseeded.responses}) > 1
    assert session.records == 1
    same(states[1], dataclasses.replace(config, num_generations=4))
    assert session.records == 2
    assert [state.fingerprint() for state in states] == prints


# the rotary computed each step and the torch tail: the reference the rotary table and the fused sampler stand in for
PLAIN_TAIL = dict(rotary_table=False, fused_sampler=False)


def _fused_logprob_bound(vocab: int, logp: torch.Tensor) -> torch.Tensor:
    """|ours - torch's log_softmax| for equal float32 logits: each within its bound of the exact value, ours
    chunked with Triton's exp, torch's a block reduction over the whole row (one chunk)."""
    return chunked_logprob_bound(vocab, CHUNK, logp.abs(), approximate_exp=True) + chunked_logprob_bound(
        vocab, vocab, logp.abs()
    )


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3_5"])
@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_the_graphed_step_with_the_table_and_fused_sampler_gives_the_plain_eager_tokens(preset, temperature):
    """One seed, bf16: the recorded step with the rotary table and the fused sampler (the defaults on CUDA) against
    the eager step with the rotary computed each step and the torch tail: the same tokens (the table's rows are each
    step's bits, so the logits are equal, and the draw's p / q differ by a few roundings: only a near-exact tie could
    go the other way) and rows finished; the log-probs within both sides' float32 bounds (`chunked_logprob_bound`)."""
    model = _policy(preset, torch.bfloat16)
    prompt = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(0)).cuda()
    state = capture(model, prompt, chunk_size=256)
    config = SamplingConfig(8, 40, temperature, stop_ids=tuple(range(3, 256, 11)), seed=5)
    decoder = Decoder(adapter_for(model), state, config)
    assert decoder.rotary_table is not None and decoder.sample_step is not None
    ours = sample(model, state, config)
    plain = sample(model, state, dataclasses.replace(config, cuda_graph=False, **PLAIN_TAIL))
    assert ours.graphed and not plain.graphed and ours.finished == plain.finished
    for a, b, lp_a, lp_b in zip(ours.responses, plain.responses, ours.logprobs, plain.logprobs, strict=True):
        assert torch.equal(a, b)
        bound = _fused_logprob_bound(model.config.vocab_size, lp_b.double())
        assert ((lp_a.double() - lp_b.double()).abs() <= bound).all()
    if temperature > 0:
        assert len({tuple(r.tolist()) for r in ours.responses}) > 1


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3_5"])
def test_the_graphed_step_with_dependent_launches_gives_the_serial_eager_steps_tokens_and_logprobs(preset):
    """One seed, bf16: the recorded step whose rotary-and-append, SwiGLU and attention merge start while the kernel
    before them runs (`decode_launches("dependent")`, the default: programmatic dependent launches on Hopper) against
    the eager step launching each after the one before (`decode_launches("serial")`): the same kernels on the same
    tensors, so the same tokens and log-probs bit for bit."""
    model = _policy(preset, torch.bfloat16)
    prompt = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(0)).cuda()
    state = capture(model, prompt, chunk_size=256)
    config = SamplingConfig(8, 40, 1.0, stop_ids=tuple(range(3, 256, 11)), seed=5)
    with decode_launches("dependent"):
        ours = sample(model, state, config)
    with decode_launches("serial"):
        serial = sample(model, state, dataclasses.replace(config, cuda_graph=False))
    assert ours.graphed and not serial.graphed and ours.finished == serial.finished
    for a, b, lp_a, lp_b in zip(ours.responses, serial.responses, ours.logprobs, serial.logprobs, strict=True):
        assert torch.equal(a, b) and torch.equal(lp_a, lp_b)


@pytest.mark.parametrize("temperature", [0.0, 1.0, 0.7])
def test_the_fused_sampler_takes_the_torch_draws_tokens_at_smollm2s_vocabulary(temperature):
    """`sample_step_triton` on 8 rows of 49,152 float32 logits (4 randn), 20 steps' worth, against the torch tail's
    arithmetic on the device with the same Exp(1) draws: the tokens of argmax(softmax(logits / T) / q) (or the
    argmax), and log-probs within `chunked_logprob_bound` (Triton's exp) of float64's log_softmax; written at the
    clock's step. Greedy tokens differ from drawn ones (the draws count)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    G, V, T = 8, 49152, 3
    stop, step = torch.tensor([5], device="cuda"), torch.tensor([1], device="cuda")
    for _ in range(20):
        logits = 4 * torch.randn(G, V, generator=gen, device="cuda")
        q = torch.empty_like(logits).exponential_(1, generator=gen) if temperature > 0 else None
        expected = logits.argmax(-1) if q is None else torch.softmax(logits / temperature, -1).div(q).argmax(-1)
        assert (q is None) == torch.equal(expected, logits.argmax(-1))
        tokens_G, unfinished_G = torch.zeros_like(expected), torch.ones_like(expected, dtype=torch.bool)
        finite_1 = torch.ones(1, dtype=torch.bool, device="cuda")
        tokens_GT, logps_GT = torch.zeros(G, T, dtype=torch.long, device="cuda"), torch.zeros(G, T, device="cuda")
        sample_step_triton(logits, q, temperature, stop, 0, step, tokens_G, unfinished_G, finite_1, tokens_GT, logps_GT)
        assert torch.equal(tokens_GT[:, 1], expected) and torch.equal(tokens_G, expected) and bool(finite_1)
        exact = torch.log_softmax(logits.double(), -1).gather(1, expected[:, None]).squeeze(1)
        bound = chunked_logprob_bound(V, CHUNK, exact.abs(), approximate_exp=True)
        assert ((logps_GT[:, 1].double() - exact).abs() <= bound).all()


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3_5", "tiny-gemma3"])
def test_the_rotary_tables_rows_are_each_steps_own_on_cuda(preset):
    """bf16 on the device: at each step the table's row is the adapter's rotary computed for that step alone, bit for
    bit (the CPU's test for every family: tests/test_rotary.py)."""
    model = build_model(preset, seed=1, dtype=torch.bfloat16, device="cuda", head_dim=64)
    adapter = adapter_for(model)
    clock = DecodeClock.allocate(16384, 64, "cuda")
    h_11H = adapter.embed(torch.zeros(1, 1, dtype=torch.long, device="cuda"))
    table = RotaryTable(adapter, clock, h_11H)
    for step in range(64):
        clock.step_1.fill_(step)
        (ours, ours_spec), (theirs, spec) = (
            tree_flatten(pe)
            for pe in (table.at(clock.step_1), adapter.position_embeddings_at(h_11H, clock.positions_11()))
        )
        assert ours_spec == spec and all(torch.equal(a, b) for a, b in zip(ours, theirs, strict=True))


class _EchoEnvironment:
    """Token ids in and out: observes 1 then the action reversed; done when the action's first id is even."""

    text = False

    def reset(self, example):
        return [7, 8]

    def step(self, action):
        return [1] + action[::-1], float(len(action)), bool(action) and action[0] % 2 == 0


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3_5"])
def test_graphed_agent_trajectories_are_the_eager_ones(preset):
    """Multi-turn rollouts with a recorded step (the host writing each step's forced observation tokens and the rows
    still going into the decoder's buffers between launches) give the eager step's trajectories, token for token
    and log-prob for log-prob, on one seed (the eager path is held to HF's forward in tests/test_agent_rollout.py)."""
    model = _policy(preset, torch.bfloat16)
    prompt = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(0)).cuda()
    state = capture(model, prompt, chunk_size=256)
    before = state.fingerprint()
    runs = {}
    for graph in (False, True):
        sampling = SamplingConfig(8, 48, 1.0, stop_ids=tuple(range(3, 256, 9)), seed=5, cuda_graph=graph)
        config = AgentConfig(sampling, max_turns=3, max_action_tokens=6)
        runs[graph] = sample_trajectories(model, state, _EchoEnvironment, None, config)
    for eager, graphed in zip(runs[False], runs[True], strict=True):
        assert torch.equal(eager.tokens, graphed.tokens) and torch.equal(eager.action_mask, graphed.action_mask)
        assert torch.equal(eager.logprobs, graphed.logprobs) and eager.turns == graphed.turns
    assert max(t.turns for t in runs[True]) > 1  # observations were forced between actions
    assert state.fingerprint() == before


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3_5"])
def test_graphed_agent_trajectories_with_the_fused_sampler_are_the_plain_eager_ones(preset):
    """The forced path: multi-turn rollouts through the recorded step with the rotary table and the fused sampler
    (forced tokens read on the device) against the eager plain step: the same tokens, action masks and turns, the
    log-probs within both sides' float32 bounds."""
    model = _policy(preset, torch.bfloat16)
    prompt = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(0)).cuda()
    state = capture(model, prompt, chunk_size=256)
    runs = {}
    for graph, plain in ((True, {}), (False, PLAIN_TAIL)):
        sampling = SamplingConfig(8, 48, 1.0, stop_ids=tuple(range(3, 256, 9)), seed=5, cuda_graph=graph, **plain)
        config = AgentConfig(sampling, max_turns=3, max_action_tokens=6)
        runs[graph] = sample_trajectories(model, state, _EchoEnvironment, None, config)
    for ours, theirs in zip(runs[True], runs[False], strict=True):
        assert torch.equal(ours.tokens, theirs.tokens) and torch.equal(ours.action_mask, theirs.action_mask)
        assert ours.turns == theirs.turns
        bound = _fused_logprob_bound(model.config.vocab_size, theirs.logprobs.double())
        assert ((ours.logprobs.double() - theirs.logprobs.double()).abs() <= bound).all()
    assert max(t.turns for t in runs[True]) > 1


def test_agent_samplings_leave_the_allocated_memory_as_the_first_left_it():
    """Every multi-turn sampling records a graph of its own; later ones leave the allocated memory where the first
    left it (the recordings' warm-up stream is the process's one: cuBLAS keeps a workspace for each stream it ran
    on, so a stream a recording grew the memory by a workspace a call)."""
    model = _policy("tiny-llama", torch.bfloat16)
    prompt = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(0)).cuda()
    state = capture(model, prompt, chunk_size=256)
    sampling = SamplingConfig(4, 24, 1.0, stop_ids=tuple(range(3, 256, 9)), seed=5, cuda_graph=True)
    config = AgentConfig(sampling, max_turns=2, max_action_tokens=6)
    sample_trajectories(model, state, _EchoEnvironment, None, config)
    torch.cuda.synchronize()
    first = torch.cuda.memory_allocated()
    for _ in range(3):
        sample_trajectories(model, state, _EchoEnvironment, None, config)
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() == first


def test_the_draw_is_torch_multinomials_on_cuda():
    """`Decoder.draw`'s arithmetic (argmax of p / Exp(1) noise) takes the tokens torch.multinomial takes from the
    same generator state: what HF's `generate` draws."""
    probs = torch.softmax(torch.randn(8, 5000, device="cuda"), -1)
    ours = torch.Generator(device="cuda").manual_seed(7)
    theirs = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(5):
        drawn = probs.clone().div_(torch.empty_like(probs).exponential_(1, generator=ours)).argmax(-1)
        assert torch.equal(drawn, torch.multinomial(probs, 1, generator=theirs).squeeze(1))


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("rows,keys", [(3, 5000), (8, 70000)])
def test_decode_attention_kernel_matches_the_reference_on_cuda(rows, keys, sinks):
    """Two launches against `decode_partial` (float32 math per block of keys, its lse merges) on the same bf16
    inputs: B sequences x 2 query heads a K/V head over a prefix read as a view of longer pages and 100 own slots,
    71 written; within a few bf16 roundings of the largest output (the kernel rounds its output once, and its
    probabilities once to bf16 for the second product)."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").bfloat16()

    q = randn(rows, 6, 1, 128)
    k_pages, v_pages = randn(1, 3, keys + 64, 128), randn(1, 3, keys + 64, 128)
    k_own, v_own = randn(rows, 3, 100, 128), randn(rows, 3, 100, 128)
    step = torch.tensor([70], device="cuda")
    sink = torch.randn(6, generator=gen, device="cuda") if sinks else None
    k_shared, v_shared = k_pages[:, :, :keys], v_pages[:, :, :keys]
    assert decode_usable(q, k_shared, v_shared, k_own)
    ours = decode_attention_triton(q, k_shared, v_shared, k_own, v_own, step, 0.1, sink).float()
    reference, _ = decode_partial(q, k_shared, v_shared, k_own, v_own, step, scale=0.1, sinks=sink, block_size=4096)
    assert ours.shape == reference.shape
    assert (ours - reference).abs().max() <= 4 * EPS_BF16 * reference.abs().max()


def test_the_dependent_merge_is_the_serial_one_eagerly_and_in_a_graph_on_cuda():
    """The merge launched while the prefix pass runs (a programmatic dependent launch on Hopper) gives the serial
    launch's output bit for bit (the same arithmetic): eagerly, and over 100 replays of a recorded graph in which a
    kernel writes each step's own key and value just before the attention, as the decoding step's append does, so
    a merge that read its own keys early, or partials before the prefix pass ended, would differ. At SmolLM2's
    shape (8 rows, 9 query heads over 3 K/V heads of 64, 16,384 prefix keys)."""
    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda").bfloat16()

    q, k_shared, v_shared = randn(8, 9, 1, 64), randn(1, 3, 16384, 64), randn(1, 3, 16384, 64)
    k_own, v_own = randn(8, 3, 100, 64), randn(8, 3, 100, 64)
    new_k, new_v = randn(100, 8, 3, 64), randn(100, 8, 3, 64)  # the key and value each step appends
    step = torch.zeros(1, dtype=torch.long, device="cuda")
    attend = functools.partial(decode_attention_triton, q, k_shared, v_shared, k_own, v_own, step, 0.125)

    def appended_then_attended(dependent: bool) -> torch.Tensor:
        k_own[:, :, step] = new_k.index_select(0, step).permute(1, 2, 0, 3)
        v_own[:, :, step] = new_v.index_select(0, step).permute(1, 2, 0, 3)
        return attend(dependent=dependent)

    assert torch.equal(attend(dependent=True), attend(dependent=False))
    appended_then_attended(True)  # compiles both launches before the recording
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed_out = appended_then_attended(True)
    k_own.normal_(generator=gen), v_own.normal_(generator=gen)  # what a stale read of an own slot would see
    for n in range(100):
        step.fill_(n)
        graph.replay()
        assert torch.equal(graphed_out, appended_then_attended(False)), n


def test_gdn_decode_step_is_the_recurrent_rule_on_cuda():
    """One launch, the state written in place, against the torch recurrence on the same device: float32 both."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k = (
        torch.nn.functional.normalize(torch.randn(4, 1, 2, 128, generator=gen, device="cuda"), dim=-1) for _ in "qk"
    )
    v = torch.randn(4, 1, 8, 128, generator=gen, device="cuda").bfloat16()
    g = -torch.rand(4, 1, 8, generator=gen, device="cuda")
    beta = torch.rand(4, 1, 8, generator=gen, device="cuda").bfloat16()
    state = torch.randn(4, 8, 128, 128, generator=gen, device="cuda")
    out, final = recurrent_gated_delta_rule(q, k, v, g, beta, state, l2norm_qk=False)
    written = state.clone()
    ours, same = gdn_decode_step(q, k, v, g, beta, written)
    assert same is written
    assert (written - final).abs().max() <= 1e-4 * final.abs().max()
    assert (ours.float() - out.float()).abs().max() <= 1e-4 * out.abs().max()


def test_rows_norm_is_hfs_llama_norm_within_one_rounding_on_cuda():
    """`rms_norm_rows` in bf16 against HF's LlamaRMSNorm module on the same rows (and on the residual's sum):
    the same roundings, so at most one bf16 rounding apart (the row's sum of squares taken in another order)."""
    model = build_model("tiny-llama", seed=1, dtype=torch.bfloat16, device="cuda")
    norm = model.model.layers[0].input_layernorm
    x, residual = (torch.randn(8, 1, norm.weight.numel(), device="cuda").bfloat16() for _ in "xr")
    with torch.no_grad():
        assert (rms_norm_rows(x, norm.weight, norm.variance_epsilon).float() - norm(x).float()).abs().max() <= (
            EPS_BF16 * norm(x).float().abs().max()
        )
        y, total = rms_norm_rows(x, norm.weight, norm.variance_epsilon, residual=residual)
        assert torch.equal(total, residual + x)
        assert (y.float() - norm(residual + x).float()).abs().max() <= EPS_BF16 * y.float().abs().max()


def test_a_graphed_decoding_step_launches_once():
    """Inside the recorded graph a decoding step is one graph launch; the host launches no kernel of the step, only
    the two small fills with which a replay hands the sampling generator's seed and offset to the graph."""
    from torch.profiler import ProfilerActivity, profile

    model = _policy("tiny-qwen3_5", torch.bfloat16)
    state = capture(model, torch.randint(0, 256, (300,), device="cuda"))
    adapter = adapter_for(model)
    with decoding(adapter):
        graph = DecodeGraph(Decoder(adapter, state, SamplingConfig(4, 8, cuda_graph=True)))
        graph.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            graph.step()
            torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert names.count("cudaGraphLaunch") == 1
    assert len([n for n in names if n in ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")]) <= 2


def test_rope_append_is_hfs_rotary_and_the_pages_append_on_cuda():
    """`rope_append_triton` against its reference (HF's `apply_rotary_pos_emb`, then `OwnPages.append`) in bf16: q and
    k within one bf16 rounding (each feature rounded once, where HF rounds the two products and their sum), v copied
    exactly, only the clock's slot written. (HF's llama rotates every feature; a partial rotation is checked against
    the formula in tests/test_triton_interpreted.py.)"""
    from transformers.models.llama.modeling_llama import LlamaAttention

    from longstraw.families.attention_decode import rope_append_reference
    from longstraw.kernels.rope_append_triton import rope_append_triton, rope_append_usable
    from longstraw.state.pages import DecodeClock, OwnPages

    B, H, K, D = 8, 9, 3, 64
    qkv = torch.randn(B, 1, (H + 2 * K) * D, device="cuda").bfloat16()
    q, k, v = (t.view(B, 1, -1, D) for t in qkv.split([H * D, K * D, K * D], -1))
    angles = torch.rand(1, 1, D // 2, device="cuda") * 6
    cos, sin = (f(torch.cat([angles, angles], -1)).bfloat16() for f in (torch.cos, torch.sin))
    pages = []
    for _ in range(2):
        clock = DecodeClock.allocate(100, 12, "cuda")
        clock.step_1.fill_(5)
        own_k, own_v = (torch.zeros(B, K, 12, D, device="cuda").bfloat16() for _ in "kv")
        pages.append(OwnPages(own_k, own_v, clock))
    assert rope_append_usable(q, k, v, cos, pages[0].k_BKND, pages[0].v_BKND)
    module = LlamaAttention.__new__(LlamaAttention)  # the reference reads only its modeling file's rotary
    expected_q = rope_append_reference(module, q, k, v, cos, sin, pages[0])
    ours_q = rope_append_triton(q, k, v, cos, sin, pages[1].k_BKND, pages[1].v_BKND, pages[1].clock.step_1)
    assert (ours_q.float() - expected_q.float()).abs().max() <= 2 * EPS_BF16 * expected_q.float().abs().max()
    assert (pages[1].k_BKND.float() - pages[0].k_BKND.float()).abs().max() <= 2 * EPS_BF16 * k.float().abs().max()
    assert torch.equal(pages[1].v_BKND, pages[0].v_BKND)
    assert not pages[1].k_BKND[:, :, :5].any() and not pages[1].k_BKND[:, :, 6:].any()


def test_stacked_swiglu_is_silu_times_up_on_cuda():
    """`swiglu_stacked_triton` on [gate | up] rows against silu(gate) * up in float32, within one bf16 rounding."""
    from longstraw.kernels.swiglu_triton import swiglu_stacked_triton

    gate_up = torch.randn(8, 1, 2 * 1536, device="cuda").bfloat16()
    gate, up = gate_up.float().chunk(2, -1)
    expected = torch.nn.functional.silu(gate) * up
    out = swiglu_stacked_triton(gate_up)
    assert out.shape == (8, 1, 1536) and out.dtype == torch.bfloat16
    assert (out.float() - expected).abs().max() <= EPS_BF16 * expected.abs().max()


@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_stacked_decoding_step_is_the_unstacked_one_on_cuda(preset):
    """One decoding step's logits with stacked projections and the fused rotary-append against the same step through
    HF's modules (float32: the stacked GEMMs sum each output in another order, the rotary rounds once): within
    `float32_tolerance` of the hidden and intermediate reductions, two reordered a layer, of the largest logit."""
    model = _policy(preset, torch.float32)
    state = capture(model, torch.randint(0, 256, (400,), device="cuda"))
    adapter = adapter_for(model)
    logits = {}
    for stacked in (False, True):
        with decoding(adapter, stacked_projections=stacked):
            decoder = Decoder(adapter, state, SamplingConfig(4, 4, cuda_graph=False))
            decoder.step()
            logits[stacked] = decoder.logits()  # the second token, over the own pages the first step wrote
    config = model.config
    tol = float32_tolerance(config.hidden_size, config.intermediate_size, roundings=2 * config.num_hidden_layers)
    assert (logits[True] - logits[False]).abs().max() <= tol * float(logits[False].abs().max())
