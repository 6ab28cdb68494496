"""The page stage: one profile's tables (CSV, `store`) and figures (their manifest) -> `<out>/index.html`,
with the tables copied to `<out>/tables/` and the figures in `<out>/figures/`. Every figure is embedded in the
page (a data URI, linking its PNG), so the file alone shows them; tables and result files are linked by
relative paths (no server needed). It reads no result file: every number on the page comes from a table the
tables stage wrote (`aggregate`).

Sections: summary (what ran, statuses, device, versions, commit, date, the paper's claims beside ours with
the model and length each of ours ran at); on a GPU profile, the targets (`longstraw.report.targets`,
evaluated by the tables stage); the paper's figures beside ours with the scale difference; the four
validation levels, with the validation experiment's points; the peers beside our modes (`peers`, where a
peer ran), with the peers experiment's points; one section per other experiment: the paper's figures for it
beside ours, its points' statuses, the figure of the kind most of its points are (`lead_figure`) and its
failures with their messages, then, one click away, its other figures, the kinds' notes (e.g. a staleness
point's refresh interval in a sentence), a table per kind straight from the aggregated data with every
status, the kinds' own tables (a sweep's steps, a capacity search's comparison steps and probes, a staleness
oracle's steps), the commands that reproduce it and provenance; recorded GPU results (the recorded results'
own tables), shown as recorded and never mixed into the local tables, with a link to their own report where
it was rendered (`reports/recorded-<device>/`, beside this one). What of a long or wide table shows:
`shorten`; a table of more than `shorten.LONG` rows opens on a click. Every file is written atomically.
"""

from __future__ import annotations

import base64
import datetime
import json
import os
import shutil
import struct
from collections import Counter
from pathlib import Path

import jinja2
import pandas as pd

from longstraw import kinds
from longstraw.plotting.ceiling import ceiling_reason
from longstraw.plotting.formatting import LOG_SPAN, column_label, exact_value, format_value, is_missing, is_nested
from longstraw.report import peers, shorten
from longstraw.report.aggregate import experiment_order, grid_columns, records, status_counts
from longstraw.report.figures import SUMMARY
from longstraw.report.levels import all_paths, levels_table, number_rules, paper_paths
from longstraw.report.paper import claim_rows, compare_figures, load_paper, scale_rows
from longstraw.report.store import MANIFEST, Tables, read_tables
from longstraw.results import STATUSES, as_dict, atomic_path, number, write_text_atomic

VERSION_KEYS = ("torch", "transformers", "peft", "bitsandbytes", "fla-core")
RECORDED_COLUMNS = [
    "file",
    "point",
    "kind",
    "status",
    "device",
    "date",
    "commit",
    "model",
    "prompt_length",
    "mode",
    "G",
    "peak_memory_bytes",
    "seconds_per_member",
    "wall_seconds",
    "error",
]
# A kind this package does not know: its numeric metrics, a dozen at most, none of these.
GENERIC_SKIP = {
    "experiment",
    "point",
    "kind",
    "status",
    "error",
    "commit",
    "date",
    "device",
    "family",
    "dtype",
    "torch_version",
    "transformers_version",
    "device_memory_bytes",
    "report_error",
    "model",
    "model_type",
    "prompt_length",
    "lora_r",
    "nf4",
    "peak_rss_bytes",
    "wall_seconds",
}
# A grid key and the derived column that repeats it: show the grid key only.
GRID_ALIASES = {
    "prompt.length": "prompt_length",
    "grpo.num_generations": "G",
    "responses.length": "response_length",
    "model.preset": "model",
    "optimizer.lr": "lr",
    "cp_size": "cp_size",
}
MET_TEXT = {True: "yes", False: "missed", None: "not measured"}
MESSAGE_COLUMNS = ("error", "report_error")
# A figure may be drawn down to this fraction of its size so that two sit side by side; never larger than drawn.
FIGURE_MIN_SCALE = 0.85
BRIEF = 240  # characters of a claim's cell the summary shows at once; the rest opens below it
SHORT_MESSAGE = 60  # characters of a message a row shows (a line of its cell); the whole opens below it


