"""Where a warm trainer step's time goes: its phases, its kernels against its wall, and its host's Python.

    python benchmarks/train_step_profile.py CONFIG.yaml [--set KEY=VALUE ...] [--warm 3] [--out F]

Builds the trainer of a `longstraw train` config (its `--set` overrides applied), runs `--warm` steps, then one step
under torch.profiler (`measure.kernel_profile`: kernels launched, their summed device time against the step's wall,
the top kernels and where the device waited) and one under cProfile (the host's functions by cumulative seconds:
what a launch- or sync-bound step spends its wall on). Each profiled step's phases are printed beside it; steps
under a profiler run slower than plain ones, so the plain warm steps' medians come first. The last stdout line is
one JSON object, also written to --out. Nothing is written under the config's output folder (a temporary one).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile
from pathlib import Path

from longstraw.cli import _apply_overrides, _load_yaml
from longstraw.measure.kernel_profile import kernel_profile
from longstraw.measure.provenance import provenance
from longstraw.results import write_json_atomic
from longstraw.training.trainer import Trainer


def phases(record: dict) -> dict:
    return {
        "step": record["seconds"],
        **{name: p["seconds"] for name, p in record["transaction"]["phases"].items()},
    }


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
        raw["steps"] = max(int(raw.get("steps", 0)), args.warm + 2)
        trainer = Trainer(raw, source=args.config)
        plain = [phases(trainer.train_step(step)) for step in range(args.warm)]
        warm = {k: statistics.median(p[k] for p in plain[1:] or plain) for k in plain[-1]}
        profiled = {}
        kernels = kernel_profile(lambda: profiled.update(phases(trainer.train_step(args.warm))), trainer.device)
        host = host_functions(trainer, args.warm + 1, args.top)
    result = {"config": args.config, "set": args.set, "warm": warm, "kernels": kernels, "profiled": profiled}
    result["host"] = host
    print("warm steps (median):", ", ".join(f"{k} {v:.4f} s" for k, v in warm.items()))
    busy = kernels["busy_fraction"]
    print(f"profiled step: wall {kernels['wall_seconds']:.4f} s, {kernels['kernels']} kernels, "
          f"{kernels['kernel_seconds']:.4f} s of kernels ({busy:.0%} busy)")  # fmt: skip
    for kind, seconds in sorted(kernels.get("by_kind", {}).items(), key=lambda kv: -kv[1]):
        print(f"  {kind:>16} {seconds * 1e3:9.2f} ms")
    for row in host:
        print(f"  {row['cumulative']:8.4f} s {row['own']:8.4f} s {row['calls']:6d}  {row['function'][:100]}")
    result["provenance"] = provenance(trainer.device)
    if args.out:
        write_json_atomic(args.out, result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
