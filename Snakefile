# LongStraw reproduction pipeline: points (JSON) -> tables (CSV) -> figures (PNG) -> report (HTML).
#   snakemake                                   # profile cpu (config/config.yaml): tiny real models
#   snakemake --config profile=h200             # one NVIDIA H200: the paper's operating points
#   snakemake --workflow-profile profiles/slurm # every job on SLURM (profiles/default: this machine)
from snakemake.utils import validate


configfile: "config/config.yaml"


validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/points.smk"
include: "workflow/rules/tables.smk"
include: "workflow/rules/report.smk"


# The default target lives here: Snakemake 9.27 takes no default target from included files.
rule all:
    input:
        f"reports/{PROFILE}/index.html",
        f"reports/recorded-{RECORDED}/index.html",
