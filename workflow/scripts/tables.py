"""Snakemake script: point results -> one CSV per experiment (logic in longstraw.report.aggregate)."""
import contextlib

from longstraw.report.aggregate import main

with open(snakemake.log[0], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
    main(snakemake.params.results, snakemake.params.tables)
