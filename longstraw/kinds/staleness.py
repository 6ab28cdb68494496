"""Kind `staleness`: the fresh-prefix oracle (`longstraw.training.oracle`): capture once, train
`staleness.steps` steps on the stale state, and at each step measure its drift against a fresh
capture; the derived refresh interval is the number of parameter updates whose loss drift stays
under `staleness.threshold` (`refresh_interval`, the one definition the run and the report share;
a step whose group had equal rewards updates nothing and is not counted).

Report: one row per point (its setting, the drift at steps 1 and 2, where the paper states its
figure, the largest drift and its step, the updates made, the refresh interval derived from the
rows, the last step's measures), one row per oracle step in a table of its own (`drift`),
the refresh interval in a sentence; figure: the drift measures per step, one line per point, the
paper's stated band beside them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from longstraw.config import PointConfig
from longstraw.config.typed import bounded
from longstraw.kinds.checks import check_task
from longstraw.kinds.spec import Kind
from longstraw.results import (
    ExtraTable,
    as_dict,
    finite,
    is_cuda_point,
    number,
    phase_columns,
    point_parts,
    rows_of_points,
    status_of,
)


@dataclass
class StalenessConfig:
    """The fresh-prefix oracle (`longstraw.training.oracle`)."""

    steps: int = bounded(8, min=1)
    threshold: float = bounded(1.0e-3, gt=0)
    # L2 norm of the random parameter perturbation that measures the numerical floor (None: not measured)
    floor_perturbation: float | None = bounded(None, gt=0)
    # a task spec: the prompt is its example (seed prompt.seed, length prompt.length) and the rewards are
    # its rewards; empty: a seeded random prompt and uniform random rewards (a model no task reward moves)
    task: dict = field(default_factory=dict)
    # with a task: how many prompt seeds (from prompt.seed on) to try for one whose first group's rewards
    # differ, so that the first step updates the parameters (1: prompt.seed whatever its rewards)
    prompt_search: int = bounded(1, min=1)


def check(cfg: PointConfig, source: str) -> None:
    """A task's spec, where the prompt and rewards are a task's (else a seeded prompt, random rewards)."""
    if cfg.staleness.task:
        check_task(cfg.staleness.task, cfg.prompt.length, f"{source}: staleness.task")


if TYPE_CHECKING:
    from longstraw.kinds.common import Progress


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    from longstraw.kinds.common import capture_kwargs, optimizer_for, policy_and_prompt
    from longstraw.measure.memory import PhaseRecorder
    from longstraw.training.oracle import staleness_oracle

    recorder = PhaseRecorder(device)
    model, vocab, prompt = policy_and_prompt(cfg, recorder)
    reward, search = None, {}
    if cfg.staleness.task:
        prompt, reward, search = task_prompt(model, vocab, cfg, device, recorder)
    optimizer = optimizer_for(model, cfg)
    threshold, rows, floor = cfg.staleness.threshold, [], {}
    setting = training_setting(model, optimizer)

    def metrics():
        return {
            "rows": rows,
            "threshold": threshold,
            "floor": floor,
            "setting": setting,
            **search,
            "refresh_interval": refresh_interval(rows, threshold, floor.get("relative_loss_drift", 0.0)),
            "prompt_positions": int(prompt.numel()),
            "phases": recorder.phases,
        }

    def step_done(row):
        rows.append(row)
        progress.line(f"staleness step {row['step']}: loss drift {row['relative_loss_drift']:.3e}")
        progress.partial(metrics())

    with recorder.phase("oracle"):
        result = staleness_oracle(
            model,
            prompt,
            optimizer,
            cfg.grpo,
            steps=cfg.staleness.steps,
            max_new_tokens=cfg.responses.length,
            seed=cfg.responses.seed,
            capture_kwargs=capture_kwargs(cfg),
            progress=step_done,
            floor_perturbation=cfg.staleness.floor_perturbation,
            reward=reward,
        )
        floor.update(result.floor)
    return metrics()


def task_prompt(model, vocab: int, cfg: PointConfig, device, recorder):
    """(prompt, reward, search record) of a task's point: the example a prompt search finds, and its task's reward."""
    from longstraw.training.tasks import build_task

    task = build_task({**cfg.staleness.task, "length": cfg.prompt.length}, vocab)
    with recorder.phase("prompt_search"):
        example, search = learnable_example(model, task, cfg, device)

    def task_reward(responses):
        return [task.reward(example, y) for y in responses]

    return example.prompt_ids.to(device), task_reward, search


def training_setting(model, optimizer) -> dict:
    """What the oracle trains, in the terms its drift depends on: the dtypes of the frozen and of the
    trainable weights, how many are trained, and whether the optimizer keeps float32 masters of them."""
    from longstraw.training.optimizer import MasterWeightsAdamW

    def dtypes(params):
        return sorted({str(p.dtype).removeprefix("torch.") for p in params})

    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    return {
        "frozen_dtypes": dtypes(p for p in params if not p.requires_grad),
        "trainable_dtypes": dtypes(trainable),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "lora": any("lora_" in name for name, p in model.named_parameters() if p.requires_grad),
        "master_weights": isinstance(optimizer, MasterWeightsAdamW),
    }


def setting_label(setting: dict) -> str | None:
    """One phrase for `training_setting`: e.g. 'bfloat16 base, float32 LoRA' or 'bfloat16 weights, float32 masters'."""
    if not setting:
        return None
    trained = "/".join(setting.get("trainable_dtypes", []))
    if setting.get("lora"):
        return f"{'/'.join(setting.get('frozen_dtypes', []))} base, {trained} LoRA"
    masters = (
        ", float32 masters" if setting.get("master_weights") else (", updated in place" if trained != "float32" else "")
    )
    return f"{trained} weights{masters}"


def recorded_setting(cfg: dict) -> dict:
    """`training_setting` for a record made before the oracle wrote it down, from its config: a full-parameter
    run updated its weights in place in `model.dtype` (float32 masters came later, with their option); a LoRA
    run kept peft's float32 adapters over that dtype."""
    model = as_dict(cfg.get("model"))
    if not model.get("dtype"):
        return {}
    dtype = str(model["dtype"])
    if model.get("lora"):
        return {"frozen_dtypes": [dtype], "trainable_dtypes": ["float32"], "lora": True, "master_weights": False}
    return {
        "frozen_dtypes": [],
        "trainable_dtypes": [dtype],
        "lora": False,
        "master_weights": bool(as_dict(cfg.get("optimizer")).get("master_weights")),
    }


