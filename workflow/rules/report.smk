# Figures (PNG, from the tables alone) and the HTML report (from the tables and the figures'
# manifest, never from result files), for the profile's results and for the recorded ones
# (`report`: `cpu` or `recorded-h200`). The profile's report lists the recorded results in a
# section of its own and links their report, so that one is rendered first.
rule figures:
    input:
        tables="results/{report}/tables/manifest.json",
        paper=PAPER,
    output:
        manifest="reports/{report}/figures/manifest.json",
    log:
        "logs/{report}/figures.log",
    params:
        tables=lambda wildcards, input: folder(input.tables),
        out=lambda wildcards, output: folder(output.manifest),
    conda:
        CONDA_ENV
    script:
        "../scripts/figures.py"


rule report:
    input:
        tables="results/{report}/tables/manifest.json",
        figures="reports/{report}/figures/manifest.json",
        recorded=f"results/recorded-{RECORDED}/tables/manifest.json",
        linked=linked_report,
        templates=TEMPLATES,
        paper=PAPER,
    output:
        "reports/{report}/index.html",
    log:
        "logs/{report}/report.log",
    params:
        tables=lambda wildcards, input: folder(input.tables),
        figures=lambda wildcards, input: folder(input.figures),
        recorded=lambda wildcards, input: folder(input.recorded),
        out=lambda wildcards, output: folder(output),
    conda:
        CONDA_ENV
    script:
        "../scripts/report.py"


# The README's screenshots of both reports (docs/report*.png, longstraw.report.screenshots), in headless
# Chromium. Not part of the default target, so that a machine without Chromium still runs the pipeline:
# `snakemake screenshots` takes them.
rule screenshots:
    input:
        profile=f"reports/{PROFILE}/index.html",
        recorded=f"reports/recorded-{RECORDED}/index.html",
    output:
        expand("docs/report{name}{shot}.png", name=["", f"-{RECORDED}"], shot=["", "-memory"]),
    log:
        "logs/screenshots.log",
    params:
        pages=lambda wildcards, input: {"report": input.profile, f"report-{RECORDED}": input.recorded},
        out=lambda wildcards, output: folder(output[0]),
    conda:
        CONDA_ENV
    script:
        "../scripts/screenshots.py"
