"""The HTML report of one profile's results: `<out>/index.html`, figures in `<out>/figures/`, CSV
tables in `<out>/tables/`, all referenced by relative paths (open the file, no server needed).

    python -m longstraw.report.render --profile cpu --results results/cpu --out reports/cpu

Sections: summary (what ran, statuses, device, versions, commit, date); on a GPU profile, the
targets (`longstraw.report.targets`); the paper's figures beside ours with the scale difference;
the four validation levels; one section per experiment (the paper's figures for it beside ours,
figures, table straight from the aggregated data with every status, a sweep's steps and a capacity
search's comparison steps and a staleness oracle's steps as tables of their own, a staleness point's
derived refresh interval in a sentence, failures with their messages, the commands that
reproduce it, provenance); recorded GPU results (every JSON under `--recorded`), shown as recorded
and never mixed into the local tables, with a link to their own report where it was rendered
(`reports/recorded-<device>/`, beside this one). Every file is written atomically.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections import Counter
from pathlib import Path

import jinja2
import pandas as pd
import yaml

from longstraw.report.aggregate import (comparison_tables, experiment_order, load_points, point_row, probe_tables,
                                        records, staleness_step_tables, status_counts, sweep_step_tables, tables,
                                        write_tables)
from longstraw.report.ceiling import memory_ceiling
from longstraw.results import write_text_atomic
from longstraw.report.formatting import (column_label, exact_value, format_percent, format_value, is_missing,
                                         refresh_interval_sentence)
from longstraw.report.paper import compare_figures, load_paper, reference_marks, scale_rows
from longstraw.report.plots import figure_caption, make_plots
from longstraw.report.levels import all_paths, levels_table, paper_paths
from longstraw.results import STATUSES

REPO_ROOT = Path(__file__).resolve().parents[2]
VERSION_KEYS = ("torch", "transformers", "peft", "bitsandbytes", "fla-core")

# Columns each kind's table shows, in order (present, non-empty ones only); the CSV has them all.
STEP_COLUMNS = ["model", "prompt_length", "mode", "G", "response_length", "cycles", "replays", "peak_memory_bytes",
                "peak_memory_measure", "capture_peak_allocated_bytes", "old_scoring_peak_allocated_bytes",
                "ref_scoring_peak_allocated_bytes", "replay_peak_allocated_bytes",
                "optimizer_step_peak_allocated_bytes", "graph_bytes_peak", "resident_bytes",
                "predicted_resident_bytes", "cp_size", "rank_resident_bytes_max", "rank_peak_bytes_max",
                "seconds_per_member", "capture_seconds", "cycle_seconds_mean", "loss_last", "state_unchanged",
                "peak_rss_bytes", "wall_seconds"]
CAPTURE_COLUMNS = ["model", "model_type", "prompt_length", "positions", "capture_seconds", "positions_per_second",
                   "resident_bytes", "predicted_resident_bytes", "bytes_per_position_measured",
                   "bytes_per_position_predicted", "transient_bytes", "replay_seconds", "peak_memory_bytes",
                   "peak_memory_measure", "peak_rss_bytes", "wall_seconds"]
CAPACITY_COLUMNS = ["model", "mode", "ceiling_bytes", "device_memory_bytes", "memory_measure", "largest_fitting",
                    "largest_fitting_peak_bytes", "first_failing", "smallest_oom", "probes", "probes_ok",
                        "probes_oom", "search_stopped_on_time_limit", "time_limit_seconds", "step_seconds_at",
                    "step_seconds_at_prompt_length", "step_seconds_at_seconds", "wall_seconds"]
# A sweep point: its one capture and a summary of the steps it served (each step: SWEEP_STEP_COLUMNS).
SWEEP_COLUMNS = ["model", "model_type", "lora_r", "prompt_length", "response_length", "positions", "resident_bytes",
                 "predicted_resident_bytes", "bytes_per_position_measured", "bytes_per_position_predicted",
                 "transient_bytes", "capture_seconds", "capture_attention_tflops_per_second",
                 "capture_peak_allocated_bytes", "weights_peak_allocated_bytes", "trainable_parameters", "steps",
                 "steps_ok", "steps_oom", "replays", "peak_memory_bytes", "peak_memory_measure",
                 "cp_size", "rank_resident_bytes_max", "rank_peak_bytes_max", "device_memory_bytes",
                 "peak_rss_bytes", "wall_seconds"]
SWEEP_STEP_COLUMNS = ["point", "step", "mode", "G", "status", "peak_memory_bytes", "rank_peak_bytes_max",
                      "headroom_bytes", "graph_bytes_peak",
                      "old_scoring_peak_allocated_bytes", "ref_scoring_peak_allocated_bytes",
                      "replay_peak_allocated_bytes", "optimizer_step_peak_allocated_bytes", "step_seconds",
                      "replay_seconds", "seconds_per_member", "loss", "grad_norm", "state_unchanged", "error",
                      "report_error"]
# A staleness point (the fresh-prefix oracle): its setting, the drift summary, the derived refresh
# interval; each oracle step: STALENESS_STEP_COLUMNS.
STALENESS_COLUMNS = ["model", "lr", "prompt_positions", "G", "response_length", "steps", "drift_threshold",
                     "refresh_interval", "threshold_crossed_at_step", "relative_loss_drift_step1",
                     "relative_loss_drift_step2", "max_relative_loss_drift", "max_drift_step", "final_param_drift",
                     "final_mean_abs_logprob_diff", "final_kl_k3", "final_grad_cosine", "step0_drift_zero",
                     "oracle_seconds", "peak_memory_bytes", "peak_memory_measure", "wall_seconds"]
STALENESS_STEP_COLUMNS = ["point", "lr", "step", "status", "param_drift", "loss_stale", "loss_fresh",
                          "relative_loss_drift", "under_threshold", "mean_abs_logprob_diff", "kl_k3", "grad_cosine",
                          "one_minus_grad_cosine", "grad_norm_stale", "grpo_loss_stale", "grpo_loss_fresh",
                          "response_tokens", "reward_mean", "error", "report_error"]
COMPARISON_COLUMNS = ["point", "mode", "measured_as", "prompt_length", "status", "peak_bytes", "step_seconds",
                      "speedup_vs_searched_mode", "capture_seconds", "old_scoring_seconds", "ref_scoring_seconds",
                      "replay_seconds", "optimizer_step_seconds", "wall_seconds", "error", "report_error"]
PROBE_COLUMNS = ["point", "mode", "prompt_length", "status", "peak_bytes", "seconds"]
RECORDED_COLUMNS = ["file", "point", "kind", "status", "device", "date", "commit", "torch_version",
                    "transformers_version", "model", "prompt_length", "mode", "G", "cycles", "peak_memory_bytes",
                    "graph_bytes_peak", "resident_bytes", "seconds_per_member", "wall_seconds", "error"]
GENERIC_SKIP = {"experiment", "point", "kind", "status", "error", "commit", "date", "device", "family", "dtype",
                "torch_version", "transformers_version", "device_memory_bytes", "report_error", "model",
                "model_type", "prompt_length", "lora_r", "nf4", "peak_rss_bytes", "wall_seconds"}
# A validation point: how many of its paths reached each level (the paths themselves: the validation section).
VALIDATION_COLUMNS = ["models", "prompt_length", "reached_V1", "reached_V2", "reached_V3", "reached_V4", "tolerance",
                      "peak_rss_bytes", "wall_seconds"]
KIND_COLUMNS = {"step": STEP_COLUMNS, "capture": CAPTURE_COLUMNS, "capacity": CAPACITY_COLUMNS, "sweep": SWEEP_COLUMNS,
                "staleness": STALENESS_COLUMNS, "validation": VALIDATION_COLUMNS}
EXTRA_TABLES = {
    "sweep_steps": ("Sweep steps", SWEEP_STEP_COLUMNS,
                    "One row per GRPO step, in the order they ran, every one served by its point's single capture "
                    "(the table above). Peak: torch.cuda.max_memory_allocated over the step (an OOM step: the peak "
                    "it reached when it ran out; its mode stopped there). Headroom: the device's total memory "
                    "minus that peak. Step seconds: the sum of the step's phases."),
    "comparison": ("Step time at the largest fitting length", COMPARISON_COLUMNS,
                   "The searched mode's step at its largest fitting prompt (its search probe there) beside the "
                   "compared modes' steps at the same length. Step seconds: the sum of the step's phase seconds "
                   "(replay and hold_all include their capture; naive has none); wall seconds: the probe's whole "
                   "process, model load included. speedup_vs_searched_mode: the searched mode's step seconds "
                   "over this row's."),
    "drift": ("Drift per step", STALENESS_STEP_COLUMNS,
              "One row per oracle step. At every step the policy samples responses from the reused (stale) prompt "
              "state, and on those same responses the stale state is compared with a fresh capture under the "
              "current parameters. Step 0 is the capture itself: fresh equals stale, so its drift is exactly zero "
              "(a check, not a data point). relative_loss_drift: |L_stale - L_fresh| / L_fresh for the mean "
              "response NLL; under_threshold: below the point's refresh threshold; mean_abs_logprob_diff and "
              "kl_k3 (exp(d) - d - 1, d = log p_fresh - log p_stale) per response token; grad_cosine: cosine of "
              "the stale and fresh gradients; param_drift: L2 norm of the trainable parameters' change since the "
              "capture (the trainer's adaptive refresh signal); grpo_loss_*: the GRPO surrogate (about 0 on "
              "policy, so not used for the drift); response_tokens: summed over the group. A point without steps "
              "(error, out of memory, rows missing) has one row saying so."),
}
MET_TEXT = {True: "yes", False: "missed", None: "not measured"}


def resolve(path) -> Path:
    """A path as given, else relative to the repository (so the defaults work from any folder)."""
    path = Path(path)
    if path.exists() or path.is_absolute():
        return path
    return REPO_ROOT / path if (REPO_ROOT / path).exists() else path


# ------------------------------------------------------------------------------------- table views

def _present(rows: list[dict], column: str) -> bool:
    return any(not is_missing(r.get(column)) for r in rows)


def table_view(rows: list[dict], columns: list[str]) -> dict:
    """What a template needs to draw a table: labels, and per cell the text, the exact number
    (`data-value`, so a reader or a test can check it against the result JSON) and a CSS class."""
    columns = [c for i, c in enumerate(columns) if c not in columns[:i] and (c in ("point", "status")
                                                                             or _present(rows, c))]
    view_rows = []
    for row in rows:
        cells = []
        for column in columns:
            value = row.get(column)
            numeric = exact_value(value)
            css = "num" if numeric is not None else ("status status-" + str(value) if column == "status"
                                                     else "message" if column in ("error", "report_error") else "")
            cells.append({"key": column, "text": format_value(column, value), "value": numeric, "css": css})
        view_rows.append({"point": str(row.get("point")), "status": str(row.get("status")), "cells": cells})
    return {"columns": [{"key": c, "label": column_label(c)} for c in columns], "rows": view_rows}


def _grid_columns(frame_columns: list[str]) -> list[str]:
    """The grid keys: `aggregate.frame` puts them between the identity columns and `status`."""
    end = frame_columns.index("status") if "status" in frame_columns else 0
    return [c for c in frame_columns[:end] if c not in ("point", "kind")]


# A grid key and the derived column that repeats it: show the grid key only.
GRID_ALIASES = {"prompt.length": "prompt_length", "responses.count": "G", "responses.length": "response_length",
                "model.preset": "model", "optimizer.lr": "lr", "cp_size": "cp_size"}


def _kind_columns(kind: str, rows: list[dict], grid: list[str]) -> list[str]:
    chosen = KIND_COLUMNS.get(kind)
    if chosen is None:  # a kind added later: its numeric metrics, a dozen at most
        keys = dict.fromkeys(k for r in rows for k in r)
        numeric = [c for c in keys if c not in GENERIC_SKIP and c not in grid
                   and any(exact_value(r.get(c)) is not None for r in rows)]
        chosen = ["model", "prompt_length"] + numeric[:12] + ["peak_rss_bytes", "wall_seconds"]
    repeated = {GRID_ALIASES[k] for k in grid if k in GRID_ALIASES}
    return ["point", *grid, "status", *(c for c in chosen if c not in repeated), "error", "report_error"]


# ---------------------------------------------------------------------------------- section pieces

def _distinct(values) -> list:
    return sorted({v for v in values if not is_missing(v)}, key=str)


def provenance_facts(points: list[dict]) -> list[dict]:
    provs = [p.get("provenance") if isinstance(p.get("provenance"), dict) else {} for p in points]
    versions = [pv.get("versions") if isinstance(pv.get("versions"), dict) else {} for pv in provs]
    dates = _distinct(pv.get("date") for pv in provs)
    facts = [
        {"key": "device", "value": ", ".join(_distinct(pv.get("device") for pv in provs)) or "not recorded"},
        {"key": "commit", "value": ", ".join(_distinct(pv.get("commit") for pv in provs)) or "not recorded"},
        {"key": "date", "value": (dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}") if dates
         else "not recorded"},
        {"key": "python", "value": ", ".join(_distinct(pv.get("python") for pv in provs)) or "not recorded"},
    ]
    for key in VERSION_KEYS:
        facts.append({"key": key, "value": ", ".join(_distinct(v.get(key) for v in versions)) or "not installed"})
    totals = _distinct(pv.get("cuda_total_memory_bytes") for pv in provs)
    if totals:
        facts.append({"key": "CUDA total memory", "value": ", ".join(format_value("x_bytes", t) for t in totals)})
    return facts


def _counts_text(counts: dict) -> str:
    return ", ".join(f"{counts.get(s, 0)} {s}" for s in STATUSES)


def commands(profile: str, experiment: str, points: list[dict]) -> dict:
    targets = [f"results/{profile}/points/{experiment}/{p.get('point')}.json" for p in points]
    return {
        "pipeline": f"snakemake --cores all --config profile={profile}",
        "experiment": (f"snakemake --cores all --config profile={profile} --force " + " ".join(targets))
        if targets else "",
        "points": [{"point": str(p.get("point")), "command": p.get("command") or "not recorded"} for p in points],
    }


def kind_table(kind: str, rows: list[dict], grid: list[str]) -> dict:
    return {"kind": kind, "view": table_view(rows, _kind_columns(kind, rows, grid))}


def experiment_file_text(experiments_dir, name: str) -> dict:
    """Title and description from `experiments/<name>.yaml` when there is one (else empty)."""
    path = resolve(Path(experiments_dir) / f"{name}.yaml")
    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError):
        return {}
    if not isinstance(data, dict):
        return {}
    return {"title": data.get("title") or "", "what": " ".join(str(data.get("description") or "").split())}


def _extra_table(name: str, key: str, df) -> dict | None:
    if df is None or not len(df):
        return None
    title, columns, note = EXTRA_TABLES[key]
    return {"title": title, "id": f"table-{name}-{key}", "note": note, "view": table_view(records(df), columns)}


def _capture_note(row: dict) -> str:
    """A sweep's one capture, in a sentence: what it held, what it cost, what it served."""
    def show(column):
        return format_value(column, row.get(column))
    return (f"{row.get('point')}: one capture of {show('positions')} positions in {show('capture_seconds')} "
            f"(attention {show('capture_attention_tflops_per_second')}); resident state {show('resident_bytes')} "
            f"measured against {show('predicted_resident_bytes')} predicted "
            f"({show('bytes_per_position_measured')} against {show('bytes_per_position_predicted')}), "
            f"capture transient {show('transient_bytes')}; steps it served: {show('steps')} "
            f"({show('steps_ok')} ok, {show('steps_oom')} oom).")


