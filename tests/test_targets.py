"""Issue 4's target table from synthetic result files: each verdict follows the stated goal,
and a figure that was not measured is reported as such, never guessed."""

import json
from pathlib import Path

from longstraw.report.targets import evaluate_targets

RATES = {
    "causal_sdpa": {"tflops_per_second": 500.0},
    "flash_forward": {"tflops_per_second": 250.0},
    "flash_backward": {"tflops_per_second": 300.0},
    "gemm": {"tflops_per_second": 800.0},
}


NAIVE_CAPACITY = {"kind": "capacity", "config": {"mode": "naive"}}


def _step(mode, count, peak, replay_seconds=1.0, status="ok", transient=None):
    step = {
        "mode": mode,
        "count": count,
        "status": status,
        "peak_allocated_bytes": peak,
        "phases": {"replay": {"seconds": replay_seconds}},
    }
    return step if transient is None else {**step, "replay_transient_bytes": transient}


def _sweep(positions, transient, steps, rates=RATES, attention_rate=400.0):
    return {
        "status": "ok",
        "kind": "sweep",
        "config": {
            "model": {"preset": "tiny-llama", "overrides": {}, "nf4": False},
            "prompt": {"length": positions + 1},
            "responses": {"length": 64},
            "capture": {"chunk_size": 8192},
        },
        "metrics": {
            "trainable_parameters": 1000,
            "kernel_rates": rates,
            "steps": steps,
            "capture": {
                "positions": positions,
                "resident_bytes": 10**10,
                "transient_bytes": transient,
                "capture_attention": {"tflops_per_second": attention_rate},
            },
        },
    }


def _write(root, relative, result):
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))


def _verdicts(root):
    return {row["target"]: row["met"] for row in evaluate_targets(root)}


def test_verdicts_follow_the_goals(tmp_path):
    _write(
        tmp_path,
        "g_sweep/sweep.json",
        _sweep(
            2_097_151,
            transient=2 * 10**9,
            attention_rate=300.0,  # 20% transient: missed; 60% of SDPA: missed
            steps=[_step("replay", 2, 10**11), _step("replay", 8, 10**11 + 2 * 10**8, replay_seconds=8e3)],
        ),
    )
    _write(
        tmp_path,
        "operating_points/long.json",
        _sweep(4_456_447, transient=5 * 10**8, steps=[_step("replay", 8, 10**11)]),
    )
    _write(
        tmp_path,
        "baselines/mode-naive.json",
        {
            "status": "ok",
            **NAIVE_CAPACITY,
            "metrics": {
                "largest_fitting": 65536,
                "first_failing": 131072,
                "search_stopped_on_time_limit": False,
                "probes": [
                    {"prompt_length": 65536, "status": "ok", "step_phases": {"replay": {"seconds": 60.0}}},
                    {"prompt_length": 131072, "status": "oom", "step_phases": None},
                ],
                "comparison_at_largest_fitting": {
                    "replay": {"status": "ok", "step_phases": {"replay": {"seconds": 20.0}}}
                },
            },
        },
    )
    rows = evaluate_targets(tmp_path)
    verdicts = {row["target"]: row["met"] for row in rows}
    assert verdicts["peak(G=8) - peak(G=2), replay, 2,097,152 positions"] is True  # 0.2%
    assert verdicts["capture attention rate at >= 1,048,576 positions"] is False
    assert verdicts["capture transient at 2,097,151 positions (chunk 8192)"] is False
    assert verdicts["capture transient at 4,456,447 positions (chunk 8192)"] is True
    assert verdicts["largest fitting prompt, replay over naive (hybrid-1b, G=8)"] is True  # 4,456,448 / 131,072 = 34x
    assert (
        verdicts["G=8 step time, naive over replay, at the longest length naive's full step was timed"] is False
    )  # 3x
    assert verdicts["replay time per member at 2,097,152 positions"] is False  # 1000 s per member


PEAK_GROWTH = "peak(G=8) - peak(G=2), replay, 2,097,152 positions"


