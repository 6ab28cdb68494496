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
    "name": "demo",
    "title": "Demo",
    "kind": "step",
    "profiles": {
        "cpu": {
            "base": {"model": {"preset": "tiny-llama"}, "prompt": {"length": 32}},
            "grid": {"responses.length": [4]},
        }
    },
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


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("model.preset", "tiny-gpt5", r"model.preset: unknown model preset 'tiny-gpt5'"),
        ("model.dtype", "float8", r"model.dtype: must be one of \['float32'"),
        (
            "mode",
            "bogus",
            r"mode: must be one of \['replay', 'hold_all', 'naive', 'trl', 'prefix_grouper'\], got 'bogus'",
        ),
        ("prompt.length", 0, r"prompt.length: must be >= 1, got 0"),
        ("grpo.num_generations", "two", r"grpo.num_generations: expected an integer, got 'two'"),
        ("grpo.num_generations", -2, r"grpo: num_generations must be an int >= 1, got -2"),
        ("responses.count", 2, r"responses.count: the group size is grpo.num_generations \(TRL's name\)"),
        ("kind", "bogus", r"kind: must be one of \['step'"),  # inside a profile's base
        ("cycles", 0, r"cycles: must be >= 1, got 0"),
        ("capture.chunk_size", 0, r"capture.chunk_size: must be >= 1, got 0"),
    ],
)
def test_plan_refuses_a_bad_value_naming_file_and_key(tmp_path, key, value, message):
    with pytest.raises(ValueError, match=message) as raised:
        _plan_with(tmp_path, _base(key, value))
    assert "demo.yaml" in str(raised.value)


def test_plan_refuses_a_misspelt_task_key(tmp_path):
    def v4(experiment):
        experiment["kind"] = "validation"
        experiment["profiles"]["cpu"]["base"]["validation"] = {
            "levels": ["V4"],
            "modes": ["response-only"],
            "train": {"task": {"name": "kv_retrieval", "lenght": 64}},
        }

    with pytest.raises(ValueError, match=r"demo.yaml.*validation.train.task.lenght: unknown setting"):
        _plan_with(tmp_path, v4)


def _train_config(tmp_path, **changes):
    cfg = {
        "model": {"preset": "tiny-llama", "overrides": {"vocab_size": 96}},
        "task": {"name": "kv_retrieval", "length": 24},
        "steps": 2,
        "steps_per_prompt": 1,
        "sampling": {"max_new_tokens": 2},
        "grpo": {"num_generations": 2, "beta": 0.0},
        "schedule": {"name": "constant"},
        "capture": {"chunk_size": 8},
        "output": {"dir": str(tmp_path / "run"), "checkpoint_every": 1},
    }
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


@pytest.mark.parametrize(
    "setting,message",
    [
        ("steps_per_prompt=0", "steps_per_prompt: must be >= 1, got 0"),
        ("steps=-3", "steps: must be >= 1, got -3"),
        ("task.lenght=5", "task.lenght: unknown setting of this task"),
        ("capture.chunk_size=0", "capture.chunk_size: must be >= 1, got 0"),
    ],
)
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
    spec.write_text(yaml.safe_dump({"model": {"preset": "tiny-llama"}, "grpo": {"num_generations": 2}}))
    assert cli.main(["run", str(spec), "--out", str(tmp_path / "r.json"), "--set", "grpo.num_generations.x=1"]) == 2
    err = capsys.readouterr().err
    assert (
        "grpo.num_generations is 2, not a mapping: cannot set grpo.num_generations.x" in err and "Traceback" not in err
    )


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
        grpo_step(
            model,
            prompt,
            [torch.tensor([3, 4])],
            [1.0],
            torch.optim.SGD(model.parameters(), lr=0.1),
            GRPOConfig(num_generations=1),
        )


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
    for call in (
        lambda: replay(other, state, response),
        lambda: score(other, state, response),
        lambda: sample(other, state, SamplingConfig(num_generations=2, max_new_tokens=2)),
    ):
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
    second = grpo_step(
        model, prompt, responses, [1.0, 0.0], optimizer, GRPOConfig(num_generations=2), state=first.state
    )
    assert second.state is first.state and "capture" not in second.metrics["phases"]
    assert (first.metrics["state_age"], second.metrics["state_age"], second.state.age) == (0, 1, 2)


