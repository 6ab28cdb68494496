"""Snakemake script: tables + figures -> the HTML report (logic in longstraw.report.render)."""

import contextlib

from longstraw.report.render import render

with open(snakemake.log[0], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
    render(snakemake.params.tables, snakemake.params.figures, snakemake.params.out, snakemake.params.recorded)
