"""The H200 targets, evaluated from result JSONs (recorded or freshly run).

    python benchmarks/h200_targets.py                       # experiments/recorded/h200
    python benchmarks/h200_targets.py --results results/h200

Each target reads the results it needs; a ratio that needs two figures takes both from one run
(one result file). A target whose results are missing, or whose figure was not measured, says
so (`met` is None) instead of guessing. Inputs (layout `<results>/<experiment>/<point>.json`):
- g_sweep/sweep.json (kind sweep at 2,097,152 positions, with kernel rates): peak growth from
  G=2 to G=8, capture attention rate against causal SDPA, replay time per member against its
  FLOP floor, capture transient;
- operating_points/*.json (sweeps): capture transient at their lengths, replay's longest prompt;
- baselines/*.json with mode naive: naive's memory bracket, the largest prompt that fitted and
  the smallest that ran out of memory, over its capacity searches (full or one-member probes)
  and its single step points;
- baselines/mode-naive.json (capacity with comparison steps): the step times of the three modes
  at the longest length where naive's full G=8 step was timed;
- peers/warm-dense-1b_mode-{replay,prefix_grouper}_length-{8192,32768}_count-8.json: replay's
  warm and cold step and peak over PrefixGrouper's;
- architectures/qwen3.6-27b-shape-nf4-1048576.json and -65536-replay-checkpointed.json: the
  27B shape's capture against its FLOP floor at that run's rates (a run cut off later, status partial,
  still measured its capture; the part outside attention against the linear floor is shown beside it),
  whether capture and a G=2 and a G=8 step ran in one command, and its replay transient under whole-layer
  checkpointing; with -65536-replay-plain.json what checkpointing costs the replay phase.
"""

from __future__ import annotations

import json
from pathlib import Path

from longstraw import kinds

SWEEP = "g_sweep/sweep.json"
NAIVE = "baselines/mode-naive.json"
MIN_LONG_POSITIONS = 1 << 20

PEAK_GROWTH_LIMIT = 0.0025
CAPTURE_RATE_FLOOR = 0.70
TRANSIENT_LIMIT = 0.10
CAPACITY_RATIO = 8
STEP_SPEEDUP = 5
FLOOR_RATIO_LIMIT = 1.5
CAPTURE_27B = "architectures/qwen3.6-27b-shape-nf4-1048576.json"
REPLAY_27B = "architectures/qwen3.6-27b-shape-nf4-65536-replay-checkpointed.json"
PLAIN_REPLAY_27B = "architectures/qwen3.6-27b-shape-nf4-65536-replay-plain.json"
BATCHED_REPLAY_27B = "architectures/qwen3.6-27b-shape-nf4-65536-replay-checkpointed-k2.json"
BATCHED_PLAIN_27B = "architectures/qwen3.6-27b-shape-nf4-65536-replay-plain-k2.json"
CHECKPOINT_COST_LIMIT = 1.3  # checkpointed replay at most 1.3x plain on the 27B shape at 65,536
CAPTURE_FLOOR_LIMIT = 1.15  # the 27B shape's capture at 1,048,576 within 1.15x its floor
COMMAND_SECONDS = 600  # one device command's limit
REPLAY_TRANSIENT_27B_LIMIT = 8e9


def _load(root: Path, relative: str, statuses=("ok",)) -> dict | None:
    path = root / relative
    if not path.is_file():
        return None
    result = json.loads(path.read_text())
    return result if result.get("status") in statuses else None


def _steps(result: dict, mode: str) -> list[dict]:
    return [s for s in result["metrics"]["steps"] if s["mode"] == mode]


def _gb(n: float) -> str:
    return f"{n / 1e9:.3f} GB"


def _row(target: str, goal: str, measured: str, met, evidence: str) -> dict:
    return {"target": target, "goal": goal, "measured": measured, "met": met, "evidence": evidence}


def _missing(target: str, goal: str, what: str) -> dict:
    return _row(target, goal, f"not measured: {what}", None, "")


