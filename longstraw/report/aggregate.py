"""The tables stage: result files -> CSV tables (`store`), the only stage that reads result JSONs;
the figures and the page read these tables alone.

Input layout: `<results>/points/<experiment>/<point>.json` (or `<results>/<experiment>/<point>.json`),
each the dict `longstraw.harness.runner.run_point` returns plus the pipeline's keys (`experiment`,
`point`, `profile`, `grid`, `experiment_title`, `command`). Every key is read defensively: an error
point has no metrics, a CPU point has no CUDA peaks, a newer kind has metrics we do not know yet
(its scalar metrics still become columns).

Tables (`write_all`):
- `<experiment>.csv`: one row per point (oom and error rows kept, with their message): identity,
  grid values, status, the columns every point has (`kinds.common_columns`), its kind's
  (`Kind.columns`), then any other scalar metric, and the result file it came from;
- `<experiment>.<suffix>.csv`: a kind's tables of its own (`Kind.tables`): a sweep's steps,
  a capacity search's probes and comparison steps, the staleness oracle's steps, a validation
  point's paths;
- `points.csv`: every experiment's rows in one table;
- `files.csv`: one row per result file, in file order: what the page says about a point beyond its
  row (the experiment's title, the command, the failure, the provenance);
- `experiments.csv`: each experiment file's title and description (`experiments/<name>.yaml`);
- `targets.csv`: the GPU targets (`targets.evaluate_targets`), on a profile other than cpu.
The manifest also holds the memory ceiling the figures and the page state (`plotting.ceiling`).
"""

from __future__ import annotations

import json
import math
import numbers
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from longstraw import kinds
from longstraw.config import recorded_config, recorded_grid
from longstraw.harness.plan import RESERVED_NAMES
from longstraw.plotting.ceiling import memory_ceiling
from longstraw.report.store import write_tables
from longstraw.results import STATUSES, as_dict, number, point_parts, scalar

EXPERIMENT_ORDER = ("g_sweep", "operating_points", "baselines", "architectures", "staleness")
LEADING_COLUMNS = ("point", "kind")
STATUS_COLUMNS = ("status", "error")
# Tables of every results folder; an experiment may not take these names.
GENERAL_TABLES = RESERVED_NAMES  # the tables every report has: the plan refuses an experiment of these names


# ---------------------------------------------------------------------------------------- loading


def load_points(results_dir) -> list[dict]:
    """Every result JSON under `results_dir` (its `points/` folder when there is one), sorted by path;
    `result_file`: the file's path relative to `results_dir`, and `results_dir` itself (what a kind reads beside its
    points: the CP scaling model calibrates on the records folder its H200 points came from).

    A file that cannot be parsed becomes an `error` point naming the file, so it shows in the report."""
    root = Path(results_dir)
    base = root / "points" if (root / "points").is_dir() else root
    if not base.is_dir():
        return []
    points = []
    for path in sorted(base.rglob("*.json")):
        if not path.name.startswith("."):
            point = load_point(path, base)
            point["result_file"] = path.relative_to(root).as_posix()
            point["results_dir"] = str(root)
            points.append(point)
    return points


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
    if isinstance(point.get("config"), dict):
        point["config"] = recorded_config(point["config"], point.get("kind"), kinds.sections())
    if isinstance(point.get("grid"), dict):
        point["grid"] = recorded_grid(point["grid"])
    if point.get("status") not in STATUSES:
        point["error"] = point.get("error") or f"result has no valid status (got {point.get('status')!r})"
        point["status"] = "error"
    point["result_file"] = str(path)
    return point


def experiment_order(names) -> list[str]:
    """The paper's experiments first, in the paper's order; any later ones alphabetically."""
    names = set(names)
    return [n for n in EXPERIMENT_ORDER if n in names] + sorted(names - set(EXPERIMENT_ORDER))


