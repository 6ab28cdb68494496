"""Experiment points and the CLI: statuses, provenance, atomic result files, clear config errors."""

import json

import pytest
import torch

from longstraw import cli, experiment

POINT = {"name": "tiny", "kind": "step", "model": {"preset": "tiny-llama"}, "prompt": {"length": 40},
         "responses": {"count": 2, "length": 5}, "capture": {"chunk_size": 16}, "cycles": 2}


def test_step_point_reuses_one_capture_across_cycles():
    result = experiment.run_point(POINT)
    assert result["status"] == "ok", result.get("error")
    cycles = result["metrics"]["cycles"]
    assert len(cycles) == 2
    assert "capture" in cycles[0]["phases"] and "capture" not in cycles[1]["phases"]
    assert all(c["state_unchanged"] for c in cycles)
    assert {"commit", "device", "date", "versions"} <= set(result["provenance"])


def test_capture_point_reports_resident_bytes_against_prediction():
    result = experiment.run_point({**POINT, "kind": "capture"})
    m = result["metrics"]
    assert result["status"] == "ok" and m["positions"] == 39
    assert m["resident_bytes"] == m["predicted_resident_bytes"]


def test_out_of_memory_is_recorded_as_a_point(monkeypatch):
    def exhausted(cfg, device):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(experiment, "_run_step", exhausted)
    result = experiment.run_point(POINT)
    assert result["status"] == "oom" and "out of memory" in result["error"]


def test_cli_writes_result_and_exits_by_status(tmp_path):
    spec = tmp_path / "point.yaml"
    spec.write_text(json.dumps(POINT))  # JSON is valid YAML
    out = tmp_path / "out" / "result.json"
    assert cli.main(["run", str(spec), "--out", str(out), "--set", "mode=hold_all"]) == 0
    result = json.loads(out.read_text())
    assert result["status"] == "ok" and result["config"]["mode"] == "hold_all"
    assert list(out.parent.iterdir()) == [out]  # no temp files left behind
    assert cli.main(["run", str(spec), "--out", str(out), "--set", "model.preset=tiny-gpt5"]) == 1
    assert "unknown model preset" in json.loads(out.read_text())["error"]


def test_cli_rejects_unknown_keys_before_running(tmp_path, capsys):
    spec = tmp_path / "bad.yaml"
    spec.write_text("model: {preset: tiny-llama}\nrepsonses: {count: 2}\n")
    assert cli.main(["run", str(spec), "--out", str(tmp_path / "r.json")]) == 2
    assert "unknown key 'repsonses'" in capsys.readouterr().err
    assert not (tmp_path / "r.json").exists()


SWEEP = {**POINT, "kind": "sweep", "sweep": {"replay": [1, 2], "hold_all": [2, 4]}, "cycles": 1}


def test_sweep_serves_every_step_from_one_capture_and_reports_progress():
    partials = []
    result = experiment.run_point(SWEEP, on_progress=lambda p: partials.append(
        [(s["mode"], s["count"]) for s in p["metrics"]["steps"]]))
    assert result["status"] == "ok", result.get("error")
    m = result["metrics"]
    assert [(s["mode"], s["count"], s["status"]) for s in m["steps"]] == [
        ("replay", 1, "ok"), ("replay", 2, "ok"), ("hold_all", 2, "ok"), ("hold_all", 4, "ok")]
    assert all("capture" not in s["phases"] for s in m["steps"])  # the sweep's one capture served them all
    assert m["capture"]["resident_bytes"] == m["capture"]["predicted_resident_bytes"]
    assert all(s["state_unchanged"] for s in m["steps"])
    graph = {(s["mode"], s["count"]): s["graph_bytes_peak"] for s in m["steps"]}
    assert graph[("replay", 2)] == pytest.approx(graph[("replay", 1)], rel=0.01)  # one member's graph at a time
    assert graph[("hold_all", 4)] > 1.9 * graph[("hold_all", 2)]  # all G graphs alive
    assert partials[0] == [] and partials[-1] == [(s["mode"], s["count"]) for s in m["steps"]]


def test_sweep_mode_stops_at_its_first_out_of_memory_step(monkeypatch):
    from longstraw import step as step_module

    real = step_module.grpo_step

    def limited(model, prompt, responses, *args, mode, **kwargs):
        if mode == "hold_all" and len(responses) >= 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(model, prompt, responses, *args, mode=mode, **kwargs)

    monkeypatch.setattr(step_module, "grpo_step", limited)
    result = experiment.run_point({**SWEEP, "sweep": {"replay": [1], "hold_all": [1, 2, 4]}})
    assert [(s["mode"], s["count"], s["status"]) for s in result["metrics"]["steps"]] == [
        ("replay", 1, "ok"), ("hold_all", 1, "ok"), ("hold_all", 2, "oom")]
    assert result["status"] == "ok"


def test_cli_keeps_a_partial_file_only_while_a_sweep_runs(tmp_path, monkeypatch):
    spec, out = tmp_path / "sweep.yaml", tmp_path / "result.json"
    spec.write_text(json.dumps({**SWEEP, "sweep": {"replay": [1], "hold_all": []}}))
    seen = []
    real = experiment._run_sweep

    def watching(cfg, device, on_progress):
        def progress(metrics):
            on_progress(metrics)
            seen.append(json.loads((tmp_path / "result.json.partial").read_text())["status"])
        return real(cfg, device, progress)

    monkeypatch.setattr(experiment, "_run_sweep", watching)
    assert cli.main(["run", str(spec), "--out", str(out)]) == 0
    assert seen == ["partial", "partial"]
    assert json.loads(out.read_text())["status"] == "ok"
    assert not (tmp_path / "result.json.partial").exists()


def test_naive_on_cuda_hides_fla_from_transformers(monkeypatch):
    import subprocess
    import sys
    import types

    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    with pytest.raises(RuntimeError, match="fresh process"):
        experiment.use_hf_torch_gdn()
    code = ("import sys; from longstraw.experiment import use_hf_torch_gdn; use_hf_torch_gdn()\n"
            "try:\n    import fla\nexcept ImportError:\n    print('hidden')\n")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "hidden"
