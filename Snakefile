# The pipeline under Snakemake (a workstation or a SLURM cluster), for
#     snakemake --profile profiles/local     |     snakemake --profile profiles/slurm
#
# One rule per stage of dvc.yaml and compare/dvc.yaml, built from them (pipeline/workflow/stage_graph.py): the same command,
# inputs (deps), outputs (outs, metrics, plots) and params, so the two engines cannot drift.
# params.yaml is Snakemake's config and holds hyperparameters only. Each job's SLURM resources are the
# profile's (`default-resources`, `set-resources` in profiles/slurm/config.yaml, or --set-resources);
# pipeline/workflow/cluster.py derives what follows from a job's `gpus` and `nodes`. A stage's output
# log goes to logs/<stage>.log; under SLURM the job's own log is in logs/slurm/rule_<stage>/<job id>.log
# (profiles/slurm sets the folder logs/slurm; the SLURM executor plugin names the rule's folder in it).
#
# Params reach a rule as a file: .snakemake/params/<stage>.json holds the values of the keys the stage
# declares, rewritten here only when they change, and is an input of the rule, so Snakemake re-runs
# exactly the stages whose params changed (and what follows them), whichever engine built the outputs
# (see stage_graph.write_param_files). `--config` overrides are refused: the jobs read params.yaml.
#
# `snakemake --report report.html` gathers each stage's figures, step logs and metrics (captions in
# report/); `logs/benchmarks/<stage>.tsv` holds each job's time and memory.

import os
import sys
from pathlib import Path

from pipeline.workflow import cluster, stage_graph
from pipeline.errors import UserError
from pipeline.stages import registry

configfile: "params.yaml"

try:
    stage_graph.check_no_overrides(workflow.config_settings.overwrite_config)
    STAGES = stage_graph.load_all()          # dvc.yaml, then compare/dvc.yaml (the methods side by side)
    SHAPES = cluster.shapes_of(workflow.resource_settings, {s.name: stage_graph.rule_name(s) for s in STAGES})
    if workflow.is_main_process:             # not again inside each job (a SLURM job parses this file too)
        # Validated before any job is submitted. Not in a job: reading every stage's declaration
        # imports torch and transformers (seconds per job), and the job's stage validates them anyway.
        PARAMS = registry.load_params("params.yaml")
        cluster.check_shape(PARAMS, SHAPES, registry.cluster_checked())
        stage_graph.write_param_files(STAGES, "params.yaml")
        stage_graph.drop_stale_benchmarks(STAGES)
except UserError as err:
    sys.exit(f"error: {err}")                # one line, as `python -m pipeline` prints it

report: "report/workflow.rst"


onstart:
    # One engine at a time in this workspace: DVC's repository lock, held until Snakemake exits, so
    # `dvc repro` and this run refuse to start beside each other (pipeline/workflow/workspace.py).
    # onstart runs only in the main process of a real run: not in a dry run, not inside a job.
    from pipeline.workflow import workspace
    try:
        workspace.hold(Path(os.path.relpath(workflow.basedir)))
    except UserError as err:
        sys.exit(f"error: {err}")


# What `snakemake --report` shows of each stage: (kind, caption) by how an output's name ends.
REPORTED = {".png": ("figures", "report/figure.rst"), ".tsv": ("step logs", "report/step_log.rst"),
            "metrics.json": ("metrics", "report/metrics.rst"), "report.md": ("report", "report/report_md.rst"),
            "samples.md": ("report", "report/samples.rst")}


def _outputs(stage):
    """The stage's outputs; those a reader looks at (figures, step logs, metrics, the report) are
    marked for the report, under the stage's name."""
    out = []
    for o in stage.outs:
        kind = next((v for end, v in REPORTED.items() if o.endswith(end)), None)
        if stage.is_dir(o):
            out.append(directory(o))
        elif kind is None:
            out.append(o)
        else:
            out.append(report(o, caption=kind[1], category=stage.name, subcategory=kind[0]))
    return out


# The default target is the default pipeline (dvc.yaml); `snakemake ... compare` also builds every
# method of compare/dvc.yaml and their comparison (its rule reads all of them).
DEFAULT = {s.name for s in stage_graph.load("dvc.yaml")}


rule all:
    default_target: True
    input:
        [o for s in STAGES if s.name in DEFAULT for o in s.outs],


for _stage in STAGES:

    rule:
        name:
            stage_graph.rule_name(_stage)
        input:
            list(_stage.deps),
            params=str(stage_graph.param_file(_stage)),
        output:
            _outputs(_stage),
        params:
            # The command travels as a param: a shell string is evaluated when the job runs,
            # after this loop has moved on, so it must not refer to `_stage`.
            # Locally, the stage keeps the thread settings it has under dvc repro (cluster.local_threads).
            cmd=cluster.local_threads(SHAPES[_stage.name]) + cluster.job_command(SHAPES[_stage.name], _stage.cmd),
        log:
            f"logs/{_stage.name}.log",
        benchmark:
            str(stage_graph.BENCHMARK_DIR / f"{_stage.name}.tsv")
        # A job's CPUs where a profile sets them; else every local core, one stage at a time as under DVC.
        threads: SHAPES[_stage.name].cpus_per_task or workflow.cores
        resources:
            **cluster.slurm_resources(SHAPES[_stage.name]),
        shell:
            "{params.cmd} > {log} 2>&1"