# ------------------------------------------------------------------------------------- table views


def _present(rows: list[dict], column: str) -> bool:
    return any(not is_missing(r.get(column)) for r in rows)


def short_message(text: str) -> tuple[str, str | None]:
    """(what a row shows, the whole message or None): a failed point's row stays one line, its first
    line cut to SHORT_MESSAGE characters; the whole message opens below it (<details>)."""
    first = text.strip().splitlines()[0] if text.strip() else text
    short = first if len(first) <= SHORT_MESSAGE else first[: SHORT_MESSAGE - 1].rstrip() + "…"
    return short, (text if short != text else None)


def brief(text: str) -> tuple[str, str]:
    """(what a claim's cell shows, the rest, "" for none): the whole up to BRIEF characters, else its first
    sentence (or its first BRIEF characters, at a word)."""
    if len(text) <= BRIEF:
        return text, ""
    end = text.find(". ") + 1
    end = end if 0 < end <= BRIEF else text.rfind(" ", 0, BRIEF)
    return (text[:end], text[end:].strip()) if end > 0 else (text, "")


def table_view(
    rows: list[dict], columns: list[str], links: dict | None = None, every: list[dict] | None = None
) -> dict:
    """What a template needs to draw a table: labels, and per cell the text, the exact number
    (`data-value`, so a reader or a test can check it against the result JSON), a CSS class, for
    the point's cell a link to its result file (`links`: {point: path relative to the page}), and
    for a long message the whole of it (`full`). `every`: the whole table where `rows` are the part of it
    the page shows (`shorten.run_ends`). A column equal to an earlier one in every row is left out and
    named (`repeats`); a wide table is drawn in `parts` (`shorten.column_parts`). `csv` / `all_columns`: set by
    `with_csv`."""
    every = rows if every is None else every
    columns = [
        c for i, c in enumerate(columns) if c not in columns[:i] and (c in ("point", "status") or _present(every, c))
    ]
    repeats = shorten.repeated_columns(every, columns)
    columns = [c for c in columns if c not in repeats]
    view_rows = []
    for row in rows:
        cells = []
        for column in columns:
            value = row.get(column)
            numeric = exact_value(value)
            css = (
                "num"
                if numeric is not None
                else (
                    "status status-" + str(value)
                    if column == "status"
                    else "message"
                    if column in MESSAGE_COLUMNS
                    else ""
                )
            )
            href = (links or {}).get(str(row.get("point"))) if column == "point" else None
            text, full = format_value(column, value), None
            if column in MESSAGE_COLUMNS and not is_missing(value):
                text, full = short_message(text)
            cells.append({"key": column, "text": text, "full": full, "value": numeric, "css": css, "href": href})
        view_rows.append({"point": str(row.get("point")), "status": str(row.get("status")), "cells": cells})
    return {
        "columns": [{"key": c, "label": column_label(c)} for c in columns],
        "rows": view_rows,
        "all_rows": len(every),
        "chosen": "",
        "repeats": [{"column": column_label(c), "twin": column_label(t)} for c, t in repeats.items()],
        "parts": shorten.column_parts(columns),
        "csv": "",
        "all_columns": 0,
    }


def with_csv(view: dict, rows: list[dict], csv: str) -> dict:
    """The table's view with its full CSV beside it: the page links it, and says how many of the
    columns these rows have a value in the table shows."""
    every = [c for c in dict.fromkeys(k for r in rows for k in r) if _present(rows, c)]
    return {**view, "csv": csv, "all_columns": len(every)}


def shown_columns(kind: str, rows: list[dict], grid: list[str]) -> list[str]:
    """The columns a kind's table shows (`Kind.shown`), the grid first: its scalar settings
    (a nested one, e.g. a sweep's G lists, the point's name says; the CSV has it)."""
    grid = [k for k in grid if not any(is_nested(r.get(k)) for r in rows)]
    chosen = kinds.part(kind, "shown")
    if chosen is None:  # a kind added later: its numeric metrics, a dozen at most
        keys = dict.fromkeys(k for r in rows for k in r)
        numeric = [
            c
            for c in keys
            if c not in GENERIC_SKIP and c not in grid and any(exact_value(r.get(c)) is not None for r in rows)
        ]
        chosen = ["model", "prompt_length"] + numeric[:12] + ["peak_rss_bytes", "wall_seconds"]
    repeated = {GRID_ALIASES[k] for k in grid if k in GRID_ALIASES}
    return ["point", *grid, "status", *(c for c in chosen if c not in repeated), "error", "report_error"]