def learnable_example(model, task, cfg: PointConfig, device) -> tuple[object, dict]:
    """The task's first example from `prompt.seed` on (at most `staleness.prompt_search` seeds)
    whose group at the oracle's step 0 (the same sampling seed) has unequal rewards, so the first
    step updates the parameters; the last one tried when none does. Returns it and
    {"prompt_seed", "prompts_tried", "first_group_rewards"}."""
    from longstraw.core.transaction import capture
    from longstraw.kinds.common import capture_kwargs
    from longstraw.training.oracle import step_sampling
    from longstraw.training.rollout import sample

    tries = cfg.staleness.prompt_search
    if tries == 1:  # no search: the point's own seed, whatever its rewards
        return task.make(cfg.prompt.seed), {"prompt_seed": cfg.prompt.seed, "prompts_tried": 1}
    for i in range(tries):
        seed = cfg.prompt.seed + i
        example = task.make(seed)
        state = capture(model, example.prompt_ids.to(device), **capture_kwargs(cfg))
        responses = sample(
            model, state, step_sampling(cfg.grpo.num_generations, cfg.responses.length, cfg.responses.seed, step=0)
        ).responses
        del state
        rewards = [float(task.reward(example, y)) for y in responses]
        if len(set(rewards)) > 1 or i == tries - 1:
            return example, {"prompt_seed": seed, "prompts_tried": i + 1, "first_group_rewards": rewards}


# ------------------------------------------------------------------------------------------- report

