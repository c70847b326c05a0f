"""SLURM: the shape of each stage's job, and where a job learns its node rank and master.

A job's resources are Snakemake's, set where Snakemake users set them: `default-resources` and
`set-resources` of the profile (profiles/slurm/config.yaml), or `--set-resources` on the command line;
params.yaml holds hyperparameters only. Two resource names are this project's own, because the
Snakefile must know them when it builds the rules: `gpus` (per node, one process each) and `nodes`.
`JobShape` is what a rule asks for; `slurm_resources` adds the resources of
`snakemake-executor-plugin-slurm` that follow from it:

- GPUs are requested per node as GRES (`--gres=gpu:N`), so a multi-node job gets N on every node.
- A multi-node stage is an "MPI" job for the plugin (no `srun` wrapped around it, `--ntasks` = nodes);
  its command is prefixed with `srun --ntasks-per-node=1`, so the stage command starts once per
  node, and each copy takes its node rank from `SLURM_NODEID` and rank 0's host from the job's node
  list (`slurm_node`), then starts its local processes (torchrun or deepspeed) as on one machine.
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ..config import Params
from ..errors import ConfigError

SHAPE_KEYS = ("gpus", "nodes", "cpus_per_task")
PROFILE = Path("profiles") / "slurm" / "config.yaml"


@dataclass(frozen=True)
class JobShape:
    """What a stage's job asks for that its rule depends on."""
    gpus: int = 0                          # per node, one process each (= distributed.num_processes)
    nodes: int = 1                         # (= distributed.num_nodes)
    cpus_per_task: Optional[int] = None    # None: the rule's threads are the local cores
    warning: Optional[str] = None          # the signal its slurm_extra `--signal` sends the job's steps (URG)


def job_shape(rule: str, defaults: Optional[Mapping[str, Any]], overrides: Optional[Mapping[str, Any]]) -> JobShape:
    """`rule`'s shape from Snakemake's resources: its `set-resources` entry over `default-resources`
    (plain values, or Snakemake's `Resource` objects)."""
    values: dict[str, Any] = {}
    for source in (defaults or {}, overrides or {}):
        for key in SHAPE_KEYS:
            if key in source:
                values[key] = getattr(source[key], "value", source[key])
    lowest = {"gpus": 0, "nodes": 1, "cpus_per_task": 1}
    for key, value in values.items():
        if value is None and key == "cpus_per_task":
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < lowest[key]:
            raise ConfigError(f"set-resources {rule}.{key}: expected a whole number >= {lowest[key]}, got {value!r}")
    # slurm_extra as written (a Resource's `raw`: the profile's expression, unevaluated outside a rule)
    extra = next((str(getattr(s["slurm_extra"], "raw", s["slurm_extra"])) for s in (overrides or {}, defaults or {})
                  if "slurm_extra" in s), "")
    return JobShape(**values, warning=warning_signal(rule, extra))


def warning_signal(rule: str, slurm_extra: str) -> Optional[str]:
    """The signal `--signal=[R:]SIG@seconds` in a job's slurm_extra sends its steps (the stage), as a
    name without SIG (`URG`); None without one, or with `B:`, which signals only the batch shell."""
    m = re.search(r"--signal[= ]([RB]:)*(\w+)", slurm_extra)
    if not m or "B:" in m.group(0):
        return None
    name = m.group(2).upper().removeprefix("SIG")
    try:
        return (signal.Signals(int(name)) if name.isdigit() else signal.Signals[f"SIG{name}"]).name.removeprefix("SIG")
    except (KeyError, ValueError):
        raise ConfigError(f"set-resources {rule}.slurm_extra: --signal names no signal: {m.group(0)!r}") from None


def shapes_of(resource_settings: Any, rules: Mapping[str, str]) -> dict[str, JobShape]:
    """Each stage's shape from Snakemake's resource settings (`workflow.resource_settings`), for
    `rules` mapping stage name -> rule name."""
    overwrite = resource_settings.overwrite_resources or {}
    return {stage: job_shape(rule, resource_settings.default_resources, overwrite.get(rule))
            for stage, rule in rules.items()}


