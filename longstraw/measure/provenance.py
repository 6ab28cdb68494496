"""Provenance recorded with every result: commit (and a variant of it), device, versions, date."""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path

import torch

from longstraw.results import write_json_atomic


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def git_commit() -> str | None:
    """The commit results record: LONGSTRAW_COMMIT when set (the GPU box receives a copy of the tree
    without .git, so the sender passes its HEAD; docs/gpu.md); else, where the package's repo root
    (the folder above `longstraw/`) itself holds `.git` (a folder, or a worktree's file), its HEAD
    with -dirty for uncommitted tracked changes; else "unknown". Git is never asked from a root
    without `.git`: it would walk up and report the commit of whatever repo encloses the copy."""
    if os.environ.get("LONGSTRAW_COMMIT"):
        return os.environ["LONGSTRAW_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return "unknown"
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=root)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=root,
        ).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def host_cpu() -> str | None:
    """The host's processor model (Linux's /proc/cpuinfo, else `platform.processor()`): a launch-bound phase runs
    at its speed, and boxes of one GPU kind have come with hosts of other speeds."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def variant() -> str | None:
    """LONGSTRAW_VARIANT when set: what a run changed from its commit's defaults (an A/B of a process setting run from
    a copy of the tree with that default changed, docs/gpu.md), else None."""
    return os.environ.get("LONGSTRAW_VARIANT") or None


def provenance(device) -> dict:
    return {
        "commit": git_commit(),
        "variant": variant(),
        "device": device_name(device),
        "host_cpu": host_cpu(),
        "threads": torch.get_num_threads(),  # CPU threads the point ran on (the pipeline's cpu profile: one)
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in ("torch", "transformers", "peft", "bitsandbytes", "fla-core")},
        "cuda_total_memory_bytes": torch.cuda.get_device_properties(device).total_memory
        if torch.device(device).type == "cuda"
        else None,
    }


def emit(result: dict, device, out=None) -> dict:
    """A benchmark's result with its provenance: written atomically to `out` when given, and printed as the last
    stdout line, one JSON object."""
    result["provenance"] = provenance(device)
    if out:
        write_json_atomic(out, result)
    print(json.dumps(result))
    return result
