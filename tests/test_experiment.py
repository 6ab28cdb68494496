"""Experiment points and the CLI: statuses, provenance, atomic result files, clear config errors."""

import dataclasses
import json

import pytest
import torch

from longstraw import cli, kinds
from longstraw.harness import runner
from longstraw.kinds.common import Progress

POINT = {
    "name": "tiny",
    "kind": "step",
    "model": {"preset": "tiny-llama"},
    "prompt": {"length": 40},
    "grpo": {"num_generations": 2},
    "responses": {"length": 5},
    "capture": {"chunk_size": 16},
    "cycles": 2,
}


def test_step_point_reuses_one_capture_across_cycles_and_reports_each(capsys):
    partials = []
    result = runner.run_point(POINT, on_progress=partials.append)
    assert result["status"] == "ok", result.get("error")
    cycles = result["metrics"]["cycles"]
    assert len(cycles) == 2
    assert "capture" in cycles[0]["phases"] and "capture" not in cycles[1]["phases"]
    # each finished step is said (its phases' seconds) and left as the partial result a cut-off run keeps
    assert [p["status"] for p in partials] == ["partial", "partial"]
    assert [p["metrics"]["cycles"] for p in partials] == [cycles[:1], cycles]
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(("set up", "cycle "))]
    assert lines[0].startswith("set up (weights ") and len(lines) == 3
    assert lines[1].startswith(f"cycle 0: capture {cycles[0]['phases']['capture']['seconds']:.3f} s, ")
    assert lines[2].startswith("cycle 1: ") and f"replay {cycles[1]['phases']['replay']['seconds']:.3f} s" in lines[2]
    assert all(c["state_unchanged"] for c in cycles)
    assert {"commit", "device", "host_cpu", "date", "versions"} <= set(result["provenance"])


def test_capture_point_reports_resident_bytes_against_prediction():
    result = runner.run_point({**POINT, "kind": "capture"})
    m = result["metrics"]
    assert result["status"] == "ok" and m["positions"] == 39
    assert m["resident_bytes"] == m["predicted_resident_bytes"]


def _with_run(monkeypatch, name: str, run) -> None:
    """The registered kind `name` runs `run` instead, for one test."""
    monkeypatch.setitem(kinds._KINDS, name, dataclasses.replace(kinds.get(name), run=run))


def test_out_of_memory_is_recorded_as_a_point(monkeypatch):
    def exhausted(cfg, device, progress):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    _with_run(monkeypatch, "step", exhausted)
    result = runner.run_point(POINT)
    assert result["status"] == "oom" and "out of memory" in result["error"]


def test_cli_writes_result_and_exits_by_status(tmp_path):
    spec = tmp_path / "point.yaml"
    spec.write_text(json.dumps(POINT))  # JSON is valid YAML
    out = tmp_path / "out" / "result.json"
    assert cli.main(["run", str(spec), "--out", str(out), "--set", "mode=hold_all"]) == 0
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and result["config"]["mode"] == "hold_all"
    assert list(out.parent.iterdir()) == [out]  # no temp files left behind
    out.unlink()
    assert (
        cli.main(["run", str(spec), "--out", str(out), "--set", "model.preset=tiny-gpt5"]) == 2
    )  # refused: nothing ran
    assert not out.exists()


def test_cli_rejects_unknown_keys_before_running(tmp_path, capsys):
    spec = tmp_path / "bad.yaml"
    spec.write_text("model: {preset: tiny-llama}\nrepsonses: {count: 2}\n")
    assert cli.main(["run", str(spec), "--out", str(tmp_path / "r.json")]) == 2
    assert "repsonses: unknown key" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


SWEEP = {**POINT, "kind": "sweep", "sweep": {"replay": [1, 2], "hold_all": [2, 4]}, "cycles": 1}


