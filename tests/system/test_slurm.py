"""The pipeline on a real SLURM cluster through the Snakemake profile: the tiny pipeline as one job
per stage equal to `dvc repro`, and a failed job naming its log (time limits: test_slurm_limits.py).

The cluster is the one `make slurm-setup` (scripts/slurm-local.sh start) sets up on this machine, on
request: the tests never set one up. The tier is skipped with its reason where none answers, and
fails instead under PIPELINE_TESTS_REQUIRE=slurm (the CI machine, whose .ci/run sets the cluster up)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from conftest import BIN, flat, project_copy, run

STAGES = ("prepare", "sft", "reward", "ppo", "evaluate")
TIMING = ("time", "seconds", "tokens_per_second", "peak_rss")   # what the process spent, not what it computed


@pytest.mark.slurm
def test_tiny_pipeline_on_slurm_equals_dvc_repro(tmp_path, tiny_run):
    tiny_run.same_threads()
    # Snakemake runs each job with OMP_NUM_THREADS set to its threads (the profile's cpus_per_task),
    # and the thread count changes PPO's floating-point sums: the jobs get the shared run's count
    # where one was set (make test's workers run at one thread).
    cpus = {s: {"cpus_per_task": int(tiny_run.threads)} for s in STAGES} if tiny_run.threads else None
    snake, dvc = project_copy(tmp_path, "snake", jobs=cpus), tiny_run.repo        # dvc: the shared `dvc repro` of the same params
    run([str(BIN / "snakemake"), "--profile", "profiles/slurm", "--slurm-init-seconds-before-status-checks", "1",
         "--seconds-between-status-checks", "2"], snake, timeout=1800)
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


@pytest.mark.slurm
def test_failed_job_names_its_log(tmp_path):
    repo = project_copy(tmp_path, "fail")
    # sft fails as a job (its module still imports: the command line reads every stage's SPEC)
    with open(repo / "pipeline/stages/sft.py", "a") as f:
        f.write("\n\ndef run(*args, **kwargs):\n    raise SystemExit('boom: sft broke')\n")
    proc = run([str(BIN / "snakemake"), "--profile", "profiles/slurm", "--slurm-init-seconds-before-status-checks", "1",
                "--seconds-between-status-checks", "2", "--retries", "0"], repo, check=False, timeout=1800)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "Error in rule sft" in out
    log = re.search(r"(\S*logs/slurm/rule_sft/\d+\.log)", out)
    assert log, out[-3000:]
    assert "boom: sft broke" in (repo / "logs/sft.log").read_text()


def test_the_slurm_tier_skips_with_its_reason_and_fails_where_it_is_required(monkeypatch):
    import conftest
    from types import SimpleNamespace
    item = SimpleNamespace(get_closest_marker=lambda name: object() if name == "slurm" else None)
    monkeypatch.setattr(conftest, "slurm_available", lambda: (False, "SLURM tier: no cluster, not root"))
    monkeypatch.delenv("PIPELINE_TESTS_REQUIRE", raising=False)
    with pytest.raises(pytest.skip.Exception, match="SLURM tier: no cluster, not root"):
        conftest.pytest_runtest_setup(item)
    monkeypatch.setenv("PIPELINE_TESTS_REQUIRE", "slurm")
    with pytest.raises(pytest.fail.Exception, match="this machine must run the SLURM tier"):
        conftest.pytest_runtest_setup(item)
    unmarked = SimpleNamespace(get_closest_marker=lambda name: None)
    assert conftest.pytest_runtest_setup(unmarked) is None
    monkeypatch.setattr(conftest, "slurm_available", lambda: (True, ""))
    assert conftest.pytest_runtest_setup(item) is None


def test_the_slurm_tier_asks_the_cluster_and_never_sets_one_up(monkeypatch):
    """Whether the tier runs is one `scontrol ping`; where no cluster answers (down, or no SLURM at
    all) nothing is installed or started, whoever runs the tests."""
    import conftest
    calls = []

    def answer(stdout):
        def fake_run(cmd, **kwargs):
            calls.append(cmd)
            if stdout is None:
                raise FileNotFoundError(cmd[0])
            return subprocess.CompletedProcess(cmd, 0, stdout=stdout, stderr="")
        return fake_run

    for stdout, expected in (("Slurmctld(primary) at node is UP\n", True),
                             ("Slurmctld(primary) at node is DOWN\n", False), (None, False)):
        calls.clear()
        monkeypatch.setattr(conftest.subprocess, "run", answer(stdout))
        ok, why = conftest.slurm_available()
        assert calls == [["scontrol", "ping"]] and ok is expected
        assert why == ("" if ok else "SLURM tier: no SLURM cluster answers `scontrol ping` "
                                     "(`make slurm-setup` starts one here, as root)")