def test_peak_growth_reads_the_last_g2_step_and_names_a_first_steps_missing_held_memory(tmp_path):
    # cold G=2 (the first step: 4e8 less held when it began), G=8: 0.5% over the cold step's peak, missed and named
    cold, warm, g8 = (
        _step("replay", 2, 10**11, transient=10**10),
        _step("replay", 2, 10**11 + 4 * 10**8, transient=10**10),
        _step("replay", 8, 10**11 + 5 * 10**8, transient=10**10 + 10**8),
    )
    _write(tmp_path, "g_sweep/sweep.json", _sweep(2_097_151, transient=10**8, steps=[cold, g8]))
    row = next(r for r in evaluate_targets(tmp_path) if r["target"] == PEAK_GROWTH)
    assert row["met"] is False and "the G=8 step began holding 0.400 GB more" in row["measured"]
    # with a warm G=2 step after the cold one, the G=8 peak is read against it: 0.1%, met, nothing to name
    _write(tmp_path, "g_sweep/sweep.json", _sweep(2_097_151, transient=10**8, steps=[cold, warm, g8]))
    row = next(r for r in evaluate_targets(tmp_path) if r["target"] == PEAK_GROWTH)
    assert row["met"] is True and row["measured"] == "0.100 GB of 100.500 GB (0.100%)"


def test_unmeasured_figures_are_not_guessed(tmp_path):
    _write(
        tmp_path,
        "baselines/mode-naive.json",
        {
            "status": "ok",
            **NAIVE_CAPACITY,
            "metrics": {
                "largest_fitting": 32768,
                "first_failing": None,
                "search_stopped_on_time_limit": True,
                "probes": [{"prompt_length": 32768, "status": "ok", "step_phases": {"replay": {"seconds": 60.0}}}],
                "comparison_at_largest_fitting": {},
            },
        },
    )
    _write(tmp_path, "operating_points/long.json", _sweep(4_456_447, 10**8, [_step("replay", 8, 10**11)]))
    rows = evaluate_targets(tmp_path)
    assert all(row["met"] is None for row in rows if "transient" not in row["target"])
    capacity = next(r for r in rows if r["target"].startswith("largest fitting"))
    assert "time limit" in capacity["measured"] and "4,456,448" in capacity["measured"]
    assert _verdicts(tmp_path / "nothing-here") == {t: None for t in _verdicts(tmp_path / "nothing-here")}


def test_recorded_h200_results_evaluate():
    rows = evaluate_targets(Path(__file__).resolve().parents[1] / "experiments" / "recorded" / "h200")
    assert len(rows) >= 6 and all(row["goal"] for row in rows)


def test_naive_bracket_takes_one_member_probes_and_oom_step_points(tmp_path):
    # a time-limited search fitted 131,072; a single step point ran out of memory at 327,680
    _write(
        tmp_path,
        "baselines/mode-naive.json",
        {
            "status": "ok",
            **NAIVE_CAPACITY,
            "metrics": {
                "largest_fitting": 131072,
                "first_failing": None,
                "search_stopped_on_time_limit": True,
                "probes": [],
                "comparison_at_largest_fitting": {},
            },
        },
    )
    _write(
        tmp_path,
        "baselines/oom.json",
        {"status": "oom", "kind": "step", "config": {"mode": "naive", "prompt": {"length": 327680}}},
    )
    _write(
        tmp_path,
        "baselines/hold.json",
        {
            "status": "oom",
            "kind": "step",  # another mode: ignored
            "config": {"mode": "hold_all", "prompt": {"length": 200000}},
        },
    )
    _write(tmp_path, "operating_points/long.json", _sweep(2_097_151, 10**8, [_step("replay", 8, 10**11)]))
    capacity = next(r for r in evaluate_targets(tmp_path) if r["target"].startswith("largest fitting"))
    assert capacity["met"] is False  # 2,097,152 / 327,680 = 6.4x
    assert "< 327,680" in capacity["measured"] and "131,072" in capacity["measured"]


def test_27b_one_command_target_needs_both_steps_within_the_command_limit(tmp_path):
    target = "27B shape NF4 at 1,048,576 positions: capture, a G=2 and a G=8 step in one command"
    relative = "architectures/qwen3.6-27b-shape-nf4-1048576.json"
    for status, wall, steps, met in [
        ("ok", 573.0, [_step("replay", 2, 1), _step("replay", 8, 1)], True),
        ("partial", 549.0, [_step("replay", 2, 1)], False),
        ("ok", 640.0, [_step("replay", 2, 1), _step("replay", 8, 1)], False),
    ]:
        _write(tmp_path, relative, {"status": status, "wall_seconds": wall, "metrics": {"steps": steps}})
        assert _verdicts(tmp_path)[target] is met


