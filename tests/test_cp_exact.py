"""Exact mode under context parallelism (`capture(..., prefix_grad=True, cp=...)` + `backward_prefix`,
`longstraw.core.exact_cp`) on gloo, world sizes 2 and 3, against the single process's exact mode (itself
held to HF's one-pass autograd over prompt + response in tests/test_prefix_grad.py and tests/test_mla.py).

In float64, HF's float32 casts and the GDN states included (float64_reference): sharding computes the same
gradient in another order, and in float32 tiny-qwen3_5's decay gradients amplify that reordering (a
parameter's gradient 2.3e-6 apart on AVX-512, 1.67e-5 on an AMD EPYC with AVX2, over the former 1e-5).
"""

import os
from contextlib import nullcontext

import pytest
import torch
from float64_reference import float64_gdn_states, hf_float64, to_float64
from test_mla import DROP_TOPK, _model
from tolerances import TOL64, above, float32_tolerance, within

from longstraw import capture, replay
from longstraw.core import grpo
from longstraw.core.hf_reference import global_relative_error, max_relative_error
from longstraw.core.step import StepOptions, grpo_step
from longstraw.cp import context_parallel, shard_bounds
from longstraw.cp.launch import run_ranks
from longstraw.models import build_model

PROMPT_LEN = 24  # 23 resident positions: divisible by neither 2 nor 3
CHUNK = 4  # several chunks per shard: the reverse recompute crosses chunk and shard boundaries
PROMPT_TERM = 0.05  # the conditional gradient alone is this far off the exact one (measured >= 0.2)
# attention (dense GQA), hybrid (GDN + attention), MLA with DSA top-k dropping positions, dense MLA
CASES = [
    ("tiny-llama", None, 3),
    ("tiny-qwen3_5", None, 2),
    ("tiny-qwen3_5", None, 3),
    ("tiny-glm_moe_dsa", DROP_TOPK, 2),
    ("tiny-glm_moe_dsa", DROP_TOPK, 3),
    ("tiny-deepseek_v3", None, 3),
]


