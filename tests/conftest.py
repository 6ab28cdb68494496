"""Test tiers. `slow`: the end-to-end pipeline and multi-process runs (`pytest -m "not slow"` is the
inner loop); `cuda`: needs a CUDA device, skipped without one; `numerics`: compares floating-point
results against a reference under a tolerance (tests/tolerances.py; CI runs them again under a second CPU
instruction set, and at one thread). LONGSTRAW_TEST_THREADS=N runs the tests, the processes they launch and
the ranks they spawn on N threads (forked ranks on one: tests/tolerances.py)."""

import pytest
import torch
from tolerances import install_fixed_threads


def pytest_configure(config):
    install_fixed_threads()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
