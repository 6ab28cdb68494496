"""The paper's figures (`paper.yaml` beside this module, package data) set beside ours, with the scale
difference stated.

Each figure names the aggregated column that answers it (`ours:`); the value shown is read from the
same tables the experiment sections show, so the comparison and the tables cannot disagree. A figure
without `ours`, or whose experiment has no points, reads "not yet measured". The paper's GB figures
are also read as numbers (`reference_marks`) so the plots can draw them beside ours, as are its
stated ranges (`band:`, e.g. the staleness drift at steps 1-2).

`op: per_point` gives one row per point of the experiment (e.g. each staleness point's drift at
steps 1-2, or its refresh interval; `kind` keeps the points of that kind): its values where `where`
matches (a list value matches any of its items), each named by the `label` column, or with
`format: refresh_interval` the derived refresh interval in a sentence; a point that did not complete
gets its row with its status. `op: regime` (with `low`, `high`, `positions`) says in one row whether a
staleness drift range appears and at which learning rate (the staleness kind's `regime_sentence`).
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import yaml

from longstraw import kinds
from longstraw.plotting.formatting import exact_value, format_bytes, format_number, format_value, is_missing

NOT_MEASURED = "not yet measured"
EMPTY_PAPER = {"setup": {}, "experiments": [], "figures": [], "standing": {}, "paths": [], "memory_points": []}
# What the two trainable-parameter counts cover, so they are not read as the same adapter: the
# paper's 116.7M is LoRA r=16 on the attention, GDN and MLP projections; ours depends on the row's
# `lora.targets`.
PAPER_LORA_TARGETS = "LoRA r=16 on the attention, GDN and MLP projections"
# what our `lora.targets` sets cover (longstraw/models/lora.py TARGET_SETS)
OUR_LORA_TARGETS = {
    "attention": "attention and GDN projections only, no MLP (lora.targets: attention)",
    "all-linear": "attention, GDN and MLP projections (lora.targets: all-linear)",
}
_GB = re.compile(r"(\d[\d,]*(?:\.\d+)?)\s*GB\b")


def paper_file():
    """The paper's figures file shipped with the package."""
    return resources.files("longstraw.report").joinpath("paper.yaml")


def load_paper(path=None) -> dict:
    """The paper's figures as data (default: the package's `paper.yaml`); an absent file gives empty
    sections (the report says so)."""
    path = paper_file() if path is None else Path(path)
    if not path.is_file():
        return {**EMPTY_PAPER, "missing": str(path)}
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    return {**EMPTY_PAPER, **{k: v for k, v in data.items() if v is not None}}


def memory_points(paper: dict) -> list[dict]:
    """The paper's operating points as {"positions", "bytes" (its GB as 10^9 bytes), "text"}."""
    return [
        {"positions": int(p["positions"]), "bytes": float(p["gb"]) * 1e9, "text": str(p.get("text", ""))}
        for p in paper.get("memory_points") or []
        if isinstance(p, dict) and isinstance(p.get("positions"), int) and isinstance(p.get("gb"), (int, float))
    ]


def _matches(row: dict, key: str, wanted) -> bool:
    if isinstance(wanted, list):  # any of the listed values
        return any(_matches(row, key, w) for w in wanted)
    value = row.get(key)
    return value == wanted or (value is not None and str(value) == str(wanted))


def select(rows: list[dict], where: dict) -> list[dict]:
    """Rows matching `where`; a `max` / `min` value keeps the rows at that column's extreme."""
    extremes = {k: v for k, v in where.items() if v in ("max", "min")}
    rows = [r for r in rows if all(_matches(r, k, v) for k, v in where.items() if k not in extremes)]
    for key, which in extremes.items():
        values = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        if not values:
            return []
        target = max(values) if which == "max" else min(values)
        rows = [r for r in rows if r.get(key) == target]
    return rows