def peak_growth(root: Path) -> dict:
    target, goal = "peak(G=8) - peak(G=2), replay, 2,097,152 positions", "<= 0.25% of peak (paper: 0.21%)"
    sweep = _load(root, SWEEP)
    if sweep is None:
        return _missing(target, goal, f"no ok {SWEEP}")
    by_g = {s["count"]: s for s in _steps(sweep, "replay") if s["status"] == "ok"}
    if 2 not in by_g or 8 not in by_g:
        return _missing(target, goal, "the sweep has no ok replay step at G=2 and G=8")
    p2, p8 = by_g[2]["peak_allocated_bytes"], by_g[8]["peak_allocated_bytes"]
    share = (p8 - p2) / p8
    measured = f"{_gb(p8 - p2)} of {_gb(p8)} ({share:.3%})"
    transients = [by_g[g].get("replay_transient_bytes") for g in (2, 8)]
    if by_g[2] is sweep["metrics"]["steps"][0] and None not in transients:
        # the steps share one state and optimizer: a later step holds what the earlier ones left (the optimizer's
        # state, created by the first step's update), so a first G=2 step's peak is read against less held memory
        held = (p8 - transients[1]) - (p2 - transients[0])
        measured += (
            f"; the G=2 step is the sweep's first: the G=8 step began holding {_gb(held)} more (the optimizer's "
            "state among it), which a second G=2 step would hold too"
        )
    return _row(target, goal, measured, share <= PEAK_GROWTH_LIMIT, SWEEP)


def capture_attention_rate(root: Path) -> dict:
    target, goal = "capture attention rate at >= 1,048,576 positions", ">= 70% of causal SDPA in the same run"
    sweep = _load(root, SWEEP)
    if sweep is None or "kernel_rates" not in sweep["metrics"]:
        return _missing(target, goal, f"no ok {SWEEP} with kernel rates")
    capture, rates = sweep["metrics"]["capture"], sweep["metrics"]["kernel_rates"]
    ours, sdpa = capture["capture_attention"]["tflops_per_second"], rates["causal_sdpa"]["tflops_per_second"]
    return _row(
        target,
        goal,
        f"{ours:.0f} vs {sdpa:.0f} TFLOP/s ({ours / sdpa:.0%}) over {capture['positions']:,} positions",
        ours / sdpa >= CAPTURE_RATE_FLOOR,
        SWEEP,
    )


def capture_transients(root: Path) -> list[dict]:
    """One row per capture of >= 1,048,576 positions among the sweeps (the target holds at each)."""
    goal = "transient <= 10% of resident bytes"
    rows = []
    for relative in [SWEEP] + sorted(str(p.relative_to(root)) for p in root.glob("operating_points/*.json")):
        result = _load(root, relative)
        if result is None or "capture" not in result.get("metrics", {}):
            continue
        capture = result["metrics"]["capture"]
        if capture["positions"] < MIN_LONG_POSITIONS:
            continue
        share = capture["transient_bytes"] / capture["resident_bytes"]
        chunk = result["config"]["capture"].get("chunk_size")
        rows.append(
            _row(
                f"capture transient at {capture['positions']:,} positions (chunk {chunk})",
                goal,
                f"{_gb(capture['transient_bytes'])} of {_gb(capture['resident_bytes'])} ({share:.1%})",
                share <= TRANSIENT_LIMIT,
                relative,
            )
        )
    return rows or [_missing("capture transient at >= 1,048,576 positions", goal, "no capture that long")]


def _longest_replay(root: Path) -> tuple[int, str] | None:
    best = None
    for path in sorted(root.glob("*/*.json")):
        result = json.loads(path.read_text())
        if result.get("status") != "ok" or result.get("kind") != "sweep" or result["config"]["model"]["nf4"]:
            continue
        if any(s["mode"] == "replay" and s["status"] == "ok" for s in result["metrics"]["steps"]):
            length = result["config"]["prompt"]["length"]
            if best is None or length > best[0]:
                best = (length, str(path.relative_to(root)))
    return best


def _step_seconds(phases: dict) -> float:
    return sum(p["seconds"] for p in phases.values())


def naive_bracket(root: Path) -> tuple[int | None, int | None, list[str]]:
    """(largest prompt naive fitted, smallest it ran out of memory at, the files) over baselines/."""
    fitted, failed, files = [], [], []
    for path in sorted(root.glob("baselines/*.json")):
        result = json.loads(path.read_text())
        if result["config"]["mode"] != "naive" or result.get("status") not in ("ok", "oom"):
            continue
        files.append(str(path.relative_to(root)))
        if result["kind"] == "capacity" and result["status"] == "ok":
            fitted.append(result["metrics"]["largest_fitting"])
            failed.append(result["metrics"]["first_failing"])
        elif result["kind"] == "step":
            (fitted if result["status"] == "ok" else failed).append(result["config"]["prompt"]["length"])
    fitted, failed = [n for n in fitted if n], [n for n in failed if n]
    return max(fitted, default=None), min(failed, default=None), files


