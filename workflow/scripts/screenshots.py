"""Snakemake script: the rendered reports -> the README's screenshots (logic in longstraw.report.screenshots)."""

import contextlib

from longstraw.report.screenshots import take

with open(snakemake.log[0], "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
    take(snakemake.params.pages, snakemake.params.out)