def _with_gb(column: str, value) -> str:
    """Ours in GiB, and in GB (10^9 bytes) beside it from 0.1 GB up: the paper states differences as
    small as +0.208 GB."""
    if column.endswith("bytes") and isinstance(value, (int, float)):
        return format_bytes(value, decimal_from=1e8)
    return format_value(column, value)


def _signed(column: str, value) -> str:
    return ("+" if value >= 0 else "-") + _with_gb(column, abs(value))


def _points(rows) -> str:
    """The points behind a value, each once (a sweep point's steps are rows of the same point)."""
    return ", ".join(dict.fromkeys(str(r.get("point")) for r in rows))


def _length(row: dict):
    """The prompt length a row ran at: the setting, else the positions the capture held."""
    for key in ("prompt_length", "prompt_positions"):
        if isinstance(row.get(key), (int, float)) and not isinstance(row.get(key), bool):
            return int(row[key])
    return None


def scale_text(rows: list[dict], lengths: bool = True) -> str:
    """Which of our models a value was measured on and at which prompt lengths ("hybrid-1b at 2,097,152
    positions"; `lengths` False: the models only), from its rows: the paper's claims are at 27B and millions of
    positions, ours may not be."""
    at: dict[str, set] = {}
    for row in rows:
        if not is_missing(row.get("model")):
            at.setdefault(str(row["model"]), set()).update({n for n in [_length(row)] if n is not None and lengths})
    parts = [
        f"{model} at {' and '.join(f'{n:,}' for n in sorted(ns))} positions" if ns else model
        for model, ns in at.items()
    ]
    return "; ".join(parts)


def _on(text: str, rows: list[dict], column: str = "") -> str:
    """`text` with the models and lengths of its `rows` (the models only where the value is a length)."""
    scale = scale_text(rows, lengths=column not in ("prompt_length", "prompt_positions"))
    return f"{text}; {scale}" if scale else text


def ours_value(spec: dict | None, rows: list[dict], ceiling: dict) -> dict:
    """{"text", "value" (exact number or None), "points"} for one figure."""
    if not spec:
        return {"text": NOT_MEASURED, "value": None, "points": ""}
    if spec.get("source") == "ceiling":
        # the label's size carries its GB (format_bytes)
        return {"text": ceiling.get("label", "not known"), "value": exact_value(ceiling.get("bytes")), "points": ""}
    column, op = spec.get("column"), spec.get("op", "value")
    ok = [r for r in rows if r.get("status") == "ok" and r.get(column) is not None]
    if not rows:
        return {"text": NOT_MEASURED, "value": None, "points": ""}
    if op in ESTIMATE_OPS:
        return ESTIMATE_OPS[op](spec, _point_rows(rows))
    if op == "list":
        values = sorted({r[column] for r in ok})
        return {
            "text": ", ".join(format_value(column, v) for v in values) or "no ok point",
            "value": None,
            "points": _points(ok),
        }
    if op == "difference":
        start, end = select(ok, spec.get("from", {})), select(ok, spec.get("to", {}))
        if not start or not end:
            return {
                "text": _missing_text(rows, spec.get("from", {}) if not start else spec.get("to", {})),
                "value": None,
                "points": "",
            }
        a, b = max(r[column] for r in start), max(r[column] for r in end)
        return {
            "text": _on(_signed(column, b - a), start + end),
            "value": exact_value(b - a),
            "points": f"{_points(start)} -> {_points(end)}",
        }
    chosen = select(ok, spec.get("where", {}))
    if not chosen:
        return {"text": _missing_text(rows, spec.get("where", {})), "value": None, "points": ""}
    values = [r[column] for r in chosen]
    value = min(values) if spec.get("reduce") == "min" else max(values)
    text = _with_gb(column, value)
    measures = sorted({str(r["peak_memory_measure"]) for r in chosen if r.get("peak_memory_measure")})
    if column == "peak_memory_bytes" and measures:  # say what was measured: CUDA allocated or CPU RSS
        text += f", {' / '.join(measures)}"
    at = [r for r in chosen if r[column] == value]  # the rows the value is read from
    return {"text": _on(text, at, column), "value": exact_value(value), "points": _points(chosen)}


