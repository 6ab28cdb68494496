"""Kind `step`: G seeded random responses with seeded rewards (a memory/time measurement needs
shapes, not meaning), `cycles` GRPO steps in the chosen mode; with `replay`/`hold_all` one capture
serves every cycle, or each cycle captures anew (`recapture`: a cold first step and warm ones, each
doing what a peer's step does); with `replay.cuda_graph` the members run as one CUDA graph recorded in the
first cycle (phase `graph_record`) and launched in the others. With `responses.source: rollouts` the cycles are
the GRPO trainer's steps on one capture instead (`longstraw.training.trainer`): G responses sampled from the
resident state, the task's rewards, serial replay, the optimizer step; its phases add `sampling` (and
`ref_capture`, the reference policy's own capture of the prompt, when beta > 0) and its old log-probs come from
sampling.

Report: one row per point (mode, G, the peak and its measure, graph and resident bytes, time per
replayed member, the first step's seconds (cold: cuDNN plans and Triton autotuning inside it) and the
median of the others (warm), the loss; per-phase peaks and seconds are in the CSV and the figures); figures:
per-phase peak memory against the ceiling, peak memory against G per mode (when G varies), time per
member, seconds per phase."""

from __future__ import annotations

import statistics
import textwrap
from typing import TYPE_CHECKING

from longstraw.config import PointConfig, to_mapping
from longstraw.config.point import trainer_sections
from longstraw.kinds.spec import Kind
from longstraw.peers import PEER_MODES
from longstraw.results import as_dict, finite, is_cuda_point, number, phase_columns, phase_peaks, point_parts


def cycles_mapping(cfg: PointConfig, out_dir) -> dict:
    """The trainer's config for a step point with `responses.source: rollouts`: `cycles` steps on one
    prompt and one capture (refresh never), G samples of at most `responses.length` tokens, the point's
    optimizer."""
    r = cfg.responses
    return {
        **trainer_sections(cfg, out_dir),
        "task": {**r.task, "length": cfg.prompt.length},
        "steps": cfg.cycles,
        "steps_per_prompt": cfg.cycles,
        "seed": cfg.prompt.seed,
        "sampling": {"max_new_tokens": r.length},
        "optimizer": to_mapping(cfg.optimizer),
        "refresh": {"policy": "never"},
    }


if TYPE_CHECKING:
    from longstraw.kinds.common import Progress


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    from longstraw.core.member_graphs import MemberGraphs
    from longstraw.core.step import StepOptions, grpo_step
    from longstraw.kinds.common import capture_kwargs, optimizer_for, policy_and_prompt, seeded_group
    from longstraw.measure.collector import collector_frozen
    from longstraw.measure.memory import PhaseRecorder
    from longstraw.models.lora import trainable_parameters

    if cfg.responses.source == "rollouts":
        return run_rollouts(cfg, device, progress)
    recorder = PhaseRecorder(device)
    model, vocab, prompt = policy_and_prompt(cfg, recorder)
    responses, rewards = seeded_group(cfg, cfg.grpo.num_generations, vocab, device)
    optimizer = optimizer_for(model, cfg)
    with collector_frozen():
        if cfg.mode in PEER_MODES:
            return run_peer(cfg, model, prompt, responses, rewards, optimizer, recorder, progress)
        options = StepOptions(
            mode=cfg.mode,
            capture=capture_kwargs(cfg),
            members=cfg.responses.probe_members,
            checkpoint_layers=cfg.replay.checkpoint_layers,
            micro_batch=cfg.replay.micro_batch,
        )
        graphs = MemberGraphs() if cfg.replay.cuda_graph else None
        state, cycles = None, []
        announce_cycles(progress, recorder)
        for _ in range(cfg.cycles):
            step = grpo_step(
                model, prompt, responses, rewards, optimizer, cfg.grpo, options, state=state, graphs=graphs
            )
            state = None if cfg.recapture else step.state
            cycles.append(step.metrics)
            del step  # with recapture, the next capture starts with this step's state freed, not held beside it
            report_cycle(progress, cycles)
    return {
        "weights": recorder.phases["weights"],
        "trainable_parameters": trainable_parameters(model),
        "cycles": cycles,
        **summary(cycles),
    }


