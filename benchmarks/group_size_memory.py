"""Memory against group size G for replay, hold_all and naive (one fresh process per point).

    python benchmarks/group_size_memory.py [--preset small-qwen3_5] [--prompt 4096] [--response 256]

Prints graph_bytes_peak (autograd saved tensors) and process peak RSS per mode and G, then the
ratios the design promises: replay's G=8 within 5% of G=2; hold_all growing about linearly.
The last stdout line is one JSON object with every measured point.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from longstraw.kinds import resolve_point
from longstraw.kinds.common import run_point_in_fresh_process

GROUP_SIZES = (1, 2, 4, 8)
MODES = ("replay", "hold_all", "naive")


def run_point(config: dict, workdir: Path) -> dict:
    result = run_point_in_fresh_process(resolve_point(config, config["name"]), workdir)
    if result["status"] != "ok":
        raise SystemExit(f"{config['name']}: {result['status']}: {result.get('error')}")
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small-qwen3_5")
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--response", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in MODES:
            for g in GROUP_SIZES:
                config = {
                    "name": f"{mode}_G{g}",
                    "kind": "step",
                    "mode": mode,
                    "model": {"preset": args.preset, "device": args.device, "lora": {"r": 8}},
                    "prompt": {"length": args.prompt},
                    "responses": {"count": g, "length": args.response},
                    "capture": {"chunk_size": 1024},
                }
                result = run_point(config, Path(tmp))
                m = result["metrics"]
                rows.append(
                    {
                        "mode": mode,
                        "G": g,
                        "graph_bytes_peak": m["graph_bytes_peak"],
                        "peak_rss_bytes": result["peak_rss_bytes"],
                        "peak_allocated_bytes": m["peak_allocated_bytes"],
                        "status": result["status"],
                    }
                )
                print(
                    f"{mode:>9} G={g}: graph {m['graph_bytes_peak'] / 2**20:9.1f} MiB   "
                    f"peak RSS {result['peak_rss_bytes'] / 2**20:9.1f} MiB",
                    flush=True,
                )

    def value(mode, g, key):
        return next(r[key] for r in rows if r["mode"] == mode and r["G"] == g)

    ratios = {}
    for key in ("graph_bytes_peak", "peak_rss_bytes"):
        ratios[f"replay_{key}_G8_over_G2"] = value("replay", 8, key) / value("replay", 2, key)
        ratios[f"hold_all_{key}_G8_over_G2"] = value("hold_all", 8, key) / value("hold_all", 2, key)
        ratios[f"naive_{key}_G8_over_G2"] = value("naive", 8, key) / value("naive", 2, key)
    print("\nratio G=8 / G=2            graph bytes   peak RSS   target")
    for mode, target in (("replay", "<= 1.05"), ("hold_all", "~4 (linear)"), ("naive", "<= 1.05")):
        print(
            f"  {mode:<24} {ratios[f'{mode}_graph_bytes_peak_G8_over_G2']:11.3f} "
            f"{ratios[f'{mode}_peak_rss_bytes_G8_over_G2']:10.3f}   {target}"
        )
    print(
        json.dumps(
            {"preset": args.preset, "prompt": args.prompt, "response": args.response, "points": rows, "ratios": ratios}
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
