"""One function of fla's, imported on first use: fla (and Triton under it) may be missing or fail to import."""

from __future__ import annotations

import functools
import importlib
from typing import Callable


@functools.cache
def fla_function(module: str, name: str) -> Callable | None:
    """`module.name` from fla, or None when it does not import (no fla, or Triton or driver trouble at import)."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:
        return None