def run_rollouts(cfg: PointConfig, device, progress: Progress) -> dict:
    """`cycles` trainer steps on one capture of the task's prompt; each cycle's record is the
    transaction's (phases, graph and resident bytes) with the step's rewards, loss and gradient norm."""
    import tempfile

    from longstraw.measure.collector import collector_frozen
    from longstraw.measure.memory import PhaseRecorder
    from longstraw.models.lora import trainable_parameters
    from longstraw.training.trainer import Trainer

    recorder = PhaseRecorder(device)
    cycles = []
    with tempfile.TemporaryDirectory(prefix="longstraw-cycles-") as tmp:
        with recorder.phase("weights"):
            trainer = Trainer(cycles_mapping(cfg, tmp), source=f"{cfg.name} [rollouts]")
        with collector_frozen():  # as the seeded cycles and a trainer's run: no full collection inside a cycle
            for step in range(cfg.cycles):
                record = trainer.train_step(step)
                cycles.append({**record["transaction"], **{k: record[k] for k in ROLLOUT_KEYS}})
                progress.line(
                    f"cycle {step}: reward {record['reward_mean']:.3f}, loss {record['loss']:.4g}, "
                    f"{record['seconds']:.1f} s"
                )
                progress.partial({"cycles": cycles})
    return {
        "weights": recorder.phases["weights"],
        "trainable_parameters": trainable_parameters(trainer.model),
        "cycles": cycles,
        **summary(cycles),
    }


def run_peer(cfg: PointConfig, model, prompt, responses, rewards, optimizer, recorder, progress: Progress) -> dict:
    """`cycles` steps of a peer (`longstraw.peers`) on the same model, prompt, group and optimizer; its setup
    (imports, TRL's trainer) is the `peer_setup` phase, outside the steps."""
    from longstraw.models.lora import trainable_parameters
    from longstraw.peers import build_peer

    with recorder.phase("peer_setup"):
        peer = build_peer(cfg.mode, model, cfg.grpo, max_response_length=cfg.responses.length)
    announce_cycles(progress, recorder)
    cycles = []
    for _ in range(cfg.cycles):
        cycles.append(peer.step(prompt, responses, rewards, optimizer))
        report_cycle(progress, cycles)
    return {
        "weights": recorder.phases["weights"],
        "peer_setup": recorder.phases["peer_setup"],
        "trainable_parameters": trainable_parameters(model),
        "cycles": cycles,
        **summary(cycles),
    }


ROLLOUT_KEYS = ("reward_mean", "rewards", "loss", "grad_norm", "update_skipped", "response_tokens")


def announce_cycles(progress: Progress, recorder) -> None:
    """Said before the first step, which can run for minutes on a box that has not built this shape's attention
    plans or tuned its Triton kernels."""
    set_up = ", ".join(f"{name} {rec['seconds']:.1f} s" for name, rec in recorder.phases.items())
    progress.line(f"set up ({set_up}); cycle 0 builds what its kernels need (cuDNN plans, Triton autotuning)")


def report_cycle(progress: Progress, cycles: list) -> None:
    """A finished step's line (each phase's seconds, their sum, the peak) and the cycles so far as the partial
    result, so that a point cut off by its time limit still leaves the steps it finished."""
    phases = cycles[-1]["phases"]
    seconds = {name: rec["seconds"] for name, rec in phases.items()}
    peak = phase_peaks(phases)  # CUDA only
    progress.line(
        f"cycle {len(cycles) - 1}: "
        + ", ".join(f"{name} {s:.3f} s" for name, s in seconds.items())
        + f" (step {sum(seconds.values()):.3f} s)"
        + (f", peak {peak / 1e9:.2f} GB" if peak is not None else "")
    )
    progress.partial({"cycles": list(cycles), **summary(cycles)})


