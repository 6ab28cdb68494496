"""The trainer on text, in TRL's terms: a local checkpoint and tokenizer, a JSONL dataset of
needle-in-a-haystack prompts, reward functions over the decoded completions.

Everything is made here, nothing downloaded: a WordLevel tokenizer trained on a generated corpus
(one variant with a chat template), a tiny-qwen3_5 checkpoint with the tokenizer's vocabulary saved
beside it, the JSONL rows. `python tests/test_text_trainer.py OUT` writes the same fixture under OUT
for experiments/examples/train_text_cpu.yaml (OUT = runs/text_fixture)."""

from __future__ import annotations

import json
import math
import random
import sys
from pathlib import Path

import pytest
import torch
from tolerances import float32_tolerance

# rewards, their statistics and advantages in float32 against float64 sums: a few float32 operations (<= 8
# roundings) on values of order 1
ARITH32 = float32_tolerance(roundings=8)
FILLER = (
    "grass sky water stone river cloud tree hill road field wind rain snow leaf bird fish sand wood "
    "lake moon star sun light dark warm cold small large old new quiet loud slow fast"
).split()
VALUES = "red blue green yellow purple orange black white pink brown gold silver".split()
QUESTION = "question : what is the key ? answer :"
SPECIALS = ["<pad>", "<unk>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "experiments" / "examples" / "train_text_cpu.yaml"


def haystack_rows(count: int, words: int, seed: int = 0, conversational: bool = False) -> list[dict]:
    """Needle-in-a-haystack rows: `words` filler words with "the key is X ." at a random depth, then the
    question; the `answer` column is X, `depth` where the needle is."""
    rng = random.Random(seed)
    rows = []
    for _ in range(count):
        answer, depth = rng.choice(VALUES), rng.random()
        filler = [rng.choice(FILLER) for _ in range(words)]
        cut = round(depth * words)
        text = " ".join(filler[:cut] + ["the", "key", "is", answer, "."] + filler[cut:] + [QUESTION])
        prompt = [{"role": "user", "content": text}] if conversational else text
        rows.append({"prompt": prompt, "answer": answer, "depth": round(depth, 3)})
    return rows


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def make_tokenizer(chat: bool = False):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    corpus = [" ".join(FILLER), " ".join(VALUES), "the key is .", QUESTION]
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=SPECIALS, min_frequency=1))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=SPECIALS[3:],
    )
    if chat:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def make_fixture(folder: Path) -> dict:
    """{checkpoint (model + plain tokenizer), chat_tokenizer, data (standard JSONL), chat_data (conversational)}."""
    from longstraw.models import build_model

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer, chat = make_tokenizer(), make_tokenizer(chat=True)
    checkpoint = folder / "checkpoint"
    build_model("tiny-qwen3_5", seed=0, vocab_size=len(tokenizer)).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    chat.save_pretrained(folder / "chat_tokenizer")
    return {
        "checkpoint": checkpoint,
        "chat_tokenizer": folder / "chat_tokenizer",
        "data": write_jsonl(folder / "niah.jsonl", haystack_rows(6, 96)),
        "chat_data": write_jsonl(folder / "niah_chat.jsonl", haystack_rows(4, 96, seed=1, conversational=True)),
    }


# ---- reward functions (TRL's signature), imported by the trainer as test_text_trainer:NAME
CALLS = []


def word_share(prompts, completions, completion_ids, answer, trainer_state, **kwargs):
    """Dense: the share of the completion's words that are key values; records what it was given."""
    CALLS.append(
        {
            "prompts": prompts,
            "completions": completions,
            "completion_ids": completion_ids,
            "answer": answer,
            "step": trainer_state.global_step,
            "keys": sorted(kwargs),
        }
    )
    texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
    return [sum(w in VALUES for w in t.split()) / max(len(t.split()), 1) for t in texts]


def every_other(completions, **kwargs):
    """None for the even items (TRL: this function does not apply there), the word count elsewhere."""
    return [None if i % 2 == 0 else float(len(c.split())) for i, c in enumerate(completions)]


def only_odd(completions, **kwargs):
    """None except at item 1: with `every_other`, items 0 and 2 are scored by no function."""
    return [0.25 if i == 1 else None for i in range(len(completions))]


def one_short(completions, **kwargs):
    return [0.0] * (len(completions) - 1)


