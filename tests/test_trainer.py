"""The trainer against a from-scratch reference (HF generate, HF forward and HF-cache gradients,
recomputed every step), and resume after an interruption reproducing the uninterrupted run."""

import copy
import json
import math
import threading

import pytest
import torch
from float64_reference import hf_float64
from tolerances import close
from transformers import GenerationConfig

from longstraw.core import grpo
from longstraw.core.hf_reference import hf_conditional_logprobs, hf_full_logprobs
from longstraw.training import tasks
from longstraw.training.trainer import Trainer, resolve


class _ParityTask:
    """A dense reward so every step has a gradient: the share of even tokens in the response."""

    def __init__(self, vocab_size, length=96):
        self.inner = tasks.KeyValueRetrieval(vocab_size, length=length)

    def make(self, seed):
        return self.inner.make(seed)

    def reward(self, example, response_ids):
        return float((response_ids % 2 == 0).float().mean())


tasks.register_task("test_parity", _ParityTask)


class _WitnessTask(_ParityTask):
    """Records the thread each example was made on and the example each reward was given."""

    def __init__(self, vocab_size, length=96):
        super().__init__(vocab_size, length)
        self.made, self.rewarded, self.events = {}, [], []

    def make(self, seed):
        self.events.append(("make", seed))
        example = self.inner.make(seed)
        self.made[seed] = (example, threading.current_thread().name)
        return example

    def reward(self, example, response_ids):
        self.rewarded.append(example)
        return super().reward(example, response_ids)


tasks.register_task("test_witness", _WitnessTask)


def _config(tmp_path, preset="tiny-qwen3_5", **changes):
    cfg = {
        "model": {"preset": preset, "lora": {"r": 4, "init_random": True}},
        "task": {"name": "test_parity", "length": 96},
        "steps": 3,
        "steps_per_prompt": 2,
        "seed": 3,
        "grpo": {"num_generations": 3},
        "sampling": {"max_new_tokens": 5, "temperature": 1.0, "top_p": 0.9},
        "optimizer": {"lr": 1e-2},
        "schedule": {"name": "cosine", "warmup_steps": 1},
        "max_grad_norm": 0.5,
        "refresh": {"policy": "every", "every": 1},
        "capture": {"chunk_size": 32},
        "output": {"dir": str(tmp_path / "run"), "checkpoint_every": 0},
    }
    for key, value in changes.items():
        cfg[key] = value
    return cfg


# Adam's eps for the from-scratch comparison: Adam moves an element with |g| ~ eps by up to lr * dg / (4 eps)
# for a gradient difference dg, and even in float64 both sides take a float32 log-softmax (dg up to 1.6e-8 at
# step 0). With torch's 1e-8 that amplification alone put the two tiny-qwen3_5 runs up to 2.2e-5 apart (one
# element with g = 5e-8; allclose at 0.76 of its bound), rounding rather than the trainer; with 1e-6, 6.1e-6.
ADAM_EPS = 1e-6
# The parameters after the run, elementwise. Adam normalises a step to ~lr per element, so a relative gradient
# difference d moves an element by ~lr d per step (d ~ 1e-6 here: the float32 log-softmax, float64_residue_
# tolerance), and an element whose gradient is near ADAM_EPS by up to lr dg / (4 ADAM_EPS) for an absolute
# difference dg. The bound, 1e-4 of a parameter or 2e-5, is 16x the worst element measured on every kernel
# path and thread count (0.062 of it, ATen/MKL AVX2).
PARAM_RTOL, PARAM_ATOL = 1e-4, 2e-5


def _trainer(cfg):
    trainer = Trainer(copy.deepcopy(cfg))
    for group in trainer.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return trainer


def _reference_run(cfg):
    """Everything recomputed from scratch each step with HF alone: generate, forwards, gradients."""
    trainer = _trainer(cfg)  # only for the same model, task, optimizer and schedule objects
    with hf_float64(trainer.model):  # a float64 model: HF's own float32 casts in float64 too
        _reference_steps(cfg, trainer, trainer.model, trainer.cfg.grpo)
    return {n: p.detach().clone() for n, p in trainer.params.items()}


