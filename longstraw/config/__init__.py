"""Typed configs, checked before any work starts (no torch here, so planning stays light):
experiment points (`point`), the GRPO trainer (`train`), their shared sections (`sections`),
the objective's settings (`grpo`), and the mapping-to-dataclass machinery (`typed`)."""

from longstraw.config.grpo import GRPOConfig
from longstraw.config.point import PointConfig, point_mapping, recorded_config, recorded_grid
from longstraw.config.train import TrainConfig, resolve_train
from longstraw.config.typed import ConfigError, from_mapping, to_mapping

__all__ = [
    "ConfigError",
    "GRPOConfig",
    "PointConfig",
    "TrainConfig",
    "from_mapping",
    "point_mapping",
    "recorded_config",
    "recorded_grid",
    "resolve_train",
    "to_mapping",
]
