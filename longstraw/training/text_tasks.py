"""Text prompts for the trainer, in TRL's terms: a dataset with a `prompt` column, a tokenizer,
reward functions over the decoded completions (`longstraw.training.rewards`).

    task = TextTask.from_config(cfg)          # cfg: a TrainConfig with `dataset` (checks all, no model)
    example = task.example(i)                 # TextExample: prompt_ids, the row's prompt and columns
    scored = task.score(example, response_ids, step=3, max_steps=8, epoch=0.4)

Dataset formats (TRL's): standard, `prompt` is a string, tokenized as it is (the tokenizer's own
special tokens, e.g. BOS, added as `tokenizer(text)` adds them); conversational, `prompt` is a
list of `{"role", "content"}` messages, rendered by the tokenizer's chat template with
`add_generation_prompt=True` (and `tokenizer.chat_template_kwargs`). `tokenizer.wrap_text_prompts`
makes a string prompt one user message (TRL does not). Completions are decoded with
`skip_special_tokens=True`: strings for a standard prompt, `[{"role": "assistant", "content": text}]`
for a conversational one (TRL's form when the tokenizer has no response schema to parse). Sampling
stops at the tokenizer's EOS token, which stays in the completion's ids (and its loss), as in TRL.

Datasets: a local JSONL file (one JSON object per line) is read here; other local files (`.json`,
`.csv`, `.parquet`) and HF dataset names go through `datasets.load_dataset` when `datasets` is
installed. Every column but `prompt` reaches the reward functions as a keyword list (a row missing
a column other rows have gives None there).

Everything is checked before any model work: the files, the `prompt` column and its format in
every row (a JSONL file; a HF dataset's first row), the chat template a conversational prompt needs,
the tokenizer against the model's vocabulary, every row of a JSONL file tokenized once (at least 2
tokens, and with `sampling.max_new_tokens` after it within the model's `max_position_embeddings`
unless `capture.beyond_max_positions`; the first bad row is named), the reward functions' imports and, unless
`check_reward_funcs: false`, one call of each on the first prompt with G empty completions.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from longstraw.training.rewards import RESERVED_KWARGS, RewardFunc, Scored, StepState, load_reward_funcs, score_group

DATASET_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}


@dataclass(frozen=True)
class TextExample:
    index: int  # the dataset row
    prompt_ids: torch.Tensor
    prompt: object  # the row's prompt as given: a string or a list of messages
    columns: dict = field(default_factory=dict)  # the row's other columns

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def _is_messages(prompt) -> bool:
    return (
        isinstance(prompt, list)
        and bool(prompt)
        and all(isinstance(m, dict) and isinstance(m.get("role"), str) and "content" in m for m in prompt)
    )


def check_prompt(prompt, where: str) -> None:
    """A prompt in TRL's standard (a string) or conversational (a list of role/content messages) format."""
    if isinstance(prompt, str):
        if not prompt:
            raise ValueError(f"{where}: the prompt is an empty string")
        return
    if not _is_messages(prompt):
        raise ValueError(
            f"{where}: the prompt must be a string (standard format) or a non-empty list of "
            f"{{'role': ..., 'content': ...}} messages (conversational format), got {prompt!r:.200}"
        )


def read_jsonl(path: Path, source: str = "dataset.path") -> list[dict]:
    """Rows of a JSONL file; each must be a JSON object with a `prompt` column of either format."""
    rows = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{source}: {path} line {number}: not JSON ({exc})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{source}: {path} line {number}: expected a JSON object, got {type(row).__name__}")
            if "prompt" not in row:
                raise ValueError(f"{source}: {path} line {number}: no 'prompt' column (columns: {sorted(row)})")
            check_prompt(row["prompt"], f"{source}: {path} line {number}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{source}: {path} holds no rows")
    return rows


def _datasets_module(source: str):
    try:
        import datasets
    except ImportError:
        raise ValueError(
            f"{source}: needs the `datasets` package (pip install datasets), which is not "
            "installed; a local JSONL file (dataset.path: FILE.jsonl) needs nothing"
        ) from None
    return datasets


