"""Environments for multi-turn rollouts (`training.agent_rollout`), in the terms of TRL's and verifiers' ones:

    make = load_environment("lookup", {"keys": 8, "hops": 2, "seed": 0})
    env = make()                                   # one per trajectory: an environment keeps its episode's state
    first = env.reset(example)                     # the first observation
    observation, reward, done = env.step(action)   # after each action

An environment is a plain Python object, seeded by its arguments, that reaches no network: `reset(example)` starts
an episode for a dataset row and returns its first observation, `step(action)` takes one action and returns the
next observation, the action's reward and whether the episode is over. With `text = True` it reads actions and
writes observations as text (the rollout decodes and encodes them with the tokenizer); otherwise as token ids
(a sequence of ints). An action is the turn's sampled tokens, its stop id left out (TRL decodes completions
skipping it).

A spec names a built-in (`ENVIRONMENTS`) or a class as reward functions are named (`package.module:Class`,
`path/to/file.py:Class`: `rewards.import_named`); its arguments are the class's keywords.
"""

from __future__ import annotations

import functools
import math
import numbers
import random
import re
from collections.abc import Callable
from typing import Protocol

from longstraw.training.rewards import import_named


class Environment(Protocol):
    text: bool  # actions and observations as text (else token ids)

    def reset(self, example): ...

    def step(self, action) -> tuple[object, float, bool]: ...


class LookupEnvironment:
    """A toy tool over a seeded table that sends each of `keys` keys (`k0`, `k1`, ...) to a next-hop key: the task
    is the key `hops` hops from the start. `lookup KEY` observes KEY's next hop (`unknown` for any other action);
    `answer KEY` ends the episode with reward 1 if KEY is the one `hops` hops from the start, else 0."""

    text = True

    def __init__(self, keys: int = 8, hops: int = 2, seed: int = 0):
        for name, value, least in (("keys", keys, 2), ("hops", hops, 1)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"lookup environment: {name} must be an integer >= {least}, got {value!r}")
        self.rng = random.Random(seed)
        names = [f"k{i}" for i in range(keys)]
        hops_to = names[:]
        self.rng.shuffle(hops_to)
        self.table, self.hops, self.target = dict(zip(names, hops_to)), hops, None

    def reset(self, example=None) -> str:
        """`example["start"]` (else a seeded draw) as the first observation `start KEY`."""
        start = (example or {}).get("start") or self.rng.choice(sorted(self.table))
        if start not in self.table:
            raise ValueError(f"lookup environment: start {start!r} is not a key (k0 .. k{len(self.table) - 1})")
        self.target = start
        for _ in range(self.hops):
            self.target = self.table[self.target]
        return f"start {start}\n"

    def step(self, action: str) -> tuple[str, float, bool]:
        verb, _, key = action.strip().partition(" ")
        key = key.strip()
        if verb == "answer":
            return "", float(key == self.target), True
        if verb == "lookup" and key in self.table:
            return f"{self.table[key]}\n", 0.0, False
        return "unknown\n", 0.0, False


