"""A RULER task as a task of `longstraw.training.tasks` (`{"name": "ruler", ...}`): token ids in, a reward out,
so that every kind built on tasks (the trainer, length curves, V4, the staleness oracle, rollout cycles)
runs it on a real model and tokenizer unchanged.

    task = build_task({"name": "ruler", "task": "vt", "tokenizer": "models/smollm2", "length": 32768}, vocab)
    example = task.make(seed)            # the chat-formatted prompt's ids, the reference answers in info
    task.reward(example, response_ids)   # RULER's metric on the decoded response

`make(seed)` is `make_example(..., chat=True)` tokenized as the trainer tokenizes a string prompt: the
chat template and RULER's answer prefix after the generation prompt, so the response continues the
answer. `Example.answer` holds the ids of the references joined as RULER writes them, and
`info["max_new_tokens"]` a few more, what a greedy answer gets (`length_curve`); sampling stops at the
tokenizer's EOS (`stop_ids`). The reward is RULER's metric on the decoded response, not `answer`'s ids.
`RulerLookupTask` (task `ruler_lookup`) is the agent's task over the same haystacks (`ruler/lookup.py`): its
example's `info` holds what environment `ruler_lookup` plays it with (the hidden chain, the answer, the frame of a
tool's answer); one turn alone scores an `answer VALUE` reply against the value (`reward`).
The tokenizer loads on first use, so a plan can build the task before its checkpoint exists; `check_ready` checks
what needs it (its folder, vocabulary and chat template, a length that holds the template), where the plan finds it
or, at the latest, before the point's model is built.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import torch

from longstraw.training.example import Example, TaskNotReady
from longstraw.training.ruler.fit import TooShort
from longstraw.training.ruler.formats import TASKS
from longstraw.training.ruler.lookup import check_lookup_length, make_lookup_example, turn_frame
from longstraw.training.ruler.rewards import string_match_all, string_match_part
from longstraw.training.ruler.tasks import check_length, make_example

METRICS = {"string_match_all": string_match_all, "string_match_part": string_match_part}
ANSWER_SLACK = 4  # greedy tokens past the references' own (a closing period, a stop token)


@functools.cache
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    if not Path(path).is_dir():  # else transformers takes it for a hub id and says so
        raise TaskNotReady("tokenizer", f"no tokenizer folder {path}")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise TaskNotReady("tokenizer", f"{path} holds no tokenizer transformers can load ({exc})") from None


@dataclass
class RulerTask:
    vocab_size: int
    length: int = 4096
    task: str = "niah_single_1"
    tokenizer: str = ""  # a tokenizer folder (a checkpoint's own)
    depth: float | None = None  # the first answering needle's depth; None: RULER's depth grid, by seed
    chat: bool = True

    def __post_init__(self):
        if self.task not in TASKS:
            raise ValueError(f"unknown RULER task {self.task!r}; known: {', '.join(TASKS)}")
        if not self.tokenizer:
            raise ValueError("tokenizer: the folder of the tokenizer the prompts are measured in (a checkpoint's)")
        if self.depth is not None and not 0 <= self.depth <= 1:
            raise ValueError(f"depth must be in [0, 1], got {self.depth}")

    @property
    def loaded(self):
        tokenizer = _tokenizer(self.tokenizer)
        if len(tokenizer) > self.vocab_size:
            raise TaskNotReady(
                "tokenizer",
                f"{self.tokenizer} has {len(tokenizer)} tokens, more than the model's {self.vocab_size}",
            )
        if self.chat and not getattr(tokenizer, "chat_template", None):
            raise TaskNotReady(
                "chat", f"true, but the tokenizer in {self.tokenizer} has no chat template; set chat: false"
            )
        return tokenizer

    def check_ready(self) -> None:
        """What needs the tokenizer, before any work: it loads, fits the model's vocabulary, has the chat template
        `chat` asks for, and `length` holds one example's template and needles."""
        try:
            check_length(self.task, self.loaded, self.length, chat=self.chat)
        except TooShort as exc:
            raise TaskNotReady("length", f"{exc} (RULER's {self.task} in this tokenizer)") from None

    @property
    def stop_ids(self) -> tuple[int, ...]:
        eos = self.loaded.eos_token_id
        return () if eos is None else (int(eos),)

    def make(self, seed: int) -> Example:
        return self.make_at_depth(seed, self.depth)

    def make_at_depth(self, seed: int, depth: float | None) -> Example:
        tokenizer = self.loaded
        made = make_example(self.task, tokenizer, self.length, seed, depth=depth, chat=self.chat)
        ids = made.ids if made.ids is not None else tokenizer(made.prompt)["input_ids"]  # tokenized once
        answer = tokenizer(" " + ", ".join(made.answer), add_special_tokens=False)["input_ids"]
        return Example(
            torch.tensor(ids),
            tuple(answer),
            {
                "depth": made.depth,
                "references": list(made.answer),
                "task": self.task,
                "seed": seed,
                "max_new_tokens": len(answer) + ANSWER_SLACK,
            },
        )

    def reward(self, example: Example, response_ids) -> float:
        text = self.loaded.decode([int(t) for t in response_ids], skip_special_tokens=True)
        metric = METRICS[TASKS[self.task].metric]
        return float(metric([None], [text], [example.info["references"]])[0])


