"""The staleness oracle: zero drift where the stale and fresh states must agree, growing drift
once training moves the parameters, and the refresh interval read off by hand-made rows."""

import math
import types

import pytest
import torch
from tolerances import float32_tolerance, logprob_tolerance, within

from longstraw.core import grpo
from longstraw.harness.runner import run_point
from longstraw.kinds.staleness import refresh_interval
from longstraw.models import build_model
from longstraw.models.lora import apply_lora, trainable_parameters
from longstraw.training.oracle import staleness_oracle


def _run(lr, steps=3, dtype=torch.float32, floor_perturbation=None):
    model = apply_lora(build_model("tiny-qwen3_5", seed=2, dtype=dtype), r=4, init_random=True)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    prompt = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0))
    result = staleness_oracle(
        model,
        prompt,
        optimizer,
        grpo.GRPOConfig(num_generations=3, beta=0.04),
        steps=steps,
        max_new_tokens=6,
        capture_kwargs={"chunk_size": 64},
        floor_perturbation=floor_perturbation,
    )
    return result.rows if floor_perturbation is None else result


def test_without_updates_the_stale_state_is_the_fresh_one():
    # a float32 cosine of equal vectors: its dot product and norms sum the trainable parameters in float32
    trainable = trainable_parameters(apply_lora(build_model("tiny-qwen3_5", seed=2), r=4, init_random=True))
    for row in _run(lr=0.0):
        assert row["param_drift"] == 0.0 and row["relative_loss_drift"] == 0.0
        assert row["mean_abs_logprob_diff"] == 0.0 and row["kl_k3"] == 0.0
        within(abs(row["grad_cosine"] - 1.0), float32_tolerance(trainable), "cosine of equal gradients")


def test_training_on_the_stale_state_makes_it_drift():
    rows = _run(lr=5e-2)
    assert rows[0]["relative_loss_drift"] == 0.0  # step 0: fresh == stale
    drift = [r["param_drift"] for r in rows]
    assert drift == sorted(drift) and drift[-1] > 0
    for r in rows[1:]:  # k3 = e^d - d - 1 ~ d^2 / 2: positive once the states differ, and below |d| for small d
        assert 0 < r["kl_k3"] < r["mean_abs_logprob_diff"] < 1
    assert all(r["grad_cosine"] < 1 for r in rows[1:])


def test_the_numerical_floor_restores_the_parameters_and_grows_with_the_perturbation():
    tiny, large = _run(lr=0.0, steps=0, floor_perturbation=1e-9), _run(lr=0.0, steps=0, floor_perturbation=1e-1)
    assert tiny.rows[0]["relative_loss_drift"] == 0.0  # restored exactly: step 0 still recaptures the same state
    assert tiny.floor["perturbation_norm"] == 1e-9
    # a perturbation far under float32's spacing leaves the log-probs within their float32 rounding
    noise = logprob_tolerance(256, 2 * math.log(256))
    assert tiny.floor["mean_abs_logprob_diff"] < noise < large.floor["mean_abs_logprob_diff"]


def test_the_floor_says_how_many_weights_its_perturbation_changed():
    """A perturbation far under a bf16 weight's spacing rounds away for almost every weight (only those at
    or near zero move), so the floor it measures is mostly the recapture's determinism: the result says
    what share of the weights changed."""
    assert _run(lr=0.0, steps=0, floor_perturbation=1e-1).floor["changed_fraction"] > 0.99  # float32 adapter

    def bf16_floor(perturbation):
        model = build_model("tiny-qwen3_5", seed=2, dtype=torch.bfloat16)  # every weight trainable, no LoRA
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.0)
        prompt = torch.randint(0, 256, (200,), generator=torch.Generator().manual_seed(0))
        return staleness_oracle(
            model,
            prompt,
            optimizer,
            grpo.GRPOConfig(num_generations=3, beta=0.0),
            steps=0,
            max_new_tokens=4,
            capture_kwargs={"chunk_size": 64},
            floor_perturbation=perturbation,
        ).floor

    # ~1e-11 per element against spacings of ~1e-4 for weights of ~0.02: rounded away but at the zeros
    assert bf16_floor(1e-9)["changed_fraction"] < 0.01
    assert bf16_floor(10.0)["changed_fraction"] > 0.5  # ~2e-2 per element: most weights move


def test_in_bfloat16_a_tiny_perturbation_already_moves_the_log_probs():
    """The floor the H200's bf16 oracle needs: re-rounding, not staleness."""
    f32 = _run(lr=0.0, steps=0, floor_perturbation=1e-6).floor["mean_abs_logprob_diff"]
    bf16 = _run(lr=0.0, steps=0, dtype=torch.bfloat16, floor_perturbation=1e-6).floor["mean_abs_logprob_diff"]
    assert bf16 > 100 * max(f32, 1e-9)


def test_a_threshold_under_the_floor_reads_no_interval():
    rows = [{"step": s, "relative_loss_drift": d} for s, d in enumerate([0.0, 1e-4, 5e-4, 2e-3])]
    assert refresh_interval(rows, 1e-3, floor=1e-4) == 2
    assert refresh_interval(rows, 1e-3, floor=4e-4) is None  # 3 x floor = 1.2e-3 > threshold


def test_refresh_interval_is_the_last_step_under_the_threshold():
    rows = [{"step": s, "relative_loss_drift": d} for s, d in enumerate([0.0, 1e-4, 5e-4, 2e-3, 1e-4])]
    assert refresh_interval(rows, 1e-3) == 2  # step 3 crosses; a later dip does not count
    assert refresh_interval(rows, 1e-5) == 0
    assert refresh_interval(rows, 1.0) == 4


