"""The trainer with an environment (`environment:`): its steps against a from-scratch reference (the sampled
trajectories' rewards recomputed by replaying the environment by hand, HF's forward and autograd, TRL's masked
loss, the same clipping and AdamW), its records counting actions only, and bad environment configs named before
any work."""

import copy
import json
import re

import pytest
import torch
import yaml
from float64_reference import hf_float64
from grpo_reference import batch_loss
from tolerances import close

from longstraw.core import grpo
from longstraw.core.hf_reference import hf_conditional_logprobs, hf_full_logprobs
from longstraw.training import agent_step, tasks
from longstraw.training.environments import register_environment
from longstraw.training.trainer import Trainer

STOP = tuple(range(3, 256, 9))  # ~11% of the vocabulary: actions end at different lengths


class TallyEnvironment:
    """Token ids: observes [5, 6] first, then [1] and the action's first two ids; an action's reward is its odd
    ids over 4; done after an action of more than 2 tokens."""

    text = False

    def reset(self, example):
        assert "key" in example  # the task example's info
        return [5, 6]

    def step(self, action):
        return [1, *action[:2]], sum(a % 2 for a in action) / 4, len(action) > 2


class StoppingTask(tasks.KeyValueRetrieval):
    stop_ids = STOP


register_environment("test_tally", TallyEnvironment)
tasks.register_task("test_stopping", StoppingTask)
ADAM_EPS, PARAM_RTOL, PARAM_ATOL = 1e-6, 1e-4, 2e-5  # as tests/test_trainer.py derives them


def _config(tmp_path, **changes):
    cfg = {
        "model": {"preset": "tiny-llama", "dtype": "float64", "lora": {"r": 4, "init_random": True}},
        "task": {"name": "test_stopping", "length": 64},
        "steps": 2,
        "steps_per_prompt": 2,
        "seed": 1,
        "grpo": {"num_generations": 4, "beta": 0.04, "loss_type": "dapo"},
        "sampling": {"max_new_tokens": 18, "temperature": 1.0},
        "optimizer": {"lr": 1e-2},
        "max_grad_norm": 0.5,
        "refresh": {"policy": "every", "every": 1},
        "capture": {"chunk_size": 16},
        "environment": {"name": "test_tally", "max_turns": 3, "max_action_tokens": 4},
        "output": {"dir": str(tmp_path / "run"), "checkpoint_every": 0},
    }
    cfg.update(changes)
    return cfg


def _trainer(cfg):
    trainer = Trainer(copy.deepcopy(cfg))
    for group in trainer.optimizer.param_groups:
        group["eps"] = ADAM_EPS
    return trainer


def _rewards_by_hand(t) -> float:
    """The trajectory's actions (its masked runs, a stop id left out) through a fresh environment: their
    rewards summed, each observation it answers checked against the tokens that follow."""
    env, tokens, mask = TallyEnvironment(), t.tokens.tolist(), t.action_mask.tolist()
    assert tokens[:2] == env.reset({"key": 0}) and mask[:2] == [False, False]
    total, i = 0.0, 2
    while i < len(tokens):
        j = next((k for k in range(i, len(tokens)) if not mask[k]), len(tokens))
        action = tokens[i:j][:-1] if tokens[j - 1] in STOP else tokens[i:j]
        observation, reward, done = env.step(action)
        total += reward
        k = next((k for k in range(j, len(tokens)) if mask[k]), len(tokens))
        assert tokens[j:k] == (observation if k < len(tokens) else []) and not (done and k < len(tokens))
        i = k
    return total


