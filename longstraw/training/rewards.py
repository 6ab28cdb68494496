"""Reward functions in TRL's terms: loaded by import path, called with TRL's signature, combined
and turned into advantages as TRL's `GRPOTrainer` does (sum_then_normalize).

    funcs = load_reward_funcs(["longstraw.training.rewards:contains_answer", "my_rewards.py:brevity"])
    scored = score_group(funcs, [1.0, 0.5], prompts, completions, completion_ids, columns)
    scored.rewards            # weighted sum per completion (NaN where every function returned None)
    scored.advantages         # TRL's group advantages (unscorable items: 0), which `grpo_step` is given

A reward function is `reward_func(prompts, completions, **kwargs) -> list[float | None]`, one value
per completion. Keyword arguments (TRL's): `completion_ids` (token ids, the stop token included),
every dataset column but `prompt` (one list entry per completion: a group repeats its row G
times), `trainer_state` (an object with `global_step`, `max_steps`, `epoch`: not HF's
`TrainerState`, whose import costs seconds), `log_metric(name, value)` (a scalar into the step's
record) and `log_extra(column, values)` (a column of per-completion values into the record's
`completion_extra`). Give a function `**kwargs` to ignore the rest.

What follows TRL (trl/trainer/grpo_trainer.py, `_calculate_rewards` and
`_generate_and_score_completions`, checked at TRL's main of July 2026):
- None for an item is NaN; the combined reward is the weighted `nansum` over the functions, so a
  function that returned None is left out of that item's sum.
- An item for which every function returned None is unscorable: its reward is NaN, it is left out
  of the group's mean and std (`nanmean`, `nanstd` with Bessel's correction), its advantage is 0.
- Advantages: (reward - group mean) / (group std + 1e-4), or without the division when
  `scale_rewards` is "none"; a group with one scorable item has advantage 0 everywhere (TRL's nanstd
  of one value is NaN).
- Metrics: `reward` (nanmean), `reward_std` (nanstd), `rewards/<name>/mean` and `/std` (per function,
  over the items it scored), `frac_reward_zero_std`; a warning when an item is unscorable (TRL warns
  too), and `unscorable`, the group's count of such items. Names are TRL's `get_callable_name`: the
  function's `__name__` (a `functools.partial` unwrapped, a callable object's class name).
Where this differs: NaN metrics are recorded as null (JSON has no NaN); a function returning the
wrong number of values, a value that is not a number or None, or an infinite one, raises an error
naming the function (TRL fails on the tensor assignment, or trains on inf); two functions of the same
name are refused (their metrics would collide); reward models (a checkpoint as a reward function) and
async reward functions are not supported.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import numbers
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from longstraw.core.grpo import group_advantages

# keywords the trainer passes itself; a dataset column of one of these names is refused
RESERVED_KWARGS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")


@dataclass(frozen=True)
class RewardFunc:
    func: Callable
    name: str  # TRL's name for it (metrics: rewards/<name>/mean)
    spec: str  # how the config named it


@dataclass
class StepState:
    """What `trainer_state` offers a reward function (the fields of HF's TrainerState it is read for)."""

    global_step: int = 0  # optimizer steps done before this one
    max_steps: int = 0
    epoch: float = 0.0  # passes over the dataset, fractional


def callable_name(func) -> str:
    """TRL's `get_callable_name`: partials unwrapped, a function's `__name__`, else the class's name."""
    while isinstance(func, functools.partial):
        func = func.func
    return getattr(func, "__name__", type(func).__name__)


def _import_module(module: str, spec: str):
    if module.endswith(".py"):
        path = Path(module)
        if not path.is_file():
            raise ValueError(f"reward function {spec!r}: no file {path}")
        name = f"longstraw_reward_{abs(hash(str(path.resolve())))}"
        if name in sys.modules:
            return sys.modules[name]
        loader = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(loader)
        sys.modules[name] = mod
        try:
            loader.loader.exec_module(mod)
        except BaseException:
            del sys.modules[name]
            raise
        return mod
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        # TRL's script puts the working directory on the path; do so only when the module is not found without it
        if exc.name is None or not module.startswith(exc.name.split(".")[0]) or os.getcwd() in sys.path:
            raise
        sys.path.insert(0, os.getcwd())
        return importlib.import_module(module)


def import_named(spec: str, what: str = "reward function"):
    """The callable a spec names: `package.module:name`, `package.module.name` (TRL's form) or
    `path/to/file.py:name`; errors name `what`, the spec and what failed."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"{what} {spec!r}: expected 'package.module:function'")
    if ":" in spec:
        module, _, attr = spec.rpartition(":")
    elif "." in spec:
        module, _, attr = spec.rpartition(".")
    else:
        raise ValueError(
            f"{what} {spec!r}: expected 'package.module:function' (or 'package.module.function', 'file.py:function')"
        )
    if not module or not attr:
        raise ValueError(f"{what} {spec!r}: expected 'package.module:function'")
    try:
        obj = _import_module(module, spec)
    except ValueError:
        raise
    except Exception as exc:  # ImportError, and whatever the module raises while it is imported
        raise ValueError(f"{what} {spec!r}: cannot import {module}: {type(exc).__name__}: {exc}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{what} {spec!r}: {module} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"{what} {spec!r}: {attr} is not callable ({type(obj).__name__})")
    return obj


def load_reward_func(spec: str) -> RewardFunc:
    """A reward function from `package.module:function`, `package.module.function` (TRL's form) or
    `path/to/file.py:function` (`import_named`)."""
    obj = import_named(spec)
    return RewardFunc(obj, callable_name(obj), spec)


def load_reward_funcs(specs: list[str]) -> list[RewardFunc]:
    funcs = [load_reward_func(s) for s in specs]
    seen = {}
    for f in funcs:
        if f.name in seen:
            raise ValueError(
                f"reward_funcs: {seen[f.name]!r} and {f.spec!r} are both named {f.name!r}; their "
                f"metrics (rewards/{f.name}/mean) would collide"
            )
        seen[f.name] = f.spec
    return funcs


def _values(func: RewardFunc, out, count: int, where: str) -> list[float]:
    """A function's outputs as floats, None as NaN; anything else is an error naming the function."""
    try:
        out = list(out)
    except TypeError:
        raise ValueError(
            f"{where}: reward function {func.spec!r} returned {type(out).__name__}, not a list of {count} rewards"
        ) from None
    if len(out) != count:
        raise ValueError(
            f"{where}: reward function {func.spec!r} returned {len(out)} rewards for {count} "
            "completions (one per completion, None where it does not apply)"
        )
    values = []
    for i, value in enumerate(out):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if value is None:
            values.append(math.nan)
        elif isinstance(value, numbers.Real) and not math.isinf(float(value)):
            values.append(float(value))  # a NaN is None, as in TRL's tensor
        else:
            raise ValueError(
                f"{where}: reward function {func.spec!r} returned {value!r} for completion {i} "
                "(rewards are finite numbers, or None where the function does not apply)"
            )
    return values


def nanstd(x: torch.Tensor) -> float:
    """TRL's nanstd: the std of the non-NaN values with Bessel's correction (NaN for fewer than two)."""
    kept = x[~torch.isnan(x)]
    if kept.numel() < 2:
        return math.nan
    return float(kept.std())


def nanmean(x: torch.Tensor) -> float:
    kept = x[~torch.isnan(x)]
    return float(kept.mean()) if kept.numel() else math.nan


def _finite_or_none(value: float):
    return None if value is None or not math.isfinite(value) else value


@dataclass
class Scored:
    rewards: list[float]  # weighted sum per completion, NaN where unscorable
    per_func: dict[str, list[float]]  # each function's values, NaN for None
    advantages: list[float]  # TRL's group advantages (`group_advantages(..., nan_unscorable=True)`)
    metrics: dict = field(default_factory=dict)  # TRL-named, NaN as None
    extra: dict = field(default_factory=dict)  # log_extra columns


def score_group(
    funcs: list[RewardFunc],
    weights,
    prompts: list,
    completions: list,
    completion_ids: list,
    columns: dict,
    *,
    scale_rewards="group",
    state: StepState | None = None,
    where: str = "rewards",
) -> Scored:
    """Call every reward function on one group and combine as TRL does (see the module's docstring)."""
    count = len(completions)
    logged, extra = {}, {}

    def log_metric(name, value):
        logged.setdefault(str(name), []).append(float(value))

    def log_extra(column, values):
        extra.setdefault(str(column), []).extend(list(values))

    kwargs = {
        **columns,
        "completion_ids": completion_ids,
        "trainer_state": state or StepState(),
        "log_metric": log_metric,
        "log_extra": log_extra,
    }
    per_func = {f.name: _called(f, prompts, completions, kwargs, count, where) for f in funcs}
    matrix = torch.tensor([per_func[f.name] for f in funcs], dtype=torch.float32).T.reshape(count, len(funcs))
    w = torch.tensor([1.0] * len(funcs) if weights is None else list(weights), dtype=torch.float32)
    rewards = (matrix * w[None]).nansum(dim=1)
    rewards[torch.isnan(matrix).all(dim=1)] = math.nan
    unscorable = int(torch.isnan(rewards).sum())
    _warn_unscorable(unscorable, count, where)
    metrics = _group_metrics(funcs, matrix, rewards, unscorable) | {
        name: sum(values) / len(values) for name, values in logged.items()
    }
    advantages = group_advantages(rewards, scale_rewards, nan_unscorable=True)
    return Scored([float(r) for r in rewards], per_func, advantages.tolist(), metrics, extra)


def _called(f: RewardFunc, prompts, completions, kwargs: dict, count: int, where: str) -> list:
    """One reward function's values for the group (checked by `_values`); its failure named."""
    try:
        out = f.func(prompts=prompts, completions=completions, **kwargs)
    except Exception as exc:
        raise ValueError(f"{where}: reward function {f.spec!r} failed: {type(exc).__name__}: {exc}") from exc
    return _values(f, out, count, where)


def _warn_unscorable(unscorable: int, count: int, where: str) -> None:
    """As TRL warns: completions no function scored get advantage 0; a wholly unscorable group changes nothing.
    The warning names `score_group`'s caller."""
    if unscorable:
        warnings.warn(
            f"{where}: every reward function returned None for {unscorable} of {count} completions: their "
            "advantage is 0"
            + (
                "; no completion of the group was scored, so the step moves the policy only through a KL term"
                if unscorable == count
                else ""
            ),
            stacklevel=3,
        )


def _group_metrics(funcs: list[RewardFunc], matrix: torch.Tensor, rewards: torch.Tensor, unscorable: int) -> dict:
    """TRL's reward metrics of a group: the combined reward's mean and std, each function's, and whether the
    group's rewards are all equal (`frac_reward_zero_std`)."""
    metrics = {
        "reward": _finite_or_none(nanmean(rewards)),
        "reward_std": _finite_or_none(nanstd(rewards)),
        "unscorable": unscorable,
    }
    for i, f in enumerate(funcs):
        metrics[f"rewards/{f.name}/mean"] = _finite_or_none(nanmean(matrix[:, i]))
        metrics[f"rewards/{f.name}/std"] = _finite_or_none(nanstd(matrix[:, i]))
    group_std = nanstd(rewards) if len(rewards) > 1 else 0.0  # TRL: isclose(std, 0), False for a NaN std
    metrics["frac_reward_zero_std"] = float(math.isfinite(group_std) and math.isclose(group_std, 0.0, abs_tol=1e-8))
    return metrics


# ---- stock reward functions over decoded text (standard or conversational completions)


def completion_text(completion) -> str:
    """A completion's text: the string itself, or the last message's content (TRL's conversational form)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def contains_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion contains its row's `answer` (case-insensitive), else 0.0."""
    return [float(str(a).strip().lower() in completion_text(c).lower()) for c, a in zip(completions, answer)]


def exact_match(completions, answer, **kwargs) -> list[float]:
    """1.0 where the completion, stripped and lower-cased, equals its row's `answer`, else 0.0."""
    return [float(completion_text(c).strip().lower() == str(a).strip().lower()) for c, a in zip(completions, answer)]
