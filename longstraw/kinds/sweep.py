"""Kind `sweep`: one capture serving a series of steps, `sweep.replay` then `sweep.hold_all` group
sizes in order, each mode stopping at its first out-of-memory step (recorded with the peak it
reached); a group size listed twice runs twice on the one state, cold then warm. Capture is
measured as in `capture` (attention time and rate included), and with `measure.kernel_rates` the
run also times torch's causal SDPA and the attention and GEMM kernels on this device, so ratios
against them come from one run.

Report: one row per point (its one capture, and a summary of the steps it served), one row per
step in a table of its own (`steps`, read beside step points' rows by the paper's figures and
the validation levels), the capture in a sentence; figures: peak against G per mode (when G
varies within a mode) with the paper's figures beside it, and each point's per-phase peaks, its
capture once then every step, against the ceiling."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from longstraw.config import PointConfig
from longstraw.config.point import with_group
from longstraw.kinds.capture import capture_columns
from longstraw.kinds.columns import common_columns
from longstraw.kinds.spec import Kind
from longstraw.kinds.step import STEP_PHASES, plot_g_sweep_memory
from longstraw.results import (
    ExtraTable,
    as_dict,
    finite,
    is_cuda_point,
    max_number,
    number,
    phase_columns,
    phase_peaks,
    phase_seconds,
    point_parts,
    ratio,
    rows_of_points,
    status_of,
)


@dataclass
class SweepConfig:
    """One capture serving steps at these group sizes: replay's, then hold_all's."""

    replay: list[int] = field(default_factory=lambda: [2, 8])
    hold_all: list[int] = field(default_factory=lambda: [2, 4, 8])

    def __post_init__(self):
        for mode in ("replay", "hold_all"):
            if any(g < 1 for g in getattr(self, mode)):
                raise ValueError(f"{mode}: group sizes must be >= 1, got {getattr(self, mode)}")


if TYPE_CHECKING:
    from longstraw.kinds.common import Progress


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    from longstraw.kinds.common import compute_dtype, measure_capture, model_config, optimizer_for, policy_and_prompt
    from longstraw.measure.memory import PhaseRecorder
    from longstraw.models.lora import trainable_parameters

    recorder = PhaseRecorder(device)
    model, vocab, prompt = policy_and_prompt(cfg, recorder)
    out = {"weights": recorder.phases["weights"], "trainable_parameters": trainable_parameters(model)}
    if cfg.measure.kernel_rates:
        from longstraw.kernels.rates import measure_kernel_rates

        out["kernel_rates"] = measure_kernel_rates(
            model_config(model),
            device=device,
            model=model,
            response_length=cfg.responses.length,
            dtype=compute_dtype(cfg),
            sdpa_positions=cfg.measure.sdpa_positions,
        )
    out["capture"], state = measure_capture(model, prompt, cfg, recorder)
    out["capture"]["phase"] = recorder.phases["capture"]
    if "kernel_rates" in out:
        from longstraw.measure.flops import capture_floor_seconds, capture_linear_parameters

        config = model_config(model)
        out["capture"]["floor"] = capture_floor_seconds(
            config, capture_linear_parameters(model, config), state.positions, out["kernel_rates"]
        )
    out["steps"] = []
    progress.partial(out)
    optimizer = optimizer_for(model, cfg)
    for mode in ("replay", "hold_all"):
        for index, count in enumerate(getattr(cfg.sweep, mode)):
            # the allocator's stack traces slow every allocation: a G repeated is traced once, its later steps timed
            traced = cfg.measure.allocation_sites and count not in getattr(cfg.sweep, mode)[:index]
            step = _step(model, prompt, state, optimizer, cfg, mode, count, vocab, device, traced)
            out["steps"].append(step)
            peak = step.get("peak_allocated_bytes")
            if getattr(state, "cp", None) is None or state.cp.rank == 0:  # one line per step, not per rank
                progress.line(
                    f"sweep {mode} G={count}: {step['status']}" + (f", peak {peak / 2**30:.2f} GiB" if peak else "")
                )
            progress.partial(out)
            if "oom" in step.get("rank_status", [step["status"]]):
                break
    return out


def _step(model, prompt, state, optimizer, cfg, mode: str, count: int, vocab: int, device, traced: bool) -> dict:
    """One step of the sweep on the shared state, its allocation sites `traced`; an out-of-memory step is recorded
    with its peak."""
    import torch

    from longstraw.core.step import StepOptions, grpo_step
    from longstraw.kinds.common import current_memory, seeded_group
    from longstraw.measure.allocation_sites import AllocationSites

    responses, rewards = seeded_group(cfg, count, vocab, device)
    step = {"mode": mode, "count": count}
    sites = AllocationSites(device, enabled=traced)
    before = current_memory(device)
    try:
        options = StepOptions(
            mode=mode,
            checkpoint_layers=cfg.replay.checkpoint_layers,
            micro_batch=cfg.replay.micro_batch if mode == "replay" else 1,
        )
        with sites:
            metrics = grpo_step(
                model, prompt, responses, rewards, optimizer, with_group(cfg.grpo, count), options, state=state
            ).metrics
        step.update(status="ok", **metrics, peak_allocated_bytes=phase_peaks(metrics["phases"]))
        replay_peak = metrics["phases"]["replay"].get("peak_allocated_bytes")
        if replay_peak is not None:  # above the weights, the pages and anything else alive before the step
            step["replay_transient_bytes"] = replay_peak - before
    except torch.OutOfMemoryError as exc:
        step.update(
            status="oom",
            error=str(exc).splitlines()[0],
            peak_allocated_bytes=(torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None),
        )
    if sites.result is not None:
        step["allocation_sites"] = sites.result
    optimizer.zero_grad(set_to_none=True)
    del responses
    if device.type == "cuda":
        torch.cuda.empty_cache()
    if getattr(state, "cp", None) is not None:  # each rank's peak; an OOM on any rank ends the mode on all
        ranks = state.cp.all_gather_objects(
            {"status": step["status"], "peak_allocated_bytes": step.get("peak_allocated_bytes")}
        )
        step["rank_peak_allocated_bytes"] = [r["peak_allocated_bytes"] for r in ranks]
        step["rank_status"] = [r["status"] for r in ranks]
    return step


# ------------------------------------------------------------------------------------------- report

# The point row: its one capture (the note states it in full) and the steps it served; every column
# is in the CSV, each step's per-phase peaks in its figure.
SHOWN = [
    "model",
    "model_type",
    "prompt_length",
    "positions",
    "resident_bytes",
    "predicted_resident_bytes",
    "transient_bytes",
    "capture_seconds",
    "capture_attention_tflops_per_second",
    "steps",
    "steps_ok",
    "steps_oom",
    "peak_memory_bytes",
    "cp_size",
    "rank_peak_bytes_max",
]
STEP_COLUMNS = [
    "point",
    "step",
    "mode",
    "G",
    "status",
    "peak_memory_bytes",
    "rank_peak_bytes_max",
    "headroom_bytes",
    "graph_bytes_peak",
    "replay_transient_bytes",
    "step_seconds",
    "seconds_per_member",
    "logp_mismatch_max",
    "loss",
    "error",
    "report_error",
]
EXTRA_TABLES = {
    "steps": ExtraTable(
        "Sweep steps",
        STEP_COLUMNS,
        "One row per GRPO step, in the order they ran, every one served by its point's single capture (the table "
        "above). Peak: torch.cuda.max_memory_allocated over the step (an OOM step: the peak it reached when it ran "
        "out; its mode stopped there). Headroom: the device's total memory minus that peak. Replay transient: the "
        "replay phase's peak above what was allocated before the step (weights, pages, optimizer state). Log p "
        "mismatch: the largest |log p_replay - log p_old| over the step's tokens, before its update. Step seconds: "
        "the sum of the step's phases.",
        key="sweep_steps",
        beside_points=True,
    ),
}
SCALING_COLUMNS = [
    "point",
    "source",
    "model",
    "prompt_length",
    "cp_size",
    "schedule",
    "capture_seconds",
    "attention_seconds",
    "other_seconds",
    "waiting_seconds",
    "communication_seconds",
    "residual_seconds",
    "model_seconds",
    "model_over_measured_ratio",
    "fits_ten_minutes",
    "role",
    "basis",
    "result_file",
    "report_error",
]


def scaling_note(rows: list[dict]) -> str:
    """What calibrated the CP scaling model and its leave-one-out error on each 2-rank point, from the table's rows."""
    two_rank = [
        r
        for r in rows
        if r.get("source") == "measured" and r.get("cp_size") == 2 and number(r.get("model_seconds")) is not None
    ]
    calibrating = next((r for r in two_rank if "calibration" in str(r.get("role"))), None)
    if calibrating is None:
        return ""

    def held_out(r):
        stated = f", stated error \u00b1{r['stated_error']:.0%}" if number(r.get("stated_error")) else ""
        return (
            f"{r['point']} ({r['schedule']}) at {r['model_seconds']:.1f} s against {r['capture_seconds']:.1f} s "
            f"measured ({r['model_over_measured_ratio'] - 1:+.1%}{stated})"
        )

    return (
        f"Measured rows are recorded captures (result_file). Predicted rows come from longstraw.cp.scaling, "
        f"calibrated on the measured rows whose role says calibration: per-rank rates from the single-GPU "
        f"captures (attention seconds per FLOP from their AttentionTimer, the rest per position, split over "
        f"ranks) and, for the pipeline only, the 2-rank run's rank-0 attention rate and residual "
        f"({calibrating['point']}). Calibrated without any 2-rank run the model predicts "
        + "; ".join(held_out(r) for r in two_rank if "check" in str(r.get("role")))
        + "."
    )


