"""Nothing lost, nothing silently wrong: a result is never thrown away or replaced unasked, a training
run's records are never cut short, and a step that fails, a state that went stale, a policy that
samples at random, a response past the position limit or a group no reward scored are never used
silently (issue 30, sections 1 and 2)."""

import builtins
import io
import json
import warnings

import pytest
import torch
import yaml

from longstraw import capture, cli, replay, score
from longstraw.config import GRPOConfig
from longstraw.config.typed import ConfigError
from longstraw.core.step import grpo_step
from longstraw.core.transaction import reuse_state
from longstraw.harness import runner
from longstraw.models import build_model
from longstraw.models.lora import apply_lora
from longstraw.results import write_result
from longstraw.training.rollout import SamplingConfig, sample
from longstraw.training.trainer import Trainer

POINT = {
    "name": "p",
    "kind": "step",
    "model": {"preset": "tiny-llama"},
    "prompt": {"length": 16},
    "grpo": {"num_generations": 2},
    "responses": {"length": 3},
}


def _ids(n, seed=0, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _no_point_runs(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the point ran although its output could not be written")

    monkeypatch.setattr(runner, "run_point", refuse)


# ---------------------------------------------------------------- 1. data loss: results


def test_an_existing_folder_as_out_is_refused_before_the_point_runs(tmp_path, monkeypatch, capsys):
    config = tmp_path / "point.yaml"
    config.write_text(yaml.safe_dump(POINT))
    folder = tmp_path / "results"
    folder.mkdir()
    _no_point_runs(monkeypatch)
    assert cli.main(["run", str(config), "--out", str(folder)]) == 2
    assert f"{folder} is a folder" in capsys.readouterr().err
    validation = tmp_path / "validation.yaml"
    validation.write_text(
        yaml.safe_dump({**POINT, "kind": "validation", "validation": {"levels": ["V1"], "modes": ["response-only"]}})
    )
    assert cli.main(["validate", str(validation), "--out", str(folder)]) == 2
    assert f"{folder} is a folder" in capsys.readouterr().err
    experiment = tmp_path / "demo.yaml"
    experiment.write_text(
        yaml.safe_dump(
            {
                "name": "demo",
                "title": "Demo",
                "kind": "step",
                "profiles": {
                    "cpu": {
                        "base": {k: v for k, v in POINT.items() if k not in ("name", "kind")},
                        "points": [{"name": "a"}],
                    }
                },
            }
        )
    )
    assert cli.main(["point", str(experiment), "--profile", "cpu", "--point", "a", "--out", str(folder)]) == 2
    assert f"{folder} is a folder" in capsys.readouterr().err
    assert list(folder.iterdir()) == []


def test_a_finished_result_is_not_replaced_unless_asked(tmp_path, monkeypatch, capsys):
    config = tmp_path / "point.yaml"
    config.write_text(yaml.safe_dump(POINT))
    out = tmp_path / "r.json"
    assert cli.main(["run", str(config), "--out", str(out)]) == 0
    first = out.read_text()
    assert json.loads(first)["status"] == "ok"
    with monkeypatch.context() as patched:
        _no_point_runs(patched)
        assert cli.main(["run", str(config), "--out", str(out), "--set", "grpo.num_generations=4"]) == 2
    assert "already exists and is not a failed result" in capsys.readouterr().err
    assert out.read_text() == first
    assert cli.main(["run", str(config), "--out", str(out), "--set", "grpo.num_generations=4", "--overwrite"]) == 0
    assert json.loads(out.read_text())["config"]["grpo"]["num_generations"] == 4
    # a failed point's result is what a rerun is for: replaced without asking
    out.write_text(json.dumps({"status": "error", "error": "RuntimeError: boom"}))
    assert cli.main(["run", str(config), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["status"] == "ok"


def test_a_result_that_cannot_be_written_is_kept_elsewhere(tmp_path):
    blocked = tmp_path / "not-a-folder"
    blocked.write_text("a file where the result's folder should be")
    with pytest.raises(OSError, match="it is kept in") as raised:
        write_result(blocked / "r.json", {"status": "ok", "metrics": {"x": 1}})
    kept = str(raised.value).rsplit("it is kept in ", 1)[1]
    assert json.loads(open(kept).read())["metrics"] == {"x": 1}


# ---------------------------------------------------------------- 1. data loss: training runs

TRAIN = {
    "model": {"preset": "tiny-llama", "lora": {"r": 4}},
    "task": {"name": "kv_retrieval", "length": 64, "num_needles": 2, "value_length": 1},
    "steps": 3,
    "steps_per_prompt": 1,
    "sampling": {"max_new_tokens": 2},
    "grpo": {"num_generations": 2, "beta": 0.0},
    "optimizer": {"lr": 1e-3},
}


def _train_config(tmp_path, checkpoint_every=0, **changes):
    cfg = json.loads(json.dumps(TRAIN))
    cfg["output"] = {"dir": str(tmp_path / "run"), "checkpoint_every": checkpoint_every}
    cfg.update(changes)
    path = tmp_path / f"train-{len(list(tmp_path.glob('train-*')))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_a_finished_run_without_checkpoints_is_not_replaced(tmp_path, monkeypatch, capsys):
    first = _train_config(tmp_path)
    assert cli.main(["train", str(first)]) == 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    records = metrics.read_text()
    assert len(records.splitlines()) == 3
    other_lr = _train_config(tmp_path, optimizer={"lr": 3e-3})

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built for a run that must be refused")

    with monkeypatch.context() as patched:
        patched.setattr("longstraw.training.trainer.build_policy", no_model)
        assert cli.main(["train", str(other_lr)]) == 2
    err = capsys.readouterr().err
    assert "holds an earlier run's records (3 steps in metrics.jsonl)" in err and "--no-resume" in err
    assert metrics.read_text() == records
    with pytest.raises(ValueError, match="no checkpoint to resume from"):  # the API refuses alike
        Trainer(yaml.safe_load(other_lr.read_text())).run()
    assert metrics.read_text() == records
    assert cli.main(["train", str(other_lr), "--no-resume"]) == 0  # starting over, on purpose
    assert metrics.read_text() != records


def test_records_shorter_than_the_checkpoint_are_refused(tmp_path):
    cfg = yaml.safe_load(_train_config(tmp_path, checkpoint_every=2).read_text())
    Trainer(cfg).run(stop_after=2)  # a checkpoint at step 2
    metrics = tmp_path / "run" / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    metrics.write_text(lines[0] + "\n")  # one record lost
    with pytest.raises(ValueError, match=r"1 step records, but the newest checkpoint is at step 2"):
        Trainer(cfg).run()
    assert metrics.read_text() == lines[0] + "\n"
    metrics.write_text(lines[1] + "\n" + lines[0] + "\n")  # out of order
    with pytest.raises(ValueError, match="line 1 is not the record of step 0"):
        Trainer(cfg).run()


class _FailingFile:
    """A text file whose writes fail once they reach it (the disk filled during the rewrite)."""

    def __init__(self, f):
        self.f = f

    def write(self, text):
        self.f.write(text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_a_failed_rewrite_of_the_records_at_resume_loses_none(tmp_path, monkeypatch):
    cfg = yaml.safe_load(_train_config(tmp_path, checkpoint_every=2).read_text())
    Trainer(cfg).run(stop_after=3)  # steps 0-2 recorded, the checkpoint at step 2
    metrics = tmp_path / "run" / "metrics.jsonl"
    before = metrics.read_text()
    real_open = builtins.open

    def failing_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return _FailingFile(f) if "metrics.jsonl" in str(file) and "w" in mode else f

    monkeypatch.setattr(builtins, "open", failing_open)
    monkeypatch.setattr(io, "open", failing_open)
    with pytest.raises(OSError, match="No space left"):
        Trainer(cfg).run()
    monkeypatch.undo()
    assert metrics.read_text() == before  # the resume's rewrite failed, the records are whole
    records = Trainer(cfg).run()
    assert [r["step"] for r in records] == [0, 1, 2]


# ---------------------------------------------------------------- 2. silent wrong results: the step


def _lora_model(**kwargs):
    return apply_lora(build_model("tiny-llama", seed=0, **kwargs), r=4, init_random=True)


def _step_inputs():
    return _ids(12, 0), [_ids(5, 1), _ids(3, 2)], [1.0, 0.0]


def test_a_step_that_raises_leaves_no_gradient_and_no_update():
    model = _lora_model()
    prompt, responses, rewards = _step_inputs()
    trainable = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    # refused before any work: old log-probs of the wrong length
    with pytest.raises(ValueError, match=r"old_logps\[1\]: one log-prob per token of response 1"):
        grpo_step(
            model,
            prompt,
            responses,
            rewards,
            optimizer,
            GRPOConfig(num_generations=2),
            old_logps=[torch.zeros(5), torch.zeros(7)],
        )
    assert all(p.grad is None for p in trainable)
    # a failure after a backward already ran (the second member): its gradient is not left behind
    state = capture(model, prompt)
    real = score(model, state, responses[0]), score(model, state, responses[1])
    calls = []

    def failing_second(logp, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("out of memory in member 2")
        return original(logp, *args, **kwargs)

    from longstraw.core import grpo

    original = grpo.response_loss
    grpo.response_loss = failing_second
    try:
        with pytest.raises(RuntimeError, match="member 2"):
            grpo_step(
                model,
                prompt,
                responses,
                rewards,
                optimizer,
                GRPOConfig(num_generations=2),
                state=state,
                old_logps=list(real),
            )
    finally:
        grpo.response_loss = original
    assert len(calls) == 2
    assert all(p.grad is None for p in trainable)
    assert not optimizer.state
    assert all(torch.equal(p, b) for p, b in zip(trainable, before))
    # the next step applies its own group's gradient only: the same update as a model that never failed
    grpo_step(model, prompt, responses, rewards, optimizer, GRPOConfig(num_generations=2), state=state)
    clean = _lora_model()
    clean_params = [p for p in clean.parameters() if p.requires_grad]
    grpo_step(
        clean, prompt, responses, rewards, torch.optim.AdamW(clean_params, lr=1e-2), GRPOConfig(num_generations=2)
    )
    assert all(torch.equal(a, b) for a, b in zip(trainable, clean_params))


def test_a_step_refuses_gradients_left_by_earlier_work():
    model = _lora_model()
    prompt, responses, rewards = _step_inputs()
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable[0].grad = torch.ones_like(trainable[0])
    with pytest.raises(ValueError, match="holds gradients from earlier work"):
        grpo_step(model, prompt, responses, rewards, torch.optim.SGD(trainable, lr=1.0), GRPOConfig(num_generations=2))
    trainable[0].grad.zero_()  # zeros are nothing to apply: the step runs
    grpo_step(model, prompt, responses, rewards, torch.optim.SGD(trainable, lr=1.0), GRPOConfig(num_generations=2))


def test_responses_past_the_position_limit_are_refused_in_replay_sampling_and_the_step():
    model = _lora_model(max_position_embeddings=16)
    prompt, rewards = _ids(12, 0), [1.0, 0.0]
    state = capture(model, prompt)  # 11 positions resident; 5 more are the most that fit
    replay(model, state, _ids(5, 1))
    with pytest.raises(ValueError, match=r"response_ids: 6 tokens after the prompt's 12 need 17 positions.*\(16\)"):
        replay(model, state, _ids(6, 1))
    with pytest.raises(ValueError, match=r"sampling max_new_tokens: 6 tokens .* max_position_embeddings \(16\)"):
        sample(model, state, SamplingConfig(num_generations=2, max_new_tokens=6))
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    for given in (state, None):
        with pytest.raises(ValueError, match=r"responses: 6 tokens after the prompt's 12 need 17"):
            grpo_step(
                model, prompt, [_ids(6, 1), _ids(2, 2)], rewards, optimizer, GRPOConfig(num_generations=2), state=given
            )
    beyond = capture(model, prompt, beyond_max_positions=True)  # asked for: allowed
    assert replay(model, beyond, _ids(6, 1)).shape == (6,)
    assert len(sample(model, beyond, SamplingConfig(num_generations=2, max_new_tokens=6)).responses) == 2


def test_response_ids_outside_the_vocabulary_are_refused_before_the_capture(monkeypatch):
    model = _lora_model()
    prompt, rewards = _ids(12, 0), [1.0, 0.0]

    def no_capture(*args, **kwargs):
        raise AssertionError("captured before the responses were checked")

    monkeypatch.setattr("longstraw.core.step.capture", no_capture)
    with pytest.raises(ValueError, match=r"responses has ids outside the vocabulary \[0, 256\): min 0, max 300"):
        grpo_step(
            model,
            prompt,
            [torch.tensor([0, 300]), _ids(2, 2)],
            rewards,
            torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1),
            GRPOConfig(num_generations=2),
        )


def test_lora_dropout_is_refused_in_the_config_and_on_the_model():
    from longstraw.config.sections import LoraConfig
    from longstraw.config.typed import from_mapping

    with pytest.raises(ConfigError, match=r"lora.dropout: must be 0, got 0.1: dropout makes scoring and replay random"):
        from_mapping(LoraConfig, {"dropout": 0.1}, "cfg", "lora")
    model = apply_lora(build_model("tiny-llama", seed=0), r=4, dropout=0.1)
    with pytest.raises(ValueError, match=r"lora_dropout.*dropout p=0.1 is active"):
        capture(model, _ids(12, 0))
    model.eval()  # the dropout modules off: deterministic, allowed
    state = capture(model, _ids(12, 0))
    assert torch.equal(score(model, state, _ids(4, 1)), score(model, state, _ids(4, 1)))


def test_a_step_checks_dropout_once_and_a_capture_after_a_refused_step_still_refuses(monkeypatch):
    """A step checks its policy before any work and its own capture does not walk the modules again; a step
    refused for dropout leaves no capture that skips the check."""
    from longstraw.core import step, transaction

    model = apply_lora(build_model("tiny-llama", seed=0), r=4, dropout=0.1)
    args = ([_ids(3, 1), _ids(2, 2)], [1.0, 0.0])
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    with pytest.raises(ValueError, match=r"dropout p=0.1 is active"):
        grpo_step(model, _ids(12, 0), *args, sgd, GRPOConfig(num_generations=2))
    with pytest.raises(ValueError, match=r"dropout p=0.1 is active"):
        capture(model, _ids(12, 0))
    model.eval()
    checks = []
    counted = transaction.check_deterministic

    def counting(m):
        checks.append(m)
        counted(m)

    monkeypatch.setattr(transaction, "check_deterministic", counting)
    monkeypatch.setattr(step, "check_deterministic", counting)
    grpo_step(model, _ids(12, 0), *args, sgd, GRPOConfig(num_generations=2))
    assert checks == [model]  # the step's own, before its capture
    capture(model, _ids(12, 0))
    assert checks == [model, model]  # a capture of its own checks again


def test_a_state_is_refused_after_its_weights_were_replaced_unless_reused_on_purpose():
    model = build_model("tiny-llama", seed=0)  # full fine-tuning: every weight trainable
    other = build_model("tiny-llama", seed=1)
    prompt, response = _ids(12, 0), _ids(4, 1)
    state = capture(model, prompt)
    model.load_state_dict(other.state_dict())
    with pytest.raises(ValueError, match="the trainable weights were written since the capture"):
        replay(model, state, response)
    with pytest.raises(ValueError, match="the trainable weights were written since the capture"):
        sample(model, state, SamplingConfig(num_generations=1, max_new_tokens=2))
    # a stale state on purpose (prefix reuse) replays, and a fresh capture agrees with the new weights
    reuse_state(model, state)
    replay(model, state, response)
    fresh = capture(model, prompt)
    assert torch.equal(score(model, fresh, response), score(other, capture(other, prompt), response))
    # grpo_step's own update keeps its state bound: the trainer's prefix reuse needs no declaration
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    result = grpo_step(
        model, prompt, [response, _ids(3, 2)], [1.0, 0.0], optimizer, GRPOConfig(num_generations=2), state=fresh
    )
    grpo_step(
        model, prompt, [response, _ids(3, 2)], [1.0, 0.0], optimizer, GRPOConfig(num_generations=2), state=result.state
    )
    assert result.state.age == 2


# ---------------------------------------------------------------- 2. silent wrong results: rewards


def none_for_all(completions, **kwargs):
    return [None] * len(completions)


def test_a_group_no_reward_function_scored_warns_and_is_counted(tmp_path, capsys):
    from test_text_trainer import _config, make_fixture

    from longstraw.training.rewards import load_reward_funcs, score_group

    funcs = load_reward_funcs(["test_trust:none_for_all"])
    with pytest.warns(UserWarning, match="returned None for 4 of 4 completions.*no completion of the group"):
        scored = score_group(funcs, None, ["p"] * 4, ["a"] * 4, [[]] * 4, {})
    assert scored.metrics["unscorable"] == 4 and scored.advantages == [0.0] * 4
    fixture = make_fixture(tmp_path / "fixture")
    cfg = _config(
        fixture, tmp_path / "run", max_steps=2, reward_funcs=["test_trust:none_for_all"], reward_weights=[1.0]
    )
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cli.main(["train", str(path)]) == 0
    assert sum("no completion of the group was scored" in str(w.message) for w in caught) == 2
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["unscorable_groups"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["unscorable"] for r in records] == [4, 4]