def summary(cycles: list) -> dict:
    """Peaks over all cycles per phase (seconds and compiled kernels summed, as repeated phases are), and
    the step's overall peak."""
    from longstraw.measure.memory import SUMMED  # torch: only where a step ran, not where its rows are read

    phases: dict = {}
    for c in cycles:
        for name, rec in c["phases"].items():
            agg = phases.setdefault(name, {"seconds": 0.0, "count": 0})
            agg["count"] += rec.get("count", 1)
            for key in SUMMED:
                if key in rec:
                    agg[key] = agg.get(key, 0) + rec[key]
            for key in ("peak_allocated_bytes", "peak_rss_bytes"):
                if key in rec:
                    agg[key] = max(agg.get(key, 0), rec[key])
    return {
        "phase_summary": phases,
        "peak_allocated_bytes": phase_peaks(phases),
        "graph_bytes_peak": max(c["graph_bytes_peak"] for c in cycles),
    }


# ------------------------------------------------------------------------------------------- report

STEP_PHASES = (
    "capture",
    "ref_capture",
    "sampling",
    "old_scoring",
    "ref_scoring",
    "graph_record",
    "replay",
    "forward_backward",
    "optimizer_step",
)
# What a reader checks a step point by (every column is in the experiment's CSV): its peak and what
# measured it, the graph and the resident state beside their prediction, time per member, the loss.
# Per-phase peaks are in the memory figure; context-parallel and rollout columns show where present.
SHOWN = [
    "model",
    "prompt_length",
    "mode",
    "source",
    "G",
    "response_length",
    "peak_memory_bytes",
    "peak_memory_measure",
    "graph_bytes_peak",
    "resident_bytes",
    "predicted_resident_bytes",
    "cp_size",
    "rank_peak_bytes_max",
    "seconds_per_member",
    "cold_step_seconds",
    "warm_step_seconds",
    "loss_last",
    "reward_mean",
]
CAPTIONS = {
    "memory_vs_ceiling": "Per-phase peak memory of each point against the memory ceiling (top; the title says "
    "which ceiling and why), and the autograd graph peak beside the resident state, measured "
    "and predicted (bottom). Left axes binary units (GiB), right axes decimal (GB, as the "
    "paper writes); a point that did not complete is marked on the x axis where it has no "
    "value.",
    "g_sweep_memory": "Peak memory against the group size G; colour: the mode (a shade per model), line style: "
    "the model. Replay should stay flat in G, hold_all grows with G. An out-of-memory point recorded no graph "
    "peak: it is marked on the x axis of that panel.",
    "time_per_member": "Seconds per replayed response (replay phase seconds / replays).",
    "phase_seconds": "Where a point's time goes: seconds per phase, summed over its cycles.",
}


def cycle_seconds(cycle: dict) -> float:
    """A step cycle's seconds: the sum of its phases' (a phase without seconds counts none)."""
    return sum(number(as_dict(r).get("seconds")) or 0.0 for r in as_dict(cycle.get("phases")).values())


