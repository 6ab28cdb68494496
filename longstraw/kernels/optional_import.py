"""One function of an optional kernel library, imported on first use: fla's, or one of this package's Triton kernels
(`kernels/*_triton.py`). fla, and Triton under both, may be missing or fail to import."""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable


@functools.cache
def optional_function(module: str, name: str) -> Callable | None:
    """`module.name`, or None when it does not import (no fla, or Triton or driver trouble at import)."""
    try:
        return getattr(importlib.import_module(module), name)
    except Exception:
        return None
