"""What a Gated DeltaNet layer pays between its projection and its rule, in capture and in replay, at hybrid-1b's
widths (CUDA): the conv, SiLU, the q/k/v split and q and k's l2 norm.

Capture (no grad): one fused Triton launch (`conv_split_heads`) against the composition it replaced (fla's conv,
three contiguous copies, fla's l2 norm) and against fla's conv alone (what the bytes cost at a rate a conv reaches
here). Replay (x alone needing a gradient): the fused forward and backward against the composition under autograd
(fla's conv and its backward, the copies, fla's l2 norm and its backward, as fla's rule ran it).

    python benchmarks/gdn_conv_split.py [--tokens 32768 --key-dim 2048 --value-dim 4096 --head-dim 128] \
        [--replay-rows 2 2048]

Prints each path's median seconds, the ratios, the GB/s each capture path moves (its input once, its output once)
and the configurations the fused kernels' autotuners chose (each candidate's time in the JSON); the last stdout line
is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from longstraw.kernels import gdn_conv_triton
from longstraw.kernels.causal_conv import causal_conv1d_channels_last, conv_split_heads
from longstraw.kernels.optional_import import optional_function
from longstraw.measure.autotuned import autotuned_choice
from longstraw.measure.provenance import provenance
from longstraw.measure.timing import seconds_each


def composition(x, state, weight, bias, key_dim, head_dim):
    """The path before the fused kernel: fla's conv, the slices copied out, fla's l2 norm on q and k (with autograd
    where x needs a gradient, as fla's rule ran it)."""
    l2norm = optional_function("fla.modules.norm.l2norm", "l2norm")
    y, new_state = causal_conv1d_channels_last(x, state, weight, bias, "silu")
    B, T, _ = y.shape
    q, k, v = (t.contiguous() for t in torch.split(y, [key_dim, key_dim, y.shape[-1] - 2 * key_dim], -1))
    q, k = (l2norm(t.reshape(B, T, -1, head_dim)) for t in (q, k))
    return q, k, v.reshape(B, T, -1, head_dim), new_state


def replay_paths(rows: list[int], C: int, key_dim: int, head_dim: int, gen) -> dict:
    """Forward and backward with x alone needing a gradient (a loss on q, k and v), fused and composed."""
    x, state, weight, bias = (
        torch.randn(*shape, generator=gen).to(device="cuda", dtype=torch.bfloat16)
        for shape in ((*rows, C), (rows[0], C, 3), (C, 4), (C,))
    )
    grads = [
        torch.randn(*rows, width // head_dim, head_dim, generator=gen).to("cuda", torch.bfloat16)
        for width in (key_dim, key_dim, C - 2 * key_dim)
    ]

    def through(split):
        def run():
            leaf = x.detach().requires_grad_(True)
            torch.autograd.backward(split(leaf, state, weight, bias, key_dim, head_dim)[:3], grads)
            return leaf.grad

        return run

    def fused(x, state, weight, bias, key_dim, head_dim):
        return conv_split_heads(x, state, weight, bias, key_dim, head_dim, head_dim)

    return {"fused": through(fused), "composition": through(composition)}


def median_seconds(fn, repeats: int) -> float:
    fn()  # compile, autotune and warm up
    return statistics.median(seconds_each(fn, torch.device("cuda"), repeats))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--key-dim", type=int, default=2048)
    parser.add_argument("--value-dim", type=int, default=4096)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--replay-rows", type=int, nargs=2, default=[2, 2048], help="members x rows of a replay")
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
        "fla_conv_alone": lambda: causal_conv1d_channels_last(x, state, weight, bias, "silu"),
    }
    with torch.no_grad():
        seconds = {name: median_seconds(fn, args.repeats) for name, fn in paths.items()}
        fused, plain = paths["fused"](), paths["composition"]()
    forward_tuned = autotuned_choice(gdn_conv_triton._conv_split_normalized_kernel)
    difference = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(fused, plain))
    replay = replay_paths(args.replay_rows, C, args.key_dim, args.head_dim, gen)
    replay_seconds = {name: median_seconds(fn, args.repeats) for name, fn in replay.items()}
    tuned = {
        "forward": forward_tuned,
        "pre_activation_gradient": autotuned_choice(gdn_conv_triton._pre_activation_gradient_kernel),
        "input_gradient": autotuned_choice(gdn_conv_triton._conv_input_gradient_kernel),
    }
    ours, theirs = (replay[name]().float() for name in ("fused", "composition"))
    replay_difference = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    moved = 2 * x.numel() * x.element_size()
    result = {
        "shape": {"tokens": args.tokens, "channels": C, "key_dim": args.key_dim, "head_dim": args.head_dim},
        "seconds": seconds,
        "fused_over_composition": seconds["fused"] / seconds["composition"],
        "fused_over_fla_conv_alone": seconds["fused"] / seconds["fla_conv_alone"],
        "gb_per_second": {name: moved / s / 1e9 for name, s in seconds.items()},
        "largest_relative_difference": difference,
        "replay": {
            "rows": args.replay_rows,
            "forward_backward_seconds": replay_seconds,
            "fused_over_composition": replay_seconds["fused"] / replay_seconds["composition"],
            "dx_largest_relative_difference": replay_difference,
        },
        "autotuned": tuned,
        "provenance": provenance(torch.device("cuda")),
    }
    print(
        f"capture: fused {seconds['fused'] * 1e3:.3f} ms ({result['gb_per_second']['fused']:.0f} GB/s), composition "
        f"{seconds['composition'] * 1e3:.3f} ms ({result['fused_over_composition']:.2f}x), fla's conv alone "
        f"{seconds['fla_conv_alone'] * 1e3:.3f} ms ({result['gb_per_second']['fla_conv_alone']:.0f} GB/s; fused "
        f"{result['fused_over_fla_conv_alone']:.2f}x); largest difference {difference:.2g} of the largest value\n"
        f"replay {args.replay_rows}: forward+backward fused {replay_seconds['fused'] * 1e3:.3f} ms, composition "
        f"{replay_seconds['composition'] * 1e3:.3f} ms ({result['replay']['fused_over_composition']:.2f}x); dx "
        f"differs by {replay_difference:.2g} of the largest\n"
        + "\n".join(f"{name}: {choice and choice['chosen']}" for name, choice in tuned.items())
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
