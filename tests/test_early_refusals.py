"""Inputs refused before the model is built, through the CLI: one line naming the file and the key, exit 2, no
traceback and nothing written (RULER's tokenizer, what each family runs, typed values, a learning point's work
folder of another config, reserved experiment names, an empty point file); and a torn newest trainer checkpoint,
which a resumed run names and goes back past."""

import hashlib
import json
import shutil

import pytest
from test_refusals import _refused, _run_refused, _train_config, _write, nothing_built  # noqa: F401 (a fixture)

from longstraw import cli
from longstraw.config import point_mapping
from longstraw.harness import plan

# ---- RULER: its tokenizer is checked where the plan finds it, else before the point's model


def _byte_tokenizer(folder, chat: bool):
    """A byte-level tokenizer without merges (257 tokens: no hub, no training), saved to `folder`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    if chat:
        fast.chat_template = (
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
        )
    fast.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tokenizers")
    return {"plain": _byte_tokenizer(root / "plain", False), "chat": _byte_tokenizer(root / "chat", True)}


def _ruler_point(tokenizer, length: int = 512, **task) -> dict:
    """A learning point on RULER's niah_single_1 (its haystack is one repeated line: no data files)."""
    return {
        "kind": "learning",
        "model": {"preset": "tiny-llama", "overrides": {"vocab_size": 320}},
        "prompt": {"length": length},
        "responses": {"length": 2},
        "grpo": {"num_generations": 2},
        "learning": {
            "task": {"name": "ruler", "task": "niah_single_1", "tokenizer": tokenizer, **task},
            "steps": 2,
            "window": 2,
        },
    }


def _experiment(folder, base: dict, name: str = "demo") -> str:
    """An experiment file of one point (`default`) of kind step unless `base` says otherwise; its folder."""
    folder.mkdir(exist_ok=True)
    _write(
        folder / f"{name}.yaml",
        {"name": name, "title": "Demo", "kind": "step", "profiles": {"cpu": {"base": base}}},
    )
    return str(folder)


@pytest.mark.usefixtures("nothing_built")
def test_a_ruler_tokenizer_folder_that_is_not_there_is_refused(tmp_path, capsys):
    missing = str(tmp_path / "no-tokenizer")
    err = _run_refused(tmp_path, capsys, _ruler_point(missing))
    assert f"learning.task.tokenizer: no folder {missing}" in err
    train = _train_config(tmp_path, task={"name": "ruler", "task": "niah_single_1", "tokenizer": missing, "length": 99})
    assert f"task.tokenizer: no tokenizer folder {missing}" in _refused(capsys, ["train", str(train)])
    # a plan refuses it too, unless something it runs writes the folder (a real checkpoint's, built by the pipeline)
    err = _refused(capsys, ["plan", "--experiments", _experiment(tmp_path / "experiments", _ruler_point(missing))])
    assert f"[profile cpu, point default]: learning.task.tokenizer: no folder {missing}, and nothing the plan" in err
    real = str(tmp_path / "checkpoints" / "smollm2-135m-instruct")
    assert cli.main(["plan", "--experiments", _experiment(tmp_path / "planned", _ruler_point(real))]) == 0


@pytest.mark.parametrize(
    "task,length,message",
    [
        ({"chat": False}, 20, "prompt.length: 20 tokens is too short: the template and needles alone take "),
        ({}, 512, "learning.task.chat: true, but the tokenizer in {plain} has no chat template; set chat: false"),
    ],
    ids=["too-short", "no-chat-template"],
)
@pytest.mark.usefixtures("nothing_built")
def test_what_a_ruler_task_needs_of_its_tokenizer_is_refused_when_the_plan_is_made(
    tmp_path, capsys, tokenizers, task, length, message
):
    point = _ruler_point(tokenizers["plain"], length, **task)
    expected = message.format(**tokenizers)
    assert expected in _run_refused(tmp_path, capsys, point)
    assert expected in _refused(capsys, ["plan", "--experiments", _experiment(tmp_path / "experiments", point)])
    # the same task with what it lacked runs past every check (so the refusal is about that alone)
    fixed = _ruler_point(tokenizers["chat"], 512, **task)
    assert cli.main(["plan", "--experiments", _experiment(tmp_path / "fixed", fixed)]) == 0


