"""Family adapters, looked up by the HF config's `model_type` (`registry.adapter_for`), and what each family runs
(`support`). The adapters import torch, so they load on first use: a plan reads `support` without it."""

from __future__ import annotations

_REGISTRY = ("adapter_for", "register_adapter", "supported_model_types", "FamilyAdapter", "unwrap_causal_lm")


def __getattr__(name):
    if name in _REGISTRY:
        from longstraw.families import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'longstraw.families' has no attribute {name!r}")
