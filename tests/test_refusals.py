"""Bad input is refused before any work, with a message naming the problem; a resident state is
refused by any model or prompt it was not captured from; a resumed run refuses a changed config."""

import json
import warnings

import pytest
import torch
import yaml

from longstraw import capture, cli, replay, score
from longstraw.config import GRPOConfig
from longstraw.core.step import grpo_step
from longstraw.harness import plan
from longstraw.models import build_model
from longstraw.training import tasks
from longstraw.training.rollout import SamplingConfig, sample
from longstraw.training.trainer import Trainer

EXPERIMENT = {
    "name": "demo", "title": "Demo", "kind": "step",
    "profiles": {"cpu": {"base": {"model": {"preset": "tiny-llama"}, "prompt": {"length": 32}},
                         "grid": {"responses.length": [4]}}},
}


def _plan_with(tmp_path, change):
    experiment = json.loads(json.dumps(EXPERIMENT))
    change(experiment)
    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(experiment))
    return plan.plan(tmp_path, "cpu")


def _base(key, value):
    def change(experiment):
        node = experiment["profiles"]["cpu"]["base"]
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return change


@pytest.mark.parametrize("key,value,message", [
    ("model.preset", "tiny-gpt5", r"model.preset: unknown model preset 'tiny-gpt5'"),
    ("model.dtype", "float8", r"model.dtype: must be one of \['float32'"),
    ("mode", "bogus", r"mode: must be one of \['replay', 'hold_all', 'naive', 'trl', 'prefix_grouper'\], got 'bogus'"),
    ("prompt.length", 0, r"prompt.length: must be >= 1, got 0"),
    ("responses.count", "two", r"responses.count: expected an integer, got 'two'"),
    ("responses.count", -2, r"responses.count: must be >= 1, got -2"),
    ("kind", "bogus", r"kind: must be one of \['step'"),  # inside a profile's base
    ("cycles", 0, r"cycles: must be >= 1, got 0"),
    ("capture.chunk_size", 0, r"capture.chunk_size: must be >= 1, got 0"),
])
def test_plan_refuses_a_bad_value_naming_file_and_key(tmp_path, key, value, message):
    with pytest.raises(ValueError, match=message) as raised:
        _plan_with(tmp_path, _base(key, value))
    assert "demo.yaml" in str(raised.value)


def test_plan_refuses_a_misspelt_task_key(tmp_path):
    def v4(experiment):
        experiment["kind"] = "validation"
        experiment["profiles"]["cpu"]["base"]["validation"] = {
            "levels": ["V4"], "modes": ["response-only"], "train": {"task": {"name": "kv_retrieval", "lenght": 64}}}
    with pytest.raises(ValueError, match=r"demo.yaml.*validation.train.task.lenght: unknown setting"):
        _plan_with(tmp_path, v4)


def _train_config(tmp_path, **changes):
    cfg = {"model": {"preset": "tiny-llama", "overrides": {"vocab_size": 96}},
           "task": {"name": "kv_retrieval", "length": 24}, "steps": 2, "steps_per_prompt": 1,
           "sampling": {"num_samples": 2, "max_new_tokens": 2}, "grpo": {"beta": 0.0},
           "schedule": {"name": "constant"}, "capture": {"chunk_size": 8},
           "output": {"dir": str(tmp_path / "run"), "checkpoint_every": 1}}
    cfg.update(changes)
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.fixture
def no_model_build(monkeypatch):
    """Fails the test if a model is built: a refusal must come before any work."""
    import longstraw.training.trainer as trainer

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the config was refused")
    monkeypatch.setattr(trainer, "build_policy", refuse)


