"""scripts/device_setup.sh's bring_back_adapter, bring_back_work and take_up_work: each function alone (sourcing the
script installs wheels), run by bash on hand-made results, work folders and adapter folders."""

from __future__ import annotations

import json
import os
import re
import subprocess
import tarfile
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_setup.sh"


def shell(name: str, args: list, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    """`name "$@"` with the script's function of that name defined, in `cwd`."""
    function = re.search(rf"^{name}\(\) \{{\n.*?^\}}\n", SCRIPT.read_text(), re.S | re.M)[0]
    return subprocess.run(
        ["bash", "-c", function + f'{name} "$@"', "bash", *map(str, args)],
        cwd=cwd,
        env=None if env is None else {**os.environ, **env},
        capture_output=True,
        text=True,
        check=True,
    )


def bring_back(result: Path, tar: Path, cwd: Path) -> subprocess.CompletedProcess:
    return shell("bring_back_adapter", [result, tar], cwd)


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


def test_a_work_folder_comes_back_with_each_runs_newest_checkpoint_and_is_taken_up_on_another_box(tmp_path):
    """A curriculum cut off in stage 1: stage 0 finished (its record, its runs' checkpoints at 5 and 10, the carried
    model kept in the tree's `out`), stage 1's runs at 5 and a torn 10. What comes back: stage 0's newest adapters
    without their optimizer state, stage 1's newest whole checkpoints, the records, and `out`; taken up on a fresh
    box (its own TMPDIR and tree) they land where device_points and the stage records look."""
    box, fresh = tmp_path / "box", tmp_path / "fresh"
    work = box / "tmp" / "device_points" / "learning" / "learning__c.json.work"
    files = {"stage-0/stage.json": "{}", "stage-0/probe.json": "{}", "stage-1/probe.json": "{}"}
    for stage, steps in (("stage-0", ["step-5", "step-10"]), ("stage-1", ["step-5", "step-10.tmp"])):
        for run in ("response-only", "untrained"):
            for step in steps:
                for leaf in ("adapter/model.safetensors", "trainer.pt"):
                    files[f"{stage}/{run}/checkpoints/{step}/{leaf}"] = f"{stage} {run} {step} {leaf}"
            files[f"{stage}/{run}/train.jsonl"] = run
    for name, text in files.items():
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        (work / name).write_text(text)
    kept = box / "tree" / "results" / "out" / "stage-0" / "model" / "model.safetensors"
    kept.parent.mkdir(parents=True)
    kept.write_text("kept")
    out = tmp_path / "returned"
    out.mkdir()
    env = {"TMPDIR": str(box / "tmp"), "OUT": str(out)}

    shell("bring_back_work", ["learning", "c", "results/out"], box / "tree", env)

    with tarfile.open(out / "learning__c.work.tgz") as tar:
        names = sorted(m.name for m in tar.getmembers() if m.isfile())
    newest = [
        *(f"stage-0/{run}/checkpoints/step-10/adapter/model.safetensors" for run in ("response-only", "untrained")),
        *(
            f"stage-1/{run}/checkpoints/step-5/{leaf}"
            for run in ("response-only", "untrained")
            for leaf in ("adapter/model.safetensors", "trainer.pt")
        ),
    ]
    records = [
        "stage-0/probe.json",
        "stage-0/response-only/train.jsonl",
        "stage-0/stage.json",
        "stage-0/untrained/train.jsonl",
        "stage-1/probe.json",
        "stage-1/response-only/train.jsonl",
        "stage-1/untrained/train.jsonl",
    ]
    assert names == sorted(
        [f"learning__c.json.work/{n}" for n in newest + records] + ["results/out/stage-0/model/model.safetensors"]
    )

    (fresh / "tree" / "results" / "out").mkdir(parents=True)
    taken = shell(
        "take_up_work", ["learning", "c", out / "learning__c.work.tgz"], fresh / "tree", {"TMPDIR": str(fresh / "tmp")}
    )
    landed = fresh / "tmp" / "device_points" / "learning" / "learning__c.json.work"
    assert sorted(str(p.relative_to(landed)) for p in landed.rglob("*") if p.is_file()) == sorted(newest + records)
    for name in newest + records:
        assert (landed / name).read_text() == files[name]
    assert (fresh / "tree" / "results/out/stage-0/model/model.safetensors").read_text() == "kept"
    assert "take_up_work: learning__c's work" in taken.stderr

    # a box that already has the work folder (the same box, a later call) keeps its own
    (landed / "stage-1" / "probe.json").write_text("newer")
    shell(
        "take_up_work", ["learning", "c", out / "learning__c.work.tgz"], fresh / "tree", {"TMPDIR": str(fresh / "tmp")}
    )
    assert (landed / "stage-1" / "probe.json").read_text() == "newer"