def _estimate(value, se) -> str:
    """A statistic with its standard error: +0.655 +- 0.044 (14.8 SE)."""
    ratio = f" ({value / se:.1f} SE)" if se else ""
    return f"{value:+.3f} +- {se:.3f}{ratio}"


def _trained_length(row: dict):
    """Where a learning row trained: its probe's chosen length, else its prompt length."""
    chosen = row.get("trained_length")
    return int(chosen) if isinstance(chosen, (int, float)) and not is_missing(chosen) else _length(row)


def longest_reached(spec: dict, rows: list[dict]) -> dict:
    """`op: longest_reached`: per model, the longest length at which a point reached its statistic in any of
    `modes` (columns `{mode}_reached`, `{mode}_gain`, `{mode}_gain_se`), with each mode's estimates there (every
    point that ran it, reached ones first: the modes may be points of their own, and a run repeated with other
    settings is a point of its own)."""
    modes = spec.get("modes") or []
    ok = [r for r in rows if r.get("status") == "ok"]
    longest: dict[str, int] = {}
    for row in ok:
        if any(row.get(f"{m}_reached") is True for m in modes):
            model = str(row.get("model"))
            longest[model] = max(longest.get(model, 0), _trained_length(row) or 0)
    parts, used = [], []
    for model, length in sorted(longest.items()):
        there = [r for r in ok if str(r.get("model")) == model and (_trained_length(r) or 0) == length]
        estimates = []
        for m in modes:
            ran = [r for r in there if not is_missing(r.get(f"{m}_gain")) and not is_missing(r.get(f"{m}_gain_se"))]
            ran.sort(key=lambda r: (r.get(f"{m}_reached") is not True, str(r.get("point"))))
            if ran:
                used += ran
                each = [f"{_estimate(r[f'{m}_gain'], r[f'{m}_gain_se'])} ({r.get('point')})" for r in ran]
                estimates.append(f"{m} {', '.join(each)}")
        parts.append(f"{model} at {format_number(length)}: {', '.join(estimates)}")
    return {"text": "; ".join(parts) or "not reached at any length", "value": None, "points": _points(used)}


def estimate_list(spec: dict, rows: list[dict]) -> dict:
    """`op: estimate_list`: every point's `column` with its standard error (column `se`), by model and length."""
    column, se = spec.get("column"), spec.get("se")
    found = [r for r in rows if r.get("status") == "ok" and not is_missing(r.get(column)) and not is_missing(r.get(se))]
    parts = [
        f"{r.get('model')} at {format_number(_trained_length(r))}: {_estimate(r[column], r[se])} ({r.get('point')})"
        for r in sorted(found, key=lambda r: (str(r.get("model")), _trained_length(r) or 0))
    ]
    return {"text": "; ".join(parts) or "no point ran both", "value": None, "points": _points(found)}


ESTIMATE_OPS = {"longest_reached": longest_reached, "estimate_list": estimate_list}


def _missing_text(rows, where) -> str:
    """Why there is no value: no such point, or only failed points (their statuses named)."""
    plain = {k: v for k, v in where.items() if v not in ("max", "min")}
    tried = [r for r in rows if all(_matches(r, k, v) for k, v in plain.items())]
    failed = sorted({str(r.get("status")) for r in tried if r.get("status") != "ok"})
    if failed:
        return f"no ok point ({', '.join(failed)})"
    needs = ", ".join(f"{k} {v}" for k, v in where.items())
    return f"not measured in these results (it needs a point with {needs})" if where else "no ok point"


def _point_rows(rows: list[dict]) -> list[dict]:
    """The row per point (not a sweep step or an oracle step), in table order, each point once."""
    seen, out = set(), []
    for row in rows:
        if str(row.get("kind")).endswith("_step") or row.get("kind") == "step" and row.get("step") is not None:
            continue
        if row.get("point") not in seen:
            seen.add(row.get("point"))
            out.append(row)
    return out