class RulerLookupEnvironment:
    """The tool of RULER's lookup task (`training/ruler/lookup.py`, task `ruler_lookup`), whose example `info` holds
    the hidden chain of keys k0 -> ... -> k_h, the answer (k_h's value, which only the context says) and the frame
    of a tool's answer in the conversation. An action is read as a lookup where it says `lookup KEY` (observed: the
    key KEY links to, or `KEY links to no key` at the chain's end or off it), else as an answer where it says
    `answer NUMBER` or, failing that, states a 7-digit number (RULER's values): the episode ends with reward 1 when
    the number is the answer, else 0; anything else is answered with the two actions' forms. Each turn also costs
    `turn_penalty`, so a trajectory's reward is its exact match less `turn_penalty` times its turns. The first
    observation is empty: the prompt poses the task."""

    text = True
    LOOKUP = re.compile(r"lookup\W+([\w-]+)", re.IGNORECASE)
    ANSWER = re.compile(r"answer\W*(\d+)|\b(\d{7})\b", re.IGNORECASE)

    def __init__(self, turn_penalty: float = 0.02):
        if isinstance(turn_penalty, bool) or not isinstance(turn_penalty, numbers.Real) or not 0 <= turn_penalty < 1:
            raise ValueError(f"ruler_lookup environment: turn_penalty must be a number in [0, 1), got {turn_penalty!r}")
        self.penalty, self.chain, self.answer, self.frame = float(turn_penalty), [], None, ("\n", "\n")

    def reset(self, example) -> str:
        missing = [k for k in ("chain", "references") if k not in (example or {})]
        if missing:
            raise ValueError(f"ruler_lookup environment: the example has no {', '.join(missing)} (task ruler_lookup's)")
        self.chain, self.answer = list(example["chain"]), example["references"][0]
        self.frame = tuple(example.get("turn_frame", self.frame))
        return ""

    def step(self, action: str) -> tuple[str, float, bool]:
        if lookup := self.LOOKUP.search(action):
            key = lookup[1]
            said = self.chain[self.chain.index(key) + 1] if key in self.chain[:-1] else f"{key} links to no key"
        elif answer := self.ANSWER.search(action):
            return "", float((answer[1] or answer[2]) == self.answer) - self.penalty, True
        else:
            said = "reply `lookup KEY` or `answer NUMBER`"
        return f"{self.frame[0]}{said}{self.frame[1]}", -self.penalty, False


ENVIRONMENTS = {"lookup": LookupEnvironment, "ruler_lookup": RulerLookupEnvironment}


def register_environment(name: str, cls) -> None:
    """A built-in under `name` (a plugin's, a test's), as `tasks.register_task` registers a task."""
    ENVIRONMENTS[name] = cls


class BadEnvironment(ValueError):
    """What `load_environment` refuses; `setting`: `name` (no such class, or no environment) or `args` (it does
    not build with them)."""

    def __init__(self, setting: str, message: str):
        super().__init__(message)
        self.setting = setting


def load_environment(spec: str, args: dict | None = None) -> Callable[[], Environment]:
    """A factory of fresh environments for `spec` (a name in `ENVIRONMENTS` or `package.module:Class`) built with
    `args`; one is built here, so bad arguments and a class that is no environment are refused before any
    rollout (`BadEnvironment`)."""
    try:
        cls = (ENVIRONMENTS.get(spec) if isinstance(spec, str) else None) or import_named(spec, "environment")
    except ValueError as exc:
        raise BadEnvironment("name", str(exc)) from None
    make = functools.partial(cls, **(args or {}))
    try:
        env = make()
    except TypeError as exc:
        raise BadEnvironment("args", f"environment {spec!r}: cannot build it with {args or {}}: {exc}") from None
    except ValueError as exc:  # its own checks of its arguments
        raise BadEnvironment("args", str(exc)) from None
    try:
        check_environment(env, spec)
    except ValueError as exc:
        raise BadEnvironment("name", str(exc)) from None
    return make


def check_environment(env, name) -> None:
    """Refuse an object that has no `reset` and `step` or no bool `text`."""
    missing = [m for m in ("reset", "step") if not callable(getattr(env, m, None))]
    if missing or not isinstance(getattr(env, "text", None), bool):
        raise ValueError(
            f"environment {name!r}: {type(env).__name__} needs reset(example), step(action) and a bool `text` "
            f"(missing: {', '.join(missing) or 'text'})"
        )


def checked_step(env, result) -> tuple[object, float, bool]:
    """`env.step`'s result as (observation, reward, done), or an error naming the environment."""
    name = type(env).__name__
    if not isinstance(result, tuple) or len(result) != 3:
        raise ValueError(f"environment {name}: step() must return (observation, reward, done), got {result!r}")
    observation, reward, done = result
    if isinstance(reward, bool) or not isinstance(reward, numbers.Real) or not math.isfinite(reward):
        raise ValueError(f"environment {name}: step()'s reward must be a finite number, got {reward!r}")
    if not isinstance(done, bool):
        raise ValueError(f"environment {name}: step()'s done must be a bool, got {done!r}")
    return observation, float(reward), done
