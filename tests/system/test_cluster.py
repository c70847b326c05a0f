"""Snakemake over the same stage graph as DVC: the DAG, the reruns a param change reaches, and the
SLURM profile's job shapes and commands (the runs on a real SLURM cluster: test_slurm.py)."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
from ruamel.yaml import YAML
from snakemake_executor_plugin_slurm.submit_string import get_submit_command
from snakemake_executor_plugin_slurm.utils import set_gres_string

from conftest import BIN, REPO, TINY, bare_env, project_copy, run, write_params
from pipeline.stages import registry
from pipeline.workflow import stage_graph
from pipeline.workflow.cluster import (THREAD_VARIABLES, JobShape, check_shape, expand_first, job_command, job_shape,
                                       local_threads, shapes_in_profile,
                                       slurm_node, slurm_resources)
from pipeline.config import Params, from_dict, merge_distributed
from pipeline.errors import ConfigError

STAGES = ("prepare", "sft", "reward", "ppo", "evaluate")
CHECKED = registry.cluster_checked()   # the default pipeline's distributed stages


def _dot_edges(dot: str, labels: dict[str, str] | None = None) -> set[tuple[str, str]]:
    edges = set()
    for a, b in re.findall(r'^\s*"?([\w.]+)"?\s*->\s*"?([\w.]+)"?', dot, flags=re.M):
        edges.add((labels.get(a, a), labels.get(b, b)) if labels else (a, b))
    return edges


def test_snakemake_dag_is_the_dvc_dag(tmp_path):
    repo = project_copy(tmp_path, "dag")
    rulegraph = run([str(BIN / "snakemake"), "-n", "--rulegraph", "--quiet", "all"], repo).stdout
    labels = dict(re.findall(r'^\s*(\d+)\[label = "(\w+)"', rulegraph, flags=re.M))
    snake = {e for e in _dot_edges(rulegraph, labels) if "all" not in e}
    # The default pipeline: evaluate and its ancestors (`dvc dag` alone also draws compare/dvc.yaml's stages).
    dvc = _dot_edges(run([str(BIN / "dvc"), "dag", "--dot", "evaluate"], repo).stdout)
    assert snake == dvc
    assert snake == stage_graph.edges(stage_graph.load(repo / "dvc.yaml"))
    assert {s for e in snake for s in e} == set(STAGES)
    # Same commands: the dry run prints each rule's shell command, which is dvc.yaml's `cmd`.
    dry = run([str(BIN / "snakemake"), "-n", "-p", "--forceall"], repo).stdout
    for stage in stage_graph.load(repo / "dvc.yaml"):
        assert f"exec {stage.cmd} > logs/{stage.name}.log 2>&1" in dry, stage.name
    # Resumable checkpoints are outputs of neither engine (Snakemake deletes outputs first; a queued
    # DVC experiment would re-run a stage whose checkpoint its fresh copy lacks).
    for stage in stage_graph.load(repo / "dvc.yaml"):
        assert not [o for o in stage.outs + stage.persistent if "checkpoint" in o], stage.name
    # A `persist: true` out a user adds stays out of the Snakemake rule.
    (tmp_path / "persist").mkdir()
    (tmp_path / "persist" / "dvc.yaml").write_text(
        "stages:\n  s:\n    cmd: x\n    outs:\n      - a\n      - b:\n          persist: true\n")
    (one,) = stage_graph.load(tmp_path / "persist" / "dvc.yaml")
    assert one.outs == ("a",) and one.persistent == ("b",)


def test_a_list_of_commands_runs_in_order_and_stops_at_a_failure(tmp_path):
    """DVC takes `cmd: [a, b]`: the rule runs a then b, as one command a job can `exec`."""
    import subprocess
    (tmp_path / "dvc.yaml").write_text("stages:\n  s:\n    cmd:\n      - echo one > log\n"
                                       "      - echo 'two words' >> log\n"
                                       "  f:\n    cmd: [\"false\", echo never > never]\n")
    ok, failing = stage_graph.load(tmp_path / "dvc.yaml")
    assert ok.cmd == "sh -c 'echo one > log && echo '\"'\"'two words'\"'\"' >> log'"
    for shape in (JobShape(), JobShape(warning="URG")):
        (tmp_path / "log").unlink(missing_ok=True)
        proc = subprocess.run(["bash", "-c", job_command(shape, ok.cmd)], cwd=tmp_path, capture_output=True,
                              text=True)
        assert proc.returncode == 0 and (tmp_path / "log").read_text() == "one\ntwo words\n", proc.stderr
    proc = subprocess.run(["bash", "-c", job_command(JobShape(), failing.cmd)], cwd=tmp_path,
                          capture_output=True)
    assert proc.returncode == 1 and not (tmp_path / "never").exists()
    assert stage_graph.shell_command(["echo a"]) == stage_graph.shell_command("echo a\n") == "echo a"


def test_compare_pipeline_is_a_target_of_its_own_in_both_engines(tmp_path):
    """compare/dvc.yaml's methods hang off the default pipeline with the same edges in DVC and in
    the stage graph Snakemake builds; Snakemake's `compare` target plans them, its default target
    does not (that a plain `dvc repro` runs none of them is checked end to end in test_e2e)."""
    repo = project_copy(tmp_path, "compare")
    dot = run([str(BIN / "dvc"), "dag", "--dot"], repo).stdout
    dvc = {(a.split(":")[-1], b.split(":")[-1]) for a, b in re.findall(r'^"([^"]+)" -> "([^"]+)";', dot, flags=re.M)}
    graph = stage_graph.edges(stage_graph.load_all(repo))
    assert dvc == graph
    # compare reads the data, the SFT policy, the reward model and every method's policy (ppo's included).
    assert {a for a, b in graph if b == "compare"} == {"prepare", "sft", "reward", *registry.methods()}
    rulegraph = run([str(BIN / "snakemake"), "compare", "-n", "--rulegraph", "--quiet", "all"], repo).stdout
    labels = dict(re.findall(r'^\s*(\d+)\[label = "(\w+)"', rulegraph, flags=re.M))
    assert _dot_edges(rulegraph, labels) == {e for e in graph if e[1] != "evaluate"}   # what compare needs
    stats = run([str(BIN / "snakemake"), "-n", "--forceall"], repo).stdout.split("Job stats:")[1].split("total")[0]
    assert set(re.findall(r"^(\w+)\s+1$", stats, flags=re.M)) == {*STAGES, "all"}, stats   # the default target


def test_snakemake_lint_reports_only_the_undeclared_software_environment(tmp_path):
    """One lint per rule and no other, that no conda environment or container is named: every rule
    runs `bin/pipeline`, i.e. the checkout's .venv, whose software requirements.lock pins; a conda
    environment beside it would describe a second install that nothing tests, so the rules declare none."""
    repo = project_copy(tmp_path, "lint")
    proc = run([str(BIN / "snakemake"), "--lint"], repo, check=False)
    out = proc.stdout + proc.stderr
    lints = set(re.findall(r"^\s+\* (.+?):?$", out, flags=re.M))
    assert lints == {"Specify a conda environment or container for each rule."}, out[-3000:]
    rules = set(re.findall(r"^Lints for rule (\w+)", out, flags=re.M))
    assert rules == {s.name for s in stage_graph.load_all(repo)}       # that one lint, per rule, and no other


def _planned(repo: Path, *args: str) -> set[str]:
    """The stages `snakemake -n` would run (none: "Nothing to be done")."""
    proc = run([str(BIN / "snakemake"), "-n", *args], repo)
    out = proc.stdout + proc.stderr
    if "Nothing to be done" in out:
        return set()
    stats = out.split("Job stats:")[1].split("total")[0]   # the "job count" table
    return {line.split()[0] for line in stats.splitlines() if line.split() and line.split()[0] in STAGES}


def _set(repo: Path, section: str, key: str, value) -> None:
    write_params(repo / "params.yaml", {**TINY, section: {**TINY.get(section, {}), key: value}})


def test_either_engine_then_snakemake_reruns_exactly_what_a_param_change_reaches(tiny_run, tiny_run_copy):
    """`dvc repro` builds the tiny pipeline; Snakemake, which has no record of that run, plans exactly
    ppo and evaluate after `ppo.kl_coef` changes (what `dvc status` flags and what follows it), and
    nothing once it ran them, or once DVC rebuilt what a `reward.lr` change reached. The README's commands run as written (`.venv/bin/dvc repro`,
    `.venv/bin/snakemake --profile profiles/local`) from a shell whose PATH lacks the venv (the jobs'
    `bin/pipeline` finds the checkout's .venv). Then the report holds every stage's outputs."""
    repo = tiny_run_copy                                          # the shared `dvc repro`, copied
    # A stage's progress is plain lines when its output is not a terminal (pipeline/progress.py).
    assert re.search(r"^sft: (\d+)/\1 steps \(100%\)", tiny_run.printed, re.M) and "\r" not in tiny_run.printed

    # Snakemake's first look, after a params edit: what DVC flags and what follows it.
    _set(repo, "ppo", "kl_coef", 0.123)
    assert set(json.loads(run([str(BIN / "dvc"), "status", "--json", "dvc.yaml"], repo).stdout)) == {"ppo"}
    assert _planned(repo) == {"ppo", "evaluate"}
    assert sorted(p.name for p in (repo / ".snakemake/params").iterdir()) == sorted(
        f"{s.name}.json" for s in stage_graph.load_all(repo))       # compare/dvc.yaml's stages too
    # `--config` would reach neither the jobs nor DVC: refused in one line.
    proc = run([str(BIN / "snakemake"), "-n", "--config", "ppo={kl_coef: 0.5}"], repo, check=False)
    assert proc.returncode != 0
    assert "error: snakemake --config/--configfile (ppo): overrides are not supported, the jobs read params.yaml; " \
           "edit params.yaml" in proc.stderr

    run([str(BIN / "snakemake"), "--profile", "profiles/local", "--quiet"], repo, timeout=900, env=bare_env(repo))
    assert not (repo / "logs/sft.log").exists()                 # only ppo and evaluate ran
    ppo_log = (repo / "logs/ppo.log").read_text()
    assert "\r" not in ppo_log
    assert re.search(r"^ppo: 3/3 iterations \(100%\), .*; score=\S+ kl=\S+ gold=\S+ detector=\S+$", ppo_log, re.M)
    for stage in ("ppo", "evaluate"):
        bench = (repo / "logs/benchmarks" / f"{stage}.tsv").read_text().splitlines()
        assert bench[0].startswith("s\th:m:s\tmax_rss") and float(bench[1].split("\t")[0]) > 0
    assert _planned(repo) == set()
    # A change undone before any run: Snakemake built ppo and recorded its params file's checksum.
    _set(repo, "ppo", "kl_coef", 0.2)
    assert _planned(repo) == {"ppo", "evaluate"}
    _set(repo, "ppo", "kl_coef", 0.123)
    assert _planned(repo) == set()

    # The report: every stage's figures, step logs and metrics, by stage (reusing this run).
    run([str(BIN / "snakemake"), "--report", "report.zip"], repo)
    with zipfile.ZipFile(repo / "report.zip") as z:
        html = z.read("report/report.html").decode()
        files = {Path(n).name for n in z.namelist() if n.startswith("report/data/raw/")}
    start = html.index("var categories = ") + len("var categories = ")
    categories, _ = json.JSONDecoder().raw_decode(html, start)
    shown = {stage: sorted(f for fs in kinds.values() for f in fs) for stage, kinds in categories.items()}
    expected = {s.name: sorted(o for o in s.outs if o.endswith((".png", ".tsv", "metrics.json", "report.md", "samples.md")))
                for s in stage_graph.load(repo / "dvc.yaml") if s.name != "prepare"}
    assert shown == expected
    assert categories["ppo"]["step logs"] == ["outputs/ppo/train.tsv"]
    assert categories["evaluate"]["figures"] == ["outputs/evaluate/kl_frontier.png", "outputs/evaluate/scores.png"]
    assert {"report.md", "samples.md", "calibration.png", "train.tsv", "metrics.json"} <= files
    assert "A step log of the <tt class=\\\"docutils literal\\\">ppo</tt> stage" in html     # its caption
    assert "InstructGPT-style RLHF" in html                                                # the workflow's

    # A middle stage's param: it and what follows; DVC then rebuilds them, and Snakemake agrees
    # (the benchmarks of the Snakemake run no longer describe the outputs: dropped).
    _set(repo, "reward", "lr", 5e-4)
    assert _planned(repo) == {"reward", "ppo", "evaluate"}
    run([str(BIN / "dvc"), "repro"], repo, env=bare_env(repo))
    assert _planned(repo) == set()
    assert not (repo / "logs/benchmarks/ppo.tsv").exists()


def test_param_files_change_only_with_the_values_and_date_from_the_edit(tmp_path):
    stages = [stage_graph.Stage("a", "cmd", (), (), (), ("x",)),
              stage_graph.Stage("b", "cmd", (), (), (), ("y", "x.k", "not.there"))]
    params = tmp_path / "params.yaml"

    def edit(text: str, when: float) -> list[str]:
        params.write_text(text)
        os.utime(params, (when, when))
        return [p.stem for p in stage_graph.write_param_files(stages, params, tmp_path, tmp_path / "dvc.lock")]

    def dated(name: str) -> float:
        return (tmp_path / ".snakemake/params" / f"{name}.json").stat().st_mtime

    # DVC built `a` with these values (b with another y): a's first file predates any output.
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\nstages:\n  a:\n    params:\n      params.yaml:\n"
                                       "        x: {k: 1}\n  b:\n    params:\n      params.yaml:\n"
                                       "        y: 7\n        x.k: 1\n")
    assert edit("x: {k: 1}\ny: 2\n", 1000) == ["a", "b"]
    assert dated("a") == 0 and dated("b") == 1000                  # b: dated from the edit
    (tmp_path / ".snakemake/params/a.json").unlink()
    (tmp_path / "dvc.lock").unlink()
    assert edit("x: {k: 1}\ny: 2\n", 1000) == ["a"]                # no lock: dated from the edit
    assert dated("a") == dated("b") == 1000
    assert json.loads((tmp_path / ".snakemake/params/b.json").read_text()) == \
        {"stage": "b", "params": {"y": 2, "x.k": 1}}                 # a key params.yaml lacks is left out
    assert edit("x: {k: 1}\ny: 3\n", 2000) == ["b"]               # only the stage that reads y
    assert dated("a") == 1000 and dated("b") == 2000
    before = time.time()
    assert edit("x: {k: 5}\ny: 3\n", 1500) == ["a", "b"]          # params.yaml dated back (restored)
    assert dated("a") == 1500 and dated("b") >= before              # never dated before its last change
    assert edit("x: {k: 5}\ny: 3\n", 9000) == [] and dated("a") == 1500   # same values: untouched


def test_stale_benchmarks_are_dropped(tmp_path):
    (stage,) = [stage_graph.Stage("s", "cmd", (), ("out/model", "out/metrics.json"), (), ())]
    model, metrics = tmp_path / "out/model", tmp_path / "out/metrics.json"
    bench = tmp_path / stage_graph.BENCHMARK_DIR / "s.tsv"
    model.mkdir(parents=True)
    bench.parent.mkdir(parents=True)

    def state(marked: bool, metrics_at: float) -> list[Path]:
        (model / ".snakemake_timestamp").unlink(missing_ok=True)
        if marked:
            (model / ".snakemake_timestamp").touch()
        metrics.write_text("{}")
        os.utime(metrics, (metrics_at, metrics_at))
        bench.write_text("s\n1\n")
        os.utime(bench, (200, 200))
        return stage_graph.drop_stale_benchmarks([stage], tmp_path)

    assert state(marked=True, metrics_at=100) == [] and bench.exists()       # Snakemake's own run
    assert state(marked=True, metrics_at=300) == [bench] and not bench.exists()   # a file rebuilt after it
    assert state(marked=False, metrics_at=100) == [bench]                    # a folder rebuilt without the mark


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
           "sft": {"batch_size": 64}, "reward": {"batch_size": 64},
           "ppo": {"rollout_batch_size": 512, "minibatch_size": 128, "micro_batch_size": 8}}
    return from_dict(Params, merge_distributed(raw, "params.yaml: "), "params.yaml: ")


# A profile for that setup, as a user writes it: GPU jobs on two nodes, a partition and an account.
GPU_PROFILE = {"default-resources": {"cpus_per_task": 2, "mem_mb": 8000, "runtime": 60, "slurm_partition": "gpu",
                                     "slurm_account": "proj"},
               "set-resources": {"prepare": {"cpus_per_task": 1},
                                 **{s: {"gpus": 8, "nodes": 2, "cpus_per_task": 16, "mem_mb": 200000, "runtime": 240}
                                    for s in ("sft", "reward", "ppo", "evaluate")}}}


def _job_resources(profile: dict, stage: str) -> dict:
    """What Snakemake gives the job: default-resources, the rule's own (what the shape implies),
    then the stage's set-resources."""
    shape = shapes_in_profile(profile, (stage,))[stage]
    return {**profile["default-resources"], **slurm_resources(shape), **profile["set-resources"].get(stage, {})}


def _sbatch(resources: dict, threads: int) -> str:
    job = SimpleNamespace(resources=_Resources(resources), threads=threads)
    account = f" -A {resources['slurm_account']}" if "slurm_account" in resources else ""
    partition = f" -p {resources['slurm_partition']}" if "slurm_partition" in resources else ""
    return get_submit_command(job, {"run_uuid": "u", "slurm_logfile": "logs/slurm/x.log", "comment_str": "c",
                                    "account": account, "partition": partition, "workdir": "/w"}) \
        + set_gres_string(job)


def test_sbatch_for_multi_node_gpu_stages():
    shapes = shapes_in_profile(GPU_PROFILE, STAGES)
    check_shape(_gpu_params(), shapes, CHECKED)
    for stage in ("sft", "reward", "ppo", "evaluate"):   # evaluate samples on the GPUs too
        res = _job_resources(GPU_PROFILE, stage)
        line = _sbatch(res, res["cpus_per_task"])
        for flag in ("-A proj", "-p gpu", "-t 240", "--mem 200000", "--nodes=2", "--ntasks=2",
                     "--cpus-per-task=16", "--gres=gpu:8"):
            assert flag in line, (stage, flag, line)
        assert "--ntasks-per-gpu" not in line        # one task per node starts the 8 processes
        # The job starts the stage once per node; each copy finds its rank from SLURM.
        assert job_command(shapes[stage], f"python -m pipeline {stage}") == \
            f"exec srun --ntasks-per-node=1 --nodes=2 python -m pipeline {stage}"
    res = _job_resources(GPU_PROFILE, "prepare")        # a CPU stage: no GPU, one node, no srun prefix
    line = _sbatch(res, res["cpus_per_task"])
    assert "gres" not in line and "--nodes=1" in line and "--cpus-per-task=1" in line
    assert job_command(shapes["prepare"], "cmd") == "exec cmd"   # the stage, not a shell, gets the signals
    # A job that asks for a warning signal names it to the stage and ignores it until the stage
    # handles it (exec keeps an ignored signal ignored); `B:` would signal only the batch shell.
    warned = {**GPU_PROFILE, "default-resources": {**GPU_PROFILE["default-resources"], "slurm_extra": "'--signal=R:urg@300'"},
              "set-resources": {**GPU_PROFILE["set-resources"], "prepare": {"slurm_extra": "--signal=B:USR1@60"}}}
    shapes = shapes_in_profile(warned, STAGES)
    assert job_command(shapes["ppo"], "cmd") == "trap '' URG; PIPELINE_STOP_SIGNAL=URG exec srun --ntasks-per-node=1 --nodes=2 cmd"
    assert job_command(shapes["prepare"], "cmd") == "exec cmd"
    assert shapes_in_profile({"default-resources": {"slurm_extra": "--signal 10@90"}}, ("sft",))["sft"].warning == "USR1"
    with pytest.raises(ConfigError, match=r"set-resources sft.slurm_extra: --signal names no signal"):
        shapes_in_profile({"set-resources": {"sft": {"slurm_extra": "--signal=NOPE@90"}}}, ("sft",))


def test_the_shipped_profile_gives_every_stage_a_cpu_job_on_one_node():
    profile = YAML(typ="safe", pure=True).load((REPO / "profiles/slurm/config.yaml").read_text())
    shapes = shapes_in_profile(profile, tuple(s.name for s in stage_graph.load_all(REPO)))
    # Every job asks for the warning signal that leaves Snakemake's process in the job alone.
    assert set(shapes.values()) == {JobShape(gpus=0, nodes=1, cpus_per_task=2, warning="URG"), JobShape(0, 1, 1, "URG")}
    assert shapes["prepare"].cpus_per_task == 1
    assert _job_resources(profile, "ppo")["runtime"] == 120 and _job_resources(profile, "sft")["runtime"] == 60
    # Every stage of both pipelines has its line in set-resources, where a user gives it GPUs or time.
    assert sorted(profile["set-resources"]) == sorted(s.name for s in stage_graph.load_all(REPO))
    # params.yaml holds hyperparameters only: no job resources there.
    assert "cluster" not in YAML(typ="safe", pure=True).load((REPO / "params.yaml").read_text())


def test_cluster_resources_must_match_the_distributed_shape(tmp_path):
    def params(raw):
        return from_dict(Params, merge_distributed(raw, "params.yaml: "), "params.yaml: ")
    with pytest.raises(ConfigError, match=r"set-resources ppo.gpus: 4 GPUs per node but ppo.distributed.num_processes=1"):
        check_shape(params({}), {"ppo": JobShape(gpus=4)}, CHECKED)
    with pytest.raises(ConfigError, match=r"set-resources sft.nodes: 2 must equal sft.distributed.num_nodes=1"):
        check_shape(params({}), {"sft": JobShape(nodes=2)}, CHECKED)
    with pytest.raises(ConfigError, match=r"set-resources prepare: a CPU stage"):
        check_shape(params({}), {"prepare": JobShape(gpus=1)}, CHECKED)
    with pytest.raises(ConfigError, match=r"set-resources ppo.gpus: expected a whole number >= 0, got 'eight'"):
        job_shape("ppo", {}, {"gpus": "eight"})
    # evaluate and compare sample on GPUs too, sharded like the training stages.
    with pytest.raises(ConfigError, match=r"set-resources evaluate.gpus: 2 GPUs per node but evaluate.distributed.num_processes=1"):
        check_shape(params({}), {"evaluate": JobShape(gpus=2)}, CHECKED)
    check_shape(params({"evaluate": {"distributed": {"backend": "deepspeed", "num_processes": 2}}}),
                {"evaluate": JobShape(gpus=2)}, CHECKED)
    # Snakemake refuses such a profile before submitting anything, from the profile or the command line.
    repo = project_copy(tmp_path, "shape", jobs={"ppo": {"gpus": 4}})
    proc = run([str(BIN / "snakemake"), "-n", "--profile", "profiles/slurm"], repo, check=False)
    assert proc.returncode != 0 and "error: set-resources ppo.gpus: 4 GPUs per node" in proc.stdout + proc.stderr
    proc = run([str(BIN / "snakemake"), "-n", "--set-resources", "sft:nodes=2"], repo, check=False)
    assert proc.returncode != 0 and "error: set-resources sft.nodes: 2 must equal" in proc.stdout + proc.stderr
    # A params file that still carries job resources is told where they live now.
    write_params(repo / "params.yaml", {**TINY, "cluster": {"ppo": {"gpus": 4}}})
    proc = run([str(BIN / "python"), "-m", "pipeline", "check"], repo, check=False)
    assert proc.returncode != 0 and "params.yaml: cluster: job resources are Snakemake's" in proc.stderr
    assert "profiles/slurm/config.yaml" in proc.stderr


def test_node_rank_and_master_from_the_slurm_environment():
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[03-04]"}
    assert slurm_node(env) == (1, "gpu03")
    assert slurm_node({"SLURM_JOB_NUM_NODES": "1", "SLURM_NODEID": "0"}) == (None, None)
    assert expand_first("gpu[07,09-11]") == "gpu07" and expand_first("a1,b2") == "a1"


def test_a_plain_snakemake_finds_the_default_profile_and_no_conda_environment(tmp_path):
    repo = project_copy(tmp_path, "plain")
    proc = run([str(BIN / "snakemake"), "-n"], repo)
    assert "Using workflow specific profile profiles/default" in proc.stdout + proc.stderr
    # Snakemake applies it under --profile profiles/slurm too, its keys first: nothing that changes
    # where or how many jobs run.
    default = YAML(typ="safe", pure=True).load((REPO / "profiles/default/config.yaml").read_text())
    assert default == {"cores": "all", "printshellcmds": True, "rerun-incomplete": True}
    # No `conda:` directive: --sdm conda would build an environment the install does not describe.
    assert "conda:" not in (REPO / "Snakefile").read_text() and not (REPO / "envs").exists()


FOREACH = """
vars:
  - folder: outputs/extra
stages:
  extra:
    foreach: [a, b]
    do:
      cmd: mkdir -p ${folder} && echo ${item} > ${folder}/${item}.txt
      deps: [data/prepared]
      outs: ["${folder}/${item}.txt"]
  grid:
    matrix:
      lr: [1, 2]
    cmd: mkdir -p outputs/grid && echo ${item.lr} > outputs/grid/${item.lr}.txt
    deps: ["outputs/extra/a.txt"]
    outs: ["outputs/grid/${item.lr}.txt"]
    params: [ppo.kl_coef]
"""


def test_foreach_matrix_and_vars_stages_resolve_as_dvc_resolves_them(tmp_path):
    (tmp_path / "dvc.yaml").write_text(FOREACH)
    got = {s.name: s for s in stage_graph.load(tmp_path / "dvc.yaml")}
    assert list(got) == ["extra@a", "extra@b", "grid@1", "grid@2"]
    assert got["extra@b"].cmd == "mkdir -p outputs/extra && echo b > outputs/extra/b.txt"
    assert got["extra@b"].outs == ("outputs/extra/b.txt",) and got["grid@2"].params == ("ppo.kl_coef",)
    assert ("extra@a", "grid@1") in stage_graph.edges(list(got.values()))
    assert [stage_graph.rule_name(s) for s in got.values()] == ["extra_a", "extra_b", "grid_1", "grid_2"]
    # Snakemake plans them from the same dvc.yaml, each expanded stage a rule of its own.
    repo = project_copy(tmp_path, "foreach")
    yaml = YAML()
    doc = yaml.load((repo / "dvc.yaml").read_text())
    extra = YAML(typ="safe", pure=True).load(FOREACH.replace("${folder}", "outputs/extra"))["stages"]
    doc["stages"].update(extra)      # no `vars` in the repository's file: the folder written out
    with open(repo / "dvc.yaml", "w") as f:
        yaml.dump(doc, f)
    plan = run([str(BIN / "snakemake"), "-n", "--quiet", "rules"], repo).stdout
    for rule in ("extra_a", "extra_b", "grid_1", "grid_2", "sft", "evaluate"):
        assert re.search(rf"^\s*{rule}\s+1\s*$", plan, flags=re.M), (rule, plan)


def test_a_local_job_runs_its_stage_at_the_thread_count_dvc_repro_gives_it(tmp_path):
    # Snakemake's shell exports every thread variable as the rule's threads (all logical CPUs);
    # under dvc repro the stage sees the caller's environment. The job's prefix undoes the first.
    shown = "import os; print(os.environ.get('OMP_NUM_THREADS'), os.environ.get('MKL_NUM_THREADS'))"
    cmd = f"{shlex.quote(sys.executable)} -c {shlex.quote(shown)}"
    snakemake_env = {**os.environ, **{v: "64" for v in THREAD_VARIABLES}}
    snakemake_env.pop("SLURM_JOB_ID", None)
    for caller, expected in (({}, "None None"), ({"OMP_NUM_THREADS": "3"}, "3 None")):
        prefix = local_threads(JobShape(), caller)
        out = subprocess.run(["bash", "-c", prefix + job_command(JobShape(), cmd)], env=snakemake_env,
                             capture_output=True, text=True, check=True).stdout.strip()
        assert out == expected, (prefix, out)
    assert local_threads(JobShape(cpus_per_task=4), {}) == ""           # a job given its CPUs keeps Snakemake's count
    assert local_threads(JobShape(), {"SLURM_JOB_ID": "7"}) == ""      # and so does one inside an allocation
    assert local_threads(JobShape(), {v: "2" for v in THREAD_VARIABLES}) == \
        "export " + " ".join(f"{v}=2" for v in THREAD_VARIABLES) + "; "