def _describe(row: dict, columns) -> str:
    parts = [f"{c} {format_value(c, row[c])}" for c in columns or () if not is_missing(row.get(c))]
    return f" ({', '.join(parts)})" if parts else ""


def per_point_rows(figure: dict, rows: list[dict]) -> list[dict]:
    """`op: per_point`: one row per point of the experiment, its values beside the paper's figure."""
    spec, experiment = figure.get("ours") or {}, figure.get("experiment")
    column, label, where = spec.get("column"), spec.get("label"), spec.get("where") or {}
    out = []
    for point in _point_rows(rows):
        if spec.get("kind") and point.get("kind") != spec["kind"]:  # an experiment of several kinds
            continue
        name = point.get("point")
        value = None
        if point.get("status") != "ok":
            text = f"no result: status {point.get('status')}" + (f" ({point['error']})" if point.get("error") else "")
        elif spec.get("format") == "refresh_interval":
            text, value = kinds.contributed("refresh_interval_sentence")(point), exact_value(point.get(column))
        else:
            mine = [
                r
                for r in select([r for r in rows if r.get("point") == name], where)
                if r.get("status") == "ok" and not is_missing(r.get(column))
            ]
            if not mine:
                wanted = ", ".join(f"{k}={v}" for k, v in where.items())
                text = f"not measured: no {column}" + (f" at {wanted}" if wanted else "") + " in the result"
            else:
                text = ", ".join(
                    (f"{label} {format_value(label, r.get(label))}: " if label else "")
                    + format_value(column, r[column])
                    for r in mine
                )
                value = exact_value(mine[0][column]) if len(mine) == 1 else None
        out.append(
            {
                "model": point.get("model"),
                "prompt_length": _length(point),
                "experiment": experiment,
                "quantity": f"{figure.get('quantity', '')}: {name}{_describe(point, spec.get('describe'))}",
                "paper": figure.get("paper", ""),
                "ours": text,
                "value": value,
                "points": str(name),
                "has_section": True,
            }
        )
    return out


def compare_figures(paper: dict, rows_by_experiment: dict[str, list[dict]], ceiling: dict) -> list[dict]:
    """One row per figure of the paper (several for a `per_point` figure: one per point), each with
    `claim`, the figure's index in `paper.yaml`."""
    out = []
    for claim, figure in enumerate(paper.get("figures") or []):
        experiment = figure.get("experiment")
        rows = rows_by_experiment.get(experiment, [])
        spec = figure.get("ours") or {}
        if spec.get("op") == "regime" and _point_rows(rows):
            text = kinds.contributed("regime_sentence")(
                _point_rows(rows), spec["low"], spec["high"], spec.get("positions")
            )
            out.append(
                {
                    "experiment": experiment,
                    "quantity": figure.get("quantity", ""),
                    "paper": figure.get("paper", ""),
                    "ours": text,
                    "value": None,
                    "points": "",
                    "has_section": True,
                    "claim": claim,
                }
            )
            continue
        if spec.get("op") == "per_point" and _point_rows(rows):
            out += [{**row, "claim": claim} for row in per_point_rows(figure, rows)]
            continue
        ours = ours_value(figure.get("ours"), rows, ceiling)
        if not figure.get("ours") and rows:
            ours = {"text": f"see the {experiment} section", "value": None, "points": ""}
        out.append(
            {
                "experiment": experiment,
                "quantity": figure.get("quantity", ""),
                "paper": figure.get("paper", ""),
                "ours": ours["text"],
                "value": ours["value"],
                "points": ours["points"],
                "has_section": experiment in rows_by_experiment,
                "claim": claim,
            }
        )
    for experiment, rows in rows_by_experiment.items():
        out += trainable_parameter_rows(paper, experiment, rows)
    return out