def baselines(root: Path) -> list[dict]:
    capacity_target = "largest fitting prompt, replay over naive (hybrid-1b, G=8)"
    capacity_goal = f">= {CAPACITY_RATIO}x"
    speed_target = "G=8 step time, naive over replay, at the longest length naive's full step was timed"
    speed_goal = f">= {STEP_SPEEDUP}x"
    largest, first_failing, files = naive_bracket(root)
    longest = _longest_replay(root)
    if largest is None or longest is None:
        capacity = _missing(capacity_target, capacity_goal, "naive or replay has no fitting length")
    elif first_failing is None:
        capacity = _row(
            capacity_target,
            capacity_goal,
            f"not established: naive fitted every probe up to {largest:,} positions and no probe ran out "
            f"of memory (searches stop on their time limit); replay completed {longest[0]:,} positions",
            None,
            ", ".join(files + [longest[1]]),
        )
    else:
        ratio = longest[0] / first_failing
        capacity = _row(
            capacity_target,
            capacity_goal,
            f"replay {longest[0]:,} (completed; its own limit not reached) vs naive < {first_failing:,} "
            f"(out of memory; largest fitting {largest:,}): > {ratio:.1f}x",
            ratio >= CAPACITY_RATIO,
            ", ".join(files + [longest[1]]),
        )
    naive = _load(root, NAIVE)
    metrics = naive["metrics"] if naive else {}
    timed = metrics.get("largest_fitting")
    at_timed = next((p for p in metrics.get("probes", []) if p["prompt_length"] == timed and p["status"] == "ok"), None)
    replay = metrics.get("comparison_at_largest_fitting", {}).get("replay")
    if at_timed is None or replay is None or replay["status"] != "ok":
        speed = _missing(speed_target, speed_goal, f"no naive step and replay comparison step at one length in {NAIVE}")
    else:
        t_naive, t_replay = _step_seconds(at_timed["step_phases"]), _step_seconds(replay["step_phases"])
        speed = _row(
            speed_target,
            speed_goal,
            f"naive {t_naive:.1f} s vs replay {t_replay:.1f} s (capture included) "
            f"at {timed:,} positions: {t_naive / t_replay:.1f}x",
            t_naive / t_replay >= STEP_SPEEDUP,
            NAIVE,
        )
    return [capacity, speed]


def replay_floor(root: Path) -> dict:
    target, goal = "replay time per member at 2,097,152 positions", "<= 1.5x its FLOP floor at measured rates"
    sweep = _load(root, SWEEP)
    if sweep is None or "kernel_rates" not in sweep["metrics"]:
        return _missing(target, goal, f"no ok {SWEEP} with kernel rates")
    step = max((s for s in _steps(sweep, "replay") if s["status"] == "ok"), key=lambda s: s["count"], default=None)
    if step is None:
        return _missing(target, goal, "no ok replay step")
    floor = floor_for(sweep)
    per_member = step["phases"]["replay"]["seconds"] / step["count"]
    parts = ", ".join(f"{k} {v:.3f} s" for k, v in floor["parts_seconds"].items())
    return _row(
        target,
        goal,
        f"{per_member:.3f} s vs floor {floor['seconds']:.3f} s ({parts}): {per_member / floor['seconds']:.2f}x",
        per_member / floor["seconds"] <= FLOOR_RATIO_LIMIT,
        SWEEP,
    )


def floor_for(sweep: dict) -> dict:
    """The FLOP floor of one member of a recorded sweep, from its config and its own kernel rates."""
    from longstraw.measure.flops import linear_parameters, replay_floor_seconds

    config, model = _shapes(sweep["config"])
    return replay_floor_seconds(
        config,
        linear_parameters(model),
        sweep["metrics"]["trainable_parameters"],
        sweep["config"]["responses"]["length"],
        sweep["metrics"]["capture"]["positions"],
        sweep["metrics"]["kernel_rates"],
    )


def _shapes(cfg: dict):
    """(HF config, a meta-device model: shapes only) of a recorded point's preset."""
    import torch
    import transformers

    from longstraw.models import MODEL_CLASSES, PRESETS, make_config

    config = make_config(cfg["model"]["preset"], **cfg["model"]["overrides"])
    with torch.device("meta"):
        return config, getattr(transformers, MODEL_CLASSES[PRESETS[cfg["model"]["preset"]].model_type][1])(config)