def test_staleness_point_records_rows_and_interval():
    result = run_point(
        {
            "name": "stale",
            "kind": "staleness",
            "model": {"preset": "tiny-llama", "lora": {"r": 4}},
            "prompt": {"length": 100},
            "grpo": {"num_generations": 2},
            "responses": {"length": 4},
            "capture": {"chunk_size": 32},
            "staleness": {"steps": 2, "threshold": 0.5},
        }
    )
    assert result["status"] == "ok", result.get("error")
    m = result["metrics"]
    assert [r["step"] for r in m["rows"]] == [0, 1, 2] and m["refresh_interval"] == 2


@pytest.mark.parametrize(
    "model, expected",
    [
        # peft's adapters stay float32 over a bf16 base: the paper's setting
        (
            {"dtype": "bfloat16", "lora": {"r": 4}},
            ({"bfloat16"}, {"float32"}, True, False, "bfloat16 base, float32 LoRA"),
        ),
        # full-parameter bf16 training keeps float32 masters by default (an update is not rounded away)
        ({"dtype": "bfloat16"}, (set(), {"bfloat16"}, False, True, "bfloat16 weights, float32 masters")),
        (
            {"dtype": "bfloat16"} | {"_masters": False},
            (set(), {"bfloat16"}, False, False, "bfloat16 weights, updated in place"),
        ),
    ],
)
def test_a_staleness_record_says_what_was_trained_in_which_precision(model, expected):
    from longstraw.kinds.staleness import columns

    masters = model.pop("_masters", None)
    result = run_point(
        {
            "name": "stale",
            "kind": "staleness",
            "model": {"preset": "tiny-llama", **model},
            "optimizer": {"master_weights": masters},
            "prompt": {"length": 40},
            "grpo": {"num_generations": 2},
            "responses": {"length": 2},
            "capture": {"chunk_size": 16},
            "staleness": {"steps": 1},
        }
    )
    assert result["status"] == "ok", result.get("error")
    setting = result["metrics"]["setting"]
    frozen, trained, lora, masters_kept, label = expected
    assert set(setting["frozen_dtypes"]) == frozen and set(setting["trainable_dtypes"]) == trained
    assert setting["lora"] is lora and setting["master_weights"] is masters_kept
    assert columns({**result, "point": "stale"})["setting"] == label


class _SeedGatedTask:
    """A stand-in task: every example's reward is 0 except seed 12's, whose reward is the parity of
    the response's first token (so a group of 8 sampled responses almost surely has both)."""

    def __init__(self, length, vocab):
        self.length, self.vocab = length, vocab

    def make(self, seed):
        ids = torch.randint(0, self.vocab, (self.length,), generator=torch.Generator().manual_seed(seed))
        return types.SimpleNamespace(prompt_ids=ids, seed=seed)

    def reward(self, example, response):
        return float(int(response[0]) % 2) if example.seed == 12 else 0.0


def _search_config(tries: int):
    from longstraw.kinds import resolve_point

    return resolve_point(
        {
            "kind": "staleness",
            "model": {"preset": "tiny-llama"},
            "prompt": {"length": 24, "seed": 10},
            "grpo": {"num_generations": 8},
            "responses": {"length": 2},
            "capture": {"chunk_size": 8},
            "staleness": {"prompt_search": tries},
        }
    )


def test_prompt_search_finds_the_first_prompt_whose_group_rewards_differ():
    from longstraw.kinds.staleness import learnable_example

    model = build_model("tiny-llama")
    task = _SeedGatedTask(24, model.config.vocab_size)
    cfg = _search_config(5)
    example, found = learnable_example(model, task, cfg, torch.device("cpu"))
    assert example.seed == 12 and found["prompt_seed"] == 12 and found["prompts_tried"] == 3
    assert len(set(found["first_group_rewards"])) == 2
    # the oracle's own step 0 draws that same group on that prompt
    result = staleness_oracle(
        model,
        example.prompt_ids,
        torch.optim.SGD(model.parameters(), lr=0.0),
        grpo.GRPOConfig(beta=0.0, num_generations=8),
        steps=0,
        max_new_tokens=2,
        seed=cfg.responses.seed,
        reward=lambda responses: [task.reward(example, y) for y in responses],
    )
    assert result.rows[0]["reward_mean"] == pytest.approx(sum(found["first_group_rewards"]) / 8)
    # fewer tries than needed: the last seed tried, its group's equal rewards stated
    example, found = learnable_example(model, task, _search_config(2), torch.device("cpu"))
    assert found["prompt_seed"] == 11 and found["prompts_tried"] == 2 and set(found["first_group_rewards"]) == {0.0}


def test_the_first_update_is_read_where_the_steps_before_it_updated_nothing():
    from longstraw.kinds.staleness import columns

    rows = [
        {"step": s, "param_drift": p, "relative_loss_drift": d, "mean_abs_logprob_diff": d}
        for s, (p, d) in enumerate([(0, 0), (0, 0), (0, 0), (0.4, 9e-3), (0.7, 3e-2)])
    ]
    point = {
        "kind": "staleness",
        "status": "ok",
        "config": {"staleness": {"threshold": 1e-3}},
        "metrics": {"rows": rows, "threshold": 1e-3},
    }
    cols = columns(point)
    assert (cols["first_update_step"], cols["first_update_relative_loss_drift"]) == (3, 9e-3)
    assert cols["updates"] == 2 and cols["refresh_interval"] == 0
