"""Measurements as DESIGN.md §5 defines them: per-phase CUDA peaks, process peak RSS, autograd
saved-tensor bytes, timings (synchronised), and provenance for every result."""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import resource
import subprocess
import time
from contextlib import contextmanager
from pathlib import Path

import torch


def synchronize(device) -> None:
    """Wait for the device's queued work (timers and peaks must see it finished)."""
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def peak_rss_bytes() -> int:
    """This process's peak resident memory so far (Linux reports kilobytes)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _storage_key(t: torch.Tensor):
    return (t.device, t.untyped_storage().data_ptr())


class GraphBytesMeter:
    """Peak bytes held by autograd saved tensors, counted per storage while their graph is alive.

    Parameters and any `exclude` tensors (the resident pages) are not graph memory: they exist
    anyway, so their storages are skipped. Use as a context manager around forward AND backward.
    """

    def __init__(self, exclude=()):
        self.excluded = {_storage_key(t) for t in exclude}
        self.live: dict = {}  # storage key -> [refcount, bytes]
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _pack(self, t: torch.Tensor):
        key = _storage_key(t)
        if key in self.excluded or t.untyped_storage().nbytes() == 0:
            return t
        entry = self.live.get(key)
        if entry is None:
            entry = self.live[key] = [0, t.untyped_storage().nbytes()]
            self.current += entry[1]
            self.peak = max(self.peak, self.current)
        entry[0] += 1
        # detached: holding `t` itself would tie a saved output to its own grad_fn, a cycle that
        # outlives a branch backward never visits (autograd re-attaches grad_fn at unpack)
        return _Saved(t.detach(), self, key)

    @staticmethod
    def _unpack(saved):
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key):
        entry = self.live[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class _Saved:
    __slots__ = ("tensor", "meter", "key")

    def __init__(self, tensor, meter, key):
        self.tensor, self.meter, self.key = tensor, meter, key

    def __del__(self):
        self.meter._release(self.key)


_PEAK_BEFORE_RESETS: dict = {}  # CUDA device index -> the largest max_memory_allocated before a phase reset it


def _cuda_index(device) -> int:
    index = torch.device(device).index
    return torch.cuda.current_device() if index is None else index


def process_peak_allocated_bytes(device) -> int:
    """The largest `max_memory_allocated` this process reached on `device` (across phase resets)."""
    return max(_PEAK_BEFORE_RESETS.get(_cuda_index(device), 0), torch.cuda.max_memory_allocated(_cuda_index(device)))


class PhaseRecorder:
    """Records, per named phase: seconds, CUDA peak allocated (reset at phase start), and RSS."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.phases: dict[str, dict] = {}

    @contextmanager
    def phase(self, name: str):
        cuda = self.device.type == "cuda"
        synchronize(self.device)
        if cuda:
            _PEAK_BEFORE_RESETS[_cuda_index(self.device)] = process_peak_allocated_bytes(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        record = {}
        try:
            yield record
        finally:
            synchronize(self.device)
            record["seconds"] = time.perf_counter() - start
            if cuda:
                stats = torch.cuda.memory_stats(self.device)
                record["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
                record["allocated_bytes_end"] = torch.cuda.memory_allocated(self.device)
                record["alloc_retries"] = stats.get("num_alloc_retries", 0)
                record["ooms"] = stats.get("num_ooms", 0)
            record["peak_rss_bytes"] = peak_rss_bytes()
            previous = self.phases.get(name)
            self.phases[name] = record if previous is None else _merge(previous, record)


def _merge(a: dict, b: dict) -> dict:
    """Repeated phases (one per replayed member) keep the max of peaks and the sum of seconds."""
    merged = {k: max(a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b)}
    merged["seconds"] = a["seconds"] + b["seconds"]
    merged["count"] = a.get("count", 1) + 1
    return merged


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
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        return "unknown"
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=root)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10, cwd=root).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def device_name(device) -> str:
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()})"


def provenance(device) -> dict:
    return {
        "commit": git_commit(),
        "device": device_name(device),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "versions": {p: _version(p) for p in ("torch", "transformers", "peft", "bitsandbytes", "fla-core")},
        "cuda_total_memory_bytes": torch.cuda.get_device_properties(device).total_memory
        if torch.device(device).type == "cuda" else None,
    }


class AttentionTimer:
    """Seconds and FLOPs spent inside paged attention while active (the capture attention rate).

    The attention mixer reports each call through `AttentionTimer.active`; every call is
    bracketed by device syncs, so use it only where calls are large (capture chunks).
    """

    active: "AttentionTimer | None" = None

    def __init__(self, device):
        self.device = torch.device(device)
        self.seconds = 0.0
        self.flops = 0
        self.calls = 0

    def __enter__(self):
        AttentionTimer.active = self
        return self

    def __exit__(self, *exc):
        AttentionTimer.active = None

    @contextmanager
    def call(self, flops: int):
        synchronize(self.device)
        start = time.perf_counter()
        yield
        synchronize(self.device)
        self.seconds += time.perf_counter() - start
        self.flops += flops
        self.calls += 1

    def summary(self) -> dict:
        return {"seconds": self.seconds, "flops": self.flops, "calls": self.calls,
                "tflops_per_second": self.flops / self.seconds / 1e12 if self.seconds else None}
