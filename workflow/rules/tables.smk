# Tables: result files (JSON) -> one CSV per table (each experiment's points, the kinds' own
# tables, every result file's provenance, the experiment files' titles, the GPU targets) and a
# manifest listing them; the only step that reads result files (longstraw.report.aggregate).
rule tables:
    input:
        points=all_point_results(),
        experiments=EXPERIMENT_FILES,
    output:
        manifest="results/{profile}/tables/manifest.json",
        experiments=expand("results/{{profile}}/tables/{experiment}.csv", experiment=list(PLAN)),
    log:
        "logs/{profile}/tables.log",
    params:
        results=lambda wildcards, input: points_dir(input.points),
        profile=lambda wildcards: wildcards.profile,
        experiments=lambda wildcards, input: folder(input.experiments),
        out=lambda wildcards, output: folder(output.manifest),
    conda:
        CONDA_ENV
    script:
        "../scripts/tables.py"


# The recorded GPU results (experiments/recorded/<device>/) go through the same steps: their tables
# here, then the `figures` and `report` rules give them a report of their own.
rule tables_recorded:
    input:
        points=recorded_results,
        experiments=EXPERIMENT_FILES,
    output:
        manifest="results/recorded-{device}/tables/manifest.json",
    log:
        "logs/recorded-{device}/tables.log",
    params:
        results=recorded_dir,
        profile=lambda wildcards: wildcards.device,
        experiments=lambda wildcards, input: folder(input.experiments),
        out=lambda wildcards, output: folder(output.manifest),
    conda:
        CONDA_ENV
    script:
        "../scripts/tables.py"