# The oracle's per-step measures (longstraw.training.oracle), in the order a step row shows them.
MEASURES = (
    "update_changed_fraction",
    "param_drift",
    "loss_stale",
    "loss_fresh",
    "relative_loss_drift",
    "mean_abs_logprob_diff",
    "kl_k3",
    "grad_cosine",
    "grad_norm_stale",
    "grpo_loss_stale",
    "grpo_loss_fresh",
    "reward_mean",
)
# what a reader checks against the paper (the drift at steps 1-2 and at the first update, the floor, the
# interval); every column stays in the CSV
SHOWN = [
    "model",
    "setting",
    "lr",
    "prompt_positions",
    "updates",
    "drift_threshold",
    "refresh_interval",
    "relative_loss_drift_step1",
    "relative_loss_drift_step2",
    "first_update_step",
    "first_update_relative_loss_drift",
    "first_update_mean_abs_logprob_diff",
    "first_update_param_drift",
    "update_changed_fraction",
    "floor_relative_loss_drift",
    "floor_changed_fraction",
    "max_relative_loss_drift",
    "peak_memory_bytes",
    "wall_seconds",
]
STEP_COLUMNS = [
    "point",
    "lr",
    "step",
    "status",
    "updated",
    "update_changed_fraction",
    "param_drift",
    "loss_stale",
    "loss_fresh",
    "relative_loss_drift",
    "under_threshold",
    "mean_abs_logprob_diff",
    "kl_k3",
    "one_minus_grad_cosine",
    "reward_mean",
    "error",
    "report_error",
]
EXTRA_TABLES = {
    "drift": ExtraTable(
        "Drift per step",
        STEP_COLUMNS,
        "One row per oracle step. At every step the policy samples responses from the reused (stale) prompt state, "
        "and on those same responses the stale state is compared with a fresh capture under the current "
        "parameters. Step 0 is the capture itself: fresh equals stale, so its drift is exactly zero (a check, not a "
        "data point). updated: the step changed the parameters (a group whose rewards were all equal has zero "
        "advantage and changes nothing); relative_loss_drift: |L_stale - L_fresh| / L_fresh for the mean response "
        "NLL; "
        "under_threshold: below the point's refresh threshold; mean_abs_logprob_diff and kl_k3 (exp(d) - d - 1, "
        "d = log p_fresh - log p_stale) per response token; grad_cosine: cosine of the stale and fresh gradients; "
        "param_drift: L2 norm of the trainable parameters' change since the capture (the trainer's adaptive "
        "refresh signal); grpo_loss_*: the GRPO surrogate (about 0 on policy, so not used for the drift); "
        "response_tokens: summed over the group. A point without steps (error, out of memory, rows missing) has "
        "one row saying so.",
        key="drift",
        beside_points=True,
    ),
}
CAPTIONS = {
    "drift_per_step": "The fresh-prefix oracle, one line per point: at every step the reused (stale) prompt state is "
    "compared with a fresh capture under the current parameters on the same responses. Top: "
    "relative loss drift |L_stale - L_fresh| / L_fresh in % (log scale) with the refresh threshold "
    "and the paper's stated band (its 1M-position oracle: ~0.04-0.12% at steps 1-2; for later "
    "steps the paper gives no figure, so none is drawn); mean |delta log p| per response token; "
    "KL k3 (stale || fresh). Bottom: 1 - cosine of the stale and fresh gradients; the parameter "
    "drift since the capture (the trainer's adaptive refresh signal); and the loss drift against "
    "that signal, each marker labelled with its step. Step 0 is the capture itself (drift exactly "
    "zero by construction) and is not drawn on the log scales. Dotted, where a point measured "
    "it: its numerical floor (the drift of a fresh capture after a random parameter perturbation "
    "far below one step's, in the same precision); drift at or under it is not staleness.",
}


def _step_rows(rows) -> list[dict]:
    """The oracle's rows that carry a step number, in step order (a malformed row is left out)."""
    rows = [r for r in rows or [] if isinstance(r, dict) and number(r.get("step")) is not None]
    return sorted(rows, key=lambda r: r["step"])


FLOOR_MARGIN = 3.0  # a drift is read as staleness only beyond this multiple of the numerical floor


def updating_steps(rows: list[dict]) -> list[dict]:
    """The oracle steps (after step 0) that moved the parameters: a step whose parameter drift equals
    the step before's made no update (every reward in its group was equal, so every advantage was
    zero) and says nothing about staleness. A row without a recorded drift counts as an update."""
    rows, out, before = _step_rows(rows), [], 0.0
    for row in rows:
        if row["step"] == 0:
            continue
        drift = number(row.get("param_drift"))
        if drift is None or drift != before:
            out.append(row)
        before = drift if drift is not None else before
    return out


def refresh_interval(rows: list[dict], threshold, floor=0.0) -> int | None:
    """The number of parameter updates the reused state stays good for: how many updating steps
    (`updating_steps`) come before the first whose relative loss drift reaches `threshold` (a step
    without a drift ends the count). None without a threshold, when no step updated the parameters
    (nothing to read), and when the threshold lies within FLOOR_MARGIN x the numerical `floor` (the
    oracle's drift under a parameter perturbation far below one step's)."""
    updates = updating_steps(rows)
    if number(threshold) is None or not updates or threshold <= FLOOR_MARGIN * (number(floor) or 0.0):
        return None
    interval = 0
    for row in updates:
        drift = number(row.get("relative_loss_drift"))
        if drift is None or drift >= threshold:
            break
        interval += 1
    return interval


