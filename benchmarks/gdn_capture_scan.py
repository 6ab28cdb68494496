"""A capture's Gated DeltaNet rule at one layer's shape (CUDA): the fused scan (each chunk's output computed inside
the state scan, `gdn_scan_triton`) against fla's whole forward (its scan writes every chunk's state, its output
kernel reads them back), no grad, from a state, q and k with unit rows as the conv's norm leaves them.

    python benchmarks/gdn_capture_scan.py [--tokens 32768 --heads 16 32 --head-dims 128 128 --repeats 20]

Prints each scan's median seconds, first-call seconds (compiling and tuning), their ratio, how far each is from the
float32 torch chunk rule (norm-wise, output and final state) and the configuration the fused scan's autotuner chose
(each candidate's time); the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from longstraw.kernels import gdn, gdn_scan_triton
from longstraw.measure.autotuned import autotuned_choice
from longstraw.measure.provenance import provenance
from longstraw.measure.timing import seconds_each


def inputs(tokens: int, hk: int, hv: int, dk: int, dv: int, gen) -> list[torch.Tensor]:
    """bf16 q, k (unit rows), v and beta, float32 log decays in (-0.5, 0] and a float32 state, on CUDA."""

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = (torch.nn.functional.normalize(randn(1, tokens, hk, dk), dim=-1) for _ in range(2))
    v, beta = randn(1, tokens, hv, dv), randn(1, tokens, hv).sigmoid()
    g = -0.5 * torch.rand(1, tokens, hv, generator=gen)
    state = 0.1 * randn(1, hv, dk, dv)
    return [t.to("cuda", torch.bfloat16) for t in (q, k, v)] + [g.cuda(), beta.to("cuda", torch.bfloat16), state.cuda()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768, help="a capture's rows (hybrid-1b's prompt)")
    parser.add_argument("--heads", type=int, nargs=2, default=[16, 32], metavar=("QK", "V"))
    parser.add_argument("--head-dims", type=int, nargs=2, default=[128, 128], metavar=("DK", "DV"))
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gdn_capture_scan.py measures the CUDA kernels: no CUDA device here")
    rule = inputs(args.tokens, *args.heads, *args.head_dims, torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = gdn.chunk_gated_delta_rule(*rule, l2norm_qk=False)  # float32 torch chunk rule
        result = {"shape": {"tokens": args.tokens, "heads": args.heads, "head_dims": args.head_dims}}
        for scan in gdn.CAPTURE_SCANS:
            with gdn.capture_scan(scan):
                run = lambda: gdn.chunk_gated_delta_rule_forward(*rule, l2norm_qk=False)  # noqa: E731
                torch.cuda.synchronize()
                start = time.perf_counter()
                out, final = run()
                torch.cuda.synchronize()
                first = time.perf_counter() - start
                seconds = statistics.median(seconds_each(run, torch.device("cuda"), args.repeats))
            result[scan] = {
                "seconds": seconds,
                "first_call_seconds": first,
                "output_from_float32_rule": gdn._relative_error(out, reference[0]),
                "state_from_float32_rule": gdn._relative_error(final, reference[1]),
            }
    result["fused"]["autotuned"] = autotuned_choice(gdn_scan_triton._scan_output_kernel)
    result["fused_over_fla"] = result["fused"]["seconds"] / result["fla"]["seconds"]
    result["provenance"] = provenance(torch.device("cuda"))
    for scan in gdn.CAPTURE_SCANS:
        r = result[scan]
        print(
            f"{scan}: {r['seconds'] * 1e3:.3f} ms (first call {r['first_call_seconds']:.1f} s), from the float32 rule: "
            f"output {r['output_from_float32_rule']:.2e}, state {r['state_from_float32_rule']:.2e}"
        )
    print(f"fused over fla: {result['fused_over_fla']:.3f}x; the scan's configuration: {result['fused']['autotuned']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
