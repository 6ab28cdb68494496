"""What the exact full-sequence mode costs beside a plain capture (measured, one process).

    python benchmarks/exact_mode_cost.py [--preset small-qwen3_5] [--lengths 4096 8192] [--device cpu]

Per prompt length: capture time with and without `prefix_grad`, the G replays' time, and
`backward_prefix` time as a ratio to the capture; the extra bytes exact mode holds: gradient
pages (the page gradients the replays accumulated, as large as the K/V pages) and the Gated
DeltaNet checkpoints (one conv + recurrent state per GDN layer per capture chunk), against the
resident bytes. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from longstraw import capture, replay
from longstraw.measure.memory import synchronize
from longstraw.models import build_model
from longstraw.models.lora import apply_lora


def _timed(fn, device):
    synchronize(device)
    start = time.perf_counter()
    out = fn()
    synchronize(device)
    return out, time.perf_counter() - start


def measure(model, length: int, responses: int, response_length: int, chunk: int, device) -> dict:
    vocab = model.get_input_embeddings().weight.shape[0]
    prompt = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(0)).to(device)
    ys = [
        torch.randint(0, vocab, (response_length,), generator=torch.Generator().manual_seed(i + 1)).to(device)
        for i in range(responses)
    ]
    plain, plain_seconds = _timed(lambda: capture(model, prompt, chunk_size=chunk), device)
    del plain
    state, exact_seconds = _timed(lambda: capture(model, prompt, prefix_grad=True, chunk_size=chunk), device)

    def replays():
        for y in ys:
            replay(model, state, y).sum().backward()

    _, replay_seconds = _timed(replays, device)
    gradient_pages = sum(
        leaf.grad.numel() * leaf.grad.element_size()
        for entry in state.layers
        for leaf in entry.leaves
        if leaf.grad is not None
    )
    checkpoints = sum(t.numel() * t.element_size() for pair in state.prefix_trace.checkpoints.values() for t in pair)
    _, prefix_seconds = _timed(state.backward_prefix, device)
    return {
        "prompt_length": length,
        "capture_seconds": plain_seconds,
        "exact_capture_seconds": exact_seconds,
        "replay_seconds": replay_seconds,
        "backward_prefix_seconds": prefix_seconds,
        "backward_prefix_over_capture": prefix_seconds / plain_seconds,
        "resident_bytes": state.nbytes,
        "gradient_page_bytes": gradient_pages,
        "checkpoint_bytes": checkpoints,
        "extra_over_resident": (gradient_pages + checkpoints) / state.nbytes,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-qwen3_5")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--responses", type=int, default=4)
    parser.add_argument("--response-length", type=int, default=64)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    model = apply_lora(build_model(args.preset, device=device), r=8, init_random=True)
    rows = [measure(model, n, args.responses, args.response_length, args.chunk, device) for n in args.lengths]
    print(
        f"{'positions':>10} {'capture s':>10} {'exact cap s':>11} {'replays s':>10} {'prefix s':>9} "
        f"{'prefix/capture':>14} {'grad pages':>11} {'checkpoints':>12} {'extra/resident':>14}"
    )
    for r in rows:
        print(
            f"{r['prompt_length']:>10,} {r['capture_seconds']:>10.2f} {r['exact_capture_seconds']:>11.2f} "
            f"{r['replay_seconds']:>10.2f} {r['backward_prefix_seconds']:>9.2f} "
            f"{r['backward_prefix_over_capture']:>14.2f} {r['gradient_page_bytes'] / 2**20:>9.1f}Mi "
            f"{r['checkpoint_bytes'] / 2**20:>10.1f}Mi {r['extra_over_resident']:>14.2f}"
        )
    print(json.dumps({"preset": args.preset, "rows": rows}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