def capture_floor_27b(root: Path) -> dict:
    target, goal = "27B shape NF4 capture at 1,048,576 positions", f"<= {CAPTURE_FLOOR_LIMIT}x its FLOP floor"
    result = _load(root, CAPTURE_27B, statuses=("ok", "partial"))
    floor = result and result["metrics"].get("capture", {}).get("floor")
    if not floor:
        return _missing(target, goal, f"no {CAPTURE_27B} with kernel rates")
    capture = result["metrics"]["capture"]
    ratio = capture["capture_seconds"] / floor["seconds"]
    parts = ", ".join(f"{k} {v:.0f} s" for k, v in floor["parts_seconds"].items())
    # outside attention: norms, gates, Gated DeltaNet, the NF4 weights' dequantisation, none of it in the floor
    rest = capture["capture_seconds"] - capture["capture_attention"]["seconds"]
    return _row(
        target,
        goal,
        f"{capture['capture_seconds']:.0f} s vs floor {floor['seconds']:.0f} s ({parts}; "
        f"attention ran at {capture['capture_attention']['tflops_per_second']:.0f} TFLOP/s): {ratio:.2f}x; "
        f"outside attention {rest:.0f} s, {rest / floor['parts_seconds']['linear']:.2f}x the linear floor",
        ratio <= CAPTURE_FLOOR_LIMIT,
        CAPTURE_27B,
    )


def one_command_27b(root: Path) -> dict:
    target = "27B shape NF4 at 1,048,576 positions: capture, a G=2 and a G=8 step in one command"
    goal = f"every part ok within {COMMAND_SECONDS} s"
    result = _load(root, CAPTURE_27B, statuses=("ok", "partial"))
    if result is None or result.get("wall_seconds") is None:
        return _missing(target, goal, f"no {CAPTURE_27B}")
    steps = {s["count"]: s["status"] for s in result["metrics"].get("steps", []) if s["mode"] == "replay"}
    done = ", ".join(f"G={g} {status}" for g, status in sorted(steps.items())) or "no step"
    met = (
        result["status"] == "ok"
        and steps.get(2) == "ok"
        and steps.get(8) == "ok"
        and result["wall_seconds"] <= COMMAND_SECONDS
    )
    return _row(target, goal, f"{result['status']} in {result['wall_seconds']:.0f} s ({done})", met, CAPTURE_27B)


def replay_transient_27b(root: Path) -> dict:
    target, goal = "27B shape replay transient, one response of 1,024", f"<= {_gb(REPLAY_TRANSIENT_27B_LIMIT)}"
    result = _load(root, REPLAY_27B)
    steps = [s for s in (result or {}).get("metrics", {}).get("steps", []) if s.get("replay_transient_bytes")]
    if not steps:
        return _missing(target, goal, f"no ok {REPLAY_27B} with a replay transient")
    worst = max(s["replay_transient_bytes"] for s in steps)
    return _row(
        target,
        goal,
        f"{_gb(worst)} (graph {_gb(max(s['graph_bytes_peak'] for s in steps))})",
        worst <= REPLAY_TRANSIENT_27B_LIMIT,
        REPLAY_27B,
    )


def _g2_replay_seconds(root: Path, relative: str) -> tuple[float, float | None, int] | None:
    """(warm or only seconds, cold seconds when a warm one exists, k) of a point's G=2 replay phase; None when it has
    no ok G=2 step (an out-of-memory one included)."""
    result = _load(root, relative)
    steps = [s for s in _steps(result, "replay") if s["count"] == 2] if result else []
    if not steps or any(s["status"] != "ok" for s in steps):
        return None
    seconds = [s["phases"]["replay"]["seconds"] for s in steps]
    return seconds[-1], (seconds[0] if len(seconds) > 1 else None), steps[0].get("micro_batch", 1)


