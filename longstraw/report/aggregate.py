"""Result files -> one table per experiment: one row per point (oom and error rows kept, with
their message), the key metrics flattened into columns, written as CSV atomically.

    python -m longstraw.report.aggregate --results results/cpu --out reports/cpu/tables

Input layout: `<results>/points/<experiment>/<point>.json` (or `<results>/<experiment>/<point>.json`),
each the dict `longstraw.harness.runner.run_point` returns plus the pipeline's keys (`experiment`,
`point`, `profile`, `grid`, `experiment_title`, `command`). Every key is read defensively: an error
point has no metrics, a CPU point has no CUDA peaks, a newer kind has metrics we do not know yet
(its scalar metrics still become columns).

Column names carry their unit in the name (`*_bytes`, `*_seconds`, `prompt_length` in positions);
`formatting.py` turns them into GiB / MiB / s on the page. `peak_memory_bytes` is the peak the
device's ceiling is compared with: `peak_allocated_bytes` on CUDA, the process peak RSS on CPU
(`peak_memory_measure` says which).

Besides the row per point, two kinds hold several measurements in one result and get a table of
their own: a `sweep` point (one capture serving GRPO steps at several (mode, G)) gets one row per
step (`sweep_step_tables`), and a capacity point with `comparison_at_largest_fitting` gets the
searched mode's step beside the compared modes' steps at that length (`comparison_tables`), and a
`staleness` point (the fresh-prefix oracle, `longstraw.training.oracle`) gets one row per oracle step, its
drift measures against a fresh capture (`staleness_step_tables`); its point row summarizes them
(drift at steps 1 and 2, the largest drift, the derived refresh interval, the final gradient cosine).
"""

from __future__ import annotations

import argparse
import json
import math
import numbers
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd

from longstraw.results import atomic_path
from longstraw.results import STATUSES

EXPERIMENT_ORDER = ("g_sweep", "operating_points", "baselines", "architectures", "staleness")
STEP_PHASES = ("capture", "old_scoring", "ref_scoring", "replay", "optimizer_step")
FAMILIES = {
    "llama": "dense GQA", "qwen3": "dense GQA", "glm4_moe": "dense GQA + routed MoE",
    "qwen3_next": "hybrid GDN + attention", "qwen3_5": "hybrid GDN + attention",
    "qwen3_5_moe": "hybrid GDN + attention",
    "glm_moe_dsa": "MLA + DSA + MoE", "deepseek_v32": "MLA + DSA + MoE", "deepseek_v3": "MLA + MoE",
}
LEADING_COLUMNS = ("point", "kind")
STATUS_COLUMNS = ("status", "error")


# ---------------------------------------------------------------------------------------- loading

def load_points(results_dir) -> list[dict]:
    """Every result JSON under `results_dir` (its `points/` folder when there is one), sorted by path.

    A file that cannot be parsed becomes an `error` point naming the file, so it shows in the report."""
    root = Path(results_dir)
    base = root / "points" if (root / "points").is_dir() else root
    if not base.is_dir():
        return []
    return [load_point(path, base) for path in sorted(base.rglob("*.json")) if not path.name.startswith(".")]


def load_point(path, base=None) -> dict:
    path = Path(path)
    try:
        with open(path) as f:
            point = json.load(f)
    except (OSError, ValueError) as exc:
        point = {"status": "error", "error": f"unreadable result file {path.name}: {exc}"}
    if not isinstance(point, dict):
        point = {"status": "error", "error": f"result file {path.name} does not hold a JSON object"}
    parts = path.relative_to(base).parts if base is not None else (path.name,)
    point.setdefault("experiment", parts[0] if len(parts) > 1 else point.get("name") or "unnamed")
    point.setdefault("point", path.stem)
    if point.get("status") not in STATUSES:
        point["error"] = point.get("error") or f"result has no valid status (got {point.get('status')!r})"
        point["status"] = "error"
    point["result_file"] = str(path)
    return point


def experiment_order(names) -> list[str]:
    """The paper's experiments first, in the paper's order; any later ones alphabetically."""
    names = set(names)
    return [n for n in EXPERIMENT_ORDER if n in names] + sorted(names - set(EXPERIMENT_ORDER))


# ------------------------------------------------------------------------------------ row per point

def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


def _number(value):
    return value if isinstance(value, numbers.Number) and not isinstance(value, bool) else None


