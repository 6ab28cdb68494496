"""Kind `agent` (multi-turn GRPO cells against G and the turn budget) and a learning point with an environment:
planned and refused as the config says, run on the CPU with a token environment, each cell's row the summary of
its trainer steps by hand, and its table and figure on the report page."""

import json

import pytest
import torch
import yaml

from longstraw import kinds
from longstraw.config import ConfigError
from longstraw.harness import plan
from longstraw.harness.runner import run_point
from longstraw.kinds.agent import cell_row, cells
from longstraw.results import write_result
from longstraw.training import agent_step, tasks
from longstraw.training.environments import register_environment


class TallyEnvironment:
    """Token ids: observes [5, 6] first, then [1] and the action's first two ids; an action's reward is its odd
    ids over 4; done after an action of more than 2 tokens."""

    text = False

    def reset(self, example):
        return [5, 6]

    def step(self, action):
        return [1, *action[:2]], sum(a % 2 for a in action) / 4, len(action) > 2


class StoppingTask(tasks.KeyValueRetrieval):
    stop_ids = tuple(range(3, 256, 9))


register_environment("kind_tally", TallyEnvironment)
tasks.register_task("kind_stopping", StoppingTask)
POINT = {
    "name": "cells",
    "kind": "agent",
    "model": {"preset": "tiny-llama", "lora": {"r": 4, "init_random": True}},
    "prompt": {"length": 48},
    "responses": {"length": 16},
    "grpo": {"beta": 0.0},
    "optimizer": {"lr": 1e-2},
    "capture": {"chunk_size": 16},
    "agent": {
        "task": {"name": "kind_stopping"},
        "environment": {"name": "kind_tally", "max_action_tokens": 4},
        "num_generations": [2, 3],
        "max_turns": [1, 3],
        "steps": 2,
    },
}


def test_the_cells_are_each_g_at_the_largest_budget_then_each_budget_at_the_smallest_g():
    section = kinds.resolve_point(POINT).agent
    assert cells(section) == [(2, 3), (3, 3), (2, 1)]
    section.num_generations, section.max_turns = [8, 2, 4], [4, 1, 2]
    assert cells(section) == [(2, 4), (4, 4), (8, 4), (2, 1), (2, 2)]


def test_a_cells_row_summarises_its_steps_records():
    mib = 2**20
    records = [
        {
            "reward_mean": 0.5,
            "turns/mean": 2.0,
            "done_ratio": 0.5,
            "response_tokens": [3, 5],
            "trajectory_tokens": [7, 11],
            "seconds": 2.0,
            "transaction": {"resident_bytes": 10 * mib, "graph_bytes_peak": 3 * mib, "phases": {"capture": {}}},
        },
        {
            "reward_mean": -0.25,
            "turns/mean": 1.0,
            "done_ratio": 0.0,
            "response_tokens": [4, 4],
            "trajectory_tokens": [4, 9],
            "seconds": 4.0,
            "transaction": {"resident_bytes": 10 * mib, "graph_bytes_peak": 5 * mib, "phases": {}},
        },
    ]
    row = cell_row(2, 3, records, "cpu")
    assert row == {
        "G": 2,
        "max_turns": 3,
        "steps": 2,
        "reward": 0.125,
        "turns_per_trajectory": 1.5,
        "done_ratio": 0.25,
        "action_tokens": 4.0,
        "trajectory_tokens": 7.75,
        "longest_trajectory": 11,
        "resident_bytes": 10 * mib,
        "graph_bytes_peak": 5 * mib,
        "peak_allocated_bytes": None,
        "memory_bytes": 15 * mib,
        "memory_measure": "resident + replay graph",
        "seconds_per_step": 3.0,
    }
    cuda = [
        {**r, "transaction": {**r["transaction"], "phases": {"a": {"peak_allocated_bytes": 7 + i}}}}
        for i, r in enumerate(records)
    ]
    assert (
        cell_row(2, 3, cuda, "cuda")["memory_bytes"] == 8 and cell_row(2, 3, cuda, "cuda")["peak_allocated_bytes"] == 8
    )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"agent.task": {}}, r"agent.task: the task the prompt comes from"),
        ({"agent.environment": {"name": "lookup"}}, r"agent.environment.name: 'lookup' reads and writes text"),
        ({"agent.environment.max_action_tokens": 17}, r"agent.environment.max_action_tokens: 17 tokens a turn exceed"),
        ({"agent.max_turns": []}, r"agent.max_turns: a non-empty list of integers >= 1"),
        ({"agent.environment.args": {"x": 1}}, r"agent.environment.args: environment 'kind_tally': cannot build"),
    ],
)
def test_bad_agent_points_are_refused_when_planned(tmp_path, change, message):
    point = {"name": "bad", "set": {k: v for k, v in change.items()}}
    experiment = {
        "name": "agents_bad",
        "title": "t",
        "kind": "agent",
        "base": POINT,
        "profiles": {"cpu": {"points": [point]}},
    }
    experiment["base"] = {k: v for k, v in POINT.items() if k not in ("name", "kind")}
    (tmp_path / "agents_bad.yaml").write_text(yaml.safe_dump(experiment))
    with pytest.raises(ConfigError, match=r"agents_bad.yaml \[profile cpu, point bad\]: " + message):
        plan.plan(tmp_path, "cpu")


