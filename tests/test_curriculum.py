"""A length curriculum (`learning.curriculum`) on CPU through the CLI, with experiments/examples/curriculum_cpu.yaml:
each stage's runs (the lr-0 control too) load the adapter the stage before saved, a command cut off mid-curriculum
and run again does not redo a finished stage, the stages' gains are the paired statistic of their own recorded
rewards, each eval task's held-out curves are the length curve's own of the stage's adapter and of the base model,
and the report draws them; and bad stage settings are refused when the plan is made, naming the file and the key."""

import hashlib
import json
import statistics
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from test_learning import _EvenShare as EvenShare

from longstraw import cli
from longstraw.training.improvement import paired_gain, per_prompt_means

EXAMPLE = Path(__file__).parents[1] / "experiments" / "examples" / "curriculum_cpu.yaml"


class _FirstToken:
    """The counting task's prompts, rewarded by the id of the response's first token (a fingerprint of a greedy
    answer: two models that answer differently score differently)."""

    def __init__(self, vocab_size, **settings):
        from longstraw.training.tasks import Counting

        self.inner, self.vocab = Counting(vocab_size, **settings), vocab_size

    def make(self, seed):
        return self.inner.make(seed)

    def reward(self, example, response_ids):
        return int(response_ids[0]) / self.vocab


FIRST_TOKEN = {"name": "curriculum_first_token", "min_count": 0, "max_count": 3}


def _lora_weights(model) -> dict:
    """The model's LoRA weights under the names peft saves them by (no adapter name)."""
    return {n.replace(".default", ""): p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}