def refresh_interval_sentence(row: dict) -> str:
    """A staleness point's derived refresh interval in words, from its row (`refresh_interval`,
    `drift_threshold`, `steps_measured`, `threshold_crossed_at_step`)."""
    from longstraw.plotting.formatting import format_percent, is_missing

    interval, threshold = row.get("refresh_interval"), row.get("drift_threshold")
    under = f"under {format_percent(threshold)}" if not is_missing(threshold) else "under the threshold"
    if is_missing(interval):
        if row.get("status") == "ok" and row.get("updates") == 0:
            return (
                "no refresh interval: no step updated the parameters (every group's rewards were equal, so "
                "every advantage was zero)"
            )
        floor = row.get("floor_relative_loss_drift")
        if (
            row.get("status") == "ok"
            and not is_missing(threshold)
            and not is_missing(floor)
            and threshold <= FLOOR_MARGIN * floor
        ):
            return (
                f"no refresh interval: the threshold {format_percent(threshold)} lies within {FLOOR_MARGIN:g}x "
                f"the numerical floor {format_percent(floor)} (the drift after a perturbation far below one "
                "step's), so a drift that small cannot be told from the precision's"
            )
        return f"no refresh interval: no loss drift measured (status {row.get('status')})"
    interval = int(interval)
    text = (
        f"{interval} update{'s' if interval != 1 else ''}: the number of parameter updates whose loss drift "
        f"stays {under}"
    )
    if not is_missing(row.get("updates")) and row.get("updates") != row.get("steps_measured"):
        text += f" ({int(row['updates'])} of the {int(row['steps_measured'])} steps updated the parameters)"
    crossed, measured = row.get("threshold_crossed_at_step"), row.get("steps_measured")
    if not is_missing(crossed):
        text += f" (crossed at step {int(crossed)})"
    elif not is_missing(measured):
        text += (
            f" (never crossed in the {int(measured)} steps measured, so at least {interval}; "
            "the run does not show where it ends)"
        )
    if is_missing(row.get("floor_relative_loss_drift")):
        text += "; its numerical floor was not measured, so drift from the precision alone is not excluded"
    elif row.get("floor_relative_loss_drift") == 0 and row.get("floor_mean_abs_logprob_diff") == 0:
        text += (
            "; its floor is exactly zero: the perturbation moved no log-prob (where it changed no weight, "
            "rounded away in the parameters' precision, the floor is the recapture's determinism, not the "
            "precision's sensitivity to a real change)"
        )
    return text


def regime_sentence(rows: list[dict], low: float, high: float, positions=None) -> str:
    """Whether the paper's staleness regime appears in these staleness rows (one per point), per training
    setting (`setting`: what was trained in which precision) and at which learning rate: each point's first
    parameter update's loss drift against the paper's range [`low`, `high`] (fractions), read only beyond
    FLOOR_MARGIN x the point's numerical floor. With `positions`, a setting's points at that prompt length
    (all of its points when none is)."""
    points = [r for r in rows if r.get("kind") == "staleness"]
    ok = [r for r in points if r.get("status") == "ok"]
    if not ok:
        return "no staleness point completed" if points else "not measured in these results (no staleness point)"
    settings = list(dict.fromkeys(r.get("setting") or "setting not recorded" for r in ok))
    parts = []
    for setting in settings:
        mine = [r for r in ok if (r.get("setting") or "setting not recorded") == setting]
        at = [r for r in mine if positions is not None and r.get("prompt_positions") == positions]
        text = _regime_of(sorted(at or mine, key=lambda r: number(r.get("lr")) or 0.0), low, high)
        parts.append(f"{setting}: {text}" if len(settings) > 1 or setting != "setting not recorded" else text)
    return " | ".join(parts)


def _regime_of(chosen: list[dict], low: float, high: float) -> str:
    from longstraw.plotting.formatting import format_percent, format_value

    readings, inside = [], []
    for row in chosen:
        drift, floor, lr = (
            number(row.get(k)) for k in ("first_update_relative_loss_drift", "floor_relative_loss_drift", "lr")
        )
        name = f"lr {lr:g} at {format_value('prompt_positions', row.get('prompt_positions'))}"
        if drift is None:
            readings.append(f"{name}: no update")
            continue
        if floor is not None and drift <= FLOOR_MARGIN * floor:
            where = f"within {FLOOR_MARGIN:g}x its floor {format_percent(floor)}, not readable"
        else:
            where = ("below" if drift < low else "above" if drift > high else "inside") + " the paper's range"
            inside += [f"{lr:g}"] if low <= drift <= high else []
        floor_text = "" if floor is not None else ", floor not measured"
        step = int(row["first_update_step"])
        readings.append(f"{name}: {format_percent(drift)} at step {step} ({where}{floor_text})")
    verdict = (
        f"the paper's regime appears at lr {', '.join(inside)}"
        if inside
        else "the paper's regime does not appear at the learning rates tried"
    )
    return f"{verdict}. First update's loss drift: " + "; ".join(readings) + _follows_the_step(chosen)


def _follows_the_step(rows: list[dict]) -> str:
    """Does the first update's log-prob drift grow with the step? Between the points whose first updates
    moved the parameters least and most: how many times the parameter drift and |delta log p| grew. Drift
    that stays put while the step grows many-fold is the precision's sensitivity, not staleness."""
    moved = [
        r
        for r in rows
        if (number(r.get("first_update_param_drift")) or 0) > 0
        and number(r.get("first_update_mean_abs_logprob_diff")) is not None
    ]
    if len(moved) < 2:
        return ""
    small = min(moved, key=lambda r: r["first_update_param_drift"])
    large = max(moved, key=lambda r: r["first_update_param_drift"])
    steps = large["first_update_param_drift"] / small["first_update_param_drift"]
    if small["first_update_mean_abs_logprob_diff"] <= 0:
        return ""
    logps = large["first_update_mean_abs_logprob_diff"] / small["first_update_mean_abs_logprob_diff"]
    text = (
        f". From lr {number(small.get('lr')):g} to lr {number(large.get('lr')):g} the first update moved the "
        f"parameters {steps:.3g}x as far and the log-probs {logps:.3g}x as far (mean |delta log p| "
        f"{small['first_update_mean_abs_logprob_diff']:.3g} -> {large['first_update_mean_abs_logprob_diff']:.3g})"
    )
    if steps >= 10 and logps < steps**0.5:
        text += ": the drift does not follow the step, so it is the precision's sensitivity rather than staleness"
    return text