def short_once_sampled(completions, **kwargs):
    """Right for the check call (empty completions), one value short for sampled ones."""
    return [0.0] * (len(completions) - (0 if all(c == "" for c in completions) else 1))


def not_a_number(completions, **kwargs):
    return ["high"] * len(completions)


# ---- configs
@pytest.fixture(scope="module")
def fixture(tmp_path_factory):
    return make_fixture(tmp_path_factory.mktemp("text_fixture"))


def _config(fixture, out: Path, **changes) -> dict:
    cfg = {
        "model": {"path": str(fixture["checkpoint"]), "dtype": "float32", "lora": {"r": 4, "init_random": True}},
        "dataset": {"path": str(fixture["data"])},
        "reward_funcs": ["longstraw.training.rewards:contains_answer", "test_text_trainer:word_share"],
        "reward_weights": [1.0, 0.5],
        "max_steps": 2,
        "steps_per_prompt": 1,
        "seed": 1,
        "num_generations": 4,
        "max_completion_length": 4,
        "temperature": 1.0,
        "beta": 0.0,
        "epsilon": 0.2,
        "loss_type": "dapo",
        "learning_rate": 1e-2,
        "capture": {"chunk_size": 64},
        "output": {"dir": str(out), "checkpoint_every": 0},
    }
    cfg.update(changes)
    return cfg


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def _trl_nanstd(x: torch.Tensor) -> torch.Tensor:  # TRL's nanstd, as trl/trainer/utils.py writes it
    variance = torch.nanmean((x - torch.nanmean(x, keepdim=True)) ** 2)
    count = torch.sum(~torch.isnan(x))
    return torch.sqrt(variance * count / (count - 1))


def _trl_rewards_and_advantages(per_func: list[list], weights: list[float]):
    """TRL's sum_then_normalize for one group, written from its source: (rewards, advantages)."""
    matrix = torch.tensor([[math.nan if v is None else v for v in f] for f in per_func], dtype=torch.float32).T
    unscorable = torch.isnan(matrix).all(dim=1)
    rewards = (matrix * torch.tensor(weights)[None]).nansum(dim=1)
    rewards[unscorable] = torch.nan
    advantages = (rewards - torch.nanmean(rewards)) / (_trl_nanstd(rewards) + 1e-4)
    return rewards, torch.nan_to_num(advantages, nan=0.0)


# ---- the trainer end to end
def test_trains_from_a_local_checkpoint_tokenizer_jsonl_and_reward_functions(fixture, tmp_path, monkeypatch):
    from longstraw.training import rewards
    from longstraw.training import trainer as trainer_module
    from longstraw.training.trainer import Trainer

    stops = []
    real_sample = trainer_module.sample
    monkeypatch.setattr(
        trainer_module, "sample", lambda m, s, c, **kw: stops.append(c.stop_ids) or real_sample(m, s, c, **kw)
    )
    CALLS.clear()
    trainer = Trainer(_config(fixture, tmp_path / "run", beta=0.04))  # a KL term: the kl metric
    assert len(CALLS) == 1 and CALLS[0]["completions"] == [""] * 4  # the check call, before the model was built
    records = trainer.run(resume=False)
    tokenizer, rows = trainer.text.tokenizer, _rows(fixture["data"])
    assert len(records) == 2 and all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in records)
    assert stops == [(tokenizer.eos_token_id,)] * 2  # sampling stops at the tokenizer's EOS
    assert _rows(tmp_path / "run" / "metrics.jsonl") == json.loads(json.dumps(records))
    for record, call in zip(records, CALLS[1:]):
        row = rows[record["dataset_index"]]
        # the reward functions got the decoded completions (EOS, a special token, skipped), TRL's keywords
        assert (
            call["completions"]
            == record["completions"]
            == tokenizer.batch_decode(call["completion_ids"], skip_special_tokens=True)
        )
        assert [len(ids) for ids in call["completion_ids"]] == record["response_tokens"]
        assert call["prompts"] == [row["prompt"]] * 4 and call["answer"] == [row["answer"]] * 4
        assert call["step"] == record["step"] and "depth" in call["keys"] and "log_metric" in call["keys"]
        # the prompt was the row's text, tokenized as it is (standard format)
        example = trainer.text.example(record["dataset_index"])
        assert example.prompt_ids.tolist() == tokenizer(row["prompt"])["input_ids"]
        # the logged rewards are the functions' outputs on the logged completions, weighted and summed
        expected = {
            "contains_answer": rewards.contains_answer(record["completions"], [row["answer"]] * 4),
            "word_share": word_share(
                call["prompts"], record["completions"], call["completion_ids"], call["answer"], rewards.StepState()
            ),
        }
        CALLS.pop()  # (the recomputation's own call)
        assert record["rewards_per_func"] == expected
        combined = [a + 0.5 * b for a, b in zip(expected["contains_answer"], expected["word_share"])]
        assert record["rewards"] == pytest.approx(combined, abs=ARITH32)
        assert record["reward"] == record["reward_mean"] == pytest.approx(sum(combined) / 4, abs=ARITH32)
        assert record["reward_std"] == pytest.approx(float(torch.tensor(combined).std()), abs=ARITH32)
        for name, values in expected.items():
            assert record[f"rewards/{name}/mean"] == pytest.approx(sum(values) / 4, abs=ARITH32)
            assert record[f"rewards/{name}/std"] == pytest.approx(float(torch.tensor(values).std()), abs=ARITH32)
        _, advantages = _trl_rewards_and_advantages(list(expected.values()), [1.0, 0.5])
        assert record["advantages"] == pytest.approx(advantages.tolist(), abs=ARITH32)
        lengths = record["response_tokens"]
        assert record["completions/mean_length"] == pytest.approx(sum(lengths) / 4)
        assert (record["completions/min_length"], record["completions/max_length"]) == (min(lengths), max(lengths))
    # TRL's metric names
    for name in (
        "reward",
        "reward_std",
        "frac_reward_zero_std",
        "kl",
        "loss",
        "grad_norm",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "completions/mean_length",
        "completions/min_length",
        "completions/max_length",
        "completions/clipped_ratio",
        "completions/mean_terminated_length",
        "rewards/contains_answer/mean",
        "rewards/contains_answer/std",
        "rewards/word_share/mean",
        "rewards/word_share/std",
    ):
        assert all(name in r for r in records), name
    assert any(r["grad_norm"] > 0 for r in records)