def load_rows(cfg, source: str = "dataset"):
    """The dataset's rows (a list of dicts, or a HF `datasets.Dataset`), checked as the module says."""
    if cfg.path is not None:
        path = Path(cfg.path)
        if not path.is_file():
            raise ValueError(f"{source}.path: no dataset file {path}")
        if cfg.loader == "jsonl" or (cfg.loader == "auto" and path.suffix == ".jsonl"):
            return read_jsonl(path, f"{source}.path")
        builder = DATASET_BUILDERS.get(path.suffix)
        if builder is None:
            raise ValueError(
                f"{source}.path: {path}: no datasets loader for {path.suffix!r} files "
                f"(known: {sorted(DATASET_BUILDERS)})"
            )
        datasets = _datasets_module(f"{source}.path ({path.suffix} file)")
        rows = datasets.load_dataset(builder, data_files=str(path), split=cfg.split)
        where = f"{source}.path: {path}"
    else:
        datasets = _datasets_module(f"{source}.name")
        try:
            rows = datasets.load_dataset(cfg.name, cfg.config, split=cfg.split)
        except Exception as exc:
            raise ValueError(
                f"{source}.name: cannot load {cfg.name!r} (config {cfg.config!r}, split "
                f"{cfg.split!r}): {type(exc).__name__}: {exc}"
            ) from None
        where = f"{source}.name: {cfg.name}"
    if len(rows) == 0:
        raise ValueError(f"{where}: the split {cfg.split!r} holds no rows")
    if "prompt" not in rows.column_names:
        raise ValueError(f"{where}: no 'prompt' column (columns: {rows.column_names})")
    check_prompt(rows[0]["prompt"], f"{where} row 0")
    return rows


def _columns(rows) -> list[str]:
    names = getattr(rows, "column_names", None)
    if names is None:
        names = list(dict.fromkeys(k for row in rows for k in row))
    return [c for c in names if c != "prompt"]


def load_tokenizer(cfg, source: str = "tokenizer"):
    """`transformers.AutoTokenizer` from the local folder (`tokenizer.path`, else `model.path`)."""
    path = (cfg.tokenizer.path if cfg.tokenizer and cfg.tokenizer.path else None) or cfg.model.path
    if path is None:
        raise ValueError(
            f"{source}.path: a text dataset needs a tokenizer; give tokenizer.path (or model.path, "
            "a checkpoint saved with its tokenizer)"
        )
    key = f"{source}.path" if cfg.tokenizer and cfg.tokenizer.path else "model.path"
    if not Path(path).is_dir():
        raise ValueError(f"{key}: no tokenizer folder {path}")
    import transformers

    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise ValueError(f"{key}: cannot load a tokenizer from {path}: {type(exc).__name__}: {exc}") from None
    if cfg.tokenizer and cfg.tokenizer.chat_template:
        tokenizer.chat_template = cfg.tokenizer.chat_template
    return tokenizer, key


def model_vocab_size(model_cfg) -> int:
    """The policy's vocabulary size from its config alone (no weights)."""
    return model_limits(model_cfg)[0]


def model_limits(model_cfg) -> tuple[int, int | None]:
    """(vocabulary size, max_position_embeddings or None) of the policy, from its config alone (no weights)."""
    if model_cfg.path:
        import transformers

        path = Path(model_cfg.path)
        if not (path / "config.json").is_file():
            raise ValueError(f"model.path: no checkpoint folder {path} (config.json)")
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    else:
        from longstraw.models.presets import make_config

        config = make_config(model_cfg.preset, **model_cfg.overrides)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    limit = getattr(text, "max_position_embeddings", None)
    return int(text.vocab_size), (int(limit) if limit else None)


