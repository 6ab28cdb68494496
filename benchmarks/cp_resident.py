"""Per-rank resident bytes of a context-parallel capture, against the single-process total / ranks.

    python benchmarks/cp_resident.py                                  # 2 ranks, tiny-qwen3_5, 4,096 tokens
    python benchmarks/cp_resident.py --world 3 --preset small-llama --length 16384
    python benchmarks/cp_resident.py --device cuda --world 2          # NCCL, one GPU per rank

The device defaults to CUDA (NCCL, rank r on cuda:r) when CUDA is present, else CPU (gloo). The
single-process capture runs first in this process, without a process group; the ranks then run
in fresh spawned processes with torchrun's environment (`longstraw.cp.launch`). Attention pages
split over the ranks; Gated DeltaNet states are whole on every rank (replay needs them there), so
a hybrid rank holds its pages plus every GDN state. One line per rank, then one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from longstraw import capture
from longstraw.cp import context_parallel
from longstraw.cp.launch import run_ranks
from longstraw.measure.memory import peak_rss_bytes, process_peak_allocated_bytes
from longstraw.models import build_model


def _prompt(length: int, vocab: int, device) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(0)).to(device)


def _rank(preset: str, length: int, device_type: str, chunk: int) -> dict:
    cp = context_parallel(int(os.environ["WORLD_SIZE"]), device_type)
    model = build_model(preset, seed=0, device=cp.device)
    state = capture(model, _prompt(length, model.config.vocab_size, cp.device), chunk_size=chunk, cp=cp)
    peak = process_peak_allocated_bytes(cp.device) if device_type == "cuda" else peak_rss_bytes()
    return {
        "rank": cp.rank,
        "shard": list(state.shard),
        "resident_bytes": state.nbytes,
        "predicted_resident_bytes": state.predicted_nbytes,
        "page_bytes": state.page_bytes,
        "state_bytes": state.nbytes - state.page_bytes,
        "peak_bytes": peak,
        "peak_measure": "max_memory_allocated" if device_type == "cuda" else "process peak RSS",
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--preset", default="tiny-qwen3_5")
    parser.add_argument("--length", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--chunk", type=int, default=512, help="capture chunk size")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    model = build_model(args.preset, seed=0, device=device)
    single = capture(model, _prompt(args.length, model.config.vocab_size, device), chunk_size=args.chunk)
    single_entry = single.nbytes_by_entry()
    del model, single
    ranks = run_ranks(_rank, args.world, args.preset, args.length, args.device, args.chunk)

    single_total = sum(single_entry.values())
    share = single_total / args.world
    for r in ranks:
        print(
            f"rank {r['rank']}: positions [{r['shard'][0]}, {r['shard'][1]}), resident {r['resident_bytes']:,} B "
            f"(pages {r['page_bytes']:,} + GDN states {r['state_bytes']:,}), single-process total / {args.world} "
            f"= {share:,.0f} B, ratio {r['resident_bytes'] / share:.3f}; peak {r['peak_bytes']:,} B "
            f"({r['peak_measure']})"
        )
    summary = {
        "preset": args.preset,
        "prompt_tokens": args.length,
        "world": args.world,
        "device": args.device,
        "single_process_resident_bytes": single_total,
        "single_process_by_entry": single_entry,
        "single_process_total_over_world": share,
        "ranks": ranks,
        "pages_sum_over_ranks": sum(r["page_bytes"] for r in ranks),
    }
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