def _scalar(value):
    """Grid values and generic metrics become cells: lists and dicts as compact JSON text."""
    if value is None or isinstance(value, (str, bool, numbers.Number)):
        return value
    return json.dumps(value, sort_keys=True, default=str)


def model_type_of(point: dict) -> str | None:
    """The model type: from the (sweep's) capture metrics when recorded, else from the preset name
    (`tiny-qwen3_5` -> `qwen3_5`), else the checkpoint folder's name."""
    metrics, model = _dict(point.get("metrics")), _dict(_dict(point.get("config")).get("model"))
    recorded = metrics.get("model_type") or _dict(metrics.get("capture")).get("model_type")  # a sweep: its capture's
    if recorded:  # qwen3_5_text (a text config) is listed under qwen3_5, as presets name it
        return str(recorded).removesuffix("_text")
    preset = model.get("preset")
    if model.get("path"):
        return Path(str(model["path"])).name
    if isinstance(preset, str):
        suffix = preset.split("-", 1)[-1]
        return suffix if suffix in FAMILIES else preset
    return None


def family_of(model_type) -> str | None:
    return FAMILIES.get(str(model_type).removesuffix("_text")) if model_type else None


def is_cuda_point(point: dict) -> bool:
    device = str(_dict(_dict(point.get("config")).get("model")).get("device") or "")
    return device.startswith("cuda") or _dict(point.get("provenance")).get("cuda_total_memory_bytes") is not None


def point_row(point: dict) -> dict:
    """One table row: identity, grid values, status, common columns, then the kind's metrics."""
    cfg, prov, metrics = _dict(point.get("config")), _dict(point.get("provenance")), _dict(point.get("metrics"))
    kind = point.get("kind") or cfg.get("kind") or "unknown"
    row = {"experiment": point.get("experiment"), "point": point.get("point") or point.get("name"), "kind": kind}
    for key, value in _dict(point.get("grid")).items():
        row[key] = _scalar(value)
    row["status"] = point.get("status")
    row["error"] = point.get("error")
    if point.get("status") == "oom" and _number(point.get("peak_allocated_bytes")) is not None:
        row["peak_memory_bytes"] = point["peak_allocated_bytes"]  # the peak reached when it ran out
        row["peak_memory_measure"] = "peak_allocated_bytes at OOM"
    _add(row, _common_columns(point, cfg, prov))
    by_kind = {"step": _step_columns, "capture": _capture_columns, "capacity": _capacity_columns,
               "sweep": _sweep_columns, "staleness": _staleness_columns}.get(kind)
    if by_kind is not None:
        try:
            _add(row, by_kind(point, cfg, metrics, is_cuda_point(point)))
        except Exception as exc:  # a malformed result must still render: say so in its row
            row["report_error"] = f"metrics not readable: {type(exc).__name__}: {exc}"
    _add(row, _generic_metrics(metrics))
    return row


def _add(row: dict, columns: dict) -> None:
    """Earlier columns win: a grid value is never overwritten by a derived one of the same name."""
    for key, value in columns.items():
        row.setdefault(key, value)


def _common_columns(point, cfg, prov) -> dict:
    model = _dict(cfg.get("model"))
    model_type = model_type_of(point)
    lora = model.get("lora")
    return {
        "model": model.get("path") or model.get("preset"),
        "model_type": model_type,
        "family": family_of(model_type),
        "dtype": model.get("dtype"),
        "nf4": model.get("nf4"),
        "lora_r": lora.get("r") if isinstance(lora, dict) else None,
        "prompt_length": _dict(cfg.get("prompt")).get("length"),
        "device": prov.get("device"),
        "peak_rss_bytes": _number(point.get("peak_rss_bytes")),
        "wall_seconds": _number(point.get("wall_seconds")),
        "device_memory_bytes": _number(prov.get("cuda_total_memory_bytes")),
        "commit": prov.get("commit"),
        "date": prov.get("date"),
        "torch_version": _dict(prov.get("versions")).get("torch"),
        "transformers_version": _dict(prov.get("versions")).get("transformers"),
        "cp_size": cfg.get("cp_size"),
        **_cp_columns(point),
    }


def _cp_columns(point) -> dict:
    """A context-parallel point: its largest rank's resident bytes and peak (rank 0 gathered every
    rank's record: CUDA max_memory_allocated over the run, else the rank's peak RSS)."""
    ranks = [r for r in _dict(point.get("cp")).get("ranks") or [] if isinstance(r, dict)]
    return {"rank_resident_bytes_max": _max_number(r.get("resident_bytes") for r in ranks),
            "rank_peak_bytes_max": _max_number(r.get("peak_allocated_bytes", r.get("peak_rss_bytes"))
                                               for r in ranks)} if ranks else {}


