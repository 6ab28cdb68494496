"""What a V4 gain is made of, for a learning record: each run's reward over the steps, and the window's prompts split
by whether the lr-0 control ever solved them.

    python scripts/v4_anatomy.py experiments/recorded/h200/curriculum/curriculum-niah-131k-from-seed-2-window-96.json

For each trained stage (or the point's runs): how many steps had all G rewards equal (no advantage: GRPO learns
nothing from them), also by that common reward in each half of the run (all solved or none); each phase's median
seconds; the mean first-visit reward of the trained run and of lr 0 in blocks of `--block` prompts, with their
paired difference; then over the V4 window (the record's `window` last steps)
the prompts on which lr 0 scored 0 in every sample, how many of them the trained run solved at least once and in
at least half its samples, and both runs' means on the others. A gain made only by sharpening the starting policy's
sampling needs prompts that policy could already answer; prompts the control never solved in G samples are where
that is least likely. Means are per prompt over its first step's G rewards (`training.improvement.per_prompt_means`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from longstraw.training.improvement import per_prompt_means  # noqa: E402

TRAINED, UNTRAINED = "response-only", "lr0"


def parts(record: dict) -> list[tuple[str, dict, int, int]]:
    """(label, runs, steps, window) of the point's runs, or of each trained curriculum stage's."""
    metrics, learning = record["metrics"], record["config"]["learning"]
    if "stages" not in metrics:
        return [("point", metrics["runs"], learning["steps"], learning["window"])]
    stages = [s for s in metrics["stages"] if s.get("runs")]
    return [(f"stage {s['stage']} at {s['length']:,}", s["runs"], s["steps"], s["window"]) for s in stages]


def phase_medians(steps: list[dict]) -> dict:
    """Each phase's median seconds over the steps after the first (the first records graphs and compiles), over the
    steps that ran it (`graph_record`: once a run, or again after a resume)."""
    seconds: dict[str, list[float]] = {"step": [s["seconds"] for s in steps[1:]]}
    for step in steps[1:]:
        for phase, value in (step.get("phase_seconds") or {}).items():
            seconds.setdefault(phase, []).append(value)
    return {phase: statistics.median(values) for phase, values in seconds.items() if values}


def equal_rewards(steps: list[dict]) -> dict[str, int]:
    """How many steps had all G rewards equal, by that reward (`"0.0": 27, "1.0": 46`), in ascending order."""
    common = sorted(s["rewards"][0] for s in steps if len(set(s["rewards"])) == 1)
    return {str(reward): common.count(reward) for reward in dict.fromkeys(common)}


def equal_reward_halves(steps: list[dict]) -> dict[str, dict[str, int]]:
    """`equal_rewards` of the run's first and second half: late all-1 groups mean the policy solves the prompt,
    all-0 groups that it cannot read it."""
    middle = len(steps) // 2
    return {"first_half": equal_rewards(steps[:middle]), "second_half": equal_rewards(steps[middle:])}


def anatomy(runs: dict, steps: int, window: int, block: int) -> dict:
    """Blocks of `block` prompts (trained mean, lr-0 mean, their paired difference) over all first visits, and the
    window's prompts split by lr 0 scoring 0 on all of them."""
    trained, untrained = (
        per_prompt_means(runs[TRAINED], first_visit=True),
        per_prompt_means(runs[UNTRAINED], first_visit=True),
    )
    prompts = sorted(set(trained) & set(untrained))
    blocks = []
    for i in range(0, len(prompts), block):
        chunk = prompts[i : i + block]
        t, u = (sum(m[p] for p in chunk) / len(chunk) for m in (trained, untrained))
        blocks.append({"prompts": [chunk[0], chunk[-1]], "trained": t, "lr0": u, "difference": t - u})
    first = steps - window
    in_window = sorted(
        set(per_prompt_means(runs[TRAINED], first, first_visit=True))
        & set(per_prompt_means(runs[UNTRAINED], first, first_visit=True))
    )
    halves = {name: equal_reward_halves(runs[name]) for name in (TRAINED, UNTRAINED)}
    unsolved = [p for p in in_window if untrained[p] == 0]
    solved = [p for p in in_window if untrained[p] > 0]

    def mean(values):
        values = list(values)
        return sum(values) / len(values) if values else None

    return {
        # steps whose G rewards are all equal: no advantage, so no update from them (GRPO's zero-signal groups)
        "equal_reward_steps": {name: sum(sum(h.values()) for h in halves[name].values()) for name in halves},
        "equal_reward_steps_by_reward": halves,
        "steps": {name: len(runs[name]) for name in (TRAINED, UNTRAINED)},
        "phase_medians": {name: phase_medians(runs[name]) for name in (TRAINED, UNTRAINED)},
        "blocks": blocks,
        "window_prompts": len(in_window),
        "lr0_never_solved": {
            "prompts": len(unsolved),
            "trained_solved_once": sum(trained[p] > 0 for p in unsolved),
            "trained_solved_half": sum(trained[p] >= 0.5 for p in unsolved),
            "trained_mean": mean(trained[p] for p in unsolved),
        },
        "lr0_solved": {
            "prompts": len(solved),
            "trained_mean": mean(trained[p] for p in solved),
            "lr0_mean": mean(untrained[p] for p in solved),
        },
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("record", type=Path)
    parser.add_argument("--block", type=int, default=16, help="prompts a block (default 16)")
    args = parser.parse_args(argv)
    for label, runs, steps, window in parts(json.loads(args.record.read_text())):
        if not {TRAINED, UNTRAINED} <= set(runs):
            print(f"{label}: no {TRAINED} and lr0 runs")
            continue
        found = anatomy(runs, steps, window, args.block)
        print(f"{label}: trained / lr 0 / difference, first visits in blocks of {args.block} prompts")
        for b in found["blocks"]:
            first, last = b["prompts"]
            print(f"  prompts {first}-{last}: {b['trained']:.3f} / {b['lr0']:.3f} / {b['difference']:+.3f}")
        never, solved = found["lr0_never_solved"], found["lr0_solved"]
        equal, count = found["equal_reward_steps"], found["steps"]
        print(
            f"  steps with equal rewards: trained {equal[TRAINED]} of {count[TRAINED]}, "
            f"lr 0 {equal[UNTRAINED]} of {count[UNTRAINED]}"
        )
        for name, halves in found["equal_reward_steps_by_reward"].items():
            print(
                f"  {name} steps with equal rewards, by reward: "
                + "; ".join(f"{half.replace('_', ' ')} {counts}" for half, counts in halves.items())
            )
        for name, medians in found["phase_medians"].items():
            print(f"  {name} median seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in medians.items()))
        print(
            f"  window ({found['window_prompts']} prompts): lr 0 never solved {never['prompts']}; the trained run "
            f"solved {never['trained_solved_once']} of them at least once, {never['trained_solved_half']} in at least "
            f"half its samples (mean {never['trained_mean']:.3f}); on the other {solved['prompts']}: trained "
            f"{solved['trained_mean']:.3f}, lr 0 {solved['lr0_mean']:.3f}"
        )
        print(json.dumps({"part": label, **found}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
