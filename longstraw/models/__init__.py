"""Models without a hub: named presets built from configs (`presets`), local checkpoints,
LoRA through peft (`lora`), NF4 through bitsandbytes (`quant`)."""

from longstraw.models.presets import (
    FAMILY_NAMES,
    MLA_MODEL_TYPES,
    MODEL_CLASSES,
    PRESETS,
    TINY_MLA_PRESETS,
    TINY_PRESETS,
    build_model,
    load_pretrained,
    make_config,
)

__all__ = [
    "FAMILY_NAMES",
    "MLA_MODEL_TYPES",
    "MODEL_CLASSES",
    "PRESETS",
    "TINY_MLA_PRESETS",
    "TINY_PRESETS",
    "build_model",
    "load_pretrained",
    "make_config",
]