@pytest.mark.parametrize("prompt", [torch.arange(2, 21), torch.arange(1, 25)], ids=["same-length", "longer"])
def test_a_step_refuses_a_state_of_another_prompt(shallow, prompt):
    model, state = shallow
    with pytest.raises(ValueError, match="another prompt|covers a prompt of 19 tokens"):
        grpo_step(
            model,
            prompt,
            [torch.tensor([5]), torch.tensor([6])],
            [0.0, 1.0],
            torch.optim.SGD(model.parameters(), lr=0.0),
            GRPOConfig(num_generations=2),
            state=state,
        )


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


# ---------------------------------------------------------------------------- every input checked before work


@pytest.fixture
def nothing_built(monkeypatch):
    """Fails the test if any model is built or loaded (a point's, a trainer's or a pretraining run's)."""
    import longstraw.models as models
    import longstraw.models.policy as policy
    import longstraw.training.trainer as trainer

    def refuse(*args, **kwargs):
        raise AssertionError("a model was built before the input was refused")

    for module, name in (
        (policy, "build_model"),
        (policy, "load_pretrained"),
        (trainer, "build_policy"),
        (models, "build_model"),
        (models, "load_pretrained"),
    ):
        monkeypatch.setattr(module, name, refuse)


def _write(path, config) -> str:
    path.write_text(config if isinstance(config, str) else yaml.safe_dump(config, sort_keys=False))
    return str(path)


