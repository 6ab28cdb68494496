"""What a kind declares about itself (`Kind`), and the models a point builds (`Built`).

A kind module ends with one `KIND = Kind(...)`; `longstraw.kinds` registers it. The plan, the runner and the
report ask the kind, never its name: every field below has the default a kind without that part gets.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Built:
    """One model a point builds: a preset (with overrides) or a checkpoint folder, and the keys naming them."""

    preset: str
    path: str | None
    overrides: dict
    preset_key: str = "model.preset"
    path_key: str = "model.path"
    overrides_key: str = "model.overrides"
    dtype: str = "float32"
    dtype_key: str = "model.dtype"
    device: str | None = None  # a device of its own (None: the point's model.device)
    device_key: str = "model.device"
    # (prompt key, prompt, response key or None, response) of what this model runs, checked against its positions
    # (a curriculum's stage: its length under its own RoPE scaling); None: the point's (`Kind.longest_runs`)
    runs: tuple | None = None


def _nothing(*_args):
    return None


def _no_rows(*_args):
    return []


def _no_tables(_points):
    return {}


def _no_checkpoints(_cfg):
    return {}


def _no_figures(_data, _ceiling, _marks):
    return ()


def _no_columns(_point):
    return {}


@dataclass(frozen=True)
class Kind:
    """One experiment kind: its config section, its plan-time checks, its run and its report parts."""

    name: str
    # run half: `run(cfg, device, progress) -> metrics` (imports torch inside, so planning and reporting stay light)
    run: Callable
    # plan half
    section: type | None = None  # its config section's dataclass, at the point's key `name` (None: none)
    check: Callable = _nothing  # `check(cfg, source)`: its own section through to the names and tasks it uses
    # `check_settings(cfg, source)`: what its run would refuse only once the model is built, refused from the config
    # alone after the settings every kind shares (`harness/inputs.py: check_settings`)
    check_settings: Callable = _nothing
    check_work: Callable | None = None  # `check_work(cfg, work_dir, source)`: a kind that resumes from a work folder
    # `modes(cfg) -> [mode]`: the step modes a point runs (its `mode`, a search's compared ones); None: the kind
    # takes no `mode` (no peer, no partial step, micro-batches whatever the mode)
    modes: Callable | None = None
    models: Callable = _nothing  # `models(cfg) -> [Built]`: the models it builds; None: the point's `model`
    # `longest_runs(cfg) -> [(prompt key, prompt, response key or None, response)]`; None: prompt and response
    longest_runs: Callable = _nothing
    tasks: Callable = _no_rows  # `tasks(cfg) -> [(key, spec, lengths, lengths key)]`: the tasks its section builds
    exact_key: Callable = _nothing  # `exact_key(cfg) -> key or None`: the setting that asks for exact gradients
    # `checkpoints_out(cfg) -> {folder: overrides}`: the whole-model checkpoints the point writes, each with the config
    # fields it writes over its first model's (`harness/inputs.py` plans the points that load them after it)
    checkpoints_out: Callable = _no_checkpoints
    adapters_out: Callable = _nothing  # `adapters_out(cfg) -> folder or None`: where it keeps the adapters it trains
    # `adapters_in(cfg) -> [(key, folder)]`: the trained adapters its own section loads (`model.lora.init` is
    # every kind's), each there or under a planned point's `adapters_out` (`harness/inputs.py`)
    adapters_in: Callable = _no_rows
    # `check_model(cfg, facts, source)`: its own checks of a model it builds, instead of the lengths, tasks and
    # capture settings checked for the point's own model
    check_model: Callable | None = None
    family_forward: bool = True  # its models run through the family adapter (False: HF's forward; dtype only)
    host_pages: bool = True  # capture.host_pages applies to its captures
    # the options of a point's own GRPO steps apply: `recapture`, `responses.source: rollouts`, `replay.cuda_graph`
    step_options: bool = False
    # its runs are the trainer's (`training.trainer`): `replay.cuda_graph` records the response-only runs' members,
    # each sampled group padded to the answer budget
    trains: bool = False
    shards_state: bool = True  # context parallelism applies (a search's probes run as single processes)
    # report half (plain Python; matplotlib only inside `figures`)
    columns: Callable = _no_columns  # `columns(point) -> dict`: its cells of the point's row
    tables: Callable = _no_tables  # `tables(points) -> {suffix: rows}`: tables of its own
    extra_tables: dict = field(default_factory=dict)  # {suffix: results.ExtraTable}: how the page shows them
    shown: list | None = None  # the columns the page's table shows, in order (None: all)
    notes: Callable = _no_rows  # `notes(row, grid) -> [sentence]`: what a row cannot say in one cell
    figures: Callable = _no_figures  # `figures(data, ceiling, marks) -> (name, figure)...`
    captions: dict = field(default_factory=dict)  # {figure name: caption}
    # named parts other report sections read (`longstraw.kinds.contributed`): a levels table's vocabulary, a
    # claims row's sentence, ...
    contributes: dict[str, Any] = field(default_factory=dict)


UNKNOWN = Kind("unknown", run=_nothing)  # a kind this package does not know (a result from a later version)
