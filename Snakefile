# The pipeline under Snakemake (a workstation or a SLURM cluster), for
#     snakemake --profile profiles/local     |     snakemake --profile profiles/slurm
#
# One rule per stage of dvc.yaml, built from it (pipeline/workflow/stage_graph.py): the same command,
# inputs (deps), outputs (outs, metrics, plots) and params, so the two engines cannot drift.
# params.yaml is Snakemake's config; its `cluster` section gives each job its SLURM resources
# (pipeline/workflow/cluster.py). A stage's output log goes to logs/<stage>.log; under SLURM the job's own
# log is in logs/slurm/<stage>/<job id>.log (profiles/slurm sets that folder).

from pipeline.workflow import cluster, stage_graph
from pipeline.config import load_params

configfile: "params.yaml"

PARAMS = load_params("params.yaml")      # validated before any job is submitted
cluster.check_shape(PARAMS)
STAGES = stage_graph.load("dvc.yaml")


def _outputs(stage):
    return [directory(o) if stage.is_dir(o) else o for o in stage.outs]


rule all:
    default_target: True
    input:
        [o for s in STAGES for o in s.outs],


for _stage in STAGES:

    rule:
        name:
            _stage.name
        input:
            list(_stage.deps),
        output:
            _outputs(_stage),
        params:
            # The command travels as a param: a shell string is evaluated when the job runs,
            # after this loop has moved on, so it must not refer to `_stage`.
            cmd=cluster.job_command(PARAMS, _stage.name, _stage.cmd),
            **stage_graph.param_values(_stage, config),
        log:
            f"logs/{_stage.name}.log",
        conda:
            "envs/pipeline.yaml"
        threads: getattr(PARAMS.cluster, _stage.name).cpus_per_task
        resources:
            **cluster.slurm_resources(PARAMS, _stage.name),
        shell:
            "{params.cmd} > {log} 2>&1"
