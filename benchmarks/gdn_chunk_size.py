"""What the Gated DeltaNet chunk size costs a replay: the differentiable chunked rule (`chunk_gated_delta_rule`)
forward + backward at one layer's shape, per chunk size, warm, with its kernel count and device-busy fraction;
and the no-grad forward a capture runs (fla's when importable) at the capture's shape.

    python benchmarks/gdn_chunk_size.py --device cuda [--batch 2 --tokens 2048 --chunks 64 128 256]

The defaults are hybrid-1b's GDN layer (16 q/k heads, 32 value heads, head dims 128) replaying two responses of
2,048. The outputs are compared with chunk 64's (the same rule in another association order: the difference
is float32 rounding). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from longstraw.kernels.gdn import chunk_gated_delta_rule, chunk_gated_delta_rule_forward
from longstraw.measure.kernel_profile import kernel_profile
from longstraw.measure.timing import seconds_each


def rule_inputs(batch, tokens, hk, hv, dk, dv, device, dtype, seed=0):
    """Random inputs in the ranges a GDN layer gives the rule (log decay <= 0, beta in (0, 1))."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    g = -torch.nn.functional.softplus(randn(batch, tokens, hv).float()).to(device)
    beta = randn(batch, tokens, hv).sigmoid()
    state = torch.randn(batch, hv, dk, dv, generator=gen).to(device) * 0.1
    return randn(batch, tokens, hk, dk), randn(batch, tokens, hk, dk), randn(batch, tokens, hv, dv), g, beta, state


def median_seconds(fn, device, repeats):
    fn()  # warm-up
    return statistics.median(seconds_each(fn, device, repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--capture-tokens", type=int, default=8192)
    parser.add_argument("--heads", type=int, nargs=2, default=[16, 32], metavar=("QK", "V"))
    parser.add_argument("--head-dims", type=int, nargs=2, default=[128, 128], metavar=("DK", "DV"))
    parser.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    hk, hv = args.heads
    dk, dv = args.head_dims
    leaves = [t.requires_grad_() for t in rule_inputs(args.batch, args.tokens, hk, hv, dk, dv, device, dtype)]
    seed_grad = torch.randn(args.batch, args.tokens, hv, dv, generator=torch.Generator().manual_seed(1)).to(device)
    rows, reference = [], None
    for chunk in args.chunks:

        def forward_backward():
            out, final = chunk_gated_delta_rule(*leaves, chunk_size=chunk)
            ((out.float() * seed_grad).sum() + final.sum()).backward()
            for leaf in leaves:
                leaf.grad = None
            return out

        out = chunk_gated_delta_rule(*leaves, chunk_size=chunk)[0].detach().float()
        reference = out if reference is None else reference
        seconds = median_seconds(forward_backward, device, args.repeats)
        profile = kernel_profile(forward_backward, device, top=5)
        rows.append(
            {
                "chunk": chunk,
                "seconds": seconds,
                "kernels": profile["kernels"],
                "busy_fraction": profile["busy_fraction"],
                "max_abs_diff_vs_first": float((out - reference).abs().max()),
                "top": profile["top"],
            }
        )
        print(
            f"replay rule fwd+bwd, chunk {chunk}: {seconds * 1e3:.1f} ms, {profile['kernels']} kernels, "
            f"busy {profile['busy_fraction']:.0%}, max |out - chunk {args.chunks[0]}| "
            f"{rows[-1]['max_abs_diff_vs_first']:.2e}",
            flush=True,
        )
    with torch.no_grad():
        capture_inputs = rule_inputs(1, args.capture_tokens, hk, hv, dk, dv, device, dtype)
        capture_seconds = median_seconds(lambda: chunk_gated_delta_rule_forward(*capture_inputs), device, args.repeats)
    print(f"capture rule forward, {args.capture_tokens} tokens: {capture_seconds * 1e3:.1f} ms", flush=True)
    print(json.dumps({"replay": rows, "capture_tokens": args.capture_tokens, "capture_seconds": capture_seconds}))


if __name__ == "__main__":
    main()
