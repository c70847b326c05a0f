"""A stage on a real SLURM cluster stopped by the profile's warning signal and by its time limit:
it finishes through Snakemake's retries with the model of one uninterrupted run. The cluster is the
one `make slurm-setup` sets up (see test_slurm.py)."""

from __future__ import annotations

import re
import subprocess
import time

import pytest

from conftest import BIN, TINY, project_copy, run, run_env
from slow_steps import slow_steps_hook


STEP_SECONDS = 0.5    # each SFT step this much longer in the cluster's jobs (slow_steps_hook)
STEPS = 300           # 150 s of steps: more than the two-minute limit gives a job, whatever the CPU
# Two minutes, not one: a job's fixed cost (Snakemake's start in the job, imports, the final
# measurement) reaches a minute on a busy machine, and a job that finished its stage a second after
# its limit is still TIMEOUT to SLURM, so one-minute jobs could keep repeating that last minute.
LIMIT_MINUTES = 2


@pytest.mark.slurm
def test_a_stage_stopped_by_the_warning_and_by_its_time_limit_finishes_after_retries_with_the_model_of_one_run(tmp_path):
    """SFT whose steps (STEPS of STEP_SECONDS each, slow_steps_hook) outlast its time limit.
    Its first job gets the warning signal (SIGURG to the job's steps, as `--signal` sends it; sent
    here by scancel once training runs, so the test need not guess when SLURM sends it) and stops
    after its step with exit 75; the next job is ended by the time limit's SIGTERM and stops the
    same way; Snakemake submits it again each time (`retries`) and the last job finishes. The model
    and step log equal an uninterrupted run (no sleep) at the same thread count. The shipped profile
    retries 3 times; this copy 8, so that a slower or busier machine, whose run takes more
    time-limited jobs, still finishes. prepare's one-minute job gets the profile's warning at once
    (it is due 5 minutes before the limit), while it starts, and lives: the job command ignores it
    until a stage handles it."""
    batch = TINY["sft"]["batch_size"]
    override = {"sft": {"epochs": STEPS * batch / TINY["data"]["n_sft"], "save_every": 10 * STEPS,
                        "eval_every": 10 * STEPS}}
    one_thread = {"runtime": 1, "cpus_per_task": 1}
    sft_job = {**one_thread, "runtime": LIMIT_MINUTES, "slurm_extra": "''"}
    repo = project_copy(tmp_path, "limit", override, jobs={"prepare": one_thread, "sft": sft_job},
                        profile={"retries": 8})
    ref = project_copy(tmp_path, "ref", override)
    env = {**run_env(), "OMP_NUM_THREADS": "1", "PIPELINE_STOP_SIGNAL": "URG"}
    run(["bin/pipeline", "prepare", "--params", "params.yaml", "--out", "data/prepared"], ref, env=env)
    run(["bin/pipeline", "sft", "--params", "params.yaml", "--data", "data/prepared", "--out", "outputs/sft"],
        ref, env=env)   # the uninterrupted run, seconds without the sleep
    assert len((ref / "outputs/sft/train.tsv").read_text().splitlines()) == 1 + STEPS   # a header, a row a step
    hook = slow_steps_hook(tmp_path / "hook", STEP_SECONDS)
    snake = subprocess.Popen([str(BIN / "snakemake"), "--profile", "profiles/slurm", "--slurm-init-seconds-before-status-checks",
                              "1", "--seconds-between-status-checks", "2", "sft"], cwd=repo,
                             env={**env, "PYTHONPATH": str(hook)},
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            assert snake.poll() is None, snake.stdout.read()[-4000:]
            log = (repo / "logs/sft.log").read_text() if (repo / "logs/sft.log").exists() else ""
            steps = [int(n) for n in re.findall(r"sft: (\d+)/\d+ steps", log)]
            if steps and steps[-1] >= 1:
                break
            time.sleep(0.5)
        first = next((repo / "logs/slurm/rule_sft").glob("*.log")).stem
        subprocess.run(["scancel", "--signal=URG", first], check=True, timeout=30)
        out, _ = snake.communicate(timeout=1700)   # under pytest's 1800 s
    finally:
        snake.kill()
    assert snake.returncode == 0, out[-4000:]
    assert len(list((repo / "logs/slurm/rule_prepare").glob("*.log"))) == 1     # not ended by the warning
    # The warning's job, the time limit's job (or more) and the one that finished.
    jobs = list((repo / "logs/slurm/rule_sft").glob("*.log"))
    assert len(jobs) >= 3, jobs
    assert out.count("Trying to restart job") == len(jobs) - 1, out[-4000:]
    # A job whose step the time limit ended: its stage stopped at its step (75), not at once (143:
    # SLURM and srun each deliver the SIGTERM, and a repeat is not a second signal), or, had the limit
    # landed while the command was still starting, exited 75 at once. A job can also be ended while
    # its batch script winds up after the step (no step line). No job's stage exits otherwise.
    texts = {j.name: j.read_text() for j in sorted(jobs)}
    shown = "\n".join(f"== {n}\n{t[-2500:]}" for n, t in texts.items())
    limited = [t for t in texts.values() if re.search(r"STEP \S+ ON \S+ CANCELLED AT \S+ DUE TO TIME LIMIT", t)]
    assert limited and all("returned non-zero exit status 75." in t for t in limited), shown
    codes = {n: set(re.findall(r"returned non-zero exit status (\d+)\.", t)) for n, t in texts.items()}
    assert all(c <= {"75"} for c in codes.values()), codes
    log = (repo / "logs/sft.log").read_text()                    # the last job's
    assert re.search(r"sft: resuming from outputs/sft/checkpoint at step [1-9]", log), log[-3000:]
    for f in ("model/model.safetensors", "train.tsv", "eval.tsv"):
        assert (repo / "outputs/sft" / f).read_bytes() == (ref / "outputs/sft" / f).read_bytes(), f
