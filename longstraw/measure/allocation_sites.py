"""Which allocation sites hold a phase's CUDA memory at its peak, from PyTorch's allocator history.

A phase's CUDA peak (`memory.PhaseRecorder`) says how much; this says what: the allocator records
every alloc and free with its Python stack while `AllocationSites` is active, and `peak_breakdown`
replays that trace to the instant the phase's allocated bytes peak and groups what is live there by
site. Only allocations made while recording are traced: memory allocated before (weights, resident
pages) is the phase's baseline and not in the breakdown.
"""

from __future__ import annotations

import os
from collections import defaultdict

import torch

from longstraw.measure.memory import _cuda_index

PROJECT_PACKAGES = ("longstraw", "peft", "transformers", "bitsandbytes", "fla")
CHECKPOINT_FILE = "torch/utils/checkpoint.py"


def _frame_site(path: str, frame: dict) -> str:
    return f"{path}:{frame['name']}:{frame['line']}"


def _project_path(filename: str) -> str | None:
    """`filename` from its deepest project package folder on ("transformers/models/x.py"), or None.
    The deepest, so a checkout named `longstraw` holding a venv still credits the venv's packages."""
    path = "/" + filename
    start = max(path.rfind(f"/{package}/") for package in PROJECT_PACKAGES)
    return path[start + 1 :] if start >= 0 else None


def _short_path(filename: str) -> str:
    """From the package folder on for installed files (site- or dist-packages), else the file's name."""
    _, installed, rest = filename.rpartition("-packages/")
    return rest if installed else os.path.basename(filename)


def default_site(frames: list[dict]) -> str:
    """The allocation's site as "path.py:function:line", from its Python frames (innermost first, as
    torch records them): the innermost frame in a project package (`PROJECT_PACKAGES`; torch's own
    frames are skipped), else the innermost frame of torch's checkpoint (a recompute outside project
    code), else the innermost frame; "unknown" without frames (e.g. C++ autograd on its own thread)."""
    if not frames:
        return "unknown"
    for frame in frames:
        path = _project_path(frame["filename"])
        if path:
            return _frame_site(path, frame)
    for frame in frames:
        if frame["filename"].endswith(CHECKPOINT_FILE):
            return _frame_site(CHECKPOINT_FILE, frame)
    return _frame_site(_short_path(frames[0]["filename"]), frames[0])


def release_action(trace: list[dict]) -> str:
    """The action that returns a block to the allocator: "free_completed". A "free_requested" block
    can stay reserved until the streams that used it finish (`record_stream`), then "free_completed"
    follows; a trace recorded with `skip_actions=["free_completed"]` falls back to "free_requested"."""
    if any(event["action"] == "free_completed" for event in trace):
        return "free_completed"
    return "free_requested"


class _Replay:
    """The allocations live after each replayed event: addr -> (bytes, frames), with their total and
    the bytes of baseline blocks (alive before recording) freed so far."""

    def __init__(self, release: str, baseline_addrs):
        self.release = release
        self.baseline = set(baseline_addrs or ())
        self.live: dict[int, tuple[int, list]] = {}
        self.traced_bytes = 0
        self.baseline_freed_bytes = 0

    def _free(self, addr: int):
        size, _ = self.live.pop(addr, (0, None))
        self.traced_bytes -= size

    def step(self, event: dict):
        action, addr = event["action"], event.get("addr")
        if action == "alloc":
            self._free(addr)  # a block still live at a reused address lost its free to a skipped action
            self.live[addr] = (event["size"], event.get("frames", []))
            self.traced_bytes += event["size"]
        elif action == self.release and addr in self.live:
            self._free(addr)
        elif action == self.release and addr in self.baseline:
            self.baseline.discard(addr)
            self.baseline_freed_bytes += event["size"]

    @property
    def net_bytes(self) -> int:
        return self.traced_bytes - self.baseline_freed_bytes


