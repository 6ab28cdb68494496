# Aggregate every point result of the profile into one CSV table per experiment (pandas).
rule tables:
    input:
        all_point_results(),
    output:
        expand("results/{profile}/tables/{experiment}.csv", profile=PROFILE, experiment=list(PLAN)),
    log:
        f"logs/{PROFILE}/tables.log",
    params:
        results=lambda wildcards, input: points_dir(input),
        tables=lambda wildcards, output: str(Path(output[0]).parent),
    conda:
        CONDA_ENV
    script:
        "../scripts/tables.py"
