"""The decoding attention kernel's launch settings, timed: which prefix split and tile reads the pages fastest

    python benchmarks/decode_attention_tune.py --out F                       # SmolLM2's shape and hybrid-1b's, CUDA

One decoding step's attention (`kernels.decode_attention_triton`) of G rows over a shared prompt's pages, for every
layer of the model in turn (each layer's own pages, so the L2 cache does not hold them across calls, as in a step),
recorded as a CUDA graph and replayed (`measure.timing.graph_replay_seconds`): microseconds a layer for each setting
of (programs a multiprocessor in the prefix pass, keys a loop iteration, warps, pipeline stages), against the pages'
bytes over the copy bandwidth measured here. Prints a line per setting, the best first; the last stdout line is the
JSON written to --out, with provenance.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from longstraw.kernels.decode_attention_triton import BLOCK_N, SPLITS_PER_SM, WARPS, decode_attention_triton
from longstraw.measure.provenance import provenance
from longstraw.measure.timing import copy_bandwidth, graph_replay_seconds
from longstraw.results import write_json_atomic

# (name, layers with attention, query heads, K/V heads, head dim, prompt positions)
SHAPES = {
    "smollm2-135m-shape": (30, 9, 3, 64, 16384),
    "hybrid-1b": (4, 8, 2, 128, 1048576),
}


def _pages(shape, group: int, device):
    layers, H, K, D, P = shape
    like = dict(dtype=torch.bfloat16, device=device)
    q = torch.randn(group, H, 1, D, **like)
    shared = [(torch.randn(1, K, P, D, **like), torch.randn(1, K, P, D, **like)) for _ in range(layers)]
    own = (torch.randn(group, K, 64, D, **like), torch.randn(group, K, 64, D, **like))
    return q, shared, own


def _time(q, shared, own, settings) -> float:
    step = torch.tensor([7], device=q.device)

    def step_all_layers():
        for k, v in shared:
            decode_attention_triton(q, k, v, *own, step, q.shape[-1] ** -0.5, **settings)

    return graph_replay_seconds(step_all_layers, repeats=20) / len(shared)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device, repeats=10)
    result = {"group": args.group, "copy_bandwidth_bytes_per_second": bandwidth, "provenance": provenance(device)}
    default = dict(splits_per_sm=SPLITS_PER_SM, block_n=BLOCK_N, warps=WARPS, stages=None)
    grid = itertools.product((1, 2, 4, 8), (32, 64, 128), (4, 8), (None, 2, 4))
    settings = [dict(splits_per_sm=s, block_n=n, warps=w, stages=st) for s, n, w, st in grid]
    for name, shape in SHAPES.items():
        q, shared, own = _pages(shape, args.group, device)
        floor = 2 * shared[0][0].numel() * shared[0][0].element_size() / bandwidth
        rows = []
        for setting in settings:
            try:
                rows.append({**setting, "seconds_per_layer": _time(q, shared, own, setting)})
            except Exception as exc:  # a setting that does not compile or fit is a measured result
                rows.append({**setting, "error": f"{type(exc).__name__}: {exc}"[:200]})
        rows.sort(key=lambda r: r.get("seconds_per_layer", float("inf")))
        at_default = next(r for r in rows if all(r[k] == v for k, v in default.items()))
        result[name] = {"shape": shape, "floor_seconds_per_layer": floor, "default": at_default, "settings": rows}
        for r in rows[:8]:
            print(name, json.dumps(r), f"{r.get('seconds_per_layer', 0) / floor:.2f}x floor", flush=True)
        print(name, "default", json.dumps(at_default), flush=True)
        write_json_atomic(args.out, result)
        del q, shared, own
        torch.cuda.empty_cache()
    print(json.dumps({k: v for k, v in result.items() if k not in SHAPES}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
