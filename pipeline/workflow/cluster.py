"""SLURM: the resources each stage asks for, and where a job learns its node rank and master.

The `cluster` section of params.yaml says, per stage, what one job needs (partition, account,
GPUs per node, CPUs per task, memory, time limit, nodes, tasks). `slurm_resources` turns it into
the resource names of `snakemake-executor-plugin-slurm`, which the Snakefile hands to each rule:

- GPUs are requested per node as GRES (`--gres=gpu:N`), so a multi-node job gets N on every node.
- A multi-node stage is an "MPI" job for the plugin (no `srun` wrapped around it, `--ntasks` = nodes);
  its command is prefixed with `srun --ntasks-per-node=1`, so the stage command starts once per
  node, and each copy takes its node rank from `SLURM_NODEID` and rank 0's host from the job's node
  list (`slurm_node`), then starts its local processes (torchrun or deepspeed) as on one machine.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any, Mapping

from ..config import Params, StageResources
from ..errors import ConfigError

# Checked before Snakemake submits anything: the default pipeline's stages. The methods of
# compare/dvc.yaml are left out, so a cluster setup for the default pipeline is not refused over
# stages it does not run; scaling those out, set their `cluster.<stage>` to match too.
SHAPE_CHECKED = ("sft", "reward", "ppo", "evaluate")


def check_shape(params: Params, where: str = "params.yaml") -> None:
    """A training stage's job must have the shape its `distributed` settings launch: as many nodes,
    and (when it asks for GPUs) one GPU per process. Checked before Snakemake submits anything."""
    for stage in SHAPE_CHECKED:
        res, dist = getattr(params.cluster, stage), getattr(params, stage).distributed
        if res.nodes != dist.num_nodes:
            raise ConfigError(f"{where}: cluster.{stage}.nodes: {res.nodes} must equal {stage}.distributed.num_nodes="
                              f"{dist.num_nodes} (one launcher per node)")
        if res.gpus and res.gpus != dist.num_processes:
            raise ConfigError(f"{where}: cluster.{stage}.gpus: {res.gpus} GPUs per node but {stage}.distributed."
                              f"num_processes={dist.num_processes} processes per node (one per GPU)")


def resources_of(params: Params, stage: str) -> StageResources:
    """`cluster.<stage>` of params; a stage of the user's own (a `foreach` stage `train@a` reads
    `cluster.train` if params has it) gets the defaults of a CPU job."""
    return getattr(params.cluster, stage.split("@")[0], None) or StageResources()


def slurm_resources(params: Params, stage: str) -> dict[str, Any]:
    """Snakemake resources for one stage's job (names of snakemake-executor-plugin-slurm)."""
    res = resources_of(params, stage)
    out: dict[str, Any] = {"cpus_per_task": res.cpus_per_task, "mem_mb": res.mem_mb, "runtime": res.runtime,
                           "nodes": res.nodes}
    if params.cluster.partition is not None:
        out["slurm_partition"] = params.cluster.partition
    if params.cluster.account is not None:
        out["slurm_account"] = params.cluster.account
    if res.gpus > 0:
        out["gres"] = f"gpu:{res.gpus}"
        out["tasks_per_gpu"] = 0           # one task drives all GPUs of its node (torchrun starts the rest)
    if res.nodes > 1:
        out["mpi"] = "srun"                # we start the per-node copies ourselves (see module doc)
        out["tasks"] = res.nodes
    else:
        out["tasks"] = res.tasks
    return out


def job_command(params: Params, stage: str, cmd: str) -> str:
    """The stage's command as a job runs it: the same command, started once per node."""
    nodes = resources_of(params, stage).nodes
    return f"srun --ntasks-per-node=1 --nodes={nodes} {cmd}" if nodes > 1 else cmd


def slurm_node(env: Mapping[str, str] | None = None) -> tuple[int | None, str | None]:
    """(node rank, rank 0's host) of this copy of a multi-node SLURM job, or (None, None) outside one."""
    env = os.environ if env is None else env
    if int(env.get("SLURM_JOB_NUM_NODES", env.get("SLURM_NNODES", "1")) or 1) <= 1 or "SLURM_NODEID" not in env:
        return None, None
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
    return int(env["SLURM_NODEID"]), first_host(nodelist)


def first_host(nodelist: str) -> str | None:
    """The first host of a SLURM node list (`gpu[03-05,07]` -> `gpu03`), via scontrol when present."""
    if not nodelist:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True,
                             check=True, timeout=30).stdout.split()
        if out:
            return out[0]
    except (OSError, subprocess.SubprocessError):
        pass
    return expand_first(nodelist)


def expand_first(nodelist: str) -> str:
    """Without scontrol: the first host of a node list, expanded by hand."""
    head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist[:nodelist.index("]") + 1]
    if "[" not in head:
        return head
    prefix, ranges = head.split("[", 1)
    first = ranges.rstrip("]").split(",")[0].split("-")[0]
    return prefix + first
