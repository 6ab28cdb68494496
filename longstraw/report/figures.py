"""The figures stage: tables (CSV, `store`) -> one PNG per figure and `manifest.json` listing them
(file, experiment, caption, and the kind that drew it), which the page reads. Which figures an experiment
gets follows from its data, not its name: every kind draws what its rows support (`Kind.figures`), so a
later experiment with step / capture / capacity / sweep / staleness points gets the same figures.

oom and error points are drawn as red / orange markers with a label, never dropped silently.
Memory is `peak_allocated_bytes` on CUDA and the process peak RSS plus autograd graph bytes on
CPU; each figure says which, and where its ceiling comes from (the tables' manifest holds it).
"""

from __future__ import annotations

import json
from pathlib import Path

from longstraw import kinds
from longstraw.plotting.draw import save_png
from longstraw.report import memory_vs_length, peers
from longstraw.report.aggregate import grid_columns, records
from longstraw.report.paper import load_paper, memory_points, reference_marks
from longstraw.report.store import MANIFEST, Tables, read_tables
from longstraw.results import ExperimentData, write_json_atomic


def experiment_data(tables: Tables, name: str) -> ExperimentData:
    """An experiment's point rows and its kinds' own tables (`<name>.<suffix>`), as plain rows."""
    df = tables.frame(name)
    extra = {
        table.split(".", 1)[1]: records(tables.frame(table))
        for table in tables.names
        if table.startswith(f"{name}.") and "." not in table.split(".", 1)[1]
    }
    return ExperimentData(name, records(df) if len(df) else [], grid_columns(df.columns), extra)


def remove_stale_figures(folder: Path, current) -> None:
    """Figures of an earlier run that this one did not draw (a removed experiment) would sit beside
    the page unreferenced; remove them so the folder holds exactly what the manifest lists."""
    keep = {Path(p).resolve() for p in current}
    for png in folder.glob("*.png") if folder.is_dir() else []:
        if png.resolve() not in keep:
            png.unlink()


SUMMARY = "summary"  # the figures drawn across experiments, shown beside the paper's figures


def make_figures(tables_dir, out_dir, marks: dict | None = None) -> dict[str, Path]:
    """Every figure the tables in `tables_dir` support, as `<out_dir>/<experiment>.<figure>.png`
    (figures across experiments as `summary.<figure>.png`), and `<out_dir>/manifest.json`. `marks`:
    {experiment: the paper's figures to draw beside ours} (default: the paper's,
    `paper.reference_marks`). Returns {"<experiment>/<figure>": path}."""
    tables, out_dir = read_tables(tables_dir), Path(out_dir)
    ceiling = tables.manifest["ceiling"]
    paper = load_paper()
    marks = reference_marks(paper) if marks is None else marks
    drawn, entries = {}, []

    def save(experiment: str, figure: str, fig, caption: str, kind: str | None = None) -> None:
        key = f"{experiment}/{figure}"
        drawn[key] = save_png(fig, out_dir / f"{experiment}.{figure}.png")
        entry = {"key": key, "experiment": experiment, **({"kind": kind} if kind else {})}
        entries.append({**entry, "file": drawn[key].name, "caption": caption})

    fig = memory_vs_length.plot_memory_vs_length(memory_vs_length.memory_rows(tables), ceiling, memory_points(paper))
    if fig is not None:
        save(SUMMARY, memory_vs_length.FIGURE, fig, memory_vs_length.CAPTION)
    for figure, fig in peers.figures(tables, ceiling):  # the Peers section's, across experiments
        save(peers.FIGURES, figure, fig, peers.CAPTIONS[figure])
    for name in tables.manifest["experiments"]:
        data = experiment_data(tables, name)
        for kind in kinds.names():
            captions = kinds.part(kind, "captions")
            for figure, fig in kinds.part(kind, "figures")(data, ceiling, marks.get(name, ())):
                save(name, figure, fig, captions.get(figure.split(".", 1)[0], ""), kind)
    remove_stale_figures(out_dir, drawn.values())
    write_json_atomic(out_dir / MANIFEST, {"tables": str(tables_dir), "figures": entries})
    print(json.dumps({"figures": str(out_dir), "drawn": len(entries)}))
    return drawn
