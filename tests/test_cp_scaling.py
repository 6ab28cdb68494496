"""The CP scaling model (`longstraw.cp.scaling`): its terms by hand, its calibration against the recorded
H200 files it reads, and its held-out 2-rank prediction within the error it states."""

import json
from dataclasses import replace
from pathlib import Path

import pytest

from longstraw.cp import scaling
from longstraw.cp.group import shard_bounds
from longstraw.kinds import sweep
from longstraw.measure.flops import attention_forward_flops

INF = float("inf")
RECORDED = Path(__file__).resolve().parents[1] / "experiments" / "recorded" / "h200"


def _load(relative):
    return json.loads((RECORDED / relative).read_text())


@pytest.fixture(scope="module")
def calibration():
    return scaling.calibrate(RECORDED)


@pytest.fixture(scope="module")
def rows():
    return scaling.table_rows(RECORDED)


def _tiny(layer_types, heads=1, head_dim=1):
    """A shape whose attention FLOPs are 4 x (query, key) pairs and whose other work is what Rates says."""
    return scaling.Shape(
        tuple(layer_types),
        hidden=4,
        intermediate=4,
        heads=heads,
        kv_heads=1,
        head_dim=head_dim,
        k_heads=1,
        v_heads=1,
        k_dim=2,
        v_dim=2,
        conv_kernel=4,
    )


# ---------------------------------------------------------------------------------------- the terms


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8, 32])
def test_causal_shares_by_hand(ranks):
    # the pipeline's last rank does (2N-1)/N^2 of a layer's causal attention, every balanced rank 1/N
    assert scaling.causal_share("pipeline", ranks - 1, ranks) == (2 * ranks - 1) / ranks**2
    assert sum(scaling.causal_share("pipeline", r, ranks) for r in range(ranks)) == pytest.approx(1.0)
    assert scaling.causal_share("balanced", 0, ranks) == 1 / ranks
    assert scaling.causal_share("pipeline", 1, 2) == 3 / 4 and scaling.causal_share("pipeline", 7, 8) == 15 / 64


@pytest.mark.parametrize("ranks", [2, 3, 8])
def test_zigzag_flops_are_exactly_one_nth(ranks):
    shape = scaling.Shape.of("hybrid-1b")
    positions = 2 * ranks * 1000  # chunks of equal length: the pairs split exactly
    chunks = scaling.zigzag_chunks(positions, ranks)
    assert len(chunks) == 2 * ranks and chunks[0][0] == 0 and chunks[-1][1] == positions
    total = shape.attention_flops(positions, 0)
    for r in range(ranks):
        mine = sum(
            shape.attention_flops(chunks[c][1] - chunks[c][0], chunks[c][0]) for c in scaling.balanced_chunks(r, ranks)
        )
        assert mine * ranks == total
    # the pipeline's contiguous shards: rank r's FLOPs tend to (2r+1)/N^2 of the layer
    big = 1 << 20
    for r, (start, end) in enumerate(shard_bounds(big, ranks)):
        share = shape.attention_flops(end - start, start) / shape.attention_flops(big, 0)
        assert share == pytest.approx(scaling.causal_share("pipeline", r, ranks), rel=1e-4)


