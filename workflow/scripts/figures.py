"""Snakemake script: tables -> figures + manifest (logic in longstraw.report.figures)."""

import contextlib

from longstraw.report.figures import make_figures

with open(snakemake.log[0], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
    make_figures(snakemake.params.tables, snakemake.params.out)
