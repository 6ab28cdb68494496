"""Kind `pretrain`: train a preset from random initialisation on a synthetic task
(`longstraw.training.pretrain`, settings in the point's `pretrain` section, its own model and
device included) and save the checkpoint to `pretrain.out` (`OUT/checkpoint`, which later points
load through `model.path`; the pipeline runs them after this point).

Report: one row per point (parameters, steps, tokens per second, the final held-out accuracy per
prompt length against the task's chance); its evaluations over training in a table of their own;
figure: the training loss and the held-out accuracy by length over the steps."""

from __future__ import annotations

from typing import TYPE_CHECKING

from longstraw.cells import ExtraTable, as_dict, number, point_parts, rows_of_points
from longstraw.config import PointConfig
from longstraw.kinds.checks import check_named_preset, check_task


def check(cfg: PointConfig, source: str) -> None:
    """Its model a preset this package has, its task one it can build."""
    check_named_preset(cfg.pretrain.model, f"{source}: pretrain.model")
    check_task(cfg.pretrain.task, cfg.prompt.length, f"{source}: pretrain.task")


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
