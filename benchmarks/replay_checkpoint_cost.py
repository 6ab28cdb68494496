"""What whole-layer activation checkpointing in replay saves and costs (measured, one process).

    python benchmarks/replay_checkpoint_cost.py [--preset small-qwen3_5] [--response-lengths 256 1024]
        [--prompt-length 4096] [--members 1] [--device cpu]
    python benchmarks/replay_checkpoint_cost.py --device cuda --preset qwen3.6-27b-shape --nf4 \
        --lora-targets all-linear --prompt-length 65536 --response-lengths 1024 --chunk-size 16384 --profile

Per response length: `--members` responses replayed as one batch (`replay_members`) and backpropagated, with
and without `checkpoint_layers`: the autograd graph the forward keeps for the backward (`GraphBytesMeter`;
under checkpointing each layer's input, the recompute's own activations being a transient the meter does not
see), the peak on CUDA above what was allocated before (`max_memory_allocated`, which does see it), the
seconds (the best of `--repeats` after a warm-up), and the ratios. `--profile` adds one more run of each under
torch.profiler: kernels launched, their device time against the wall, the top ops. The last stdout line is one
JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from longstraw import capture
from longstraw.config.sections import LoraConfig, ModelConfig
from longstraw.core.transaction import replay_members
from longstraw.measure.kernel_profile import kernel_profile
from longstraw.measure.memory import GraphBytesMeter, synchronize
from longstraw.models.policy import build_policy

MODES = (("plain", False), ("checkpointed", True))


def replay_batch(model, state, responses, checkpoint_layers: bool) -> None:
    logps = replay_members(model, state, responses, checkpoint_layers=checkpoint_layers)
    torch.stack([lp.sum() for lp in logps]).sum().backward()
    model.zero_grad(set_to_none=True)


def replay_once(model, state, responses, checkpoint_layers: bool, device) -> dict:
    """One batched replay and its backward: graph kept, CUDA peak above what was allocated before, seconds."""
    exclude = list(model.parameters()) + [t for e in state.layers for t in e.tensors()]
    synchronize(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    with GraphBytesMeter(exclude=exclude) as meter:
        replay_batch(model, state, responses, checkpoint_layers)
    synchronize(device)
    seconds = time.perf_counter() - start
    return {
        "graph_bytes": meter.peak,
        "seconds": seconds,
        "transient_bytes": torch.cuda.max_memory_allocated(device) - before if cuda else None,
    }


def measure(model, state, length: int, members: int, device, repeats: int, profiled: bool) -> dict:
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(1)
    responses = [torch.randint(0, vocab, (length,), generator=generator).to(device) for _ in range(members)]
    for _, flag in MODES:  # warm-up: first-call costs (plans, autotuning) out of both timings
        replay_once(model, state, responses, flag, device)
    runs = {name: [replay_once(model, state, responses, flag, device) for _ in range(repeats)] for name, flag in MODES}
    best = {name: min(rows, key=lambda r: r["seconds"]) for name, rows in runs.items()}
    plain, ckpt = best["plain"], best["checkpointed"]
    out = {
        "response_length": length,
        "members": members,
        "plain": plain,
        "checkpointed": ckpt,
        "graph_ratio": plain["graph_bytes"] / ckpt["graph_bytes"],
        "time_ratio": ckpt["seconds"] / plain["seconds"],
    }
    if plain["transient_bytes"] is not None:
        out["transient_ratio"] = plain["transient_bytes"] / ckpt["transient_bytes"]
    if profiled:
        for name, flag in MODES:
            out[name]["profile"] = kernel_profile(lambda: replay_batch(model, state, responses, flag), device)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-qwen3_5")
    parser.add_argument("--nf4", action="store_true")
    parser.add_argument("--lora-targets", default="attention", choices=["attention", "all-linear"])
    parser.add_argument("--prompt-length", type=int, default=4096)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--response-lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--lora-r", type=int, default=16)
    parser.add_argument("--members", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--profile", action="store_true")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = build_policy(
        ModelConfig(
            preset=args.preset,
            dtype="bfloat16" if device.type == "cuda" else "float32",
            device=args.device,
            nf4=args.nf4,
            lora=LoraConfig(r=args.lora_r, targets=args.lora_targets, init_random=True),
        )
    )
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (args.prompt_length,), generator=torch.Generator().manual_seed(0)).to(device)
    state = capture(model, prompt, chunk_size=args.chunk_size, progress=False)
    rows = [measure(model, state, n, args.members, device, args.repeats, args.profile) for n in args.response_lengths]
    print(
        f"{'response':>9} {'k':>3} {'graph plain':>12} {'graph ckpt':>11} {'ratio':>6} {'s plain':>8} "
        f"{'s ckpt':>7} {'time ratio':>10}"
    )
    for r in rows:
        print(
            f"{r['response_length']:>9,} {r['members']:>3} {r['plain']['graph_bytes'] / 2**20:>10.1f}Mi "
            f"{r['checkpointed']['graph_bytes'] / 2**20:>9.1f}Mi {r['graph_ratio']:>6.1f} "
            f"{r['plain']['seconds']:>8.3f} {r['checkpointed']['seconds']:>7.3f} {r['time_ratio']:>10.2f}"
        )
        for name, _ in MODES:
            p = r[name].get("profile")
            if p:
                print(
                    f"  {name}: {p['kernels']:,} kernels, {p['kernel_seconds']:.3f} s of kernels in "
                    f"{p['wall_seconds']:.3f} s ({p['busy_fraction']:.0%} busy); top: "
                    + "; ".join(f"{t['name'][:50]} {t['seconds'] * 1e3:.0f} ms x{t['calls']}" for t in p["top"][:6])
                )
    print(
        json.dumps(
            {
                "preset": args.preset,
                "nf4": args.nf4,
                "prompt_length": args.prompt_length,
                "device": str(device),
                "rows": rows,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