def _warm(mode, seconds, peak):
    return {
        "status": "ok",
        "kind": "step",
        "config": {"mode": mode},
        "metrics": {
            "peak_allocated_bytes": peak,
            "cycles": [{"phases": {"forward_backward": {"seconds": s}}} for s in seconds],
        },
    }


def test_replay_against_prefix_grouper_reads_cold_and_warm_steps_and_peaks(tmp_path):
    # 8,192: replay warm 1.0 (median of 1.2, 1.0, 0.9) over PrefixGrouper's 2.0 = 0.5x, met; cold 3.0 over 2.5,
    # missed; peak 4 GB over 5 GB, met. 32,768: PrefixGrouper's point has one cycle, so no verdict there
    point = "peers/warm-dense-1b_mode-{}_length-{}_count-8.json"
    _write(tmp_path, point.format("replay", 8192), _warm("replay", [3.0, 1.2, 1.0, 0.9], 4 * 10**9))
    _write(tmp_path, point.format("prefix_grouper", 8192), _warm("prefix_grouper", [2.5, 2.0, 2.0], 5 * 10**9))
    _write(tmp_path, point.format("replay", 32768), _warm("replay", [3.0, 1.0], 4 * 10**9))
    _write(tmp_path, point.format("prefix_grouper", 32768), _warm("prefix_grouper", [2.5], 5 * 10**9))
    rows = {row["target"]: row for row in evaluate_targets(tmp_path)}
    at = "dense-1b, G=8, {:,} positions"
    assert rows[f"replay over PrefixGrouper, warm step, {at.format(8192)}"]["met"] is True
    assert rows[f"replay over PrefixGrouper, warm step, {at.format(8192)}"]["measured"].startswith("0.50x")
    assert rows[f"replay over PrefixGrouper, cold step, {at.format(8192)}"]["met"] is False
    assert rows[f"replay over PrefixGrouper, peak memory, {at.format(8192)}"]["met"] is True
    for what in ("warm step", "cold step", "peak memory"):
        assert rows[f"replay over PrefixGrouper, {what}, {at.format(32768)}"]["met"] is None


def _scheduled(peak, replay_seconds, members):
    return {
        "status": "ok",
        "kind": "step",
        "config": {"mode": "replay"},
        "metrics": {
            "peak_allocated_bytes": peak,
            "cycles": [{"members_replayed": members, "phases": {"replay": {"seconds": s}}} for s in replay_seconds],
        },
    }


def test_the_g_schedule_targets_read_peaks_against_g_and_warm_time_per_member_against_k(tmp_path):
    point = "peers/mb-dense-1b_length-32768_count-{}_k-{}.json"
    peak, time = (
        "peak memory against G (2, 8, 32) at k=2, dense-1b, 32,768 positions",
        "time per member against k (2, 4, 8) at G=8, dense-1b, 32,768 positions",
    )
    for count, gb in ((2, 10.0), (8, 10.2), (32, 10.4)):  # 10.4 / 10.0 = 1.04: flat
        _write(tmp_path, point.format(count, 2), _scheduled(gb * 1e9, [9.0, 0.8, 0.8], count))
    # the cold first cycle is not read: k=4's 9 s there would otherwise put it above k=2
    _write(tmp_path, point.format(8, 4), _scheduled(1e10, [9.0, 0.6], 8))
    _write(tmp_path, point.format(8, 8), _scheduled(1e10, [0.1, 0.4], 8))
    rows = {row["target"]: row for row in evaluate_targets(tmp_path)}
    assert rows[peak]["met"] is True and rows[peak]["measured"].startswith("1.040")
    assert rows[time]["met"] is True and rows[time]["measured"] == "100.0 ms > 75.0 ms > 50.0 ms"
    _write(tmp_path, point.format(32, 2), _scheduled(11e9, [1.0], 32))  # 11 / 10 = 1.1
    _write(tmp_path, point.format(8, 8), _scheduled(1e10, [0.1, 0.7], 8))  # k=8 slower than k=4
    rows = {row["target"]: row for row in evaluate_targets(tmp_path)}
    assert rows[peak]["met"] is False and rows[time]["met"] is False


