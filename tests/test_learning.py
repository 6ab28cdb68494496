"""The learning kinds end to end on a tiny task: a pretrain point writes a checkpoint, a length-curve
point and a learning point load it; the learning point's runs share prompts and seeds and its V4
gain is the paired statistic of its own recorded rewards."""

import hashlib
import json

import pytest
import torch

from longstraw.harness.plan import needs
from longstraw.harness.runner import run_point
from longstraw.training.improvement import paired_gain, per_prompt_means

TASK = {"name": "counting", "min_count": 0, "max_count": 3}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("learning") / "tiny"
    result = run_point(
        {
            "name": "pretrain",
            "kind": "pretrain",
            "pretrain": {
                "model": "learn-tiny-hybrid",
                "task": TASK,
                "stages": [],
                "eval_task": None,
                "lengths": [16],
                "batch_size": 32,
                "batch_tokens": None,
                "steps": 150,
                "lr": 3e-3,
                "eval_every": 0,
                "eval_lengths": [16],
                "eval_examples": 32,
                "out": str(out),
                "progress": False,
            },
        }
    )
    assert result["status"] == "ok", result.get("error")
    assert result["metrics"]["loss_curve"] and result["metrics"]["checkpoint"] == str(out / "checkpoint")
    assert result["metrics"]["checkpoint_sha256"] == _sha256(out / "checkpoint" / "model.safetensors")
    return str(out / "checkpoint")


def _sha256(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def test_a_point_records_which_pretrained_weights_it_loaded(checkpoint, tmp_path):
    """A pretrained checkpoint has no manifest, and its bits differ from host to host (the same recipe on an AMD and
    an Intel CPU). So a point that loads one, as `model.path` or as a pretrain point's `init`, records the folder and
    its weights' sha256."""
    weights = {"path": checkpoint, "weights_sha256": _sha256(f"{checkpoint}/model.safetensors")}
    curve = {"task": TASK, "lengths": [16], "examples": 2}
    result = run_point({"name": "curve", "kind": "length_curve", "model": {"path": checkpoint}, "length_curve": curve})
    assert result["status"] == "ok", result.get("error")
    assert result["provenance"]["checkpoint"] == weights
    again = {"model": "learn-tiny-hybrid", "init": checkpoint, "task": TASK, "stages": [], "eval_task": None}
    again |= {"lengths": [16], "batch_size": 4, "batch_tokens": None, "steps": 1, "eval_every": 0}
    again |= {"eval_lengths": [16], "eval_examples": 4, "out": str(tmp_path / "next"), "progress": False}
    result = run_point({"name": "pretrain-on", "kind": "pretrain", "pretrain": again})
    assert result["status"] == "ok", result.get("error")
    assert result["provenance"]["checkpoint"] == weights
    assert result["metrics"]["checkpoint_sha256"] == _sha256(tmp_path / "next" / "checkpoint" / "model.safetensors")


def test_length_curve_point_reads_the_checkpoint(checkpoint):
    partials = []  # what a run cut off at its time limit would have left: the cells finished so far

    def keep(partial):
        partials.append((partial["status"], [r["length"] for r in partial["metrics"]["rows"]]))

    result = run_point(
        {
            "name": "curve",
            "kind": "length_curve",
            "model": {"path": checkpoint},
            "length_curve": {"task": TASK, "lengths": [16, 64], "examples": 8},
        },
        on_progress=keep,
    )
    assert result["status"] == "ok", result.get("error")
    rows = result["metrics"]["rows"]
    assert [(r["length"], r["n"]) for r in rows] == [(16, 8), (64, 8)]
    assert partials == [("partial", [16]), ("partial", [16, 64])]
    assert result["metrics"]["chance"]["value"] == 0.25


def _greedy_by_hand(model, prompt_ids, steps: int) -> list[int]:
    """HF's own forward, one argmax at a time over the whole sequence: the reference decode."""
    ids = prompt_ids[None]
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(input_ids=ids, use_cache=False).logits[0, -1].argmax().view(1, 1)], 1)
    return ids[0, prompt_ids.numel() :].tolist()


