"""Where a capture's time goes: a preset's capture timed at two chunk sizes in each loop order (chunk-major,
layer-major), then one capture under torch.profiler, its top CUDA kernels and CPU ops printed (CUDA).

    python benchmarks/capture_profile.py --preset qwen3.6-27b-shape --nf4 --lora-targets all-linear \
        --positions 65536 --out $OUT/capture_profile.json
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from longstraw import capture
from longstraw.config.sections import LoraConfig, ModelConfig
from longstraw.measure.provenance import provenance
from longstraw.models.policy import build_policy
from longstraw.results import write_json_atomic


def timed_capture(model, prompt, chunk: int, order: str = "chunk") -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    state = capture(model, prompt, chunk_size=chunk, order=order, progress=False)
    torch.cuda.synchronize()
    del state
    torch.cuda.empty_cache()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="qwen3.6-27b-shape")
    parser.add_argument("--nf4", action="store_true")
    parser.add_argument("--lora-targets", default="all-linear")
    parser.add_argument("--positions", type=int, default=65536)
    parser.add_argument("--chunks", type=int, nargs="+", default=[16384, 32768])
    parser.add_argument("--orders", nargs="+", default=["chunk", "layer"], choices=["chunk", "layer"])
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    model = build_policy(
        ModelConfig(
            preset=args.preset,
            dtype="bfloat16",
            device="cuda",
            nf4=args.nf4,
            lora=LoraConfig(r=16, targets=args.lora_targets),
        )
    )
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (args.positions + 1,), generator=torch.Generator().manual_seed(0)).cuda()
    timed_capture(model, prompt[: args.chunks[0] + 1], args.chunks[0])  # warm-up: kernels compiled, plans built
    seconds = {}
    for order in args.orders:
        for chunk in args.chunks:
            seconds[f"{order}-{chunk}"] = timed_capture(model, prompt, chunk, order)
            print(
                f"capture of {args.positions:,} positions, {order}-major, chunk {chunk}: "
                f"{seconds[f'{order}-{chunk}']:.2f} s",
                flush=True,
            )
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        timed_capture(model, prompt[: 2 * args.chunks[0] + 1], args.chunks[0])
    table = prof.key_averages()
    by_cuda = sorted(table, key=lambda e: e.device_time_total, reverse=True)[: args.top]
    by_cpu = sorted(table, key=lambda e: e.self_cpu_time_total, reverse=True)[: args.top]
    print(prof.key_averages().table(sort_by="device_time_total", row_limit=args.top, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70))
    write_json_atomic(
        args.out,
        {
            "provenance": provenance("cuda"),
            "positions": args.positions,
            "capture_seconds": seconds,
            "top_device": [{"name": e.key, "device_ms": e.device_time_total / 1e3, "calls": e.count} for e in by_cuda],
            "top_cpu": [{"name": e.key, "self_cpu_ms": e.self_cpu_time_total / 1e3, "calls": e.count} for e in by_cpu],
        },
    )


if __name__ == "__main__":
    main()