@pytest.mark.usefixtures("nothing_built")
def test_a_ruler_tokenizer_written_after_the_plan_is_checked_before_the_points_model(tmp_path, tokenizers):
    from longstraw.harness.inputs import check_ready

    folder = tmp_path / "tokenizer"
    cfg = plan.resolve(_ruler_point(str(folder), 20, chat=False), "point.yaml")  # not there yet: left for later
    shutil.copytree(tokenizers["plain"], folder)
    with pytest.raises(ValueError, match=r"^point.yaml: prompt.length: 20 tokens is too short"):
        check_ready(cfg, "point.yaml")


# ---- what each family runs (`families.support`), refused when the plan is made


@pytest.mark.parametrize(
    "base,message",
    [
        (
            {"model": {"preset": "tiny-gemma3"}, "cp_size": 2},
            "cp_size: 2: gemma3 models have no context-parallel capture (its sliding-window layers' WindowKV",
        ),
        ({"model": {"preset": "tiny-gpt-oss"}, "cp_size": 2}, "cp_size: 2: gpt_oss models have no context-parallel"),
        (
            {"model": {"preset": "tiny-gemma3", "overrides": {"attn_logit_softcapping": 50.0}}},
            "model.overrides.attn_logit_softcapping: attn_logit_softcapping=50.0 is set, but HF's Gemma3Attention",
        ),
        (
            {
                "model": {
                    "preset": "tiny-gpt-oss",
                    "overrides": {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}},
                }
            },
            "model.overrides.rope_parameters: rope_type 'dynamic' sets its frequencies from the longest position",
        ),
        (
            {"model": {"preset": "tiny-gpt-oss", "dtype": "float64"}},
            "model.dtype: float64: gpt_oss models do not run in it (its routed experts run torch's grouped_mm",
        ),
        (
            {"model": {"preset": "tiny-qwen3_5_moe", "dtype": "float64"}},
            "model.dtype: float64: qwen3_5_moe models do not run in it",
        ),
    ],
    ids=["cp-gemma3", "cp-gpt-oss", "softcapping-gemma3", "dynamic-rope-gpt-oss", "float64-gpt-oss", "float64-moe"],
)
@pytest.mark.usefixtures("nothing_built")
def test_what_a_family_does_not_run_is_refused_by_the_plan(tmp_path, capsys, base, message):
    point = {**base, "prompt": {"length": 16}, "responses": {"length": 2}}
    experiments = _experiment(tmp_path / "experiments", point)
    assert f"demo.yaml [profile cpu, point default]: {message}" in _refused(
        capsys, ["plan", "--experiments", experiments]
    )
    assert message in _run_refused(tmp_path, capsys, point)


@pytest.mark.parametrize(
    "base",
    [
        {"model": {"preset": "tiny-llama"}, "cp_size": 2},
        {"model": {"preset": "tiny-qwen3_5", "dtype": "float64"}},
        {"model": {"preset": "tiny-gemma3", "dtype": "float64", "overrides": {"attn_logit_softcapping": None}}},
        {"model": {"preset": "tiny-gpt-oss", "overrides": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}}},
    ],
    ids=["cp-llama", "float64-dense-hybrid", "float64-gemma3", "yarn-gpt-oss"],
)
def test_what_a_family_runs_passes_the_plan(tmp_path, capsys, base):
    assert cli.main(["plan", "--experiments", _experiment(tmp_path / "experiments", base)]) == 0
    assert capsys.readouterr().out.splitlines() == ["demo/default"]