def _reference_steps(cfg, trainer, model, config):
    s = cfg["sampling"]
    for step in range(cfg["steps"]):
        example = trainer._example(step)
        prompt = example.prompt_ids
        torch.manual_seed(cfg["seed"] * 1_000_003 + step)
        out = model.generate(
            prompt[None],
            generation_config=GenerationConfig(
                do_sample=True,
                temperature=s["temperature"],
                top_p=s["top_p"],
                top_k=0,
                num_return_sequences=cfg["grpo"]["num_generations"],
                max_new_tokens=s["max_new_tokens"],
                pad_token_id=0,
            ),
        )
        responses = list(out[:, prompt.numel() :])
        rewards = torch.tensor([trainer.task.reward(example, r) for r in responses])
        advantages = grpo.group_advantages(rewards, config.scale_rewards, num_generations=config.num_generations)
        weights = grpo.token_weights([r.numel() for r in responses], config)
        with torch.no_grad():
            old = [hf_full_logprobs(model, prompt, r) for r in responses]
            with model.disable_adapter():
                ref = [hf_full_logprobs(model, prompt, r) for r in responses]
        for i, r in enumerate(responses):
            grpo.response_loss(
                hf_conditional_logprobs(model, prompt, r), old[i], ref[i], advantages[i], weights[i], config
            ).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], cfg["max_grad_norm"])
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)
        trainer.scheduler.step()


@pytest.mark.numerics
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3_5"])
def test_refresh_every_step_equals_recomputing_from_scratch(tmp_path, preset):
    # float64 (float64_reference): in float32 the GDN decay gradients carry ~4e-4 relative rounding on both
    # sides (tiny-qwen3_5: 2.8e-5 / 6.4e-5 / 8.2e-5 apart after 3 steps on ATen avx2 / avx512 / default)
    cfg = _config(tmp_path, preset)
    cfg["model"]["dtype"] = "float64"
    trainer = _trainer(cfg)
    start = {n: p.detach().clone() for n, p in trainer.params.items()}
    with hf_float64(trainer.model):  # as the reference: the trainer runs HF's norms and MLPs too
        metrics = trainer.run(resume=False)
    assert all(m["refreshed"] for m in metrics) and any(m["grad_norm"] > 0 for m in metrics)
    assert trainer.decode_session.records == 1  # every step sampled through the one kept decoder
    expected = _reference_run(cfg)
    moved = max(float((p.detach() - start[n]).abs().max()) for n, p in trainer.params.items())
    assert moved > 1e-3  # the updates are real
    # float64: <= 6.1e-6 apart (ATen default / avx2 / avx512, MKL AVX2 or AVX-512); a state not refreshed at
    # step 1 gives 2.4e-2, dt_bias off by 0.1% in our GDN mixer 2.6e-3
    for name, p in trainer.params.items():
        close(p, expected[name], rtol=PARAM_RTOL, atol=PARAM_ATOL, what=name)


def _without_timing(rows):
    """Records less what a rerun measures afresh: seconds, and the phases' memory and time."""
    return [{k: v for k, v in row.items() if k not in ("seconds", "transaction")} for row in rows]