# ---------------------------------------------------------------------------------- section pieces


def _distinct(values) -> list:
    return sorted({v for v in values if not is_missing(v)}, key=str)


def _tally(values, missing: str) -> str:
    """One value, or each distinct value with how many points have it (`missing` for none)."""
    counts = Counter(str(v) if not is_missing(v) else missing for v in values)
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{value} ({n} point{'s' if n != 1 else ''})" for value, n in counts.most_common())


def _commits(files: list[dict]) -> str:
    """The points' commits: listed when a few, else their count and the first and last by date."""
    by_date = sorted(files, key=lambda f: str(f.get("date") or ""))
    commits = list(dict.fromkeys(str(f["commit"]) for f in by_date if not is_missing(f.get("commit"))))
    if len(commits) <= 3:
        return _tally([f.get("commit") for f in files], "not recorded")
    return (
        f"{len(commits)} commits, from {commits[0]} to {commits[-1]} by date; each experiment's section lists its own"
    )


def provenance_facts(files: list[dict]) -> list[dict]:
    """Device, commit, date, versions of the points (`files` rows: the tables' `files.csv`); where
    points differ, how many have each value."""
    dates = _distinct(f.get("date") for f in files)
    facts = [
        {"key": "device", "value": _tally([f.get("device") for f in files], "not recorded")},
        {"key": "commit", "value": _commits(files)},
        {
            "key": "date",
            "value": (dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}") if dates else "not recorded",
        },
        {"key": "python", "value": _tally([f.get("python") for f in files], "not recorded")},
    ]
    for key in VERSION_KEYS:
        facts.append({"key": key, "value": _tally([f.get(f"version.{key}") for f in files], "not installed")})
    totals = _distinct(f.get("cuda_total_memory_bytes") for f in files)
    if totals:
        facts.append({"key": "CUDA total memory", "value": ", ".join(format_value("x_bytes", t) for t in totals)})
    return facts


def _counts_text(counts: dict) -> str:
    return ", ".join(f"{counts.get(s, 0)} {s}" for s in STATUSES)


def commands(profile: str, experiment: str, files: list[dict]) -> dict:
    """Commands that run this experiment's points again from a clone: the pipeline's, and each
    point's own (written as the plan writes it, not as the point's machine ran it: a recorded GPU
    point's output folder exists only there). The profile is the one the points ran under."""
    from longstraw.harness.plan import point_command

    ran = _distinct(f.get("profile") for f in files)
    profile = ran[0] if len(ran) == 1 else profile
    targets = [f"results/{profile}/points/{experiment}/{f.get('point')}.json" for f in files]
    return {
        "pipeline": f"snakemake --cores all --config profile={profile}",
        "experiment": (f"snakemake --cores all --config profile={profile} --force " + " ".join(targets))
        if targets
        else "",
        "points": [
            {
                "point": str(f.get("point")),
                "command": point_command(
                    f"experiments/{experiment}.yaml",
                    f.get("profile") or profile,
                    str(f.get("point")),
                    target,
                    int(number(as_dict(f.get("config")).get("cp_size")) or 1),
                ),
            }
            for f, target in zip(files, targets)
        ],
    }


def kind_tables(rows: list[dict], grid: list[str], links: dict | None = None, csv: str = "") -> list[dict]:
    """One table per kind among an experiment's point rows, in the order the kinds first appear;
    `csv`: the experiment's table with every column (all kinds' rows)."""
    out = []
    for kind in dict.fromkeys(str(r.get("kind")) for r in rows):
        mine = [r for r in rows if str(r.get("kind")) == kind]
        out.append(
            {"kind": kind, "view": with_csv(table_view(mine, shown_columns(kind, mine, grid), links), mine, csv)}
        )
    return out


