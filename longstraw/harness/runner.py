"""One experiment point: its resolved config -> one measured result dict (status ok / oom / error, or
nonfinite when a step skipped its update).

    python -m longstraw run experiments/examples/step_cpu.yaml --out results/step.json

The point's kind (`longstraw.kinds.<kind>`, from the kinds' registry) runs it; every result carries provenance and the
resolved config. Out-of-memory is a result, not a crash.
"""

from __future__ import annotations

import os
import time
import traceback

import torch

from longstraw import kinds
from longstraw.config import PointConfig, point_mapping
from longstraw.core.determinism import deterministic_mode
from longstraw.cp import context_parallel
from longstraw.harness.inputs import built_models, check_ready
from longstraw.harness.plan import resolve
from longstraw.kernels.paged_attention import forward_kernel
from longstraw.kinds.common import Progress
from longstraw.measure.memory import peak_rss_bytes, process_peak_allocated_bytes
from longstraw.measure.provenance import provenance
from longstraw.models.real import checkpoint_provenance
from longstraw.results import finished_status


def run_point(raw, source: str = "config", on_progress=None, work_dir=None) -> dict:
    """Run one experiment point (`raw`: its mapping, or a resolved `PointConfig`); never raises for OOM or runtime
    failure (recorded as status).
    A bad config, a device this machine lacks or a missing or cut checkpoint raises ValueError before
    anything runs.

    `on_progress(partial_result)` is called after each finished step of a `step`, `sweep`, `staleness` or
    `learning` point and each cell of a `length_curve`, so a run cut off later still leaves what it measured.
    `work_dir` is the point's resumable work (`Progress.work_dir`): a learning point run again with the same
    `work_dir` goes on from its runs' last checkpoints; one of another config is refused before any work.
    """
    cfg = raw if isinstance(raw, PointConfig) else resolve(raw, source)  # the CLI hands over the config it resolved
    check_ready(cfg, source)  # its devices exist here, its checkpoint is there and whole
    kind = kinds.get(cfg.kind)
    if kind.check_work is not None and work_dir is not None:  # a kind that resumes from work_dir
        kind.check_work(cfg, work_dir, source)
    device = torch.device(cfg.model.device)
    cp = _context_parallel(cfg, source)
    if cp is not None and cp.rank != 0:
        on_progress = None  # rank 0 writes the result
    result = {"name": cfg.name, "kind": cfg.kind, "config": point_mapping(cfg), "provenance": provenance(device)}
    loaded = next((built.path for built in built_models(cfg) if built.path), None)  # model.path, or pretrain's init
    if loaded:
        result["provenance"]["checkpoint"] = checkpoint_provenance(loaded)  # which weights: their hash
    start, cpu_start = time.perf_counter(), cpu_seconds()

    def partial(metrics):
        if on_progress:
            on_progress(
                {
                    **result,
                    "status": "partial",
                    "metrics": metrics,
                    "wall_seconds": time.perf_counter() - start,
                    "cpu_seconds": cpu_seconds() - cpu_start,
                }
            )

    try:
        with deterministic_mode(cfg.deterministic), forward_kernel(cfg.model.attention_kernel):
            result["metrics"] = kind.run(cfg, device, Progress(partial, work_dir))
        result.update(finished_status(result["metrics"]))  # ok, or nonfinite: a step skipped its update
    except torch.OutOfMemoryError as exc:
        result["status"] = "oom"
        result["error"] = str(exc).splitlines()[0]
        if device.type == "cuda":
            result["peak_allocated_bytes"] = torch.cuda.max_memory_allocated(device)
    except Exception as exc:  # recorded, not swallowed: the CLI exits non-zero on status error
        result["status"] = "error"
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    result["wall_seconds"] = time.perf_counter() - start
    # beside wall_seconds, whether the point had its cores: on a busy machine wall grows, CPU barely
    result["cpu_seconds"] = cpu_seconds() - cpu_start
    result["peak_rss_bytes"] = peak_rss_bytes()
    if cp is not None:
        result["cp"] = _rank_records(cp, result)
    return result


def cpu_seconds() -> float:
    """CPU seconds so far (user + system) of this process's threads and of the child processes it has waited for (a
    capacity search runs each probe as one)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _context_parallel(cfg: PointConfig, source: str):
    """The run's CP group (None for a single process); kinds without a resident state refuse it."""
    cp = context_parallel(cfg.cp_size, torch.device(cfg.model.device).type)
    if cp is not None and cp.world > 1 and (not kinds.get(cfg.kind).shards_state or cfg.mode == "naive"):
        raise ValueError(
            f"{source}: cp_size={cp.world} shards a captured prompt; kind {cfg.kind!r} with mode "
            f"{cfg.mode!r} has none to shard (capacity probes run as single processes)"
        )
    return cp


def _rank_records(cp, result: dict) -> dict:
    """Per-rank memory, gathered to rank 0: {"size", "rank", "ranks": [per rank] (rank 0 only)}.
    A rank's peak is its process's CUDA max_memory_allocated (across phases) or its peak RSS."""
    record = {
        "rank": cp.rank,
        "device": str(cp.device),
        "status": result["status"],
        "resident_bytes": cp.resident_bytes,
        "peak_rss_bytes": peak_rss_bytes(),
    }
    if cp.device.type == "cuda":
        record["peak_allocated_bytes"] = process_peak_allocated_bytes(cp.device)
    ranks = cp.gather_objects(record)
    return {"size": cp.world, "rank": cp.rank, **({"ranks": ranks} if ranks is not None else {})}
