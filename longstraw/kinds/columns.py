"""The columns every point's row has, whatever its kind: model, family, prompt, provenance,
context-parallel ranks (the model's family read from the presets; the cells themselves: `longstraw.results`)."""

from __future__ import annotations

from pathlib import Path

from longstraw.models.presets import FAMILY_NAMES, PRESETS
from longstraw.results import as_dict, checkpoint_name, cp_columns, number, point_parts, real_weights


def model_type_of(point: dict) -> str | None:
    """The model type: from the (sweep's) capture metrics when recorded, else the preset's (a preset no
    longer defined: from its name, `tiny-qwen3_5` -> `qwen3_5`), else the checkpoint folder's name."""
    cfg, metrics = point_parts(point)
    model = as_dict(cfg.get("model"))
    recorded = metrics.get("model_type") or as_dict(metrics.get("capture")).get("model_type")  # a sweep: its capture's
    if recorded:  # qwen3_5_text (a text config) is listed under qwen3_5, as presets name it
        return str(recorded).removesuffix("_text")
    preset = model.get("preset")
    if model.get("path"):
        return Path(str(model["path"])).name
    if isinstance(preset, str):
        if preset in PRESETS:  # a point that recorded no metrics (it ran out, or failed): its preset's type
            return PRESETS[preset].model_type
        suffix = preset.split("-", 1)[-1]
        return suffix if suffix in FAMILY_NAMES else preset
    return None


def family_of(model_type) -> str | None:
    return FAMILY_NAMES.get(str(model_type).removesuffix("_text")) if model_type else None


def common_columns(point: dict) -> dict:
    """The columns of every point's row, whatever its kind."""
    cfg, prov = as_dict(point.get("config")), as_dict(point.get("provenance"))
    model = as_dict(cfg.get("model"))
    model_type = model_type_of(point)
    lora = model.get("lora")
    return {
        "model": checkpoint_name(model["path"]) if model.get("path") else model.get("preset"),
        "model_type": model_type,
        "family": family_of(model_type),
        "dtype": model.get("dtype"),
        "nf4": model.get("nf4"),
        "lora_r": lora.get("r") if isinstance(lora, dict) else None,
        "lora_targets": lora.get("targets", "attention") if isinstance(lora, dict) else None,
        "prompt_length": as_dict(cfg.get("prompt")).get("length"),
        "device": prov.get("device"),
        "peak_rss_bytes": number(point.get("peak_rss_bytes")),
        "wall_seconds": number(point.get("wall_seconds")),
        # the point process's CPU seconds and the threads it ran on (None in results from before they were kept)
        "cpu_seconds": number(point.get("cpu_seconds")),
        "threads": number(prov.get("threads")),
        "device_memory_bytes": number(prov.get("cuda_total_memory_bytes")),
        "commit": prov.get("commit"),
        "date": prov.get("date"),
        "torch_version": as_dict(prov.get("versions")).get("torch"),
        "transformers_version": as_dict(prov.get("versions")).get("transformers"),
        "cp_size": cfg.get("cp_size"),
        "weights": real_weights(prov),
        **cp_columns(point),
    }