def _phase_columns(name: str, record: dict) -> dict:
    return {f"{name}_{key}": _number(record.get(key))
            for key in ("seconds", "peak_allocated_bytes", "peak_rss_bytes") if key in record}


def _finite(values) -> bool | None:
    values = [v for v in values if isinstance(v, numbers.Number)]
    return all(math.isfinite(v) for v in values) if values else None


def _step_columns(point, cfg, metrics, cuda) -> dict:
    responses = _dict(cfg.get("responses"))
    summary = _dict(metrics.get("phase_summary"))
    cycles = [c for c in metrics.get("cycles") or [] if isinstance(c, dict)]
    replay = _dict(summary.get("replay"))
    # Responses replayed over all cycles: hold_all times its G replays as one phase, so count
    # responses (not replay-phase entries) for the time per member.
    replays = sum(len(c.get("response_tokens") or []) for c in cycles) or None
    cols = {
        "mode": cfg.get("mode"),
        "G": responses.get("count"),
        "response_length": responses.get("length"),
        "cycles": cfg.get("cycles"),
        "replays": replays,
    }
    if cuda:
        peak = metrics.get("peak_allocated_bytes", point.get("peak_allocated_bytes"))
        cols.update(peak_memory_bytes=_number(peak), peak_memory_measure="peak_allocated_bytes")
    else:
        cols.update(peak_memory_bytes=_number(point.get("peak_rss_bytes")), peak_memory_measure="process peak RSS")
    cols["graph_bytes_peak"] = _number(metrics.get("graph_bytes_peak"))
    for key in ("resident_bytes", "predicted_resident_bytes", "prompt_positions"):
        values = [c[key] for c in cycles if _number(c.get(key)) is not None]
        cols[key] = max(values) if values else None
    flags = [c["state_unchanged"] for c in cycles if "state_unchanged" in c]
    cols["state_unchanged"] = all(flags) if flags else None
    losses = [c.get("loss") for c in cycles]
    cols["loss_first"] = _number(losses[0]) if losses else None
    cols["loss_last"] = _number(losses[-1]) if losses else None
    cols["loss_finite"] = _finite(losses)
    cols["grad_norm_finite"] = _finite(c.get("grad_norm") for c in cycles)
    if replays and _number(replay.get("seconds")) is not None:
        cols["seconds_per_member"] = replay["seconds"] / replays
    if cycles:
        per_cycle = [sum(_number(_dict(r).get("seconds")) or 0.0 for r in _dict(c.get("phases")).values())
                     for c in cycles]
        cols["cycle_seconds_mean"] = sum(per_cycle) / len(per_cycle)
    cols["trainable_parameters"] = metrics.get("trainable_parameters")
    for name in list(STEP_PHASES) + sorted(set(summary) - set(STEP_PHASES)):
        cols.update(_phase_columns(name, _dict(summary.get(name))))
    cols.update(_phase_columns("weights", _dict(metrics.get("weights"))))
    return cols


def _ratio(a, b):
    return a / b if _number(a) is not None and _number(b) else None


def _capture_columns(point, cfg, metrics, cuda) -> dict:
    capture_phase = _dict(_dict(metrics.get("phases")).get("capture"))
    positions = _number(metrics.get("positions"))
    resident, predicted = _number(metrics.get("resident_bytes")), _number(metrics.get("predicted_resident_bytes"))
    measured_pp = metrics.get("bytes_per_position_measured", _ratio(resident, positions))
    predicted_pp = metrics.get("bytes_per_position_predicted", _ratio(predicted, positions))
    peak = capture_phase.get("peak_allocated_bytes") if cuda else point.get("peak_rss_bytes")
    cols = {
        "positions": positions,
        "positions_per_second": _number(metrics.get("positions_per_second")),
        "capture_seconds": _number(capture_phase.get("seconds")),
        "resident_bytes": resident,
        "predicted_resident_bytes": predicted,
        "bytes_per_position_measured": _number(measured_pp),
        "bytes_per_position_predicted": _number(predicted_pp),
        "resident_to_predicted_ratio": _ratio(resident, predicted),
        "transient_bytes": _number(metrics.get("transient_bytes")),
        "peak_memory_bytes": _number(peak if point.get("status") != "oom" else point.get("peak_allocated_bytes", peak)),
        "peak_memory_measure": "peak_allocated_bytes" if cuda else "process peak RSS",
        "replay_seconds": _number(metrics.get("replay_seconds")),
        "response_length": metrics.get("response_length"),
    }
    cols.update(_phase_columns("capture", capture_phase))
    return cols


