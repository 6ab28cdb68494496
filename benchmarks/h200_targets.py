"""Print the H200 targets (issues 4, 20 and 32), measured figure beside goal, from recorded (or fresh) results.

    python benchmarks/h200_targets.py                          # experiments/recorded/h200
    python benchmarks/h200_targets.py --results results/h200   # a fresh h200 pipeline run

The evaluation lives in `longstraw.report.targets` (the h200 report shows the same table).
"""

import argparse

from longstraw.report.targets import evaluate_targets

VERDICT = {True: "met", False: "MISSED", None: "not measured"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="experiments/recorded/h200")
    args = parser.parse_args()
    for row in evaluate_targets(args.results):
        print(
            f"[{VERDICT[row['met']]:>12}] {row['target']}\n{'':15}goal: {row['goal']}\n"
            f"{'':15}measured: {row['measured']}\n{'':15}from: {row['evidence'] or '-'}"
        )


if __name__ == "__main__":
    main()