def test_a_curriculum_carries_each_stages_adapter_and_a_rerun_skips_finished_stages(tmp_path, monkeypatch):
    from longstraw.kinds import learning_curriculum
    from longstraw.models import lora
    from longstraw.training.tasks import register_task
    from longstraw.training.trainer import Trainer

    register_task("curriculum_even_share", EvenShare)  # test_learning's: a dense reward on counting prompts
    register_task("curriculum_first_token", _FirstToken)
    loads, steps, cut = [], [], []
    load = lora.load_adapter_weights

    def spy_load(model, path):
        load(model, path)
        loads.append((path, _lora_weights(model)))

    step = Trainer.train_step

    def spy_step(self, index):
        steps.append(self.out.parent.name)  # the stage folder of the run taking the step
        if steps.count("stage-1") == 3 and not cut:  # stage 1's second run, mid-way: the command is cut off
            cut.append(index)
            raise RuntimeError("cut off")
        return step(self, index)

    finals = _final_weights(monkeypatch, _lora_weights)
    monkeypatch.setattr(lora, "load_adapter_weights", spy_load)
    monkeypatch.setattr(Trainer, "train_step", spy_step)
    evaluated, load_trained = [], lora.load_adapter  # the adapters the held-out curves are measured with
    monkeypatch.setattr(lora, "load_adapter", lambda model, path: evaluated.append(path) or load_trained(model, path))
    out = tmp_path / "curriculum.json"
    kept = tmp_path / "adapters"
    args = ["run", str(EXAMPLE), "--out", str(out), "--set", "learning.task.name=curriculum_even_share"]
    args += ["--set", f"learning.curriculum.out={kept}"]
    eval_tasks = yaml.safe_load(EXAMPLE.read_text())["learning"]["curriculum"]["eval_tasks"] + [FIRST_TOKEN]
    args += ["--set", f"learning.curriculum.eval_tasks={json.dumps(eval_tasks)}"]
    assert cli.main(args) == 1
    stage_0 = tmp_path / "curriculum.json.work" / "stage-0" / learning_curriculum.STAGE_RECORD
    first_record = stage_0.read_text()
    assert steps.count("stage-0") == 6  # 3 runs of 2 steps
    assert json.loads(out.read_text())["status"] == "error"  # the point is not finished

    steps.clear()
    assert cli.main(args) == 0
    assert "stage-0" not in steps and steps.count("stage-1") == 6 - 2  # stage 0 not redone; stage 1's first run kept
    result = json.loads(out.read_text())
    assert result["status"] == "ok"
    stages = result["metrics"]["stages"]
    assert json.loads(first_record) == stages[0]

    # stage 1 started every run, the lr-0 control and its probe from the adapter stage 0 saved: its weights as the
    # file holds them, its sha256 the file's
    saved = stages[0]["adapter"]
    assert stages[0]["start_adapter"] is None and stages[1]["start_adapter"] == saved
    assert saved["path"] == str(kept / "stage-0" / "adapter") and not out.with_name(out.name + ".work").exists()
    file = Path(saved["path"]) / "adapter_model.safetensors"
    assert saved["sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    on_disk = {k.replace("base_model.model.", "", 1): v for k, v in load_file(str(file)).items()}
    stage_1_loads = [w for path, w in loads if path == saved["path"]]
    assert len(stage_1_loads) == len(loads) >= 3  # stage 1's probe and runs, in both commands
    for weights in stage_1_loads:
        assert {k.replace("base_model.model.", "", 1): v for k, v in weights.items()}.keys() == on_disk.keys()
        assert all(torch.equal(weights[f"base_model.model.{k}"], v) for k, v in on_disk.items())

    # the lr-0 control ends where it started (stage 0's adapter); the trained runs moved it
    # the lr-0 control of stage 1 ends where it started (stage 0's adapter); its trained runs moved it
    assert all(torch.equal(finals[("stage-1", "lr0")][f"base_model.model.{k}"], v) for k, v in on_disk.items())
    moved = finals[("stage-1", "response-only")]
    assert not all(torch.equal(moved[f"base_model.model.{k}"], v) for k, v in on_disk.items())

    for stage in stages:
        runs = stage["runs"]
        for name in ("response-only", "exact"):
            expected = paired_gain(per_prompt_means(runs[name], 0), per_prompt_means(runs["lr0"], 0))
            assert stage["gains"][name] == pytest.approx(expected)
        assert [r["length"] for r in stage["heldout"]["rows"]] == [64, 128][: stage["stage"] + 1]
        assert len(stage["heldout"]["base_rows"]) == len(stage["heldout"]["rows"])
    assert [s["length"] for s in stages] == [64, 128]
    assert stages[1]["overrides"]["rope_parameters"]["factor"] == 2.0
    # stage 1 sets its own group size (6), stage 0 takes grpo.num_generations (4): every step of every run rewards
    # that many rollouts
    assert [s["num_generations"] for s in stages] == [4, 6]
    for stage, group in zip(stages, (4, 6)):
        assert {len(r["rewards"]) for run in stage["runs"].values() for r in run} == {group}
    # each stage's curves (the training task's, then each eval task's) with the adapter the stage carried on
    assert evaluated == [stages[0]["adapter"]["path"]] * 3 + [stages[1]["adapter"]["path"]] * 3
    _check_eval_curves(stages, eval_tasks)

    # the row: the stages in a cell, the longest trained stage's gains in the gain columns (none reached V4 here), and
    # one row per stage in the stages table, each naming the adapter it started from
    from longstraw.kinds import learning

    row = learning.columns(result)
    assert row["trained_length"] == 128 and row["response-only_gain"] == stages[1]["gains"]["response-only"]["gain"]
    assert row["G"] == 6  # the shown stage's group, not grpo.num_generations (4)
    assert row["exact_gain_se"] == stages[1]["gains"]["exact"]["standard_error"]
    cell = [part.split(": ", 1) for part in row["curriculum"].split("; ")]
    assert [length for length, _ in cell] == ["64", "128"]
    assert all("response-only " in gains_ and "exact " in gains_ for _, gains_ in cell)
    table = learning.tables([{**result, "kind": "learning", "point": "c"}])["stages"]
    assert [(r["stage"], r["length"], r["rope"]) for r in table] == [(0, 64, "native"), (1, 128, "yarn x2.0")]
    assert table[0]["start_adapter"] == "model.lora" and saved["sha256"][:12] in table[1]["start_adapter"]
    # the exact-minus-response-only gap of each stage, by hand: the two trained runs' per-prompt mean rewards over
    # the stage's last window (one prompt a step), their mean difference and its standard error (sample sd / sqrt n)
    for stage, r in zip(stages, table):
        window = [
            (e, o)
            for e, o in zip(stage["runs"]["exact"], stage["runs"]["response-only"])
            if e["step"] >= stage["steps"] - stage["window"]
        ]
        d = [statistics.fmean(e["rewards"]) - statistics.fmean(o["rewards"]) for e, o in window]
        assert r["exact_minus_response_only"] == pytest.approx(statistics.fmean(d), abs=1e-12)
        assert r["exact_minus_response_only_se"] == pytest.approx(statistics.stdev(d) / len(d) ** 0.5, abs=1e-12)
        seconds = [s["seconds"] for s in stage["runs"]["response-only"][1:]]
        assert r["step_seconds"] == pytest.approx(statistics.median(seconds))
        # held-out against the start: the probe scored the starting policy on the held-out curve's own examples
        assert stage["probe"]["seed_base"] == stage["heldout"]["seed_base"]
        probed = next(x for x in stage["probe"]["rows"] if x["length"] == stage["length"])["rewards"]
        after = next(x for x in stage["heldout"]["rows"] if x["length"] == stage["length"])["rewards"]
        pairs = list(zip(probed, after))
        gained, lost = pairs.count((0.0, 1.0)), pairs.count((1.0, 0.0))
        assert r["heldout_vs_start"].startswith(f"+{gained} -{lost} of {len(pairs)} (p ")
        # each eval task's success at the stage's length (its last row), with the adapter and without
        at = [(c["label"], c["rows"][-1]["success"], c["base_rows"][-1]["success"]) for c in stage["heldout_tasks"]]
        assert r["heldout_eval_tasks"] == "; ".join(f"{label}: {a:.2f} (base {b:.2f})" for label, a, b in at)
    _check_heldout_figure({**result, "kind": "learning", "point": "c", "experiment": "demo"}, tmp_path / "tables")


def test_a_stage_the_policy_already_reads_is_skipped_with_its_adapter_carried_on(tmp_path, monkeypatch):
    """A stage whose probe finds the starting policy above the probe's range does not train and hands the adapter it
    started from to the next stage, which probes and trains from it; a stage below the range ends the curriculum."""
    from longstraw.kinds import learning, learning_curriculum
    from longstraw.training.trainer import Trainer

    probed, trained, success = [], [], {}

    def fake_probe(cfg, progress, lengths):  # the probe's record, its success set per length by the test
        (length,) = lengths
        probed.append((length, cfg.model.lora.init))
        low, high = cfg.learning.probe.success
        s = success[length]
        rows = [{"length": length, "success": s}]
        return {"rows": rows, "range": [low, high], "chosen_length": length if low <= s <= high else None}

    step = Trainer.train_step

    def spy_step(self, index):
        trained.append(self.out.parent.name)
        return step(self, index)

    monkeypatch.setattr(learning_curriculum, "probe_lengths", fake_probe)
    monkeypatch.setattr(Trainer, "train_step", spy_step)
    yarn = {"max_position_embeddings": 160, "rope_parameters": {"rope_type": "yarn", "factor": 2.0,
            "original_max_position_embeddings": 80, "rope_theta": 10000.0}}  # fmt: skip
    stages = [{"length": 64, "steps": 2}] + [{"length": n, "steps": 2, "overrides": yarn} for n in (96, 128)]

    def run(name: str) -> list[dict]:
        changes = ["learning.probe.success=[0.1, 0.9]", f"learning.curriculum.stages={json.dumps(stages)}"]
        changes += ["learning.curriculum.eval_tasks=[]", "learning.gradients=[response-only]"]
        args = ["run", str(EXAMPLE), "--out", str(tmp_path / f"{name}.json")]
        assert cli.main(args + [arg for change in changes for arg in ("--set", change)]) == 0
        return json.loads((tmp_path / f"{name}.json").read_text())

    success.update({64: 0.5, 96: 0.95, 128: 0.5})
    result = run("skipped")
    done = result["metrics"]["stages"]
    assert [s["length"] for s in done] == [64, 96, 128]
    assert done[1]["skipped"] == "probe success 0.95 above the range's 0.9" and "runs" not in done[1]
    assert done[1]["start_adapter"] == done[1]["adapter"] == done[2]["start_adapter"] == done[0]["adapter"]
    assert probed == [(64, None), (96, done[0]["adapter"]["path"]), (128, done[0]["adapter"]["path"])]
    assert sorted(set(trained)) == ["stage-0", "stage-2"] and trained.count("stage-2") == 4  # 2 runs of 2 steps
    columns = learning.columns(result)
    assert "96: skipped, its adapter carried on" in columns["curriculum"]
    assert "96: 0.95 -> above the range: skipped; 128: 0.50 -> trained at 128" in columns["probe"]

    probed.clear()
    success.update({96: 0.05})
    result = run("stopped")
    done = result["metrics"]["stages"]
    assert [(s["length"], s["adapter"], s.get("skipped")) for s in done[1:]] == [(96, None, None)]
    assert learning.columns(result)["probe"].endswith("96: 0.05 -> none in range: not trained")
    assert [length for length, _ in probed] == [64, 96]


def _weights(model) -> dict:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _final_weights(monkeypatch, weights_of) -> dict:
    """{(stage folder, run name): `weights_of(model)` as each trainer run ended}, filled as the runs end."""
    from longstraw.training.trainer import Trainer

    finals, whole_run = {}, Trainer.run

    def spy_run(self, *args, **kwargs):
        records = whole_run(self, *args, **kwargs)
        finals[(self.out.parent.name, self.out.name)] = weights_of(self.model)
        return records

    monkeypatch.setattr(Trainer, "run", spy_run)
    return finals


def test_without_lora_a_curriculum_carries_the_whole_models_trained_weights(tmp_path, monkeypatch):
    """Without model.lora (full-parameter training, as the synthetic model's points train) a stage's runs, the lr-0
    control too, start from the whole model the stage before trained, as HF's own `from_pretrained` reads the folder
    kept for it; its held-out curve is the length curve's own of that model beside the model the point started from."""
    from transformers import AutoModelForCausalLM

    from longstraw.kinds import learning
    from longstraw.training.tasks import register_task
    from longstraw.training.trainer import Trainer

    register_task("curriculum_even_share", EvenShare)  # a dense reward: the trained run's weights move
    starts, init, finals = {}, Trainer.__init__, _final_weights(monkeypatch, _weights)

    def spy_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        starts[(self.out.parent.name, self.out.name)] = _weights(self.model)

    monkeypatch.setattr(Trainer, "__init__", spy_init)
    out, kept = tmp_path / "weights.json", tmp_path / "kept"
    changes = ["model.lora=null", "learning.task.name=curriculum_even_share", f"learning.curriculum.out={kept}"]
    changes += ["learning.curriculum.eval_tasks=[]", "learning.gradients=[response-only]"]
    assert cli.main(["run", str(EXAMPLE), "--out", str(out)] + [a for c in changes for a in ("--set", c)]) == 0
    result = json.loads(out.read_text())
    stages = result["metrics"]["stages"]
    example = yaml.safe_load(EXAMPLE.read_text())
    start = _weights(_example_model(example, {}))

    saved = [s["adapter"] for s in stages]
    assert [s["carries"] for s in stages] == ["weights", "weights"]
    assert stages[0]["start_adapter"] is None and stages[1]["start_adapter"] == saved[0]
    lr = example["optimizer"]["lr"]  # each stage's runs: the point's rate (lr 0 for the control), no weight decay
    assert [{n: (o["lr"], o["weight_decay"]) for n, o in s["run_optimizer"].items()} for s in stages] == [
        {"response-only": (lr, 0.0), "lr0": (0.0, 0.0)}
    ] * 2
    assert [a["path"] for a in saved] == [str(kept / f"stage-{i}" / "model") for i in (0, 1)]
    for adapter in saved:
        file = Path(adapter["path"]) / "model.safetensors"
        assert adapter["sha256"] == hashlib.sha256(file.read_bytes()).hexdigest()
    read = [_weights(AutoModelForCausalLM.from_pretrained(a["path"], dtype=torch.float32)) for a in saved]
    for stage, before in enumerate((start, read[0])):
        for name in ("response-only", "lr0"):  # every run of a stage starts from the policy the stage before left
            assert starts[(f"stage-{stage}", name)].keys() == before.keys()
            assert all(torch.equal(starts[(f"stage-{stage}", name)][k], v) for k, v in before.items())
        # the folder holds the trained run's last weights; they moved; the lr-0 control's did not
        assert all(torch.equal(finals[(f"stage-{stage}", "response-only")][k], v) for k, v in read[stage].items())
        assert not all(torch.equal(read[stage][k], v) for k, v in before.items())
        assert all(torch.equal(finals[(f"stage-{stage}", "lr0")][k], v) for k, v in before.items())

    # held-out: the trained model's curve beside the untrained model's, each the length curve's own on its model
    curriculum = example["learning"]["curriculum"]
    for stage, setting in zip(stages, curriculum["stages"]):
        lengths = [s["length"] for s in curriculum["stages"][: stage["stage"] + 1]]
        overrides = setting.get("overrides", {})
        trained = _example_model(example, overrides, path=stage["adapter"]["path"])
        for recorded, model in ((stage["heldout"]["rows"], trained), (stage["heldout"]["base_rows"], None)):
            direct = _curve_rows(example, model or _example_model(example, overrides), lengths)
            keys = ("length", "depth", "n", "success", "stderr", "rewards")
            assert [{k: r[k] for k in keys} for r in recorded] == [{k: r[k] for k in keys} for r in direct]
    table = learning.tables([{**result, "kind": "learning", "point": "w"}])["stages"]
    assert table[0]["start_adapter"] == "model.path" and saved[0]["sha256"][:12] in table[1]["start_adapter"]


def _example_model(example: dict, overrides: dict, path: str | None = None):
    """The example's model with the stage's `overrides`: its preset's weights, or those saved at `path`."""
    from longstraw.config.sections import ModelConfig
    from longstraw.models.policy import build_policy

    settings = example["model"]
    merged = {**settings["overrides"], **overrides}
    return build_policy(ModelConfig(preset=settings["preset"], path=path, dtype=settings["dtype"], overrides=merged))


def _curve_rows(example: dict, model, lengths: list[int]) -> list[dict]:
    """The length curve's rows (`training.length_curve`) of `model` on the training task, the curriculum's examples."""
    from longstraw.config.sections import CaptureConfig
    from longstraw.training.length_curve import length_curve

    spec = {**example["learning"]["task"], "name": "curriculum_even_share"}
    examples = example["learning"]["curriculum"]["eval_examples"]
    return length_curve(model, spec, lengths, None, examples, chunk_size=CaptureConfig().chunk_size, progress=False)[
        "rows"
    ]


def _check_eval_curves(stages: list[dict], eval_tasks: list[dict]) -> None:
    """Each stage's curves of each eval task are the length curve's own (`training.length_curve`, called here on a
    model built from the example's settings, the stage's saved adapter loaded): the base model's on the plain model,
    the adapter's on it with the adapter; the same lengths, the same examples, each example's reward."""
    example = yaml.safe_load(EXAMPLE.read_text())
    curriculum = example["learning"]["curriculum"]
    keys = ("length", "depth", "n", "success", "stderr", "rewards")
    for stage, setting in zip(stages, curriculum["stages"]):
        lengths = [s["length"] for s in curriculum["stages"][: stage["stage"] + 1]]
        assert [c["label"] for c in stage["heldout_tasks"]] == ["kv_retrieval", "curriculum_first_token"]
        assert [c["task"] for c in stage["heldout_tasks"]] == eval_tasks
        direct = _direct_curves(example, setting, eval_tasks, lengths, stage["adapter"]["path"])
        for recorded, (with_adapter, base) in zip(stage["heldout_tasks"], direct):
            for mine, theirs in ((recorded["rows"], with_adapter), (recorded["base_rows"], base)):
                assert [{k: r[k] for k in keys} for r in mine] == [{k: r[k] for k in keys} for r in theirs]
                assert [r["length"] for r in mine] == lengths


def _direct_curves(example: dict, stage: dict, specs: list[dict], lengths: list[int], adapter: str) -> list:
    """[(with the adapter, without it)] per task of `specs`: the length curve's rows of the example's model with the
    stage's overrides."""
    from longstraw.config.sections import CaptureConfig, ModelConfig
    from longstraw.models.lora import load_adapter
    from longstraw.models.policy import build_policy
    from longstraw.training.length_curve import length_curve

    settings = example["model"]
    overrides = {**settings["overrides"], **stage.get("overrides", {})}
    model = build_policy(ModelConfig(preset=settings["preset"], dtype=settings["dtype"], overrides=overrides))
    examples = example["learning"]["curriculum"]["eval_examples"]
    kwargs = {"chunk_size": CaptureConfig().chunk_size, "progress": False}
    base = [length_curve(model, spec, lengths, None, examples, **kwargs)["rows"] for spec in specs]
    model = load_adapter(model, adapter)
    return [(length_curve(model, spec, lengths, None, examples, **kwargs)["rows"], b) for spec, b in zip(specs, base)]


def _check_heldout_figure(point: dict, folder: Path) -> None:
    """Through the report's tables (CSV and back): one panel per task, the trained one first, each with a line for
    the base model and one per stage's adapter, at the stage lengths so far."""
    from longstraw.kinds import learning
    from longstraw.plotting import draw
    from longstraw.report.aggregate import kind_tables, tables
    from longstraw.report.figures import experiment_data
    from longstraw.report.store import read_tables, write_tables

    write_tables({**tables([point]), **kind_tables([point])}, folder, {})
    figures = dict(learning.figures(experiment_data(read_tables(folder), "demo"), {}, ()))
    assert "heldout_by_stage" in learning.CAPTIONS
    panels = [ax for ax in figures["heldout_by_stage"].axes if ax.get_visible()]
    titles = [ax.get_title() for ax in panels]
    assert titles == [
        "c\ncurriculum_even_share (trained on)",
        "c\nkv_retrieval (eval task)",
        "c\ncurriculum_first_token (eval task)",
    ]
    lengths = {"base model (stage 1's RoPE)": [64, 128], "stage 0 adapter (trained at 64)": [64]}
    lengths["stage 1 adapter (trained at 128)"] = [64, 128]
    last = point["metrics"]["stages"][-1]
    for ax, curve in zip(panels, [last["heldout"], *last["heldout_tasks"]]):
        lines = {c.get_label(): c.lines[0] for c in ax.containers}
        assert list(lines) == list(lengths)
        for label, line in lines.items():  # each line beside the others at its lengths, within 5% of each
            assert line.get_xdata().tolist() == pytest.approx(lengths[label], rel=0.05)
        drawn = [lines["stage 1 adapter (trained at 128)"], lines["base model (stage 1's RoPE)"]]
        assert [d.get_ydata().tolist() for d in drawn] == [
            [r["success"] for r in curve[k]] for k in ("rows", "base_rows")
        ]
        assert ax.get_xscale() == "log" and [t.get_text() for t in ax.get_xticklabels()] == ["64", "128"]
    assert draw.layout_problems(figures["heldout_by_stage"]) == []  # what the report's PNG would say does not fit
    for fig in figures.values():
        draw.plt.close(fig)


def _experiment(folder: Path, change) -> str:
    """An experiment file whose one cpu point is the CPU example with `change` applied to its point mapping."""
    point = yaml.safe_load(EXAMPLE.read_text())
    point.pop("name")
    change(point)
    folder.mkdir()
    experiment = {"name": "demo", "title": "Demo", "kind": "learning", "profiles": {"cpu": {"base": point}}}
    (folder / "demo.yaml").write_text(yaml.safe_dump(experiment))
    return str(folder)


def _stages(point):
    return point["learning"]["curriculum"]["stages"]


@pytest.mark.parametrize(
    "change,message",
    [
        (
            lambda p: _stages(p).reverse(),
            "learning.curriculum.stages: stages[1].length 64 is not longer than stages[0].length 128",
        ),
        (lambda p: p["learning"]["task"].update(name="bogus"), "learning.task: unknown task 'bogus'"),
        (
            lambda p: _stages(p)[1].pop("overrides"),
            "learning.curriculum.stages[1].length: 128 positions, more than the 80 the model was configured for",
        ),
        (lambda p: _stages(p)[1].update(num_generations=0), "learning.curriculum.stages[1].num_generations"),
        (lambda p: p["learning"]["probe"].update(lengths=[64]), "learning.probe: lengths: a curriculum probes"),
        (
            lambda p: p["learning"]["curriculum"]["eval_tasks"][0].update(name="bogus"),
            "learning.curriculum.eval_tasks[0]: unknown task 'bogus'",
        ),
        (
            lambda p: p["learning"]["curriculum"]["eval_tasks"].append({"name": "kv_retrieval", "num_needles": 3}),
            "learning.curriculum: eval_tasks[1]: 'kv_retrieval' is the name of the training task or an earlier",
        ),
        (
            lambda p: p["learning"]["curriculum"]["eval_tasks"].append({"name": "ruler", "tokenizer": "/none/tok"}),
            "learning.curriculum.eval_tasks[1].tokenizer: no folder /none/tok",
        ),
        (
            lambda p: p["learning"]["curriculum"]["eval_tasks"][0].update(num_needle=3),
            "learning.curriculum.eval_tasks[0].num_needle: unknown setting of this task",
        ),
        (
            lambda p: p["learning"].update(gradients=["exact"], steps_per_prompt=2, refresh={"every": 2}),
            "learning.refresh: the exact gradient needs a capture with the current parameters every step",
        ),
        (
            lambda p: p["learning"].update(steps_per_prompt=3),
            "learning.window: 2 steps hold fewer than 2 prompts' first steps at 3 steps a prompt",
        ),
    ],
)
def test_bad_stage_settings_are_refused_when_the_plan_is_made(tmp_path, capsys, change, message):
    assert cli.main(["plan", "--experiments", _experiment(tmp_path / "experiments", change)]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "demo.yaml" in err and "Traceback" not in err
    assert len(err.splitlines()) == 1


def test_the_gpu_curriculum_is_planned_on_h200_only(tmp_path):
    from longstraw.harness.plan import plan

    experiments = Path(__file__).parents[1] / "experiments"
    (tmp_path / "curriculum.yaml").write_text((experiments / "curriculum.yaml").read_text())
    assert plan(tmp_path, "cpu") == {}
    points = plan(tmp_path, "h200")["curriculum"]["points"]
    first, via = (
        points[name]["config"].learning for name in ("curriculum-niah-16k-131k", "curriculum-niah-16k-131k-via-98k")
    )
    assert [s.length for s in first.curriculum.stages] == [16384, 32768, 65536, 131072]
    assert [s.overrides["rope_parameters"]["factor"] for s in first.curriculum.stages] == [4.0, 4.0, 8.0, 16.0]
    assert [(t["name"], t["task"]) for t in first.curriculum.eval_tasks] == [("ruler", "vt")]
    assert first.gradients == ["response-only", "exact"] and via.gradients == ["response-only"]
    assert [s.length for s in via.curriculum.stages] == [16384, 32768, 65536, 98304, 131072]
    assert [s.overrides["rope_parameters"]["factor"] for s in via.curriculum.stages] == [4.0, 4.0, 8.0, 12.0, 16.0]
    fine = points["curriculum-niah-16k-131k-fine"]["config"].learning.curriculum
    assert [s.length for s in fine.stages] == [16384, 32768, 65536, 81920, 98304, 114688, 131072]
    # past 65,536 each stage runs its own length's factor over SmolLM2's 8,192 native positions
    assert [s.overrides["rope_parameters"]["factor"] for s in fine.stages[2:]] == [8.0, 10.0, 12.0, 14.0, 16.0]
    assert all(s.overrides["max_position_embeddings"] >= s.length for s in fine.stages)
    assert fine.out == "results/h200/adapters/curriculum-niah-16k-131k-fine"
    # the last step to 131,072 starts from the fine curriculum's last kept adapter, 32 rollouts a prompt
    last = points["curriculum-niah-131k-from-fine-g32"]["config"]
    assert last.model.lora.init == f"{fine.out}/stage-{len(fine.stages) - 2}/adapter"
    assert [(s.length, s.overrides["rope_parameters"]["factor"]) for s in last.learning.curriculum.stages] == [
        (122880, 15.0),
        (131072, 16.0),
    ]
    assert [s.num_generations for s in last.learning.curriculum.stages] == [32, 32]
    # RL at 131,072 from the rope-steps curriculum's last adapter, 4 steps on each prompt's one capture
    steps = points["curriculum-niah-16k-131k-rope-steps"]["config"].learning.curriculum
    reuse = points["curriculum-niah-131k-reuse4-from-rope-steps"]["config"]
    assert reuse.model.lora.init == f"{steps.out}/stage-{len(steps.stages) - 1}/adapter"
    assert (reuse.learning.steps_per_prompt, reuse.learning.refresh.every, reuse.learning.window) == (4, 4, 64)
    (stage,) = reuse.learning.curriculum.stages
    assert (stage.length, stage.overrides["rope_parameters"]["factor"], stage.steps) == (131072, 16.0, 128)


def test_a_lora_adapter_starts_from_a_saved_one_and_refuses_another_shape(tmp_path):
    from longstraw.config.sections import LoraConfig, ModelConfig
    from longstraw.models.policy import build_policy

    trained = build_policy(ModelConfig(preset="tiny-llama", lora=LoraConfig(r=4, init_random=True)))
    trained.save_pretrained(tmp_path / "adapter")
    on_disk = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors"))
    model = build_policy(ModelConfig(preset="tiny-llama", seed=1, lora=LoraConfig(r=4, init=str(tmp_path / "adapter"))))
    weights = _lora_weights(model)
    assert weights.keys() == on_disk.keys() and all(torch.equal(weights[k], v) for k, v in on_disk.items())
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)
    with pytest.raises(ValueError, match=r"model.lora.init: the adapter at .* does not fit .*size mismatch"):
        build_policy(ModelConfig(preset="tiny-llama", lora=LoraConfig(r=8, init=str(tmp_path / "adapter"))))
    with pytest.raises(ValueError, match=r"model.lora.init: no trained adapter \(adapter_model.safetensors\) at"):
        build_policy(ModelConfig(preset="tiny-llama", lora=LoraConfig(r=4, init=str(tmp_path / "none"))))


def test_a_stage_row_keeps_the_highest_step_peak_of_the_trained_run():
    """`step_peak_bytes`: the response-only run's highest CUDA peak (its first step too, where kernels are built),
    not the lr-0 run's; None where no step has one (the CPU)."""
    from longstraw.kinds.learning import stage_row

    def steps(peaks):
        return [
            {"step": i, "prompt": i, "seconds": 1.0, "rewards": [0.0], "peak_allocated_bytes": p}
            for i, p in enumerate(peaks)
        ]

    stage = {"stage": 0, "length": 64, "steps": 3, "window": 1}
    row = stage_row({**stage, "runs": {"response-only": steps([7, 5, None]), "lr0": steps([9, 1, 1])}})
    assert row["step_peak_bytes"] == 7
    assert stage_row({**stage, "runs": {"response-only": steps([None] * 3)}})["step_peak_bytes"] is None


def test_a_point_on_a_curriculums_kept_model_waits_for_it_within_that_stages_positions(tmp_path):
    """A curriculum without LoRA keeps each stage's trained model as `out/stage-<i>/model`: a point whose
    `model.path` is one plans before it is written, needs the curriculum first, and is checked against the positions
    that stage's overrides give it (stage 1: YaRN to 160 over the model's 80), unless its own overrides say otherwise;
    a path under `out` the curriculum does not write (an adapter folder) is refused, naming the file and point."""
    from longstraw.config import ConfigError
    from longstraw.harness.plan import needs, plan

    out = tmp_path / "kept"
    curriculum = yaml.safe_load(EXAMPLE.read_text())
    curriculum.pop("name")
    curriculum["model"].pop("lora")
    curriculum["learning"]["curriculum"]["out"] = str(out)
    on = {"model.path": str(out / "stage-1" / "model"), "model.overrides": {}, "learning.curriculum": None}
    on["learning.probe"] = None

    def experiment(length: int, path: str | None = None, overrides: dict | None = None):
        point = {**on, "prompt.length": length}
        point.update({} if path is None else {"model.path": path})
        point.update({} if overrides is None else {"model.overrides": overrides})
        points = [{"name": "curriculum", "set": {}}, {"name": "on", "set": point}]
        profiles = {"cpu": {"base": curriculum, "points": points}}
        spec = {"name": "e", "title": "t", "kind": "learning", "profiles": profiles}
        (tmp_path / "e.yaml").write_text(yaml.safe_dump(spec))

    experiment(128)
    planned = plan(tmp_path, "cpu")
    assert needs(planned, "e", "on") == [("e", "curriculum")] and needs(planned, "e", "curriculum") == []
    experiment(156)  # 156 + the 4-token answer fill stage 1's 160 positions
    assert needs(plan(tmp_path, "cpu"), "e", "on") == [("e", "curriculum")]
    experiment(160)
    with pytest.raises(ConfigError, match=r"e.yaml \[profile cpu, point on\]: .*160.*e/curriculum writes to"):
        plan(tmp_path, "cpu")
    experiment(128, overrides={"max_position_embeddings": 80})  # the loader sets the point's own over it
    with pytest.raises(ConfigError, match=r"point on\]: .*128.*e/curriculum writes to"):
        plan(tmp_path, "cpu")
    experiment(128, path=str(out / "stage-1" / "adapter"))
    with pytest.raises(ConfigError, match=r"point on\]: model.path: no checkpoint folder .*stage-1/adapter, and no"):
        plan(tmp_path, "cpu")
    # nor does it keep adapters there for a LoRA start to wait for
    on["model.lora"] = {"r": 4, "init": str(out / "stage-1" / "adapter")}
    experiment(64)
    with pytest.raises(
        ConfigError, match=r"point on\]: model.lora.init: no trained peft adapter .*no point of the plan"
    ):
        plan(tmp_path, "cpu")
    del on["model.lora"]

    # a curriculum on a checkpoint folder writes its model's overrides too: stage 0's model has the 80 positions the
    # curriculum set over the checkpoint's own
    from longstraw.config.sections import ModelConfig
    from longstraw.models.policy import build_policy

    saved = tmp_path / "checkpoint"
    build_policy(ModelConfig(preset="tiny-llama", dtype="float32")).save_pretrained(saved)
    native = json.loads((saved / "config.json").read_text())["max_position_embeddings"]
    assert native > 128
    curriculum["model"] = {"path": str(saved), "dtype": "float32", "overrides": {"max_position_embeddings": 80}}
    experiment(64, path=str(out / "stage-0" / "model"))
    assert needs(plan(tmp_path, "cpu"), "e", "on") == [("e", "curriculum")]
    experiment(96, path=str(out / "stage-0" / "model"))
    with pytest.raises(ConfigError, match=r"point on\]: .*96.*80.*e/curriculum writes to"):
        plan(tmp_path, "cpu")
