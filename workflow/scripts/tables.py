"""Snakemake script: result files -> CSV tables + manifest (logic in longstraw.report.aggregate)."""

import contextlib

from longstraw.report.aggregate import write_all

with open(snakemake.log[0], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
    write_all(snakemake.params.results, snakemake.params.out, snakemake.params.profile, snakemake.params.experiments)