def _sweep_capture(metrics) -> dict:
    """A sweep's capture metrics shaped as a capture point's (its phase record under `phases`)."""
    capture = _dict(metrics.get("capture"))
    return {**capture, "phases": {"capture": _dict(capture.get("phase"))}}


def _sweep_columns(point, cfg, metrics, cuda) -> dict:
    """The sweep point as a whole: its one capture, and a summary of the steps it served (each
    step is a row of `sweep_step_tables`). The peak is the largest that fitted: capture's or an ok
    step's (an oom step's peak is the allocator at the device's limit, shown on its step row)."""
    capture = _sweep_capture(metrics)
    cols = _capture_columns(point, cfg, capture, cuda)
    steps = sweep_steps(point)
    ok = [s for s in steps if s["status"] == "ok"]
    attention = _dict(capture.get("capture_attention"))
    fitted = [cols.get("capture_peak_allocated_bytes")] + [s.get("peak_memory_bytes") for s in ok]
    fitted = [v for v in fitted if v is not None]
    cols.update(
        capture_attention_seconds=_number(attention.get("seconds")),
        capture_attention_tflops_per_second=_number(attention.get("tflops_per_second")),
        response_length=_dict(cfg.get("responses")).get("length"),
        trainable_parameters=metrics.get("trainable_parameters"),
        steps=len(steps),
        steps_ok=len(ok),
        steps_oom=sum(s["status"] == "oom" for s in steps),
        replays=sum(s.get("replays") or 0 for s in ok) or None,
        peak_memory_bytes=max(fitted) if cuda and fitted else _number(point.get("peak_rss_bytes")),
        peak_memory_measure="peak_allocated_bytes" if cuda else "process peak RSS",
    )
    cols.update(_phase_columns("weights", _dict(metrics.get("weights"))))
    return cols


def sweep_steps(point: dict) -> list[dict]:
    """One row per step of a sweep point, in the order they ran (`step`, from 1). Each row carries
    the point's model and prompt, so it reads (and is checked for V1) like a step point's row."""
    cfg, prov, metrics = _dict(point.get("config")), _dict(point.get("provenance")), _dict(point.get("metrics"))
    common = _common_columns(point, cfg, prov)
    identity = {k: common[k] for k in ("model", "model_type", "family", "device", "prompt_length",
                                       "device_memory_bytes")}
    steps = [s for s in metrics.get("steps") or [] if isinstance(s, dict)]
    return [_sweep_step_row(point, index, step, identity) for index, step in enumerate(steps, 1)]


def _sweep_step_row(point, index: int, step: dict, identity: dict) -> dict:
    phases = _dict(step.get("phases"))
    status = step.get("status") if step.get("status") in STATUSES else "error"
    peak = _number(step.get("peak_allocated_bytes"))
    # hold_all times its G replays as one phase: count responses, not replay-phase entries
    members = len(step.get("response_tokens") or []) or None
    row = {"point": point.get("point"), "step": index, "kind": "step", "mode": step.get("mode"),
           "G": step.get("count"), "status": status, "error": step.get("error"), **identity,
           "peak_memory_bytes": peak,
           "peak_memory_measure": "peak_allocated_bytes" + (" at OOM" if status == "oom" else ""),
           "headroom_bytes": identity["device_memory_bytes"] - peak
           if peak is not None and identity["device_memory_bytes"] else None,
           "graph_bytes_peak": _number(step.get("graph_bytes_peak")),
           "rank_peak_bytes_max": _max_number(step.get("rank_peak_allocated_bytes")),
           "step_seconds": _phase_seconds(phases),
           "replays": members,
           "seconds_per_member": _ratio(_dict(phases.get("replay")).get("seconds"), members),
           "resident_bytes": _number(step.get("resident_bytes")),
           "predicted_resident_bytes": _number(step.get("predicted_resident_bytes")),
           "prompt_positions": _number(step.get("prompt_positions")),
           "loss": _number(step.get("loss")), "grad_norm": _number(step.get("grad_norm")),
           "loss_finite": _finite([step.get("loss")]) if "loss" in step else None,
           "grad_norm_finite": _finite([step.get("grad_norm")]) if "grad_norm" in step else None,
           "state_unchanged": step.get("state_unchanged")}
    for name in list(STEP_PHASES) + sorted(set(phases) - set(STEP_PHASES)):
        row.update(_phase_columns(name, _dict(phases.get(name))))
    return row