def _time_limit_note(row: dict) -> str:
    limit = f" ({format_value('time_limit_seconds', row['time_limit_seconds'])})" \
        if row.get("time_limit_seconds") is not None else ""
    ran_out = "none ran out of memory" if not row.get("probes_oom") else f"{row['probes_oom']} ran out of memory"
    return (f"{row.get('point')} ({row.get('mode')}): the search stopped on its time limit{limit}; of the "
            f"probes it ran ({row.get('probes')}), {ran_out}, so its largest fitting length, "
            f"{format_value('largest_fitting', row.get('largest_fitting'))} positions, is how far it got, "
            "not where memory runs out." + _probe_members_note(row))


def _probe_members_note(row: dict) -> str:
    members = row.get("responses.probe_members")
    if is_missing(members):
        return ""
    return (f" Each probe replayed {int(members)} of the G members (a serial mode's peak is one member's; the "
            "targets below take out-of-memory step points of the same mode as the upper end of its bracket).")


def _refresh_note(row: dict, grid: list[str]) -> str:
    """A staleness point's derived refresh interval in a sentence, with what it rests on."""
    setting = ", ".join(f"{k}={row[k]}" for k in grid if not is_missing(row.get(k)))
    head = f"{row.get('point')}" + (f" ({setting})" if setting else "")
    if row.get("status") != "ok" or is_missing(row.get("refresh_interval")):
        why = row.get("error") or row.get("report_error") or "no drift measured"
        return f"{head}: no refresh interval (status {row.get('status')}: {why})."
    text = f"{head}: refresh interval {refresh_interval_sentence(row)}."
    if not is_missing(row.get("max_relative_loss_drift")):
        text += (f" Largest loss drift {format_percent(row['max_relative_loss_drift'])} at step "
                 f"{row.get('max_drift_step')}; drift at steps 1-2: "
                 f"{format_percent(row.get('relative_loss_drift_step1'))}, "
                 f"{format_percent(row.get('relative_loss_drift_step2'))}, at "
                 f"{format_value('prompt_positions', row.get('prompt_positions'))} prompt positions "
                 "(the paper's reading beside ours: the table below).")
    if row.get("step0_drift_zero") is False:
        text += " Step 0's drift is not zero: the oracle's fresh capture does not reproduce the stale one."
    return text


