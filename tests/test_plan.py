"""Experiment files -> points: grid expansion, per-profile settings, errors naming file and key."""

from pathlib import Path

import pytest

from longstraw.harness import plan

REPO = Path(__file__).resolve().parents[1]

EXPERIMENT = """
name: demo
title: Demo
kind: step
base: {grpo: {beta: 0.0}}
profiles:
  cpu:
    base: {model: {preset: tiny-llama}, prompt: {length: 64}}
    grid: {mode: [replay, naive], grpo.num_generations: [1, 2]}
    points:
      - {name: long, set: {prompt.length: 128, kind: capture}}
"""


def _write(tmp_path, text, name="demo"):
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    return path


def test_grid_and_points_expand_with_profile_settings(tmp_path):
    points = plan.plan(_write(tmp_path, EXPERIMENT).parent, "cpu")["demo"]["points"]
    assert sorted(points) == [
        "long",
        "mode-naive_count-1",
        "mode-naive_count-2",
        "mode-replay_count-1",
        "mode-replay_count-2",
    ]
    point = points["mode-naive_count-2"]
    assert point["grid"] == {"mode": "naive", "grpo.num_generations": 2}
    config = point["config"]
    assert (config.mode, config.grpo.num_generations, config.prompt.length) == ("naive", 2, 64)
    assert config.grpo.beta == 0.0 and config.grpo.epsilon == 0.2  # defaults fill the rest
    assert config.grpo.num_generations == 2  # the group size is the point's
    assert points["long"]["config"].kind == "capture" and points["long"]["config"].prompt.length == 128


def test_a_profiles_base_may_set_the_kind(tmp_path):
    """A profile's base kind applies to its points (it used to be overwritten by the experiment's)."""
    text = EXPERIMENT.replace("base: {model: {preset: tiny-llama}", "base: {kind: sweep, model: {preset: tiny-llama}")
    points = plan.plan(_write(tmp_path, text).parent, "cpu")["demo"]["points"]
    assert points["mode-replay_count-1"]["config"].kind == "sweep"
    assert points["long"]["config"].kind == "capture"  # a point's own setting still wins


def test_one_point_by_name_or_an_error_naming_the_file_and_its_points(tmp_path):
    path = _write(tmp_path, EXPERIMENT)
    config = plan.point_config(path, "cpu", "long")
    assert (config.kind, config.prompt.length) == ("capture", 128)
    with pytest.raises(ValueError, match=r"demo.yaml: profile 'cpu' has no point 'lnog'.*'long'"):
        plan.point_config(path, "cpu", "lnog")


def test_profile_without_settings_has_no_points(tmp_path):
    assert plan.plan(_write(tmp_path, EXPERIMENT).parent, "h200") == {}


@pytest.mark.parametrize(
    "text, message",
    [
        (
            EXPERIMENT.replace("title: Demo", "title: Demo\ncolour: red"),
            r"<top level>: Additional properties .*'colour'",
        ),
        (EXPERIMENT.replace("grid:", "gird:"), r"profiles.cpu: Additional properties .*'gird'"),
        (EXPERIMENT.replace("prompt: {length: 64}", "prompt: {lenght: 64}"), r"point .*: prompt.lenght: unknown key"),
        (EXPERIMENT.replace("kind: step", "kind: stepp"), r"kind: 'stepp' is not one of"),
        (EXPERIMENT.replace("grpo.num_generations: [1, 2]", "grpoz.num_generations: [1]"), r"grpoz: unknown key"),
        (
            EXPERIMENT.replace("title: Demo", "title: Demo\ntitle: Other"),
            r": key 'title' appears twice \(lines 3 and 4\)",
        ),
        (
            EXPERIMENT.replace("mode: [replay, naive]", "mode: [replay], mode: [naive]"),
            r": profiles.cpu.grid: key 'mode' appears twice \(both on line 9\)",
        ),
    ],
)
def test_malformed_experiment_names_file_and_key(tmp_path, text, message):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=message) as info:
        plan.plan(path.parent, "cpu")
    assert str(path) in str(info.value)


def test_file_name_must_match_experiment_name(tmp_path):
    with pytest.raises(ValueError, match="must equal the file name"):
        plan.plan(_write(tmp_path, EXPERIMENT, name="other").parent, "cpu")


def test_repository_experiments_plan_for_both_profiles():
    for profile in plan.PROFILES:
        experiments = plan.plan(REPO / "experiments", profile)
        assert {"g_sweep", "operating_points", "baselines", "architectures"} <= set(experiments)


def test_the_kinds_are_registered_once_and_each_declares_itself():
    """The registry is the one list: the schema's enum and the point config's type are made from it, every module of
    `longstraw/kinds` that declares a `KIND` is registered under its name with a `run`, and no other runs points."""
    import importlib
    import typing

    from longstraw import kinds

    expected = (
        "step",
        "capture",
        "capacity",
        "sweep",
        "staleness",
        "validation",
        "pretrain",
        "length_curve",
        "learning",
        "agent",
    )
    assert kinds.names() == expected
    assert plan.schema()["properties"]["kind"]["enum"] == list(expected)
    hints = typing.get_type_hints(kinds.point_config_class())
    assert typing.get_args(hints["kind"]) == expected
    # each kind section is its kind's, and the config's field of that name holds its type or None
    sections = kinds.sections()
    assert set(sections) == {
        "capacity",
        "sweep",
        "staleness",
        "validation",
        "pretrain",
        "length_curve",
        "learning",
        "agent",
    }
    assert all(typing.get_args(hints[k]) == (t, type(None)) for k, t in sections.items())
    declared = {}
    for path in (REPO / "longstraw" / "kinds").glob("*.py"):
        module = importlib.import_module(f"longstraw.kinds.{path.stem}")
        if hasattr(module, "KIND"):
            declared[path.stem] = module.KIND
    assert set(declared) == set(expected)
    assert all(kinds.get(name) is kind and kind.name == name and callable(kind.run) for name, kind in declared.items())