def _max_number(values):
    """The largest number of a list (a context-parallel step's per-rank peaks); None if none."""
    numbers_ = [v for v in values or () if _number(v) is not None]
    return max(numbers_) if numbers_ else None


def _probes(metrics) -> list[dict]:
    return [p for p in metrics.get("probes") or [] if isinstance(p, dict)]


def _phase_seconds(phases) -> float | None:
    """A step's time: the sum of its phases' seconds (process start and model load left out)."""
    seconds = [_number(_dict(r).get("seconds")) for r in _dict(phases).values()]
    seconds = [v for v in seconds if v is not None]
    return sum(seconds) if seconds else None


def _capacity_columns(point, cfg, metrics, cuda) -> dict:
    probes = _probes(metrics)
    fitting, oom = ([p for p in probes if p.get("status") == s] for s in ("ok", "oom"))
    largest = metrics.get("largest_fitting")
    at_largest = next((p for p in fitting if p.get("prompt_length") == largest), {})
    oom_lengths = [p["prompt_length"] for p in oom if _number(p.get("prompt_length")) is not None]
    return {
        "mode": metrics.get("mode", cfg.get("mode")),
        "ceiling_bytes": _number(metrics.get("ceiling_bytes")),
        "memory_measure": metrics.get("memory_measure"),
        "largest_fitting": largest,
        "largest_fitting_peak_bytes": _number(at_largest.get("peak_bytes")),
        "largest_fitting_seconds": _number(at_largest.get("seconds")),
        "smallest_oom": min(oom_lengths) if oom_lengths else None,
        "probes": len(probes),
        "probes_ok": len(fitting),
        "probes_oom": len(oom),
        "peak_memory_bytes": _number(at_largest.get("peak_bytes")),
        "peak_memory_measure": metrics.get("memory_measure"),
        "search_stopped_on_time_limit": metrics.get("search_stopped_on_time_limit"),
        "time_limit_seconds": _number(_dict(cfg.get("capacity")).get("time_limit_seconds")),
    }


def comparison_rows(point: dict) -> list[dict]:
    """The searched mode's step at its largest fitting length (its search probe there) and each
    compared mode's step at that same length, with step seconds side by side; empty without a
    comparison. `speedup_vs_searched_mode`: the searched mode's step seconds over this row's."""
    cfg, metrics = _dict(point.get("config")), _dict(point.get("metrics"))
    compared = _dict(metrics.get("comparison_at_largest_fitting"))
    if not compared:
        return []
    largest = metrics.get("largest_fitting")
    probe = next((p for p in _probes(metrics) if p.get("prompt_length") == largest and p.get("status") == "ok"), {})
    entries = [(metrics.get("mode", cfg.get("mode")), "search probe", probe)]
    entries += [(mode, "comparison step", _dict(record)) for mode, record in compared.items()]
    rows = []
    for mode, measured_as, record in entries:
        phases = _dict(record.get("step_phases"))
        row = {"point": point.get("point"), "mode": mode, "measured_as": measured_as,
               "prompt_length": record.get("prompt_length", largest),
               "status": record.get("status") if record.get("status") in STATUSES else "error",
               "error": record.get("error") or (None if record else "no ok probe at the largest fitting length"),
               "peak_bytes": _number(record.get("peak_bytes")), "step_seconds": _phase_seconds(phases),
               "wall_seconds": _number(record.get("seconds"))}
        for name in list(STEP_PHASES) + sorted(set(phases) - set(STEP_PHASES)):
            row[f"{name}_seconds"] = _number(_dict(phases.get(name)).get("seconds"))
        rows.append(row)
    for row in rows:
        row["speedup_vs_searched_mode"] = _ratio(rows[0]["step_seconds"], row["step_seconds"])
    return rows


# The oracle's per-step measures (longstraw/oracle.py), in the order a step row shows them.
STALENESS_MEASURES = ("param_drift", "loss_stale", "loss_fresh", "relative_loss_drift", "mean_abs_logprob_diff",
                      "kl_k3", "grad_cosine", "grad_norm_stale", "grpo_loss_stale", "grpo_loss_fresh", "reward_mean")


