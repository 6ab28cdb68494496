"""A length curriculum of the learning kind (`learning.curriculum`), as QwenLong-L1 and LoongRL train: stage n
trains `steps` GRPO steps at its `length` (groups of its `num_generations` rollouts, if it sets them), the model built
with its `overrides` (the RoPE scaling the length needs), starting from the policy stage n-1 trained: its LoRA
adapter (stage 0: `model.lora`'s own start) or, without `model.lora`, the whole model's weights (full-parameter
training, as the synthetic model's points train; stage 0: `model.path`'s).

Each stage is one learning point's work at one length, fixed before it runs:
- the probe (`learning.probe`: its `examples` and `success` range): the greedy success of the policy the stage
  starts from, at the stage's length, on held-out seeds; below the range the stage does not train, and no later
  stage runs (none would have an adapter to start from); above it the policy already reads the length, so the stage
  is skipped (`skipped`: no runs, no V4 to measure) and its starting adapter is carried on to the next stage;
- the runs of `learning.gradients` at `optimizer.lr` and the lr-0 control, all from the same starting adapter, with
  the same prompts and sampling seeds; V4's paired gain per gradient mode over the last `learning.window` steps
  (`learning.gains`);
- the held-out length curve (`kinds.length_curve`'s run, with `adapter:`) of the adapter carried on (the first
  gradient mode's) at every stage length so far, beside the base model's (the adapter off) on the same examples:
  the training task's (`heldout`), then each of `learning.curriculum.eval_tasks`' (`heldout_tasks`, in their order,
  each with its spec and `learning_runs.task_label`), each kept in the stage's folder once measured (`heldout.json`,
  `heldout-<i>.json`: a command cut off there goes on from the next curve).

The policies carried on are copied to `learning.curriculum.out` (`stage-<i>/adapter`, or `stage-<i>/model`: the
trained run's last checkpoint of the whole model, as `save_pretrained` wrote it), where they outlive the point;
without it they go with the work folder when the point's result is written. A record's `adapter` names the carried
policy either way (`carries`: "adapter" or "weights"); the held-out curve of carried weights runs the trained model
and, on the same examples, the model the point started from (`model.path`) as its base.

Work folder: `stage-<i>/` holds the stage's probe, its runs' checkpoints (one every `learning.RESUME_EVERY` steps
and at the last) and, once the stage is done, `stage.json`, its record (written atomically): a stage with one is
never run again, and the next starts from the adapter it names, after its sha256 is checked. A record names the
adapter it started from (path, sha256, the stage and run that trained it; stage 0: `model.lora.init`'s, or none)
and the one it carries on.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

from longstraw.config import PointConfig
from longstraw.kinds.common import Progress
from longstraw.kinds.learning_runs import gains, probe_lengths, remembered, task_label, train_runs
from longstraw.kinds.length_curve import LengthCurveConfig
from longstraw.kinds.length_curve import run as run_length_curve
from longstraw.models.checks import ADAPTER_WEIGHTS
from longstraw.models.real import WEIGHTS as MODEL_WEIGHTS
from longstraw.results import check_writable, strict_json, write_text_atomic
from longstraw.wheels import sha256_of

STAGE_RECORD = "stage.json"  # a finished stage's record in its folder


def run_curriculum(cfg: PointConfig, device, progress: Progress, work: Path, checkpoint_every: int) -> dict:
    """Every stage in order (a finished one read from its record), until one is not trained; each run checkpoints
    every `checkpoint_every` steps and at its last."""
    out = cfg.learning.curriculum.out
    if out is not None:  # before any work: the adapters kept there can be written
        check_writable(Path(out) / "stage-0.tmp", "learning.curriculum.out", overwrite=True)
    init = cfg.model.lora and cfg.model.lora.init  # a trained adapter stage 0 starts from (None: peft's init)
    start = None if not init else {"path": init, "sha256": sha256_of(Path(init) / ADAPTER_WEIGHTS), "stage": None}
    stages = []
    for index, stage in enumerate(cfg.learning.curriculum.stages):
        folder = work / f"stage-{index}"
        record_file = folder / STAGE_RECORD
        if record_file.is_file():
            record = json.loads(record_file.read_text())
            progress.line(f"learning curriculum: stage {index} ({stage.length:,} positions) done before; not rerun")
        else:
            record = run_stage(cfg, index, stage, start, folder, device, progress, checkpoint_every)
            write_text_atomic(record_file, strict_json(record))
        stages.append(record)
        progress.partial({"stages": stages})
        if record["adapter"] is None and not record.get("skipped"):
            break
        start = record["adapter"]  # a skipped stage's: the one it started from (stage 0's may be none)
        if start is not None:
            checked(start)
    return {"stages": stages}


def weights_file(folder) -> Path:
    """The file whose sha256 names a carried policy: a LoRA adapter's weights, else the whole model's (the one
    safetensors file `save_pretrained` writes for models of these sizes)."""
    adapter = Path(folder) / ADAPTER_WEIGHTS
    return adapter if adapter.is_file() else Path(folder) / MODEL_WEIGHTS


def checked(adapter: dict) -> None:
    """Refuse to go on from a carried policy whose weights are no longer those a finished stage recorded."""
    now = sha256_of(weights_file(adapter["path"]))
    if now != adapter["sha256"]:
        raise ValueError(
            f"{adapter['path']}: its weights changed since stage {adapter['stage']} recorded them (sha256 "
            f"{adapter['sha256'][:12]}..., now {now[:12]}...); remove the work folder to start over"
        )


def stage_config(cfg: PointConfig, stage, start: dict | None) -> PointConfig:
    """The point's config as one stage runs it: the stage's overrides over the model's, its policy starting from
    `start` (None: `model.lora`'s own start, or `model.path`'s weights), the stage's steps and group size (None: the
    point's)."""
    model = dataclasses.replace(cfg.model, overrides={**cfg.model.overrides, **stage.overrides})
    if start is not None and cfg.model.lora is not None:
        model = dataclasses.replace(model, lora=dataclasses.replace(cfg.model.lora, init=start["path"]))
    elif start is not None:  # the whole model carried: the last stage's trained weights
        model = dataclasses.replace(model, path=start["path"])
    learning = dataclasses.replace(cfg.learning, steps=stage.steps)
    group = cfg.grpo.num_generations if stage.num_generations is None else stage.num_generations
    grpo = dataclasses.replace(cfg.grpo, num_generations=group)
    return dataclasses.replace(cfg, model=model, learning=learning, grpo=grpo)