def section_notes(rows: list[dict], grid: list[str] = ()) -> list[str]:
    """What a row cannot say in one cell: a sweep's capture, a capacity search cut off by time, a
    staleness point's refresh interval."""
    notes = []
    for row in rows:
        if row.get("kind") == "sweep" and row.get("positions") is not None:
            notes.append(_capture_note(row))
        if row.get("kind") == "capacity" and row.get("search_stopped_on_time_limit"):
            notes.append(_time_limit_note(row))
        if row.get("kind") == "staleness":
            notes.append(_refresh_note(row, list(grid)))
    return notes


def experiment_section(name: str, df, probes, points: list[dict], figures: dict, profile: str,
                       paper_entry: dict, paper_rows: list[dict], steps=None, comparison=None, drift=None) -> dict:
    rows = records(df) if df is not None else []
    grid = _grid_columns(list(df.columns)) if df is not None else []
    kinds = list(dict.fromkeys(str(r.get("kind")) for r in rows))
    titles = _distinct(p.get("experiment_title") for p in points)
    return {
        "name": name,
        "anchor": f"experiment-{name}",
        "title": titles[0] if titles else paper_entry.get("title", name),
        "what": paper_entry.get("what", ""),
        "counts": status_counts(points),
        "counts_text": _counts_text(status_counts(points)),
        "figures": [{"src": f"figures/{path.name}", "caption": figure_caption(key), "alt": key}
                    for key, path in figures.items() if key.split("/", 1)[0] == name],
        "tables": [kind_table(kind, [r for r in rows if str(r.get("kind")) == kind], grid) for kind in kinds],
        "probes": table_view(records(probes), PROBE_COLUMNS) if probes is not None and len(probes) else None,
        "extra_tables": [t for t in (_extra_table(name, "sweep_steps", steps),
                                     _extra_table(name, "comparison", comparison),
                                     _extra_table(name, "drift", drift)) if t],
        "notes": section_notes(rows, grid),
        "paper": [r for r in paper_rows if r["experiment"] == name],
        "csv": f"tables/{name}.csv" if rows else "",
        "failures": [{"point": str(p.get("point")), "status": p.get("status"),
                      "error": p.get("error") or "no message recorded",
                      "peak": format_value("peak_allocated_bytes", p.get("peak_allocated_bytes"))
                      if p.get("peak_allocated_bytes") is not None else ""}
                     for p in points if p.get("status") != "ok"],
        "commands": commands(profile, name, points),
        "provenance": provenance_facts(points) if points else [],
        "empty": not points,
    }