@dataclass
class RulerLookupTask(RulerTask):
    """RULER's essays with one needle per key of a hidden chain of `hops` links and `distractors` more
    (`ruler/lookup.py`), for an agent with a lookup tool (environment `ruler_lookup`)."""

    task: str = "ruler_lookup"
    hops: int = 2
    distractors: int = 2

    def __post_init__(self):
        if not self.tokenizer:
            raise ValueError("tokenizer: the folder of the tokenizer the prompts are measured in (a checkpoint's)")
        if self.task != "ruler_lookup":
            raise ValueError(f"task: {self.task!r}; this task is 'ruler_lookup' (RULER's own: task 'ruler')")
        for name, value, least in (("hops", self.hops, 1), ("distractors", self.distractors, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"{name} must be an integer >= {least}, got {value!r}")
        if self.depth is not None and not 0 <= self.depth <= 1:
            raise ValueError(f"depth must be in [0, 1], got {self.depth}")

    def check_ready(self) -> None:
        try:
            check_lookup_length(self.loaded, self.length, hops=self.hops, distractors=self.distractors, chat=self.chat)
        except TooShort as exc:
            raise TaskNotReady("length", f"{exc} (ruler_lookup in this tokenizer)") from None

    def make_at_depth(self, seed: int, depth: float | None) -> Example:
        tokenizer = self.loaded
        made = make_lookup_example(
            tokenizer, self.length, seed, hops=self.hops, distractors=self.distractors, depth=depth, chat=self.chat
        )
        answer = tokenizer(f"answer {made.value}", add_special_tokens=False)["input_ids"]
        info = {
            "chain": made.chain,
            "references": [made.value],
            "turn_frame": list(turn_frame(tokenizer, self.chat)),
            "task": self.task,
            "seed": seed,
            "depth": made.depths[self.hops],
            "max_new_tokens": len(answer) + ANSWER_SLACK,
        }
        return Example(torch.tensor(tokenizer(made.prompt)["input_ids"]), tuple(answer), info)

    def reward(self, example: Example, response_ids) -> float:
        """One reply alone: 1 when it is `answer VALUE` with the answer (as the environment reads it), else 0."""
        from longstraw.training.environments import RulerLookupEnvironment

        env = RulerLookupEnvironment(turn_penalty=0.0)
        env.reset(example.info)
        text = self.loaded.decode([int(t) for t in response_ids], skip_special_tokens=True)
        return max(env.step(text)[1], 0.0)
