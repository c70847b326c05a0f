"""The pipeline on a real SLURM cluster through the Snakemake profile: the tiny pipeline as one job
per stage equal to `dvc repro`, a failed job naming its log, and a stage stopped by the warning
signal and by its time limit that finishes through retries with the model of one run.

The cluster is the one `scripts/slurm-local.sh start` sets up on this machine (`make test` starts
it); the tier is skipped with its reason where none answers, and fails instead under
PIPELINE_TESTS_REQUIRE=slurm (the CI machine)."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from conftest import BIN, flat, project_copy, run, run_env

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


@pytest.mark.slurm
def test_a_stage_stopped_by_the_warning_and_by_its_time_limit_finishes_after_retries_with_the_model_of_one_run(tmp_path):
    """SFT whose work (about 100 s at one thread) outlasts its one-minute time limit. Its first job
    gets the warning signal (SIGURG to the job's steps, as `--signal` sends it; sent here by scancel
    once training runs, so the test need not guess when SLURM sends it) and stops after its step
    with exit 75; the next job is ended by the time limit's SIGTERM and stops the same way;
    Snakemake submits it again each time (`retries`) and the last job finishes. The model and step
    log equal an uninterrupted run at the same thread count. The shipped profile retries 3 times;
    this copy 8, so that a slower or busier machine, whose run takes more time-limited jobs, still
    finishes. prepare's one-minute job gets the
    profile's warning at once (it is due 5 minutes before the limit), while it starts, and lives:
    the job command ignores it until a stage handles it."""
    override = {"data": {"n_sft": 4000}, "sft": {"epochs": 60.0, "save_every": 1000, "eval_every": 1000}}
    one_thread = {"runtime": 1, "cpus_per_task": 1}
    repo = project_copy(tmp_path, "limit", override, jobs={"prepare": one_thread, "sft": {**one_thread, "slurm_extra": "''"}},
                        profile={"retries": 8})
    ref = project_copy(tmp_path, "ref", override)
    env = {**run_env(), "OMP_NUM_THREADS": "1", "PIPELINE_STOP_SIGNAL": "URG"}
    run(["bin/pipeline", "prepare", "--params", "params.yaml", "--out", "data/prepared"], ref, env=env)
    # The uninterrupted run on the other CPU while the cluster runs its job on one.
    reference = subprocess.Popen(["bin/pipeline", "sft", "--params", "params.yaml", "--data", "data/prepared",
                                  "--out", "outputs/sft"], cwd=ref, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.PIPE, text=True)
    snake = subprocess.Popen([str(BIN / "snakemake"), "--profile", "profiles/slurm", "--slurm-init-seconds-before-status-checks",
                              "1", "--seconds-between-status-checks", "2", "sft"], cwd=repo, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert snake.poll() is None, snake.stdout.read()[-4000:]
            log = (repo / "logs/sft.log").read_text() if (repo / "logs/sft.log").exists() else ""
            steps = [int(n) for n in re.findall(r"sft: (\d+)/\d+ steps", log)]
            if steps and steps[-1] >= 500:
                break
            time.sleep(0.5)
        first = next((repo / "logs/slurm/rule_sft").glob("*.log")).stem
        subprocess.run(["scancel", "--signal=URG", first], check=True, timeout=30)
        out, _ = snake.communicate(timeout=1200)
    finally:
        snake.kill()
    assert reference.wait(timeout=600) == 0, reference.stderr.read()[-2000:]
    assert snake.returncode == 0, out[-4000:]
    assert len(list((repo / "logs/slurm/rule_prepare").glob("*.log"))) == 1     # not ended by the warning
    # The warning's job, the time limit's job (or more) and the one that finished.
    jobs = list((repo / "logs/slurm/rule_sft").glob("*.log"))
    assert len(jobs) >= 3, jobs
    assert out.count("Trying to restart job") == len(jobs) - 1, out[-4000:]
    log = (repo / "logs/sft.log").read_text()                    # the last job's
    assert re.search(r"sft: resuming from outputs/sft/checkpoint at step [1-9]", log), log[-3000:]
    for f in ("model/model.safetensors", "train.tsv", "eval.tsv"):
        assert (repo / "outputs/sft" / f).read_bytes() == (ref / "outputs/sft" / f).read_bytes(), f
