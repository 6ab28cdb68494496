"""Snakemake script: plots + HTML report (logic in longstraw.report.render)."""
import contextlib

from longstraw.report.render import render_report

with open(snakemake.log[0], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
    render_report(snakemake.params.profile, snakemake.params.results, snakemake.params.out)
