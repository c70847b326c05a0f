"""Snakemake over the same stage graph as DVC, on a real (single-node) SLURM cluster.

The cluster is the one `scripts/slurm-local.sh start` sets up on this machine (`make test` starts
it). The SLURM test runs the tiny pipeline with `snakemake --profile profiles/slurm`, checks that
every stage ran as its own SLURM job, and that every metric equals `dvc repro` on the same params.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
from snakemake_executor_plugin_slurm.submit_string import get_submit_command
from snakemake_executor_plugin_slurm.utils import set_gres_string

from conftest import BIN, REPO, TINY, bare_env, copy_repo, flat, run, write_params
from pipeline.workflow import stage_graph
from pipeline.workflow.cluster import check_shape, expand_first, job_command, slurm_node, slurm_resources
from pipeline.config import Params, from_dict, merge_distributed
from pipeline.errors import ConfigError

STAGES = ("prepare", "sft", "reward", "ppo", "evaluate")
TIMING = ("time", "seconds", "tokens_per_second")


def _repo(tmp_path: Path, name: str) -> Path:
    repo = copy_repo(tmp_path / name)
    write_params(repo / "params.yaml", TINY)
    return repo


def _dot_edges(dot: str, labels: dict[str, str] | None = None) -> set[tuple[str, str]]:
    edges = set()
    for a, b in re.findall(r'^\s*"?([\w.]+)"?\s*->\s*"?([\w.]+)"?', dot, flags=re.M):
        edges.add((labels.get(a, a), labels.get(b, b)) if labels else (a, b))
    return edges


def test_snakemake_dag_is_the_dvc_dag(tmp_path):
    repo = _repo(tmp_path, "dag")
    rulegraph = run([str(BIN / "snakemake"), "-n", "--rulegraph", "--quiet", "all"], repo).stdout
    labels = dict(re.findall(r'^\s*(\d+)\[label = "(\w+)"', rulegraph, flags=re.M))
    snake = {e for e in _dot_edges(rulegraph, labels) if "all" not in e}
    dvc = _dot_edges(run([str(BIN / "dvc"), "dag", "--dot"], repo).stdout)
    assert snake == dvc
    assert snake == stage_graph.edges(stage_graph.load(repo / "dvc.yaml"))
    assert {s for e in snake for s in e} == set(STAGES)
    # Same commands: the dry run prints each rule's shell command, which is dvc.yaml's `cmd`.
    dry = run([str(BIN / "snakemake"), "-n", "-p", "--forceall"], repo).stdout
    for stage in stage_graph.load(repo / "dvc.yaml"):
        assert f"{stage.cmd} > logs/{stage.name}.log 2>&1" in dry, stage.name
    # Resumable checkpoints are outputs of neither engine (Snakemake deletes outputs first; a queued
    # DVC experiment would re-run a stage whose checkpoint its fresh copy lacks).
    for stage in stage_graph.load(repo / "dvc.yaml"):
        assert not [o for o in stage.outs + stage.persistent if "checkpoint" in o], stage.name
    # A `persist: true` out a user adds stays out of the Snakemake rule.
    (tmp_path / "persist.yaml").write_text(
        "stages:\n  s:\n    cmd: x\n    outs:\n      - a\n      - b:\n          persist: true\n")
    (one,) = stage_graph.load(tmp_path / "persist.yaml")
    assert one.outs == ("a",) and one.persistent == ("b",)


def test_snakemake_lint_is_clean(tmp_path):
    repo = _repo(tmp_path, "lint")
    proc = run([str(BIN / "snakemake"), "--lint"], repo)
    assert "Congratulations, your workflow is in a good condition!" in proc.stdout + proc.stderr


def test_params_change_reruns_the_stage_and_its_descendants(tmp_path):
    """Snakemake re-runs what a changed param touches, as `dvc repro` would (params are rule params).
    The run is the README's command as written, `.venv/bin/snakemake --profile profiles/local`, from a
    shell whose PATH lacks the venv (the jobs' `bin/pipeline` finds the checkout's .venv)."""
    repo = _repo(tmp_path, "rerun")
    run([str(BIN / "snakemake"), "--profile", "profiles/local", "--quiet"], repo, timeout=900, env=bare_env(repo))
    write_params(repo / "params.yaml", {**TINY, "reward": {**TINY["reward"], "lr": 5e-4}})
    dry = run([str(BIN / "snakemake"), "-n"], repo)
    stats = (dry.stdout + dry.stderr).split("Job stats:")[1].split("total")[0]   # "job count" table
    ran = {line.split()[0] for line in stats.splitlines() if line.split() and line.split()[0] in STAGES}
    assert ran == {"reward", "ppo", "evaluate"}


# ---- SLURM resources (no GPU exists here: the sbatch lines are checked, not run) ----------------


class _Resources(dict):
    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


def _gpu_params() -> Params:
    raw = {"distributed": {"backend": "deepspeed", "num_processes": 8, "num_nodes": 2, "zero_stage": 3,
                           "precision": "bf16"},
           "cluster": {"partition": "gpu", "account": "proj",
                       **{s: {"gpus": 8, "nodes": 2, "cpus_per_task": 16, "mem_mb": 200000, "runtime": 240}
                          for s in ("sft", "reward", "ppo")}},
           "sft": {"batch_size": 64}, "reward": {"batch_size": 64},
           "ppo": {"rollout_batch_size": 512, "minibatch_size": 128, "micro_batch_size": 8}}
    return from_dict(Params, merge_distributed(raw, "params.yaml: "), "params.yaml: ")


def _sbatch(resources: dict, threads: int) -> str:
    job = SimpleNamespace(resources=_Resources(resources), threads=threads)
    account = f" -A {resources['slurm_account']}" if "slurm_account" in resources else ""
    partition = f" -p {resources['slurm_partition']}" if "slurm_partition" in resources else ""
    return get_submit_command(job, {"run_uuid": "u", "slurm_logfile": "logs/slurm/x.log", "comment_str": "c",
                                    "account": account, "partition": partition, "workdir": "/w"}) \
        + set_gres_string(job)


def test_sbatch_for_multi_node_gpu_stages():
    params = _gpu_params()
    for stage in ("sft", "reward", "ppo"):
        res = slurm_resources(params, stage)
        line = _sbatch(res, res["cpus_per_task"])
        for flag in ("-A proj", "-p gpu", "-t 240", "--mem 200000", "--nodes=2", "--ntasks=2",
                     "--cpus-per-task=16", "--gres=gpu:8"):
            assert flag in line, (stage, flag, line)
        assert "--ntasks-per-gpu" not in line        # one task per node starts the 8 processes
        # The job starts the stage once per node; each copy finds its rank from SLURM.
        assert job_command(params, stage, f"python -m pipeline {stage}") == \
            f"srun --ntasks-per-node=1 --nodes=2 python -m pipeline {stage}"
    for stage in ("prepare", "evaluate"):               # CPU stages: no GPU, one node, no srun prefix
        res = slurm_resources(params, stage)
        line = _sbatch(res, res["cpus_per_task"])
        assert "gres" not in line and "--nodes=1" in line and "--ntasks=1" in line
        assert job_command(params, stage, "cmd") == "cmd"


def test_cluster_resources_must_match_the_distributed_shape(tmp_path):
    def params(raw):
        return from_dict(Params, merge_distributed(raw, "params.yaml: "), "params.yaml: ")
    with pytest.raises(ConfigError, match=r"cluster.ppo.gpus: 4 GPUs per node but ppo.distributed.num_processes=1"):
        check_shape(params({"cluster": {"ppo": {"gpus": 4}}}))
    with pytest.raises(ConfigError, match=r"cluster.sft.nodes: 2 must equal sft.distributed.num_nodes=1"):
        check_shape(params({"cluster": {"sft": {"nodes": 2}}}))
    check_shape(_gpu_params())
    # Snakemake refuses such params before submitting anything.
    repo = _repo(tmp_path, "shape")
    write_params(repo / "params.yaml", {**TINY, "cluster": {"ppo": {"gpus": 4}}})
    proc = run([str(BIN / "snakemake"), "-n"], repo, check=False)
    assert proc.returncode != 0 and "cluster.ppo.gpus: 4 GPUs per node" in proc.stdout + proc.stderr
    with pytest.raises(ConfigError, match=r"cluster.evaluate: a CPU stage"):
        params({"cluster": {"evaluate": {"gpus": 1}}})


def test_node_rank_and_master_from_the_slurm_environment():
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[03-04]"}
    assert slurm_node(env) == (1, "gpu03")
    assert slurm_node({"SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}) == (None, None)
    assert expand_first("gpu[07,09-11]") == "gpu07" and expand_first("a1,b2") == "a1"


# ---- A real SLURM ---------------------------------------------------------------------------------


def _ensure_slurm() -> None:
    ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True)
    if "is UP" not in ping.stdout:
        subprocess.run(["bash", str(REPO / "scripts/slurm-local.sh"), "start"], check=True, capture_output=True)


def test_tiny_pipeline_on_slurm_equals_dvc_repro(tmp_path):
    _ensure_slurm()
    snake, dvc = _repo(tmp_path, "snake"), _repo(tmp_path, "dvc")
    run([str(BIN / "snakemake"), "--profile", "profiles/slurm", "--slurm-init-seconds-before-status-checks", "1",
         "--seconds-between-status-checks", "2"], snake, timeout=1800)
    run([str(BIN / "dvc"), "repro"], dvc, timeout=1800)
    job_ids = {}
    for stage in STAGES:
        logs = list((snake / "logs/slurm" / f"rule_{stage}").glob("*.log"))
        assert len(logs) == 1, (stage, logs)            # one SLURM job per stage, its log where promised
        job_ids[stage] = logs[0].stem
        state = subprocess.run(["scontrol", "show", "job", job_ids[stage]], capture_output=True, text=True).stdout
        assert "JobState=COMPLETED" in state, (stage, state)
        assert f"rule {stage}:" in logs[0].read_text()
        assert (snake / "logs" / f"{stage}.log").is_file()
    assert len(set(job_ids.values())) == len(STAGES)
    for stage in ("sft", "reward", "ppo", "evaluate"):
        a = flat(json.loads((snake / "outputs" / stage / "metrics.json").read_text()))
        b = flat(json.loads((dvc / "outputs" / stage / "metrics.json").read_text()))
        assert a.keys() == b.keys()
        differ = {k for k in a if a[k] != b[k] and not any(t in k for t in TIMING)}
        assert not differ, (stage, {k: (a[k], b[k]) for k in differ})
    assert (snake / "data/prepared/stats.json").read_bytes() == (dvc / "data/prepared/stats.json").read_bytes()


def test_failed_job_names_its_log(tmp_path):
    _ensure_slurm()
    repo = _repo(tmp_path, "fail")
    (repo / "pipeline/stages/sft.py").write_text("raise SystemExit('boom: sft broke')\n")   # sft fails as a job
    proc = run([str(BIN / "snakemake"), "--profile", "profiles/slurm", "--slurm-init-seconds-before-status-checks", "1",
                "--seconds-between-status-checks", "2"], repo, check=False, timeout=1800)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "Error in rule sft" in out
    log = re.search(r"(\S*logs/slurm/rule_sft/\d+\.log)", out)
    assert log, out[-3000:]
    assert "boom: sft broke" in (repo / "logs/sft.log").read_text()