@pytest.mark.parametrize("setting,message", [
    ("steps_per_prompt=0", "steps_per_prompt: must be >= 1, got 0"),
    ("steps=-3", "steps: must be >= 1, got -3"),
    ("task.lenght=5", "task.lenght: unknown setting of this task"),
    ("capture.chunk_size=0", "capture.chunk_size: must be >= 1, got 0"),
])
def test_train_refuses_bad_settings_before_any_work(tmp_path, capsys, no_model_build, setting, message):
    assert cli.main(["train", str(_train_config(tmp_path)), "--set", setting]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_train_refuses_an_unwritable_output_dir_before_any_work(tmp_path, capsys, no_model_build):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    config = _train_config(tmp_path, output={"dir": str(blocker / "run")})
    assert cli.main(["train", str(config)]) == 2
    assert "output.dir: cannot write to" in capsys.readouterr().err


def test_a_set_through_a_value_is_refused(tmp_path, capsys):
    spec = tmp_path / "point.yaml"
    spec.write_text(yaml.safe_dump({"model": {"preset": "tiny-llama"}, "responses": {"count": 2}}))
    assert cli.main(["run", str(spec), "--out", str(tmp_path / "r.json"), "--set", "responses.count.x=1"]) == 2
    err = capsys.readouterr().err
    assert "responses.count is 2, not a mapping: cannot set responses.count.x" in err and "Traceback" not in err


def test_run_refuses_an_unwritable_out_before_running(tmp_path, capsys, monkeypatch):
    import longstraw.harness.runner as runner

    monkeypatch.setattr(runner, "run_point", lambda *a, **k: pytest.fail("the point ran"))
    spec = tmp_path / "point.yaml"
    spec.write_text(yaml.safe_dump({"model": {"preset": "tiny-llama"}}))
    (tmp_path / "a_file").write_text("")
    assert cli.main(["run", str(spec), "--out", str(tmp_path / "a_file" / "r.json")]) == 2
    assert "--out: cannot write to" in capsys.readouterr().err


class _NanTask:
    def __init__(self, vocab_size, length=24):
        self.inner = tasks.KeyValueRetrieval(vocab_size, length=length)

    def make(self, seed):
        return self.inner.make(seed)

    def reward(self, example, response_ids):
        return float("nan")


tasks.register_task("test_nan_reward", _NanTask)


def test_a_non_number_reward_stops_training_with_its_step(tmp_path, capsys):
    config = _train_config(tmp_path, task={"name": "test_nan_reward", "length": 24})
    assert cli.main(["train", str(config)]) == 1
    err = capsys.readouterr().err
    assert "step 0: the task's reward function returned nan" in err and "Traceback" not in err


def test_a_group_of_one_says_its_step_changes_nothing():
    model = build_model("tiny-llama")
    prompt = torch.randint(0, 256, (12,))
    with pytest.warns(UserWarning, match="group of one response has zero advantage"):
        grpo_step(model, prompt, [torch.tensor([3, 4])], [1.0], torch.optim.SGD(model.parameters(), lr=0.1),
                  GRPOConfig(num_generations=1))


def test_capture_refuses_chunk_size_zero_and_prompts_beyond_the_configured_positions():
    model = build_model("tiny-llama", max_position_embeddings=16)
    with pytest.raises(ValueError, match="chunk_size must be a positive integer, got 0"):
        capture(model, torch.arange(8), chunk_size=0)
    with pytest.raises(ValueError, match="20 tokens but the model was configured for at most 16 positions"):
        capture(model, torch.arange(20))
    state = capture(model, torch.arange(20), beyond_max_positions=True)  # when asked for
    assert state.positions == 19


# ---------------------------------------------------------------------------- a state's binding

@pytest.fixture(scope="module")
def shallow():
    model = build_model("tiny-qwen3", seed=0)  # 2 layers
    return model, capture(model, torch.arange(1, 20))


@pytest.mark.parametrize("layers", [1, 4])
def test_a_state_refuses_a_model_with_other_layers(shallow, layers):
    _, state = shallow
    other = build_model("tiny-qwen3", seed=0, num_hidden_layers=layers)
    response = torch.tensor([5, 6, 7])
    for call in (lambda: replay(other, state, response), lambda: score(other, state, response),
                 lambda: sample(other, state, SamplingConfig(num_samples=2, max_new_tokens=2))):
        with pytest.raises(ValueError, match=rf"captured from a 2-layer qwen3 model .* not a {layers}-layer qwen3"):
            call()


def test_a_state_refuses_another_model_of_the_same_shape(shallow):
    _, state = shallow
    with pytest.raises(ValueError, match="another model's weights"):
        replay(build_model("tiny-qwen3", seed=1), state, torch.tensor([5, 6]))


def test_a_state_refuses_a_model_whose_frozen_weights_changed():
    model = build_model("tiny-qwen3", seed=0)
    for p in model.parameters():
        p.requires_grad_(False)
    state = capture(model, torch.arange(1, 20))
    with torch.no_grad():
        model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)  # the weights that shaped the pages
    with pytest.raises(ValueError, match="frozen weights changed since the capture"):
        replay(model, state, torch.tensor([5, 6]))