def checkpoint_cost_27b(root: Path) -> dict:
    """The replay phase of a G=2 step under whole-layer checkpointing over the plain one, each point in its
    own process, the two members one at a time (k=1) and, where recorded, as one batch (k=2). A point that ran two
    G=2 steps on its state is read warm (the last), its first (cold) beside it. The goal is read on each mode's
    fastest schedule that fits; a schedule that ran out of memory is named."""
    target = "27B shape replay, checkpointed over plain, G=2 x 1,024 at 65,536 positions"
    goal = f"<= {CHECKPOINT_COST_LIMIT}x, warm, each at its fastest k that fits"
    measured = {mode: {} for mode in ("checkpointed", "plain")}
    for mode, paths in (
        ("checkpointed", (REPLAY_27B, BATCHED_REPLAY_27B)),
        ("plain", (PLAIN_REPLAY_27B, BATCHED_PLAIN_27B)),
    ):
        for path in paths:
            if (root / path).is_file():
                measured[mode][path] = _g2_replay_seconds(root, path)
    fitting = {mode: [m for m in runs.values() if m] for mode, runs in measured.items()}
    if not all(fitting.values()):
        return _missing(target, goal, f"ok {REPLAY_27B} and {PLAIN_REPLAY_27B}, each with a G=2 replay step")
    best = {mode: min(runs) for mode, runs in fitting.items()}
    ratio = best["checkpointed"][0] / best["plain"][0]
    (checkpointed, _, k_checkpointed), (plain, _, k_plain) = best["checkpointed"], best["plain"]
    parts = [f"{ratio:.2f}x ({checkpointed:.2f} s at k={k_checkpointed} / {plain:.2f} s at k={k_plain})"]
    for mode, runs in measured.items():
        for path, m in runs.items():
            name = path.rsplit("/", 1)[-1].removesuffix(".json")
            if m is None:
                parts.append(f"{name}: no ok G=2 step (out of memory or failed)")
            else:
                warmth = f"warm {m[0]:.2f} s, cold {m[1]:.2f} s" if m[1] is not None else f"cold {m[0]:.2f} s"
                parts.append(f"{mode} k={m[2]}: {warmth}")
    evidence = ", ".join(path for runs in measured.values() for path in runs)
    return _row(target, goal, "; ".join(parts), ratio <= CHECKPOINT_COST_LIMIT, evidence)


def point_columns(result: dict) -> dict:
    """A result's cells as its kind reports them (a step point's warm and cold step seconds)."""
    return kinds.part(result.get("kind"), "columns")(result)


WARM_POINT = "peers/warm-dense-1b_mode-{mode}_length-{length}_count-8.json"
WARM_LENGTHS = (8192, 32768)
WARM_RATIO_LIMIT = 0.67  # replay's warm step at most 0.67x PrefixGrouper's (1.5x faster)


def replay_against_prefix_grouper(root: Path) -> list[dict]:
    """dense-1b, G=8, responses of 2,048: at each length, replay's warm step (the median of its
    cycles after the first, each from a fresh capture) over PrefixGrouper's, their cold (first) steps, and
    their peaks (one process per system: the two figures of a ratio come from two files)."""
    rows = []
    for length in WARM_LENGTHS:
        files = {mode: WARM_POINT.format(mode=mode, length=length) for mode in ("replay", "prefix_grouper")}
        results = {mode: _load(root, path) for mode, path in files.items()}
        evidence = ", ".join(files.values())
        # (what, goal, figure of a result, the ratio's limit, whether the limit itself misses)
        checks = [
            (
                "warm step",
                f"<= {WARM_RATIO_LIMIT}x",
                lambda r: point_columns(r)["warm_step_seconds"],
                WARM_RATIO_LIMIT,
                False,
            ),
            ("cold step", "< 1x", lambda r: point_columns(r)["cold_step_seconds"], 1.0, True),
            ("peak memory", "<= 1x", lambda r: r["metrics"]["peak_allocated_bytes"], 1.0, False),
        ]
        complete = all(r is not None and len(r["metrics"].get("cycles", [])) >= 2 for r in results.values())
        for what, goal, figure, limit, strict in checks:
            target = f"replay over PrefixGrouper, {what}, dense-1b, G=8, {length:,} positions"
            if not complete:
                rows.append(_missing(target, goal, f"ok {evidence}, at least 2 cycles each"))
                continue
            ours, theirs = figure(results["replay"]), figure(results["prefix_grouper"])
            ratio = ours / theirs
            shown = f"{_gb(ours)} / {_gb(theirs)}" if what == "peak memory" else f"{ours:.3f} s / {theirs:.3f} s"
            rows.append(
                _row(target, goal, f"{ratio:.2f}x ({shown})", ratio < limit if strict else ratio <= limit, evidence)
            )
    return rows


