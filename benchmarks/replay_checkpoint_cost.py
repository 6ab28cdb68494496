"""What whole-layer activation checkpointing in replay saves and costs (measured, one process).

    python benchmarks/replay_checkpoint_cost.py [--preset small-qwen3_5] [--response-lengths 256 1024]
        [--prompt-length 4096] [--device cpu]

Per response length: one replay + backward of one response with and without `checkpoint_layers`: the
autograd graph the forward keeps for the backward (`GraphBytesMeter`; under checkpointing each layer's
input, the recompute's own activations being a transient the meter does not see), the replay phase's
peak on CUDA (`max_memory_allocated`, which does see it), the seconds, and the ratios. The last stdout
line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from longstraw import capture, replay
from longstraw.measure.memory import GraphBytesMeter, synchronize
from longstraw.models import build_model
from longstraw.models.lora import apply_lora


def replay_once(model, state, response, checkpoint_layers: bool, device) -> dict:
    """One replay and its backward: graph kept, CUDA peak above what was allocated before, seconds."""
    exclude = list(model.parameters()) + [t for e in state.layers for t in e.tensors()]
    synchronize(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    with GraphBytesMeter(exclude=exclude) as meter:
        replay(model, state, response, checkpoint_layers=checkpoint_layers).sum().backward()
    synchronize(device)
    seconds = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return {"graph_bytes": meter.peak, "seconds": seconds,
            "transient_bytes": torch.cuda.max_memory_allocated(device) - before if cuda else None}


def measure(model, state, length: int, device, repeats: int) -> dict:
    vocab = model.get_input_embeddings().weight.shape[0]
    response = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(1)).to(device)
    replay_once(model, state, response, False, device)  # warm-up: first-call costs out of both timings
    runs = {name: [replay_once(model, state, response, flag, device) for _ in range(repeats)]
            for name, flag in (("plain", False), ("checkpointed", True))}
    best = {name: min(rows, key=lambda r: r["seconds"]) for name, rows in runs.items()}
    plain, ckpt = best["plain"], best["checkpointed"]
    out = {"response_length": length, "plain": plain, "checkpointed": ckpt,
           "graph_ratio": plain["graph_bytes"] / ckpt["graph_bytes"],
           "time_ratio": ckpt["seconds"] / plain["seconds"]}
    if plain["transient_bytes"] is not None:
        out["transient_ratio"] = plain["transient_bytes"] / ckpt["transient_bytes"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-qwen3_5")
    parser.add_argument("--prompt-length", type=int, default=4096)
    parser.add_argument("--response-lengths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = apply_lora(build_model(args.preset, device=device), r=8, init_random=True)
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (args.prompt_length,), generator=torch.Generator().manual_seed(0)).to(device)
    state = capture(model, prompt)
    rows = [measure(model, state, n, device, args.repeats) for n in args.response_lengths]
    print(f"{'response':>9} {'graph plain':>12} {'graph ckpt':>11} {'ratio':>6} {'s plain':>8} {'s ckpt':>7} "
          f"{'time ratio':>10}")
    for r in rows:
        print(f"{r['response_length']:>9,} {r['plain']['graph_bytes'] / 2**20:>10.1f}Mi "
              f"{r['checkpointed']['graph_bytes'] / 2**20:>9.1f}Mi {r['graph_ratio']:>6.1f} "
              f"{r['plain']['seconds']:>8.3f} {r['checkpointed']['seconds']:>7.3f} {r['time_ratio']:>10.2f}")
    print(json.dumps({"preset": args.preset, "prompt_length": args.prompt_length, "device": str(device),
                      "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
