"""A trainer's first step on a box that never compiled its kernels, apart from a fresh process's first step and a
warm step (issue 62: "report that first-ever cost apart from cold and warm").

    python benchmarks/first_step_cost.py CONFIG.yaml [--steps 6] [--out F]

Runs `longstraw train CONFIG --no-resume` twice, each in a fresh process, both with one new empty kernel cache
folder (`TRITON_CACHE_DIR` for Triton's compiled and autotuned kernels, `CUDA_CACHE_PATH` for the driver's JIT
cache, which runtime-compiled cuDNN engines fill): the first run compiles everything the loop needs (first-ever),
the second finds it on disk (cold: a restarted trainer's first step), and the second run's later steps are warm.
Prints each phase's seconds of the three and the first-ever and cold steps over the warm one; the last stdout line
is one JSON object, also written to --out. The libraries' own files read from disk on a box's first use (cuDNN's,
for instance) are not in these folders: run a throwaway process first (`scripts/device_setup.sh: warm_libraries`)
or read the first-ever step as including them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from longstraw.measure.provenance import emit


def train(config: str, out: Path, steps: int, caches: Path) -> list[dict]:
    """One `longstraw train` process writing under `out`, its kernel caches in `caches`; its step records."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"), "CUDA_CACHE_PATH": str(caches / "cuda")}
    command = [sys.executable, "-m", "longstraw", "train", config, "--no-resume"]
    command += ["--set", f"output.dir={out}", "--set", f"steps={steps}"]
    subprocess.run(command, env=env, check=True)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def phases(step: dict) -> dict:
    """A step record's seconds: the whole step and each phase."""
    named = step.get("transaction", {}).get("phases", {})
    return {"step": step["seconds"], **{name: phase["seconds"] for name, phase in named.items()}}


def warm_median(steps: list[dict]) -> dict:
    """The median of each phase's seconds over `steps` (phases every step ran)."""
    rows = [phases(s) for s in steps]
    return {name: statistics.median(r[name] for r in rows) for name in rows[0] if all(name in r for r in rows)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--steps", type=int, default=6, help="steps of each run (the second run's later ones: warm)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first step, then warm ones)")
    with tempfile.TemporaryDirectory(prefix="first_step_") as folder:
        caches = Path(folder) / "caches"
        first_ever = train(args.config, Path(folder) / "first", args.steps, caches)
        restarted = train(args.config, Path(folder) / "second", args.steps, caches)
    result = {
        "config": args.config,
        "first_ever": phases(first_ever[0]),
        "cold": phases(restarted[0]),
        "warm": warm_median(restarted[1:]),
        "triton_entries_first_ever": sum(
            p.get("triton_cache_entries_added", 0) for p in first_ever[0]["transaction"]["phases"].values()
        ),
    }
    warm = result["warm"]["step"]
    result["ratios"] = {
        "first_ever_over_warm": result["first_ever"]["step"] / warm,
        "cold_over_warm": result["cold"]["step"] / warm,
    }
    for name in ("first_ever", "cold", "warm"):
        print(f"{name:>10}: " + ", ".join(f"{k} {v:.3f} s" for k, v in result[name].items()))
    ratios = result["ratios"]
    print(f"first-ever / warm {ratios['first_ever_over_warm']:.1f}x, cold / warm {ratios['cold_over_warm']:.1f}x")
    import torch  # the device's provenance, after the runs (this process does no GPU work of its own)

    emit(result, torch.device("cuda" if torch.cuda.is_available() else "cpu"), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