def test_a_reused_state_serves_later_steps_and_counts_them():
    """Prefix reuse is the design: trainable weights move, the state stays usable and says how old it is."""
    model = build_model("tiny-qwen3", seed=0)
    prompt, responses = torch.arange(1, 20), [torch.tensor([5, 6]), torch.tensor([7, 8, 9])]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    first = grpo_step(model, prompt, responses, [0.0, 1.0], optimizer, GRPOConfig(num_generations=2))
    second = grpo_step(model, prompt, responses, [1.0, 0.0], optimizer, GRPOConfig(num_generations=2),
                       state=first.state)
    assert second.state is first.state and "capture" not in second.metrics["phases"]
    assert (first.metrics["state_age"], second.metrics["state_age"], second.state.age) == (0, 1, 2)


@pytest.mark.parametrize("prompt", [torch.arange(2, 21), torch.arange(1, 25)], ids=["same-length", "longer"])
def test_a_step_refuses_a_state_of_another_prompt(shallow, prompt):
    model, state = shallow
    with pytest.raises(ValueError, match="another prompt|covers a prompt of 19 tokens"):
        grpo_step(model, prompt, [torch.tensor([5]), torch.tensor([6])], [0.0, 1.0],
                  torch.optim.SGD(model.parameters(), lr=0.0), GRPOConfig(num_generations=2), state=state)


# ---------------------------------------------------------------------------- resume

def test_resume_refuses_a_changed_config_unless_asked_then_applies_and_records_it(tmp_path, capsys):
    config = _train_config(tmp_path, steps=3, optimizer={"lr": 1e-3})
    cfg = yaml.safe_load(config.read_text())
    Trainer(cfg).run(resume=False, stop_after=1)  # a checkpoint at step 1
    assert cli.main(["train", str(config), "--set", "optimizer.lr=0.01"]) == 1
    assert "optimizer.lr: 0.001 -> 0.01" in capsys.readouterr().err
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert cli.main(["train", str(config), "--set", "optimizer.lr=0.01", "--allow-config-change"]) == 0
    run = tmp_path / "run"
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["lr"] for s in steps] == pytest.approx([1e-3, 1e-2, 1e-2])  # the new rate from the resumed step on
    (change,) = [json.loads(line) for line in (run / "config_changes.jsonl").read_text().splitlines()]
    assert change == {"resumed_at_step": 1, "changes": {"optimizer.lr": [1e-3, 1e-2]}}


@pytest.mark.parametrize("numel", [1, 2, 16, 17, 311_164_928, 2**40 + 1])
def test_the_binding_samples_weights_inside_their_bounds(numel):
    """The checksum's element indices are exact integers: evenly spaced from 0 to numel - 1, never past the
    end (a float32 linspace put hybrid-1b's 311,164,928-element embedding's last index at 311,164,928, which
    CUDA reports as a device-side assert)."""
    from longstraw.families.base import sample_positions

    at = sample_positions(numel, 16, "cpu").tolist()
    n = min(16, numel)
    assert len(at) == n and at[0] == 0 and at[-1] == numel - 1 and at == sorted(set(at))
    assert at == [i * (numel - 1) // max(n - 1, 1) for i in range(n)]  # by hand, in Python's exact integers
