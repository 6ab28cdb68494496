"""Exact mode under context parallelism (`capture(..., prefix_grad=True, cp=...)` + `backward_prefix`,
`longstraw.core.exact_cp`) on gloo, world sizes 2 and 3, against the single process's exact mode (itself
held to HF's one-pass autograd over prompt + response in tests/test_prefix_grad.py and tests/test_mla.py).
"""

import os
from contextlib import nullcontext

import pytest
import torch

from longstraw import capture, replay
from longstraw.core import grpo
from longstraw.core.step import StepOptions, grpo_step
from longstraw.core.hf_reference import global_relative_error, max_relative_error
from longstraw.cp import context_parallel
from longstraw.cp.launch import run_ranks
from longstraw.models import build_model
from float64_reference import float64_gdn_states, hf_float64, to_float64
from test_mla import DROP_TOPK, _model

PROMPT_LEN = 24  # 23 resident positions: divisible by neither 2 nor 3
CHUNK = 4  # several chunks per shard: the reverse recompute crosses chunk and shard boundaries
TOL = 1e-5  # relative, float32
# attention (dense GQA), hybrid (GDN + attention), MLA with DSA top-k dropping positions, dense MLA
CASES = [("tiny-llama", None, 3), ("tiny-qwen3_5", None, 2), ("tiny-qwen3_5", None, 3),
         ("tiny-glm_moe_dsa", DROP_TOPK, 2), ("tiny-glm_moe_dsa", DROP_TOPK, 3), ("tiny-deepseek_v3", None, 3)]


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


def _rank_exact(preset, topk, *args):
    return _exact(preset, topk, context_parallel(int(os.environ["WORLD_SIZE"])), *args)


@pytest.mark.numerics
@pytest.mark.parametrize("preset,topk,world", CASES, ids=lambda c: str(c))
def test_exact_mode_under_cp_equals_the_single_process(preset, topk, world):
    ranks = run_ranks(_rank_exact, world, preset, topk, start_method="fork")
    single = _exact(preset, topk)
    for r in ranks:
        assert r["unchanged"]
        assert set(r["exact"]) == set(single["exact"])
        error = max_relative_error(r["exact"], single["exact"])
        assert error < TOL, error
        for name, g in r["exact"].items():  # every rank ends with the same gradient
            assert torch.equal(g, ranks[0]["exact"][name]), name
    # the prompt-side term is real: without it the gradient is far off
    assert global_relative_error(ranks[0]["conditional"], single["exact"]) > 0.05


@pytest.mark.numerics
def test_exact_mode_under_cp_with_shards_shorter_than_the_conv_window():
    """5 positions over 3 ranks: shards of 2, 2 and 1, shorter than the GDN conv's K-1 = 3, so the conv
    state entering the last shard holds inputs of two earlier shards, and its gradient must reach both.
    float64: the shards' chunks start elsewhere than the single process's, and the GDN decay gate is
    computed in float32 whatever the model's dtype (`gdn_rule_inputs`: a.float()), whose gradient then
    differs by float32 rounding (measured 5.6e-8 of a parameter's gradient; 1.1e-5 in float32). A
    gradient that did not reach the earlier shard is off by far more (a lost GDN seed: 0.5)."""
    prompt = _ids(6, 0)
    ranks = run_ranks(_rank_exact, 3, "tiny-qwen3_5", None, prompt, torch.float64, start_method="fork")
    single = _exact("tiny-qwen3_5", None, None, prompt, torch.float64)
    for r in ranks:
        assert r["unchanged"]
        error = max_relative_error(r["exact"], single["exact"])
        assert error < 1e-6, error
    assert global_relative_error(ranks[0]["conditional"], single["exact"]) > 0.05


def _exact_step(preset, cp=None):
    """One GRPO step in exact mode (`StepOptions(prefix_grad=True)`): the parameters' update."""
    model = build_model(preset, seed=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)  # the update is the gradient
    responses = [_ids(5, 10 + i) for i in range(3)]
    options = StepOptions(prefix_grad=True, capture={"chunk_size": CHUNK, **({"cp": cp} if cp else {})})
    metrics = grpo_step(model, PROMPT, responses, [0.0, 1.0, 0.5], optimizer, grpo.GRPOConfig(num_generations=3),
                        options).metrics
    return {"loss": metrics["loss"], "updates": {n: p.detach() - before[n] for n, p in model.named_parameters()}}


def _rank_exact_step(preset):
    return _exact_step(preset, context_parallel(int(os.environ["WORLD_SIZE"])))


@pytest.mark.numerics
def test_exact_grpo_step_under_cp_equals_the_single_process():
    ranks = run_ranks(_rank_exact_step, 2, "tiny-llama", start_method="fork")
    single = _exact_step("tiny-llama")
    for r in ranks:
        assert r["loss"] == pytest.approx(single["loss"], rel=TOL, abs=1e-7)
        for name, u in r["updates"].items():
            assert torch.equal(u, ranks[0]["updates"][name]), name  # one consistent optimizer step
        error = global_relative_error(r["updates"], single["updates"])
        print(f"update error {error:.2e}, per parameter {max_relative_error(r['updates'], single['updates']):.2e}")
        assert error < TOL, error