def shapes_in_profile(profile: Mapping[str, Any], stages: tuple[str, ...]) -> dict[str, JobShape]:
    """The same from a profile's config.yaml as read (its `default-resources` and `set-resources`)."""
    defaults, per_rule = profile.get("default-resources") or {}, profile.get("set-resources") or {}
    return {stage: job_shape(stage, defaults, per_rule.get(stage)) for stage in stages}


def check_shape(params: Params, shapes: Mapping[str, JobShape], stages: Sequence[str]) -> None:
    """A stage's job must have the shape its `distributed` settings launch: as many nodes, and (when
    it asks for GPUs) one GPU per process; `prepare` is a CPU job on one node. Checked before
    Snakemake submits anything, for `stages` (the registry's cluster_checked: the default
    pipeline's distributed stages; scaling compare/dvc.yaml's methods out, set their resources to
    match too)."""
    prepare = shapes.get("prepare", JobShape())
    if prepare.gpus or prepare.nodes > 1:
        raise ConfigError("set-resources prepare: a CPU stage on one node: set gpus: 0 and nodes: 1")
    for stage in stages:
        res, dist = shapes.get(stage, JobShape()), getattr(params, stage).distributed
        if res.nodes != dist.num_nodes:
            raise ConfigError(f"set-resources {stage}.nodes: {res.nodes} must equal {stage}.distributed.num_nodes="
                              f"{dist.num_nodes} (one launcher per node)")
        if res.gpus and res.gpus != dist.num_processes:
            raise ConfigError(f"set-resources {stage}.gpus: {res.gpus} GPUs per node but {stage}.distributed."
                              f"num_processes={dist.num_processes} processes per node (one per GPU)")


def slurm_resources(shape: JobShape) -> dict[str, Any]:
    """The plugin's resources that follow from a job's shape (the rest, memory, time, partition,
    come from the profile as they are)."""
    out: dict[str, Any] = {"nodes": shape.nodes}
    if shape.gpus > 0:
        out["gres"] = f"gpu:{shape.gpus}"
        out["tasks_per_gpu"] = 0           # one task drives all GPUs of its node (torchrun starts the rest)
    if shape.nodes > 1:
        out["mpi"] = "srun"                # we start the per-node copies ourselves (see module doc)
        out["tasks"] = shape.nodes
    return out


def job_command(shape: JobShape, cmd: str) -> str:
    """The stage's command as a job runs it: the same command, started once per node (srun passes
    a signal on to its tasks). `exec`: the job's shell becomes the stage, so SLURM's SIGTERM at a
    time limit reaches the stage itself, which stops at a step boundary and saves its checkpoint
    (pipeline/training/stopping.py). A job that asks for a warning signal tells the stage which
    (PIPELINE_STOP_SIGNAL) and ignores it until the stage handles it: SLURM may send the warning
    up to a minute early, so at once under a short time limit, while the stage is still starting."""
    warn = f"trap '' {shape.warning}; PIPELINE_STOP_SIGNAL={shape.warning} " if shape.warning else ""
    return f"{warn}exec srun --ntasks-per-node=1 --nodes={shape.nodes} {cmd}" if shape.nodes > 1 else f"{warn}exec {cmd}"


# The thread counts Snakemake's shell sets in every job's environment to the rule's `threads`.
THREAD_VARIABLES = ("OMP_NUM_THREADS", "GOTO_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                    "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


def local_threads(shape: JobShape, env: Mapping[str, str] | None = None) -> str:
    """Shell words that give a stage run by a local Snakemake job the thread settings it has under
    `dvc repro`: those of the environment Snakemake was started from (`env`, read when the Snakefile
    is parsed), each unset where that environment has none. Snakemake sets them all to the rule's
    threads, here every logical CPU (`workflow.cores`), while torch left alone takes one thread per
    physical core: on a CPU with two hardware threads per core, the two routes ran the same stage at
    different thread counts and trained models that differ in their bits. Empty for a job given its
    CPUs (`cpus_per_task`) or run inside a SLURM allocation, where Snakemake's count is the job's."""
    env = os.environ if env is None else env
    if shape.cpus_per_task is not None or "SLURM_JOB_ID" in env:
        return ""
    unset = [v for v in THREAD_VARIABLES if v not in env]
    kept = [f"{v}={shlex.quote(env[v])}" for v in THREAD_VARIABLES if v in env]
    return (f"unset {' '.join(unset)}; " if unset else "") + (f"export {' '.join(kept)}; " if kept else "")


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