def recorded_report_link(folder: Path, out_dir: Path) -> str:
    """The recorded results' own report (the pipeline renders it as `reports/recorded-<folder>/`,
    beside this report's folder), relative to this page; empty where it was not rendered."""
    page = out_dir.parent / f"recorded-{folder.name}" / "index.html"
    return os.path.relpath(page, out_dir) if page.is_file() and page.parent != out_dir else ""


def recorded_section(recorded_dir, out_dir, results_dir) -> dict:
    """Recorded GPU results, as recorded: their own table, never merged into the local ones."""
    folder = resolve(recorded_dir)
    if not folder.is_dir():
        return {"dir": str(recorded_dir), "view": None, "count": 0, "notes": [], "link": "", "same": False,
                "missing": f"no recorded results folder at {recorded_dir}"}
    points = load_points(folder)
    rows = []
    for point in points:
        row = point_row(point)
        row["file"] = str(Path(point["result_file"]).relative_to(folder))
        rows.append(row)
    notes = sorted({p["provenance"]["commit_source"] for p in points
                    if isinstance(p.get("provenance"), dict) and p["provenance"].get("commit_source")})
    same = resolve(results_dir).resolve() == folder.resolve()  # the recorded results' own report
    return {"dir": str(recorded_dir), "view": table_view(rows, RECORDED_COLUMNS) if rows else None,
            "count": len(rows), "counts_text": _counts_text(status_counts(points)), "notes": notes, "missing": "",
            "link": recorded_report_link(folder, Path(out_dir)), "same": same,
            "command": f"python -m longstraw.report.render --profile {folder.name} --results {recorded_dir} "
                       f"--out reports/recorded-{folder.name} --recorded {recorded_dir}"}