def claim_rows(paper: dict, compared: list[dict]) -> list[dict]:
    """One row per figure the paper states, for the page's summary: the paper's number, ours (the
    one value, or how many points answer it, with the models and lengths they ran at), and where to read
    it (the experiment's section, else the comparison table)."""
    out = []
    for claim, figure in enumerate(paper.get("figures") or []):
        mine = [r for r in compared if r.get("claim") == claim]
        scale = scale_text(mine)  # a point's own row (`per_point`) names its model; a value's text already does
        if len(mine) == 1:
            ours = f"{mine[0]['ours']}; {scale}" if scale else mine[0]["ours"]
        else:
            ours = f"{len(mine)} points{f' ({scale})' if scale else ''}: see the section" if mine else NOT_MEASURED
        experiment = str(figure.get("experiment"))
        section = bool(mine) and mine[0]["has_section"]
        out.append(
            {
                "quantity": figure.get("quantity", ""),
                "paper": figure.get("paper", ""),
                "ours": ours,
                "where": experiment if section else "the paper's figures",
                "link": f"#experiment-{experiment}" if section else "#paper-figures",
            }
        )
    return out


def trainable_parameter_rows(paper: dict, experiment: str, rows: list[dict]) -> list[dict]:
    """Our trainable-parameter count on a model of the paper's shape (a preset named after the
    paper's model, e.g. qwen3.6-27b-shape) beside the paper's, with what each adapter covers."""
    setup = paper.get("setup") or {}
    paper_model = str(setup.get("model") or "").split(" ", 1)[0].lower()
    count = setup.get("trainable_parameters")
    shaped = [
        r
        for r in rows
        if r.get("status") == "ok"
        and isinstance(r.get("trainable_parameters"), int)
        and paper_model
        and str(r.get("model") or "").lower().startswith(paper_model)
    ]
    out = []
    for row in shaped:
        ours = row["trainable_parameters"]
        ratio = f", {ours / count:.2f}x the paper's" if isinstance(count, (int, float)) and count else ""
        lora = f"LoRA r={row['lora_r']} on the " if row.get("lora_r") is not None else ""
        out.append(
            {
                "experiment": experiment,
                "quantity": f"trainable parameters, {row.get('model')}",
                "paper": f"{setup.get('trainable_parameters_text', 'not stated')} ({PAPER_LORA_TARGETS})",
                "ours": f"{format_number(ours)}{ratio} ({lora}"
                f"{OUR_LORA_TARGETS.get(row.get('lora_targets') or 'attention', row.get('lora_targets'))})",
                "value": exact_value(ours),
                "points": str(row.get("point")),
                "has_section": True,
            }
        )
    return out


def reference_marks(paper: dict) -> dict[str, list[dict]]:
    """The paper's peak-memory figures as numbers, per experiment, for the plots: {"bytes" (the
    paper's GB as 10^9 bytes), "where" (the filter naming which of our rows it stands beside),
    "text" (the paper's number as written), "source" (whose: model size, parallelism)}. Only figures
    answered by `peak_memory_bytes` of one row (not differences or lists). A figure's stated range
    (`band: {steps, low, high, text}`, fractions) becomes {"band": ...} for the drift plot."""
    setup = paper.get("setup") or {}
    source = ", ".join(str(v).split(" (")[0] for v in (setup.get("parameters"), setup.get("parallelism")) if v)
    source = f"paper ({source}, per rank)" if source else "paper"
    marks: dict[str, list[dict]] = {}
    for figure in paper.get("figures") or []:
        band = figure.get("band")
        if (
            isinstance(band, dict)
            and all(isinstance(band.get(k), (int, float)) for k in ("low", "high"))
            and band.get("steps")
        ):
            marks.setdefault(str(figure.get("experiment")), []).append(
                {"band": {**band, "text": band.get("text") or figure.get("paper", "")}}
            )
        spec = figure.get("ours") or {}
        match = _GB.search(str(figure.get("paper") or ""))
        if not match or spec.get("column") != "peak_memory_bytes" or spec.get("op", "value") != "value":
            continue
        marks.setdefault(str(figure.get("experiment")), []).append(
            {
                "bytes": float(match.group(1).replace(",", "")) * 1e9,
                "where": spec.get("where") or {},
                "text": match.group(0),
                "source": source,
            }
        )
    return marks