def _reference_steps(cfg, sampled):
    """The run recomputed with HF alone on the trajectories the trainer sampled: parameters after it."""
    trainer = _trainer(cfg)  # the same model, optimizer and schedule objects, from the same seeds
    model, config = trainer.model, trainer.cfg.grpo
    with hf_float64(model):
        for step, trajectories in enumerate(sampled):
            prompt = trainer._example(step).prompt_ids
            rewards = torch.tensor([_rewards_by_hand(t) for t in trajectories])
            advantages = grpo.group_advantages(rewards, config.scale_rewards, num_generations=config.num_generations)
            with torch.no_grad(), model.disable_adapter():
                ref = [hf_full_logprobs(model, prompt, t.tokens) for t in trajectories]
            logps = [hf_conditional_logprobs(model, prompt, t.tokens) for t in trajectories]
            batch_loss(
                logps, None, ref, advantages, config, tool_masks=[t.action_mask for t in trajectories]
            ).backward()
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], cfg["max_grad_norm"])
            trainer.optimizer.step()
            trainer.optimizer.zero_grad(set_to_none=True)
    return {n: p.detach().clone() for n, p in trainer.params.items()}


@pytest.mark.numerics
def test_trainer_steps_with_an_environment_equal_hf_and_trls_masked_loss(tmp_path, monkeypatch):
    # float64 (float64_reference), as tests/test_trainer.py's from-scratch comparison
    sampled, sample = [], agent_step.AgentSampler.sample

    def keep(self, *args):
        rollouts = sample(self, *args)
        sampled.append(rollouts.trajectories)
        return rollouts

    monkeypatch.setattr(agent_step.AgentSampler, "sample", keep)
    cfg = _config(tmp_path)
    trainer = _trainer(cfg)
    start = {n: p.detach().clone() for n, p in trainer.params.items()}
    with hf_float64(trainer.model):
        records = trainer.run(resume=False)
    for record, trajectories in zip(records, sampled, strict=True):
        actions = [int(t.action_mask.sum()) for t in trajectories]
        assert record["rewards"] == pytest.approx([_rewards_by_hand(t) for t in trajectories], abs=1e-12)
        assert record["response_tokens"] == actions and record["num_tokens"] == sum(actions)
        assert record["completions/mean_length"] == pytest.approx(sum(actions) / len(actions))
        assert record["turns"] == [t.turns for t in trajectories] and record["turns/mean"] == sum(record["turns"]) / 4
        assert record["trajectory_tokens"] == [t.tokens.numel() for t in trajectories] != actions
        assert record["done_ratio"] == sum(t.done for t in trajectories) / 4
    assert len({t.turns for ts in sampled for t in ts}) > 1 and any(t.done for ts in sampled for t in ts)
    assert any(len(set(r["rewards"])) > 1 for r in records)  # the advantages are not all zero
    expected = _reference_steps(cfg, sampled)
    assert max(float((p.detach() - start[n]).abs().max()) for n, p in trainer.params.items()) > 1e-3
    for name, p in trainer.params.items():
        close(p, expected[name], rtol=PARAM_RTOL, atol=PARAM_ATOL, what=name)
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["turns"] == records[0]["turns"]


@pytest.mark.parametrize(
    "environment, message",
    [
        ({"name": "nowhere"}, "environment.name: environment 'nowhere': expected 'package.module:function'"),
        ({"name": "test_tally", "args": {"colour": 1}}, "environment.args: environment 'test_tally': cannot build it"),
        ({"name": "lookup", "args": {"keys": 1}}, "environment.args: lookup environment: keys must be an integer"),
        ({"name": "lookup"}, "environment.name: 'lookup' reads and writes text, and the task 'test_stopping' has no"),
        ({"name": "test_tally", "max_action_tokens": 20}, "environment.max_action_tokens: 20 tokens a turn exceed"),
        ({"name": "test_tally", "max_turns": 0}, "environment.max_turns: must be >= 1, got 0"),
    ],
)
def test_bad_environment_configs_are_named_before_any_work(tmp_path, monkeypatch, capsys, environment, message):
    from longstraw import cli

    monkeypatch.setattr(Trainer, "__init__", lambda *a, **k: pytest.fail("the trainer was built"))
    config = tmp_path / "train.yaml"
    config.write_text(yaml.safe_dump(_config(tmp_path, environment={"max_action_tokens": 4, **environment})))
    assert cli.main(["train", str(config)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(f"longstraw: {config}: ")
    assert re.search(message, err), err
