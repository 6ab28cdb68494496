"""Does the policy improve? The learning statistic of two runs that differ only in their learning rate.

    gain = paired_gain(trained, untrained)      # per-prompt rewards of the same prompts, same seeds

Both runs visit the same prompts in the same order with the same sampling seeds (the trainer
derives both from its seed), so prompt difficulty cancels in the per-prompt differences
d_i = r_trained(i) - r_untrained(i) (each the mean reward of that prompt's steps and samples). The
gain is mean(d), its standard error sd(d) / sqrt(n) (sample sd), and the policy improves when the
gain exceeds SIGMAS standard errors. Simplification: a prompt's G samples share one policy, so a
prompt is the unit, not a sample.
"""

from __future__ import annotations

import math

SIGMAS = 3.0


def per_prompt_means(steps: list[dict], first_step: int = 0, first_visit: bool = False) -> dict[int, float]:
    """{prompt index: mean reward over its steps (from `first_step` on) and samples} of trainer metrics. With
    `first_visit`, only each prompt's first step, and only prompts first visited from `first_step` on: the rewards
    of a policy not yet trained on that prompt (a prompt's later steps follow updates on its own rewards)."""
    totals: dict[int, list[float]] = {}
    seen: set[int] = set()
    for step in sorted(steps, key=lambda s: s["step"]):
        first, prompt = step["prompt"] not in seen, step["prompt"]
        seen.add(prompt)
        if step["step"] >= first_step and (first or not first_visit):
            totals.setdefault(prompt, []).extend(step["rewards"])
    return {prompt: sum(r) / len(r) for prompt, r in sorted(totals.items())}


def paired_gain(trained: dict[int, float], untrained: dict[int, float], sigmas: float = SIGMAS) -> dict:
    """The gain of `trained` over `untrained` on the prompts both visited (see the module doc)."""
    prompts = sorted(set(trained) & set(untrained))
    if len(prompts) < 2:
        raise ValueError(f"a paired gain needs at least 2 shared prompts, got {len(prompts)}")
    d = [trained[p] - untrained[p] for p in prompts]
    n, mean = len(d), sum(d) / len(d)
    se = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1) / n)
    return {
        "gain": mean,
        "standard_error": se,
        "prompts": n,
        "sigmas": sigmas,
        "trained_mean": sum(trained[p] for p in prompts) / n,
        "untrained_mean": sum(untrained[p] for p in prompts) / n,
        "reached": mean > sigmas * se and mean > 0,
    }


def first_visits(steps: int, window: int, steps_per_prompt: int) -> int:
    """How many prompts `first_visit_gain` pairs over the last `window` of `steps` trainer steps at
    `steps_per_prompt` steps a prompt (prompt = step // steps_per_prompt, first visited at a multiple of it)."""
    return sum(step % steps_per_prompt == 0 for step in range(steps - window, steps))


def first_visit_gain(trained: list[dict], untrained: list[dict], first_step: int) -> dict:
    """V4's statistic of two runs' trainer steps: `paired_gain` on the prompts first visited from `first_step` on,
    each prompt's first step only (with `steps_per_prompt` > 1 its later steps follow updates on its own rewards,
    which would credit the trained run with fitting the prompts it is scored on)."""
    return paired_gain(
        per_prompt_means(trained, first_step, first_visit=True),
        per_prompt_means(untrained, first_step, first_visit=True),
    )


def paired_change(before: list[float], after: list[float]) -> dict:
    """Two policies' 0/1 rewards on the same held-out examples, in order (a curriculum stage's probe of the policy it
    starts from, and its trained adapter's held-out curve at that length: the same seeds): the examples `gained`
    (0 -> 1) and `lost` (1 -> 0) over the examples both scored, and the exact two-sided sign test of gained against
    lost (`p`: the chance of a split at least as uneven if either way were equally likely; 1.0 with none changed)."""
    n = min(len(before), len(after))
    if any(r not in (0.0, 1.0) for r in [*before[:n], *after[:n]]):
        raise ValueError("paired_change: rewards must be 0 or 1 (exact-match success)")
    gained = sum(1 for b, a in zip(before[:n], after[:n]) if (b, a) == (0.0, 1.0))
    lost = sum(1 for b, a in zip(before[:n], after[:n]) if (b, a) == (1.0, 0.0))
    changed = gained + lost
    tail = sum(math.comb(changed, k) for k in range(min(gained, lost) + 1)) / 2**changed
    return {"examples": n, "gained": gained, "lost": lost, "p": min(1.0, 2 * tail)}