def test_a_point_holds_its_own_kinds_section_and_no_other(tmp_path):
    """A point's config holds the shared sections and its kind's; a base's section of another kind
    (written for the experiment's kind) is left out of a point of another kind, and one a point's own `set`
    gives is refused, naming it."""
    from longstraw import kinds
    from longstraw.config import ConfigError
    from longstraw.config.point import point_mapping

    KIND_SECTIONS = tuple(kinds.sections())

    text = EXPERIMENT.replace("kind: step", "kind: sweep").replace(
        "base: {grpo: {beta: 0.0}}", "base: {grpo: {beta: 0.0}, sweep: {replay: [2, 4], hold_all: []}}"
    )
    points = plan.plan(_write(tmp_path, text).parent, "cpu")["demo"]["points"]
    swept, long = points["mode-replay_count-1"]["config"], points["long"]["config"]
    assert swept.sweep.replay == [2, 4] and long.kind == "capture" and long.sweep is None
    assert [s for s in KIND_SECTIONS if getattr(swept, s) is not None] == ["sweep"]
    recorded = point_mapping(swept)
    assert recorded["sweep"] == {"replay": [2, 4], "hold_all": []}
    assert set(recorded) & set(KIND_SECTIONS) == {"sweep"} and "sweep" not in point_mapping(long)
    assert kinds.resolve_point(recorded) == swept  # the recorded mapping resolves to the same config
    # a section of another kind in the point's own settings: refused when the plan is made
    refused = text.replace("set: {prompt.length: 128, kind: capture}", "set: {kind: capture, sweep.replay: [8]}")
    with pytest.raises(ConfigError, match=r"point long\]: sweep: a section of kind sweep; this point is kind capture"):
        plan.plan(_write(tmp_path, refused).parent, "cpu")
    # a kind's own section defaults when the file gives none
    assert plan.resolve({"kind": "staleness", "model": {"preset": "tiny-llama"}}).staleness.steps == 8


def test_committed_records_load_with_their_own_kinds_section_only():
    """Records written before a point held only its kind's section carry every kind's (their defaults): they
    load in today's shape, each with its own kind's section only."""
    import json

    from longstraw import kinds
    from longstraw.report.aggregate import load_points

    KIND_SECTIONS = tuple(kinds.sections())

    records = REPO / "experiments" / "recorded"
    old = 0
    for path in sorted(records.rglob("*.json")):
        raw = json.loads(path.read_text())
        if not isinstance(raw.get("config"), dict):
            continue
        old += sum(s in raw["config"] for s in KIND_SECTIONS if s != raw.get("kind")) > 0
    assert old > 0  # the committed records are of the old shape: the conversion is exercised
    loaded = [p for p in load_points(records / "h200") if isinstance(p.get("config"), dict)]
    assert loaded
    for point in loaded:
        assert set(point["config"]) & set(KIND_SECTIONS) <= {point.get("kind")}, point["result_file"]
        if point.get("kind") in KIND_SECTIONS:
            assert isinstance(point["config"][point["kind"]], dict), point["result_file"]


def test_committed_records_read_the_group_size_under_its_one_name():
    """Records written before the group size had one name spelt it responses.count (and a learning point's runs
    learning.num_samples), in their configs and grids: they load with it at grpo.num_generations, its value kept."""
    import json

    from longstraw.report.aggregate import load_point

    records = REPO / "experiments" / "recorded" / "h200"
    seen = {"responses.count": 0, "learning.num_samples": 0, "grid": 0}
    for path in sorted(records.rglob("*.json")):
        raw = json.loads(path.read_text())
        config = raw.get("config")
        if not isinstance(config, dict):
            continue
        if raw.get("kind") == "learning" and "num_samples" in config.get("learning", {}):
            expected, seen["learning.num_samples"] = config["learning"]["num_samples"], seen["learning.num_samples"] + 1
        elif "count" in config.get("responses", {}):
            expected, seen["responses.count"] = config["responses"]["count"], seen["responses.count"] + 1
        else:
            continue
        point = load_point(path, records)
        assert point["config"]["grpo"]["num_generations"] == expected, path
        assert "count" not in point["config"]["responses"], path
        assert "num_samples" not in point["config"].get("learning", {}), path
        if "responses.count" in raw.get("grid", {}):
            seen["grid"] += 1
            assert point["grid"]["grpo.num_generations"] == raw["grid"]["responses.count"], path
        assert "responses.count" not in point.get("grid", {}), path
    assert all(seen.values()), seen  # each old spelling is among the committed records: the conversion is exercised