def columns(point: dict) -> dict:
    """One staleness point: its setting, the drift at steps 1 and 2 (where the paper states its
    figure), the largest drift and the step it occurred at, the derived refresh interval (where the
    drift first reached the threshold, if it did) and the last step's measures."""
    cfg, metrics = point_parts(point)
    rows = _step_rows(metrics.get("rows"))
    threshold = number(metrics.get("threshold", as_dict(cfg.get("staleness")).get("threshold")))
    phases = as_dict(metrics.get("phases"))
    cols = {
        **_setting_columns(cfg, metrics, rows, threshold),
        **_refresh_columns(metrics, rows, threshold),
        **_drift_columns(rows),
        **_memory_columns(point, phases),
    }
    cols.update(phase_columns("oracle", as_dict(phases.get("oracle"))))
    cols.update(phase_columns("weights", as_dict(phases.get("weights"))))
    if point.get("status") == "ok" and not rows:
        cols["report_error"] = "no per-step rows in the result (metrics.rows missing or empty)"
    return cols


def _setting_columns(cfg: dict, metrics: dict, rows: list[dict], threshold) -> dict:
    first_update = next(iter(updating_steps(rows)), {})
    return {
        "lr": number(as_dict(cfg.get("optimizer")).get("lr")),
        # what is trained and in which precision: the drift means staleness only where an update is not rounded away
        "setting": setting_label(as_dict(metrics.get("setting")) or recorded_setting(cfg)),
        "update_changed_fraction": number(first_update.get("update_changed_fraction")),
        "prompt_positions": number(metrics.get("prompt_positions")),
        "G": as_dict(cfg.get("grpo")).get("num_generations"),
        "response_length": as_dict(cfg.get("responses")).get("length"),
        "steps": as_dict(cfg.get("staleness")).get("steps"),
        "steps_measured": max((r["step"] for r in rows), default=None) if rows else None,
        "drift_threshold": threshold,
    }


def _refresh_columns(metrics: dict, rows: list[dict], threshold) -> dict:
    """The refresh interval the rows give, the numerical floor, and the first update's drift."""
    floor = as_dict(metrics.get("floor"))
    after = [r for r in rows if r["step"] >= 1 and number(r.get("relative_loss_drift")) is not None]
    crossed = next((r["step"] for r in after if threshold is not None and r["relative_loss_drift"] >= threshold), None)
    first_update = next(iter(updating_steps(rows)), {})
    return {
        # derived from the rows (the evidence), not read from the result: one definition for every record
        "refresh_interval": refresh_interval(rows, threshold, floor.get("relative_loss_drift", 0.0)),
        "updates": len(updating_steps(rows)) if rows else None,
        # the drift of a fresh capture after a parameter perturbation far below one step's (the precision's)
        "floor_relative_loss_drift": number(floor.get("relative_loss_drift")),
        "floor_mean_abs_logprob_diff": number(floor.get("mean_abs_logprob_diff")),
        "floor_changed_fraction": number(floor.get("changed_fraction")),
        "threshold_crossed_at_step": crossed,
        # the drift after the first step that moved the parameters: what the paper's steps 1-2 figure reads
        # when every step updates (a task's zero-advantage groups update nothing)
        "first_update_step": first_update.get("step"),
        "first_update_relative_loss_drift": number(first_update.get("relative_loss_drift")),
        "first_update_mean_abs_logprob_diff": number(first_update.get("mean_abs_logprob_diff")),
        "first_update_param_drift": number(first_update.get("param_drift")),
        # the task example the oracle ran on (a prompt search tries seeds until a group's rewards differ)
        "prompt_seed": number(metrics.get("prompt_seed")),
        "prompts_tried": number(metrics.get("prompts_tried")),
    }


def _drift_columns(rows: list[dict]) -> dict:
    """The drift at steps 1 and 2, the largest, step 0's check and the last step's measures."""
    by_step = {r["step"]: r for r in rows}
    after = [r for r in rows if r["step"] >= 1 and number(r.get("relative_loss_drift")) is not None]
    largest = max(after, key=lambda r: r["relative_loss_drift"]) if after else {}
    first, last = by_step.get(0, {}), rows[-1] if rows else {}
    return {
        "relative_loss_drift_step1": number(by_step.get(1, {}).get("relative_loss_drift")),
        "relative_loss_drift_step2": number(by_step.get(2, {}).get("relative_loss_drift")),
        "max_relative_loss_drift": number(largest.get("relative_loss_drift")),
        "max_drift_step": largest.get("step"),
        # step 0: fresh == stale by construction, so its drift must be exactly zero (a check)
        "step0_drift_zero": (first.get("relative_loss_drift") == 0 and first.get("mean_abs_logprob_diff") == 0)
        if first
        else None,
        "final_param_drift": number(last.get("param_drift")),
        "final_mean_abs_logprob_diff": number(last.get("mean_abs_logprob_diff")),
        "final_kl_k3": number(last.get("kl_k3")),
        "final_grad_cosine": number(last.get("grad_cosine")),
        "min_grad_cosine": min(
            (r["grad_cosine"] for r in rows if number(r.get("grad_cosine")) is not None), default=None
        ),
        "loss_finite": finite([r.get(k) for r in rows for k in ("loss_stale", "loss_fresh")]),
    }


