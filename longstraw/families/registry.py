"""The family adapters, looked up by the HF config's `model_type`."""

from __future__ import annotations

from longstraw.families.base import FamilyAdapter, unwrap_causal_lm
from longstraw.families.dense import DenseAdapter
from longstraw.families.hybrid import HybridAdapter
from longstraw.families.mla import MlaAdapter
from longstraw.families.sliding import Gemma3Adapter, GptOssAdapter

_ADAPTERS: dict[str, type[FamilyAdapter]] = {}


def register_adapter(cls: type[FamilyAdapter]) -> type[FamilyAdapter]:
    for model_type in cls.model_types:
        _ADAPTERS[model_type] = cls
    return cls


for _cls in (DenseAdapter, HybridAdapter, MlaAdapter, Gemma3Adapter, GptOssAdapter):
    register_adapter(_cls)


def supported_model_types() -> list[str]:
    return sorted(_ADAPTERS)


def adapter_for(model) -> FamilyAdapter:
    lm = unwrap_causal_lm(model)
    model_type = getattr(getattr(lm, "config", None), "model_type", None)
    if model_type not in _ADAPTERS:
        raise ValueError(
            f"unsupported model type {model_type!r} ({type(lm).__name__}); supported: {supported_model_types()}"
        )
    return _ADAPTERS[model_type](model)
