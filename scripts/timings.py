"""Record how long the README's two commands took, from their logs, in docs/timings.md (never by hand).

    ( time .ci/run ) > ci.log 2>&1
    python scripts/timings.py ci ci.log --repo CLONE
    ( time bash -c "<the README's pipeline command>" ) > pipeline.log 2>&1
    python scripts/timings.py pipeline pipeline.log --repo CLONE

Each call reads one log of a run in a fresh clone (`--repo`: its commit), takes what the log itself says (bash's
`real` line of `time`; for CI each pytest summary's count and seconds, the suite's first; for the pipeline
snakemake's `N of M steps` and the points' statuses under the clone's results/cpu/points), adds a row with the
date, the commit and this machine (CPU model, cores) to docs/timings.json and writes docs/timings.md from all the
rows, both atomically. A log without its `real` line is refused: a timing is what was measured, not typed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from longstraw.results import write_json_atomic, write_text_atomic  # noqa: E402

ROWS, PAGE = REPO / "docs" / "timings.json", REPO / "docs" / "timings.md"


def real_seconds(log: str) -> float:
    """bash's `time` line: real XmY.Zs."""
    found = re.findall(r"^real\s+(\d+)m([\d.]+)s", log, re.MULTILINE)
    if not found:
        raise ValueError("the log has no `real XmYs` line: run the command under bash's `time`")
    minutes, seconds = found[-1]
    return int(minutes) * 60 + float(seconds)


def pytest_runs(log: str) -> list[dict]:
    """Each pytest summary line's passed/failed counts and seconds, in order."""
    runs = []
    for line in re.findall(r"^=*\s*(\d+ (?:passed|failed).* in [\d.]+s.*)$", log, re.MULTILINE):
        counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|skipped|deselected|error)", line)}
        runs.append({**counts, "seconds": float(re.search(r" in ([\d.]+)s", line).group(1))})
    return runs


def pipeline_facts(log: str, clone: Path) -> dict:
    steps = re.findall(r"(\d+) of (\d+) steps \(100%\) done", log)
    statuses: dict[str, int] = {}
    for path in (clone / "results" / "cpu" / "points").rglob("*.json"):
        status = json.loads(path.read_text()).get("status", "?")
        statuses[status] = statuses.get(status, 0) + 1
    return {"jobs": int(steps[-1][1]) if steps else None, "points": statuses}


def machine() -> str:
    lines = Path("/proc/cpuinfo").read_text().splitlines()
    model = next((line.split(":", 1)[1].strip() for line in lines if "model name" in line), "unknown CPU")
    return f"{model}, {os.cpu_count()} cores"


def describe(row: dict) -> str:
    if row["what"] == "ci":
        suite, *numerics = row["pytest"]
        extra = ", ".join(f"{r['seconds']:.0f} s" for r in numerics)
        return f"suite {suite.get('passed', 0)} passed in {suite['seconds']:.0f} s" + (
            f"; numerics passes {extra}" if extra else ""
        )
    points = ", ".join(f"{n} {s}" for s, n in sorted(row["points"].items()))
    return f"{row['jobs']} jobs; points: {points}"


def render(rows: list[dict]) -> str:
    lines = [
        "# Timings of the README's two commands",
        "",
        "Written by `scripts/timings.py` from the logs of runs in fresh clones (bash's `time`, pytest's and",
        "snakemake's own summaries); never edited by hand. Newest first. `ci`: `.ci/run` (the README's test command,",
        "ruff, the numerics passes), its install included; `pipeline`: the README's pipeline command, its install",
        "included.",
        "",
        "| date | commit | machine | command | wall | what the log says |",
        "|---|---|---|---|---|---|",
    ]
    for row in reversed(rows):  # appended as they were measured
        wall = f"{int(row['seconds'] // 60)} min {row['seconds'] % 60:.0f} s"
        lines.append(
            f"| {row['date']} | {row['commit'][:7]} | {row['machine']} | {row['what']} | {wall} | {describe(row)} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("what", choices=("ci", "pipeline"))
    parser.add_argument("log", help="the run's whole output, `time` included")
    parser.add_argument("--repo", required=True, help="the fresh clone the run was made in")
    args = parser.parse_args()
    log, clone = Path(args.log).read_text(errors="replace"), Path(args.repo)
    commit = subprocess.run(["git", "-C", str(clone), "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
    row = {
        "date": datetime.date.today().isoformat(),
        "commit": commit.stdout.strip(),
        "machine": machine(),
        "what": args.what,
        "seconds": real_seconds(log),
    }
    if args.what == "ci":
        row["pytest"] = pytest_runs(log)
        if not row["pytest"]:
            raise ValueError(f"{args.log}: no pytest summary line")
    else:
        row.update(pipeline_facts(log, clone))
    rows = json.loads(ROWS.read_text()) if ROWS.exists() else []
    write_json_atomic(ROWS, rows + [row])
    write_text_atomic(PAGE, render(rows + [row]))
    print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
