"""What a Gated DeltaNet capture pays between its projection and its rule: the conv, the q/k/v split and q and k's
l2 norm, as one fused Triton kernel (`conv_split_heads` on CUDA without grad) against the composition it
replaces (fla's conv, three contiguous copies, fla's l2 norm, as the rule ran it), at one layer's capture shape.

    python benchmarks/gdn_conv_split.py [--tokens 32768 --key-dim 2048 --value-dim 4096 --head-dim 128]

The defaults are hybrid-1b's GDN layer. Prints each path's median seconds, the ratio and the GB/s the fused kernel
moves (its input once, its output once); the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from longstraw.kernels.causal_conv import causal_conv1d_channels_last, conv_split_heads
from longstraw.kernels.fla_import import fla_function
from longstraw.measure.provenance import provenance
from longstraw.measure.timing import seconds_each


def composition(x, state, weight, bias, key_dim, head_dim):
    """The capture's path before the fused kernel: fla's conv, the slices copied out, fla's l2 norm on q and k."""
    l2norm = fla_function("fla.modules.norm.l2norm", "l2norm_fwd")
    y, new_state = causal_conv1d_channels_last(x, state, weight, bias, "silu")
    B, T, _ = y.shape
    q, k, v = (t.contiguous() for t in torch.split(y, [key_dim, key_dim, y.shape[-1] - 2 * key_dim], -1))
    q, k = (l2norm(t.reshape(B, T, -1, head_dim))[0] for t in (q, k))
    return q, k, v.reshape(B, T, -1, head_dim), new_state


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--key-dim", type=int, default=2048)
    parser.add_argument("--value-dim", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gdn_conv_split.py measures the CUDA kernels: no CUDA device here")
    gen = torch.Generator().manual_seed(0)
    C, K = 2 * args.key_dim + args.value_dim, 4
    x, state, weight, bias = (
        torch.randn(*shape, generator=gen).to(device="cuda", dtype=torch.bfloat16)
        for shape in ((1, args.tokens, C), (1, C, K - 1), (C, K), (C,))
    )
    paths = {
        "fused": lambda: conv_split_heads(x, state, weight, bias, args.key_dim, args.head_dim, args.head_dim),
        "composition": lambda: composition(x, state, weight, bias, args.key_dim, args.head_dim),
    }
    seconds = {}
    with torch.no_grad():
        for name, fn in paths.items():
            fn()  # compile and warm up
            seconds[name] = statistics.median(seconds_each(fn, torch.device("cuda"), args.repeats))
        fused, plain = paths["fused"](), paths["composition"]()
    difference = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(fused, plain))
    moved = 2 * x.numel() * x.element_size()
    result = {
        "shape": {"tokens": args.tokens, "channels": C, "key_dim": args.key_dim, "head_dim": args.head_dim},
        "seconds": seconds,
        "fused_over_composition": seconds["fused"] / seconds["composition"],
        "fused_gb_per_second": moved / seconds["fused"] / 1e9,
        "largest_relative_difference": difference,
        "provenance": provenance(torch.device("cuda")),
    }
    print(
        f"fused {seconds['fused'] * 1e3:.3f} ms, composition {seconds['composition'] * 1e3:.3f} ms "
        f"({result['fused_over_composition']:.2f}x); fused moves {result['fused_gb_per_second']:.0f} GB/s; "
        f"largest difference {difference:.2g} of the largest value"
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