def _refused(capsys, argv: list, out=None, one_line: bool = True) -> str:
    """`longstraw ARGV` exits 2 with one line naming the problem, no traceback, and writes no result."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and (err.count("\n") == 1 or not one_line), err
    if out is not None:
        assert not out.exists() and not out.with_name(out.name + ".partial").exists()
    return err


def _run_refused(tmp_path, capsys, config, *extra, one_line: bool = True) -> str:
    spec, out = _write(tmp_path / "point.yaml", config), tmp_path / "r.json"
    err = _refused(capsys, ["run", spec, "--out", str(out), *extra], out, one_line)
    assert f"longstraw: {spec}" in err
    return err


POINT = {
    "model": {"preset": "tiny-llama"},
    "prompt": {"length": 16},
    "grpo": {"num_generations": 2},
    "responses": {"length": 4},
}


# ---- 1. a key given twice


def test_a_repeated_key_in_an_experiment_file_is_refused_naming_both_lines(tmp_path):
    (tmp_path / "demo.yaml").write_text(
        "name: demo\ntitle: Demo\nkind: step\nprofiles:\n  cpu:\n    base:\n"
        "      model: {preset: tiny-llama}\n      prompt: {length: 32}\n      prompt: {length: 64}\n"
    )
    with pytest.raises(ValueError, match=r"demo.yaml: profiles.cpu.base: key 'prompt' appears twice \(lines 8 and 9\)"):
        plan.plan(tmp_path, "cpu")


def test_a_repeated_key_in_a_point_config_or_a_set_value_is_refused(tmp_path, capsys, nothing_built):
    err = _run_refused(
        tmp_path, capsys, "model: {preset: tiny-llama}\nresponses:\n  length: 2\n  seed: 4\n  length: 8\n"
    )
    assert "point.yaml: responses: key 'length' appears twice (lines 3 and 5)" in err
    err = _run_refused(tmp_path, capsys, POINT, "--set", "responses={length: 2, length: 8}")
    assert "point.yaml (--set responses={length: 2, length: 8}): key 'length' appears twice (both on line 1)" in err
    err = _run_refused(tmp_path, capsys, "model: {preset: tiny-llama\n", one_line=False)  # YAML's own message
    assert "point.yaml: not valid YAML: " in err and 'in "' in err


def test_a_repeated_key_in_train_pretrain_and_validate_configs_is_refused(tmp_path, capsys, nothing_built):
    train = _write(
        tmp_path / "train.yaml",
        yaml.safe_dump({"task": {"name": "kv_retrieval", "length": 24}}) + "steps: 2\nsteps: 3\n",
    )
    assert "train.yaml: key 'steps' appears twice (lines 4 and 5)" in _refused(capsys, ["train", train])
    pretrain = _write(tmp_path / "pretrain.yaml", "model: tiny-llama\nsteps: 2\nlr: 0.01\nsteps: 3\n")
    assert "pretrain.yaml: key 'steps' appears twice (lines 2 and 4)" in _refused(capsys, ["pretrain", pretrain])
    validate, out = (
        _write(tmp_path / "v.yaml", "model: {preset: tiny-llama}\nvalidation: {levels: [V1], levels: [V2]}\n"),
        tmp_path / "v.json",
    )
    err = _refused(capsys, ["validate", validate, "--out", str(out)], out)
    assert "v.yaml: validation: key 'levels' appears twice (both on line 2)" in err


# ---- 2. model.overrides against the config class


def test_an_override_the_config_class_lacks_is_refused_when_the_plan_is_made(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"demo.yaml \[profile cpu, point length-4\]: model.overrides.num_hidden_layerz: "
        r"not a field of Qwen3_5TextConfig \(did you mean 'num_hidden_layers'\?\)$",
    ):
        _plan_with(tmp_path, _base("model", {"preset": "tiny-qwen3_5", "overrides": {"num_hidden_layerz": 2}}))
    with pytest.raises(ValueError, match=r"demo.yaml.*model.overrides: LlamaConfig refuses them: .*num_hidden_layers"):
        _plan_with(tmp_path, _base("model.overrides", {"num_hidden_layers": "two"}))


def test_run_refuses_an_override_typo_before_any_work(tmp_path, capsys, nothing_built):
    err = _run_refused(tmp_path, capsys, {**POINT, "model": {"preset": "tiny-llama", "overrides": {"vocab_sise": 80}}})
    assert "model.overrides.vocab_sise: not a field of LlamaConfig (did you mean 'vocab_size'?)" in err


def test_every_preset_setting_and_the_config_classes_own_extras_are_accepted_as_overrides():
    """Each config class's fields, attribute_map, the kwargs its __post_init__ and RoPE conversion take, and
    what its modeling code reads with getattr (glm4_moe's head_dim is no field) are overrides that apply."""
    from longstraw.models.checks import check_override_keys, config_keys
    from longstraw.models.presets import MODEL_CLASSES, PRESETS

    for preset in PRESETS.values():
        check_override_keys(preset.model_type, preset.config)  # every preset's own settings are known keys
    assert set(MODEL_CLASSES) == {p.model_type for p in PRESETS.values()}
    check_override_keys("glm4_moe", {"head_dim": 8, "partial_rotary_factor": 0.25, "num_local_experts": 4})
    check_override_keys("llama", {"rope_theta": 50.0, "rope_scaling": None})
    for model_type in MODEL_CLASSES:
        assert {"num_hidden_layers", "vocab_size", "max_position_embeddings"} <= config_keys(model_type)
        assert "num_hidden_layerz" not in config_keys(model_type) and "max_length" not in config_keys(model_type)


def test_a_plan_without_overrides_imports_no_transformers(tmp_path):
    import subprocess
    import sys

    (tmp_path / "demo.yaml").write_text(yaml.safe_dump(EXPERIMENT))
    code = (
        f"import sys; from longstraw.harness import plan; plan.plan({str(tmp_path)!r}, 'cpu'); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    assert (
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "[]"
    )


# ---- 3. the model's position limit


@pytest.mark.parametrize(
    "settings,message",
    [
        (
            {"prompt.length": 100},
            r"prompt.length: 100 positions, more than the 64 the model was configured for "
            r"\(preset tiny-llama: max_position_embeddings\); set capture.beyond_max_positions",
        ),
        (
            {"prompt.length": 62},
            r"responses.length: 4 response tokens after a prompt of 62 \(prompt.length\) run to "
            r"position 66, past the 64 .*; set capture.beyond_max_positions: true to run them anyway$",
        ),
        (
            {"kind": "capacity", "capacity": {"min_length": 32, "max_length": 128, "ceiling_bytes": 1 << 30}},
            r"capacity.max_length: 128 positions, more than the 64",
        ),
        ({"kind": "length_curve", "length_curve": {"lengths": [32, 128]}}, r"length_curve.lengths: 128 positions"),
        ({"kind": "learning", "prompt.length": 80}, r"prompt.length: 80 positions"),
        ({"kind": "sweep", "prompt.length": 61}, r"responses.length: 4 response tokens after a prompt of 61"),
    ],
)
def test_the_plan_refuses_what_runs_past_the_models_positions(tmp_path, settings, message):
    def change(experiment):
        base = experiment["profiles"]["cpu"]["base"]
        base["model"]["overrides"] = {"max_position_embeddings": 64}
        for key, value in settings.items():
            plan.set_dotted(base, key, value)

    with pytest.raises(ValueError, match=message) as raised:
        _plan_with(tmp_path, change)
    assert "demo.yaml [profile cpu, point length-4]" in str(raised.value)
    beyond = _plan_with(
        tmp_path,
        lambda e: (change(e), plan.set_dotted(e["profiles"]["cpu"]["base"], "capture.beyond_max_positions", True)),
    )
    assert beyond["demo"]["points"]["length-4"]["config"].capture.beyond_max_positions  # asked for: planned


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny-llama checkpoint configured for 64 positions."""
    folder = tmp_path_factory.mktemp("checkpoint") / "ck"
    build_model("tiny-llama", max_position_embeddings=64).save_pretrained(folder)
    return folder


def test_overrides_apply_over_a_checkpoints_config(tmp_path, checkpoint):
    """A checkpoint's overrides (RoPE scaling past its trained length, say) are its loader's config kwargs:
    the plan reads the limit they set, and the policy is built with them."""
    from longstraw.config.sections import ModelConfig
    from longstraw.models.policy import build_policy

    longer = {
        "max_position_embeddings": 256,
        "rope_parameters": {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 64,
            "rope_theta": 10000.0,
        },
    }
    planned = _plan_with(
        tmp_path,
        lambda e: e["profiles"]["cpu"]["base"].update(
            model={"path": str(checkpoint), "overrides": longer}, prompt={"length": 100}
        ),
    )
    assert planned["demo"]["points"]["length-4"]["config"].prompt.length == 100  # 100 > 64, within 256
    model = build_policy(ModelConfig(path=str(checkpoint), overrides=longer))
    assert model.config.max_position_embeddings == 256 and model.config.rope_parameters["rope_type"] == "yarn"


def test_the_plan_reads_a_checkpoints_position_limit_from_its_config(tmp_path, checkpoint):
    with pytest.raises(
        ValueError, match=rf"prompt.length: 100 positions, more than the 64 .*\({checkpoint}/config.json"
    ):
        _plan_with(tmp_path, lambda e: (_base("model", {"path": str(checkpoint)})(e), _base("prompt.length", 100)(e)))


# ---- 4. model.path: there, or written by a planned pretrain point


def test_run_refuses_a_missing_checkpoint_before_building_anything(tmp_path, capsys, nothing_built):
    err = _run_refused(tmp_path, capsys, {**POINT, "model": {"path": str(tmp_path / "nowhere")}})
    assert f"model.path: no checkpoint folder {tmp_path / 'nowhere'}" in err


def test_the_plan_accepts_a_checkpoint_a_pretrain_point_writes_and_refuses_any_other(tmp_path):
    written = str(tmp_path / "ck" / "checkpoint")

    def pipeline(path, lengths=(32,)):
        def change(experiment):
            experiment["profiles"]["cpu"]["points"] = [
                {
                    "name": "pretrain",
                    "set": {
                        "kind": "pretrain",
                        "pretrain": {
                            "model": "learn-tiny-dense",
                            "model_overrides": {"max_position_embeddings": 64},
                            "steps": 1,
                            "out": str(tmp_path / "ck"),
                        },
                    },
                },
                {
                    "name": "curve",
                    "set": {"kind": "length_curve", "model.path": path, "length_curve": {"lengths": list(lengths)}},
                },
            ]

        return change

    planned = _plan_with(tmp_path, pipeline(written))
    assert plan.needs(planned, "demo", "curve") == [("demo", "pretrain")]
    with pytest.raises(
        ValueError,
        match=r"point curve\]: model.path: no checkpoint folder .*elsewhere, and no point of the plan writes it",
    ):
        _plan_with(tmp_path, pipeline(str(tmp_path / "elsewhere")))
    with pytest.raises(
        ValueError,
        match=r"point curve\]: length_curve.lengths: 128 positions, more than the 64 .*the "
        r"checkpoint demo/pretrain writes",
    ):
        _plan_with(tmp_path, pipeline(written, lengths=(32, 128)))  # the limit of the model it will hold


def test_a_checkpoint_folder_without_config_or_weights_is_refused(tmp_path, checkpoint, capsys, nothing_built):
    import shutil

    for missing, message in (("config.json", "holds no config.json"), ("model.safetensors", "holds no weights")):
        folder = tmp_path / f"without-{missing}"
        shutil.copytree(checkpoint, folder)
        (folder / missing).unlink()
        err = _run_refused(tmp_path, capsys, {**POINT, "model": {"path": str(folder)}})
        assert f"model.path: {folder} {message}" in err


# ---- 5. weights files whole


def test_a_truncated_or_corrupt_safetensors_file_is_refused_naming_it(tmp_path, checkpoint, capsys, nothing_built):
    import shutil

    cut = tmp_path / "cut"
    shutil.copytree(checkpoint, cut)
    weights = cut / "model.safetensors"
    with open(weights, "r+b") as f:
        f.truncate(weights.stat().st_size - 100)
    err = _run_refused(tmp_path, capsys, {**POINT, "model": {"path": str(cut)}})
    assert f"model.path: {weights}: truncated: " in err
    with pytest.raises(ValueError, match=rf"model.path: {weights}: truncated"):  # and when the plan is made
        _plan_with(tmp_path, _base("model", {"path": str(cut)}))
    weights.write_bytes((10**9).to_bytes(8, "little") + b"{}")
    assert "truncated or not safetensors: its header length says 1,000,000,000 bytes" in _run_refused(
        tmp_path, capsys, {**POINT, "model": {"path": str(cut)}}
    )
    weights.write_bytes((4).to_bytes(8, "little") + b"{no}")
    assert f"{weights}: corrupt safetensors header" in _run_refused(
        tmp_path, capsys, {**POINT, "model": {"path": str(cut)}}
    )


def test_a_safetensors_index_naming_a_missing_shard_is_refused(tmp_path, checkpoint, capsys, nothing_built):
    import shutil

    sharded = tmp_path / "sharded"
    shutil.copytree(checkpoint, sharded)
    (sharded / "model.safetensors").rename(sharded / "model-00001-of-00002.safetensors")
    (sharded / "model.safetensors.index.json").write_text(
        json.dumps(
            {
                "metadata": {},
                "weight_map": {
                    "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
                    "lm_head.weight": "model-00002-of-00002.safetensors",
                },
            }
        )
    )
    err = _run_refused(tmp_path, capsys, {**POINT, "model": {"path": str(sharded)}})
    assert "model.safetensors.index.json names the shard model-00002-of-00002.safetensors, which is missing" in err


# ---- 6. a text dataset's rows, every one tokenized when the task is set up


def test_a_text_row_too_short_or_too_long_is_named_when_the_task_is_set_up(tmp_path, nothing_built):
    from test_text_trainer import haystack_rows, make_tokenizer, write_jsonl

    tokenizer = make_tokenizer()
    folder = tmp_path / "text-checkpoint"  # a checkpoint configured for 64 positions, with its tokenizer
    build_model("tiny-llama", vocab_size=len(tokenizer), max_position_embeddings=64).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    rows = haystack_rows(5, 8)

    def config(data):
        return {
            "model": {"path": str(folder)},
            "dataset": {"path": str(data)},
            "reward_funcs": ["longstraw.training.rewards:contains_answer"],
            "check_reward_funcs": False,
            "grpo": {"num_generations": 2},
            "sampling": {"max_new_tokens": 4},
            "output": {"dir": str(tmp_path / "run")},
        }

    short = write_jsonl(tmp_path / "short.jsonl", rows[:3] + [{"prompt": "grass", "answer": "red"}] + rows[3:])
    with pytest.raises(
        ValueError,
        match=rf"dataset.path: {short} row 3: the prompt is 1 token\(s\); a capture needs "
        r"at least 2",
    ):
        Trainer(config(short))
    long = write_jsonl(tmp_path / "long.jsonl", rows[:2] + haystack_rows(1, 80, seed=5) + rows[2:])
    with pytest.raises(ValueError, match=rf"{long} row 2: the prompt is \d+ tokens, more than the 64 positions"):
        Trainer(config(long))
    edge = write_jsonl(tmp_path / "edge.jsonl", rows[:1] + haystack_rows(1, 48, seed=5))  # 62 tokens, then 4 more
    with pytest.raises(ValueError, match=rf"{edge} row 1: the prompt's 62 tokens and up to 4 sampled"):
        Trainer(config(edge))


# ---- 7. a device this machine does not have

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is of CUDA where there is none")
NO_CUDA = "'cuda', but this torch"


@needs_no_cuda
def test_run_point_train_pretrain_and_validate_refuse_cuda_without_it(tmp_path, capsys, nothing_built):
    cuda = {**POINT, "model": {"preset": "tiny-llama", "device": "cuda"}}
    assert f"model.device: {NO_CUDA}" in _run_refused(tmp_path, capsys, cuda)
    experiment = json.loads(json.dumps(EXPERIMENT))
    experiment["profiles"]["h200"] = {"base": cuda, "grid": {"responses.length": [4]}}
    (tmp_path / "experiments").mkdir()
    path, out = _write(tmp_path / "experiments" / "demo.yaml", experiment), tmp_path / "p.json"
    err = _refused(capsys, ["point", path, "--profile", "h200", "--point", "length-4", "--out", str(out)], out)
    assert f"model.device: {NO_CUDA}" in err
    assert cli.main(["plan", "--profile", "h200", "--experiments", str(tmp_path / "experiments")]) == 0  # any machine
    assert capsys.readouterr().out.splitlines() == ["demo/length-4"]
    train = _write(
        tmp_path / "train.yaml",
        {
            "model": {"preset": "tiny-llama", "device": "cuda"},
            "task": {"name": "kv_retrieval", "length": 24},
            "output": {"dir": str(tmp_path / "run")},
        },
    )
    assert f"model.device: {NO_CUDA}" in _refused(capsys, ["train", train])
    pretrain = _write(tmp_path / "pretrain.yaml", {"model": "learn-tiny-dense", "device": "cuda", "steps": 1})
    assert f"pretrain.yaml: device: {NO_CUDA}" in _refused(capsys, ["pretrain", pretrain])
    validate, out = _write(tmp_path / "v.yaml", {**cuda, "validation": {"levels": ["V1"]}}), tmp_path / "v.json"
    assert f"model.device: {NO_CUDA}" in _refused(capsys, ["validate", validate, "--out", str(out)], out)


def test_a_cuda_index_beyond_the_device_count_is_refused(monkeypatch):
    from longstraw.models.checks import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    check_device("cuda:1", "model.device")
    with pytest.raises(ValueError, match=r"model.device: 'cuda:2', but this machine has 2 CUDA device\(s\)"):
        check_device("cuda:2", "model.device")


# ---- 8. the rest of the class: what the kinds, the trainer and pretraining would refuse only later


@pytest.mark.parametrize(
    "settings,message",
    [
        (
            {"model": {"path": "PATH", "overrides": {"num_hidden_layerz": 1}}},
            r"model.overrides.num_hidden_layerz: not a field of LlamaConfig \(did you mean 'num_hidden_layers'\?\)",
        ),
        (
            {"kind": "capacity", "capacity": {"min_length": 16, "max_length": 32}},
            r"capacity.ceiling_bytes: a capacity search on CPU needs an emulated memory ceiling",
        ),
        (
            {
                "kind": "capacity",
                "responses.probe_members": 1,
                "capacity": {"min_length": 16, "max_length": 32, "ceiling_bytes": 1 << 30},
            },
            r"responses.probe_members: for CUDA capacity searches",
        ),
        (
            {"responses.probe_members": 3},
            r"responses.probe_members: 3 members of a group of 2 \(grpo.num_generations\)",
        ),
        (
            {"responses.probe_members": 1, "mode": "hold_all"},
            r"responses.probe_members: a partial step is a memory probe",
        ),
        (
            {"capture.host_pages": True},
            r"capture.host_pages: 'llama' models keep no host-resident pages \(preset tiny-llama\)",
        ),
        (
            {"kind": "pretrain", "pretrain": {"model": "learn-tiny-dense", "steps": 1}},
            r"pretrain.out: the folder the checkpoint is written to",
        ),
        (
            {
                "kind": "pretrain",
                "pretrain": {"model": "learn-tiny-dense", "out": "OUT", "stages": [{"lengths": [28]}]},
            },
            r"pretrain.stages\[0\]: a stage is a mapping with an integer 'until'",
        ),
        (
            {
                "kind": "pretrain",
                "pretrain": {"model": "learn-tiny-dense", "out": "OUT", "model_overrides": {"vocab_size": 16}},
            },
            r"pretrain.task: vocab_size 16 is too small for the task's token layout .* at length 32",
        ),
        (
            {
                "kind": "pretrain",
                "pretrain": {
                    "model": "learn-tiny-dense",
                    "out": "OUT",
                    "eval_task": {"name": "kv_retrieval", "num_needle": 2},
                },
            },
            r"pretrain.eval_task.num_needle: unknown setting of this task",
        ),
        (
            {
                "responses": {
                    "length": 2,
                    "source": "rollouts",
                    "task": {"name": "kv_retrieval", "num_needles": 8},
                }
            },
            r"responses.task: length 16 cannot hold 8 needles .* "
            r"\(the task at length 16, against the vocabulary of 256",
        ),
        (
            {
                "kind": "length_curve",
                "length_curve": {
                    "lengths": [16, 64],
                    "task": {"name": "kv_retrieval", "num_needles": 4, "value_length": 2},
                },
            },
            r"length_curve.task: length 16 cannot hold 4 needles",
        ),
    ],
)
def test_the_plan_refuses_settings_a_point_would_refuse_only_after_building_its_model(
    tmp_path, checkpoint, settings, message
):
    def change(experiment):
        base = experiment["profiles"]["cpu"]["base"]
        base["prompt"]["length"], base["responses"], base["grpo"] = 16, {"length": 4}, {"num_generations": 2}
        for key, value in json.loads(json.dumps(settings).replace("PATH", str(checkpoint))).items():
            plan.set_dotted(base, key, value)

    with pytest.raises(ValueError, match=message) as raised:
        _plan_with(tmp_path, change)
    assert "demo.yaml [profile cpu, point length-4]" in str(raised.value)


def test_host_pages_with_context_parallelism_or_exact_gradients_are_refused(tmp_path):
    mla = {"preset": "tiny-deepseek_v3"}
    with pytest.raises(ValueError, match=r"capture.host_pages: not implemented for a context-parallel capture"):
        _plan_with(
            tmp_path, lambda e: e["profiles"]["cpu"]["base"].update(model=mla, cp_size=2, capture={"host_pages": True})
        )
    with pytest.raises(ValueError, match=r"capture.host_pages: cannot be combined with exact gradients"):
        _plan_with(
            tmp_path,
            lambda e: e["profiles"]["cpu"]["base"].update(
                model=mla, kind="validation", capture={"host_pages": True}, validation={"modes": ["exact"]}
            ),
        )
    planned = _plan_with(
        tmp_path, lambda e: e["profiles"]["cpu"]["base"].update(model=mla, capture={"host_pages": True})
    )
    assert planned["demo"]["points"]["length-4"]["config"].capture.host_pages  # the MLA family keeps host pages


@pytest.mark.parametrize(
    "setting,message",
    [
        ("model.overrides={vocab_size: 16}", "task: vocab_size 16 is too small for the task's token layout"),
        ("task.num_needles=9", "task: length 24 cannot hold 9 needles"),
        ("model.overrides={max_position_embeddings: 20}", "task.length: 24 positions, more than the 20"),
        (
            "model.overrides={max_position_embeddings: 25}",
            "sampling.max_new_tokens: 2 response tokens after a prompt of 24",
        ),
        ("model.overrides={num_layers: 1}", "model.overrides.num_layers: not a field of LlamaConfig"),
    ],
)
def test_train_refuses_a_task_or_policy_the_model_cannot_run_before_building_it(
    tmp_path, capsys, no_model_build, setting, message
):
    config = _train_config(tmp_path, model={"preset": "tiny-llama"})
    err = _refused(capsys, ["train", str(config), "--set", setting])
    assert f"train.yaml: {message}" in err


@pytest.mark.parametrize(
    "config,message",
    [
        (
            {"model_overrides": {"num_hidden_layer": 2}},
            "model_overrides.num_hidden_layer: not a field of LlamaConfig (did you mean 'num_hidden_layers'?)",
        ),
        ({"init": "INIT"}, "init: no checkpoint folder"),
        ({"task": {"name": "kv_retrieval", "num_needle": 2}}, "task.num_needle: unknown setting of this task"),
        ({"stages": [{"until": 10, "num_needle": 2}]}, "stages[0]: "),
        (
            {"lengths": [16], "task": {"name": "kv_retrieval", "num_needles": 8}},
            "task: length 16 cannot hold 8 needles",
        ),
    ],
)
def test_pretrain_refuses_its_inputs_before_any_work(tmp_path, capsys, nothing_built, config, message):
    raw = {
        "model": "learn-tiny-dense",
        "steps": 1,
        "eval_lengths": [32],
        "progress": False,
        **json.loads(json.dumps(config).replace("INIT", str(tmp_path / "no-such"))),
    }
    path = _write(tmp_path / "pretrain.yaml", raw)
    assert f"pretrain.yaml: {message}" in _refused(capsys, ["pretrain", path])