class TextTask:
    """A text dataset's prompts and the reward functions over their completions."""

    def __init__(
        self,
        rows,
        tokenizer,
        reward_funcs: list[RewardFunc],
        reward_weights=None,
        *,
        chat_template_kwargs: dict | None = None,
        wrap_text_prompts: bool = False,
        scale_rewards="group",
        source: str = "text task",
    ):
        self.rows, self.tokenizer, self.reward_funcs = rows, tokenizer, reward_funcs
        self.reward_weights = list(reward_weights) if reward_weights is not None else [1.0] * len(reward_funcs)
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.wrap_text_prompts = wrap_text_prompts
        self.scale_rewards = scale_rewards
        self.source = source
        self.columns = _columns(rows)
        reserved = [c for c in self.columns if c in RESERVED_KWARGS]
        if reserved:
            raise ValueError(
                f"{source}: dataset column {reserved[0]!r} has the name of a keyword the trainer passes "
                f"to reward functions ({', '.join(RESERVED_KWARGS)}); rename it"
            )
        eos = tokenizer.eos_token_id
        self.stop_ids = () if eos is None else (int(eos),)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else (eos if eos is not None else 0))
        self._ids: list[list[int]] | None = None  # every row's prompt ids, once `tokenize_rows` ran

    # ---- set-up
    @classmethod
    def from_config(cls, cfg, source: str = "train config") -> TextTask:
        """The task of a TrainConfig with a dataset, every input checked (module docstring), no model built."""
        funcs = load_reward_funcs(cfg.reward_funcs)  # first: the cheapest to get wrong
        rows = load_rows(cfg.dataset, f"{source}: dataset")
        tokenizer, key = load_tokenizer(cfg, f"{source}: tokenizer")
        vocab, limit = model_limits(cfg.model)
        if len(tokenizer) > vocab:
            raise ValueError(
                f"{source}: {key}: the tokenizer has {len(tokenizer)} tokens but the model's vocabulary "
                f"has {vocab} (vocab_size); its ids would index past the embeddings"
            )
        t = cfg.tokenizer
        task = cls(
            rows,
            tokenizer,
            funcs,
            cfg.reward_weights,
            chat_template_kwargs=t.chat_template_kwargs if t else None,
            wrap_text_prompts=bool(t and t.wrap_text_prompts),
            scale_rewards=cfg.grpo.scale_rewards,
            source=f"{source}: dataset",
        )
        if isinstance(rows, list):  # a JSONL file, read whole: every row's prompt is known
            if any(task._messages(row["prompt"]) is not None for row in rows) and not tokenizer.chat_template:
                first = next(i for i, row in enumerate(rows) if task._messages(row["prompt"]) is not None)
                raise ValueError(
                    f"{source}: {key}: the tokenizer has no chat template, and row {first}'s prompt is a "
                    "list of messages (TRL's conversational format) that needs one; set "
                    "tokenizer.chat_template"
                )
            # every row tokenized once, here: one too short to capture or too long for the model is named now
            task.tokenize_rows(
                None if cfg.capture.beyond_max_positions else limit,
                cfg.sampling.max_new_tokens,
                f"{source}: dataset.path: {cfg.dataset.path}",
            )
        example = task.example(0)
        if cfg.check_reward_funcs:
            G = cfg.grpo.num_generations
            with warnings.catch_warnings():  # empty completions may well be unscorable: no warning for the check
                warnings.simplefilter("ignore")
                task.score(
                    example,
                    [torch.zeros(0, dtype=torch.long)] * G,
                    where=f"{source}: reward_funcs (a check "
                    f"call on row 0 with {G} empty completions; check_reward_funcs: false skips it)",
                )
        return task

    def __len__(self) -> int:
        return len(self.rows)

    # ---- prompts
    def _messages(self, prompt):
        """The messages the chat template renders, or None for a prompt tokenized as it is."""
        if isinstance(prompt, list):
            return prompt
        return [{"role": "user", "content": prompt}] if self.wrap_text_prompts else None

    def prompt_ids(self, prompt, where: str = "prompt") -> list[int]:
        messages = self._messages(prompt)
        if messages is None:
            return list(self.tokenizer(prompt)["input_ids"])
        if not self.tokenizer.chat_template:
            raise ValueError(
                f"{where}: a conversational prompt needs the tokenizer's chat template, and it has "
                "none; set tokenizer.chat_template"
            )
        out = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=True, **self.chat_template_kwargs
        )
        ids = out["input_ids"]
        return list(ids[0] if ids and isinstance(ids[0], list) else ids)

    def tokenize_rows(self, limit: int | None, max_new_tokens: int, where: str) -> None:
        """Tokenize every row's prompt once (a batch call for string prompts), keep the ids for `example`,
        and refuse the first row whose prompt is under 2 tokens, or, with `limit`, longer than the model's
        positions or too long for `max_new_tokens` more after it."""
        prompts = [row["prompt"] for row in self.rows]
        plain = [i for i, p in enumerate(prompts) if self._messages(p) is None]
        ids: list = [None] * len(prompts)
        if plain:
            for i, row_ids in zip(plain, self.tokenizer([prompts[i] for i in plain])["input_ids"]):
                ids[i] = list(row_ids)
        for i, prompt in enumerate(prompts):
            if ids[i] is None:
                ids[i] = self.prompt_ids(prompt, f"{where} row {i}")
        for i, row_ids in enumerate(ids):
            n = len(row_ids)
            if n < 2:
                raise ValueError(f"{where} row {i}: the prompt is {n} token(s); a capture needs at least 2")
            if limit and n > limit:
                raise ValueError(
                    f"{where} row {i}: the prompt is {n:,} tokens, more than the {limit:,} positions the "
                    "model was configured for (max_position_embeddings); set "
                    "capture.beyond_max_positions: true to run it anyway"
                )
            if limit and n + max_new_tokens > limit:
                raise ValueError(
                    f"{where} row {i}: the prompt's {n:,} tokens and up to {max_new_tokens:,} sampled "
                    f"(sampling.max_new_tokens) run past the {limit:,} positions the model was "
                    "configured for (max_position_embeddings); set capture.beyond_max_positions: true "
                    "to run them anyway"
                )
        self._ids = ids

    def example(self, index: int) -> TextExample:
        row = dict(self.rows[index])
        where = f"{self.source} row {index}"
        check_prompt(row.get("prompt"), where)
        ids = self._ids[index] if self._ids is not None else self.prompt_ids(row["prompt"], where)
        if len(ids) < 2:
            raise ValueError(f"{where}: the prompt is {len(ids)} token(s); a capture needs at least 2")
        columns = {c: row.get(c) for c in self.columns}
        return TextExample(index, torch.tensor(ids, dtype=torch.long), row["prompt"], columns)

    def order(self, epoch: int, seed: int, shuffle: bool) -> list[int]:
        """The rows' order in pass `epoch` over the dataset (a seeded permutation per pass when shuffled)."""
        if not shuffle:
            return list(range(len(self)))
        generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        return torch.randperm(len(self), generator=generator).tolist()

    # ---- completions and rewards
    def decode(self, example: TextExample, response_ids) -> list:
        texts = self.tokenizer.batch_decode([[int(t) for t in r] for r in response_ids], skip_special_tokens=True)
        if self._messages(example.prompt) is not None:
            return [[{"role": "assistant", "content": t}] for t in texts]
        return texts

    def score(
        self,
        example: TextExample,
        response_ids,
        *,
        step: int = 0,
        max_steps: int = 0,
        epoch: float = 0.0,
        where: str | None = None,
    ) -> tuple[Scored, list]:
        """(Scored, completions): every reward function on the group's decoded completions."""
        G = len(response_ids)
        completions = self.decode(example, response_ids)
        columns = {c: [v] * G for c, v in example.columns.items()}
        scored = score_group(
            self.reward_funcs,
            self.reward_weights,
            [example.prompt] * G,
            completions,
            [[int(t) for t in r] for r in response_ids],
            columns,
            scale_rewards=self.scale_rewards,
            state=StepState(step, max_steps, epoch),
            where=where or f"step {step}",
        )
        return scored, completions


def completion_metrics(lengths: list[int], finished: list[bool]) -> dict:
    """TRL's completion-length metrics (lengths in tokens, the stop token included); `clipped_ratio`:
    the share that ran to the length limit without a stop token."""
    t = torch.tensor(lengths, dtype=torch.float64)
    done = torch.tensor([length for length, f in zip(lengths, finished) if f] or [0], dtype=torch.float64)
    return {
        "completions/mean_length": float(t.mean()),
        "completions/min_length": float(t.min()),
        "completions/max_length": float(t.max()),
        "completions/clipped_ratio": sum(not f for f in finished) / max(len(finished), 1),
        "completions/mean_terminated_length": float(done.mean()),
        "completions/min_terminated_length": float(done.min()),
        "completions/max_terminated_length": float(done.max()),
    }


def json_safe(value):
    """NaN as None (JSON has no NaN), through lists and dicts."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    return value
