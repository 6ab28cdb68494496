"""Deterministic mode (config `deterministic: true`): capture, scoring and replay give the same bits
for the same inputs, run after run, at a measured cost in time.

What it switches, and why each is needed on the GPU:
* `torch.use_deterministic_algorithms(True)`: flash attention's backward then runs its deterministic
  variant (its default accumulates dQ with atomics, so two replays of one response gave gradients
  1.5% apart), and any op without a deterministic implementation raises instead of drifting;
* `CUBLAS_WORKSPACE_CONFIG=:4096:8`, which cuBLAS needs for reproducible GEMMs under that switch;
* cuDNN's deterministic algorithms, without autotuning (`cudnn.benchmark` off).
Uninitialised memory is not filled (torch's default under the switch): every page is written before it
is read, and filling a 70 GB page buffer with NaN would cost time for nothing.
Everything is restored on exit.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch
import torch.utils.deterministic

CUBLAS_WORKSPACE = ":4096:8"


@contextmanager
def deterministic_mode(enabled: bool = True):
    """Run the block with deterministic algorithms (a no-op when not `enabled`)."""
    if not enabled:
        yield
        return
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        torch.utils.deterministic.fill_uninitialized_memory,
        os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
    )
    if saved[-1] not in (":4096:8", ":16:8"):
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        yield
    finally:
        algorithms, warn_only, cudnn_deterministic, benchmark, fill, workspace = saved
        torch.use_deterministic_algorithms(algorithms, warn_only=warn_only)
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = cudnn_deterministic, benchmark
        torch.utils.deterministic.fill_uninitialized_memory = fill
        if workspace is None:
            os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
        else:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = workspace