def _peak_index(trace: list[dict], release: str, baseline_addrs) -> int:
    """The index of the first event after which net allocated bytes peak (-1: at the start)."""
    replay, peak, peak_index = _Replay(release, baseline_addrs), 0, -1
    for index, event in enumerate(trace):
        replay.step(event)
        if replay.net_bytes > peak:
            peak, peak_index = replay.net_bytes, index
    return peak_index


def _group_by_site(live: dict, site_of) -> list[dict]:
    bytes_by_site, count_by_site = defaultdict(int), defaultdict(int)
    for size, frames in live.values():
        site = site_of(frames)
        bytes_by_site[site] += size
        count_by_site[site] += 1
    sites = [{"site": s, "bytes": b, "count": count_by_site[s]} for s, b in bytes_by_site.items()]
    return sorted(sites, key=lambda entry: (-entry["bytes"], entry["site"]))


def peak_breakdown(snapshot: dict, device: int = 0, baseline_addrs=None, top: int = 12, site_of=default_site) -> dict:
    """The allocations live when `device`'s trace in `snapshot` (`torch.cuda.memory._snapshot()`)
    reaches its peak, grouped by `site_of(frames)`: the `top` sites by bytes, the rest in
    `other_bytes`. Sizes are the requested bytes the trace records.

    The trace covers only allocations made while recording: memory allocated before is the phase's
    baseline and not in the breakdown; a free of an address never allocated in the trace is ignored,
    unless the address is in `baseline_addrs` (blocks alive when recording began): then its bytes
    count as baseline released (`baseline_freed_bytes`), so the peak located is that of the phase's
    allocated bytes, `peak_traced_bytes - baseline_freed_bytes` over the start.
    """
    trace = snapshot["device_traces"][device]
    release = release_action(trace)
    replay = _Replay(release, baseline_addrs)
    for event in trace[: _peak_index(trace, release, baseline_addrs) + 1]:
        replay.step(event)
    sites = _group_by_site(replay.live, site_of)
    return {
        "peak_traced_bytes": replay.traced_bytes,
        "baseline_freed_bytes": replay.baseline_freed_bytes,
        "sites": sites[:top],
        "other_bytes": sum(entry["bytes"] for entry in sites[top:]),
        "events": len(trace),
    }


def live_block_addrs(snapshot: dict, device: int) -> set[int]:
    """Addresses of `device`'s blocks in use or awaiting their free: a phase's baseline blocks."""
    return {
        block["address"]
        for segment in snapshot["segments"]
        if segment["device"] == device
        for block in segment["blocks"]
        if block["state"] != "inactive"
    }


class AllocationSites:
    """`with AllocationSites(device) as sites: ...` records `device`'s allocator history for the block;
    then `sites.result` is its `peak_breakdown` plus `truncated` (the trace reached `max_entries`, so
    its oldest events were dropped). The result is taken also when the block raises (an OOM's peak
    is the interesting one). A no-op, `result` None, when disabled or on a non-CUDA device.

    Recording starts from a cleared history and replaces any recording in progress; it is stopped on
    exit, also on exceptions. Stacks are Python only (C++ unwinding is slow to symbolise), so an
    allocation by C++ autograd on its own thread has no frames and its site is "unknown".
    """

    def __init__(self, device, enabled: bool = True, max_entries: int = 1_000_000):
        self.device = torch.device(device)
        self.active = enabled and self.device.type == "cuda"
        self.max_entries = max_entries
        self.result: dict | None = None

    def __enter__(self):
        if self.active:
            self.index = _cuda_index(self.device)
            self.baseline_addrs = live_block_addrs(torch.cuda.memory._snapshot(), self.index)
            torch.cuda.memory._record_memory_history(
                enabled="all", context="alloc", stacks="python", max_entries=self.max_entries, clear_history=True
            )
        return self

    def __exit__(self, *exc):
        if not self.active:
            return
        try:
            snapshot = torch.cuda.memory._snapshot()
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
        self.result = peak_breakdown(snapshot, self.index, self.baseline_addrs)
        self.result["truncated"] = self.result["events"] >= self.max_entries
