"""The report, in three stages, each reading only the files the one before wrote:

    result files (JSON) -> tables (CSV + manifest) -> figures (PNG + manifest) -> page (HTML)

- `aggregate`: the tables stage, the only one that reads result files (`write_all`); `store`: how
  tables are written and read back exactly (CSV, with each column's type in the manifest).
- `figures`: the figures stage (`make_figures`); each kind draws its own (`longstraw.kinds`), from
  primitives in `longstraw.plotting`.
- `render`: the page stage (`render`), Jinja2 templates shipped in `templates/`; `paper` (the
  paper's figures beside ours, `paper.yaml` shipped beside it), `levels` (the validation levels
  table), `targets` (the GPU targets, evaluated by the tables stage).
- `shorten`: what of a long or wide table the page shows (the CSV keeps every row and column).
- `browser`: the page as headless Chromium lays it out (its height, its tables' boxes) and its screenshots;
  `screenshots`: the README's pictures of the reports (`snakemake screenshots`).
- `build`: the three in one call (`build_report`), what `longstraw report` runs; the Snakemake
  workflow runs them as rules of their own (`workflow/rules/report.smk`).
"""
