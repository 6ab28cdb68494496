"""Where a warm trainer step's time goes: its phases, its kernels against its wall, and its host's Python.

    python benchmarks/train_step_profile.py CONFIG.yaml [--set KEY=VALUE ...] [--warm 3] [--out F]

Builds the trainer of a `longstraw train` config (its `--set` overrides applied), runs plain steps (twice `--warm`:
the collector's A/B, below), then one step
under torch.profiler (`measure.kernel_profile`: kernels launched, their summed device time against the step's wall,
the top kernels and where the device waited) and one under cProfile (the host's functions by cumulative seconds:
what a launch- or sync-bound step spends its wall on). Each profiled step's phases are printed beside it; steps
under a profiler run slower than plain ones, so the plain warm steps' medians come first. The last stdout line is
one JSON object, also written to --out. Nothing is written under the config's output folder (a temporary one).

Python's cyclic collector: the plain steps run `--warm` times with the heap thawed, then `--warm` times frozen as
`Trainer.run` steps (`measure.collector_frozen`), each counting the collections that ran inside them per generation
and their seconds; the ratio of the collector's seconds, thawed over frozen, is printed. The plain steps' medians are
the frozen ones', and the profiled steps run frozen.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

from longstraw.cli import _apply_overrides, _load_yaml
from longstraw.measure.collector import collector_frozen
from longstraw.measure.kernel_profile import kernel_profile
from longstraw.measure.provenance import emit
from longstraw.training.trainer import Trainer


def phases(record: dict) -> dict:
    return {
        "step": record["seconds"],
        **{name: p["seconds"] for name, p in record["transaction"]["phases"].items()},
    }


def collected_steps(trainer: Trainer, steps: range) -> tuple[list[dict], dict]:
    """The steps' phases, and the collections that ran inside them: count per generation, seconds in all, the
    longest."""
    runs, started = [], []

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        else:
            runs.append((info["generation"], time.perf_counter() - started.pop()))

    gc.callbacks.append(timed)
    try:
        plain = [phases(trainer.train_step(step)) for step in steps]
    finally:
        gc.callbacks.remove(timed)
    collections = {f"gen{g}": sum(1 for gen, _ in runs if gen == g) for g in range(3)}
    seconds = [s for _, s in runs]
    return plain, {"steps": len(plain), **collections, "seconds": sum(seconds), "longest": max(seconds, default=0.0)}


def host_functions(trainer: Trainer, step: int, top: int) -> list[dict]:
    """One step under cProfile: the `top` functions by cumulative seconds (file:line name)."""
    profiler = cProfile.Profile()
    profiler.enable()
    trainer.train_step(step)
    profiler.disable()
    stats = pstats.Stats(profiler, stream=io.StringIO()).sort_stats("cumulative")
    rows = sorted(stats.stats.items(), key=lambda item: item[1][3], reverse=True)[:top]
    return [
        {"function": f"{Path(file).name}:{line} {name}", "calls": calls, "cumulative": cumulative, "own": own}
        for (file, line, name), (_, calls, own, cumulative, _) in rows
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--warm", type=int, default=3, help="plain steps before the profiled ones")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    raw = _load_yaml(args.config)
    _apply_overrides(raw, args.set, args.config)  # as `longstraw train --set` reads them
    with tempfile.TemporaryDirectory(prefix="train_profile_") as folder:
        raw["output"] = {**raw.get("output", {}), "dir": folder, "checkpoint_every": 0}
        raw["steps"] = max(int(raw.get("steps", 0)), 2 * args.warm + 2)
        trainer = Trainer(raw, source=args.config)
        _, thawed = collected_steps(trainer, range(args.warm))
        with collector_frozen():
            plain, frozen = collected_steps(trainer, range(args.warm, 2 * args.warm))
            warm = {k: statistics.median(p[k] for p in plain[1:] or plain) for k in plain[-1]}
            profiled, step = {}, 2 * args.warm
            kernels = kernel_profile(lambda: profiled.update(phases(trainer.train_step(step))), trainer.device)
            host = host_functions(trainer, step + 1, args.top)
    collector = {"thawed": thawed, "frozen": frozen}
    result = {"config": args.config, "set": args.set, "warm": warm, "collector": collector, "kernels": kernels}
    result.update(profiled=profiled, host=host)
    print("warm steps (median):", ", ".join(f"{k} {v:.4f} s" for k, v in warm.items()))
    for mode, c in collector.items():
        print(f"collector {mode}: {c['steps']} steps, collections gen0 {c['gen0']} gen1 {c['gen1']} gen2 {c['gen2']}, "
              f"{c['seconds']:.4f} s in all, the longest {c['longest']:.4f} s")  # fmt: skip
    print(f"collector seconds, thawed / frozen: {thawed['seconds'] / max(frozen['seconds'], 1e-9):.1f}x")
    busy = kernels["busy_fraction"]
    print(f"profiled step: wall {kernels['wall_seconds']:.4f} s, {kernels['kernels']} kernels, "
          f"{kernels['kernel_seconds']:.4f} s of kernels ({busy:.0%} busy)")  # fmt: skip
    for kind, seconds in sorted(kernels.get("by_kind", {}).items(), key=lambda kv: -kv[1]):
        print(f"  {kind:>16} {seconds * 1e3:9.2f} ms")
    for row in host:
        print(f"  {row['cumulative']:8.4f} s {row['own']:8.4f} s {row['calls']:6d}  {row['function'][:100]}")
    emit(result, trainer.device, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