def columns(point: dict) -> dict:
    cfg, metrics = point_parts(point)
    responses = as_dict(cfg.get("responses"))
    summary = as_dict(metrics.get("phase_summary"))
    cycles = [c for c in metrics.get("cycles") or [] if isinstance(c, dict)]
    replay = as_dict(summary.get("replay"))
    # Responses replayed over all cycles: hold_all times its G replays as one phase, so count
    # responses (not replay-phase entries) for the time per member.
    replays = sum(len(c.get("response_tokens") or []) for c in cycles) or None
    # a task's rewards mean something; a seeded point's are uniform draws, so it shows none
    rollouts = responses.get("source") == "rollouts"
    rewards = [number(c.get("reward_mean")) for c in cycles if rollouts and number(c.get("reward_mean")) is not None]
    cols = {
        "mode": cfg.get("mode"),
        "source": responses.get("source", "seeded"),
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
        "G": as_dict(cfg.get("grpo")).get("num_generations"),
        "response_length": responses.get("length"),
        "cycles": cfg.get("cycles"),
        "replays": replays,
    }
    if is_cuda_point(point):
        peak = metrics.get("peak_allocated_bytes", point.get("peak_allocated_bytes"))
        cols.update(peak_memory_bytes=number(peak), peak_memory_measure="peak_allocated_bytes")
    else:
        cols.update(peak_memory_bytes=number(point.get("peak_rss_bytes")), peak_memory_measure="process peak RSS")
    cols["graph_bytes_peak"] = number(metrics.get("graph_bytes_peak"))
    for key in ("resident_bytes", "predicted_resident_bytes", "prompt_positions"):
        values = [c[key] for c in cycles if number(c.get(key)) is not None]
        cols[key] = max(values) if values else None
    flags = [c["state_unchanged"] for c in cycles if "state_unchanged" in c]
    cols["state_unchanged"] = all(flags) if flags else None
    losses = [c.get("loss") for c in cycles]
    cols["loss_first"] = number(losses[0]) if losses else None
    cols["loss_last"] = number(losses[-1]) if losses else None
    cols["loss_finite"] = finite(losses)
    cols["grad_norm_finite"] = finite(c.get("grad_norm") for c in cycles)
    cols.update(_timing_columns(cycles, replays, replay))
    cols["trainable_parameters"] = metrics.get("trainable_parameters")
    for name in list(STEP_PHASES) + sorted(set(summary) - set(STEP_PHASES)):
        cols.update(phase_columns(name, as_dict(summary.get(name))))
    cols.update(phase_columns("weights", as_dict(metrics.get("weights"))))
    cols.update(phase_columns("peer_setup", as_dict(metrics.get("peer_setup"))))  # a peer's imports and trainer
    return cols


def _timing_columns(cycles: list[dict], replays: int | None, replay: dict) -> dict:
    """Seconds per replayed member, and per cycle: the mean, the cold (first) and the warm (median of the rest)."""
    cols = {}
    if replays and number(replay.get("seconds")) is not None:
        cols["seconds_per_member"] = replay["seconds"] / replays
    if cycles:
        per_cycle = [cycle_seconds(c) for c in cycles]
        cols["cycle_seconds_mean"] = sum(per_cycle) / len(per_cycle)
        # cold: the process's first step (cuDNN plans, Triton autotuning inside it); warm: the median of the rest
        cols["cold_step_seconds"] = per_cycle[0]
        cols["warm_step_seconds"] = statistics.median(per_cycle[1:]) if len(per_cycle) > 1 else None
    return cols


COMPILED = "_triton_cache_entries_added"  # a phase column: Triton kernels compiled or autotuned in the phase


def notes(row: dict, grid) -> list[str]:
    """A step phase that compiled or autotuned Triton kernels: its seconds hold that first-call cost."""
    phases = {
        column.removesuffix(COMPILED): int(value)
        for column, value in row.items()
        if column.endswith(COMPILED) and not column.startswith(("weights_", "peer_setup_")) and (number(value) or 0) > 0
    }
    if not phases:
        return []
    listed = ", ".join(f"{name} {count}" for name, count in phases.items())
    return [
        f"{row.get('point')}: Triton compiled or autotuned kernels inside the timed step ({listed} new cache "
        "entries), so those phases' seconds include first-call compilation, not only the step's work."
    ]


def figures(data, ceiling: dict, marks=()):
    """Step points: per-phase peaks against the ceiling, peak against G per mode (when G varies),
    time per member, seconds per phase."""
    step = data.of_kind("step")
    if not step:
        return
    cuda = any(r.get("peak_memory_measure") == "peak_allocated_bytes" for r in step)
    yield "memory_vs_ceiling", plot_memory_vs_ceiling(step, data.grid, ceiling, cuda, data.name)
    if len({r.get("G") for r in step if r.get("G") is not None}) > 1:
        yield "g_sweep_memory", plot_g_sweep_memory(step, ceiling, cuda, data.name)
    yield "time_per_member", plot_time_per_member(step, data.grid, data.name)
    yield "phase_seconds", plot_phase_seconds(step, data.grid, data.name)