def test_the_default_pipelines_agent_point_is_planned():
    points = plan.plan("experiments", "cpu")["agents"]["points"]
    assert [n for n, p in points.items() if p["config"].kind == "agent"] == ["lookup-400"]
    gpu = plan.plan("experiments", "h200")["agents"]["points"]
    assert gpu["v4-lookup"]["config"].learning.environment.name == "ruler_lookup"


def test_an_agent_point_runs_its_cells_and_reaches_the_report(tmp_path, monkeypatch):
    from longstraw.report.build import build_report

    records = []
    step = agent_step.agent_record

    def kept(rollouts):  # each step's trajectories, to check the cells against by hand
        records.append(rollouts.trajectories)
        return step(rollouts)

    monkeypatch.setattr("longstraw.training.trainer.agent_record", kept)
    result = run_point(POINT)
    assert result["status"] == "ok", result.get("error")
    rows = result["metrics"]["cells"]
    assert [(r["G"], r["max_turns"]) for r in rows] == [(2, 3), (3, 3), (2, 1)]
    for row, (first, second) in zip(rows, zip(records[::2], records[1::2])):
        trajectories = first + second  # the cell's two steps
        assert len(first) == row["G"] and all(t.turns <= row["max_turns"] for t in trajectories)
        assert row["turns_per_trajectory"] == pytest.approx(sum(t.turns for t in trajectories) / len(trajectories))
        assert row["action_tokens"] == pytest.approx(
            sum(int(t.action_mask.sum()) for t in trajectories) / len(trajectories)
        )
        assert row["longest_trajectory"] == max(t.tokens.numel() for t in trajectories)
        means = [sum(t.reward for t in ts) / len(ts) for ts in (first, second)]
        assert row["reward"] == pytest.approx(sum(means) / 2)
        assert row["memory_bytes"] == row["resident_bytes"] + row["graph_bytes_peak"] > row["resident_bytes"] > 0
    assert rows[2]["turns_per_trajectory"] == 1 < max(r["turns_per_trajectory"] for r in rows[:2])
    results = tmp_path / "results"
    write_result(results / "agents" / "cells.json", {**result, "grid": {}})
    experiments = tmp_path / "experiments"
    experiments.mkdir()
    base = {k: v for k, v in POINT.items() if k not in ("name", "kind")}
    experiment = {"name": "agents", "title": "Agents", "kind": "agent", "base": base}
    experiment["profiles"] = {"cpu": {"points": [{"name": "cells"}]}}
    (experiments / "agents.yaml").write_text(yaml.safe_dump(experiment))
    page = build_report(results, tmp_path / "report", profile="cpu", experiments_dir=experiments)
    table = (tmp_path / "report" / "tables" / "agents.cells.csv").read_text().splitlines()
    header = table[0].split(",")
    shown = [dict(zip(header, line.split(","))) for line in table[1:]]
    assert [(int(r["G"]), int(r["max_turns"]), float(r["memory_bytes"])) for r in shown] == [
        (r["G"], r["max_turns"], float(r["memory_bytes"])) for r in rows
    ]
    manifest = json.loads((tmp_path / "report" / "figures" / "manifest.json").read_text())
    assert [f["kind"] for f in manifest["figures"] if f["experiment"] == "agents"] == ["agent"]
    assert 'id="experiment-agents"' in page.read_text()


def test_a_learning_point_trains_and_probes_with_its_environment():
    point = {
        **{k: v for k, v in POINT.items() if k != "agent"},
        "name": "v4-agent",
        "kind": "learning",
        "learning": {
            "task": {"name": "kind_stopping"},
            "environment": {"name": "kind_tally", "max_turns": 3, "max_action_tokens": 4},
            "steps": 2,
            "window": 2,
            "probe": {"lengths": [48, 32], "examples": 2, "success": [0.0, 1.0]},
        },
    }
    result = run_point(point)
    assert result["status"] == "ok", result.get("error")
    metrics = result["metrics"]
    assert metrics["probe"]["chosen_length"] == 48 and [r["length"] for r in metrics["probe"]["rows"]] == [48, 32]
    assert all(r["success"] in (0.0, 0.5, 1.0) for r in metrics["probe"]["rows"])
    runs = metrics["runs"]
    assert runs["lr0"][0]["rewards"] == runs["response-only"][0]["rewards"]  # the same trajectories before an update
    assert all(len(s["response_tokens"]) == 4 for run in runs.values() for s in run)  # G = grpo's default, 4
    # the rewards are the environment's: multiples of 1/4 (odd ids over 4, summed over turns)
    assert all(float(r * 4).is_integer() for run in runs.values() for s in run for r in s["rewards"])
    assert torch.tensor([s["reward_mean"] for s in runs["lr0"]]).isfinite().all()
