"""The 27B shape's limits in one H200 run: kernel ceilings, capture against its FLOP floor, and the
replay transient with the allocation sites that hold it (issue 20).

    python benchmarks/kernel_ceilings.py --out $OUT/kernel_ceilings.json \
        [--results $OUT/architectures__qwen3.6-27b-shape-nf4-65536-replay-checkpointed.json ...]

Measured here (CUDA): attention TFLOP/s of each block kernel paged attention can call (flash forward
and backward, cuDNN's forward) at head dims 128 and 256 on the 27B's heads (24 query, 4 K/V) over a
capture chunk's folded rows, torch's causal SDPA beside them; one NF4 linear layer of the 27B's MLP
shape on a capture chunk's rows through the layer as capture calls it (dequantise + GEMM), through
bitsandbytes' fused 4-bit GEMM, and as a bf16 GEMM, against a square bf16 GEMM. Read from the given
pipeline results (sweep points run with `measure.kernel_rates` / `measure.allocation_sites`): capture
seconds against the floor at that run's rates, and each step's replay transient against its graph
bytes with the top allocation sites. Prints one line per figure; the JSON carries provenance.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from longstraw.kernels.rates import block_rates, causal_sdpa_rate, gemm_rate, nf4_linear_rates
from longstraw.measure.provenance import provenance
from longstraw.results import write_json_atomic

HEADS, KV_HEADS, CAPTURE_ROWS = 24, 4, 16384
MLP_SHAPE = (5120, 17408)  # Qwen3.6-27B: hidden 5120, intermediate 17408


def attention_ceilings(device) -> dict:
    out = {}
    for dim in (128, 256):
        # a capture chunk's queries (folded: G x 16384 rows per K/V head) against one 65,536-key block
        rates = block_rates(HEADS, KV_HEADS, dim, CAPTURE_ROWS, torch.bfloat16, device, repeats=4)
        rates["causal_sdpa"] = causal_sdpa_rate(HEADS, dim, 131072, torch.bfloat16, device)
        out[f"head_dim_{dim}"] = rates
        torch.cuda.empty_cache()
    # replay's block: one response of 1,024 (folded: 6 x 1,024 rows per K/V head) against 65,536 keys
    out["head_dim_256_replay_rows"] = block_rates(HEADS, KV_HEADS, 256, 1024, torch.bfloat16, device)
    return out


def nf4_ceilings(device) -> dict:
    from longstraw.models.quant import quantize_nf4

    holder = torch.nn.Module()
    holder.mlp_up = torch.nn.Linear(*MLP_SHAPE, bias=False, device=device, dtype=torch.bfloat16)
    quantize_nf4(holder, skip=())
    holder.is_loaded_in_4bit = True
    rates = {
        "nf4_linear": nf4_linear_rates(holder, CAPTURE_ROWS, torch.bfloat16, device),
        "nf4_linear_replay_rows": nf4_linear_rates(holder, 1024, torch.bfloat16, device),
        "gemm": gemm_rate(torch.bfloat16, device),
    }
    return rates


def from_results(paths) -> list[dict]:
    rows = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        metrics = result.get("metrics", {})
        capture = metrics.get("capture", {})
        row = {
            "point": result.get("name"),
            "status": result.get("status"),
            "positions": capture.get("positions"),
            "capture_seconds": capture.get("capture_seconds"),
            "capture_floor": capture.get("floor"),
            "weights_seconds": metrics.get("weights", {}).get("seconds"),
            "steps": [
                {
                    k: s.get(k)
                    for k in (
                        "mode",
                        "count",
                        "status",
                        "replay_transient_bytes",
                        "graph_bytes_peak",
                        "allocation_sites",
                        "logp_mismatch",
                    )
                }
                | {"replay_seconds": s.get("phases", {}).get("replay", {}).get("seconds")}
                for s in metrics.get("steps", [])
            ],
        }
        rows.append(row)
    return rows


def print_report(report: dict) -> None:
    for dim, rates in report["attention"].items():
        print(
            f"attention {dim}: " + ", ".join(f"{k} {v['tflops_per_second']:.0f}" for k, v in rates.items()) + " TFLOP/s"
        )
        if "cudnn_backward" in rates:
            print(f"  cudnn_backward dq vs flash: {rates['cudnn_backward']['dq_difference_from_flash']:.2e} (relative)")
    nf4, gemm = report["linear"], report["linear"]["gemm"]["tflops_per_second"]
    for key in ("nf4_linear", "nf4_linear_replay_rows"):
        print(
            f"{key} ({nf4[key]['as_captured']['rows']} rows): "
            + ", ".join(
                f"{k} {v['tflops_per_second']:.0f} TFLOP/s ({v['tflops_per_second'] / gemm:.0%} of the square GEMM's "
                f"{gemm:.0f})"
                for k, v in nf4[key].items()
            )
        )
    for row in report["results"]:
        floor = row["capture_floor"]
        if floor:
            parts = ", ".join(f"{k} {v:.1f} s" for k, v in floor["parts_seconds"].items())
            print(
                f"{row['point']}: capture {row['capture_seconds']:.1f} s over {row['positions']:,} positions, "
                f"floor {floor['seconds']:.1f} s ({parts}): {row['capture_seconds'] / floor['seconds']:.2f}x; "
                f"weights built in {row['weights_seconds']:.1f} s"
            )
        for step in row["steps"]:
            if step["status"] != "ok":
                print(f"  {step['mode']} G={step['count']}: {step['status']}")
                continue
            print(
                f"  {step['mode']} G={step['count']}: replay transient {step['replay_transient_bytes'] / 1e9:.2f} GB, "
                f"graph {step['graph_bytes_peak'] / 1e9:.2f} GB, replay {step['replay_seconds']:.1f} s, "
                + (
                    f"logp mismatch max {step['logp_mismatch']['max']:.3g}"
                    if step["logp_mismatch"]
                    else "old policy: the replay's own (on-policy, not scored)"
                )
            )
            for site in (step.get("allocation_sites") or {}).get("sites", [])[:8]:
                print(f"      {site['bytes'] / 1e9:7.3f} GB x{site['count']:<5} {site['site']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--results", nargs="*", default=[], help="pipeline results to read capture and replay from")
    args = parser.parse_args()
    device = torch.device("cuda")
    report = {
        "provenance": provenance(device),
        "attention": attention_ceilings(device),
        "linear": nf4_ceilings(device),
        "results": from_results(args.results),
    }
    print_report(report)
    write_json_atomic(args.out, report)


if __name__ == "__main__":
    main()
