"""Every configuration of the package's Triton kernels builds for the H200 (sm_90) on this CPU: `benchmarks/
triton_build_report.py` run as a reader runs it (Triton compiles to PTX, its bundled ptxas to a cubin, no GPU or
driver needed). The interpreter tests (`test_triton_interpreted.py`) check the kernels' arithmetic but not their
compilation: a jitted function reading a plain module global, for one, runs interpreted and fails to compile."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "triton_build_report.py"

pytestmark = pytest.mark.slow  # ~25 s: every configuration of every kernel


def test_every_kernel_configuration_builds_for_sm_90(tmp_path):
    triton = pytest.importorskip("triton")
    if not (Path(triton.__file__).parent / "backends/nvidia/bin/ptxas").exists():
        pytest.skip("this Triton has no bundled ptxas")
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from triton_build_report import KERNELS
    finally:
        sys.path.remove(str(SCRIPT.parent))
    out = tmp_path / "report.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    built = json.loads(out.read_text())["kernels"]
    assert set(built) == set(KERNELS)
    for name, rows in built.items():
        assert len(rows) == len(KERNELS[name].configs), name
        assert all(row["registers"] > 0 and row["sass_instructions"] > 0 for row in rows), name
