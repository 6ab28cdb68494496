# Plots and the HTML report (Jinja2); recorded GPU results are shown in their own section.
# The recorded H200 results also get a report of their own (just rendering, no measurement), which
# the profile's report links to from that section, so it is rendered first.
RECORDED_H200 = "experiments/recorded/h200"


rule report_recorded:
    input:
        recorded=sorted(str(p) for p in Path(RECORDED_H200).rglob("*.json")),
        templates=sorted(str(p) for p in Path("reports/templates").glob("*.html")),
    output:
        "reports/recorded-h200/index.html",
    log:
        "logs/recorded-h200/report.log",
    params:
        profile="h200",
        results=RECORDED_H200,
        out=lambda wildcards, output: str(Path(output[0]).parent),
    conda:
        CONDA_ENV
    script:
        "../scripts/report.py"


rule report:
    input:
        tables=rules.tables.output,
        points=all_point_results(),
        recorded=RECORDED,
        recorded_report=rules.report_recorded.output,
        templates=sorted(str(p) for p in Path("reports/templates").glob("*.html")),
    output:
        f"reports/{PROFILE}/index.html",
    log:
        f"logs/{PROFILE}/report.log",
    params:
        profile=PROFILE,
        results=lambda wildcards, input: points_dir(input.points),
        out=lambda wildcards, output: str(Path(output[0]).parent),
    conda:
        CONDA_ENV
    script:
        "../scripts/report.py"