EXTRA_TABLES["cp_scaling"] = ExtraTable(
    "Context-parallel capture time: measured and predicted", SCALING_COLUMNS, scaling_note, key="cp_scaling"
)

CAPTIONS = {
    "sweep_memory": "Peak allocated memory of each sweep step against G (left) and its autograd graph peak "
    "(right); colour: the mode (a shade per model), line style: the model. The OOM step is drawn at the peak it "
    "reached on the left and, having no graph peak, on the x axis on the right; the device "
    "ceiling and the paper's per-rank figures (GB, read off the right-hand axis) beside ours.",
    "step_phase_peaks": "Per-phase peak memory of one sweep point: its weights and its one capture, then each step "
    "it served, against the device ceiling (top); seconds per replayed member per step (bottom).",
}


def _sweep_capture(metrics) -> dict:
    """A sweep's capture metrics shaped as a capture point's (its phase record under `phases`)."""
    capture = as_dict(metrics.get("capture"))
    return {**capture, "phases": {"capture": as_dict(capture.get("phase"))}}


def columns(point: dict) -> dict:
    """The sweep point as a whole: its one capture, and a summary of the steps it served (each
    step is a row of `steps`). The peak is the largest that fitted: capture's or an ok step's (an
    oom step's peak is the allocator at the device's limit, shown on its step row)."""
    cfg, metrics = point_parts(point)
    cuda = is_cuda_point(point)
    capture = _sweep_capture(metrics)
    cols = capture_columns(point, capture, cuda)
    steps = step_rows(point)
    ok = [s for s in steps if s["status"] == "ok"]
    attention = as_dict(capture.get("capture_attention"))
    fitted = [cols.get("capture_peak_allocated_bytes")] + [s.get("peak_memory_bytes") for s in ok]
    fitted = [v for v in fitted if v is not None]
    cols.update(
        capture_attention_seconds=number(attention.get("seconds")),
        capture_attention_tflops_per_second=number(attention.get("tflops_per_second")),
        response_length=as_dict(cfg.get("responses")).get("length"),
        trainable_parameters=metrics.get("trainable_parameters"),
        steps=len(steps),
        steps_ok=len(ok),
        steps_oom=sum(s["status"] == "oom" for s in steps),
        replays=sum(s.get("replays") or 0 for s in ok) or None,
        peak_memory_bytes=max(fitted) if cuda and fitted else number(point.get("peak_rss_bytes")),
        peak_memory_measure="peak_allocated_bytes" if cuda else "process peak RSS",
    )
    cols.update(phase_columns("weights", as_dict(metrics.get("weights"))))
    return cols


