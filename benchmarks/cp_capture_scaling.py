"""Context-parallel capture time against one process, with each rank's attention seconds (measured).

    python benchmarks/cp_capture_scaling.py                        # CPU (gloo), 1 and 2 ranks, 1 thread each
    python benchmarks/cp_capture_scaling.py --worlds 1 2 4 --device cuda --length 2097152 --preset hybrid-1b

Every world size runs in fresh spawned processes with torchrun's environment (`longstraw.cp.launch`),
the single process as a world of 1, with the same threads per rank, so the ratio is the schedule's
and not the machine's thread count. Per rank: capture seconds (the slowest rank's is the capture's),
the seconds inside capture attention (`AttentionTimer`) and its FLOPs, which show how evenly the
causal work is spread. One line per world, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from longstraw import capture
from longstraw.cp import context_parallel
from longstraw.cp.launch import run_ranks
from longstraw.measure.memory import synchronize
from longstraw.measure.timing import AttentionTimer
from longstraw.models import build_model


def _rank(preset: str, length: int, device_type: str, chunk: int, threads: int) -> dict:
    torch.set_num_threads(threads)
    world = int(os.environ["WORLD_SIZE"])
    cp = context_parallel(world, device_type) if world > 1 else None
    device = cp.device if cp is not None else torch.device(device_type)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_model(preset, seed=0, device=device, dtype=dtype)
    prompt = torch.randint(0, model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(0)).to(device)
    capture(model, prompt[: 2 * chunk + 1], chunk_size=chunk, cp=cp)  # warm-up: first-call costs out of the timing
    synchronize(device)
    start = time.perf_counter()
    with AttentionTimer(device) as attention:
        capture(model, prompt, chunk_size=chunk, cp=cp, progress=False)
    synchronize(device)
    return {
        "rank": cp.rank if cp else 0,
        "capture_seconds": time.perf_counter() - start,
        "attention_seconds": attention.seconds,
        "attention_flops": attention.flops,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--preset", default="small-qwen3_5")
    parser.add_argument("--length", type=int, default=16384, help="prompt tokens")
    parser.add_argument("--chunk", type=int, default=1024, help="capture chunk size")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", help="write the JSON object here too")
    args = parser.parse_args(argv)
    runs = {}
    for world in args.worlds:
        ranks = run_ranks(_rank, world, args.preset, args.length, args.device, args.chunk, args.threads, timeout=3600)
        runs[world] = ranks
    base = max(r["capture_seconds"] for r in runs[args.worlds[0]])
    for world, ranks in runs.items():
        slowest = max(r["capture_seconds"] for r in ranks)
        attention = [r["attention_seconds"] for r in ranks]
        flops = [r["attention_flops"] for r in ranks]
        print(
            f"{world} rank(s): capture {slowest:.2f} s, {base / slowest:.2f}x of {args.worlds[0]} rank(s); "
            f"attention seconds per rank {', '.join(f'{a:.2f}' for a in attention)}; "
            f"attention FLOPs max/min {max(flops) / max(min(flops), 1):.3f}"
        )
    summary = {
        "preset": args.preset,
        "prompt_tokens": args.length,
        "chunk": args.chunk,
        "threads": args.threads,
        "device": args.device,
        "runs": {str(w): r for w, r in runs.items()},
    }
    print(json.dumps(summary))
    if args.out:
        from longstraw.results import write_json_atomic

        write_json_atomic(args.out, summary)
    return summary


if __name__ == "__main__":
    main()
