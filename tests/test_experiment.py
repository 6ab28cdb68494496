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