def test_conversational_prompts_go_through_the_chat_template(fixture, tmp_path):
    from longstraw.training.rewards import StepState
    from longstraw.training.trainer import Trainer

    CALLS.clear()
    cfg = _config(
        fixture,
        tmp_path / "chat",
        max_steps=1,
        dataset={"path": str(fixture["chat_data"])},
        tokenizer={"path": str(fixture["chat_tokenizer"])},
        check_reward_funcs=False,
    )
    trainer = Trainer(cfg)
    record = trainer.run(resume=False)[0]
    row = _rows(fixture["chat_data"])[record["dataset_index"]]
    tokenizer = trainer.text.tokenizer
    expected = tokenizer.apply_chat_template(
        row["prompt"], add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    prompt_ids = trainer.text.example(record["dataset_index"]).prompt_ids.tolist()
    assert prompt_ids == expected and prompt_ids[-1] == tokenizer.convert_tokens_to_ids("<|assistant|>")
    # TRL's conversational completions: one assistant message each (the record holds the same)
    (call,) = CALLS
    assert call["prompts"] == [row["prompt"]] * 4
    assert [c[0]["role"] for c in call["completions"]] == ["assistant"] * 4
    assert call["completions"] == record["completions"]
    assert record["rewards_per_func"]["word_share"] == word_share(None, call["completions"], None, None, StepState())
    CALLS.clear()


def test_text_prompts_are_tokenized_as_they_are_unless_wrapped(fixture):
    """TRL: a string prompt is tokenized as it is, chat template or not; wrap_text_prompts makes it a user message."""
    from longstraw.config import resolve_train
    from longstraw.training.text_tasks import TextTask

    base = _config(
        fixture, Path("unused"), tokenizer={"path": str(fixture["chat_tokenizer"])}, check_reward_funcs=False
    )
    plain = TextTask.from_config(resolve_train(base))
    text = _rows(fixture["data"])[0]["prompt"]
    assert plain.example(0).prompt_ids.tolist() == plain.tokenizer(text)["input_ids"]
    wrapping = {**base, "tokenizer": {**base["tokenizer"], "wrap_text_prompts": True}}
    wrapped = TextTask.from_config(resolve_train(wrapping))
    assert (
        wrapped.example(0).prompt_ids.tolist()
        == wrapped.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )


def test_none_rewards_follow_trl(fixture, tmp_path):
    """None is skipped in the weighted sum; an item no function scored has reward None (NaN in TRL),
    stays out of the group's mean and std, and gets advantage 0: the step's advantages are TRL's."""
    from longstraw.training.rewards import load_reward_funcs, score_group
    from longstraw.training.trainer import Trainer

    funcs = load_reward_funcs(["test_text_trainer:every_other", "test_text_trainer:only_odd"])
    completions = ["a b", "c", "d e f", "g h i j"]
    scored = score_group(funcs, [2.0, 4.0], ["p"] * 4, completions, [[]] * 4, {})
    trl_rewards, trl_advantages = _trl_rewards_and_advantages(
        [every_other(completions), only_odd(completions)], [2.0, 4.0]
    )
    assert scored.rewards[1::2] == [2.0 * 1 + 4.0 * 0.25, 2.0 * 4] == trl_rewards[1::2].tolist()
    assert all(math.isnan(r) for r in scored.rewards[0::2])
    assert scored.metrics["reward"] == pytest.approx((3.0 + 8.0) / 2)
    assert scored.metrics["rewards/every_other/mean"] == pytest.approx(2.5)
    assert scored.metrics["rewards/only_odd/mean"] == 0.25 and scored.metrics["rewards/only_odd/std"] is None
    assert scored.advantages == pytest.approx(trl_advantages.tolist(), abs=ARITH32)
    for scale in ("group", "none"):
        got = torch.tensor(
            score_group(funcs, [2.0, 4.0], ["p"] * 4, completions, [[]] * 4, {}, scale_rewards=scale).advantages
        )
        expected = trl_advantages if scale == "group" else torch.nan_to_num(trl_rewards - torch.nanmean(trl_rewards))
        assert got.tolist() == pytest.approx(expected.tolist(), abs=ARITH32)
    # and through the trainer: the record's rewards, advantages and metrics
    cfg = _config(
        fixture,
        tmp_path / "none",
        max_steps=1,
        reward_funcs=["test_text_trainer:every_other", "test_text_trainer:only_odd"],
        reward_weights=[2.0, 4.0],
    )
    record = Trainer(cfg).run(resume=False)[0]
    assert record["rewards"][0::2] == [None, None]
    assert record["rewards_per_func"]["only_odd"] == [None, 0.25, None, None]
    per_func = [record["rewards_per_func"]["every_other"], record["rewards_per_func"]["only_odd"]]
    _, advantages = _trl_rewards_and_advantages(per_func, [2.0, 4.0])
    assert record["advantages"] == pytest.approx(advantages.tolist(), abs=ARITH32)
    assert record["advantages"][0] == record["advantages"][2] == 0.0


def test_trl_names_are_the_sectioned_settings():
    from longstraw.config import ConfigError, resolve_train, to_mapping

    flat = resolve_train(
        {
            "learning_rate": 3e-4,
            "num_generations": 6,
            "max_completion_length": 12,
            "beta": 0.0,
            "epsilon": 0.3,
            "loss_type": "grpo",
            "temperature": 0.7,
            "top_p": 0.9,
            "max_steps": 5,
        }
    )
    sectioned = resolve_train(
        {
            "optimizer": {"lr": 3e-4},
            "sampling": {"max_new_tokens": 12, "temperature": 0.7, "top_p": 0.9},
            "grpo": {
                "num_generations": 6,
                "beta": 0.0,
                "epsilon": 0.3,
                "loss_type": "grpo",
                "max_completion_length": 12,
            },
            "steps": 5,
        }
    )
    assert to_mapping(flat) == to_mapping(sectioned) and flat.grpo.num_generations == 6
    assert resolve_train({"learning_rate": 1e-3, "optimizer": {"lr": 1e-3}}).optimizer.lr == 1e-3
    with pytest.raises(ConfigError, match=r"learning_rate: TRL's name for optimizer.lr, which says 0.001"):
        resolve_train({"learning_rate": 1e-5, "optimizer": {"lr": 1e-3}})
    with pytest.raises(ConfigError, match=r"num_generations: TRL's name for grpo.num_generations"):
        resolve_train({"num_generations": 8, "grpo": {"num_generations": 4}})
    with pytest.raises(ConfigError, match=r"sampling.num_samples: the group size is grpo.num_generations"):
        resolve_train({"sampling": {"num_samples": 4}})


def test_bad_text_configs_are_named_before_any_model_work(fixture, tmp_path, monkeypatch):
    from longstraw.config import ConfigError
    from longstraw.training import trainer as trainer_module
    from longstraw.training.trainer import Trainer

    def no_model(cfg):
        raise AssertionError("the model was built before the config was checked")

    monkeypatch.setattr(trainer_module, "build_policy", no_model)

    def refused(match, **changes):
        with pytest.raises(ValueError, match=match):
            Trainer(_config(fixture, tmp_path / "bad", **changes))

    refused(r"dataset.path: no dataset file .*missing.jsonl", dataset={"path": str(tmp_path / "missing.jsonl")})
    refused(
        r"reward function 'no_such_module:f': cannot import no_such_module: ModuleNotFoundError",
        reward_funcs=["no_such_module:f"],
        reward_weights=None,
    )
    refused(
        r"reward function 'test_text_trainer:missing': test_text_trainer has no attribute 'missing'",
        reward_funcs=["test_text_trainer:missing"],
        reward_weights=None,
    )
    no_prompt = write_jsonl(tmp_path / "no_prompt.jsonl", [{"prompt": "a b c"}, {"question": "x", "answer": "red"}])
    refused(
        r"no_prompt.jsonl line 2: no 'prompt' column \(columns: \['answer', 'question'\]\)",
        dataset={"path": str(no_prompt)},
    )
    bad_format = write_jsonl(tmp_path / "bad_format.jsonl", [{"prompt": {"text": "a"}}])
    refused(r"bad_format.jsonl line 1: the prompt must be a string", dataset={"path": str(bad_format)})
    refused(
        r"reward_funcs \(a check call on row 0 with 4 empty completions.*\): reward function "
        r"'test_text_trainer:one_short' returned 3 rewards for 4 completions",
        reward_funcs=["test_text_trainer:one_short"],
        reward_weights=None,
    )
    refused(
        r"reward function 'test_text_trainer:not_a_number' returned 'high' for completion 0",
        reward_funcs=["test_text_trainer:not_a_number"],
        reward_weights=None,
    )
    refused(
        r"reward function 'longstraw.training.rewards:contains_answer' failed: TypeError: .*answer",
        dataset={"path": str(write_jsonl(tmp_path / "no_answer.jsonl", [{"prompt": "a b"}]))},
    )
    refused(
        r"the tokenizer has no chat template, and row 0's prompt is a list of messages",
        dataset={"path": str(fixture["chat_data"])},
    )
    refused(r"reward_weights: 1 weights for 2 reward functions", reward_weights=[1.0])
    refused(r"reward_funcs: a text dataset needs at least one reward function", reward_funcs=[], reward_weights=None)
    refused(
        r"task: a synthetic task and a text dataset \(dataset\) are two sources of prompts",
        task={"name": "kv_retrieval", "length": 64},
    )
    refused(r"model.path: no checkpoint folder", model={"path": str(tmp_path / "nowhere")})
    refused(
        r"the tokenizer has \d+ tokens but the model's vocabulary has 16",
        model={"preset": "tiny-qwen3_5", "overrides": {"vocab_size": 16}},
        tokenizer={"path": str(fixture["checkpoint"])},
    )
    refused(
        r"test_text_trainer:word_share.*both named 'word_share'",
        reward_funcs=["test_text_trainer:word_share", "test_text_trainer.word_share"],
    )
    with pytest.raises(ConfigError, match=r"reward_funcs: belongs to a text dataset"):
        Trainer({"task": {"name": "kv_retrieval", "length": 64}, "reward_funcs": ["test_text_trainer:word_share"]})
    try:
        import datasets  # noqa: F401
    except ImportError:
        refused(r"dataset.name: needs the `datasets` package", dataset={"name": "some/dataset"})


def test_a_reward_of_the_wrong_length_during_training_is_named(fixture, tmp_path):
    from longstraw.training.trainer import Trainer

    trainer = Trainer(
        _config(
            fixture,
            tmp_path / "short",
            reward_funcs=["test_text_trainer:short_once_sampled"],
            reward_weights=None,
            max_steps=1,
            max_completion_length=3,
        )
    )
    with pytest.raises(
        ValueError,
        match=r"step 0: reward function 'test_text_trainer:short_once_sampled' returned "
        r"3 rewards for 4 completions",
    ):
        trainer.run(resume=False)


def test_the_example_config_runs_through_the_cli(fixture, tmp_path, capsys):
    import yaml

    from longstraw.cli import main

    example = yaml.safe_load(EXAMPLE.read_text())
    assert example["model"]["path"] == "runs/text_fixture/checkpoint"  # what `python tests/test_text_trainer.py` writes
    argv = [
        "train",
        str(EXAMPLE),
        "--no-resume",
        "--set",
        f"model.path={fixture['checkpoint']}",
        "--set",
        f"dataset.path={fixture['data']}",
        "--set",
        f"output.dir={tmp_path / 'cli'}",
        "--set",
        "max_steps=1",
        "--set",
        "output.checkpoint_every=1",
    ]
    assert main(argv) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["steps"] == 1 and (tmp_path / "cli" / "checkpoints" / "step-1" / "trainer.pt").is_file()
    # a bad config: exit status 2, the problem named
    assert (
        main(
            [
                "train",
                str(EXAMPLE),
                "--set",
                f"model.path={fixture['checkpoint']}",
                "--set",
                f"dataset.path={tmp_path / 'none.jsonl'}",
            ]
        )
        == 2
    )
    assert "no dataset file" in capsys.readouterr().err


def test_resume_reproduces_a_text_run(fixture, tmp_path):
    from longstraw.training.trainer import Trainer

    def run(out, **kwargs):
        cfg = _config(fixture, out, output={"dir": str(out), "checkpoint_every": 1})
        return Trainer(cfg).run(**kwargs)

    whole = run(tmp_path / "a", resume=False)
    run(tmp_path / "b", resume=False, stop_after=1)
    resumed = run(tmp_path / "b", resume=True)  # step 1 from the checkpoint of step 1
    drop = ("seconds", "transaction")
    assert [{k: v for k, v in r.items() if k not in drop} for r in resumed] == [
        {k: v for k, v in r.items() if k not in drop} for r in json.loads(json.dumps(whole))
    ]


class _FakeDataset:
    """What the trainer uses of a `datasets.Dataset`: column_names, len, rows by index."""

    def __init__(self, rows):
        self.rows, self.column_names = rows, sorted({k for r in rows for k in r})

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def test_hf_datasets_names_and_local_files_are_loaded_through_load_dataset(fixture, tmp_path, monkeypatch):
    """The `datasets` path with a stand-in module (the package is optional): the calls TRL's script makes."""
    import types

    from longstraw.config import resolve_train
    from longstraw.training.text_tasks import TextTask

    calls = []

    def load_dataset(*args, **kwargs):
        calls.append((args, kwargs))
        return _FakeDataset(_rows(fixture["data"]))

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    named = TextTask.from_config(
        resolve_train(
            _config(
                fixture,
                tmp_path,
                dataset=None,
                dataset_name="org/niah",
                dataset_config="short",
                dataset_train_split="test",
            )
        )
    )
    assert calls[-1] == (("org/niah", "short"), {"split": "test"})
    assert len(named) == 6 and named.columns == ["answer", "depth"]
    assert named.example(2).columns["answer"] == _rows(fixture["data"])[2]["answer"]
    local = tmp_path / "niah.parquet"
    local.write_bytes(b"")
    TextTask.from_config(resolve_train(_config(fixture, tmp_path, dataset={"path": str(local)})))
    assert calls[-1] == (("parquet",), {"data_files": str(local), "split": "train"})
    monkeypatch.setitem(
        sys.modules, "datasets", types.SimpleNamespace(load_dataset=lambda *a, **k: _FakeDataset([{"question": "q"}]))
    )
    with pytest.raises(ValueError, match=r"dataset.name: org/niah: no 'prompt' column \(columns: \['question'\]\)"):
        TextTask.from_config(resolve_train(_config(fixture, tmp_path, dataset={"name": "org/niah"})))


def test_a_local_json_file_through_hf_datasets(fixture, tmp_path):
    pytest.importorskip("datasets")
    from longstraw.config import resolve_train
    from longstraw.training.text_tasks import TextTask

    path = tmp_path / "niah.json"
    path.write_text(json.dumps(_rows(fixture["data"])))
    task = TextTask.from_config(resolve_train(_config(fixture, tmp_path, dataset={"path": str(path)})))
    assert len(task) == 6 and task.example(0).columns["answer"] == _rows(fixture["data"])[0]["answer"]


if __name__ == "__main__":  # the example's fixture: python tests/test_text_trainer.py runs/text_fixture
    sys.path.insert(0, str(REPO))
    made = make_fixture(Path(sys.argv[1] if len(sys.argv) > 1 else "runs/text_fixture"))
    print(json.dumps({k: str(v) for k, v in made.items()}))
