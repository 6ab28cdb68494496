"""`docs/extending.md`'s kind recipe, followed: a toy kind declared in this file and registered at test time
(no package file edited) is planned, runs a point on the CPU and reaches the report's tables and page."""

import json
from dataclasses import dataclass

import pytest

from longstraw import kinds
from longstraw.config import ConfigError
from longstraw.config.typed import bounded
from longstraw.harness import plan
from longstraw.harness.runner import run_point
from longstraw.kinds.spec import Kind
from longstraw.results import number, point_parts, write_result

# ------------------------------------------------------------------------ the toy kind, as the recipe writes it


@dataclass
class EchoConfig:
    """Sum the prompt's positions `repeats` times."""

    repeats: int = bounded(2, min=1)


def check(cfg, source: str) -> None:
    if cfg.echo.repeats > cfg.prompt.length:
        raise ConfigError(
            f"{source}: echo.repeats: at most prompt.length ({cfg.prompt.length}), got {cfg.echo.repeats}"
        )


def run(cfg, device, progress) -> dict:
    import torch

    positions = torch.arange(cfg.prompt.length, dtype=torch.float64, device=device)
    return {"total": float(positions.sum() * cfg.echo.repeats)}


def columns(point: dict) -> dict:
    cfg, metrics = point_parts(point)
    return {"repeats": cfg.get("echo", {}).get("repeats"), "total": number(metrics.get("total"))}


def figures(data, ceiling, marks):
    rows = data.of_kind("echo")
    if not rows:
        return
    from longstraw.plotting import draw

    fig, ax = draw.plt.subplots(figsize=(4, 3))
    ax.plot([r["repeats"] for r in rows], [r["total"] for r in rows], marker="o")
    yield "echo_total", fig


ECHO = Kind(
    "echo",
    run=run,
    section=EchoConfig,
    check=check,
    columns=columns,
    shown=["repeats", "total"],
    figures=figures,
    captions={"echo_total": "the positions' sum against repeats"},
)

EXPERIMENT = """
name: echoes
title: Echoes of the prompt
kind: echo
base: {model: {preset: tiny-llama}, prompt: {length: 16}}
profiles:
  cpu:
    grid: {echo.repeats: [1, 3]}
"""


def expected_total(length: int, repeats: int) -> float:
    return length * (length - 1) / 2 * repeats  # 0 + 1 + ... + (length - 1), repeats times


@pytest.fixture
def echo():
    kinds.register(ECHO)
    yield ECHO
    kinds.unregister("echo")


def _experiments(tmp_path, text=EXPERIMENT):
    folder = tmp_path / "experiments"
    folder.mkdir(exist_ok=True)
    (folder / "echoes.yaml").write_text(text)
    return folder


# --------------------------------------------------------------------------------------------------- tests


def test_the_toy_kind_joins_the_schema_and_the_config_and_leaves_cleanly(echo):
    assert "echo" in plan.schema()["properties"]["kind"]["enum"]
    cfg = kinds.resolve_point({"kind": "echo", "model": {"preset": "tiny-llama"}})
    assert cfg.echo == EchoConfig(repeats=2)  # its section, with its defaults
    assert kinds.resolve_point({"model": {"preset": "tiny-llama"}}).echo is None  # a step point holds none
    kinds.unregister("echo")
    try:
        assert "echo" not in plan.schema()["properties"]["kind"]["enum"] and kinds.get("echo") is None
        with pytest.raises(ConfigError, match="kind: must be one of"):
            kinds.resolve_point({"kind": "echo"}, "x.yaml")
    finally:
        kinds.register(ECHO)


def test_the_toy_kind_plans(echo, tmp_path):
    points = plan.plan(_experiments(tmp_path), "cpu")["echoes"]["points"]
    assert {name: p["config"].echo.repeats for name, p in points.items()} == {"repeats-1": 1, "repeats-3": 3}
    # its section's keys and its check refuse bad input when the plan is made, naming the file and the key
    bad_key = EXPERIMENT.replace("grid: {echo.repeats: [1, 3]}", "grid: {echo.repeat: [1]}")
    with pytest.raises(ConfigError, match=r"echoes.yaml \[profile cpu, point repeat-1\]: echo.repeat: unknown key"):
        plan.plan(_experiments(tmp_path, bad_key), "cpu")
    too_many = EXPERIMENT.replace("[1, 3]", "[17]")
    with pytest.raises(ConfigError, match=r"point repeats-17\]: echo.repeats: at most prompt.length \(16\), got 17"):
        plan.plan(_experiments(tmp_path, too_many), "cpu")
    # a section of the toy kind on a point of another kind is refused, as any kind's is
    with pytest.raises(ConfigError, match="echo: a section of kind echo; this point is kind step"):
        kinds.resolve_point({"kind": "step", "model": {"preset": "tiny-llama"}, "echo": {}}, "x.yaml")


def test_the_toy_kind_runs_a_point_and_reaches_the_report(echo, tmp_path):
    from longstraw.report.build import build_report

    experiments = _experiments(tmp_path)
    results = tmp_path / "results"
    for name, point in plan.plan(experiments, "cpu")["echoes"]["points"].items():
        result = run_point(point["config"], f"echoes [{name}]")
        assert result["status"] == "ok", result.get("error")
        assert result["metrics"]["total"] == expected_total(16, point["config"].echo.repeats)
        write_result(results / "echoes" / f"{name}.json", {**result, "grid": point["grid"]})
    page = build_report(results, tmp_path / "report", profile="cpu", experiments_dir=experiments)
    table = (tmp_path / "report" / "tables" / "echoes.csv").read_text().splitlines()
    header = table[0].split(",")
    totals = {row.split(",")[header.index("point")]: float(row.split(",")[header.index("total")]) for row in table[1:]}
    assert totals == {"repeats-1": expected_total(16, 1), "repeats-3": expected_total(16, 3)}
    manifest = json.loads((tmp_path / "report" / "figures" / "manifest.json").read_text())
    drawn = [f for f in manifest["figures"] if f["experiment"] == "echoes"]
    assert [(f["kind"], f["caption"]) for f in drawn] == [("echo", "the positions' sum against repeats")]
    html = page.read_text()
    assert 'id="experiment-echoes"' in html and "Echoes of the prompt" in html
    assert "the positions&#39; sum against repeats" in html or "the positions' sum against repeats" in html
