"""Experiment point configs: defaults and validation (no torch here, so planning stays light)."""

from __future__ import annotations

import copy

DEFAULTS = {
    "name": "unnamed",
    "kind": "step",
    "model": {"preset": "tiny-qwen3_5", "path": None, "dtype": "float32", "device": "cpu", "seed": 0,
              "lora": None, "nf4": False, "overrides": {}},
    "prompt": {"length": 1024, "seed": 0},
    "responses": {"count": 4, "length": 32, "seed": 1},
    "mode": "replay",
    "cycles": 1,
    "grpo": {"beta": 0.04, "epsilon": 0.2, "loss_type": "dapo", "scale_rewards": "group"},
    "optimizer": {"lr": 1.0e-4},
    "capture": {"chunk_size": None, "order": "auto", "memory_budget_bytes": None},
    "capacity": {"min_length": 1024, "max_length": 1 << 20, "granularity": 1024, "ceiling_bytes": None,
                 "time_limit_seconds": None, "compare_modes": []},
    "sweep": {"replay": [2, 8], "hold_all": [2, 4, 8]},
    "measure": {"kernel_rates": False},
}


def resolve_config(raw: dict, source: str = "config") -> dict:
    """Defaults filled in; unknown keys rejected with the key path named."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: the experiment config must be a mapping, got {type(raw).__name__}")
    return _merge(DEFAULTS, raw, source)


def _merge(defaults: dict, raw: dict, path: str) -> dict:
    out = copy.deepcopy(defaults)
    for key, value in raw.items():
        if key not in defaults:
            raise ValueError(f"{path}: unknown key {key!r} (known: {sorted(defaults)})")
        if isinstance(defaults[key], dict) and defaults[key] and key != "overrides":
            if not isinstance(value, dict):
                raise ValueError(f"{path}.{key}: expected a mapping, got {value!r}")
            out[key] = _merge(defaults[key], value, f"{path}.{key}")
        else:
            out[key] = value
    return out
