"""Test tiers. `slow`: the end-to-end pipeline and multi-process runs (`pytest -m "not slow"` is the
inner loop); `cuda`: needs a CUDA device, skipped without one; `numerics`: compares floating-point
results against a reference (CI runs them again under a second CPU instruction set)."""

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