def test_the_hybrid_trl_targets_read_warm_steps_and_the_boxs_kernel_rates(tmp_path):
    root = tmp_path / "h200"
    point = "peers/warm-hybrid-1b_mode-{}_length-32768_count-2.json"
    config = {
        "mode": "replay",
        "model": {"preset": "hybrid-1b", "overrides": {}},
        "prompt": {"length": 32768},
        "grpo": {"num_generations": 2},
        "responses": {"length": 2048},
    }
    replay = {**_warm("replay", [40.0, 1.0, 1.2], 5e9), "config": config}  # warm: the median of 1.0 and 1.2
    replay["metrics"]["trainable_parameters"] = 10**7
    _write(root, point.format("replay"), replay)
    _write(root, point.format("trl"), _warm("trl", [46.0, 44.0], 4e10))
    speed = "replay over TRL, warm step, hybrid-1b, G=2, 32,768 positions"
    floor = "replay's warm step over its FLOP floor, hybrid-1b, G=2, 32,768 positions"
    rows = {row["target"]: row for row in evaluate_targets(root)}
    assert rows[speed]["met"] is True and rows[speed]["measured"].startswith("40.0x")  # 44 / 1.1
    assert rows[floor]["met"] is None  # no kernel rates beside the points
    # the uncheckpointed variant, faster warm (median of 0.5 and 0.6), decides; a slower one would not
    _write(root, point.format("replay-uncheckpointed"), {**replay, **_warm("replay", [9.0, 0.5, 0.6], 8e9)})
    rows = {row["target"]: row for row in evaluate_targets(root)}
    assert rows[speed]["measured"].startswith("80.0x") and "replay-uncheckpointed" in rows[speed]["measured"]
    _write(root, point.format("replay-uncheckpointed"), {**replay, **_warm("replay", [9.0, 1.5, 1.6], 8e9)})
    rows = {row["target"]: row for row in evaluate_targets(root)}
    assert rows[speed]["measured"].startswith("40.0x")
    rate = {"tflops_per_second": 1e6}  # a million TFLOP/s: a floor of microseconds, so 1.1 s is far above it
    _write(
        tmp_path,
        "h200-benchmarks/kernel_ceilings.json",
        {"attention": {"head_dim_128": {"cudnn_forward": rate, "cudnn_backward": rate}}, "linear": {"gemm": rate}},
    )
    rows = {row["target"]: row for row in evaluate_targets(root)}
    assert rows[floor]["met"] is False and rows[floor]["measured"].endswith("replay-uncheckpointed 1.550 s)")
    # a bf16-adapter variant, faster still, decides the floor (replay's own), not the TRL speed (float32 adapters)
    bf16lora = {**_warm("replay", [9.0, 0.2, 0.3], 8e9), "config": config}
    bf16lora["metrics"]["trainable_parameters"] = 10**7
    _write(root, point.format("replay-uncheckpointed-bf16lora"), bf16lora)
    rows = {row["target"]: row for row in evaluate_targets(root)}
    assert rows[speed]["measured"].startswith("40.0x") and "bf16lora" not in rows[speed]["measured"]
    assert "0.2500 s, replay-uncheckpointed-bf16lora /" in rows[floor]["measured"]


def test_the_27b_checkpoint_cost_target_divides_the_two_points_g2_replay_phases(tmp_path):
    target = "27B shape replay, checkpointed over plain, G=2 x 1,024 at 65,536 positions"
    checkpointed = "architectures/qwen3.6-27b-shape-nf4-65536-replay-checkpointed.json"
    plain = "architectures/qwen3.6-27b-shape-nf4-65536-replay-plain.json"
    _write(tmp_path, checkpointed, {"status": "ok", "metrics": {"steps": [_step("replay", 2, 1, replay_seconds=3.9)]}})
    rows = {row["target"]: row for row in evaluate_targets(tmp_path)}
    assert rows[target]["met"] is None and plain in rows[target]["measured"]  # the plain point missing: said so
    _write(tmp_path, plain, {"status": "ok", "metrics": {"steps": [_step("replay", 2, 1, replay_seconds=3.0)]}})
    rows = {row["target"]: row for row in evaluate_targets(tmp_path)}
    assert rows[target]["met"] is True and rows[target]["measured"].startswith("1.30x")  # 3.9 / 3.0, at the limit
    _write(tmp_path, plain, {"status": "ok", "metrics": {"steps": [_step("replay", 2, 1, replay_seconds=2.5)]}})
    assert _verdicts(tmp_path)[target] is False  # 1.56x
