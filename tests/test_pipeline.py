"""The Snakemake workflow end to end on a tiny experiment set in a temporary directory.

Runs the real Snakefile (copied with workflow/, config/ and profiles/) on two tiny experiments, one
point of which fails on purpose; then checks the graph (points -> tables -> figures -> report, no
point file read past the tables), the report, the tables against the result JSONs, resumption
after an interruption, parse-time rejection of a malformed experiment, `snakemake --lint`, the
conda environment against pyproject.toml, and renders the report in headless Chromium.
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pandas as pd
import pytest
import yaml
from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow

STEP = """
name: tiny_steps
title: Tiny steps
kind: step
base: {grpo: {beta: 0.04}}
profiles:
  cpu:
    base:
      model: {preset: tiny-llama}
      prompt: {length: 48}
      responses: {length: 6}
      grpo: {num_generations: 2}
      capture: {chunk_size: 16}
    grid: {mode: [replay, hold_all]}
    points:
      - {name: broken, set: {model.overrides: {hidden_act: not_an_activation}}}  # fails only once the model is built
"""
CAPTURE = """
name: tiny_capture
title: Tiny capture
kind: capture
profiles:
  cpu:
    base: {prompt: {length: 48}, responses: {length: 6}, capture: {chunk_size: 16}}
    grid: {model.preset: [tiny-qwen3, tiny-qwen3_5]}
"""


def _snakemake(workdir, *args, **kwargs):
    return subprocess.run(
        [sys.executable, "-m", "snakemake", "--cores", "2", *args],
        cwd=workdir,
        capture_output=True,
        text=True,
        **kwargs,
    )


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("pipeline")
    for top in ("Snakefile", "environment.yml"):  # the rules name the conda environment: snakemake reads it
        shutil.copy(REPO / top, root)
    for folder in ("workflow", "config", "profiles"):
        shutil.copytree(REPO / folder, root / folder)
    experiments = root / "experiments"
    (experiments / "recorded" / "h200").mkdir(parents=True)
    (experiments / "tiny_steps.yaml").write_text(STEP)
    (experiments / "tiny_capture.yaml").write_text(CAPTURE)
    for recorded in (REPO / "experiments" / "recorded" / "h200").glob("*.json"):
        shutil.copy(recorded, experiments / "recorded" / "h200")
    return root


@pytest.fixture(scope="module")
def completed(workdir):
    """Interrupt a first run while its second point runs (the first one done), then rerun."""
    points, logs = workdir / "results" / "cpu" / "points", workdir / "logs" / "cpu" / "points"
    # SIGINT back to its default: a test run started in the background by a non-interactive shell
    # inherits it ignored, and snakemake would then finish every point despite the Ctrl-C
    first = subprocess.Popen(
        [sys.executable, "-m", "snakemake", "--cores", "1"],
        cwd=workdir,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.time() + 240
    while time.time() < deadline and len(list(logs.rglob("*.log"))) < 2:
        assert first.poll() is None, "the first run ended before its second point started"
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGINT)
    first.wait(timeout=60)
    done_before = {p: p.stat().st_mtime_ns for p in points.rglob("*.json")}
    assert 0 < len(done_before) < 5, "the interruption should leave some points done and some missing"
    planned = _snakemake(workdir, "-n")
    assert planned.returncode == 0, planned.stdout[-3000:] + planned.stderr
    rerun = _snakemake(workdir)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    return {"done_before": done_before, "planned": planned.stdout + planned.stderr}


def test_the_graph_is_points_tables_figures_report(workdir):
    """Each rule reads the one before: points only feed the tables; the figures and the report read
    tables (the recorded results' too); the profile's report links the recorded report."""
    graph = _snakemake(workdir, "--rulegraph")
    assert graph.returncode == 0, graph.stderr
    names = dict(re.findall(r'(\d+)\[label = "(\w+)"', graph.stdout))
    edges = {(names[a], names[b]) for a, b in re.findall(r"(\d+) -> (\d+)", graph.stdout)}
    assert edges == {
        ("point", "tables"),
        ("tables", "figures"),
        ("tables_recorded", "figures"),
        ("tables", "report"),
        ("tables_recorded", "report"),
        ("figures", "report"),
        ("report", "report"),
        ("report", "all"),
    }


def test_lint_is_clean(workdir):
    lint = _snakemake(workdir, "--lint")
    assert lint.returncode == 0 and "Congratulations, your workflow is in a good condition!" in lint.stderr, (
        lint.stdout + lint.stderr
    )[-3000:]


def test_conda_environment_matches_pyproject():
    """environment.yml pins every dependency of pyproject.toml (tests and peers included) within its range,
    names the same range where it pins none, and nothing else (the rules import the checkout itself)."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = {
        r.name: r
        for r in map(Requirement, project["dependencies"] + extras["test"] + extras["peers"])
        if r.name != project["name"]
    }  # `longstraw[peers]` in the test extra: the peers, listed above
    env = yaml.safe_load((REPO / "environment.yml").read_text())["dependencies"]
    python = next(d for d in env if isinstance(d, str) and d.startswith("python="))
    assert Requirement(f"python{project['requires-python']}").specifier.contains(python.split("=", 1)[1])
    pip = next(d["pip"] for d in env if isinstance(d, dict))
    pinned = {r.name: r for r in map(Requirement, pip)}
    assert set(pinned) == set(wanted)
    for name, requirement in pinned.items():
        (spec, *more) = requirement.specifier
        if spec.operator == "==" and not more:
            assert wanted[name].specifier.contains(spec.version, prereleases=True), name
        else:
            assert requirement.specifier == wanted[name].specifier, name