def targets_section(results_dir, profile: str) -> dict | None:
    """The GPU targets (`longstraw.report.targets.evaluate_targets`) as a table; None on CPU, whose
    sizes and ceilings are emulated (every target would read "not measured"), or where the module
    is not there. An exception while evaluating is shown, not raised: the rest still renders."""
    if profile == "cpu":
        return None
    try:
        from longstraw.report.targets import evaluate_targets
    except ImportError:
        return None
    try:
        rows = evaluate_targets(resolve(results_dir))
    except Exception as exc:
        return {"rows": [], "error": f"{type(exc).__name__}: {exc}"}
    return {"error": "", "rows": [{"target": r.get("target", ""), "goal": r.get("goal", ""),
                                   "measured": r.get("measured", ""), "evidence": r.get("evidence", ""),
                                   "met": MET_TEXT.get(r.get("met"), str(r.get("met")))} for r in rows]}


# -------------------------------------------------------------------------------------------- page

def environment(templates_dir=None) -> jinja2.Environment:
    """Templates from `reports/templates` of the working folder when it has them (the Snakemake
    rule's inputs), else the package checkout's."""
    templates_dir = templates_dir or resolve("reports/templates")
    return jinja2.Environment(loader=jinja2.FileSystemLoader(str(templates_dir)),
                              autoescape=jinja2.select_autoescape(["html"]), undefined=jinja2.StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True)