HYBRID_WARM_POINT = "peers/warm-hybrid-1b_mode-{mode}_length-32768_count-2.json"
TRL_SPEEDUP_LIMIT = 10.0  # replay's warm step at least 10x faster than TRL's on hybrid-1b
CEILINGS = "../h200-benchmarks/kernel_ceilings.json"  # the box's measured kernel rates, beside the recorded points


def step_floor(result: dict, ceilings: dict) -> dict:
    """The FLOP floor of a replay step point (its capture and G members) at the box's measured kernel rates
    (`kernel_ceilings.json`: cuDNN's attention rates at the model's head dim, the bf16 GEMM rate). A lower bound:
    no recompute under checkpointing, no Gated DeltaNet, norm or elementwise work."""
    from longstraw.measure.flops import (
        capture_floor_seconds,
        capture_linear_parameters,
        head_dim,
        linear_parameters,
        replay_floor_seconds,
    )

    cfg = result["config"]
    config, model = _shapes(cfg)
    rates = {**ceilings["attention"][f"head_dim_{head_dim(config)}"], "gemm": ceilings["linear"]["gemm"]}
    positions, linear = cfg["prompt"]["length"] - 1, linear_parameters(model)
    capture = capture_floor_seconds(config, capture_linear_parameters(model, config), positions, rates)
    member = replay_floor_seconds(
        config, linear, result["metrics"]["trainable_parameters"], cfg["responses"]["length"], positions, rates
    )
    count = cfg["grpo"]["num_generations"]
    return {
        "seconds": capture["seconds"] + count * member["seconds"],
        "capture_seconds": capture["seconds"],
        "replay_seconds": count * member["seconds"],
    }


# replay's variants the hybrid TRL target reads, each with TRL's float32 adapters: with and without whole-layer
# checkpointing (at G=2 and 32,768 both fit many times over), the members eager or as one CUDA graph
# (`replay.cuda_graph`); the faster warm step is the verdict's
HYBRID_REPLAY_VARIANTS = ("replay", "replay-uncheckpointed", "replay-uncheckpointed-graph")
# the floor is replay's own: there the variants with bf16 adapters (float32 masters in the optimizer) count too
HYBRID_FLOOR_VARIANTS = (
    *HYBRID_REPLAY_VARIANTS,
    "replay-bf16lora",
    "replay-uncheckpointed-bf16lora",
    "replay-bf16lora-graph",
    "replay-uncheckpointed-bf16lora-graph",
)


def _warm_variants(root: Path, modes) -> dict[str, dict]:
    """{mode: result} of the hybrid warm points present with at least two cycles (a warm step)."""
    variants = {}
    for mode in modes:
        result = _load(root, HYBRID_WARM_POINT.format(mode=mode))
        if result is not None and len(result["metrics"].get("cycles", [])) >= 2:
            variants[mode] = result
    return variants


def _fastest_warm(variants: dict[str, dict]) -> tuple[str, float, str]:
    """(mode, warm step seconds) of the fastest variant, and each variant's warm step as text."""
    warm = {mode: point_columns(r)["warm_step_seconds"] for mode, r in variants.items()}
    fastest = min(warm, key=warm.get)
    return fastest, warm[fastest], "; ".join(f"{mode} {seconds:.3f} s" for mode, seconds in warm.items())


