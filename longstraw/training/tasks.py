"""Verifiable long-context tasks on token ids (no tokenizer download), and the plugin interface.

    task = build_task({"name": "kv_retrieval", "length": 4096, "num_needles": 4, "value_length": 2},
                      vocab_size=model.config.vocab_size)
    example = task.make(seed=0)                  # Example(prompt_ids, answer, info)
    task.reward(example, response_ids)           # 1.0 when the response starts with the answer

Built-in tasks (the answer depends on the long prompt, so a model must read it):
- `kv_retrieval`: a haystack of filler tokens hiding `num_needles` needles
  `KEY k VAL v_1..v_m END` at `depths` (fractions of the prompt; random when not given); the
  prompt ends `QUERY k ANSWER` for one needle's key; the answer is its value tokens.
- `counting`: a haystack in which a marker token occurs n times (n uniform in
  [min_count, max_count]); the prompt ends `COUNT ANSWER`; the answer is the token `NUMBER + n`.
Difficulty knobs: prompt `length`, needle count and depth, value length, count range.
- `ruler`: RULER's tasks over real text in a real tokenizer (`longstraw.training.ruler.task`), e.g.
  `{"name": "ruler", "task": "vt", "tokenizer": CHECKPOINT, "length": 32768}`.
- `ruler_lookup`: an agent's task over RULER's essays (`longstraw.training.ruler.lookup`, played in environment
  `ruler_lookup`), e.g. `{"name": "ruler_lookup", "tokenizer": CHECKPOINT, "length": 32768, "hops": 2}`.

Token layout (ids below `vocab_size`): specials 0-7, numbers 8-71, keys and values in the next
two ranges, filler above. Rewards are exact match on the answer's tokens (partial credit per
token with `partial: true`).

Plugins: `register_task(name, factory)` makes `build_task({"name": name, ...})` call
`factory(vocab_size=..., **settings)`; any object with `make(seed) -> Example` and
`reward(example, response_ids) -> float` is a task, so real tokenizers, datasets and reward
functions plug in as a factory, and a task spec may name one by import path
(`{"plugin": "package.module:factory", ...}`). A factory's `folders` names the settings that are folders the task
reads (`task_folders`), and a task's `check_ready()` what it checks with them (`check_task_ready`): plans call both.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from longstraw.training.example import Example, Task

PAD, KEY, VAL, END, QUERY, ANSWER, COUNT, MARK = range(8)
NUMBER, NUMBERS = 8, 64
FIRST_FREE = NUMBER + NUMBERS


def _match_reward(example: Example, response_ids, partial: bool) -> float:
    got = [int(t) for t in response_ids[: len(example.answer)]]
    hits = sum(a == b for a, b in zip(got, example.answer))
    if partial:
        return hits / len(example.answer)
    return float(hits == len(example.answer))


def _split_vocab(vocab_size: int, parts: int) -> list[range]:
    """Equal ranges above the reserved ids: keys, values, filler (and more if asked)."""
    span = (vocab_size - FIRST_FREE) // parts
    if span < 2:
        raise ValueError(
            f"vocab_size {vocab_size} is too small for the task's token layout (needs > {FIRST_FREE + 2 * parts})"
        )
    return [range(FIRST_FREE + i * span, FIRST_FREE + (i + 1) * span) for i in range(parts)]


def _pick(rng: torch.Generator, ids: range, n: int, distinct: bool = False) -> list[int]:
    if distinct:
        if n > len(ids):
            raise ValueError(f"need {n} distinct tokens from a range of {len(ids)}")
        return [ids[i] for i in torch.randperm(len(ids), generator=rng)[:n].tolist()]
    return [ids[i] for i in torch.randint(len(ids), (n,), generator=rng).tolist()]


@dataclass
class KeyValueRetrieval:
    vocab_size: int
    length: int = 1024
    num_needles: int = 1
    value_length: int = 1
    depths: list[float] | None = None
    partial: bool = False

    def __post_init__(self):
        self.keys, self.values, self.filler = _split_vocab(self.vocab_size, 3)
        needle = self.num_needles * (self.value_length + 3)
        if self.length < needle + 3:
            raise ValueError(
                f"length {self.length} cannot hold {self.num_needles} needles of value length "
                f"{self.value_length} plus the query"
            )
        if self.depths is not None and (
            len(self.depths) != self.num_needles or not all(0 <= d <= 1 for d in self.depths)
        ):
            raise ValueError(f"depths must be {self.num_needles} fractions in [0, 1], got {self.depths}")

    def make(self, seed: int) -> Example:
        rng = torch.Generator().manual_seed(seed)
        body = self.length - 3  # the prompt ends QUERY key ANSWER
        keys = _pick(rng, self.keys, self.num_needles, distinct=True)
        needles = [[KEY, k, VAL, *_pick(rng, self.values, self.value_length), END] for k in keys]
        room = body - sum(len(n) for n in needles)
        depths = self.depths if self.depths is not None else torch.rand(self.num_needles, generator=rng).tolist()
        cuts = sorted((round(d * room), i) for i, d in enumerate(depths))
        tokens, placed = [], 0
        filler = _pick(rng, self.filler, room)
        for cut, i in cuts:
            tokens += filler[placed:cut] + needles[i]
            placed = cut
        tokens += filler[placed:]
        target = int(torch.randint(self.num_needles, (1,), generator=rng))
        tokens += [QUERY, keys[target], ANSWER]
        answer = tuple(needles[target][3:-1])
        return Example(torch.tensor(tokens), answer, {"key": keys[target], "depth": depths[target]})

    def reward(self, example: Example, response_ids) -> float:
        return _match_reward(example, response_ids, self.partial)


@dataclass
class Counting:
    vocab_size: int
    length: int = 1024
    min_count: int = 0
    max_count: int = 8

    def __post_init__(self):
        (self.filler,) = _split_vocab(self.vocab_size, 1)
        if not 0 <= self.min_count <= self.max_count < NUMBERS:
            raise ValueError(f"counts must satisfy 0 <= min_count <= max_count < {NUMBERS}")
        if self.length < self.max_count + 2:
            raise ValueError(f"length {self.length} cannot hold {self.max_count} markers and the question")

    def make(self, seed: int) -> Example:
        rng = torch.Generator().manual_seed(seed)
        body = self.length - 2  # the prompt ends COUNT ANSWER
        n = int(torch.randint(self.min_count, self.max_count + 1, (1,), generator=rng))
        tokens = _pick(rng, self.filler, body)
        for position in torch.randperm(body, generator=rng)[:n].tolist():
            tokens[position] = MARK
        return Example(torch.tensor(tokens + [COUNT, ANSWER]), (NUMBER + n,), {"count": n})

    def reward(self, example: Example, response_ids) -> float:
        return _match_reward(example, response_ids, partial=False)


def chance_level(task) -> dict:
    """{"value": chance success, "rule": how it was computed} (value None for unknown tasks)."""
    if isinstance(task, KeyValueRetrieval):
        copy = 1.0 / task.num_needles
        blind = 1.0 / len(task.values) ** task.value_length
        return {
            "value": max(copy, blind),
            "copy_one_needle": copy,
            "blind_guess": blind,
            "rule": "max(1/num_needles, 1/|values|^value_length): the queried needle is uniform among the "
            "needles, so ignoring the query key gives 1/num_needles",
        }
    if isinstance(task, Counting):
        return {
            "value": 1.0 / (task.max_count - task.min_count + 1),
            "rule": "1/(max_count - min_count + 1): counts are uniform",
        }
    return {"value": None, "rule": f"unknown for {type(task).__name__}"}


def _ruler(**settings) -> Task:
    """RULER's tasks over real text in a real tokenizer (`longstraw.training.ruler.task.RulerTask`), imported
    only when asked for."""
    from longstraw.training.ruler.task import RulerTask

    return RulerTask(**settings)


_ruler.folders = ("tokenizer",)  # the settings naming a folder the task reads (`task_folders`)


def _ruler_lookup(**settings) -> Task:
    """An agent's task over RULER's essays (`longstraw.training.ruler.task.RulerLookupTask`: a hidden chain of keys
    that only a lookup tool knows, values that only the context holds), imported only when asked for."""
    from longstraw.training.ruler.task import RulerLookupTask

    return RulerLookupTask(**settings)


_ruler_lookup.folders = ("tokenizer",)

TASKS: dict[str, Callable[..., Task]] = {
    "kv_retrieval": KeyValueRetrieval,
    "counting": Counting,
    "ruler": _ruler,
    "ruler_lookup": _ruler_lookup,
}


def register_task(name: str, factory: Callable[..., Task]) -> None:
    TASKS[name] = factory


def _factory(spec: dict):
    """(factory, settings) of a task spec: `{"name": registered name | "plugin": "module:factory", **settings}`."""
    if not isinstance(spec, dict):
        raise ValueError(f"a task spec is a mapping with 'name' (or 'plugin'), got {spec!r}")
    settings = dict(spec)
    if "plugin" in settings:
        module, _, attr = str(settings.pop("plugin")).partition(":")
        try:
            return getattr(importlib.import_module(module), attr), settings
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"task plugin {module}:{attr} cannot be loaded: {exc}") from None
    name = settings.pop("name", None)
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; registered: {sorted(TASKS)} (or give 'plugin')")
    return TASKS[name], settings


def check_task_spec(spec: dict, source: str = "task") -> None:
    """Refuse, before any work, a task spec whose task is unknown or whose settings the task does not
    take (a misspelt key), naming it."""
    try:
        factory, settings = _factory(spec)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None
    parameters = inspect.signature(factory).parameters
    if not any(p.kind == p.VAR_KEYWORD for p in parameters.values()):
        known = [k for k in parameters if k != "vocab_size"]
        for key in settings:
            if key not in parameters or key == "vocab_size":
                raise ValueError(f"{source}.{key}: unknown setting of this task (known: {known})")


def build_task(spec: dict, vocab_size: int) -> Task:
    """A task from its spec: `{"name": registered name | "plugin": "module:factory", **settings}`."""
    factory, settings = _factory(spec)
    return factory(vocab_size=vocab_size, **settings)


def task_folders(spec: dict) -> dict[str, str]:
    """{setting: folder} of the folders a task reads when it runs (a factory's `folders`: a RULER task's
    tokenizer), which a plan may find not written yet."""
    factory, settings = _factory(spec)
    return {key: str(settings[key]) for key in getattr(factory, "folders", ()) if settings.get(key)}


def check_task_ready(spec: dict, vocab_size: int) -> None:
    """What a task can check only with its folders there (`check_ready`, where the task has one: a RULER task's
    tokenizer), before any work; `example.TaskNotReady` names the setting."""
    check = getattr(build_task(spec, vocab_size), "check_ready", None)
    if check is not None:
        check()
