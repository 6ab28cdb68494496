"""A folded decoding step's four projections at a model's widths (CUDA): cuBLAS's GEMMs (`decode_linear`'s
"cublas", the reference) against `decode_linear_triton`'s kernels, each as it runs in the decoding graph.

    python benchmarks/decode_linear_rate.py [--rows 8 --hidden 576 --intermediate 1536 --qkv 960] [--sweep] [--out F]

For q/k/v (x W^T), o_proj and down_proj into the residual, and the folded gate/up with its SwiGLU (cuBLAS: the
stacked GEMM, then `swiglu_stacked_scaled_triton`; Triton: one launch), and for the four in a layer's order: the
microseconds a call inside a CUDA graph of `--calls` calls replayed `--repeats` times (the decoding step is such a
graph, so neither side pays a host launch), the weights' bytes over that time, and cuBLAS over Triton. `--sweep`
times other launch shapes (`decode_linear_triton.Blocks`) too. Defaults: SmolLM2-135M's widths at G = 8. The last
stdout line is one JSON object, also written to --out.
"""

from __future__ import annotations

import argparse
import json

import torch

from longstraw.kernels.decode_linear import add_rows_linear_, decode_linear, rows_linear, rows_swiglu
from longstraw.kernels.decode_linear_triton import BLOCKS, Blocks, rows_linear_triton, rows_swiglu_triton
from longstraw.measure.provenance import provenance
from longstraw.measure.timing import graph_replay_seconds
from longstraw.results import write_json_atomic

SWEEP = [Blocks(n, k, 4, stages) for n in (16, 32) for k in (64, 128, 256) for stages in (2, 3)]


def _operands(args, gen) -> dict:
    """The layer's rows, residual and weights (scaled so sums stay O(1) over the repeats' residual additions)."""

    def randn(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to("cuda", torch.bfloat16)

    H, I, M = args.hidden, args.intermediate, args.rows
    return {
        "x": randn(M, 1, H),
        "residual": randn(M, 1, H),
        "heads": randn(M, 1, H),
        "product": randn(M, 1, I),
        "qkv": randn(args.qkv, H, scale=H**-0.5),
        "o": randn(H, H, scale=1e-3 * H**-0.5),
        "gate_up": randn(2 * I, H, scale=H**-0.5),
        "down": randn(H, I, scale=1e-3 * I**-0.5),
    }


def _calls(t: dict, blocks: Blocks | None) -> dict:
    """Each projection as a call: the dispatcher's (`blocks` None, under the caller's `decode_linear` choice) or the
    Triton kernels launched with `blocks`."""
    if blocks is None:
        return {
            "qkv": lambda: rows_linear(t["x"], t["qkv"]),
            "o_proj into the residual": lambda: add_rows_linear_(t["residual"], t["heads"], t["o"]),
            "gate_up and swiglu": lambda: rows_swiglu(t["x"], t["gate_up"], 1e-5),
            "down_proj into the residual": lambda: add_rows_linear_(t["residual"], t["product"], t["down"]),
        }
    return {
        "qkv": lambda: rows_linear_triton(t["x"], t["qkv"], blocks=blocks),
        "o_proj into the residual": lambda: rows_linear_triton(t["heads"], t["o"], t["residual"], blocks=blocks),
        "gate_up and swiglu": lambda: rows_swiglu_triton(t["x"], t["gate_up"], 1e-5, blocks=blocks),
        "down_proj into the residual": lambda: rows_linear_triton(
            t["product"], t["down"], t["residual"], blocks=blocks
        ),
    }


def _microseconds(call, calls: int, repeats: int) -> float:
    """A call's device microseconds inside a recorded graph of `calls` calls."""
    return 1e6 * graph_replay_seconds(lambda: [call() for _ in range(calls)], repeats) / calls


def _timed(t: dict, blocks: Blocks | None, args) -> dict:
    calls = _calls(t, blocks)
    timed = {name: _microseconds(call, args.calls, args.repeats) for name, call in calls.items()}
    timed["layer"] = _microseconds(lambda: [call() for call in calls.values()], args.calls, args.repeats)
    return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=8, help="the decoding step's rows (G)")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--qkv", type=int, default=960, help="q, k and v's stacked output width")
    parser.add_argument("--calls", type=int, default=50, help="calls a recorded graph")
    parser.add_argument("--repeats", type=int, default=20, help="replays of the graph timed")
    parser.add_argument("--sweep", action="store_true", help="also time the launch shapes in SWEEP")
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("decode_linear_rate.py measures CUDA kernels: no CUDA device here")
    t = _operands(args, torch.Generator().manual_seed(0))
    weight_bytes = {
        name: t[key].numel() * t[key].element_size()
        for name, key in (
            ("qkv", "qkv"),
            ("o_proj into the residual", "o"),
            ("gate_up and swiglu", "gate_up"),
            ("down_proj into the residual", "down"),
        )
    }
    weight_bytes["layer"] = sum(weight_bytes.values())
    microseconds = {}
    for name in ("cublas", "triton"):
        with decode_linear(name):
            microseconds[name] = _timed(t, None, args)
    if args.sweep:
        for blocks in SWEEP:
            microseconds[f"triton {tuple(blocks)}"] = _timed(t, blocks, args)
    result = {
        "shape": {k: getattr(args, k) for k in ("rows", "hidden", "intermediate", "qkv")},
        "blocks": list(BLOCKS),
        "microseconds": microseconds,
        "gb_per_second": {
            path: {op: weight_bytes[op] / us / 1e3 for op, us in ops.items()} for path, ops in microseconds.items()
        },
        "cublas_over_triton": {op: microseconds["cublas"][op] / us for op, us in microseconds["triton"].items()},
        "provenance": provenance(torch.device("cuda")),
    }
    for path, ops in microseconds.items():
        print(f"{path}: " + ", ".join(f"{op} {us:.2f} us" for op, us in ops.items()), flush=True)
    print("cublas over triton: " + ", ".join(f"{op} {r:.2f}x" for op, r in result["cublas_over_triton"].items()))
    print(json.dumps(result))
    if args.out:
        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