def step_rows(point: dict) -> list[dict]:
    """One row per step of a sweep point, in the order they ran (`step`, from 1). Each row carries
    the point's model and prompt, so it reads (and is checked for V1) like a step point's row."""
    metrics = point_parts(point)[1]
    common = common_columns(point)
    identity = {
        k: common[k] for k in ("model", "model_type", "family", "device", "prompt_length", "device_memory_bytes")
    }
    steps = [s for s in metrics.get("steps") or [] if isinstance(s, dict)]
    return [_step_row(point, index, step, identity) for index, step in enumerate(steps, 1)]


def _step_row(point, index: int, step: dict, identity: dict) -> dict:
    phases = as_dict(step.get("phases"))
    status = status_of(step.get("status"))
    peak = number(step.get("peak_allocated_bytes"))
    # hold_all times its G replays as one phase: count responses, not replay-phase entries
    members = len(step.get("response_tokens") or []) or None
    row = {
        "point": point.get("point"),
        "step": index,
        "kind": "step",
        "mode": step.get("mode"),
        "G": step.get("count"),
        "status": status,
        "error": step.get("error"),
        **identity,
        "peak_memory_bytes": peak,
        "peak_memory_measure": "peak_allocated_bytes" + (" at OOM" if status == "oom" else ""),
        "headroom_bytes": identity["device_memory_bytes"] - peak
        if peak is not None and identity["device_memory_bytes"]
        else None,
        "graph_bytes_peak": number(step.get("graph_bytes_peak")),
        "replay_transient_bytes": number(step.get("replay_transient_bytes")),
        # |log p_replay - log p_old| before the update (0: scoring and replay agree bit for bit)
        "logp_mismatch_max": number(as_dict(step.get("logp_mismatch")).get("max")),
        "rank_peak_bytes_max": max_number(step.get("rank_peak_allocated_bytes")),
        "step_seconds": phase_seconds(phases),
        "replays": members,
        "seconds_per_member": ratio(as_dict(phases.get("replay")).get("seconds"), members),
        "resident_bytes": number(step.get("resident_bytes")),
        "predicted_resident_bytes": number(step.get("predicted_resident_bytes")),
        "prompt_positions": number(step.get("prompt_positions")),
        "loss": number(step.get("loss")),
        "grad_norm": number(step.get("grad_norm")),
        "loss_finite": finite([step.get("loss")]) if "loss" in step else None,
        "grad_norm_finite": finite([step.get("grad_norm")]) if "grad_norm" in step else None,
        "state_unchanged": step.get("state_unchanged"),
    }
    for name in list(STEP_PHASES) + sorted(set(phases) - set(STEP_PHASES)):
        row.update(phase_columns(name, as_dict(phases.get(name))))
    return row


