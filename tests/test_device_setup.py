"""scripts/device_setup.sh's bring_back_adapter: the function alone (sourcing the script installs wheels), run by
bash on a hand-made result and adapter folder."""

from __future__ import annotations

import json
import re
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_setup.sh"


def bring_back(result: Path, tar: Path, cwd: Path) -> subprocess.CompletedProcess:
    function = re.search(r"^bring_back_adapter\(\) \{\n.*?^\}\n", SCRIPT.read_text(), re.S | re.M)[0]
    return subprocess.run(
        ["bash", "-c", function + 'bring_back_adapter "$1" "$2"', "bash", str(result), str(tar)],
        cwd=cwd,
        capture_output=True,
        text=True,
        check=True,
    )


def test_the_last_kept_stage_comes_back_as_its_folder(tmp_path):
    out = tmp_path / "results/h200/adapters/run"
    for stage in ("stage-0", "stage-1"):
        (out / stage / "adapter").mkdir(parents=True)
        (out / stage / "adapter" / "adapter_model.safetensors").write_bytes(stage.encode())
    stages = [
        {"adapter": {"path": "results/h200/adapters/run/stage-0/adapter"}},
        {"adapter": {"path": "results/h200/adapters/run/stage-1/adapter"}},
        {"skipped": "probe success above the range", "adapter": None},
    ]
    result = tmp_path / "point.json"
    result.write_text(json.dumps({"metrics": {"stages": stages}}))

    done = bring_back(result, tmp_path / "point.adapter.tar", tmp_path)

    with tarfile.open(tmp_path / "point.adapter.tar") as tar:
        names = sorted(tar.getnames())
        weights = tar.extractfile("stage-1/adapter/adapter_model.safetensors").read()
    assert names == ["stage-1", "stage-1/adapter", "stage-1/adapter/adapter_model.safetensors"]
    assert weights == b"stage-1"
    assert "stage-1/adapter ->" in done.stderr


def test_a_point_that_kept_none_brings_nothing(tmp_path):
    for name, record in (("plain", {"metrics": {"rows": []}}), ("untrained", {"metrics": {"stages": [{}]}})):
        result = tmp_path / f"{name}.json"
        result.write_text(json.dumps(record))
        bring_back(result, tmp_path / f"{name}.tar", tmp_path)
        assert not (tmp_path / f"{name}.tar").exists()
