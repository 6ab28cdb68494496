"""Largest prompt that fits: a search over prompt lengths, each probe one GRPO step in a fresh process.

A fresh process per probe gives a clean allocator after an OOM and a process peak RSS that
belongs to that probe alone. A probe fits when it completes and its measured step memory is
under the ceiling:
- CUDA: `peak_allocated_bytes` over all phases; the ceiling is the device itself (a real OOM)
  unless `capacity.ceiling_bytes` sets a lower one.
- CPU: process peak RSS minus RSS after building the weights, against `capacity.ceiling_bytes`
  (an emulated ceiling, stated in the result: a 24 GiB machine would not run out at CPU sizes).

Search: double from `min_length` until a probe does not fit (or `max_length`), then bisect
between the last fitting and the first failing length down to `granularity` positions. With
`time_limit_seconds`, no probe starts once that much time has passed: the result then says the
search stopped on time, and the bracket it reached is what was measured. `compare_modes` then
runs those modes' steps at the largest fitting length (the step times the baselines compare).

`responses.probe_members: k` makes each probe of a serial mode (replay, naive) score and replay
only k of its G members (`grpo_step(members=k)`): one member at a time is live, so equal-length
members reach the same peak, and a probe costs k members' time instead of G. The result states
it; `tests/test_step.py` checks that one member's live graph peak equals the full step's, and on
the H200 one naive member's peak at 32,768 positions came within 0.12% of the full G=8 step's.
CUDA only: a CPU probe's measure, process peak RSS, keeps growing over members (freed heap is not
returned), so there one member reads low (205 MiB against the full step's > 256 MiB, tiny-qwen3_5
naive at 6,144 positions).
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from pathlib import Path

from longstraw.config import PointConfig
from longstraw.config.point import CapacityConfig
from longstraw.kinds.common import Progress, run_point_in_fresh_process


def _probe(point: PointConfig, length: int, workdir: Path) -> dict:
    config = dataclasses.replace(point, kind="step", name=f"{point.name}_probe_{length}",
                                 prompt=dataclasses.replace(point.prompt, length=length), capacity=CapacityConfig())
    return run_point_in_fresh_process(config, workdir)


def _measured_bytes(result: dict, device_type: str) -> int | None:
    metrics = result.get("metrics") or {}
    if device_type == "cuda":
        return metrics.get("peak_allocated_bytes") or result.get("peak_allocated_bytes")
    weights = (metrics.get("weights") or {}).get("peak_rss_bytes")
    return result["peak_rss_bytes"] - weights if weights is not None and "peak_rss_bytes" in result else None


def run(point: PointConfig, device, progress: Progress) -> dict:
    """Run the search for a point; returns the capacity metrics with every probe."""
    settings = point.capacity
    device_type = device.type
    ceiling = settings.ceiling_bytes
    if device_type != "cuda" and ceiling is None:
        raise ValueError("capacity on CPU needs capacity.ceiling_bytes (an emulated memory ceiling)")
    if device_type != "cuda" and point.responses.probe_members is not None:
        raise ValueError("responses.probe_members is for CUDA capacity searches: on CPU the measured peak RSS "
                         "grows over members, so a partial step would read low")
    probes: dict[int, dict] = {}

    def fits(length: int) -> bool:
        result = _probe(point, length, workdir)
        peak = _measured_bytes(result, device_type)
        status = result["status"]
        if status == "ok" and ceiling is not None and peak is not None and peak > ceiling:
            status = "oom"
        if status == "error":
            raise RuntimeError(f"probe at {length} positions failed: {result.get('error')}")
        probes[length] = {"prompt_length": length, "status": status, "peak_bytes": peak,
                          "seconds": result.get("wall_seconds"), "step_phases": (result.get("metrics") or {})
                          .get("phase_summary")}
        progress.line(f"capacity {point.mode}: {length:,} positions -> {status}"
                 + (f" ({peak / 2**20:,.1f} MiB)" if peak else ""))
        return status == "ok"

    started, limit = time.perf_counter(), settings.time_limit_seconds
    stopped_on_time = False

    def out_of_time() -> bool:
        nonlocal stopped_on_time
        stopped_on_time = limit is not None and time.perf_counter() - started > limit
        return stopped_on_time

    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        low, high, length = None, None, settings.min_length
        while length <= settings.max_length and not out_of_time():
            if fits(length):
                low, length = length, length * 2
            else:
                high = length
                break
        if low is not None and high is not None:
            while high - low > settings.granularity and not out_of_time():
                middle = (low + high) // 2 // settings.granularity * settings.granularity
                if middle in (low, high):
                    break
                low, high = (middle, high) if fits(middle) else (low, middle)
        # the other modes' G=8 steps at the largest length this mode fitted (step time beside it)
        comparison = {}
        for mode in settings.compare_modes if low is not None else []:
            full_step = dataclasses.replace(point, mode=mode, name=f"{point.name}_{mode}",
                                            responses=dataclasses.replace(point.responses, probe_members=None))
            result = _probe(full_step, low, workdir)
            comparison[mode] = {"prompt_length": low, "status": result["status"],
                                "peak_bytes": _measured_bytes(result, device_type),
                                "seconds": result.get("wall_seconds"), "error": result.get("error"),
                                "step_phases": (result.get("metrics") or {}).get("phase_summary")}
            progress.line(f"comparison {mode} at {low:,} positions -> {result['status']}")
    return {
        "mode": point.mode,
        "comparison_at_largest_fitting": comparison,
        "ceiling_bytes": ceiling,
        "memory_measure": "peak_allocated_bytes" if device_type == "cuda" else
        "process peak RSS minus RSS after weights (emulated CPU ceiling)",
        "probe_members": point.responses.probe_members,
        "probes": [probes[k] for k in sorted(probes)],
        "largest_fitting": low,
        "first_failing": high,
        "search_capped_at_max_length": high is None and not stopped_on_time,
        "search_stopped_on_time_limit": stopped_on_time,
    }
