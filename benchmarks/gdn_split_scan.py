"""A capture's Gated DeltaNet forward with fla's state scan split across the sequence (`split_scan_forward`) against
fla's whole-sequence chunk forward, at one layer's capture shape (CUDA): the median seconds of each, their ratio,
and how far each is from the float32 torch chunk rule (the plain reference) in output and final state.

    python benchmarks/gdn_split_scan.py [--tokens 32768 --heads 16 32 --head-dims 128 128 --repeats 10]

The defaults are hybrid-1b's GDN layer (16 q/k heads, 32 value heads, head dims 128) over a 32,768-token prompt.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from longstraw.kernels.gdn import _fla_forward, _load_fla, chunk_gated_delta_rule
from longstraw.kernels.gdn_split_scan import split_scan_forward
from longstraw.measure.provenance import provenance
from longstraw.measure.timing import seconds_each


def capture_inputs(tokens, hk, hv, dk, dv, seed=0):
    """One sequence as a capture gives the rule: q and k l2-normalised bf16, v bf16, float32 log decay <= 0, beta in
    (0, 1), a float32 start state."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = (F.normalize(randn(1, tokens, hk, dk), dim=-1).cuda().bfloat16() for _ in range(2))
    v = randn(1, tokens, hv, dv).cuda().bfloat16()
    g = -F.softplus(randn(1, tokens, hv)).cuda() * 0.1
    beta = randn(1, tokens, hv).sigmoid().cuda().bfloat16()
    state = (randn(1, hv, dk, dv) * 0.1).cuda()
    return q, k, v, g, beta, state


def relative(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--heads", type=int, nargs=2, default=[16, 32], metavar=("QK", "V"))
    parser.add_argument("--head-dims", type=int, nargs=2, default=[128, 128], metavar=("DK", "DV"))
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    inputs = capture_inputs(args.tokens, *args.heads, *args.head_dims)
    scale = args.head_dims[0] ** -0.5
    fla_chunk, fla_version = _load_fla()
    paths = {
        "whole": lambda: _fla_forward(fla_chunk, fla_version, *inputs, l2norm_qk=False),
        "split": lambda: split_scan_forward(*inputs, scale),
    }
    with torch.no_grad():
        reference = chunk_gated_delta_rule(*(t.float() for t in inputs), l2norm_qk=False)
        row = {"tokens": args.tokens, "heads": args.heads, "head_dims": args.head_dims}
        print(f"reference (float32 torch rule) done; {args.repeats} timed calls of each path follow", flush=True)
        for name, run in paths.items():
            start = time.perf_counter()
            out, state = run()
            torch.cuda.synchronize()
            row[f"{name}_first_call_seconds"] = time.perf_counter() - start  # compiling and autotuning included
            row[f"{name}_out_error"] = relative(out, reference[0])
            row[f"{name}_state_error"] = relative(state, reference[1])
            seconds = seconds_each(run, torch.device("cuda"), args.repeats)
            row[f"{name}_seconds"] = statistics.median(seconds)
            errors = f"output {row[f'{name}_out_error']:.2e}, state {row[f'{name}_state_error']:.2e}"
            print(
                f"{name}: {row[f'{name}_seconds'] * 1e3:.3f} ms (median of {args.repeats}; first call "
                f"{row[f'{name}_first_call_seconds']:.1f} s); against the float32 torch rule: {errors}"
            )
    row["split_over_whole"] = row["split_seconds"] / row["whole_seconds"]
    print(f"split over whole: {row['split_over_whole']:.3f}")
    print(json.dumps({**row, "provenance": provenance()}))


if __name__ == "__main__":
    main()