def test_resume_after_interruption_reproduces_the_run(tmp_path):
    changes = dict(steps=5, steps_per_prompt=5, refresh={"policy": "every", "every": 3})
    whole = _config(tmp_path / "a", **changes, output={"dir": str(tmp_path / "a"), "checkpoint_every": 2})
    expected = Trainer(whole).run(resume=False)
    cut = _config(tmp_path / "b", **changes, output={"dir": str(tmp_path / "b"), "checkpoint_every": 2})
    Trainer(copy.deepcopy(cut)).run(resume=False, stop_after=3)  # interrupted after step 2 (checkpoint at 2)
    assert len((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()) == 3
    resumed = Trainer(copy.deepcopy(cut)).run(resume=True)
    # the resumed run recaptured the state of step 0 with the parameters of step 0
    assert [m["refreshed"] for m in resumed] == [True, False, False, True, False]
    assert _without_timing(resumed) == _without_timing(expected)
    assert json.loads((tmp_path / "b" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 4
    # what ran is recorded beside the metrics: the resumed call's, from the checkpoint of step 2
    ran = json.loads((tmp_path / "b" / "provenance.json").read_text())
    assert ran["resumed_at"] == 2 and {"commit", "device", "versions"} <= set(ran)


def test_the_next_prompt_is_made_on_a_worker_thread_while_a_step_runs(tmp_path):
    """Prompt p + 1's example is made ahead on the trainer's worker thread (the first on the caller's), once, started
    after the step's capture (whose launches the worker's Python would slow), and step p is rewarded on prompt p's
    example, the one its seed makes anywhere."""
    cfg = _config(tmp_path, task={"name": "test_witness", "length": 96}, steps=4, steps_per_prompt=2)
    trainer = Trainer(cfg)
    capture = trainer._capture

    def logged_capture(step, *args):
        trainer.task.events.append(("capture", step))
        capture(step, *args)

    trainer._capture = logged_capture
    trainer.run(resume=False)
    task, seeds = trainer.task, [3 * 1_000_003 + p for p in range(2)]
    assert sorted(task.made) == seeds
    assert [task.made[s][1].startswith("next-prompt") for s in seeds] == [False, True]
    assert task.events.index(("capture", 0)) < task.events.index(("make", seeds[1]))
    groups = [task.rewarded[i * 3] for i in range(4)]  # G = 3 rewards a step
    assert [e is task.made[seeds[step // 2]][0] for step, e in enumerate(groups)] == [True] * 4
    for seed in seeds:
        assert torch.equal(task.made[seed][0].prompt_ids, task.inner.make(seed).prompt_ids)


def test_a_run_steps_with_what_was_built_frozen_out_of_the_collector_and_thaws_after(tmp_path):
    """Every step of a run finds the model's, torch's and transformers' objects out of the cyclic collector's reach
    (no full collection walks them inside a step: 0.25 s every ~10 real-model steps on the CPU); after the run, and
    after a run whose step raised, nothing stays frozen."""
    import gc

    trainer, frozen = Trainer(_config(tmp_path, steps=2)), []
    step = trainer.train_step

    def watched(index):
        frozen.append(gc.get_freeze_count())
        return step(index)

    trainer.train_step = watched
    assert gc.get_freeze_count() == 0
    trainer.run(resume=False)
    assert len(frozen) == 2 and min(frozen) > 1000
    assert gc.get_freeze_count() == 0

    def failing(index):
        raise RuntimeError("a step that fails")

    trainer.train_step = failing
    with pytest.raises(RuntimeError, match="a step that fails"):
        trainer.run(resume=False)
    assert gc.get_freeze_count() == 0

    # a run inside a frozen block of its caller's (a point's cycles) leaves that block frozen when it returns
    from longstraw.measure.collector import collector_frozen

    trainer.train_step = watched
    with collector_frozen():
        outer = gc.get_freeze_count()
        trainer.run(resume=False)
        assert outer > 1000 and gc.get_freeze_count() > 1000  # still frozen (refcounting may free a few)
    assert gc.get_freeze_count() == 0


def test_adaptive_refresh_follows_the_drift_signal(tmp_path):
    cfg = _config(tmp_path, steps=4, steps_per_prompt=4, refresh={"policy": "adaptive", "threshold": 1e9})
    metrics = Trainer(cfg).run(resume=False)
    assert [m["refreshed"] for m in metrics] == [True, False, False, False]
    assert 0 < metrics[1]["drift_before"] < metrics[3]["drift_before"]
    cfg = _config(tmp_path, steps=3, steps_per_prompt=3, refresh={"policy": "adaptive", "threshold": 0.0})
    assert all(m["refreshed"] for m in Trainer(cfg).run(resume=False))


def test_bad_train_configs_are_named(tmp_path):
    with pytest.raises(ValueError, match="refresh.policy"):
        Trainer(_config(tmp_path, refresh={"policy": "sometimes"}))
    with pytest.raises(ValueError, match="threshold"):
        Trainer(_config(tmp_path, refresh={"policy": "adaptive"}))


def test_trainer_runs_on_an_mla_preset(tmp_path):
    """MLA + DSA with IndexShare: rollouts from latent pages (top-k 16 drops most of the 96-token prompt),
    reference scoring and serial replay; two steps with finite losses and a real gradient."""
    model = {"preset": "tiny-glm_moe_dsa", "lora": {"r": 4, "init_random": True}, "overrides": {"index_topk": 16}}
    metrics = Trainer(_config(tmp_path, steps=2, model=model)).run(resume=False)  # beta 0.04: reference scoring too
    assert len(metrics) == 2
    assert all(math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]) for m in metrics)
    assert any(m["grad_norm"] > 0 for m in metrics)


def test_exact_gradient_training_steps_on_the_full_sequence_gradient(tmp_path):
    """gradient: exact recaptures with prefix_grad every step: the same rollouts as response-only
    at the first step (same weights, same seed), a larger gradient (the prompt-side term)."""
    runs = {}
    for gradient in ("response-only", "exact"):
        cfg = _config(tmp_path / gradient, steps=1, gradient=gradient)
        runs[gradient] = Trainer(cfg).run(resume=False)[0]
    assert runs["exact"]["response_tokens"] == runs["response-only"]["response_tokens"]
    assert runs["exact"]["rewards"] == runs["response-only"]["rewards"]
    assert runs["exact"]["grad_norm"] != pytest.approx(runs["response-only"]["grad_norm"], rel=1e-3)
    with pytest.raises(ValueError, match="gradient: 'exact' needs a capture with the current parameters"):
        Trainer(_config(tmp_path / "x", gradient="exact", refresh={"policy": "every", "every": 2}))


def test_recorded_member_graphs_are_refused_off_cuda_before_the_model():
    with pytest.raises(
        ValueError, match=r"replay.cuda_graph: records the members on one CUDA device; model.device is 'cpu'"
    ):
        resolve({"model": {"preset": "tiny-llama", "device": "cpu"}, "replay": {"cuda_graph": True}}, "t.yaml")


def test_report_to_sends_each_steps_numbers_to_the_backend(tmp_path, monkeypatch):
    """`report_to: trackio` (TRL's name): each step's finite numbers, as metrics.jsonl records them, logged
    under the step index, the run opened with its config and finished at the end."""
    import sys
    import types

    calls = []
    fake = types.ModuleType("trackio")
    fake.init = lambda **kwargs: calls.append(("init", kwargs))
    fake.log = lambda values, step: calls.append(("log", step, values))
    fake.finish = lambda: calls.append(("finish",))
    monkeypatch.setitem(sys.modules, "trackio", fake)
    monkeypatch.setattr("longstraw.training.watch.installed", lambda package: package == "trackio")
    Trainer(_config(tmp_path, steps=2, report_to="trackio")).run()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert calls[0][0] == "init" and calls[0][1]["config"]["report_to"] == "trackio"
    logged = [c for c in calls if c[0] == "log"]
    assert [c[1] for c in logged] == [0, 1] and calls[-1] == ("finish",)
    for (_, _, values), record in zip(logged, records):
        expected = {
            k: float(v)
            for k, v in record.items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        }
        assert values == expected and {"loss", "reward", "grad_norm"} <= set(values)


def test_report_to_a_backend_that_is_not_installed_is_refused_before_the_model(tmp_path, monkeypatch, capsys):
    import yaml

    from longstraw import cli

    monkeypatch.setattr("longstraw.training.watch.installed", lambda package: False)
    monkeypatch.setattr(Trainer, "__init__", lambda *a, **k: pytest.fail("the trainer was built"))
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(_config(tmp_path, report_to="tensorboard")))
    assert cli.main(["train", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err == f"longstraw: {config}: report_to: 'tensorboard' needs the tensorboard package (pip install tensorboard)"
    )
