"""Each run's sampled success on each prompt's first step, by where the answer's needle sits, for a learning record.

    python scripts/success_by_depth.py experiments/recorded/h200/curriculum/curriculum-niah-16k-131k-rope-steps.json \
        --stage 8 --tokenizer results/cpu/checkpoints/smollm2-135m-instruct

Records written since the trainer kept each step's `depth` are read as they are. For older ones each prompt's example
is made again from the record's task spec (its tokenizer folder replaced by `--tokenizer` where the record's is on
another machine), at the stage's length, from the run's seed (`training.trainer.prompt_seed`): a task's examples are
functions of their seed, so the depth is the one the run's prompt had. Bands and text: `kinds.learning_runs
.success_by_depth`, as the report's `lr0_by_depth` column.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from longstraw.kinds.learning import depth_text  # noqa: E402
from longstraw.training.tasks import build_task  # noqa: E402
from longstraw.training.trainer import prompt_seed  # noqa: E402


def parts(record: dict, stage: int | None) -> list[tuple[str, dict, int]]:
    """(label, runs, length) of the point's runs, or of each curriculum stage's (one with `stage`)."""
    metrics = record["metrics"]
    if "stages" not in metrics:
        return [("point", metrics["runs"], metrics["prompt_positions"])]
    stages = [s for s in metrics["stages"] if s.get("runs") and (stage is None or s["stage"] == stage)]
    if not stages:
        raise ValueError(f"no trained stage {stage}")
    return [(f"stage {s['stage']} at {s['length']:,}", s["runs"], s["length"]) for s in stages]


def with_depths(runs: dict, spec: dict, length: int, seed: int) -> dict:
    """The runs' steps with each prompt's needle depth, made again from its seed where a step lacks it."""
    steps = [s for run in runs.values() for s in run]
    if all(s.get("depth") is not None for s in steps):
        return runs
    from transformers import AutoTokenizer

    if not spec.get("tokenizer"):  # a synthetic task's examples depend on the model's vocabulary, not kept here
        raise ValueError(f"steps without depth of a task with no tokenizer ({spec.get('name')}): not made again")
    task = build_task({**spec, "length": length}, len(AutoTokenizer.from_pretrained(spec["tokenizer"])))
    depth = {}
    for prompt in sorted({s["prompt"] for s in steps}):
        depth[prompt] = task.make(prompt_seed(seed, prompt)).info.get("depth")
        print(f"  prompt {prompt}: depth {depth[prompt]:.3f}", file=sys.stderr, flush=True)
    return {name: [{**s, "depth": depth[s["prompt"]]} for s in run] for name, run in runs.items()}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("record", type=Path)
    parser.add_argument("--stage", type=int, default=None, help="one curriculum stage (default: every trained one)")
    parser.add_argument("--tokenizer", default=None, help="the RULER task's tokenizer folder on this machine")
    args = parser.parse_args(argv)
    try:
        record = json.loads(args.record.read_text())
        learning = record["config"]["learning"]
    except (OSError, ValueError, KeyError) as exc:
        print(f"{args.record}: not a learning record ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    spec = dict(learning["task"])
    if args.tokenizer is not None:
        spec["tokenizer"] = args.tokenizer
    try:
        for label, runs, length in parts(record, args.stage):
            runs = with_depths(runs, spec, length, learning.get("seed", 0))
            print(f"{record.get('name')} {label}: first-visit success by needle depth (prompts)")
            for name, steps in runs.items():
                print(f"  {name}: {depth_text(steps)}")
    except ValueError as exc:
        print(f"{args.record}: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
