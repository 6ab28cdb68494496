"""An A/B of one step point at several commits on one box: each commit's warm cycles pooled over its rounds.

    python benchmarks/point_ab.py experiments/recorded/h100-benchmarks/floor_point_ab_2 [--base e237692]

The folder holds the point's result JSONs as `device_points` and `device_points_at` wrote them (docs/gpu.md, "An A/B
on one box"), any number of rounds a commit; a variant of a commit (a setting's default changed on the box,
LONGSTRAW_VARIANT) counts as one of its own, `c61912c+fused`. A round's first cycle is its process's cold step
(compiling, tuning, cuDNN plans) and is left out; the warm cycles of every round of a commit are pooled. Prints, per
commit, the number of warm cycles and the median step, capture, replay and optimizer step seconds, and each median's
difference from the base commit's; refuses a folder whose results came from different devices or points. The last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

from longstraw.kinds.step import cycle_seconds

PHASES = ("capture", "replay", "optimizer_step")


def label(provenance: dict) -> str:
    """A result's commit, 7 characters, and its variant after a "+" where it has one (a setting changed on the box)."""
    variant = provenance.get("variant")
    return provenance["commit"][:7] + (f"+{variant}" if variant else "")


def warm_cycles(result: dict) -> list[dict]:
    """{step, capture, replay} seconds of each cycle after the process's first (a step as the step table counts it)."""
    cycles = result["metrics"]["cycles"][1:]
    return [
        {"step": cycle_seconds(cycle)} | {name: cycle["phases"][name]["seconds"] for name in PHASES} for cycle in cycles
    ]


def compare(folder: Path, base: str | None) -> dict:
    results = [json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))]
    if not results:
        raise SystemExit(f"no result JSON in {folder}")
    for field, values in (
        ("devices", {r["provenance"]["device"] for r in results}),
        ("points", {r["point"] for r in results}),
    ):
        if len(values) > 1:
            raise SystemExit(f"{folder} mixes {field}: {sorted(values)}; an A/B compares one point on one device")
    pooled = defaultdict(list)
    for result in results:
        pooled[label(result["provenance"])] += warm_cycles(result)
    medians = {
        commit: {"warm_cycles": len(cycles)}
        | {key: statistics.median(c[key] for c in cycles) for key in ("step", *PHASES)}
        for commit, cycles in pooled.items()
    }
    if base:
        commit, _, variant = base.partition("+")
        base = label({"commit": commit, "variant": variant})
    else:
        base = next(iter(medians))
    if base not in medians:
        raise SystemExit(f"base commit {base} has no results in {folder}: {sorted(medians)}")
    for row in medians.values():
        row["difference_from_base"] = {key: row[key] - medians[base][key] for key in ("step", *PHASES)}
    return {
        "point": results[0]["point"],
        "device": results[0]["provenance"]["device"],
        "base": base,
        "commits": medians,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    parser.add_argument(
        "--base", help="the commit (or commit+variant) the others are compared with (default: the first by file name)"
    )
    args = parser.parse_args()
    summary = compare(args.folder, args.base)
    print(f"{summary['point']} on {summary['device']}, against {summary['base']}:")
    for commit, row in summary["commits"].items():
        change = row["difference_from_base"]
        print(
            f"  {commit}: {row['warm_cycles']} warm cycles, median step {row['step']:.4f} s ({change['step']:+.4f}), "
            f"capture {row['capture']:.4f} ({change['capture']:+.4f}), replay {row['replay']:.4f} "
            f"({change['replay']:+.4f}), optimizer step {row['optimizer_step']:.4f} ({change['optimizer_step']:+.4f})"
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