def _ids(n, seed, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


PROMPT, RESPONSES = _ids(PROMPT_LEN, 0), [_ids(7, 1), _ids(5, 2)]


def _grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _exact(preset, topk, cp=None, prompt=PROMPT, dtype=torch.float32):
    model = _model(preset, topk) if preset in ("tiny-glm_moe_dsa", "tiny-deepseek_v3") else build_model(preset, seed=1)
    model = to_float64(model) if dtype == torch.float64 else model
    with hf_float64(model) if dtype == torch.float64 else nullcontext(), float64_gdn_states():
        state = capture(model, prompt, prefix_grad=True, chunk_size=CHUNK, cp=cp)
        before = state.fingerprint()
        for y in RESPONSES:  # serial replay, one backward each
            (replay(model, state, y) * torch.linspace(-1.0, 2.0, y.numel(), dtype=dtype)).sum().backward()
        conditional = _grads(model)
        state.backward_prefix()
    return {"conditional": conditional, "exact": _grads(model), "unchanged": state.fingerprint() == before}


def _chunks(start, end):
    return {(a, min(a + CHUNK, end)) for a in range(start, end, CHUNK)}


def _tolerance(preset, positions, world):
    """TOL64, but a float64 GDN model keeps exp(A_log) in float32 (`families.hybrid.gdn_rule_inputs`), so each
    capture chunk's backward rounds its share of the A_log gradient to float32 (within EPS32 of the share):
    one EPS32 for each chunk the shards cut where the single process does not, or the reverse (measured
    0.39 EPS32 on 5 positions over 3 ranks, 3 such chunks; 23 positions are cut alike: <= 5e-16)."""
    single = _chunks(0, positions)
    sharded = set().union(*(_chunks(s, e) for s, e in shard_bounds(positions, world)))
    differing = len(single ^ sharded) if preset == "tiny-qwen3_5" else 0
    return max(TOL64, float32_tolerance(roundings=differing))


def _rank_exact(preset, topk, *args):
    return _exact(preset, topk, context_parallel(int(os.environ["WORLD_SIZE"])), *args)


@pytest.mark.numerics
@pytest.mark.parametrize("preset,topk,world", CASES, ids=lambda c: str(c))
def test_exact_mode_under_cp_equals_the_single_process(preset, topk, world):
    ranks = run_ranks(_rank_exact, world, preset, topk, PROMPT, torch.float64, start_method="fork")
    single = _exact(preset, topk, None, PROMPT, torch.float64)
    tol = _tolerance(preset, PROMPT_LEN - 1, world)
    for r in ranks:
        assert r["unchanged"]
        assert set(r["exact"]) == set(single["exact"])
        within(max_relative_error(r["exact"], single["exact"]), tol, "max relative gradient error")
        for name, g in r["exact"].items():  # every rank ends with the same gradient
            assert torch.equal(g, ranks[0]["exact"][name]), name
    # the prompt-side term is real: without it the gradient is far off
    above(global_relative_error(ranks[0]["conditional"], single["exact"]), PROMPT_TERM, "prompt-side term")


@pytest.mark.numerics
def test_exact_mode_under_cp_with_shards_shorter_than_the_conv_window():
    """5 positions over 3 ranks: shards of 2, 2 and 1, shorter than the GDN conv's K-1 = 3, so the conv
    state entering the last shard holds inputs of two earlier shards, and its gradient must reach both.
    float64, as above (measured 5.6e-8 of a parameter's gradient; 1.1e-5 in float32). A gradient that did
    not reach the earlier shard is off by far more (a lost GDN seed: 0.5)."""
    prompt = _ids(6, 0)
    ranks = run_ranks(_rank_exact, 3, "tiny-qwen3_5", None, prompt, torch.float64, start_method="fork")
    single = _exact("tiny-qwen3_5", None, None, prompt, torch.float64)
    for r in ranks:
        assert r["unchanged"]
        within(
            max_relative_error(r["exact"], single["exact"]),
            _tolerance("tiny-qwen3_5", 5, 3),
            "max relative gradient error",
        )
    above(global_relative_error(ranks[0]["conditional"], single["exact"]), PROMPT_TERM, "prompt-side term")


def _exact_step(preset, cp=None):
    """One GRPO step in exact mode (`StepOptions(prefix_grad=True)`): the parameters' update. In float64 (as
    `_exact`): in float32 a parameter's update was up to 2.7e-5 off under sharding (tests/test_cp.py)."""
    model = build_model(preset, seed=1, dtype=torch.float64)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)  # the update is the gradient
    responses = [_ids(5, 10 + i) for i in range(3)]
    options = StepOptions(prefix_grad=True, capture={"chunk_size": CHUNK, **({"cp": cp} if cp else {})})
    with hf_float64(model), float64_gdn_states():
        metrics = grpo_step(
            model, PROMPT, responses, [0.0, 1.0, 0.5], optimizer, grpo.GRPOConfig(num_generations=3), options
        ).metrics
    return {"loss": metrics["loss"], "updates": {n: p.detach() - before[n] for n, p in model.named_parameters()}}


def _rank_exact_step(preset):
    return _exact_step(preset, context_parallel(int(os.environ["WORLD_SIZE"])))


@pytest.mark.numerics
def test_exact_grpo_step_under_cp_equals_the_single_process():
    ranks = run_ranks(_rank_exact_step, 2, "tiny-llama", start_method="fork")
    single = _exact_step("tiny-llama")
    for r in ranks:
        within(abs(r["loss"] - single["loss"]), TOL64 * max(abs(single["loss"]), 1.0), "loss")
        for name, u in r["updates"].items():
            assert torch.equal(u, ranks[0]["updates"][name]), name  # one consistent optimizer step
        within(global_relative_error(r["updates"], single["updates"]), TOL64, "relative update error")
        within(max_relative_error(r["updates"], single["updates"]), TOL64, "max relative update error")