def plot_memory_vs_ceiling(rows, grid, ceiling, cuda: bool, title: str):
    from longstraw.plotting import draw

    measure = "peak_allocated_bytes" if cuda else "peak_rss_bytes"
    phases = [p for p in STEP_PHASES if any(r.get(f"{p}_{measure}") is not None for r in rows)]
    labels = draw.point_labels(rows, grid)
    # + 3 inches for the legends beside the axes
    width = min(18, max(9, 5 + 0.75 * len(rows) * max(1, len(phases)) / 3)) + 3
    fig, (top, bottom) = draw.plt.subplots(2, 1, figsize=(width, 8.5))
    wrap = int(width * 9)  # title characters a line holds beside the legend (fontsize 9)
    peaks = [r.get(f"{p}_{measure}") for r in rows for p in phases] + [r.get("peak_memory_bytes") for r in rows]
    axis = draw.memory_axis(peaks + [ceiling.get("bytes")])
    xs, width = draw.bar_positions(len(rows), len(phases))
    for j, phase in enumerate(phases):
        heights = [(r.get(f"{phase}_{measure}") or 0) / axis.scale if r.get("status") == "ok" else 0 for r in rows]
        top.bar(xs[j], heights, width, label=phase, color=draw.PHASE_COLORS.get(phase))
    stated = draw.ceiling_line(top, ceiling, axis, peaks)
    for i, row in enumerate(rows):
        if row.get("status") != "ok":
            draw.mark_failed(top, i, row, axis.scale)
    what = (
        "peak allocated (torch.cuda.max_memory_allocated per phase)"
        if cuda
        else "process peak RSS up to the end of each phase (CPU; monotone over a run)"
    )
    axis.finish(top)
    top.set_title(
        textwrap.fill(f"{title}: {what}", wrap) + "\n" + textwrap.fill(f"ceiling: {stated}", wrap), fontsize=9
    )
    top.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    draw.bar_slots(top, len(rows))
    draw.legend_outside(top)
    _draw_graph_and_state(bottom, rows, labels, wrap)
    return fig


def _draw_graph_and_state(bottom, rows: list[dict], labels: list[str], wrap: int) -> None:
    """Per point: the autograd graph's peak and the resident state, measured beside predicted."""
    from longstraw.plotting import draw

    series = [
        ("graph_bytes_peak", "autograd graph peak", "#dd8452"),
        ("resident_bytes", "resident state (measured)", "#4c72b0"),
    ]
    values = [r.get(k) for r in rows for k, _, _ in series] + [r.get("predicted_resident_bytes") for r in rows]
    axis2 = draw.memory_axis(values)
    xs2, width2 = draw.bar_positions(len(rows), len(series))
    for j, (key, name, color) in enumerate(series):
        bottom.bar(
            xs2[j],
            [(r.get(key) or 0) / axis2.scale if r.get("status") == "ok" else 0 for r in rows],
            width2,
            label=name,
            color=color,
        )
    predicted = [
        (i, r["predicted_resident_bytes"] / axis2.scale)
        for i, r in enumerate(rows)
        if r.get("status") == "ok" and r.get("predicted_resident_bytes") is not None
    ]
    if predicted:
        bottom.plot(
            [xs2[1][i] for i, _ in predicted],
            [v for _, v in predicted],
            linestyle="none",
            marker="_",
            markersize=18,
            markeredgewidth=2.5,
            color="black",
            label="resident state (predicted)",
        )
    draw.mark_failed_bars(bottom, rows)  # a failed point measured no graph: on the axis, not at a value
    axis2.finish(bottom)
    bottom.set_title(
        textwrap.fill(
            "autograd saved-tensor peak and resident state per point (naive mode has no resident state)", wrap
        ),
        fontsize=9,
    )
    bottom.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    draw.bar_slots(bottom, len(rows))
    draw.legend_outside(bottom)