def _memory_columns(point: dict, phases: dict) -> dict:
    """The peak the ceiling is compared with: the phases' and the point's allocated peak on CUDA, else peak RSS."""
    if not is_cuda_point(point):
        return {"peak_memory_bytes": number(point.get("peak_rss_bytes")), "peak_memory_measure": "process peak RSS"}
    peaks = [v for v in (number(as_dict(p).get("peak_allocated_bytes")) for p in phases.values()) if v is not None]
    if number(point.get("peak_allocated_bytes")) is not None:
        peaks.append(point["peak_allocated_bytes"])
    return {"peak_memory_bytes": max(peaks, default=None), "peak_memory_measure": "peak_allocated_bytes"}


def drift_rows(point: dict) -> list[dict]:
    """One row per oracle step of a staleness point (step 0: the capture itself, drift zero by
    construction). A point without rows (error, oom, or rows missing) gives one row saying so, so
    the per-step table shows every point."""
    cfg, metrics = point_parts(point)
    rows = _step_rows(metrics.get("rows"))
    threshold = number(metrics.get("threshold", as_dict(cfg.get("staleness")).get("threshold")))
    lr = number(as_dict(cfg.get("optimizer")).get("lr"))
    if not rows:
        status = status_of(point.get("status"))
        return [
            {
                "point": point.get("point"),
                "kind": "staleness_step",
                "lr": lr,
                "step": None,
                "status": status,
                "error": point.get("error"),
                "report_error": "no per-step rows in the result" if status == "ok" or not point.get("error") else None,
            }
        ]
    out, updated = [], {r["step"] for r in updating_steps(rows)}
    for row in rows:
        record = {
            "point": point.get("point"),
            "kind": "staleness_step",
            "lr": lr,
            "step": int(row["step"]),
            "status": "ok",
            "updated": row["step"] in updated,
            "error": None,
        }
        record.update({key: number(row.get(key)) for key in MEASURES})
        cosine, drift = record["grad_cosine"], record["relative_loss_drift"]
        record["one_minus_grad_cosine"] = 1.0 - cosine if cosine is not None else None
        record["under_threshold"] = drift < threshold if drift is not None and threshold is not None else None
        tokens = row.get("response_tokens")
        record["response_tokens"] = (
            sum(tokens) if isinstance(tokens, list) and all(number(t) is not None for t in tokens) else number(tokens)
        )
        out.append(record)
    return out


def tables(points: list[dict]) -> dict[str, list[dict]]:
    return {"drift": rows_of_points(points, drift_rows)}


def notes(row: dict, grid) -> list[str]:
    """The point's derived refresh interval in a sentence, with what it rests on."""
    from longstraw.plotting.formatting import format_percent, format_value, is_missing

    setting = ", ".join(f"{k}={row[k]}" for k in grid if not is_missing(row.get(k)))
    head = (
        f"{row.get('point')}"
        + (f" ({row['setting']})" if not is_missing(row.get("setting")) else "")
        + (f" ({setting})" if setting else "")
    )
    if row.get("status") != "ok" or is_missing(row.get("refresh_interval")):
        if row.get("status") == "ok" and (
            row.get("updates") == 0 or not is_missing(row.get("floor_relative_loss_drift"))
        ):
            return [f"{head}: {refresh_interval_sentence(row)}."]
        why = row.get("error") or row.get("report_error") or "no drift measured"
        return [f"{head}: no refresh interval (status {row.get('status')}: {why})."]
    text = f"{head}: refresh interval {refresh_interval_sentence(row)}."
    if not is_missing(row.get("max_relative_loss_drift")):
        text += (
            f" Largest loss drift {format_percent(row['max_relative_loss_drift'])} at step "
            f"{row.get('max_drift_step')}; drift at steps 1-2: "
            f"{format_percent(row.get('relative_loss_drift_step1'))}, "
            f"{format_percent(row.get('relative_loss_drift_step2'))}, at "
            f"{format_value('prompt_positions', row.get('prompt_positions'))} prompt positions "
            "(the paper's reading beside ours: the table below)."
        )
    if not is_missing(row.get("first_update_relative_loss_drift")) and row.get("updates") != row.get("steps_measured"):
        text += (
            f" Its first parameter update came at step {int(row['first_update_step'])}, with loss drift "
            f"{format_percent(row['first_update_relative_loss_drift'])}."
        )
    if row.get("step0_drift_zero") is False:
        text += " Step 0's drift is not zero: the oracle's fresh capture does not reproduce the stale one."
    return [text]


