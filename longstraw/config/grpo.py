"""The GRPO objective's settings (a subset of TRL's `GRPOConfig`, same names and meanings); the
objective itself is `longstraw.core.grpo`."""

from __future__ import annotations

import math
from dataclasses import dataclass

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "none")


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def normalize_scale_rewards(value) -> str:
    """Map ``True``/``"group"`` -> ``"group"`` and ``False``/``"none"`` -> ``"none"``."""
    if value is True:
        return "group"
    if value is False:
        return "none"
    if isinstance(value, str) and value in SCALE_REWARDS:
        return value
    raise ValueError(
        f"scale_rewards must be one of {SCALE_REWARDS} or a bool, got {value!r}"
        + (" ('batch' is not supported: for a single-prompt batch it equals 'group')" if value == "batch" else "")
    )


# the group size G, `num_generations`, where none is given: GRPOConfig's, a point's and a train config's alike
GROUP_SIZE = 4


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO objective settings (a subset of TRL's ``GRPOConfig``, same names and meanings).

    ``epsilon_high=None`` means ``epsilon``; after construction ``epsilon_high`` is always a
    float. ``scale_rewards`` accepts ``True``/``False`` and is stored as ``"group"``/``"none"``.
    ``max_completion_length`` is required for ``loss_type="dr_grpo"``; when set, response
    lengths above it are rejected by :func:`token_weights`. ``num_generations`` defaults to the project's one
    group size default, ``GROUP_SIZE`` (TRL's is 8).
    """

    num_generations: int = GROUP_SIZE
    beta: float = 0.0
    epsilon: float = 0.2
    epsilon_high: float | None = None
    loss_type: str = "dapo"
    scale_rewards: str | bool = "group"
    max_completion_length: int | None = None

    def __post_init__(self) -> None:
        g = self.num_generations
        if not isinstance(g, int) or isinstance(g, bool) or g < 1:
            raise ValueError(f"num_generations must be an int >= 1, got {g!r}")
        if not _is_real(self.beta) or not math.isfinite(self.beta) or self.beta < 0:
            raise ValueError(f"beta must be a finite float >= 0, got {self.beta!r}")
        if not _is_real(self.epsilon) or not (0.0 <= self.epsilon < 1.0):
            raise ValueError(f"epsilon must be a float in [0, 1), got {self.epsilon!r}")
        eh = self.epsilon if self.epsilon_high is None else self.epsilon_high
        if not _is_real(eh) or not math.isfinite(eh) or eh < 0:
            raise ValueError(f"epsilon_high must be None or a finite float >= 0, got {self.epsilon_high!r}")
        object.__setattr__(self, "epsilon", float(self.epsilon))
        object.__setattr__(self, "epsilon_high", float(eh))
        object.__setattr__(self, "beta", float(self.beta))
        if self.loss_type not in LOSS_TYPES:
            raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {self.loss_type!r}")
        object.__setattr__(self, "scale_rewards", normalize_scale_rewards(self.scale_rewards))
        m = self.max_completion_length
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise ValueError(f"max_completion_length must be None or an int >= 1, got {m!r}")
        if self.loss_type == "dr_grpo" and m is None:
            raise ValueError("max_completion_length is required when loss_type='dr_grpo'")


# spellings of the group size before it had one name, TRL's `num_generations`: refused, naming it
OLD_GROUP_SIZES = (("responses", "count"), ("sampling", "num_samples"), ("learning", "num_samples"))


def grouped_objective(raw: dict, source: str) -> dict:
    """`raw` (a point or trainer mapping) with the objective's defaults where it gives none: the group size
    `grpo.num_generations` (TRL's name, the one name it has) `GROUP_SIZE`, beta 0.04 (a KL term towards the
    reference). A group size under an old name is refused, naming the new one."""
    from longstraw.config.typed import ConfigError

    for section, key in OLD_GROUP_SIZES:
        if isinstance(raw.get(section), dict) and key in raw[section]:
            raise ConfigError(
                f"{source}: {section}.{key}: the group size is grpo.num_generations (TRL's name); "
                f"{section}.{key} is no longer read"
            )
    grpo = raw.get("grpo")
    if grpo is not None and not isinstance(grpo, dict):
        raise ConfigError(f"{source}: grpo: expected a mapping, got {grpo!r}")
    return {**raw, "grpo": {"beta": 0.04, **(grpo or {})}}
