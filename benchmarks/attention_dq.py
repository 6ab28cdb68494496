"""The prefix's backward in a replay (CUDA): `attention_dq_triton` (dQ alone) against the library's whole backward
(cuDNN's, as "auto" runs it on prefix blocks; flash's beside it), at a member batch's folded rows over a prompt's pages.

    python benchmarks/attention_dq.py [--rows 16384 --keys 32767 --kv-heads 2 --head-dim 128 --repeats 10]

The defaults are hybrid-1b's floor point: two members of 2,048 tokens, 8 query heads over 2 K/V heads folded into
16,384 rows a K/V head, over 32,767 prompt keys (a page view of a longer buffer, as replay reads them). Prints each
path's median seconds and TFLOP/s (dQ's three products: 6 rows keys head_dim a K/V head; the library's five count
10), each configuration of ours timed alone and the autotuner's choice, and how far each dQ is from a float64 one
on a sample of rows; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from longstraw.kernels import paged_attention as attention
from longstraw.kernels.attention_dq_triton import CONFIGS, attention_dq_triton
from longstraw.measure.provenance import provenance
from longstraw.measure.timing import seconds_each

SAMPLE_ROWS = 256  # rows of the float64 check (the whole [rows, keys] float64 scores would not fit)


def inputs(rows: int, keys: int, heads: int, dim: int, gen) -> dict:
    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32).bfloat16()

    q, do = randn(1, heads, rows, dim), randn(1, heads, rows, dim)
    pages_k, pages_v = randn(1, heads, keys + 1000, dim), randn(1, heads, keys + 1000, dim)
    k, v = pages_k[:, :, :keys], pages_v[:, :, :keys]
    out, lse = attention._cudnn_block_fwd(q, k, v, dim**-0.5)
    return {"do": do, "q": q, "k": k, "v": v, "out": out.contiguous(), "lse": lse.float().contiguous()}


def float64_dq(x: dict, scale: float) -> torch.Tensor:
    """dQ of the first SAMPLE_ROWS rows of each head in float64 (`_math_block_bwd`)."""
    rows = slice(0, SAMPLE_ROWS)
    do, q, out = (x[name][:, :, rows].double() for name in ("do", "q", "out"))
    delta = (do * out).sum(-1)
    dq, _, _ = attention._math_block_bwd(
        do, q, x["k"].double(), x["v"].double(), x["lse"][:, :, rows].double(), delta, scale, need_kv=False
    )
    return dq


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=16384, help="folded query rows a K/V head")
    parser.add_argument("--keys", type=int, default=32767)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = inputs(args.rows, args.keys, args.kv_heads, args.head_dim, gen)
    scale = args.head_dim**-0.5
    reference = float64_dq(x, scale)
    rows = (x["do"], x["q"], x["k"], x["v"], x["out"], x["lse"])

    def ours(config=None):
        dq = torch.zeros(x["q"].shape, dtype=torch.float32, device="cuda")
        attention_dq_triton(*rows, scale, dq, config=config)
        return dq

    runs = {"cudnn": lambda: attention._cudnn_block_bwd(*rows, scale)[0]}
    runs["flash"] = lambda: attention._flash_block_bwd(*rows, scale)[0]
    runs["dq autotuned"] = ours
    runs |= {f"dq {'-'.join(map(str, c))}": lambda c=c: ours(c) for c in CONFIGS}
    product = 2 * args.kv_heads * args.rows * args.keys * args.head_dim  # one [rows, keys, head_dim] product
    table = {}
    for name, run in runs.items():
        try:
            dq = run()  # compile (the autotuner: every configuration) and warm up
            seconds = statistics.median(seconds_each(run, torch.device("cuda"), args.repeats))
        except Exception as error:  # a configuration that does not build here (shared memory): shown, not fatal
            table[name] = {"error": f"{type(error).__name__}: {str(error)[:200]}"}
            print(f"{name}: {table[name]['error']}", flush=True)
            continue
        sample = dq[:, :, :SAMPLE_ROWS].double()
        error = ((sample - reference).norm() / reference.norm()).item()
        flops = product * (5 if name in ("cudnn", "flash") else 3)
        table[name] = {"seconds": seconds, "tflops": flops / seconds / 1e12, "relative_error": error}
        print(f"{name}: {seconds * 1e3:.3f} ms, {flops / seconds / 1e12:.0f} TFLOP/s, error {error:.2e}", flush=True)
    timed = {name: row["seconds"] for name, row in table.items() if "seconds" in row}
    best = min((name for name in timed if name.startswith("dq ")), key=timed.get, default=None)
    if best is not None and "cudnn" in timed:
        print(f"fastest dq: {best}, {timed['cudnn'] / timed[best]:.2f}x faster than cuDNN's whole backward")
    print(
        json.dumps(
            {
                "rows": args.rows,
                "keys": args.keys,
                "kv_heads": args.kv_heads,
                "head_dim": args.head_dim,
                "paths": table,
                "fastest_dq": best,
                "provenance": provenance(torch.device("cuda")),
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