def run_stage(cfg, index: int, stage, start, folder: Path, device, progress: Progress, checkpoint_every: int) -> dict:
    staged = stage_config(cfg, stage, start)
    carries = "weights" if cfg.model.lora is None else "adapter"
    record = {
        "stage": index,
        "length": stage.length,
        "steps": stage.steps,
        "num_generations": staged.grpo.num_generations,
        "window": cfg.learning.window,
        "overrides": stage.overrides,
        "carries": carries,
        "start_adapter": start,
        "adapter": None,
    }
    if cfg.learning.probe is not None:
        probe = remembered(folder / "probe.json", lambda: probe_lengths(staged, progress, [stage.length]))
        record["probe"] = probe
        if probe["chosen_length"] is None:
            success, (_, high) = probe["rows"][0]["success"], probe["range"]
            if success > high:  # nothing left to learn at this length: the next stage starts where this one would
                progress.line(f"learning curriculum: stage {index} skipped (probe {success:.2f} above {high})")
                return {**record, "adapter": start, "skipped": f"probe success {success:.2f} above the range's {high}"}
            return record
    runs, resumed_at, optimizers = train_runs(staged, folder, checkpoint_every, stage.length, progress)
    carried = cfg.learning.gradients[0]
    # the trainer's last checkpoint: `save_pretrained`'s folder, of the adapter or (no LoRA) of the whole model
    last = folder / carried / "checkpoints" / f"step-{stage.steps}" / "adapter"
    path = kept(last, cfg.learning.curriculum, index, "model" if carries == "weights" else "adapter")
    adapter = {"path": str(path), "sha256": sha256_of(weights_file(path)), "stage": index, "run": carried}
    lengths = [s.length for s in cfg.learning.curriculum.stages[: index + 1]]
    base = dataclasses.replace(staged.model, path=cfg.model.path, lora=None)  # the model the point started from

    def curve(name: str, task: dict | None = None) -> dict:  # kept once measured: a cut command goes on from here
        return remembered(folder / name, lambda: heldout_curve(staged, base, adapter["path"], lengths, device, task))

    return {
        **record,
        "runs": runs,
        "gains": gains(runs, stage.steps - cfg.learning.window),
        "resumed_at": resumed_at,
        "run_optimizer": optimizers,
        "adapter": adapter,
        "heldout": curve("heldout.json"),
        "heldout_tasks": [
            {"label": task_label(task), "task": dict(task), **curve(f"heldout-{i}.json", task)}
            for i, task in enumerate(cfg.learning.curriculum.eval_tasks)
        ],
    }


def kept(adapter: Path, curriculum, index: int, name: str) -> Path:
    """The stage's carried policy, copied whole to `curriculum.kept(index, name)` (no `out`: where it is). A copy
    there already is kept when it holds the same weights, refused otherwise: a finished run is never overwritten."""
    if curriculum.out is None:
        return adapter
    target = curriculum.kept(index, name)
    if target.exists():
        if sha256_of(weights_file(target)) != sha256_of(weights_file(adapter)):
            raise ValueError(
                f"learning.curriculum.out: {target} holds another run's stage-{index} {name}; choose another folder"
            )
        return target
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(adapter, tmp)
    tmp.rename(target)  # there whole or not at all
    return target


def heldout_curve(
    staged: PointConfig, base, carried: str, lengths: list[int], device, task: dict | None = None
) -> dict:
    """The length curve (`kinds.length_curve`) of `task` (None: the training task's) at `lengths` of the carried
    policy (`rows`) and of the `base` model (`base_rows`), on the same examples: an adapter's by the length curve's
    own `adapter:` (the base: the adapter off), carried weights by two curves, the trained model's and `base`'s."""

    def length_curve(model, adapter: str | None) -> dict:
        section = LengthCurveConfig(
            task=dict(staged.learning.task if task is None else task),
            lengths=lengths,
            examples=staged.learning.curriculum.eval_examples,
            adapter=adapter,
        )
        curve_cfg = dataclasses.replace(staged, kind="length_curve", model=model, length_curve=section, learning=None)
        return run_length_curve(curve_cfg, device, Progress())

    if staged.model.lora is not None:
        result = length_curve(base, carried)
    else:
        result = length_curve(dataclasses.replace(base, path=carried), None)
        result["base_rows"] = length_curve(base, None)["rows"]  # the same examples: seeds from the curve's settings
    return {k: result[k] for k in ("rows", "base_rows", "chance", "seed_base")}