def by_mode(rows):
    """{line label: (colour, line style, rows)}: one line per mode, and per model where the rows hold
    several (e.g. two sweeps of one experiment on different models), each model its own line style and its
    own shade of the mode's colour, so two lines of one mode differ in colour too."""
    from longstraw.plotting.draw import LINE_STYLES, MODE_COLORS, shade

    models = list(dict.fromkeys(str(row.get("model")) for row in rows))
    lines: dict[str, tuple[str, str, list[dict]]] = {}
    for row in rows:
        mode, model = str(row.get("mode")), str(row.get("model"))
        label = mode if len(models) == 1 else f"{mode}, {model}"
        which = models.index(model)
        color = shade(MODE_COLORS.get(mode, "#4c72b0"), which)
        lines.setdefault(label, (color, LINE_STYLES[which % len(LINE_STYLES)], []))[2].append(row)
    return lines


def _draw_paper_points(ax, marks, scale: float) -> None:
    """The paper's per-G figures as hollow diamonds at their G, labelled with the paper's text."""
    from longstraw.plotting.draw import PAPER_COLOR

    for i, mark in enumerate(marks):
        g = mark["where"]["G"]
        ax.plot(
            [g],
            [mark["bytes"] / scale],
            marker="D",
            markersize=9,
            markerfacecolor="none",
            linestyle="none",
            markeredgecolor=PAPER_COLOR,
            markeredgewidth=1.8,
            label=mark["source"] if i == 0 else None,
        )
        ax.annotate(
            f"paper: {mark['text']}",
            (g, mark["bytes"] / scale),
            textcoords="offset points",
            xytext=(8, -10 if i else 4),
            color=PAPER_COLOR,
            fontsize=7,
        )


def plot_g_sweep_memory(rows, ceiling, cuda: bool, title: str, marks=()):
    """`marks`: the paper's figures at a G (`report.paper.reference_marks`), drawn on the peak panel.
    Colour is the mode, line style the model (where the rows hold several); one legend beside both
    panels, so it covers neither the lines nor the ceiling."""
    from longstraw.plotting import draw

    panels = [
        ("peak_memory_bytes", "peak allocated (CUDA)" if cuda else "process peak RSS (CPU)"),
        ("graph_bytes_peak", "autograd graph peak (saved tensors)"),
    ]
    marks = [m for m in marks if isinstance(m["where"].get("G"), (int, float))]
    fig, axes = draw.plt.subplots(1, 2, figsize=(14, 4.8))
    for ax, (key, name) in zip(axes, panels):
        _draw_g_panel(ax, rows, key, name, ceiling, cuda, marks)
    several = len({str(r.get("model")) for r in rows}) > 1
    draw.legend_outside(
        axes[-1],
        *draw.shared_legend(axes),
        title="colour: mode (a shade per model), line style: model" if several else "colour: mode",
        title_fontsize=7,
        handlelength=4,  # long enough to show a dashed line's dashes
    )
    fig.suptitle(f"{title}: peak memory against G", fontsize=10)
    return fig


def _draw_g_panel(ax, rows: list[dict], key: str, name: str, ceiling: dict, cuda: bool, marks: list[dict]) -> None:
    """One measure against G, a line per mode (and model), failed steps on the axis; on the peak panel the
    ceiling (CUDA) and the paper's points."""
    from longstraw.plotting import draw

    peak = key == "peak_memory_bytes"
    drawn_ceiling = [ceiling.get("bytes")] if peak and cuda else []
    axis = draw.memory_axis([r.get(key) for r in rows] + ([m["bytes"] for m in marks] if peak else []) + drawn_ceiling)
    for label, (color, style, members) in by_mode(rows).items():
        ok = sorted((r for r in draw.ok(members) if r.get(key) is not None), key=lambda r: r["G"])
        if ok:
            ax.plot(
                [r["G"] for r in ok],
                [r[key] / axis.scale for r in ok],
                marker="o",
                label=label,
                color=color,
                linestyle=style,
            )
    for row in draw.failed(rows):  # an oom step recorded its peak, never its graph: that one on the axis
        if row.get("G") is not None:
            draw.mark_failed(ax, row["G"], row, axis.scale, value_key=key)
    if drawn_ceiling:
        name += "\nceiling: " + draw.ceiling_line(ax, ceiling, axis, [r.get(key) for r in draw.ok(rows)])
    if peak:
        _draw_paper_points(ax, marks, axis.scale)
    ax.set_xscale("log", base=2)
    gs = sorted({r["G"] for r in rows if r.get("G") is not None} | {m["where"]["G"] for m in marks})
    ax.set_xticks(gs, [str(g) for g in gs])
    ax.set_xlabel("G (responses per prompt)")
    axis.finish(ax)
    ax.set_title("\n".join(textwrap.fill(line, 60) for line in name.split("\n")), fontsize=9)


