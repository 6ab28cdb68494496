# Helpers shared by the rules. The plan (experiment files -> points) comes from the package,
# which validates every experiment file against its schema (shipped with the package) now,
# at parse time, so a malformed file fails before anything runs.
import sys
from importlib import resources
from pathlib import Path

from longstraw.harness.plan import launcher, plan

PROFILE = config.get("profile", "cpu")
PYTHON = sys.executable
PLAN = plan("experiments", PROFILE)
SCHEMA = str(resources.files("longstraw.harness") / "experiment.schema.yaml")  # package data
RECORDED = sorted(str(p) for p in Path("experiments/recorded").rglob("*.json"))


wildcard_constraints:
    profile=PROFILE,
    experiment="|".join(PLAN) or "none",


def point_results(experiment):
    return [f"results/{PROFILE}/points/{experiment}/{point}.json" for point in PLAN[experiment]["points"]]


def all_point_results():
    return [path for experiment in PLAN for path in point_results(experiment)]


def experiment_file(wildcards):
    return PLAN[wildcards.experiment]["path"]


def point_cp_size(wildcards):
    return PLAN[wildcards.experiment]["points"][wildcards.point]["config"].cp_size


def point_gpus(wildcards):
    """GPUs a point's job holds: one per context-parallel rank (none on the cpu profile)."""
    return 0 if PROFILE == "cpu" else point_cp_size(wildcards)


def point_launcher(wildcards):
    return launcher(point_cp_size(wildcards), PYTHON)
CONDA_ENV = "../../environment.yml"


def points_dir(point_files):
    """results/<profile>/points, derived from the point files themselves."""
    return str(Path(point_files[0]).parents[1])