def test_sweep_serves_every_step_from_one_capture_and_reports_progress():
    partials = []
    result = runner.run_point(
        SWEEP, on_progress=lambda p: partials.append([(s["mode"], s["count"]) for s in p["metrics"]["steps"]])
    )
    assert result["status"] == "ok", result.get("error")
    m = result["metrics"]
    assert [(s["mode"], s["count"], s["status"]) for s in m["steps"]] == [
        ("replay", 1, "ok"),
        ("replay", 2, "ok"),
        ("hold_all", 2, "ok"),
        ("hold_all", 4, "ok"),
    ]
    assert all("capture" not in s["phases"] for s in m["steps"])  # the sweep's one capture served them all
    assert m["capture"]["resident_bytes"] == m["capture"]["predicted_resident_bytes"]
    assert all(s["state_unchanged"] for s in m["steps"])
    graph = {(s["mode"], s["count"]): s["graph_bytes_peak"] for s in m["steps"]}
    assert graph[("replay", 2)] == pytest.approx(graph[("replay", 1)], rel=0.01)  # one member's graph at a time
    assert graph[("hold_all", 4)] > 1.9 * graph[("hold_all", 2)]  # all G graphs alive
    assert partials[0] == [] and partials[-1] == [(s["mode"], s["count"]) for s in m["steps"]]


def test_sweep_mode_stops_at_its_first_out_of_memory_step(monkeypatch):
    from longstraw.core import step as core_step

    real = core_step.grpo_step  # what the sweep's steps call

    def limited(model, prompt, responses, rewards, optimizer, config, options, **kwargs):
        if options.mode == "hold_all" and len(responses) >= 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, prompt, responses, rewards, optimizer, config, options, **kwargs)

    monkeypatch.setattr(core_step, "grpo_step", limited)
    result = runner.run_point({**SWEEP, "sweep": {"replay": [1], "hold_all": [1, 2, 4]}})
    assert [(s["mode"], s["count"], s["status"]) for s in result["metrics"]["steps"]] == [
        ("replay", 1, "ok"),
        ("hold_all", 1, "ok"),
        ("hold_all", 2, "oom"),
    ]
    assert result["status"] == "ok"


def test_cli_keeps_a_partial_file_only_while_a_sweep_runs(tmp_path, monkeypatch):
    spec, out = tmp_path / "sweep.yaml", tmp_path / "result.json"
    spec.write_text(json.dumps({**SWEEP, "sweep": {"replay": [2], "hold_all": []}}))
    seen = []
    real = kinds.get("sweep").run

    def watching(cfg, device, progress):
        def partial(metrics):
            progress.partial(metrics)
            seen.append(json.loads((tmp_path / "result.json.partial").read_text())["status"])

        return real(cfg, device, Progress(partial))

    _with_run(monkeypatch, "sweep", watching)
    assert cli.main(["run", str(spec), "--out", str(out)]) == 0
    assert seen == ["partial", "partial"]
    assert json.loads(out.read_text())["status"] == "ok"
    assert not (tmp_path / "result.json.partial").exists()


def test_naive_steps_run_hfs_torch_gdn_kernel_in_forward_and_backward(monkeypatch):
    """Where fla is installed, HF binds its GDN kernel, whose backward fails on Hopper; the naive
    baseline swaps in HF's plain torch kernel for its whole step (scoped, not process-wide)."""
    import sys

    from longstraw.config import GRPOConfig
    from longstraw.core.step import StepOptions, grpo_step
    from longstraw.models import build_model

    model = build_model("tiny-qwen3_5")
    modeling = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    plain = getattr(modeling.torch_chunk_gated_delta_rule, "__wrapped__", modeling.torch_chunk_gated_delta_rule)

    def fla_like(*args, **kwargs):  # a hub kernel HF would call instead of its own
        raise RuntimeError("fla's chunk kernel was called")

    fla_like.__wrapped__ = plain
    monkeypatch.setattr(modeling, "torch_chunk_gated_delta_rule", fla_like)
    prompt = torch.randint(0, 256, (24,))
    with pytest.raises(RuntimeError, match="fla's chunk kernel"):  # HF's own forward takes the bound kernel
        model(input_ids=prompt[None])
    responses = [torch.randint(0, 256, (4,)) for _ in range(2)]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    step = grpo_step(
        model, prompt, responses, [0.0, 1.0], optimizer, GRPOConfig(num_generations=2), StepOptions(mode="naive")
    )
    assert step.metrics["grad_norm"] > 0 and step.state is None
    assert modeling.torch_chunk_gated_delta_rule is fla_like  # restored after the step