def figures(data, ceiling: dict, marks=()):
    staleness = data.of_kind("staleness")
    drift = data.extra.get("drift", [])
    if staleness and any(d.get("step") is not None for d in drift):
        bands = [m["band"] for m in marks if "band" in m]
        yield "drift_per_step", plot_drift(staleness, drift, data.grid, data.name, bands)


def _positive(rows, key, scale=1.0):
    """(steps, values) of the rows with a positive value (what a log scale can draw), step >= 1."""
    pairs = [
        (r["step"], r[key] * scale)
        for r in rows
        if r.get("step") is not None and r["step"] >= 1 and r.get(key) is not None and r[key] * scale > 0
    ]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _draw_band(ax, band: dict) -> None:
    """The paper's stated drift range over its stated steps, hatched, labelled as the paper's."""
    import textwrap

    from longstraw.plotting.draw import PAPER_COLOR

    steps = band["steps"]
    ax.fill_between(
        [min(steps), max(steps)],
        band["low"] * 100,
        band["high"] * 100,
        color=PAPER_COLOR,
        alpha=0.2,
        hatch="//",
        edgecolor=PAPER_COLOR,
        linewidth=1.2,
        label=textwrap.fill(f"paper: {band['text']}", 48, subsequent_indent="  "),
        zorder=1,
    )


def plot_drift(points: list[dict], drift: list[dict], grid, title: str, bands=()):
    """`points`: the staleness point rows (`columns`); `drift`: their oracle steps (`drift_rows`);
    `bands`: the paper's stated drift ranges (`report.paper.reference_marks`)."""
    from longstraw.plotting import draw

    fig, axes = draw.plt.subplots(2, 3, figsize=(16, 10))
    labels = dict(zip((str(r.get("point")) for r in points), draw.point_labels(points, grid)))
    drawn = [p for p in points if any(d.get("point") == p.get("point") and d.get("step") is not None for d in drift)]
    for i, point in enumerate(drawn):
        name, color = str(point.get("point")), draw.POINT_COLORS[i % len(draw.POINT_COLORS)]
        rows = sorted(
            (d for d in drift if str(d.get("point")) == name and d.get("step") is not None), key=lambda d: d["step"]
        )
        label = labels.get(name, name)
        if point.get("status") != "ok":
            label += f" ({str(point.get('status')).upper()}: partial)"
        _draw_point_drift(axes, point, rows, label, color)
    _mark_undrawn(axes[0][0], [p for p in points if p not in drawn], labels)
    _draw_thresholds(axes, points, bands)
    _label_drift_panels(axes, points, drift, bands)
    # one legend for every panel (points, floors, threshold, the paper's band), beside them, clear of the lines
    draw.legend_outside(axes[0][2], *draw.shared_legend(axes.flat))
    fig.suptitle(f"{title}: drift of a reused prompt state against a fresh capture, per step", fontsize=10)
    return fig


def _draw_point_drift(axes, point: dict, rows: list[dict], label: str, color) -> None:
    """One point's oracle steps in every panel, and its numerical floor where it was measured."""
    (loss_ax, logp_ax, kl_ax), (cos_ax, param_ax, vs_ax) = axes
    for ax, key, scale in (
        (loss_ax, "relative_loss_drift", 100.0),
        (logp_ax, "mean_abs_logprob_diff", 1.0),
        (kl_ax, "kl_k3", 1.0),
        (cos_ax, "one_minus_grad_cosine", 1.0),
    ):
        xs, ys = _positive(rows, key, scale)
        if xs:
            ax.plot(xs, ys, marker="o", markersize=4, color=color, label=label)
    # the point's numerical floor (drift under a perturbation far below one step's): read only above it
    for ax, key, scale in (
        (loss_ax, "floor_relative_loss_drift", 100.0),
        (logp_ax, "floor_mean_abs_logprob_diff", 1.0),
    ):
        if number(point.get(key)):
            ax.axhline(
                point[key] * scale,
                color=color,
                linestyle=":",
                linewidth=1.2,
                label=f"{label}: numerical floor" if ax is loss_ax else None,
            )
    moved = [r for r in rows if r.get("param_drift") is not None]
    param_ax.plot(
        [r["step"] for r in moved],
        [r["param_drift"] for r in moved],
        marker="o",
        markersize=4,
        color=color,
        label=label,
    )
    pairs = [
        (r["param_drift"], r["relative_loss_drift"] * 100, r["step"])
        for r in rows
        if r["step"] >= 1 and r.get("param_drift") and r.get("relative_loss_drift")
    ]
    if pairs:
        vs_ax.plot([p[0] for p in pairs], [p[1] for p in pairs], marker="o", markersize=4, color=color, label=label)
        for x, y, step in pairs:
            vs_ax.annotate(str(step), (x, y), textcoords="offset points", xytext=(3, 3), fontsize=6, color=color)


