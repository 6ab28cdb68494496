"""Memory and time per phase, as the design defines them: CUDA peaks (reset at each phase), the
process's peak RSS, the bytes autograd's saved tensors hold, and synchronised timings."""

from __future__ import annotations

import os
import resource
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
    Under activation checkpointing (`replay(..., checkpoint_layers=True)`) it counts what the forward
    keeps (each segment's input); the activations a segment recomputes for its own backward are held
    by checkpoint's hooks, not these, so that transient is in a phase's CUDA peak, not here.
    """

    def __init__(self, exclude=()):
        self.excluded = {_storage_key(t) for t in exclude}
        self.live: dict = {}  # storage key -> [refcount, bytes]
        self.current = 0
        self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def exclude(self, tensors) -> None:
        """Count these tensors' storages as not graph memory from now on (a resident state's copy)."""
        self.excluded |= {_storage_key(t) for t in tensors}

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


def triton_cache_entries() -> int | None:
    """Entries in Triton's on-disk cache (`TRITON_CACHE_DIR`, else ~/.triton/cache): one folder per compiled
    kernel or stored autotuning result; None where there is no such folder."""
    folder = Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")
    try:
        with os.scandir(folder) as entries:
            return sum(1 for entry in entries if entry.is_dir())
    except OSError:
        return None


class PhaseRecorder:
    """Records, per named phase: seconds, CUDA peak allocated (reset at phase start), and RSS. On CUDA also
    `triton_cache_entries_added`: Triton kernels compiled or autotuned inside the phase, whose first-call
    cost (tens of seconds for fla's autotuning) its seconds then include."""

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
        cached = triton_cache_entries() if cuda else None
        start = time.perf_counter()
        record = {}
        try:
            yield record
        finally:
            synchronize(self.device)
            record["seconds"] = time.perf_counter() - start
            if cached is not None and (now := triton_cache_entries()) is not None:
                record["triton_cache_entries_added"] = now - cached
            if cuda:
                stats = torch.cuda.memory_stats(self.device)
                record["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(self.device)
                record["allocated_bytes_end"] = torch.cuda.memory_allocated(self.device)
                record["alloc_retries"] = stats.get("num_alloc_retries", 0)
                record["ooms"] = stats.get("num_ooms", 0)
            record["peak_rss_bytes"] = peak_rss_bytes()
            previous = self.phases.get(name)
            self.phases[name] = record if previous is None else _merge(previous, record)


SUMMED = ("seconds", "triton_cache_entries_added")  # what repeated phases add up; the rest are peaks


def _merge(a: dict, b: dict) -> dict:
    """Repeated phases (one per replayed member) keep the max of peaks, the sum of seconds and of Triton
    cache entries added."""
    merged = {k: (a.get(k, 0) + b.get(k, 0)) if k in SUMMED else max(a.get(k, 0), b.get(k, 0)) for k in set(a) | set(b)}
    merged["count"] = a.get("count", 1) + 1
    return merged
