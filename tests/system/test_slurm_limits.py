"""A stage on a real SLURM cluster stopped by the profile's warning signal and by its time limit:
it finishes through Snakemake's retries with the model of one uninterrupted run. The cluster is the
one `scripts/slurm-local.sh start` sets up (see test_slurm.py)."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from conftest import BIN, project_copy, run, run_env


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