def test_rerun_redoes_only_missing_points(workdir, completed):
    planned_points = int(
        next(line.split()[1] for line in completed["planned"].splitlines() if line.startswith("point "))
    )
    assert planned_points == 5 - len(completed["done_before"])
    for path, mtime in completed["done_before"].items():
        assert path.stat().st_mtime_ns == mtime


def test_failing_point_is_recorded_and_reported(workdir, completed):
    broken = json.loads((workdir / "results/cpu/points/tiny_steps/broken.json").read_text())
    assert broken["status"] == "error" and broken["error"]
    html = (workdir / "reports/cpu/index.html").read_text()
    assert "broken" in html and "error" in html


def test_report_has_every_section_and_valid_images(workdir, completed):
    html = (workdir / "reports/cpu/index.html").read_text()
    for heading in ("Tiny steps", "Tiny capture", "Validation", "paper", "Recorded"):
        assert heading.lower() in html.lower(), heading
    images = [p for p in (workdir / "reports/cpu").rglob("*.png")]
    assert images
    for image in images:
        assert image.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert image.relative_to(workdir / "reports/cpu").as_posix() in html
    listed = json.loads((workdir / "reports/cpu/figures/manifest.json").read_text())["figures"]
    assert sorted(f["file"] for f in listed) == sorted(p.name for p in images)
    # the tables beside the page are the tables stage's, and the recorded results have their own report
    manifest = json.loads((workdir / "results/cpu/tables/manifest.json").read_text())
    for entry in manifest["tables"].values():
        assert (workdir / "reports/cpu/tables" / entry["file"]).read_bytes() == (
            workdir / "results/cpu/tables" / entry["file"]
        ).read_bytes()
    assert 'href="../recorded-h200/index.html"' in html
    assert (workdir / "reports/recorded-h200/index.html").is_file()


def test_tables_equal_result_files(workdir, completed):
    for experiment in ("tiny_steps", "tiny_capture"):
        table = pd.read_csv(workdir / f"results/cpu/tables/{experiment}.csv")
        results = {
            p.stem: json.loads(p.read_text()) for p in (workdir / f"results/cpu/points/{experiment}").glob("*.json")
        }
        assert sorted(table["point"]) == sorted(results)
        for _, row in table.iterrows():
            assert row["status"] == results[row["point"]]["status"]
    capture = pd.read_csv(workdir / "results/cpu/tables/tiny_capture.csv").set_index("point")
    for name in capture.index:
        metrics = json.loads((workdir / f"results/cpu/points/tiny_capture/{name}.json").read_text())["metrics"]
        assert capture.loc[name, "resident_bytes"] == metrics["resident_bytes"]


def test_malformed_experiment_fails_at_parse_time(workdir, completed):
    bad = workdir / "experiments" / "tiny_bad.yaml"
    bad.write_text(CAPTURE.replace("tiny_capture", "tiny_bad").replace("grid:", "gird:"))
    try:
        result = _snakemake(workdir, "-n")
    finally:
        bad.unlink()
    assert result.returncode != 0
    output = result.stdout + result.stderr
    assert "tiny_bad.yaml: profiles.cpu: Additional properties are not allowed ('gird' was unexpected)" in output


@pytest.mark.skipif(shutil.which("chromium") is None, reason="Debian's chromium is not installed")
def test_report_renders_in_headless_chromium(workdir, completed, tmp_path):
    shot = tmp_path / "report.png"
    result = subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            f"--user-data-dir={tmp_path / 'profile'}",
            "--enable-logging=stderr",
            "--v=0",
            "--window-size=1280,2400",
            f"--screenshot={shot}",
            (workdir / "reports/cpu/index.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shot.exists() and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", result.stderr[-2000:]
    console_errors = [line for line in result.stderr.splitlines() if "CONSOLE" in line and "ERROR" in line]
    assert not console_errors, console_errors
