"""Kind `pretrain`: train a preset from random initialisation on a synthetic task
(`longstraw.training.pretrain`, settings in the point's `pretrain` section, its own model and
device included) and save the checkpoint to `pretrain.out` (`OUT/checkpoint`, which later points
load through `model.path`; the pipeline runs them after this point).

Report: one row per point (parameters, steps, tokens per second, the final held-out accuracy per
prompt length against the task's chance); its evaluations over training in a table of their own;
figure: the training loss and the held-out accuracy by length over the steps."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from longstraw.config import ConfigError, PointConfig
from longstraw.config.pretrain import PretrainConfig
from longstraw.kinds.checks import check_named_preset, check_task
from longstraw.kinds.spec import Built, Kind
from longstraw.models.checks import ModelFacts
from longstraw.results import ExtraTable, as_dict, number, point_parts, rows_of_points
from longstraw.training.checks import check_task_builds


def check(cfg: PointConfig, source: str) -> None:
    """Its model a preset this package has, its task one it can build."""
    check_named_preset(cfg.pretrain.model, f"{source}: pretrain.model")
    check_task(cfg.pretrain.task, cfg.prompt.length, f"{source}: pretrain.task")


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


if TYPE_CHECKING:
    from longstraw.kinds.common import Progress

LOSS_POINTS = 200  # the loss curve a result keeps (every step's loss stays in OUT/curve.json)


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    from longstraw.training.pretrain import pretrain

    if not cfg.pretrain.out:
        raise ValueError("pretrain.out: the folder the checkpoint is written to (OUT/checkpoint)")
    curve = pretrain(cfg.pretrain)
    curve.pop("model")
    steps = curve.pop("steps")
    every = max(1, len(steps) // LOSS_POINTS)
    curve["loss_curve"] = [{k: s[k] for k in ("step", "length", "loss", "answer_loss")} for s in steps[::every]]
    curve["final_answer_loss"] = sum(s["answer_loss"] for s in steps[-20:]) / len(steps[-20:])
    return curve


# ------------------------------------------------------------------------------------------- report

SHOWN = [
    "model",
    "parameters",
    "steps",
    "final_answer_loss",
    "chance",
    "final_accuracy",
    "tokens_per_second",
    "train_seconds",
    "checkpoint",
    "wall_seconds",
]
EXTRA_TABLES = {
    "evals": ExtraTable(
        "Held-out accuracy during pretraining, per prompt length",
        ["point", "step", "length", "accuracy", "n"],
        "Greedy exact match of the answer on held-out examples (seeds disjoint from training), "
        "teacher-forced: equal to greedy decoding's success for exact-match rewards.",
    ),
    "loss": ExtraTable(
        "Pretraining loss",
        ["point", "step", "length", "answer_loss", "loss"],
        f"Every step's loss is in the checkpoint folder's curve.json; the result keeps about {LOSS_POINTS} of them.",
    ),
}
CAPTIONS = {
    "pretrain_curve": "Pretraining: the answer loss per step (left) and the held-out accuracy per prompt "
    "length over training (right), the task's chance level dotted."
}


def columns(point: dict) -> dict:
    cfg, metrics = point_parts(point)
    final = as_dict(metrics.get("final_accuracy"))
    return {
        "model": as_dict(cfg.get("pretrain")).get("model"),
        "parameters": number(metrics.get("parameters")),
        "steps": as_dict(cfg.get("pretrain")).get("steps"),
        "final_answer_loss": number(metrics.get("final_answer_loss")),
        "chance": number(as_dict(metrics.get("chance")).get("value")),
        "final_accuracy": " ".join(f"{k}: {v:.3f}" for k, v in final.items()) or None,
        "tokens_per_second": number(metrics.get("tokens_per_second")),
        "train_seconds": number(metrics.get("train_seconds")),
        "checkpoint": metrics.get("checkpoint"),
    }


def tables(points: list[dict]) -> dict:
    mine = [p for p in points if p.get("kind") == "pretrain"]

    def evals(point):
        return [
            {
                "point": point.get("point"),
                "step": e.get("step"),
                "length": int(length),
                "accuracy": acc,
                "n": e.get("n"),
            }
            for e in point_parts(point)[1].get("evals") or []
            for length, acc in as_dict(e.get("accuracy")).items()
        ]

    def losses(point):
        return [{"point": point.get("point"), **s} for s in point_parts(point)[1].get("loss_curve") or []]

    return {"evals": rows_of_points(mine, evals), "loss": rows_of_points(mine, losses)}


def figures(data, ceiling: dict, marks=()):
    rows = [r for r in data.of_kind("pretrain") if r.get("status") == "ok"]
    if rows and data.extra.get("loss"):
        yield "pretrain_curve", plot_curve(rows, data.extra.get("loss", []), data.extra.get("evals", []), data.name)


def plot_curve(rows, losses, evals, title: str):
    from longstraw.plotting import draw

    fig, (loss_ax, acc_ax) = draw.plt.subplots(1, 2, figsize=(12, 4.5))
    for i, row in enumerate(rows):
        name, color = row.get("point"), draw.POINT_COLORS[i % len(draw.POINT_COLORS)]
        mine = [s for s in losses if s.get("point") == name]
        loss_ax.plot([s["step"] for s in mine], [s["answer_loss"] for s in mine], color=color, label=str(name))
        scored = [e for e in evals if e.get("point") == name]
        for j, length in enumerate(sorted({e["length"] for e in scored})):
            at = [e for e in scored if e["length"] == length]
            acc_ax.plot(
                [e["step"] for e in at],
                [e["accuracy"] for e in at],
                marker="o",
                color=color,
                linestyle=draw.LINE_STYLES[j % len(draw.LINE_STYLES)],
                label=f"{name}: {length} positions",
            )
        if row.get("chance") is not None:
            acc_ax.axhline(row["chance"], color=color, linestyle=":", linewidth=1, label=f"chance {row['chance']:.2f}")
    loss_ax.set(xlabel="step", ylabel="answer loss (nats)", yscale="log", title=f"{title}: pretraining loss")
    acc_ax.set(xlabel="step", ylabel="held-out accuracy", ylim=(0, 1.02), title="held-out accuracy by length")
    loss_ax.legend(fontsize=7)
    acc_ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def models(cfg: PointConfig) -> list[Built]:
    """Its own model, from its section: pretraining builds it."""
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
            p.device,
            "pretrain.device",
        )
    ]


KIND = Kind(
    "pretrain",
    run=run,
    section=PretrainConfig,
    check=check,
    check_settings=lambda cfg, source: check_pretrain_settings(cfg.pretrain, source),
    models=models,
    check_model=lambda cfg, facts, source: check_pretrain_tasks(cfg.pretrain, facts, source),
    checkpoints_out=lambda cfg: {str(Path(cfg.pretrain.out) / "checkpoint"): {}} if cfg.pretrain.out else {},
    family_forward=False,  # pretraining runs HF's forward, not the family's: only its dtype counts
    host_pages=False,
    columns=columns,
    tables=tables,
    extra_tables=EXTRA_TABLES,
    shown=SHOWN,
    figures=figures,
    captions=CAPTIONS,
)