def remove_stale_figures(folder: Path, current) -> None:
    """Figures of an earlier render that this one did not draw (a removed experiment) would sit
    beside the page unreferenced; remove them so the folder shows exactly what the page shows."""
    keep = {Path(p).resolve() for p in current}
    for png in folder.glob("*.png") if folder.is_dir() else []:
        if png.resolve() not in keep:
            png.unlink()


def build_context(profile: str, results_dir, out_dir, recorded_dir, paper_path, experiments_dir="experiments") -> dict:
    out_dir = Path(out_dir)
    points = load_points(results_dir)
    frames, probes = tables(points), probe_tables(points)
    steps, comparisons = sweep_step_tables(points), comparison_tables(points)
    drift = staleness_step_tables(points)
    ceiling = memory_ceiling(points)
    paper = load_paper(resolve(paper_path))
    figures = make_plots(frames, out_dir / "figures", probes=probes, ceiling=ceiling, steps=steps,
                         comparisons=comparisons, marks=reference_marks(paper), drift=drift)
    remove_stale_figures(out_dir / "figures", figures.values())
    write_tables(frames, out_dir / "tables", probes=probes, steps=steps, comparisons=comparisons, drift=drift)
    paper_entries = {e.get("name"): e for e in paper.get("experiments") or [] if isinstance(e, dict)}

    by_experiment: dict[str, list[dict]] = {}
    for point in points:
        by_experiment.setdefault(str(point.get("experiment")), []).append(point)
    names = experiment_order(set(frames) | set(paper_entries))
    described = {name: {**paper_entries.get(name, {}),
                        **{k: v for k, v in experiment_file_text(experiments_dir, name).items() if v}}
                 for name in names}
    # A sweep's steps are rows like step points' (mode, G, peak, V1 evidence): the paper's figures
    # and the validation levels read them beside the point rows.
    with_steps = {name: pd.concat([df, steps[name]], ignore_index=True) if name in steps else df
                  for name, df in frames.items()}
    # The staleness oracle's steps too (the paper's drift at steps 1-2 stands beside them).
    rows_by_experiment = {name: records(pd.concat([df, drift[name]], ignore_index=True) if name in drift else df)
                          for name, df in with_steps.items()}
    figures_beside = compare_figures(paper, rows_by_experiment, ceiling)
    sections = [experiment_section(name, frames.get(name), probes.get(name), by_experiment.get(name, []), figures,
                                   profile, described[name], figures_beside, steps.get(name), comparisons.get(name),
                                   drift.get(name))
                for name in names]
    all_rows = [r for df in frames.values() for r in records(df)]
    paths = all_paths(with_steps, points)
    counts = status_counts(points)
    return {
        "profile": profile,
        "results_dir": str(results_dir),
        "generated": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "summary": {
            "total": len(points), "counts": counts, "counts_text": _counts_text(counts),
            "kinds": ", ".join(f"{n} {k}" for k, n in sorted(Counter(str(p.get("kind")) for p in points).items())),
            "experiments": [{"name": s["name"], "anchor": s["anchor"], "title": s["title"],
                             "total": sum(s["counts"].values()), **s["counts"]} for s in sections],
            "provenance": provenance_facts(points),
            "ceiling": ceiling["label"],
        },
        "targets": targets_section(results_dir, profile),
        "paper": {"missing": paper.get("missing", ""), "scale": scale_rows(paper, all_rows, ceiling),
                  "figures": figures_beside},
        "validation": {"levels": levels_table(paths, paper.get("standing") or {}), "paths": paths,
                       "paper_paths": paper_paths(paper)},
        "experiments": sections,
        "recorded": recorded_section(recorded_dir, out_dir, results_dir),
    }


def render_report(profile: str, results_dir, out_dir, recorded_dir="experiments/recorded/h200",
                  paper="experiments/reference/paper.yaml", templates_dir=None, experiments_dir="experiments") -> Path:
    """Write `out_dir/index.html` (+ figures/ and tables/ beside it); returns the page's path."""
    context = build_context(profile, results_dir, out_dir, recorded_dir, paper, experiments_dir)
    html = environment(templates_dir).get_template("report.html").render(**context)
    return write_text_atomic(Path(out_dir) / "index.html", html)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", required=True, help="cpu or h200 (names the commands the report shows)")
    parser.add_argument("--results", required=True, help="results folder, e.g. results/cpu")
    parser.add_argument("--out", required=True, help="report folder, e.g. reports/cpu")
    parser.add_argument("--recorded", default="experiments/recorded/h200", help="recorded GPU results folder")
    parser.add_argument("--paper", default="experiments/reference/paper.yaml", help="the paper's figures as data")
    args = parser.parse_args(argv)
    page = render_report(args.profile, args.results, args.out, recorded_dir=args.recorded, paper=args.paper)
    counts = status_counts(load_points(args.results))
    print(json.dumps({"report": os.fspath(page), "statuses": counts}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
