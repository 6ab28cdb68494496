"""Capture's transient memory at growing prompt lengths (one fresh process per point).

    python benchmarks/capture_transient_memory.py [--preset small-qwen3_5] [--lengths 8192 16384 32768 65536]

transient = peak during capture - memory before capture - resident state bytes
(CPU: process RSS; CUDA: allocated bytes). Chunk-major capture must stay flat as the prompt
grows; layer-major (chosen when [P, hidden] activations fit the memory budget) grows by design
and is shown for contrast. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from group_size_memory import run_point


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-qwen3_5")
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for order in ("chunk", "layer"):
            for n in args.lengths:
                config = {
                    "name": f"capture_{order}_{n}",
                    "kind": "capture",
                    "model": {"preset": args.preset, "device": args.device},
                    "prompt": {"length": n},
                    "capture": {"chunk_size": args.chunk, "order": order},
                }
                m = run_point(config, Path(tmp))["metrics"]
                rows.append(
                    {
                        "order": order,
                        "positions": m["positions"],
                        "transient_bytes": m["transient_bytes"],
                        "resident_bytes": m["resident_bytes"],
                        "positions_per_second": m["positions_per_second"],
                    }
                )
                print(
                    f"{order:>5}-major P={n:>8,}: resident {m['resident_bytes'] / 2**20:8.1f} MiB  "
                    f"transient {m['transient_bytes'] / 2**20:8.1f} MiB  {m['positions_per_second']:,.0f} pos/s",
                    flush=True,
                )
    chunk = [r for r in rows if r["order"] == "chunk"]
    growth = chunk[-1]["transient_bytes"] / max(chunk[0]["transient_bytes"], 1)
    print(
        f"\nchunk-major transient, longest / shortest prompt ({chunk[-1]['positions']:,} / "
        f"{chunk[0]['positions']:,} positions): {growth:.3f}  (flat means ~1)"
    )
    print(json.dumps({"preset": args.preset, "points": rows, "chunk_transient_growth": growth}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
