"""The report's three stages in one call, for results outside the pipeline (`longstraw report`):
result files -> `<out>/tables/` (`aggregate`) -> `<out>/figures/` (`figures`) -> `<out>/index.html`
(`render`), each stage reading the files the one before wrote.

    build_report("results/cpu", "reports/cpu", profile="cpu", recorded_dir="experiments/recorded/h200")
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from longstraw.report.aggregate import write_all
from longstraw.report.figures import make_figures
from longstraw.report.render import render


def build_report(results_dir, out_dir, profile: str = "cpu", recorded_dir=None, experiments_dir="experiments") -> Path:
    """Tables, figures and the page of the results in `results_dir`; `recorded_dir`: recorded GPU
    results listed in their own section (None: none); `experiments_dir`: the experiment files whose
    titles and descriptions the sections show, where it exists. Returns the page's path."""
    out_dir = Path(out_dir)
    tables, figures = out_dir / "tables", out_dir / "figures"
    write_all(results_dir, tables, profile, experiments_dir)
    make_figures(tables, figures)
    if recorded_dir is None:
        return render(tables, figures, out_dir)
    if Path(recorded_dir).resolve() == Path(results_dir).resolve():
        return render(tables, figures, out_dir, recorded_tables=tables)
    with tempfile.TemporaryDirectory(prefix="longstraw-recorded-") as recorded_tables:
        write_all(recorded_dir, recorded_tables, Path(recorded_dir).name, experiments_dir, targets=False)
        return render(tables, figures, out_dir, recorded_tables=recorded_tables)
