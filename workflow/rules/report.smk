# Plots and the HTML report (Jinja2); recorded GPU results are shown in their own section.
rule report:
    input:
        tables=rules.tables.output,
        points=all_point_results(),
        recorded=RECORDED,
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
