"""Kind `capture`: capture only; time, positions/s, resident bytes against the prediction and the
transient memory (peak minus what was there before minus the resident state), then one timed
replay (forward + backward) of a response of `responses.length`.

Report: one row per point (positions, capture time and rate, resident bytes measured against
predicted, per position too, the transient); figures: resident bytes per position measured
against predicted, and capture throughput, per model type (a sweep's capture joins them where
there is more than one capture to compare)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from longstraw.config import PointConfig
from longstraw.kinds.spec import Kind
from longstraw.results import as_dict, is_cuda_point, number, phase_columns, point_parts, ratio

if TYPE_CHECKING:
    from longstraw.kinds.common import Progress


def run(cfg: PointConfig, device, progress: Progress) -> dict:
    from longstraw.core.transaction import replay
    from longstraw.kinds.common import measure_capture, policy_and_prompt, seeded_tokens
    from longstraw.measure.memory import PhaseRecorder

    recorder = PhaseRecorder(device)
    model, vocab, prompt = policy_and_prompt(cfg, recorder)
    metrics, state = measure_capture(model, prompt, cfg, recorder)
    response = seeded_tokens(cfg.responses.length, cfg.responses.seed, vocab, device)
    with recorder.phase("replay"):
        replay(model, state, response).sum().backward()
    return {
        "phases": recorder.phases,
        **metrics,
        "replay_seconds": recorder.phases["replay"]["seconds"],
        "response_length": int(response.numel()),
    }


# ------------------------------------------------------------------------------------------- report

SHOWN = [
    "model",
    "model_type",
    "prompt_length",
    "positions",
    "capture_seconds",
    "positions_per_second",
    "resident_bytes",
    "predicted_resident_bytes",
    "bytes_per_position_measured",
    "bytes_per_position_predicted",
    "transient_bytes",
    "replay_seconds",
    "peak_memory_bytes",
    "peak_memory_measure",
]
CAPTIONS = {
    "resident_per_position": "Resident state bytes per prompt position, measured (state.nbytes) against the "
    "analytical prediction from the config, per model type.",
    "capture_throughput": "Capture throughput (positions per second) per model type.",
}


def columns(point: dict) -> dict:
    return capture_columns(point, point_parts(point)[1], is_cuda_point(point))


def capture_columns(point: dict, metrics: dict, cuda: bool) -> dict:
    """The capture's cells from capture metrics (a capture point's, or a sweep's one capture shaped
    like them: its phase record under `phases`)."""
    capture_phase = as_dict(as_dict(metrics.get("phases")).get("capture"))
    positions = number(metrics.get("positions"))
    resident, predicted = number(metrics.get("resident_bytes")), number(metrics.get("predicted_resident_bytes"))
    measured_pp = metrics.get("bytes_per_position_measured", ratio(resident, positions))
    predicted_pp = metrics.get("bytes_per_position_predicted", ratio(predicted, positions))
    peak = capture_phase.get("peak_allocated_bytes") if cuda else point.get("peak_rss_bytes")
    cols = {
        "positions": positions,
        "positions_per_second": number(metrics.get("positions_per_second")),
        "capture_seconds": number(capture_phase.get("seconds")),
        "resident_bytes": resident,
        "predicted_resident_bytes": predicted,
        "bytes_per_position_measured": number(measured_pp),
        "bytes_per_position_predicted": number(predicted_pp),
        "resident_to_predicted_ratio": ratio(resident, predicted),
        "transient_bytes": number(metrics.get("transient_bytes")),
        "peak_memory_bytes": number(peak if point.get("status") != "oom" else point.get("peak_allocated_bytes", peak)),
        "peak_memory_measure": "peak_allocated_bytes" if cuda else "process peak RSS",
        "replay_seconds": number(metrics.get("replay_seconds")),
        "response_length": metrics.get("response_length"),
    }
    cols.update(phase_columns("capture", capture_phase))
    return cols


def figures(data, ceiling: dict, marks=()):
    """Capture points, and sweeps' captures beside them: a lone sweep's capture is stated in its
    table; a figure is worth it beside other captures."""
    captured = [
        r
        for r in data.rows
        if r.get("kind") == "capture" or (r.get("kind") == "sweep" and r.get("positions") is not None)
    ]
    if captured and (len(captured) > 1 or captured[0].get("kind") == "capture"):
        yield "resident_per_position", plot_resident_per_position(captured, data.grid, data.name)
        yield "capture_throughput", plot_capture_throughput(captured, data.grid, data.name)


def _capture_labels(rows, grid) -> list[str]:
    """Model type and prompt length per bar; the model's name instead where two bars share a type
    (a preset and a real model's shape of one family)."""
    from longstraw.plotting.draw import point_labels

    types = [r.get("model_type") for r in rows]
    labels = []
    for row, named in zip(rows, point_labels(rows, grid)):
        label = row.get("model_type") or named
        if types.count(row.get("model_type")) > 1 and row.get("model"):
            label = row["model"]
        labels.append(
            f"{label}\n{row.get('prompt_length')} pos" if row.get("prompt_length") is not None else str(label)
        )
    return labels


def plot_resident_per_position(rows, grid, title: str):
    from longstraw.plotting import draw
    from longstraw.plotting.formatting import format_bytes

    fig, ax = draw.plt.subplots(figsize=(max(9, 1.3 * len(rows) + 5), 4.8))  # 2 inches of it: the legend
    series = [
        ("bytes_per_position_measured", "measured (state.nbytes / positions)", "#4c72b0"),
        ("bytes_per_position_predicted", "predicted (from the config)", "#bcbcbc"),
    ]
    axis = draw.memory_axis([r.get(k) for r in rows for k, _, _ in series])
    xs, width = draw.bar_positions(len(rows), len(series))
    for j, (key, name, color) in enumerate(series):
        heights = [(r.get(key) or 0) / axis.scale if r.get("status") == "ok" else 0 for r in rows]
        bars = ax.bar(xs[j], heights, width, label=name, color=color)
        for bar, row in zip(bars, rows):
            if row.get("status") == "ok" and row.get(key) is not None:
                ax.annotate(
                    format_bytes(row[key]),
                    (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    textcoords="offset points",
                    xytext=(0, 2),
                    ha="center",
                    fontsize=7,
                )
    draw.mark_failed_bars(ax, rows)
    ax.set_xticks(range(len(rows)), _capture_labels(rows, grid), fontsize=8)
    draw.bar_slots(ax, len(rows))
    axis.finish(ax, "per prompt position")
    ax.set_title(f"{title}: resident bytes per position, measured against predicted", fontsize=10)
    draw.legend_outside(ax)
    return fig


def plot_capture_throughput(rows, grid, title: str):
    from longstraw.plotting import draw

    fig, ax = draw.plt.subplots(figsize=(max(7, 1.1 * len(rows) + 3), 4.5))
    ax.bar(
        range(len(rows)),
        [(r.get("positions_per_second") or 0) if r.get("status") == "ok" else 0 for r in rows],
        color="#4c72b0",
    )
    draw.mark_failed_bars(ax, rows)
    ax.set_xticks(range(len(rows)), _capture_labels(rows, grid), fontsize=8)
    draw.bar_slots(ax, len(rows))
    ax.set_ylabel("positions per second")
    ax.set_title(f"{title}: capture throughput", fontsize=10)
    return fig


KIND = Kind("capture", run=run, columns=columns, shown=SHOWN, figures=figures, captions=CAPTIONS)