def _mark_undrawn(loss_ax, undrawn: list[dict], labels: dict) -> None:
    """Points with no rows to draw: said in the legend, never dropped silently."""
    from longstraw.plotting import draw

    for point in undrawn:
        status = str(point.get("status") or "error")
        loss_ax.plot(
            [],
            [],
            marker="X",
            linestyle="none",
            markersize=9,
            color=draw.FAILED_COLORS.get(status, draw.FAILED_COLORS["error"]),
            label=f"{labels.get(str(point.get('point')))}: "
            + ("no per-step rows in the result" if status == "ok" else f"{status.upper()}, no steps measured"),
        )


def _draw_thresholds(axes, points: list[dict], bands) -> None:
    """The refresh thresholds on the loss panels, and the paper's drift bands."""
    from longstraw.plotting.formatting import format_percent

    loss_ax, vs_ax = axes[0][0], axes[1][2]
    for threshold in sorted({p["drift_threshold"] for p in points if p.get("drift_threshold")}):
        for ax in (loss_ax, vs_ax):
            ax.axhline(
                threshold * 100,
                color="black",
                linestyle="--",
                linewidth=1.1,
                label=f"threshold {format_percent(threshold)} (refresh interval)" if ax is loss_ax else None,
            )
    for band in bands:
        _draw_band(loss_ax, band)


def _label_drift_panels(axes, points: list[dict], drift: list[dict], bands) -> None:
    """Axes, scales, titles and ticks of the six panels."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    from longstraw.plotting import draw

    (loss_ax, logp_ax, kl_ax), (cos_ax, param_ax, vs_ax) = axes
    panels = (
        (loss_ax, "relative loss drift (%)", "loss drift per step"),
        (logp_ax, "mean |Δ log p| (nats per token)", "mean |Δ log p|, stale against fresh"),
        (kl_ax, "KL k3 (nats per token)", "KL(stale || fresh), k3 estimate"),
        (cos_ax, "1 − cos(g_stale, g_fresh)", "1 − gradient cosine"),
    )
    scales = {}
    for ax, ylabel, name in panels:  # log only where the values span a decade (`draw.scale_by_span`)
        shaded = [100 * b[k] for b in bands for k in ("low", "high")] if ax is loss_ax else ()
        scales[ax] = " (log scale)" if draw.scale_by_span(ax, shaded) else ""
        ax.set_xlabel("step since the capture")
        ax.set_ylabel(ylabel)
        ax.set_title(name + scales[ax], fontsize=9)
    positions = sorted({p["prompt_positions"] for p in points if p.get("prompt_positions")})
    paper_where = "; ".join(f"paper at {b['positions']:,} positions" for b in bands if b.get("positions"))
    loss_ax.set_title(
        f"relative loss drift per step{scales[loss_ax]}\nours at "
        + (", ".join(f"{n:,}" for n in positions) or "?")
        + " positions"
        + (f"; {paper_where}" if paper_where else ""),
        fontsize=9,
    )
    param_ax.set_xlabel("step since the capture")
    param_ax.set_ylabel("‖θ − θ_capture‖₂ (trainable parameters)")
    param_ax.set_title("parameter drift (the trainer's adaptive refresh signal)", fontsize=9)
    vs_ax.set_xscale("log")
    vs_ax.set_yscale("log")
    vs_ax.set_xlabel("parameter drift ‖θ − θ_capture‖₂ (log)")
    vs_ax.set_ylabel("relative loss drift (%)")
    vs_ax.set_title("measured loss drift against the refresh signal (labels: step)", fontsize=9)
    steps = sorted({d["step"] for d in drift if d.get("step") is not None})
    for ax in (loss_ax, logp_ax, kl_ax, cos_ax, param_ax):
        if steps:
            ax.set_xticks(steps)
    # ticks at 1, 2, 5 x 10^k, plainly labelled (log minor labels overlap on a narrow range)
    vs_ax.xaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    vs_ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    vs_ax.xaxis.set_minor_formatter(NullFormatter())


def tasks(cfg: PointConfig) -> list:
    """Its task, where the prompt and rewards are a task's."""
    task = cfg.staleness.task
    return [("staleness.task", task, [cfg.prompt.length], "prompt.length")] if task else []


KIND = Kind(
    "staleness",
    run=run,
    section=StalenessConfig,
    check=check,
    tasks=tasks,
    columns=columns,
    tables=tables,
    extra_tables=EXTRA_TABLES,
    shown=SHOWN,
    notes=notes,
    figures=figures,
    captions=CAPTIONS,
    contributes={"regime_sentence": regime_sentence, "refresh_interval_sentence": refresh_interval_sentence},
)
