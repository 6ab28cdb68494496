"""The report: result files -> tables (CSV) -> figures (PNG) -> one HTML page per profile.

    python -m longstraw.report.aggregate --results results/cpu --out reports/cpu/tables
    python -m longstraw.report.render --profile cpu --results results/cpu --out reports/cpu

Modules, one job each: `aggregate` (load points, one table per experiment), `plots` (figures),
`paper` (the paper's figures beside ours), `validation` (the four levels), `render` (the page),
`formatting` (units), `ceiling` (which memory ceiling a plot draws), atomic writes come from `longstraw.results`.
"""

_EXPORTS = {"load_points": "aggregate", "tables": "aggregate", "write_tables": "aggregate",
            "make_plots": "plots", "render_report": "render"}
__all__ = list(_EXPORTS)


def __getattr__(name):
    # Lazy, so `python -m longstraw.report.render` does not import render twice (runpy warns).
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(f"longstraw.report.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'longstraw.report' has no attribute {name!r}")