@pytest.mark.numerics  # which examples a model gets right depends on the kernel path
def test_a_length_curve_evaluates_a_trained_adapter_beside_its_base(checkpoint, tmp_path):
    """`length_curve.adapter`: the curve of the checkpoint with a saved LoRA adapter and, on the same held-out
    examples, without it; each example's reward equals HF's greedy decode of the checkpoint under peft's own
    `PeftModel.from_pretrained` of that folder, and of the plain checkpoint. The adapter (random, large) changes
    some answers, so a curve that ignored it could not pass."""
    from peft import PeftModel

    from longstraw.models import load_pretrained
    from longstraw.models.lora import apply_lora
    from longstraw.training.pretrain import CURVE_SEED_BASE
    from longstraw.training.tasks import build_task

    torch.manual_seed(0)
    apply_lora(load_pretrained(checkpoint, dtype=torch.float32), r=4, init_random=True).save_pretrained(tmp_path)
    point = {"name": "held-out", "kind": "length_curve", "model": {"path": checkpoint, "dtype": "float32"}}
    curve = {"task": TASK, "lengths": [16, 24], "examples": 6, "adapter": str(tmp_path)}
    result = run_point({**point, "length_curve": curve})
    assert result["status"] == "ok", result.get("error")
    weights = (tmp_path / "adapter_model.safetensors").read_bytes()
    assert result["metrics"]["adapter"] == {"path": str(tmp_path), "sha256": hashlib.sha256(weights).hexdigest()}
    base = load_pretrained(checkpoint, dtype=torch.float32)
    adapted = PeftModel.from_pretrained(load_pretrained(checkpoint, dtype=torch.float32), str(tmp_path))
    changed = False
    for key, model in (("rows", adapted), ("base_rows", base)):
        for row in result["metrics"][key]:
            task = build_task({**TASK, "length": row["length"]}, model.config.vocab_size)
            examples = [task.make(CURVE_SEED_BASE + i) for i in range(row["n"])]
            answers = [_greedy_by_hand(model, e.prompt_ids, len(e.answer)) for e in examples]
            assert row["rewards"] == [float(a == list(e.answer)) for a, e in zip(answers, examples)], (key, row)
    for row, base_row in zip(result["metrics"]["rows"], result["metrics"]["base_rows"]):
        changed |= row["rewards"] != base_row["rewards"]
    assert changed


