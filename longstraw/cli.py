"""Command line: `longstraw run EXPERIMENT.yaml --out RESULT.json` (also `python -m longstraw`).

    longstraw run experiments/examples/step_cpu.yaml --out results/step.json
    longstraw run experiments/examples/step_cpu.yaml --out r.json --set mode=hold_all --set responses.count=8

The result JSON is written atomically; the last stdout line is a one-line JSON summary.
Exit status: 0 for ok and oom (an out-of-memory point is a measurement), 1 for error.
"""

from __future__ import annotations

import argparse
import json
import sys

import yaml

from longstraw.experiment import run_point
from longstraw.results import write_json_atomic


def _apply_override(cfg: dict, assignment: str) -> None:
    if "=" not in assignment:
        raise SystemExit(f"--set expects KEY.PATH=VALUE, got {assignment!r}")
    path, value = assignment.split("=", 1)
    *parents, leaf = path.split(".")
    node = cfg
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = yaml.safe_load(value)


def _summary(result: dict) -> dict:
    out = {"name": result["name"], "status": result["status"], "wall_seconds": round(result["wall_seconds"], 3)}
    metrics = result.get("metrics", {})
    for key in ("peak_allocated_bytes", "graph_bytes_peak", "resident_bytes", "transient_bytes"):
        if metrics.get(key) is not None:
            out[key] = metrics[key]
    out["peak_rss_bytes"] = result["peak_rss_bytes"]
    if "error" in result:
        out["error"] = result["error"]
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="longstraw", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run one experiment point and write its result JSON")
    run.add_argument("experiment", help="experiment YAML file")
    run.add_argument("--out", required=True, help="result JSON path (written atomically)")
    run.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help="override a config key")
    args = parser.parse_args(argv)

    try:
        with open(args.experiment) as f:
            cfg = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as exc:
        print(f"longstraw: cannot read {args.experiment}: {exc}", file=sys.stderr)
        return 2
    for assignment in args.set:
        _apply_override(cfg, assignment)
    try:
        result = run_point(cfg, source=args.experiment)
    except ValueError as exc:  # bad config: nothing ran
        print(f"longstraw: {exc}", file=sys.stderr)
        return 2
    write_json_atomic(args.out, result)
    if result["status"] == "error":
        print(result.get("traceback", result["error"]), file=sys.stderr)
    print(json.dumps(_summary(result)))
    return 1 if result["status"] == "error" else 0


if __name__ == "__main__":
    sys.exit(main())
