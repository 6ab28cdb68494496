# LongStraw reproduction pipeline: points (JSON) -> tables (CSV) -> figures (PNG) -> report (HTML).
#   snakemake --cores all                         # profile cpu (default): tiny real models
#   snakemake --cores all --config profile=h200   # one NVIDIA H200: the paper's operating points
include: "workflow/rules/common.smk"
include: "workflow/rules/points.smk"
include: "workflow/rules/tables.smk"
include: "workflow/rules/report.smk"


# The default target lives here: Snakemake 9.27 takes no default target from included files.
rule all:
    input:
        f"reports/{PROFILE}/index.html",
        f"reports/recorded-{RECORDED}/index.html",