def tables(points: list[dict]) -> dict[str, list[dict]]:
    """A sweep's steps; beside context-parallel H200 points, the CP scaling model's table too."""
    out = {"steps": rows_of_points(points, step_rows)}
    records = {p["results_dir"] for p in points if _h200_cp(p) and "results_dir" in p}
    if len(records) == 1:
        out["cp_scaling"] = scaling_rows(records.pop())
    return out


def _h200_cp(point: dict) -> bool:
    cfg = point_parts(point)[0]
    return (number(cfg.get("cp_size")) or 1) > 1 and "H200" in str(as_dict(point.get("provenance")).get("device"))


def scaling_rows(records) -> list[dict]:
    """Measured and predicted capture times over ranks (`longstraw.cp.scaling`, calibrated on the H200 files in the
    folder `records`; it imports torch, as the GPU targets do, so only here)."""
    try:
        from longstraw.cp.scaling import table_rows

        return table_rows(records)
    except (OSError, KeyError, ValueError) as exc:
        return [
            {
                "point": "cp scaling model",
                "source": "predicted",
                "report_error": f"not computed: {type(exc).__name__}: {exc}",
            }
        ]


def notes(row: dict, grid) -> list[str]:
    """A sweep's one capture, in a sentence: what it held, what it cost, what it served."""
    if row.get("positions") is None:
        return []
    from longstraw.plotting.formatting import format_value

    def show(column):
        return format_value(column, row.get(column))

    return [
        f"{row.get('point')}: one capture of {show('positions')} positions in {show('capture_seconds')} "
        f"(attention {show('capture_attention_tflops_per_second')}); resident state {show('resident_bytes')} "
        f"measured against {show('predicted_resident_bytes')} predicted "
        f"({show('bytes_per_position_measured')} against {show('bytes_per_position_predicted')}), "
        f"capture transient {show('transient_bytes')}; steps it served: {show('steps')} "
        f"({show('steps_ok')} ok, {show('steps_oom')} oom)."
    ]


def figures(data, ceiling: dict, marks=()):
    """Peak against G per mode where G varies within a mode (the paper's per-G figures beside it),
    and each sweep point's per-phase peaks (the paper's figures that name no G beside them)."""
    steps = data.extra.get("steps", [])
    marks = [m for m in marks if "bytes" in m]
    gs_per_mode = {}
    for step in steps:
        gs_per_mode.setdefault(step.get("mode"), set()).add(step.get("G"))
    if any(len(gs) > 1 for gs in gs_per_mode.values()):
        cuda = any(str(s.get("peak_memory_measure")).startswith("peak_allocated_bytes") for s in steps)
        yield (
            "sweep_memory",
            plot_g_sweep_memory([s for s in steps if s.get("kind") == "step"], ceiling, cuda, data.name, marks),
        )
    for row in data.of_kind("sweep"):
        mine = [s for s in steps if s.get("point") == row.get("point") and s.get("kind") == "step"]
        yield f"step_phase_peaks.{row.get('point')}", plot_step_phase_peaks(row, mine, ceiling, data.name, marks)


def _step_label(step: dict) -> str:
    label = f"#{step.get('step')} {step.get('mode')}\nG={step.get('G')}"
    return label if step.get("status") == "ok" else f"{label} ({str(step.get('status')).upper()})"


