"""Issue 4's target table from synthetic result files: each verdict follows the stated goal,
and a figure that was not measured is reported as such, never guessed."""

import json
from pathlib import Path

from longstraw.report.targets import evaluate_targets

RATES = {"causal_sdpa": {"tflops_per_second": 500.0}, "flash_forward": {"tflops_per_second": 250.0},
         "flash_backward": {"tflops_per_second": 300.0}, "gemm": {"tflops_per_second": 800.0}}


def _step(mode, count, peak, replay_seconds=1.0, status="ok"):
    return {"mode": mode, "count": count, "status": status, "peak_allocated_bytes": peak,
            "phases": {"replay": {"seconds": replay_seconds}}}


def _sweep(positions, transient, steps, rates=RATES, attention_rate=400.0):
    return {"status": "ok", "kind": "sweep",
            "config": {"model": {"preset": "tiny-llama", "overrides": {}, "nf4": False},
                       "prompt": {"length": positions + 1}, "responses": {"length": 64},
                       "capture": {"chunk_size": 8192}},
            "metrics": {"trainable_parameters": 1000, "kernel_rates": rates, "steps": steps,
                        "capture": {"positions": positions, "resident_bytes": 10**10, "transient_bytes": transient,
                                    "capture_attention": {"tflops_per_second": attention_rate}}}}


def _write(root, relative, result):
    path = root / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result))


def _verdicts(root):
    return {row["target"]: row["met"] for row in evaluate_targets(root)}


def test_verdicts_follow_the_goals(tmp_path):
    _write(tmp_path, "g_sweep/sweep.json", _sweep(
        2_097_151, transient=2 * 10**9, attention_rate=300.0,  # 20% transient: missed; 60% of SDPA: missed
        steps=[_step("replay", 2, 10**11), _step("replay", 8, 10**11 + 2 * 10**8, replay_seconds=8e3)]))
    _write(tmp_path, "operating_points/long.json", _sweep(4_456_447, transient=5 * 10**8,
                                                          steps=[_step("replay", 8, 10**11)]))
    _write(tmp_path, "baselines/mode-naive.json", {"status": "ok", "metrics": {
        "largest_fitting": 65536, "first_failing": 131072, "search_stopped_on_time_limit": False,
        "probes": [{"prompt_length": 65536, "status": "ok", "step_phases": {"replay": {"seconds": 60.0}}},
                   {"prompt_length": 131072, "status": "oom", "step_phases": None}],
        "comparison_at_largest_fitting": {"replay": {"status": "ok", "step_phases": {"replay": {"seconds": 20.0}}}}}})
    rows = evaluate_targets(tmp_path)
    verdicts = {row["target"]: row["met"] for row in rows}
    assert verdicts["peak(G=8) - peak(G=2), replay, 2,097,152 positions"] is True  # 0.2%
    assert verdicts["capture attention rate at >= 1,048,576 positions"] is False
    assert verdicts["capture transient at 2,097,151 positions (chunk 8192)"] is False
    assert verdicts["capture transient at 4,456,447 positions (chunk 8192)"] is True
    assert verdicts["largest fitting prompt, replay over naive (hybrid-1b, G=8)"] is True  # 4,456,448 / 131,072 = 34x
    assert verdicts["G=8 step time at naive's largest fitting length, naive over replay"] is False  # 3x
    assert verdicts["replay time per member at 2,097,152 positions"] is False  # 1000 s per member


def test_unmeasured_figures_are_not_guessed(tmp_path):
    _write(tmp_path, "baselines/mode-naive.json", {"status": "ok", "metrics": {
        "largest_fitting": 32768, "first_failing": None, "search_stopped_on_time_limit": True,
        "probes": [{"prompt_length": 32768, "status": "ok", "step_phases": {"replay": {"seconds": 60.0}}}],
        "comparison_at_largest_fitting": {}}})
    _write(tmp_path, "operating_points/long.json", _sweep(4_456_447, 10**8, [_step("replay", 8, 10**11)]))
    rows = evaluate_targets(tmp_path)
    assert all(row["met"] is None for row in rows if "transient" not in row["target"])
    capacity = next(r for r in rows if r["target"].startswith("largest fitting"))
    assert "time limit" in capacity["measured"] and "4,456,448" in capacity["measured"]
    assert _verdicts(tmp_path / "nothing-here") == {t: None for t in _verdicts(tmp_path / "nothing-here")}


def test_recorded_h200_results_evaluate():
    rows = evaluate_targets(Path(__file__).resolve().parents[1] / "experiments" / "recorded" / "h200")
    assert len(rows) >= 6 and all(row["goal"] for row in rows)