def _staleness_rows(metrics) -> list[dict]:
    """The oracle's rows that carry a step number, in step order (a malformed row is left out)."""
    rows = [r for r in metrics.get("rows") or [] if isinstance(r, dict) and _number(r.get("step")) is not None]
    return sorted(rows, key=lambda r: r["step"])


def _derived_refresh_interval(rows: list[dict], threshold) -> int | None:
    """`longstraw.training.oracle.refresh_interval`'s rule, for a result that did not record it: the largest
    step k with the relative loss drift under `threshold` at every step 1..k."""
    if _number(threshold) is None or not rows:
        return None
    interval = 0
    for row in rows:
        if row["step"] == 0:
            continue
        drift = _number(row.get("relative_loss_drift"))
        if drift is None or drift >= threshold:
            break
        interval = int(row["step"])
    return interval


def _staleness_columns(point, cfg, metrics, cuda) -> dict:
    """One staleness point: its setting, the drift at steps 1 and 2 (where the paper states its
    figure), the largest drift and the step it occurred at, the derived refresh interval (where the
    drift first reached the threshold, if it did) and the last step's measures."""
    settings, responses = _dict(cfg.get("staleness")), _dict(cfg.get("responses"))
    rows = _staleness_rows(metrics)
    threshold = _number(metrics.get("threshold", settings.get("threshold")))
    after = [r for r in rows if r["step"] >= 1 and _number(r.get("relative_loss_drift")) is not None]
    largest = max(after, key=lambda r: r["relative_loss_drift"]) if after else {}
    crossed = next((r["step"] for r in after if threshold is not None and r["relative_loss_drift"] >= threshold),
                   None)
    recorded = _number(metrics.get("refresh_interval"))
    by_step = {r["step"]: r for r in rows}
    peaks = [_number(_dict(p).get("peak_allocated_bytes")) for p in _dict(metrics.get("phases")).values()]
    peaks = [v for v in peaks if v is not None]
    first, last = by_step.get(0, {}), rows[-1] if rows else {}
    cols = {
        "lr": _number(_dict(cfg.get("optimizer")).get("lr")),
        "prompt_positions": _number(metrics.get("prompt_positions")),
        "G": responses.get("count"),
        "response_length": responses.get("length"),
        "steps": settings.get("steps"),
        "steps_measured": max((r["step"] for r in rows), default=None) if rows else None,
        "drift_threshold": threshold,
        "refresh_interval": recorded if recorded is not None else _derived_refresh_interval(rows, threshold),
        "threshold_crossed_at_step": crossed,
        "relative_loss_drift_step1": _number(by_step.get(1, {}).get("relative_loss_drift")),
        "relative_loss_drift_step2": _number(by_step.get(2, {}).get("relative_loss_drift")),
        "max_relative_loss_drift": _number(largest.get("relative_loss_drift")),
        "max_drift_step": largest.get("step"),
        # step 0: fresh == stale by construction, so its drift must be exactly zero (a check)
        "step0_drift_zero": (first.get("relative_loss_drift") == 0 and first.get("mean_abs_logprob_diff") == 0)
        if first else None,
        "final_param_drift": _number(last.get("param_drift")),
        "final_mean_abs_logprob_diff": _number(last.get("mean_abs_logprob_diff")),
        "final_kl_k3": _number(last.get("kl_k3")),
        "final_grad_cosine": _number(last.get("grad_cosine")),
        "min_grad_cosine": min((r["grad_cosine"] for r in rows if _number(r.get("grad_cosine")) is not None),
                               default=None),
        "loss_finite": _finite([r.get(k) for r in rows for k in ("loss_stale", "loss_fresh")]),
        "peak_memory_bytes": _number(point.get("peak_rss_bytes")) if not cuda else max(
            peaks + [point["peak_allocated_bytes"]] if _number(point.get("peak_allocated_bytes")) is not None
            else peaks, default=None),
        "peak_memory_measure": "peak_allocated_bytes" if cuda else "process peak RSS",
    }
    cols.update(_phase_columns("oracle", _dict(_dict(metrics.get("phases")).get("oracle"))))
    cols.update(_phase_columns("weights", _dict(_dict(metrics.get("phases")).get("weights"))))
    if point.get("status") == "ok" and not rows:
        cols["report_error"] = "no per-step rows in the result (metrics.rows missing or empty)"
    return cols


