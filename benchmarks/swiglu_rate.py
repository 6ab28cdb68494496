"""silu(gate) * up at a gated MLP's widths (CUDA): `swiglu_triton` against fla's `swiglu` and torch's two passes,
forward without grad (a capture's) and forward with backward (a member's), and the bytes each moves a second.

    python benchmarks/swiglu_rate.py [--rows 32768 --columns 5632 --member-rows 4096 --repeats 20]

Prints each path's seconds and GB/s (forward: gate and up read, the product written; backward: gate, up and the
incoming gradient read, two gradients written) and the ratios to ours: the capture's forward the median of calls
timed one by one, the member's forward and backward the mean of a CUDA graph's replays (members run as graphs); the
last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from longstraw.kernels.optional_import import optional_function
from longstraw.kernels.swiglu_triton import SwiGLU
from longstraw.measure.provenance import provenance
from longstraw.measure.timing import graph_replay_seconds, seconds_each


def paths() -> dict:
    fla_swiglu = optional_function("fla.modules.activations", "swiglu")
    found = {"ours": SwiGLU.apply, "torch": lambda gate, up: F.silu(gate) * up}
    if fla_swiglu is not None:
        found["fla"] = fla_swiglu
    return found


def median_seconds(fn, repeats: int) -> float:
    fn()  # compile, autotune and warm up
    return statistics.median(seconds_each(fn, torch.device("cuda"), repeats))


def measure(rows: int, columns: int, repeats: int, backward: bool, gen) -> dict:
    gate, up, grad = (torch.randn(rows, columns, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    if backward:
        gate.requires_grad_(True), up.requires_grad_(True)
    runs = {}
    for name, fn in paths().items():
        if backward:
            runs[name] = lambda fn=fn: torch.autograd.grad(fn(gate, up), (gate, up), grad)
        else:
            runs[name] = lambda fn=fn: fn(gate, up)
    # a member's pass runs inside a CUDA graph: timed call by call, a ~0.1 ms pass would also count autograd's host
    # time (torch's C++ autograd then looks faster than a Python autograd.Function)
    timer = graph_replay_seconds if backward else median_seconds
    with torch.set_grad_enabled(backward):
        seconds = {name: timer(run, repeats) for name, run in runs.items()}
    moved = gate.numel() * gate.element_size() * (3 + 5 if backward else 3)
    return {
        "rows": rows,
        "columns": columns,
        "seconds": seconds,
        "gb_per_second": {name: moved / s / 1e9 for name, s in seconds.items()},
        "over_ours": {name: s / seconds["ours"] for name, s in seconds.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=32768, help="a capture's rows (hybrid-1b's prompt)")
    parser.add_argument("--columns", type=int, default=5632, help="the MLP's intermediate width (hybrid-1b's)")
    parser.add_argument("--member-rows", type=int, default=4096, help="a member batch's rows (2 x 2,048)")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("swiglu_rate.py measures the CUDA kernels: no CUDA device here")
    gen = torch.Generator().manual_seed(0)
    result = {
        "capture_forward": measure(args.rows, args.columns, args.repeats, False, gen),
        "member_forward_backward": measure(args.member_rows, args.columns, args.repeats, True, gen),
        "provenance": provenance(torch.device("cuda")),
    }
    for phase in ("capture_forward", "member_forward_backward"):
        r = result[phase]
        print(
            f"{phase} ({r['rows']} x {r['columns']}): "
            + ", ".join(
                f"{name} {s * 1e3:.3f} ms ({r['gb_per_second'][name]:.0f} GB/s, {r['over_ours'][name]:.2f}x ours)"
                for name, s in r["seconds"].items()
            )
        )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