def _distinct(rows, key) -> list:
    return sorted({r[key] for r in rows if r.get(key) is not None}, key=str)


def _span(values, fmt) -> str:
    if not values:
        return "not recorded"
    return fmt(values[0]) if len(values) == 1 else f"{fmt(min(values))} to {fmt(max(values))}"


def scale_rows(paper: dict, rows: list[dict], ceiling: dict) -> list[dict]:
    """Paper setup against ours, row by row: model, parameters, devices, quantization, positions."""
    setup = paper.get("setup") or {}
    ran = [r for r in rows if r.get("kind") in ("step", "capture", "capacity", "sweep")]
    ok = [r for r in ran if r.get("status") == "ok"]
    models = sorted({f"{r.get('model')} ({r.get('model_type')})" for r in ran if r.get("model")})
    trainable = [v for v in _distinct(ran, "trainable_parameters") if isinstance(v, int)]
    paper_positions = setup.get("positions") or []
    return [
        {"quantity": "model", "paper": setup.get("model", "not stated"), "ours": "; ".join(models) or "no points"},
        {
            "quantity": "parameters",
            "paper": setup.get("parameters", "not stated"),
            "ours": "the presets in the model row (total parameter count not recorded per point)",
        },
        {
            "quantity": "trainable parameters",
            "paper": setup.get("trainable_parameters_text", "not stated"),
            "ours": _span(trainable, format_number),
        },
        {
            "quantity": "devices",
            "paper": setup.get("devices", "not stated"),
            "ours": "; ".join(_distinct(ran, "device")) + " (one device per process)" if ran else "no points",
        },
        {
            "quantity": "parallelism",
            "paper": setup.get("parallelism", "not stated"),
            "ours": _our_parallelism(ran),
        },
        {
            "quantity": "quantization",
            "paper": setup.get("quantization", "not stated"),
            "ours": _our_quantization(ran) if ran else "no points",
        },
        {
            "quantity": "prompt positions",
            "paper": " and ".join(f"{p:,}" for p in paper_positions) or "not stated",
            "ours": _our_positions(ok, paper_positions),
        },
        {"quantity": "memory ceiling", "paper": setup.get("ceiling", "not stated"), "ours": ceiling.get("label", "")},
        {
            "quantity": "gradient",
            "paper": setup.get("gradient", "not stated"),
            "ours": "conditional-response (replay mode); hold_all and naive are baselines",
        },
    ]


def _our_parallelism(ran: list[dict]) -> str:
    cp_sizes = [v for v in _distinct(ran, "cp_size") if isinstance(v, int) and v > 1]
    if not cp_sizes:
        return "none (single device)"
    return (
        f"context parallel over {' or '.join(str(v) for v in cp_sizes)} ranks on the points that set "
        "cp_size; the others on one device"
    )


def _our_quantization(ran: list[dict]) -> str:
    """NF4 (on every point, some, or none), LoRA's ranks, the dtypes."""
    nf4 = {bool(r.get("nf4")) for r in ran if r.get("nf4") is not None}
    lora = _distinct(ran, "lora_r")
    return "; ".join(
        [
            {frozenset({True}): "NF4", frozenset({True, False}): "NF4 on some points"}.get(frozenset(nf4), "no NF4"),
            f"LoRA r={', '.join(str(v) for v in lora)}" if lora else "no LoRA (all parameters trainable)",
            "dtype " + ", ".join(_distinct(ran, "dtype")),
        ]
    )


def _our_positions(ok: list[dict], paper_positions: list[int]) -> str:
    """The prompt lengths our ok points ran, and how far the paper's longest is beyond ours."""
    lengths = [v for v in _distinct(ok, "prompt_length") if isinstance(v, int)]
    if not lengths:
        return "no ok point"
    ratio = (
        f"; the paper's {max(paper_positions):,} is {max(paper_positions) / max(lengths):,.0f}x ours"
        if paper_positions
        else ""
    )
    return _span(lengths, lambda v: f"{v:,}") + ratio