def plot_time_per_member(rows, grid, title: str):
    from longstraw.plotting import draw

    gs = {r.get("G") for r in rows if r.get("G") is not None}
    lines = len(gs) > 1
    fig, ax = draw.plt.subplots(figsize=(10, 4.5) if lines else (min(16, max(6, 4 + 0.7 * len(rows))), 4.5))
    if lines:
        for label, (color, style, members) in by_mode(rows).items():
            ok = sorted((r for r in draw.ok(members) if r.get("seconds_per_member") is not None), key=lambda r: r["G"])
            if ok:
                ax.plot(
                    [r["G"] for r in ok],
                    [r["seconds_per_member"] for r in ok],
                    marker="o",
                    label=label,
                    color=color,
                    linestyle=style,
                )
        for row in draw.failed(rows):
            if row.get("G") is not None:
                draw.mark_failed(ax, row["G"], row, value_key=None)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(gs), [str(g) for g in sorted(gs)])
        ax.set_xlabel("G (responses per prompt)")
        draw.legend_outside(ax, handlelength=4)  # long enough to show a dashed line's dashes
    else:
        ax.bar(
            range(len(rows)),
            [r.get("seconds_per_member") or 0 if r.get("status") == "ok" else 0 for r in rows],
            color=[draw.MODE_COLORS.get(str(r.get("mode")), "#4c72b0") for r in rows],
        )
        draw.mark_failed_bars(ax, rows)
        ax.set_xticks(range(len(rows)), draw.point_labels(rows, grid), rotation=30, ha="right", fontsize=8)
        draw.bar_slots(ax, len(rows))
    ax.set_ylim(bottom=0)
    ax.set_ylabel("seconds per replayed member (s)")
    ax.set_title(f"{title}: time per member", fontsize=10)
    return fig


def plot_phase_seconds(rows, grid, title: str):
    from longstraw.plotting import draw

    phases = [p for p in STEP_PHASES if any(r.get(f"{p}_seconds") is not None for r in rows)]
    fig, ax = draw.plt.subplots(figsize=(min(18, 6 + 0.7 * len(rows)), 4.8))  # 2 inches of it: the legend
    base = [0.0] * len(rows)
    for phase in phases:
        heights = [(r.get(f"{phase}_seconds") or 0.0) if r.get("status") == "ok" else 0.0 for r in rows]
        ax.bar(range(len(rows)), heights, bottom=base, label=phase, color=draw.PHASE_COLORS.get(phase))
        base = [b + h for b, h in zip(base, heights)]
    draw.mark_failed_bars(ax, rows)
    ax.set_xticks(range(len(rows)), draw.point_labels(rows, grid), rotation=30, ha="right", fontsize=8)
    draw.bar_slots(ax, len(rows))
    ax.set_ylabel("seconds (s), summed over cycles")
    ax.set_title(f"{title}: seconds per phase", fontsize=10)
    if phases:  # points that all failed have no phase to label
        draw.legend_outside(ax)
    return fig


KIND = Kind(
    "step",
    run=run,
    modes=lambda cfg: [cfg.mode],
    step_options=True,
    columns=columns,
    shown=SHOWN,
    notes=notes,
    figures=figures,
    captions=CAPTIONS,
)
