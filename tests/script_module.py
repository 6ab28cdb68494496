"""A repository script (scripts/, benchmarks/: not in the package) imported as a module by its path, so that tests
call its functions."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_script(relative: str):
    """The module of the script at `relative` (from the repository's root), executed once per call."""
    path = REPO / relative
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
