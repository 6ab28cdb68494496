"""Where a task-trained model breaks with prompt length: greedy success per (length, needle depth).

    result = length_curve(model, {"name": "kv_retrieval", "num_needles": 4, "value_length": 2},
                          lengths=[512, 2048, 8192], depths=[0.1, 0.5, 0.9], examples=100)
    (a pipeline point of kind `length_curve`: `longstraw.kinds.length_curve`)

Each example goes through the project's own path, as GRPO will see it: `longstraw.capture` of the
prompt (resident state, no autograd), then `longstraw.training.rollout.sample` greedily
(`temperature=0`, `max_new_tokens=len(answer)`) from that state, scored with `task.reward`.
Examples are held out: seeds `CURVE_SEED_BASE + i` (`longstraw.training.pretrain` documents the
seed ranges); the same seeds in every cell, so cells differ only in length and depth.

Depth (kv_retrieval): the queried needle starts at `depth` (a fraction of the filler); the other
needles keep depths drawn uniformly from the example's own seed. `None` leaves all depths random,
as in training. A band `[lo, hi]` gives each example a depth of its own within it, drawn from its seed
(`depths.example_depth`): on a task whose haystack is one text (RULER's niah) a fixed depth puts every
example's needle in the same place. A row keeps each example's depth (`example_depths`). Tasks without
needles (counting) take `depths=None`.

Chance (`chance_level`): the success of the best strategy that does not use what the task tests.
- kv_retrieval with n needles and values of m tokens from a range of |V| ids: the queried needle is
  uniform among the n and independent of the prompt's layout, so a model that ignores the query key
  (copies some needle's value, e.g. the last one) succeeds with probability 1/n (a little more when two
  needles happen to share a value); a blind guess gets 1/|V|^m, far lower. Chance = max(1/n, 1/|V|^m):
  success above 1/n shows key matching, not just copying. With one needle, chance is 1: such a task
  tests retrieval-by-copy only.
- counting with counts uniform in [min_count, max_count]: 1 / (max_count - min_count + 1).
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time

import torch

from longstraw.training.depths import depth_label, example_depth
from longstraw.training.pretrain import CURVE_SEED_BASE, teacher_forced_rewards
from longstraw.training.tasks import chance_level


def example_at_depth(task, seed: int, depth: float | None):
    """`task.make(seed)` with the queried needle at `depth` (kv_retrieval; a task with its own
    `make_at_depth`, e.g. RULER's: that), the others at random depths."""
    if depth is None:
        return task.make(seed)
    if hasattr(task, "make_at_depth"):
        return task.make_at_depth(seed, depth)
    if not hasattr(task, "depths") or not hasattr(task, "num_needles"):
        raise ValueError(f"depth {depth} asked of a task without needles ({type(task).__name__}); use depths=None")
    if not 0 <= depth <= 1:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    n = task.num_needles
    # which needle is queried does not depend on the depth values (given depths draw nothing from the
    # example's generator), so a probe with distinct depths names it
    marks = [i / max(1, n - 1) for i in range(n)] if n > 1 else [0.0]
    queried = marks.index(dataclasses.replace(task, depths=marks).make(seed).info["depth"])
    others = torch.rand(n, generator=torch.Generator().manual_seed(seed ^ 0x5EED)).tolist()
    depths = [depth if i == queried else others[i] for i in range(n)]
    example = dataclasses.replace(task, depths=depths).make(seed)
    assert example.info["depth"] == depth
    return example


def greedy_success(
    model, task, example, chunk_size: int | None = None, beyond_max_positions: bool = False, agent=None
) -> float:
    """Capture the prompt, decode len(answer) tokens greedily from the resident state (or the example's
    `max_new_tokens`, up to the task's `stop_ids`), score them. With `agent` (an environment config and a
    trajectory's token budget): a greedy trajectory in that environment instead (`agent_step.greedy_agent_success`)."""
    from longstraw.core.transaction import capture
    from longstraw.training.agent_step import greedy_agent_success
    from longstraw.training.rollout import SamplingConfig, sample

    device = next(model.parameters()).device
    state = capture(
        model,
        example.prompt_ids.to(device),
        chunk_size=chunk_size,
        progress=False,
        beyond_max_positions=beyond_max_positions,
    )
    if agent is not None:
        return greedy_agent_success(model, state, task, example, *agent)
    rollouts = sample(
        model,
        state,
        SamplingConfig(
            num_generations=1,
            max_new_tokens=example.info.get("max_new_tokens", len(example.answer)),
            temperature=0.0,
            seed=None,
            stop_ids=tuple(getattr(task, "stop_ids", ())),
        ),
    )
    return float(task.reward(example, rollouts.responses[0].cpu()))


def forward_successes(model, task, examples, batch_tokens: int = 65536) -> list[float]:
    """The same scores from HF's one-pass forward, batched (`pretrain.teacher_forced_rewards`).
    Exact-match rewards only."""
    if getattr(task, "partial", False):
        raise ValueError("method='forward' needs exact-match rewards (partial=False); use method='capture'")
    device = next(model.parameters()).device
    per_batch = max(1, batch_tokens // (examples[0].prompt_ids.numel() + len(examples[0].answer)))
    return [
        reward
        for start in range(0, len(examples), per_batch)
        for reward in teacher_forced_rewards(model, task, examples[start : start + per_batch], device)
    ]


def length_curve(
    model,
    task_spec: dict,
    lengths,
    depths=None,
    examples: int = 64,
    *,
    seed_base: int = CURVE_SEED_BASE,
    chunk_size: int | None = None,
    method: str = "capture",
    progress: bool = True,
    beyond_max_positions: bool = False,
    on_row=None,
    agent=None,
) -> dict:
    """Rows {length, depth, success, n, stderr, rewards} per cell, the task's chance, and timing;
    `on_row(rows)` after each cell (so a run cut off at its time limit keeps the cells it finished).

    `method="capture"` (the reference: capture + greedy sampling from the resident state, one example at a
    time) or `"forward"` (HF's batched one-pass forward, teacher-forced argmax: the same scores for
    exact-match rewards, and on CPU much faster at long lengths, where the project's math attention
    backend materialises the score blocks; tests check the two agree example by example); `agent`: greedy_success's."""
    from longstraw.training.tasks import build_task

    if method not in ("capture", "forward"):
        raise ValueError(f"method must be 'capture' or 'forward', got {method!r}")
    vocab, capturing = model.config.vocab_size, (chunk_size, beyond_max_positions, agent)
    rows, start = [], time.perf_counter()
    for length in lengths:
        task = build_task({**task_spec, "length": int(length)}, vocab)
        for depth in depths if depths else [None]:
            row = _cell(model, task, int(length), depth, examples, seed_base, method, capturing)
            rows.append(row)
            if on_row is not None:
                on_row(rows)
            if progress:
                print(
                    f"length_curve: length {length:>9,} depth {'random' if depth is None else depth_label(depth)}: "
                    f"success {row['success']:.3f} +- {row['stderr']:.3f} (n={row['n']}, {row['seconds']:.1f} s)",
                    file=sys.stderr,
                    flush=True,
                )
    return {
        "task": dict(task_spec),
        "chance": chance_level(build_task({**task_spec, "length": int(lengths[0])}, vocab)),
        "rows": rows,
        "seed_base": seed_base,
        "seconds": time.perf_counter() - start,
    }


def _cell(model, task, length: int, depth, examples: int, seed_base: int, method: str, capturing: tuple) -> dict:
    """One cell of the curve: the success rate of `examples` examples of one length with the needle at `depth`
    (None: a random depth each; a band: a depth each within it), scored by `method` (capture: `greedy_success` with
    `capturing`, its chunk size, `beyond_max_positions` and `agent`)."""
    t = time.perf_counter()
    seeds = range(seed_base, seed_base + examples)
    cell = [example_at_depth(task, seed, example_depth(depth, seed)) for seed in seeds]
    if method == "capture":
        rewards = [greedy_success(model, task, example, *capturing) for example in cell]
    else:
        rewards = forward_successes(model, task, cell)
    p = sum(rewards) / len(rewards)
    return {
        "length": length,
        "depth": list(depth) if isinstance(depth, (list, tuple)) else depth,
        "example_depths": [example.info.get("depth") for example in cell],
        "success": p,
        "n": len(rewards),
        "method": method,
        "stderr": math.sqrt(p * (1 - p) / len(rewards)),
        "seconds": time.perf_counter() - t,
        "rewards": rewards,
    }