def extra_specs(rows: list[dict]) -> list[tuple]:
    """(suffix, `ExtraTable`) of the kinds' own tables, for the kinds these point rows are of: two
    kinds may use one suffix (a sweep's and a learning run's `steps`), and an experiment's table of
    that name is the one its own kind wrote."""
    present = {str(r.get("kind")) for r in rows}
    return [
        (suffix, spec)
        for kind in kinds.names()
        if kind in present
        for suffix, spec in kinds.part(kind, "extra_tables").items()
    ]


def extra_tables(tables: Tables, name: str, rows: list[dict], links: dict | None = None) -> list[dict]:
    """The kinds' own tables of an experiment (`rows`: its point rows), as the page shows them
    (`Kind.extra_tables`), each beside its CSV."""
    out = []
    for suffix, spec in extra_specs(rows):
        df = tables.frame(f"{name}.{suffix}")
        if df is not None and len(df):
            mine = records(df)
            note = spec.note(mine) if callable(spec.note) else spec.note
            shown, chosen = shorten.run_ends(mine)
            view = with_csv(table_view(shown, spec.columns, links, every=mine), mine, f"tables/{name}.{suffix}.csv")
            out.append(
                {
                    "title": spec.title,
                    "id": f"table-{name}-{spec.key or suffix}",
                    "note": note,
                    "view": {**view, "chosen": chosen},
                }
            )
    return out


def section_notes(rows: list[dict], grid: list[str] = ()) -> list[str]:
    """What a row cannot say in one cell, row by row (`Kind.notes`), and where real weights came from."""
    weights = [w for w in dict.fromkeys(row.get("weights") for row in rows) if w]
    return [note for row in rows for note in kinds.part(row.get("kind"), "notes")(row, list(grid))] + weights


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def lead_figure(figures: list[dict], files: list[dict]) -> dict | None:
    """The figure a section opens with: the first one the kind of most of its points draws (the kinds in their
    order on a tie), else its first."""
    counts = Counter(str(f.get("kind")) for f in files)
    for kind in sorted(kinds.names(), key=lambda k: -counts[k]):
        mine = [f for f in figures if f.get("kind") == kind]
        if mine:
            return mine[0]
    return figures[0] if figures else None


def more_line(figures: int, tables: int, notes: int) -> str:
    """The line that opens the rest of a section: what it holds."""
    held = [_count(n, what) for n, what in ((figures, "more figure"), (tables, "table"), (notes, "note")) if n]
    return "More: " + ", ".join(held + ["the commands that reproduce each point, provenance"])


def experiment_section(
    name: str,
    tables: Tables,
    files: list[dict],
    figures: list[dict],
    profile: str,
    described: dict,
    paper_rows: list[dict],
    links: dict | None = None,
) -> dict:
    """`links`: {point: its result file, relative to the page}."""
    df = tables.frame(name)
    rows = records(df) if df is not None else []
    grid = grid_columns(df.columns) if df is not None else []
    titles = _distinct(f.get("experiment_title") for f in files)
    counts = status_counts(files)
    drawn = [f for f in figures if f["experiment"] == name]
    lead = lead_figure(drawn, files)
    point_tables = kind_tables(rows, grid, links, f"tables/{name}.csv")
    own_tables = extra_tables(tables, name, rows, links)
    notes = section_notes(rows, grid)
    return {
        "name": name,
        "anchor": f"experiment-{name}",
        "title": titles[0] if titles else described.get("title", name),
        "what": described.get("what", ""),
        "counts": counts,
        "counts_text": _counts_text(counts),
        "figures": [f for f in drawn if f is lead],
        "more_figures": [f for f in drawn if f is not lead],
        "tables": point_tables,
        "extra_tables": own_tables,
        "notes": notes,
        "more": more_line(len(drawn) - (lead is not None), len(point_tables) + len(own_tables), len(notes)),
        "paper": [r for r in paper_rows if r["experiment"] == name],
        "failures": failures(files),
        "unrecorded": [
            r["point"]
            for r in (records(tables.frame("unrecorded")) if "unrecorded" in tables.names else [])
            if r["experiment"] == name
        ],
        "commands": commands(profile, name, files),
        "provenance": provenance_facts(files) if files else [],
        "empty": not files,
    }