def by_experiment(points: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = defaultdict(list)
    for point in points:
        grouped[str(point.get("experiment"))].append(point)
    return grouped


# ------------------------------------------------------------------------------------ row per point


def point_row(point: dict) -> dict:
    """One table row: identity, grid values, status, common columns, then the kind's metrics."""
    cfg, metrics = point_parts(point)
    kind = point.get("kind") or cfg.get("kind") or "unknown"
    row = {"experiment": point.get("experiment"), "point": point.get("point") or point.get("name"), "kind": kind}
    grid = as_dict(point.get("grid"))
    # a whole section a point sets (`set: {model: {...}}`) yields to what is derived from it (the model's name)
    sections = {key: scalar(value) for key, value in grid.items() if isinstance(value, dict)}
    for key, value in grid.items():
        if key not in sections:
            row[key] = scalar(value)
    row["status"] = point.get("status")
    row["error"] = point.get("error")
    if point.get("status") == "oom" and number(point.get("peak_allocated_bytes")) is not None:
        row["peak_memory_bytes"] = point["peak_allocated_bytes"]  # the peak reached when it ran out
        row["peak_memory_measure"] = "peak_allocated_bytes at OOM"
    _add(row, kinds.common_columns(point))
    try:
        _add(row, kinds.part(kind, "columns")(point))
    except Exception as exc:  # a malformed result must still render: say so in its row
        row["report_error"] = f"metrics not readable: {type(exc).__name__}: {exc}"
    _add(row, _generic_metrics(metrics))
    _add(row, sections)
    _add(row, {"result_file": point.get("result_file")})
    return row


def _add(row: dict, columns: dict) -> None:
    """Earlier columns win: a grid value is never overwritten by a derived one of the same name."""
    for key, value in columns.items():
        row.setdefault(key, value)


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
        keys += [k for k in as_dict(point.get("grid")) if k not in keys]
    return keys


def grid_columns(columns) -> list[str]:
    """The grid keys of a point table: `frame` puts them between the identity columns and `status`."""
    columns = list(columns)
    end = columns.index("status") if "status" in columns else 0
    return [c for c in columns[:end] if c not in LEADING_COLUMNS]


def frame(rows: list[dict], grid: list[str]) -> pd.DataFrame:
    """Rows sorted by grid values (numbers numerically), columns: identity, grid, status, the rest."""
    rows = sorted(rows, key=lambda r: [_sort_key(r.get(k)) for k in grid] + [_sort_key(r.get("point"))])
    df = pd.DataFrame(rows)
    first = [c for c in dict.fromkeys((*LEADING_COLUMNS, *grid, *STATUS_COLUMNS)) if c in df.columns]
    df = df[first + [c for c in df.columns if c not in first and c != "experiment"]]
    return df.convert_dtypes(convert_string=False).reset_index(drop=True)


def tables(points: list[dict]) -> dict[str, pd.DataFrame]:
    """{experiment: DataFrame}, one row per point, experiments in the paper's order."""
    grouped = by_experiment(points)
    return {
        name: frame([point_row(p) for p in grouped[name]], grid_keys(grouped[name]))
        for name in experiment_order(grouped)
    }


def kind_tables(points: list[dict]) -> dict[str, pd.DataFrame]:
    """{"<experiment>.<suffix>": DataFrame}: each kind's tables of its own, where they have rows."""
    out = {}
    grouped = by_experiment(points)
    for name in experiment_order(grouped):
        for kind in kinds.names():
            mine = [p for p in grouped[name] if p.get("kind") == kind]
            for suffix, rows in (kinds.part(kind, "tables")(mine) if mine else {}).items():
                if rows:
                    out[f"{name}.{suffix}"] = pd.DataFrame(rows).convert_dtypes(convert_string=False)
    return out


def files_table(points: list[dict]) -> pd.DataFrame:
    """One row per result file, in file order: what the page states about a point beside its row."""
    rows = []
    for point in points:
        prov = as_dict(point.get("provenance"))
        rows.append(
            {
                "result_file": point.get("result_file"),
                "experiment": str(point.get("experiment")),
                "point": scalar(point.get("point")),
                "kind": scalar(point.get("kind")),
                "status": point.get("status"),
                "error": scalar(point.get("error")),
                "peak_allocated_bytes": scalar(point.get("peak_allocated_bytes")),
                "experiment_title": scalar(point.get("experiment_title")),
                "command": scalar(point.get("command")),
                **{
                    key: scalar(prov.get(key))
                    for key in ("device", "commit", "commit_source", "date", "python", "cuda_total_memory_bytes")
                },
                **{f"version.{key}": scalar(value) for key, value in as_dict(prov.get("versions")).items()},
            }
        )
    return pd.DataFrame(rows).convert_dtypes(convert_string=False)


def experiments_table(experiments_dir) -> pd.DataFrame:
    """Title and description of each experiment file (`<experiments_dir>/<name>.yaml`) that reads."""
    rows = []
    for path in sorted(Path(experiments_dir).glob("*.yaml")) if experiments_dir else []:
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        if isinstance(data, dict):
            rows.append(
                {
                    "experiment": path.stem,
                    "title": str(data.get("title") or ""),
                    "description": " ".join(str(data.get("description") or "").split()),
                }
            )
    return pd.DataFrame(rows, columns=["experiment", "title", "description"])


def unrecorded_table(points: list[dict], experiments_dir, profile: str) -> pd.DataFrame:
    """The points the profile's plan (`longstraw.harness.plan`, from `experiments_dir`) lists that have no
    result here: a recorded folder's gaps, or a pipeline run not finished. Empty without an experiments
    folder or for a profile the plan does not know."""
    from longstraw.harness.plan import PROFILES, plan

    columns = ["experiment", "point", "kind"]
    if not experiments_dir or not Path(experiments_dir).is_dir() or profile not in PROFILES:
        return pd.DataFrame(columns=columns)
    have = {(str(p.get("experiment")), str(p.get("point"))) for p in points}
    rows = [
        {"experiment": experiment, "point": name, "kind": entry["config"].kind}
        for experiment, planned in plan(experiments_dir, profile).items()
        for name, entry in planned["points"].items()
        if (experiment, name) not in have
    ]
    return pd.DataFrame(rows, columns=columns)


def targets_section(results_dir, profile: str) -> dict | None:
    """The GPU targets (`longstraw.report.targets.evaluate_targets`): {"rows", "error"}; None on CPU,
    whose sizes and ceilings are emulated (every target would read "not measured"), or where the
    module is not there. An exception while evaluating is kept as its text: the rest still renders."""
    if profile == "cpu":
        return None
    try:
        from longstraw.report.targets import evaluate_targets
    except ImportError:
        return None
    try:
        rows = evaluate_targets(results_dir)
    except Exception as exc:
        return {"rows": [], "error": f"{type(exc).__name__}: {exc}"}
    return {
        "error": "",
        "rows": [
            {
                "target": r.get("target", ""),
                "goal": r.get("goal", ""),
                "measured": r.get("measured", ""),
                "met": r.get("met"),
                "evidence": r.get("evidence", ""),
            }
            for r in rows
        ],
    }


def records(df: pd.DataFrame) -> list[dict]:
    """Plain Python rows: None for missing (never pd.NA / NaN), Python numbers (never numpy)."""

    def plain(value):
        if value is None or (np.ndim(value) == 0 and pd.isna(value)):
            return None
        return value.item() if isinstance(value, np.generic) else value

    return [{k: plain(v) for k, v in row.items()} for row in df.astype(object).to_dict("records")]


def status_counts(points: list[dict]) -> dict[str, int]:
    counts = {s: 0 for s in STATUSES}
    for point in points:
        counts[point.get("status", "error")] = counts.get(point.get("status", "error"), 0) + 1
    return counts


def build_tables(
    points: list[dict], results_dir, profile: str = "cpu", experiments_dir=None, targets: bool = True
) -> tuple[dict[str, pd.DataFrame], dict]:
    """Every table of a results folder, and what the stages share beside them (the manifest's meta).
    `targets`: evaluate the GPU targets (on a profile other than cpu)."""
    frames = tables(points)
    clash = sorted(set(frames) & set(GENERAL_TABLES))
    if clash:
        raise ValueError(
            f"experiment name {clash[0]!r} is taken by a table of every results folder; "
            f"rename it (reserved: {', '.join(GENERAL_TABLES)})"
        )
    everything = [df.assign(experiment=name) for name, df in frames.items()]
    combined = pd.concat(everything, ignore_index=True) if everything else pd.DataFrame(columns=["experiment"])
    combined = combined[["experiment"] + [c for c in combined.columns if c != "experiment"]]
    out = {
        **frames,
        **kind_tables(points),
        "points": combined,
        "files": files_table(points),
        "experiments": experiments_table(experiments_dir),
        "unrecorded": unrecorded_table(points, experiments_dir, profile),
    }
    state = targets_section(results_dir, profile) if targets else None
    if state is not None:
        out["targets"] = pd.DataFrame(state["rows"], columns=["target", "goal", "measured", "met", "evidence"])
    meta = {
        "results_dir": str(results_dir),
        "results_found": Path(results_dir).is_dir(),
        "profile": profile,
        "experiments": list(frames),
        "statuses": status_counts(points),
        "ceiling": memory_ceiling(points),
        "targets": None if state is None else {"error": state["error"]},
    }
    return out, meta


def write_all(results_dir, out_dir, profile: str = "cpu", experiments_dir=None, targets: bool = True) -> dict:
    """The tables stage: load every result under `results_dir`, write every table and the manifest
    to `out_dir`; returns the manifest."""
    points = load_points(results_dir)
    frames, meta = build_tables(points, results_dir, profile, experiments_dir, targets)
    manifest = write_tables(frames, out_dir, meta)
    print(
        json.dumps(
            {"tables": str(Path(out_dir)), "written": len(manifest["tables"]), "statuses": status_counts(points)}
        )
    )
    return manifest
