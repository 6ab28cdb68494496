"""`benchmarks/point_ab.py`: an A/B of one point's results at several commits, run as the command a reader runs, on
hand-made results whose medians are worked out here."""

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "point_ab.py"


def _result(commit: str, cycles: list[tuple[float, float, float]], device: str = "NVIDIA H100 80GB HBM3") -> dict:
    """A step point's JSON reduced to what the A/B reads: each cycle's (capture, replay, optimizer) seconds."""
    phases = [
        {"capture": {"seconds": c}, "replay": {"seconds": r}, "optimizer_step": {"seconds": o}} for c, r, o in cycles
    ]
    return {
        "point": "warm-x",
        "provenance": {"commit": commit + "0" * 33, "device": device},
        "metrics": {"cycles": [{"phases": p} for p in phases]},
    }


def _run(folder: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), str(folder), *args], capture_output=True, text=True)


def test_warm_cycles_pooled_over_rounds_against_the_base(tmp_path):
    cold = (9.0, 9.0, 9.0)  # each round's first cycle: left out
    rounds = {
        "old_1": _result("aaaaaaa", [cold, (0.16, 0.07, 0.01), (0.20, 0.08, 0.01)]),
        "old_2": _result("aaaaaaa", [cold, (0.17, 0.07, 0.01)]),
        "new_1": _result("bbbbbbb", [cold, (0.15, 0.06, 0.004), (0.15, 0.07, 0.006)]),
    }
    for name, result in rounds.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(result))
    done = _run(tmp_path, "--base", "aaaaaaa")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    old, new = summary["commits"]["aaaaaaa"], summary["commits"]["bbbbbbb"]
    # old's warm steps 0.24, 0.29, 0.25 (median 0.25), captures 0.16, 0.20, 0.17 (0.17); new's 0.214 and 0.226
    assert old["warm_cycles"] == 3 and abs(old["step"] - 0.25) < 1e-12 and abs(old["capture"] - 0.17) < 1e-12
    assert new["warm_cycles"] == 2 and abs(new["step"] - 0.22) < 1e-12
    assert abs(new["difference_from_base"]["step"] - (0.22 - 0.25)) < 1e-12
    assert abs(new["difference_from_base"]["replay"] - (0.065 - 0.07)) < 1e-12
    assert abs(new["difference_from_base"]["optimizer_step"] - (0.005 - 0.01)) < 1e-12


def test_a_variant_of_a_commit_is_compared_as_one_of_its_own(tmp_path):
    """A result whose provenance names a variant (LONGSTRAW_VARIANT: a setting's default changed on the box) pools
    apart from its commit's plain results, as commit+variant, and can be the base."""
    plain = _result("aaaaaaa", [(9.0, 9.0, 9.0), (0.16, 0.07, 0.01)])
    changed = _result("aaaaaaa", [(9.0, 9.0, 9.0), (0.16, 0.05, 0.01)])
    changed["provenance"]["variant"] = "dq"
    (tmp_path / "plain.json").write_text(json.dumps(plain))
    (tmp_path / "changed.json").write_text(json.dumps(changed))
    done = _run(tmp_path, "--base", "aaaaaaa+dq")
    assert done.returncode == 0, done.stderr
    commits = json.loads(done.stdout.strip().splitlines()[-1])["commits"]
    assert set(commits) == {"aaaaaaa", "aaaaaaa+dq"}
    assert abs(commits["aaaaaaa"]["difference_from_base"]["replay"] - 0.02) < 1e-12


def test_results_from_two_devices_are_refused(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(_result("aaaaaaa", [(1, 1, 1), (0.1, 0.1, 0.1)])))
    (tmp_path / "b.json").write_text(json.dumps(_result("bbbbbbb", [(1, 1, 1), (0.1, 0.1, 0.1)], "NVIDIA H200")))
    done = _run(tmp_path)
    assert done.returncode != 0 and "mixes devices" in done.stderr