def failures(files: list[dict]) -> list[dict]:
    """The points that did not finish ok: their status, error and the peak they reached."""
    return [
        {
            "point": str(f.get("point")),
            "status": f.get("status"),
            "error": f.get("error") or "no message recorded",
            "peak": format_value("peak_allocated_bytes", f.get("peak_allocated_bytes"))
            if f.get("peak_allocated_bytes") is not None
            else "",
        }
        for f in files
        if f.get("status") != "ok"
    ]


def recorded_report_link(folder: Path, out_dir: Path) -> str:
    """The recorded results' own report (the pipeline renders it as `reports/recorded-<folder>/`,
    beside this report's folder), relative to this page; empty where it was not rendered."""
    page = out_dir.parent / f"recorded-{folder.name}" / "index.html"
    return os.path.relpath(page, out_dir) if page.is_file() and page.parent != out_dir else ""


def recorded_section(recorded: Tables | None, out_dir, results_dir) -> dict:
    """Recorded GPU results, as recorded (their own tables): one row per result file, never merged
    into the local tables."""
    if recorded is None or not recorded.manifest.get("results_found", True):
        where = recorded.manifest["results_dir"] if recorded is not None else None
        return {
            "dir": str(where or ""),
            "view": None,
            "count": 0,
            "notes": [],
            "link": "",
            "same": False,
            "missing": f"no recorded results folder at {where}" if where else "no recorded results given",
        }
    where = recorded.manifest["results_dir"]
    folder = Path(where)
    files = records(recorded.frame("files"))
    by_file = {r["result_file"]: r for r in records(recorded.frame("points")) if r.get("result_file")}
    rows = [{**by_file.get(f["result_file"], {}), "file": f["result_file"]} for f in files]
    notes = sorted({f["commit_source"] for f in files if f.get("commit_source")})
    same = Path(results_dir).resolve() == folder.resolve()  # the recorded results' own report
    return {
        "dir": where,
        "view": table_view(rows, RECORDED_COLUMNS) if rows else None,
        "count": len(rows),
        "counts_text": _counts_text(status_counts(files)),
        "notes": notes,
        "missing": "",
        "link": recorded_report_link(folder, Path(out_dir)),
        "same": same,
        "command": f"longstraw report --profile {folder.name} --results {where} "
        f"--out reports/recorded-{folder.name} --recorded {where}",
    }


def targets_view(tables: Tables) -> dict | None:
    """The GPU targets the tables stage evaluated (None: no targets on this profile)."""
    state = tables.manifest.get("targets")
    if state is None:
        return None
    rows = records(tables.frame("targets")) if tables.frame("targets") is not None else []
    return {
        "error": state.get("error", ""),
        "rows": [{**r, "met": MET_TEXT.get(r.get("met"), str(r.get("met")))} for r in rows],
    }


# -------------------------------------------------------------------------------------------- page


def environment() -> jinja2.Environment:
    """The page's templates, shipped with the package (`longstraw/report/templates/`)."""
    env = jinja2.Environment(
        loader=jinja2.PackageLoader("longstraw.report", "templates"),
        autoescape=jinja2.select_autoescape(["html"]),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["brief"] = brief
    return env


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) in pixels, from a PNG's header chunk."""
    return struct.unpack(">II", data[16:24])


def figure_entries(figures_dir, out_dir) -> list[dict]:
    """The figures the figures stage drew (its manifest), each embedded in the page as a data URI (the page
    copied alone still shows it), with its file's path relative to the page (the image links it) and its size
    in pixels (the page lays it out at that size, never larger)."""
    figures_dir = Path(figures_dir)
    manifest = json.loads((figures_dir / MANIFEST).read_text())
    out = []
    for f in manifest["figures"]:
        data = (figures_dir / f["file"]).read_bytes()
        width, height = png_size(data)
        out.append(
            {
                "src": "data:image/png;base64," + base64.b64encode(data).decode("ascii"),
                "file": Path(os.path.relpath(figures_dir / f["file"], out_dir)).as_posix(),
                "width": width,
                "height": height,
                "basis": int(width * FIGURE_MIN_SCALE),
                "caption": f["caption"],
                "alt": f["key"],
                "kind": f.get("kind"),
                "experiment": f["experiment"],
            }
        )
    return out