def replay_against_trl_hybrid(root: Path) -> list[dict]:
    """hybrid-1b, G=2, 32,768: replay's warm step against TRL's, and against its own FLOP floor."""
    speed = ("replay over TRL, warm step, hybrid-1b, G=2, 32,768 positions", f">= {TRL_SPEEDUP_LIMIT:.0f}x faster")
    floor = ("replay's warm step over its FLOP floor, hybrid-1b, G=2, 32,768 positions", f"<= {FLOOR_RATIO_LIMIT}x")
    trl_file = HYBRID_WARM_POINT.format(mode="trl")
    trl = _load(root, trl_file)
    every = _warm_variants(root, HYBRID_FLOOR_VARIANTS)
    variants = {mode: result for mode, result in every.items() if mode in HYBRID_REPLAY_VARIANTS}
    if trl is None or len(trl["metrics"].get("cycles", [])) < 2 or not variants:
        files = ", ".join(HYBRID_WARM_POINT.format(mode=m) for m in (*HYBRID_REPLAY_VARIANTS, "trl"))
        return [
            _missing(*speed, f"ok {trl_file} and one of the replay points ({files}), at least 2 cycles each"),
            _missing(*floor, "ok replay point, at least 2 cycles"),
        ]
    fastest, ours, each = _fastest_warm(variants)
    theirs = point_columns(trl)["warm_step_seconds"]
    files = ", ".join(HYBRID_WARM_POINT.format(mode=m) for m in variants)
    rows = [
        _row(
            *speed,
            f"{theirs / ours:.1f}x ({theirs:.2f} s / {ours:.3f} s, {fastest}; {each})",
            theirs / ours >= TRL_SPEEDUP_LIMIT,
            f"{files}, {trl_file}",
        )
    ]
    ceilings_path = root / CEILINGS
    if not ceilings_path.is_file():
        return rows + [_missing(*floor, f"no {CEILINGS} (the box's kernel rates)")]
    fastest, ours, each = _fastest_warm(every)
    bound = step_floor(every[fastest], json.loads(ceilings_path.read_text()))
    rows.append(
        _row(
            *floor,
            f"{ours / bound['seconds']:.2f}x ({ours:.4f} s, {fastest} / {bound['seconds']:.3f} s: capture "
            f"{bound['capture_seconds']:.3f} s, replay {bound['replay_seconds']:.3f} s; {each})",
            ours / bound["seconds"] <= FLOOR_RATIO_LIMIT,
            f"{HYBRID_WARM_POINT.format(mode=fastest)}, {CEILINGS}",
        )
    )
    return rows


SCHEDULE_POINT = "peers/mb-dense-1b_length-32768_count-{count}_k-{k}.json"
SCHEDULE_PEAK_SPREAD = 1.05  # at one k, the peaks for G = 2, 8, 32 within 5% of each other


def _last_replay_seconds_per_member(result: dict) -> float:
    last = result["metrics"]["cycles"][-1]
    return last["phases"]["replay"]["seconds"] / last["members_replayed"]


def members_as_a_schedule(root: Path) -> list[dict]:
    """dense-1b at 32,768: the peak for G = 2, 8, 32 replayed two members at a time (flat in G), and
    the time per member at G=8 for k = 2, 4, 8 (the last cycle's replay phase over its members: warm)."""
    rows = []
    target, goal = "peak memory against G (2, 8, 32) at k=2, dense-1b, 32,768 positions", "max / min <= 1.05"
    files = [SCHEDULE_POINT.format(count=g, k=2) for g in (2, 8, 32)]
    results = [_load(root, f) for f in files]
    if any(r is None for r in results):
        rows.append(_missing(target, goal, "ok " + ", ".join(files)))
    else:
        peaks = [r["metrics"]["peak_allocated_bytes"] for r in results]
        spread = max(peaks) / min(peaks)
        rows.append(
            _row(
                target,
                goal,
                f"{spread:.3f} ({', '.join(_gb(p) for p in peaks)})",
                spread <= SCHEDULE_PEAK_SPREAD,
                ", ".join(files),
            )
        )
    target, goal = "time per member against k (2, 4, 8) at G=8, dense-1b, 32,768 positions", "falls as k grows"
    files = [SCHEDULE_POINT.format(count=8, k=k) for k in (2, 4, 8)]
    results = [_load(root, f) for f in files]
    if any(r is None or len(r["metrics"].get("cycles", [])) < 2 for r in results):
        rows.append(_missing(target, goal, "ok " + ", ".join(files) + ", at least 2 cycles each"))
    else:
        seconds = [_last_replay_seconds_per_member(r) for r in results]
        falling = all(a > b for a, b in zip(seconds, seconds[1:]))
        rows.append(
            _row(
                target,
                goal,
                " > ".join(f"{s * 1e3:.1f} ms" for s in seconds)
                if falling
                else ", ".join(f"{s * 1e3:.1f} ms" for s in seconds),
                falling,
                ", ".join(files),
            )
        )
    return rows


def evaluate_targets(results_dir) -> list[dict]:
    root = Path(results_dir)
    root = root / "points" if (root / "points").is_dir() else root
    return [
        peak_growth(root),
        capture_attention_rate(root),
        *capture_transients(root),
        *baselines(root),
        replay_floor(root),
        capture_floor_27b(root),
        one_command_27b(root),
        replay_transient_27b(root),
        checkpoint_cost_27b(root),
        *replay_against_prefix_grouper(root),
        *replay_against_trl_hybrid(root),
        *members_as_a_schedule(root),
    ]