def test_a_trained_adapter_that_is_not_there_or_cut_short_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    """`length_curve.adapter` and `model.lora.init`: a folder without peft's two files, or whose weights are cut
    short, is refused naming the key, before any model is built."""
    from longstraw.models import policy

    monkeypatch.setattr(policy, "build_policy", lambda *a, **k: pytest.fail("a model was built"))
    curve = {"name": "c", "kind": "length_curve", "model": {"preset": "tiny-llama"}}
    with pytest.raises(ValueError, match=r"length_curve.adapter: no trained peft adapter at /nowhere \(adapter_config"):
        run_point({**curve, "length_curve": {"task": TASK, "lengths": [16], "adapter": "/nowhere"}})
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.safetensors").write_bytes((64).to_bytes(8, "little") + b"{")  # a header cut short
    with pytest.raises(ValueError, match=rf"length_curve.adapter: .*{tmp_path}/adapter_model.safetensors"):
        run_point({**curve, "length_curve": {"task": TASK, "lengths": [16], "adapter": str(tmp_path)}})
    learning = {"name": "l", "kind": "learning", "prompt": {"length": 32}}
    learning["learning"] = {"task": TASK, "steps": 2, "window": 2}
    lora = {"r": 4, "init": str(tmp_path / "none")}
    with pytest.raises(ValueError, match=r"model.lora.init: no trained peft adapter at .*/none"):
        run_point({**learning, "model": {"preset": "tiny-llama", "lora": lora}})


def test_a_point_loading_a_curriculums_adapter_waits_for_it_and_an_unwritten_one_is_refused(tmp_path):
    """A trained adapter not yet there plans when a planned point keeps its adapters in a folder holding it (a
    curriculum's `out`), and the loading point needs that point first; with no such point it is refused at plan
    time, naming the file, the point and the key."""
    from longstraw.config import ConfigError
    from longstraw.harness.plan import plan

    kept = tmp_path / "adapters" / "c"
    stages = [{"length": 64, "steps": 2}, {"length": 96, "steps": 2}]
    curriculum = {"task": TASK, "steps": 2, "window": 2, "curriculum": {"stages": stages, "out": str(kept)}}
    points = [
        {"name": "curriculum", "set": {"learning": curriculum}},
        {
            "name": "held-out",
            "set": {
                "kind": "length_curve",
                "model.lora": None,
                "length_curve": {"task": TASK, "lengths": [96], "adapter": str(kept / "stage-1" / "adapter")},
            },
        },
        {"name": "on", "set": {"model.lora.init": str(kept / "stage-1" / "adapter"), "learning": {"task": TASK}}},
    ]
    experiment = {
        "name": "e",
        "title": "t",
        "description": "d",
        "kind": "learning",
        "profiles": {"cpu": {"base": {"model": {"preset": "tiny-llama", "lora": {"r": 4}}}, "points": points}},
    }
    (tmp_path / "e.yaml").write_text(json.dumps(experiment))
    planned = plan(tmp_path, "cpu")
    assert needs(planned, "e", "held-out") == needs(planned, "e", "on") == [("e", "curriculum")]
    assert needs(planned, "e", "curriculum") == []
    elsewhere = json.dumps(experiment).replace(str(kept / "stage-1"), str(tmp_path / "other" / "stage-1"))
    (tmp_path / "e.yaml").write_text(elsewhere)
    with pytest.raises(
        ConfigError,
        match=r"e.yaml \[profile cpu, point held-out\]: length_curve.adapter: no trained "
        r"peft adapter at .*other/stage-1/adapter .*no point of the plan keeps",
    ):
        plan(tmp_path, "cpu")


def _learning_point(checkpoint, name: str, learning: dict, lr: float = 1e-2) -> dict:
    """A learning point on the checkpoint at 32 positions, one-token answers, no KL term; its result, checked ok."""
    result = run_point(
        {
            "name": name,
            "kind": "learning",
            "model": {"path": checkpoint},
            "prompt": {"length": 32},
            "responses": {"length": 1},
            "grpo": {"beta": 0.0},
            "optimizer": {"lr": lr},
            "learning": learning,
        }
    )
    assert result["status"] == "ok", result.get("error")
    return result


@pytest.mark.parametrize("masters", [False, True, None])
def test_a_learning_points_runs_keep_float32_masters_as_its_optimizer_says(checkpoint, monkeypatch, masters):
    """A bf16 point's runs (lr 0's too) update the weights in place under `optimizer.master_weights: false`, as the
    recorded synthetic points did, and keep float32 masters when it is true or unset (the default for bf16 weights)."""
    from longstraw.training import trainer
    from longstraw.training.optimizer import MasterWeightsAdamW

    built, build = [], trainer.build_optimizer
    monkeypatch.setattr(trainer, "build_optimizer", lambda params, cfg: built.append(build(params, cfg)) or built[-1])
    result = run_point(
        {
            "name": "v4-bf16",
            "kind": "learning",
            "model": {"path": checkpoint, "dtype": "bfloat16"},
            "prompt": {"length": 32},
            "responses": {"length": 1},
            "optimizer": {"lr": 1e-2, "master_weights": masters},
            "learning": {"task": TASK, "steps": 2, "window": 2},
        }
    )
    assert result["status"] == "ok", result.get("error")
    assert [isinstance(o, MasterWeightsAdamW) for o in built] == [masters is not False] * 2
    # the record says what the runs' AdamW applied, not the point's weight decay (0.01 by default), which they drop
    assert result["config"]["optimizer"]["weight_decay"] == 0.01
    assert [o.param_groups[0]["weight_decay"] for o in built] == [0.0, 0.0]
    assert result["metrics"]["run_optimizer"] == {
        "response-only": {"lr": 1e-2, "weight_decay": 0.0, "master_weights": masters is not False},
        "lr0": {"lr": 0.0, "weight_decay": 0.0, "master_weights": masters is not False},
    }


def test_learning_point_runs_the_same_prompts_and_reports_the_paired_gain(checkpoint):
    learning = {"task": TASK, "steps": 4, "window": 2, "gradients": ["response-only", "exact"]}
    result = _learning_point(checkpoint, "v4", learning)
    runs = result["metrics"]["runs"]
    assert set(runs) == {"response-only", "exact", "lr0"}
    assert [s["prompt"] for s in runs["lr0"]] == [s["prompt"] for s in runs["exact"]] == [0, 1, 2, 3]
    # same weights and seeds until the first update: the first step's rollouts and rewards agree
    assert runs["lr0"][0]["rewards"] == runs["response-only"][0]["rewards"] == runs["exact"][0]["rewards"]
    for name in ("response-only", "exact"):
        expected = paired_gain(per_prompt_means(runs[name], 2), per_prompt_means(runs["lr0"], 2))
        assert result["metrics"]["gains"][name] == pytest.approx(expected)
    # each step keeps its CUDA peak; on the CPU there is none to claim
    assert all(s["peak_allocated_bytes"] is None for steps in runs.values() for s in steps)


def test_a_learning_point_reusing_each_prompt_state_measures_v4_on_first_visits(checkpoint, monkeypatch):
    """`steps_per_prompt: 2` with `refresh.every: 2`: one capture a prompt, its second step on the state captured
    before the first update (prefix reuse); V4 pairs each prompt's first step only, the rewards of a policy not yet
    trained on that prompt."""
    from longstraw.training import trainer

    captured, capture = [], trainer.capture
    monkeypatch.setattr(trainer, "capture", lambda model, ids, **kw: captured.append(ids) or capture(model, ids, **kw))
    learning = {"task": TASK, "steps": 8, "steps_per_prompt": 2, "refresh": {"every": 2}, "window": 6}
    result = _learning_point(checkpoint, "v4-reuse", learning)
    runs = result["metrics"]["runs"]
    for steps in runs.values():
        assert [s["prompt"] for s in steps] == [0, 0, 1, 1, 2, 2, 3, 3]
        assert [s["refreshed"] for s in steps] == [True, False] * 4
    assert len(captured) == 2 * 4  # two runs (response-only, lr 0), one capture of each of the 4 prompts

    def first_steps(steps):  # steps 2, 4, 6: the first visits of prompts 1-3, the window's last 6 steps
        return {s["prompt"]: sum(s["rewards"]) / len(s["rewards"]) for s in steps if s["step"] in (2, 4, 6)}

    expected = paired_gain(first_steps(runs["response-only"]), first_steps(runs["lr0"]))
    assert result["metrics"]["gains"]["response-only"] == pytest.approx(expected)
    assert expected["prompts"] == 3


def test_each_step_records_where_its_needle_sits(checkpoint):
    """A step's `depth` is where its prompt holds the answer's needle: rebuilt here from the task and the documented
    seed of a run's prompt (seed * 1,000,003 + prompt), the KEY token sits at depth x the filler's room (+- 0.5)."""
    from transformers import AutoConfig

    from longstraw.training.tasks import KEY, build_task

    spec = {"name": "kv_retrieval", "num_needles": 1, "value_length": 1}
    result = _learning_point(checkpoint, "depths", {"task": spec, "steps": 4, "window": 2})
    task = build_task({**spec, "length": 32}, AutoConfig.from_pretrained(checkpoint).vocab_size)
    room = 32 - 3 - 5  # the prompt less QUERY key ANSWER and the needle KEY k VAL v END
    depths = []
    for steps in result["metrics"]["runs"].values():
        for step in steps:
            ids = task.make(0 * 1_000_003 + step["prompt"]).prompt_ids.tolist()
            assert abs(step["depth"] * room - ids.index(KEY)) <= 0.5, step
            depths.append(step["depth"])
    assert len(set(depths)) == 4  # four prompts, four depths


def test_success_by_depth_bands_each_prompts_first_step_by_hand():
    from longstraw.kinds.learning import depth_text
    from longstraw.kinds.learning_runs import success_by_depth

    steps = [
        {"step": 0, "prompt": 0, "depth": 0.1, "rewards": [1.0, 0.0]},
        {"step": 1, "prompt": 0, "depth": 0.1, "rewards": [1.0, 1.0]},  # not a first visit
        {"step": 2, "prompt": 1, "depth": 0.2, "rewards": [0.0, 0.0]},  # a band's lower edge is in it
        {"step": 3, "prompt": 2, "depth": 1.0, "rewards": [1.0, 1.0]},  # the last band holds 1.0
        {"step": 4, "prompt": 3, "depth": 0.95, "rewards": [0.0, 1.0]},
    ]
    assert [(r["depths"], r["prompts"], r["success"]) for r in success_by_depth(steps)] == [
        ([0.0, 0.2], 1, 0.5),
        ([0.2, 0.4], 1, 0.0),
        ([0.4, 0.6], 0, None),
        ([0.6, 0.8], 0, None),
        ([0.8, 1.0], 2, 0.75),
    ]
    assert depth_text(steps) == "0-0.2: 0.50 (1); 0.2-0.4: 0.00 (1); 0.4-0.6: - (0); 0.6-0.8: - (0); 0.8-1: 0.75 (2)"
    assert success_by_depth([{**steps[0], "depth": None}]) is None and depth_text([]) is None


def test_window_by_depth_pairs_the_trained_run_with_lr0_over_the_window_by_hand():
    from longstraw.kinds.learning import window_depth_text

    def run(rewards):  # prompts 0-3, one step each, at depths 0.1, 0.3, 0.1, 0.9
        return [
            {"step": i, "prompt": i, "depth": d, "rewards": r}
            for i, (d, r) in enumerate(zip((0.1, 0.3, 0.1, 0.9), rewards))
        ]

    runs = {
        "response-only": run([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [1.0, 1.0]]),
        "lr0": run([[0.0, 0.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0]]),
    }
    # the window is steps 1-3: the 0-0.2 band holds prompt 2 only (trained 0.5, lr 0 0.0)
    assert window_depth_text(runs, 1) == (
        "0-0.2: 0.50 / 0.00 (1); 0.2-0.4: 0.50 / 0.00 (1); 0.4-0.6: - / - (0); 0.6-0.8: - / - (0); "
        "0.8-1: 1.00 / 0.50 (1)"
    )
    assert window_depth_text({"lr0": runs["lr0"]}, 1) is None
    # 2 steps a prompt, window from step 1: prompt 0's second step is in it, but its first visit is not
    two = {
        name: [{"step": 0, "prompt": 0, "depth": 0.1, "rewards": [1.0, 1.0]}]
        + [
            {"step": k, "prompt": k // 2, "depth": 0.1 if k < 2 else 0.9, "rewards": [float(k % 2), 0.0]}
            for k in (1, 2, 3)
        ]
        for name in ("response-only", "lr0")
    }
    assert window_depth_text(two, 1).startswith("0-0.2: - / - (0);") and window_depth_text(two, 1).endswith(
        "0.8-1: 0.00 / 0.00 (1)"
    )


class _EvenShare:
    """The counting task's prompts with a dense reward (the share of even ids in the response). Sampled at a high
    temperature (the pretrained checkpoint is so sure of its answers that at temperature 1 an AMD EPYC's kernels
    drew one response G times in every group), a group's rewards differ and its step updates on any CPU."""

    def __init__(self, vocab_size, **settings):
        from longstraw.training.tasks import Counting

        self.inner = Counting(vocab_size, **settings)

    def make(self, seed):
        return self.inner.make(seed)

    def reward(self, example, response_ids):
        return float((response_ids % 2 == 0).float().mean())


def test_a_learning_point_cut_off_goes_on_from_its_work_folder(checkpoint, tmp_path, monkeypatch):
    # a command cut off mid-run and started again with the same work folder resumes the runs from their last
    # checkpoints; on CPU its runs equal an uninterrupted point's (same prompts, rewards, losses)
    from longstraw.kinds import learning
    from longstraw.training.tasks import register_task
    from longstraw.training.trainer import Trainer

    register_task("learning_even_share", _EvenShare)
    task = {**TASK, "name": "learning_even_share"}
    point = {
        "name": "v4",
        "kind": "learning",
        "model": {"path": checkpoint},
        "prompt": {"length": 32},
        "responses": {"length": 4},
        "grpo": {"num_generations": 4, "beta": 0.0},
        "optimizer": {"lr": 1e-2},
        "learning": {"task": task, "steps": 5, "window": 2, "temperature": 10.0},
    }
    whole = run_point(point)["metrics"]["runs"]
    monkeypatch.setattr(learning, "RESUME_EVERY", 2)
    original, calls = Trainer.train_step, []

    def cut_at_the_fourth_step(self, step):
        calls.append(step)
        if len(calls) == 4:
            raise RuntimeError("cut off")
        return original(self, step)

    monkeypatch.setattr(Trainer, "train_step", cut_at_the_fourth_step)
    work = tmp_path / "point.json.work"
    first = run_point(point, work_dir=work)
    assert first["status"] == "error" and "cut off" in first["error"]
    again = run_point(point, work_dir=work)
    assert again["status"] == "ok", again.get("error")
    assert calls[:4] == [0, 1, 2, 3] and calls[4:] == [2, 3, 4] + [0, 1, 2, 3, 4]  # from step 2's checkpoint
    assert again["metrics"]["resumed_at"] == {"response-only": 2, "lr0": 0}
    keys = ("step", "prompt", "rewards", "loss", "grad_norm")
    for name, steps in whole.items():
        resumed = again["metrics"]["runs"][name]
        assert [{k: s[k] for k in keys} for s in resumed] == [{k: s[k] for k in keys} for s in steps]
    assert any(s["grad_norm"] > 0 for s in whole["response-only"][2:])  # the resumed steps had updates to redo
    changed = {**point, "optimizer": {"lr": 2e-2}}
    with pytest.raises(ValueError, match=r"optimizer.lr: .* holds the runs of another config of this point"):
        run_point(changed, work_dir=work)


def test_a_point_on_a_checkpoint_waits_for_its_pretrain_point(tmp_path):
    from longstraw.harness.plan import plan

    (tmp_path / "learning.yaml").write_text(
        (__import__("pathlib").Path(__file__).parents[1] / "experiments" / "learning.yaml").read_text()
    )
    planned = plan(tmp_path, "cpu")
    assert needs(planned, "learning", "v4-8192") == [("learning", "pretrain")]
    assert needs(planned, "learning", "cycles-8192") == [("learning", "pretrain")]
    assert needs(planned, "learning", "pretrain") == []
    # a continued pretraining waits for the point whose checkpoint it starts from (`pretrain.init`)
    planned = plan(tmp_path, "h200")
    assert needs(planned, "learning", "pretrain-reach") == [("learning", "pretrain-reach-base")]
    assert needs(planned, "learning", "v4-reach-1048576") == [("learning", "pretrain-reach")]
    # a point on a curriculum's kept model waits for that curriculum
    assert needs(planned, "learning", "curriculum-reach-2m-from-1m") == [("learning", "curriculum-reach-524k-1m")]


def test_the_window_needs_two_first_visits_counted_where_they_fall():
    """V4 pairs the prompts first visited in the last `window` steps (prompt = step // steps_per_prompt). 9 steps at
    4 a prompt: steps 4-8 hold the first steps of prompts 1 and 2 (4 and 8), though 5 // 4 is 1; 8 steps: 3-7 hold
    only step 4's."""
    from longstraw.kinds.learning import LearningConfig
    from longstraw.training.improvement import first_visits

    assert first_visits(9, 5, 4) == 2 and first_visits(8, 5, 4) == 1 and first_visits(8, 8, 1) == 8
    LearningConfig(steps=9, window=5, steps_per_prompt=4)
    with pytest.raises(ValueError, match="window: 5 steps hold fewer than 2 prompts' first steps at 4 steps a prompt"):
        LearningConfig(steps=8, window=5, steps_per_prompt=4)