def result_links(files: list[dict], results_dir, out_dir) -> dict[str, str]:
    """{point: its result JSON, relative to the page} for an experiment's files."""
    return {
        str(f.get("point")): Path(os.path.relpath(Path(results_dir) / f["result_file"], out_dir)).as_posix()
        for f in files
        if not is_missing(f.get("result_file"))
    }


def experiment_rows(tables: Tables) -> dict[str, list[dict]]:
    """{experiment: its rows}, with the kinds' rows that read like point rows (a sweep's steps, the
    staleness oracle's steps) beside the point rows: the paper's figures and the validation levels read
    them there."""
    out = {}
    for name in tables.manifest["experiments"]:
        df = tables.frame(name)
        for suffix in [suffix for suffix, spec in extra_specs(records(df)) if spec.beside_points]:
            extra = tables.frame(f"{name}.{suffix}")
            df = pd.concat([df, extra], ignore_index=True) if extra is not None else df
        out[name] = records(df)
    return out


def recorded_claims(paper: dict, recorded: Tables | None, results_dir) -> list[str] | None:
    """Each paper claim's value in the recorded GPU results, in claim order, for the summary's column
    beside this run's (None on the recorded results' own page, or without recorded results)."""
    if recorded is None or Path(results_dir).resolve() == Path(recorded.manifest["results_dir"]).resolve():
        return None
    compared = compare_figures(paper, experiment_rows(recorded), recorded.manifest["ceiling"])
    return [row["ours"] for row in claim_rows(paper, compared)]


def build_context(tables: Tables, figures: list[dict], out_dir, recorded: Tables | None = None) -> dict:
    manifest = tables.manifest
    profile, results_dir, ceiling = manifest["profile"], manifest["results_dir"], manifest["ceiling"]
    files = records(tables.frame("files"))
    paper = load_paper()
    frames = {name: tables.frame(name) for name in manifest["experiments"]}
    rows_by_experiment = experiment_rows(tables)
    figures_beside = compare_figures(paper, rows_by_experiment, ceiling)
    by_experiment: dict[str, list[dict]] = {}
    for f in files:
        by_experiment.setdefault(str(f.get("experiment")), []).append(f)
    sections = experiment_sections(tables, figures, paper, frames, by_experiment, figures_beside, out_dir)
    peer_view = peers_section(tables, figures)
    # the validation and peers experiments' points go inside the page's Validation and Peers sections: one
    # section per subject, which the summary's links reach
    for section in sections:
        section["merged"] = section["name"] == "validation" or (section["name"] == "peers" and peer_view is not None)
        if section["merged"]:
            section["anchor"] = section["name"]
    return {
        "profile": profile,
        "results_dir": results_dir,
        "generated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "log_span": LOG_SPAN,
        "long_table": shorten.LONG,
        "summary": summary_view(files, sections, paper, figures_beside, ceiling, recorded, results_dir),
        "targets": targets_view(tables),
        "paper": {
            "missing": paper.get("missing", ""),
            "scale": scale_rows(paper, [r for df in frames.values() for r in records(df)], ceiling),
            "figures": figures_beside,
            "summary_figures": [f for f in figures if f["experiment"] == SUMMARY],
        },
        "validation": validation_view(tables, paper, by_experiment, rows_by_experiment),
        "experiments": sections,
        "peers": peer_view,
        "recorded": recorded_section(recorded, out_dir, results_dir),
    }


