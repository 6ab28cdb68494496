# One job per experiment point. A point that fails is still recorded (status error) and the
# job succeeds, so the report shows it; an interrupted run reruns only missing result files.
# Points run one at a time (threads = all cores) so timings are not shared between jobs.
rule point:
    input:
        experiment=experiment_file,
        schema=SCHEMA,
    output:
        "results/{profile}/points/{experiment}/{point}.json",
    log:
        "logs/{profile}/points/{experiment}/{point}.log",
    params:
        python=PYTHON,
    threads: 1024
    resources:
        gpu=1 if PROFILE != "cpu" else 0,
    conda:
        CONDA_ENV
    shell:
        "OMP_NUM_THREADS={threads} {params.python} -m longstraw point {input.experiment}"
        " --profile {wildcards.profile} --point {wildcards.point} --out {output} > {log} 2>&1"