def test_each_familys_declaration_covers_the_model_types_its_adapters_run():
    import importlib

    from longstraw.families import FamilyAdapter, support, supported_model_types
    from longstraw.models.presets import MODEL_CLASSES

    for family, supports in support.FAMILIES.items():
        module = importlib.import_module(f"longstraw.families.{family}")
        adapters = [c for c in vars(module).values() if isinstance(c, type) and issubclass(c, FamilyAdapter)]
        runs = {t for c in adapters if c.__module__ == module.__name__ for t in c.model_types}
        declared = {t for s in supports for t in s.model_types}
        assert runs <= declared and not (declared - runs) & set(supported_model_types()), family
    assert set(support.SUPPORT) == set(supported_model_types()) | set(MODEL_CLASSES)  # presets' names too


# ---- typed values: the allowed ones in words; what ran is recorded


@pytest.mark.parametrize("value", ["0", "-1", "fast", "2.5"])
@pytest.mark.usefixtures("nothing_built")
def test_a_micro_batch_that_is_not_one_says_what_is_allowed(tmp_path, capsys, value):
    point = {"model": {"preset": "tiny-llama"}, "prompt": {"length": 16}, "responses": {"length": 2}}
    err = _run_refused(tmp_path, capsys, point, "--set", f"replay.micro_batch={value}")
    shown = {"fast": "'fast'"}.get(value, value)
    assert f"point.yaml: replay.micro_batch: must be an integer >= 1 or 'auto', got {shown}\n" in err


def test_a_micro_batch_larger_than_the_group_is_recorded_as_the_batch_that_ran():
    import torch

    from longstraw.config import GRPOConfig
    from longstraw.core.step import StepOptions, grpo_step
    from longstraw.models import build_model

    model = build_model("tiny-llama")
    responses = [torch.tensor([3, 4]), torch.tensor([5, 6]), torch.tensor([7, 8])]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = grpo_step(
        model,
        torch.arange(12),
        responses,
        [0.0, 1.0, 0.5],
        optimizer,
        GRPOConfig(num_generations=3),
        StepOptions(micro_batch=8),
    )
    assert step.metrics["phases"]["replay"].get("count", 1) == 1  # the three members replayed as one batch
    assert step.metrics["micro_batch"] == 3


# ---- a learning point run again with another config over its work folder


def _tree(folder) -> dict:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*") if p.is_file()
    }


@pytest.mark.usefixtures("nothing_built")
def test_a_learning_point_of_another_config_leaves_the_work_folder_as_it_was(tmp_path, capsys):
    point = {
        "kind": "learning",
        "model": {"preset": "tiny-llama", "overrides": {"vocab_size": 96}},
        "prompt": {"length": 24},
        "responses": {"length": 2},
        "grpo": {"num_generations": 2},
        "learning": {"task": {"name": "kv_retrieval"}, "steps": 3, "window": 2},
    }
    work = tmp_path / "r.json.work"  # what a cut-off command left: its runs' checkpoints and its config
    (work / "lr0" / "checkpoints" / "step-2").mkdir(parents=True)
    (work / "lr0" / "checkpoints" / "step-2" / "trainer.pt").write_bytes(b"a checkpoint")
    recorded = plan.resolve({**point, "learning": {**point["learning"], "steps": 4}}, "earlier")
    (work / "config.json").write_text(json.dumps(point_mapping(recorded), sort_keys=True))
    before = _tree(work)
    err = _run_refused(tmp_path, capsys, point)
    assert (
        f"point.yaml: learning.steps: {work} holds the runs of another config of this point (learning.steps: 4 there"
        in err
    )
    assert _tree(work) == before


# ---- reserved names, empty files


@pytest.mark.usefixtures("nothing_built")
def test_an_experiment_named_after_a_report_table_is_refused_when_the_plan_is_made(tmp_path, capsys):
    experiments = _experiment(tmp_path / "experiments", {"model": {"preset": "tiny-llama"}}, name="files")
    err = _refused(capsys, ["plan", "--experiments", experiments])
    assert "files.yaml: name: 'files' is the name of a table every report has" in err