def experiment_sections(
    tables: Tables, figures: list[dict], paper: dict, frames: dict, by_experiment: dict, figures_beside, out_dir
) -> list[dict]:
    """One section per experiment, the paper's first (an experiment the paper names but no result holds too)."""
    manifest = tables.manifest
    paper_entries = {e.get("name"): e for e in paper.get("experiments") or [] if isinstance(e, dict)}
    experiment_files = {
        r["experiment"]: {"title": r.get("title"), "what": r.get("description")}
        for r in records(tables.frame("experiments"))
    }
    names = experiment_order(set(frames) | set(paper_entries))
    described = {
        name: {**paper_entries.get(name, {}), **{k: v for k, v in experiment_files.get(name, {}).items() if v}}
        for name in names
    }
    return [
        experiment_section(
            name,
            tables,
            by_experiment.get(name, []),
            figures,
            manifest["profile"],
            described[name],
            figures_beside,
            result_links(by_experiment.get(name, []), manifest["results_dir"], out_dir),
        )
        for name in names
    ]


def summary_view(
    files: list[dict], sections: list[dict], paper: dict, figures_beside, ceiling: dict, recorded, results_dir
) -> dict:
    """The page's summary: the points' statuses and kinds, each experiment's counts, provenance, claims."""
    counts = status_counts(files)
    return {
        "total": len(files),
        "counts": counts,
        "counts_text": _counts_text(counts),
        "kinds": ", ".join(f"{n} {k}" for k, n in sorted(Counter(str(f.get("kind")) for f in files).items())),
        "experiments": [
            {
                "name": s["name"],
                "anchor": s["anchor"],
                "title": s["title"],
                "total": sum(s["counts"].values()),
                **s["counts"],
            }
            for s in sections
        ],
        "provenance": provenance_facts(files),
        "ceiling": f"{ceiling['label']}: {ceiling_reason(ceiling)}",
        "cpu": ceiling.get("source") != "cuda_total_memory",
        "claims": claim_rows(paper, figures_beside),
        "recorded_claims": recorded_claims(paper, recorded, results_dir),
    }


def validation_view(tables: Tables, paper: dict, by_experiment: dict, rows_by_experiment) -> dict:
    """The validation levels: every path (the validation points' and the other points' V1), the levels table."""
    suffix = kinds.contributed("paths_table")  # the table of the validation levels' paths
    path_rows = [  # their experiments in file order (as their points were read)
        row
        for name in by_experiment
        if tables.frame(f"{name}.{suffix}") is not None
        for row in records(tables.frame(f"{name}.{suffix}"))
    ]
    paths = all_paths(rows_by_experiment, path_rows)
    return {
        "levels": levels_table(paths, paper.get("standing") or {}),
        "paths": paths,
        "rules": number_rules(paths),
        "paper_paths": paper_paths(paper),
    }


def peers_section(tables: Tables, figures: list[dict]) -> dict | None:
    """The Peers section (`longstraw.report.peers`): sentences, figures, the step and capacity rows."""
    found = peers.view(tables)
    if found is None:
        return None
    return {
        **found,
        "figures": [f for f in figures if f["experiment"] == peers.FIGURES],
        "step_view": table_view(found["steps"], peers.STEP_COLUMNS),
        "capacity_view": table_view(found["capacity"], peers.CAPACITY_COLUMNS) if found["capacity"] else None,
    }


def copy_tables(tables: Tables, folder: Path) -> None:
    """The tables beside the page (`tables/<name>.csv`, the page links them), unless already there."""
    if folder.resolve() == tables.folder.resolve():
        return
    for path in tables.files() + [tables.folder / MANIFEST]:
        with atomic_path(folder / path.name) as tmp:
            shutil.copyfile(path, tmp)


def render(tables_dir, figures_dir, out_dir, recorded_tables=None) -> Path:
    """Write `out_dir/index.html` from the tables in `tables_dir` (copied to `out_dir/tables/`), the
    figures listed in `figures_dir`'s manifest and, for the recorded section, the tables of the
    recorded results (`recorded_tables`, a folder the tables stage wrote; None: none given).
    Returns the page's path."""
    out_dir = Path(out_dir)
    tables = read_tables(tables_dir)
    recorded = read_tables(recorded_tables) if recorded_tables is not None else None
    context = build_context(tables, figure_entries(figures_dir, out_dir), out_dir, recorded)
    copy_tables(tables, out_dir / "tables")
    html = environment().get_template("report.html").render(**context)
    return write_text_atomic(out_dir / "index.html", html)