def plot_step_phase_peaks(row: dict, steps: list[dict], ceiling: dict, title: str, marks=()):
    """One sweep point: weights and capture (once), then each step's phase peaks, against the
    ceiling; the paper's figures that name no G (e.g. its operating point's peak) as dotted lines."""
    import textwrap

    from longstraw.plotting import draw

    groups = [("weights +\ncapture", {p: row.get(f"{p}_peak_allocated_bytes") for p in ("weights", "capture")}, None)]
    groups += [(_step_label(s), {p: s.get(f"{p}_peak_allocated_bytes") for p in STEP_PHASES[1:]}, s) for s in steps]
    marks = [m for m in marks if "G" not in m["where"]]
    values = [v for _, peaks, _ in groups for v in peaks.values()] + [s.get("peak_memory_bytes") for s in steps]
    axis = draw.memory_axis(values + [ceiling.get("bytes")] + [m["bytes"] for m in marks])
    width = min(20, max(12, 6 + 1.1 * len(groups)))  # 3 inches of it: the legend beside the axes
    fig, (top, bottom) = draw.plt.subplots(2, 1, figsize=(width, 8.5), gridspec_kw={"height_ratios": [2, 1]})
    _draw_phase_bars(top, groups, axis)
    stated = draw.ceiling_line(top, ceiling, axis, values)
    for mark in marks:
        top.axhline(
            mark["bytes"] / axis.scale,
            color=draw.PAPER_COLOR,
            linestyle=":",
            linewidth=1.5,
            label=textwrap.fill(f"{mark['source']}: {mark['text']}", 44),
        )
    top.set_xticks(range(len(groups)), [g[0] for g in groups], fontsize=8)
    draw.bar_slots(top, len(groups))
    axis.finish(top)
    top.set_title(
        textwrap.fill(
            f"{title} / {row.get('point')}: peak allocated per phase (torch.cuda.max_memory_allocated)", int(width * 9)
        )
        + "\n"
        + textwrap.fill(f"ceiling: {stated}", int(width * 9)),
        fontsize=9,
    )
    draw.legend_outside(top)
    _draw_member_seconds(bottom, row, steps, [g[0] for g in groups])
    bottom.set_xlim(top.get_xlim())
    return fig


def _draw_phase_bars(ax, groups: list, axis) -> None:
    """Each group's phase peaks side by side; a step that failed marked at the peak it reached."""
    from longstraw.plotting import draw

    labelled = set()
    for i, (_, peaks, step) in enumerate(groups):
        present = [(p, v) for p, v in peaks.items() if v is not None]
        if step is not None and step.get("status") != "ok":
            draw.mark_failed(ax, i, step, axis.scale)  # the peak the allocator reached when it ran out
            continue
        bar = 0.8 / max(len(present), 1)
        for j, (phase, value) in enumerate(present):
            ax.bar(
                i - 0.4 + bar * (j + 0.5),
                value / axis.scale,
                bar,
                color=draw.PHASE_COLORS.get(phase),
                label=phase if phase not in labelled else None,
            )
            labelled.add(phase)


def _draw_member_seconds(ax, row: dict, steps: list[dict], labels: list[str]) -> None:
    """Seconds per replayed member of each step, under the peaks (the first slot, the capture's, left empty)."""
    from longstraw.plotting import draw

    per_member = [s.get("seconds_per_member") if s.get("status") == "ok" else None for s in steps]
    ax.bar(
        range(1, len(labels)),
        [v or 0 for v in per_member],
        color=[draw.MODE_COLORS.get(str(s.get("mode")), "#4c72b0") for s in steps],
        width=0.6,
    )
    for i, (step, value) in enumerate(zip(steps, per_member), 1):
        if value is not None:
            ax.annotate(
                f"{value:.2f} s", (i, value), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7
            )
        elif step.get("status") != "ok":
            draw.mark_failed(ax, i, step, value_key=None)
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylabel("s per member")
    capture = row.get("capture_seconds")
    ax.set_title(
        "seconds per replayed member (replay phase / responses)"
        + (
            f"; the one capture took {capture:,.1f} s for {row.get('positions') or 0:,} positions"
            if capture is not None
            else ""
        ),
        fontsize=9,
    )


KIND = Kind(
    "sweep",
    run=run,
    section=SweepConfig,
    columns=columns,
    tables=tables,
    extra_tables=EXTRA_TABLES,
    shown=SHOWN,
    notes=notes,
    figures=figures,
    captions=CAPTIONS,
)