def staleness_steps(point: dict) -> list[dict]:
    """One row per oracle step of a staleness point (step 0: the capture itself, drift zero by
    construction). A point without rows (error, oom, or rows missing) gives one row saying so, so
    the per-step table shows every point."""
    cfg, metrics = _dict(point.get("config")), _dict(point.get("metrics"))
    rows = _staleness_rows(metrics)
    threshold = _number(metrics.get("threshold", _dict(cfg.get("staleness")).get("threshold")))
    lr = _number(_dict(cfg.get("optimizer")).get("lr"))
    if not rows:
        status = point.get("status") if point.get("status") in STATUSES else "error"
        return [{"point": point.get("point"), "kind": "staleness_step", "lr": lr, "step": None, "status": status,
                 "error": point.get("error"),
                 "report_error": "no per-step rows in the result" if status == "ok" or not point.get("error")
                 else None}]
    out = []
    for row in rows:
        record = {"point": point.get("point"), "kind": "staleness_step", "lr": lr, "step": int(row["step"]),
                  "status": "ok", "error": None}
        record.update({key: _number(row.get(key)) for key in STALENESS_MEASURES})
        cosine, drift = record["grad_cosine"], record["relative_loss_drift"]
        record["one_minus_grad_cosine"] = 1.0 - cosine if cosine is not None else None
        record["under_threshold"] = drift < threshold if drift is not None and threshold is not None else None
        tokens = row.get("response_tokens")
        record["response_tokens"] = sum(tokens) if isinstance(tokens, list) and all(
            _number(t) is not None for t in tokens) else _number(tokens)
        out.append(record)
    return out


def _generic_metrics(metrics: dict) -> dict:
    """Scalar metrics, and scalars one level down (`weights_seconds`), for kinds added later."""
    cols = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            for sub, inner in value.items():
                if inner is None or isinstance(inner, (str, bool, numbers.Number)):
                    cols[f"{key}_{sub}"] = inner
        elif value is None or isinstance(value, (str, bool, numbers.Number)):
            cols[key] = value
    return cols


# ----------------------------------------------------------------------------------------- tables

def _sort_key(value):
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return (2, 0, "")
    if isinstance(value, numbers.Number) and not isinstance(value, bool):
        return (0, float(value), "")
    return (1, 0, str(value))


def grid_keys(points: list[dict]) -> list[str]:
    keys: list[str] = []
    for point in points:
        keys += [k for k in _dict(point.get("grid")) if k not in keys]
    return keys


def frame(rows: list[dict], grid: list[str]) -> pd.DataFrame:
    """Rows sorted by grid values (numbers numerically), columns: identity, grid, status, the rest."""
    rows = sorted(rows, key=lambda r: [_sort_key(r.get(k)) for k in grid] + [_sort_key(r.get("point"))])
    df = pd.DataFrame(rows)
    first = [c for c in dict.fromkeys((*LEADING_COLUMNS, *grid, *STATUS_COLUMNS)) if c in df.columns]
    df = df[first + [c for c in df.columns if c not in first and c != "experiment"]]
    return df.convert_dtypes(convert_string=False).reset_index(drop=True)


def tables(points: list[dict]) -> dict[str, pd.DataFrame]:
    """{experiment: DataFrame}, one row per point, experiments in the paper's order."""
    by_experiment: dict[str, list[dict]] = defaultdict(list)
    for point in points:
        by_experiment[str(point.get("experiment"))].append(point)
    return {name: frame([point_row(p) for p in by_experiment[name]], grid_keys(by_experiment[name]))
            for name in experiment_order(by_experiment)}


def probe_tables(points: list[dict]) -> dict[str, pd.DataFrame]:
    """{experiment: DataFrame} of capacity probes (one row per prompt length tried), where any."""
    rows: dict[str, list[dict]] = defaultdict(list)
    for point in points:
        metrics = _dict(point.get("metrics"))
        for probe in _probes(metrics):
            rows[str(point.get("experiment"))].append({
                "point": point.get("point"), "mode": metrics.get("mode", _dict(point.get("config")).get("mode")),
                "prompt_length": probe.get("prompt_length"), "status": probe.get("status"),
                "peak_bytes": _number(probe.get("peak_bytes")), "seconds": _number(probe.get("seconds")),
                "memory_measure": metrics.get("memory_measure"), "ceiling_bytes": _number(metrics.get("ceiling_bytes")),
            })
    return {name: pd.DataFrame(r).convert_dtypes(convert_string=False) for name, r in rows.items()}