@pytest.mark.parametrize("text", ["", "# nothing set yet\n", "null\n"])
@pytest.mark.usefixtures("nothing_built")
def test_an_empty_point_file_is_refused(tmp_path, capsys, text):
    assert "point.yaml: <top level>: empty; a point config names at least its model" in _run_refused(
        tmp_path, capsys, text
    )


# ---- a torn newest checkpoint: named, left in place, the one before it resumed


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A two-step `longstraw train` run with a checkpoint after each step, and its records."""
    root = tmp_path_factory.mktemp("trained")
    assert cli.main(["train", str(_train_config(root))]) == 0
    return root / "run"


def _records(run) -> list[dict]:
    keys = ("step", "prompt", "rewards", "loss", "grad_norm")
    return [{k: r[k] for k in keys} for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def _tear(file) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def test_a_torn_newest_checkpoint_is_named_and_training_resumes_from_the_one_before(tmp_path, capsys, trained):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    torn = run / "checkpoints" / "step-2" / "trainer.pt"
    _tear(torn)
    assert cli.main(["train", str(_train_config(tmp_path))]) == 0
    err = capsys.readouterr().err
    assert f"longstraw: {torn} (RuntimeError: " in err and "unreadable, left in place; resuming from step 1's" in err
    assert _records(run) == _records(trained)  # step 1 again, as the uninterrupted run took it (CPU)


def test_no_checkpoint_that_reads_is_an_error_naming_each(tmp_path, capsys, trained):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    for step in (1, 2):
        _tear(run / "checkpoints" / f"step-{step}" / "trainer.pt")
    before = _tree(run)
    assert cli.main(["train", str(_train_config(tmp_path))]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert f"{run}: no checkpoint reads: {run}/checkpoints/step-2/trainer.pt (RuntimeError" in err
    assert f"; {run}/checkpoints/step-1/trainer.pt (" in err and "start over with --no-resume" in err
    assert _tree(run) == before


def test_a_learning_point_goes_on_from_the_checkpoint_before_a_torn_one(tmp_path, capsys, monkeypatch):
    from longstraw.harness.runner import run_point
    from longstraw.kinds import learning
    from longstraw.training.trainer import Trainer

    point = {
        "name": "v4",
        "kind": "learning",
        "model": {"preset": "tiny-llama", "overrides": {"vocab_size": 96}},
        "prompt": {"length": 24},
        "responses": {"length": 2},
        "grpo": {"num_generations": 2, "beta": 0.0},
        "optimizer": {"lr": 1e-2},
        "learning": {"task": {"name": "kv_retrieval"}, "steps": 2, "window": 2, "temperature": 10.0},
    }
    monkeypatch.setattr(learning, "RESUME_EVERY", 1)
    original, calls = Trainer.train_step, []

    def cut_at_the_third_step(self, step):  # the trained run whole (checkpoints at steps 1 and 2), lr0 cut
        calls.append(step)
        if len(calls) == 3:
            raise RuntimeError("cut off")
        return original(self, step)

    monkeypatch.setattr(Trainer, "train_step", cut_at_the_third_step)
    work = tmp_path / "point.json.work"
    assert run_point(point, work_dir=work)["status"] == "error"
    trained = work / "response-only"
    first = _records(trained)
    torn = trained / "checkpoints" / "step-2" / "trainer.pt"
    _tear(torn)
    again = run_point(point, work_dir=work)
    assert again["status"] == "ok", again.get("error")
    assert f"{torn} (RuntimeError: " in capsys.readouterr().err
    assert again["metrics"]["resumed_at"] == {"response-only": 1, "lr0": 0}
    assert calls[3:] == [1, 0, 1]  # step 1 again, from step 1's checkpoint; lr0 whole
    assert _records(trained) == first  # as the first command took it (CPU)
