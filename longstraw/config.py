"""Experiment point configs: defaults and validation (no torch here, so planning stays light)."""

from __future__ import annotations

import copy

DEFAULTS = {
    "name": "unnamed",
    "kind": "step",
    "cp_size": 1,  # context-parallel ranks (longstraw.cp); > 1 runs under `torchrun --nproc-per-node cp_size`
    "model": {"preset": "tiny-qwen3_5", "path": None, "dtype": "float32", "device": "cpu", "seed": 0,
              "lora": None, "nf4": False, "overrides": {}},
    "prompt": {"length": 1024, "seed": 0},
    "responses": {"count": 4, "length": 32, "seed": 1, "probe_members": None},
    "mode": "replay",
    "cycles": 1,
    "grpo": {"beta": 0.04, "epsilon": 0.2, "loss_type": "dapo", "scale_rewards": "group"},
    "optimizer": {"lr": 1.0e-4},
    "capture": {"chunk_size": None, "order": "auto", "memory_budget_bytes": None, "host_pages": False},
    "capacity": {"min_length": 1024, "max_length": 1 << 20, "granularity": 1024, "ceiling_bytes": None,
                 "time_limit_seconds": None, "compare_modes": []},
    "sweep": {"replay": [2, 8], "hold_all": [2, 4, 8]},
    "measure": {"kernel_rates": False},
    "staleness": {"steps": 8, "threshold": 1.0e-3},
    # kind validation (longstraw.validation): gradient modes and levels per path; presets: the models
    # (empty: `model` alone); tolerance: V2/V3's (None: by dtype); window: V4's k steps; train: V4's
    # trainer settings (a `longstraw train` config without model, grpo and capture, which are the point's)
    "validation": {"modes": ["response-only", "exact"], "levels": ["V1", "V2", "V3"], "presets": [],
                   "tolerance": None, "weights_seed": 0, "window": 8, "train": {}},
}


VALIDATION_MODES = ("response-only", "exact")
VALIDATION_LEVELS = ("V1", "V2", "V3", "V4")
FREE_FORM = {"overrides", "task", "train"}  # passed through as given (HF config fields, a task's own settings)

TRAIN_DEFAULTS = {
    "model": DEFAULTS["model"],
    "task": {"name": "kv_retrieval", "length": 1024},
    "steps": 8,
    "steps_per_prompt": 4,
    "seed": 0,
    "cp_size": 1,
    "sampling": {"num_samples": 4, "max_new_tokens": 8, "temperature": 1.0, "top_p": 1.0},
    "grpo": DEFAULTS["grpo"],
    "optimizer": {"lr": 1.0e-4, "weight_decay": 0.0},
    "schedule": {"name": "constant", "warmup_steps": 0},
    "max_grad_norm": 1.0,
    "refresh": {"policy": "every", "every": 1, "threshold": None},
    "capture": DEFAULTS["capture"],
    "output": {"dir": "runs/train", "checkpoint_every": 0},
}


def resolve_train_config(raw: dict, source: str = "train config") -> dict:
    """A `longstraw train` config with defaults filled in; unknown keys rejected by path."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: the train config must be a mapping, got {type(raw).__name__}")
    cfg = _merge(TRAIN_DEFAULTS, raw, source)
    refresh = cfg["refresh"]
    if refresh["policy"] not in ("every", "adaptive", "never"):
        raise ValueError(f"{source}.refresh.policy must be 'every', 'adaptive' or 'never', got {refresh['policy']!r}")
    if refresh["policy"] == "adaptive" and not isinstance(refresh["threshold"], (int, float)):
        raise ValueError(f"{source}.refresh.threshold: the adaptive policy needs a number")
    if cfg["schedule"]["name"] not in ("constant", "cosine"):
        raise ValueError(f"{source}.schedule.name must be 'constant' or 'cosine', got {cfg['schedule']['name']!r}")
    return cfg


def resolve_config(raw: dict, source: str = "config") -> dict:
    """Defaults filled in; unknown keys rejected with the key path named."""
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: the experiment config must be a mapping, got {type(raw).__name__}")
    cfg = _merge(DEFAULTS, raw, source)
    if cfg["kind"] == "validation":
        _check_validation(cfg["validation"], f"{source}.validation")
    return cfg


def _check_validation(settings: dict, path: str) -> None:
    for key, known in (("modes", VALIDATION_MODES), ("levels", VALIDATION_LEVELS)):
        values = settings[key]
        if not isinstance(values, list) or not values or any(v not in known for v in values):
            raise ValueError(f"{path}.{key} must be a non-empty list of {known}, got {values!r}")
    if "V4" in settings["levels"]:
        if not settings["train"]:
            raise ValueError(f"{path}.train: level V4 needs the trainer's settings (task, steps, sampling, ...)")
        resolve_train_config(settings["train"], f"{path}.train")  # unknown keys fail now, not mid-run


def _merge(defaults: dict, raw: dict, path: str) -> dict:
    out = copy.deepcopy(defaults)
    for key, value in raw.items():
        if key not in defaults:
            raise ValueError(f"{path}: unknown key {key!r} (known: {sorted(defaults)})")
        if isinstance(defaults[key], dict) and defaults[key] and key not in FREE_FORM:
            if not isinstance(value, dict):
                raise ValueError(f"{path}.{key}: expected a mapping, got {value!r}")
            out[key] = _merge(defaults[key], value, f"{path}.{key}")
        else:
            out[key] = value
    return out