def test_bytes_moved_per_rank_by_hand():
    shape = scaling.Shape.of("hybrid-1b")
    assert shape.kv_bytes == 2 * 2 * 128 * 2  # K and V, 2 heads of 128, bf16
    assert shape.query_bytes == 8 * 128 * 2
    assert shape.transition_bytes == 32 * 128 * 256 * 4  # [Hv, Dk, Dk + Dv] float32
    assert shape.state_bytes == 25_755_648 // 12  # the recorded RecurrentState bytes over 12 GDN layers
    # pipeline: the last of N ranks receives (N-1)/N of the prompt's K/V per attention layer
    P, N = 2_097_152, 8
    kv = shape.attention_layers * (N - 1) * (P // N) * shape.kv_bytes
    assert scaling.pipeline_received_bytes(shape, P, N, N - 1) == kv + 12 * shape.state_bytes
    assert scaling.pipeline_received_bytes(shape, P, N, 0) == 0
    # balanced, 2 ranks of 4 positions: chunks [0,2) [2,4) [4,6) [6,8); rank 0 computes 0 and 3, owns 0 and 1:
    # chunk 1's queries go out (2), chunk 3's come in (2), outputs back the same; K/V: the other shard's 4
    assert scaling.balanced_layer_bytes(shape, 8, 2, 0, True) == 4 * shape.kv_bytes + 2 * 2 * shape.query_bytes
    # 4 ranks of 2 positions: rank 0 computes chunks 0 (its own) and 7 (rank 3's): one chunk of 1 each way
    assert scaling.balanced_layer_bytes(shape, 8, 4, 0, True) == 3 * 2 * shape.kv_bytes + 2 * 1 * shape.query_bytes
    assert scaling.balanced_layer_bytes(shape, 8, 4, 1, False) == 3 * shape.transition_bytes + shape.conv_bytes
    assert scaling.balanced_layer_bytes(shape, 8, 1, 0, True) == 0


def test_layer_linear_counts_match_the_hf_modules():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from longstraw.models import MODEL_CLASSES, PRESETS, make_config

    for name in ("hybrid-1b", "qwen3.6-27b-shape"):
        config = make_config(name)
        with torch.device("meta"):
            model = getattr(transformers, MODEL_CLASSES[PRESETS[name].model_type][1])(config)
        shape = scaling.Shape.of(name)
        for i, layer in enumerate(model.model.layers):
            linear = [(n, m) for n, m in layer.named_modules() if isinstance(m, torch.nn.Linear)]
            total = sum(m.in_features * m.out_features for _, m in linear)
            mixer = "self_attn" if shape.is_attention(i) else "linear_attn.in_proj"
            repeated = sum(m.in_features * m.out_features for n, m in linear if n.startswith(mixer))
            assert shape.layer_linear(i) == (total, repeated), (name, i)


def test_pipeline_recurrence_by_hand():
    # attention only (c = 0, links infinitely fast), 2 attention layers: a_r = rank r's FLOPs x s
    rates = scaling.Rates(attention_seconds_per_flop=1.0, other_seconds_per_position=0.0)
    free = scaling.Calibration(intra_node_bytes_per_second=INF, inter_node_bytes_per_second=INF)
    shape = _tiny(["full_attention"] * 2)
    for N in (2, 3):
        P = 2 * N
        a = [attention_forward_flops(1, 1, e - s, s) for s, e in shard_bounds(P, N)]
        terms = scaling.pipeline_seconds(shape, rates, P, N, free)
        # 2 ranks: the last waits for rank 0's first layer, then runs its own two;
        # 3 ranks: in the second layer rank 1 forwards only once rank 2 reached it: rank 2 waits a_1 again
        expected = a[0] + 2 * a[1] if N == 2 else a[0] + 2 * a[1] + 2 * a[2]
        assert terms["modelled_seconds"] == expected
        assert terms["attention_seconds"] == 2 * a[-1]
        assert terms["waiting_seconds"] == expected - 2 * a[-1]
        assert terms["communication_seconds"] == 0
    # GDN layers only, equal work per rank: the chain's fill is (N-1) layers, then they run side by side
    rates = scaling.Rates(attention_seconds_per_flop=0.0, other_seconds_per_position=1.0)
    shape = _tiny(["linear_attention"] * 3)
    terms = scaling.pipeline_seconds(shape, rates, 12, 4, free)
    layer = 3 * (1 / 3)  # 3 positions a rank, a third of the linear parameters a layer
    assert terms["modelled_seconds"] == pytest.approx(3 * layer + 3 * layer)
    assert terms["waiting_seconds"] == pytest.approx(3 * layer)


def test_balanced_is_the_slowest_rank_per_layer():
    rates = scaling.Rates(attention_seconds_per_flop=1.0, other_seconds_per_position=1.0)
    free = scaling.Calibration(intra_node_bytes_per_second=INF, inter_node_bytes_per_second=INF)
    shape = _tiny(["linear_attention", "full_attention"])
    P, N = 8, 2
    u = shape.layer_shares()
    total_g, rep_g = shape.layer_linear(0)
    total_a, rep_a = shape.layer_linear(1)
    # GDN: rank 0 (not last) runs the in_proj twice; attention: every rank runs the mixer twice, 1/N of the pairs
    gdn = 4 * u[0] * (1 + rep_g / total_g)
    attention = attention_forward_flops(1, 1, P, 0) / N + 4 * u[1] * (1 + rep_a / total_a)
    terms = scaling.balanced_seconds(shape, rates, P, N, free)
    assert terms["modelled_seconds"] == pytest.approx(gdn + attention)
    assert terms["waiting_seconds"] == pytest.approx(0)
    one = scaling.balanced_seconds(shape, rates, P, 1, free)  # one rank: the single-GPU capture, no repeats
    assert one["modelled_seconds"] == pytest.approx(attention_forward_flops(1, 1, P, 0) + P)


def test_predict_refuses_what_it_does_not_model(calibration):
    with pytest.raises(ValueError, match="schedule"):
        scaling.predict("hybrid-1b", 1024, 2, "ring", calibration)
    with pytest.raises(ValueError, match="qwen3_5"):
        scaling.Shape.of("tiny-llama")
    with pytest.raises(ValueError, match="ranks"):
        scaling.predict("hybrid-1b", 4, 8, "balanced", calibration)


# ---------------------------------------------------------------------------------- the calibration


def test_calibration_comes_from_the_recorded_files(calibration):
    for model, file in scaling.CALIBRATION.items():
        capture = _load(file)["metrics"]["capture"]
        rates = calibration.rates[model]
        assert (
            rates.attention_seconds_per_flop
            == capture["capture_attention"]["seconds"] / capture["capture_attention"]["flops"]
        )
        assert (
            rates.other_seconds_per_position
            == (capture["capture_seconds"] - capture["capture_attention"]["seconds"]) / capture["positions"]
        )
    cp = _load(scaling.CP_CALIBRATION)
    rank0 = cp["metrics"]["capture"]["capture_attention"]
    single = _load(scaling.CALIBRATION["hybrid-1b"])["metrics"]["capture"]["capture_attention"]
    assert calibration.pipeline_attention_efficiency == pytest.approx(
        rank0["tflops_per_second"] / single["tflops_per_second"], rel=1e-12
    )
    assert cp["config"]["cp_size"] == 2 and cp["config"]["model"]["preset"] == "hybrid-1b"


def test_the_calibrated_model_reproduces_its_calibration_points(calibration, rows):
    for model, file in scaling.CALIBRATION.items():
        result = _load(file)
        capture = result["metrics"]["capture"]
        predicted = scaling.predict(model, capture["positions"], 1, "balanced", calibration, prompt=False)
        assert predicted["capture_seconds"] == pytest.approx(capture["capture_seconds"], rel=1e-12)
        assert predicted["attention_seconds"] == pytest.approx(capture["capture_attention"]["seconds"], rel=1e-12)
        assert scaling.predict(model, capture["positions"], 1, "pipeline", calibration, prompt=False)[
            "capture_seconds"
        ] == pytest.approx(capture["capture_seconds"], rel=1e-12)
    cp = _load(scaling.CP_CALIBRATION)
    predicted = scaling.predict("hybrid-1b", cp["config"]["prompt"]["length"], 2, "pipeline", calibration)
    assert predicted["capture_seconds"] == pytest.approx(cp["metrics"]["capture"]["capture_seconds"], rel=1e-12)
    row = next(
        r
        for r in rows
        if r["source"] == "predicted"
        and r["model"] == "hybrid-1b"
        and r["cp_size"] == 2
        and r["schedule"] == "pipeline"
    )
    assert row["capture_seconds"] == pytest.approx(cp["metrics"]["capture"]["capture_seconds"], rel=1e-12)


def test_held_out_two_rank_point_within_the_stated_error():
    """The 2-rank capture predicted from the single-GPU captures alone (nothing of any 2-rank run)."""
    held_out = scaling.calibrate(RECORDED, cp=False)
    assert held_out.pipeline_attention_efficiency == 1.0 and held_out.pipeline_residual == 0.0
    two_rank = [
        (file, schedule) for role, file, _, schedule in scaling.MEASURED if "check" in role and schedule != "one GPU"
    ]
    assert {schedule for _, schedule in two_rank} == {"balanced", "pipeline"}
    for file, schedule in two_rank:
        result = _load(file)
        measured = result["metrics"]["capture"]["capture_seconds"]
        predicted = scaling.predict("hybrid-1b", result["config"]["prompt"]["length"], 2, schedule, held_out)
        assert abs(predicted["capture_seconds"] / measured - 1) <= scaling.STATED_ERROR, file
    checks = {r["point"]: r for r in scaling.checks(RECORDED)}
    # the errors the docs state: the balanced schedule on the calibration's code, the pipeline on older code
    assert checks["context_parallel/positions-2097152"]["relative_error"] == pytest.approx(-0.061, abs=5e-4)
    assert checks["../h200-benchmarks/cp-pipeline-positions-2097152"]["relative_error"] == pytest.approx(
        -0.131, abs=5e-4
    )
    # the single-GPU checks at the other length: within 3% (hybrid-1b) and 16% (the 27B shape)
    assert abs(checks["g_sweep/sweep"]["relative_error"]) < 0.03
    assert abs(checks["architectures/qwen3.6-27b-shape-nf4"]["relative_error"]) < 0.16


# -------------------------------------------------------------------------------------- the table


def test_table_rows(rows):
    measured = [r for r in rows if r["source"] == "measured"]
    predicted = [r for r in rows if r["source"] == "predicted"]
    assert [r["result_file"] for r in measured] == [f for _, f, _, _ in scaling.MEASURED]
    for row in measured:
        result = json.loads((RECORDED / row["result_file"]).read_text())
        capture = result["metrics"].get("capture")
        if capture is not None:
            assert row["capture_seconds"] == capture["capture_seconds"]
        assert row["cp_size"] == (result["config"].get("cp_size") or 1)
    assert {(r["model"], r["prompt_length"], r["cp_size"], r["schedule"]) for r in predicted} == {
        (m, n, k, s) for m, n, k in scaling.PREDICTED for s in scaling.SCHEDULES
    }
    for row in predicted:
        parts = sum(
            row[k]
            for k in (
                "attention_seconds",
                "other_seconds",
                "waiting_seconds",
                "communication_seconds",
                "residual_seconds",
            )
        )
        assert parts == pytest.approx(row["capture_seconds"])
        assert row["waiting_seconds"] >= -1e-9 and row["basis"].startswith("s, c: ")
        assert row["fits_ten_minutes"] == (row["capture_seconds"] <= 600)
    by = {(r["model"], r["prompt_length"], r["cp_size"], r["schedule"]): r for r in predicted}
    # the balanced schedule is faster than the pipeline wherever both are predicted
    for (model, length, ranks, schedule), row in by.items():
        if schedule == "balanced":
            assert row["capture_seconds"] < by[(model, length, ranks, "pipeline")]["capture_seconds"]
    # its attention term is 1/N of the single-GPU attention at the calibrated rate
    calibration = scaling.calibrate(RECORDED)
    shape, rates = scaling.Shape.of("qwen3.6-27b-shape"), calibration.rates["qwen3.6-27b-shape"]
    row = by[("qwen3.6-27b-shape", 2_097_152, 8, "balanced")]
    full = shape.attention_layers * shape.attention_flops(2_097_151, 0) * rates.attention_seconds_per_flop
    assert row["attention_seconds"] == pytest.approx(full / 8, rel=1e-5)


def test_sweep_tables_carry_the_scaling_table_beside_h200_cp_points(rows):
    cp = {**_load(scaling.CP_CALIBRATION), "results_dir": str(RECORDED)}  # as the report loads it
    assert sweep.tables([cp])["cp_scaling"] == rows
    single = {**_load("g_sweep/sweep.json"), "results_dir": str(RECORDED)}
    assert "cp_scaling" not in sweep.tables([single])
    note = sweep.scaling_note(rows)
    assert "(balanced) at 42.7 s against 45.5 s measured (-6.1%, stated error \u00b115%)" in note
    assert "(pipeline) at 58.7 s against 67.6 s measured (-13.1%" in note
    assert sweep.scaling_note([]) == ""


def test_a_bandwidth_changes_only_the_communication_term(calibration):
    slow = replace(calibration, intra_node_bytes_per_second=calibration.intra_node_bytes_per_second / 10)
    fast, slower = (scaling.predict("qwen3.6-27b-shape", 2_097_152, 8, "balanced", c) for c in (calibration, slow))
    assert slower["attention_seconds"] == fast["attention_seconds"]
    assert slower["communication_seconds"] == pytest.approx(10 * fast["communication_seconds"], rel=1e-9)
