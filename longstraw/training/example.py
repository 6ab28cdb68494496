"""What a task is (`longstraw.training.tasks`): an object whose `make(seed)` gives an `Example` (the prompt's
token ids, the answer's, and what else the reward needs in `info`) and whose `reward(example, response_ids)`
scores a response. Kept apart from the registry, so that a task defined elsewhere (RULER's) need not import it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class Example:
    prompt_ids: torch.Tensor
    answer: tuple[int, ...]
    info: dict = field(default_factory=dict)


class Task(Protocol):
    def make(self, seed: int) -> Example: ...

    def reward(self, example: Example, response_ids) -> float: ...


class TaskNotReady(ValueError):
    """What a task refuses once the files it reads are at hand (`check_ready`); `setting`: the setting of its spec
    the refusal is about."""

    def __init__(self, setting: str, message: str):
        super().__init__(f"{setting}: {message}")
        self.setting, self.detail = setting, message