def _rows_by_experiment(points: list[dict], rows_of) -> dict[str, pd.DataFrame]:
    """{experiment: DataFrame} of the rows `rows_of(point)` gives, where any. A point whose rows
    cannot be read gives one error row saying so (a malformed result must still render)."""
    rows: dict[str, list[dict]] = defaultdict(list)
    for point in points:
        try:
            rows[str(point.get("experiment"))] += rows_of(point)
        except Exception as exc:
            rows[str(point.get("experiment"))].append({
                "point": point.get("point"), "status": "error",
                "report_error": f"metrics not readable: {type(exc).__name__}: {exc}"})
    return {name: pd.DataFrame(r).convert_dtypes(convert_string=False) for name, r in rows.items() if r}


def sweep_step_tables(points: list[dict]) -> dict[str, pd.DataFrame]:
    """{experiment: DataFrame} with one row per step of its sweep points, where any."""
    return _rows_by_experiment([p for p in points if p.get("kind") == "sweep"], sweep_steps)


def staleness_step_tables(points: list[dict]) -> dict[str, pd.DataFrame]:
    """{experiment: DataFrame} with one row per oracle step of its staleness points, where any."""
    return _rows_by_experiment([p for p in points if p.get("kind") == "staleness"], staleness_steps)


def comparison_tables(points: list[dict]) -> dict[str, pd.DataFrame]:
    """{experiment: DataFrame} of capacity comparisons (`comparison_rows`), where any."""
    return _rows_by_experiment([p for p in points if p.get("kind") == "capacity"], comparison_rows)


def records(df: pd.DataFrame) -> list[dict]:
    """Plain Python rows: None for missing (never pd.NA / NaN), Python numbers (never numpy)."""
    def plain(value):
        if value is None or (np.ndim(value) == 0 and pd.isna(value)):
            return None
        return value.item() if isinstance(value, np.generic) else value
    return [{k: plain(v) for k, v in row.items()} for row in df.astype(object).to_dict("records")]


def write_csv_atomic(df: pd.DataFrame, path) -> Path:
    with atomic_path(path) as tmp:
        df.to_csv(tmp, index=False)
    return Path(path)


def write_tables(tables: dict[str, pd.DataFrame], out_dir, probes: dict[str, pd.DataFrame] | None = None,
                 steps: dict[str, pd.DataFrame] | None = None,
                 comparisons: dict[str, pd.DataFrame] | None = None,
                 drift: dict[str, pd.DataFrame] | None = None) -> dict:
    """`<experiment>.csv` per experiment (+ `<experiment>.probes.csv` for capacity probes,
    `.steps.csv` for sweep steps, `.comparison.csv` for capacity comparisons, `.drift.csv` for the
    staleness oracle's steps) and `points.csv` with every point of every experiment; each written
    atomically. Returns {name: path}."""
    out_dir = Path(out_dir)
    written = {name: write_csv_atomic(df, out_dir / f"{name}.csv") for name, df in tables.items()}
    for suffix, extra in (("probes", probes), ("steps", steps), ("comparison", comparisons), ("drift", drift)):
        for name, df in (extra or {}).items():
            written[f"{name}.{suffix}"] = write_csv_atomic(df, out_dir / f"{name}.{suffix}.csv")
    everything = [df.assign(experiment=name) for name, df in tables.items()]
    combined = pd.concat(everything, ignore_index=True) if everything else pd.DataFrame(columns=["experiment"])
    combined = combined[["experiment"] + [c for c in combined.columns if c != "experiment"]]
    written["points"] = write_csv_atomic(combined, out_dir / "points.csv")
    return written


def status_counts(points: list[dict]) -> dict[str, int]:
    counts = {s: 0 for s in STATUSES}
    for point in points:
        counts[point.get("status", "error")] = counts.get(point.get("status", "error"), 0) + 1
    return counts


def main(results_dir, out_dir) -> dict:
    """What the Snakemake script calls: load, tabulate, write the CSVs; returns {name: path}."""
    points = load_points(results_dir)
    return write_tables(tables(points), out_dir, probes=probe_tables(points), steps=sweep_step_tables(points),
                        comparisons=comparison_tables(points), drift=staleness_step_tables(points))


def cli(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", required=True, help="results folder, e.g. results/cpu")
    parser.add_argument("--out", required=True, help="folder for the CSV tables, e.g. reports/cpu/tables")
    args = parser.parse_args(argv)
    written = main(args.results, args.out)
    counts = status_counts(load_points(args.results))
    print(json.dumps({"tables": {k: str(v) for k, v in written.items()}, "statuses": counts}))
    return 0


if __name__ == "__main__":
    sys.exit(cli())
