"""Two length-curve records that scored the same held-out examples (the same seed base, lengths, depths and example
depths: e.g. a curriculum's starting adapter and its trained adapter on one band curve), paired row by row.

    python scripts/compare_curves.py \\
        experiments/recorded/h200/real_model/curve-niah_single_2-yarn16-bands-131k-seed-2.json \\
        experiments/recorded/h200/real_model/curve-niah_single_2-yarn16-bands-131k-window-96-seed-4.json

For each row (length and depth band) and for all rows together: the before and after successes and the examples
gained and lost, with the exact sign test (`training.improvement.paired_change`). Each record's own base rows (the
adapter off) are the same model in both, so only the adapters' rows are compared. Records whose examples differ are
refused (exit 2): a pairing of different examples would mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from longstraw.training.improvement import paired_change  # noqa: E402


def paired_rows(before: dict, after: dict) -> list[dict]:
    """The rows of two length-curve records' `metrics`, paired; ValueError naming the first difference in their
    examples (seed base, rows, or a row's example depths)."""
    if before.get("seed_base") != after.get("seed_base"):
        raise ValueError(f"seed_base differs: {before.get('seed_base')} vs {after.get('seed_base')}")
    rows_before, rows_after = before.get("rows") or [], after.get("rows") or []
    keys_before = [(r["length"], r.get("depth")) for r in rows_before]
    if keys_before != [(r["length"], r.get("depth")) for r in rows_after]:
        raise ValueError("rows differ: (length, depth) of one record's rows are not the other's")
    paired, all_before, all_after = [], [], []
    for (length, depth), b, a in zip(keys_before, rows_before, rows_after):
        if b.get("example_depths") != a.get("example_depths"):
            raise ValueError(f"rows at length {length}, depth {depth}: example_depths differ")
        all_before += b["rewards"]
        all_after += a["rewards"]
        paired.append({"length": length, "depth": depth, **_pair(b["rewards"], a["rewards"])})
    paired.append({"length": "all", "depth": None, **_pair(all_before, all_after)})
    return paired


def _pair(before: list[float], after: list[float]) -> dict:
    return {"before": sum(before), "after": sum(after), **paired_change(before, after)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    args = parser.parse_args(argv)
    metrics = [json.loads(path.read_text())["metrics"] for path in (args.before, args.after)]
    try:
        rows = paired_rows(*metrics)
    except ValueError as error:
        print(f"compare_curves: {args.after} against {args.before}: {error}", file=sys.stderr)
        return 2
    print("length, depth: before / after of n, +gained -lost (sign test p)")
    for row in rows:
        print(
            f"  {row['length']}, {row['depth']}: {row['before']:g} / {row['after']:g} of {row['examples']}, "
            f"+{row['gained']} -{row['lost']} (p {row['p']:.4f})"
        )
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
