"""A graceful stop on SIGTERM or the warning signal (pipeline/training/stopping.py): the stage
finishes the step (PPO: the iteration) in progress, saves its checkpoint at that step, exits with
75, and a re-run resumes to the models of an uninterrupted run (same threads).

The steps are drawn from a seed printed with each assertion and always include the first step, a
checkpoint step (save_every) and the last step."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (REPO, TINY, free_port, merge, run_env, step_rows, supervised_run, tiny_params, wait_for,
                      without_time, write_params)
from pipeline.config import Params
from pipeline.errors import Stopped
from pipeline.ppo import trainer as ppo_trainer
from pipeline.stages import ppo, reward
from pipeline.training import stopping, supervised
from slow_steps import slow_start_hook, slow_steps_hook

SEED = int(os.environ.get("PIPELINE_TEST_SEED", random.SystemRandom().randrange(10_000)))


def _params(**override) -> Params:
    return tiny_params(merge({"sft": {"epochs": 2.0, "save_every": 2}, "reward": {"epochs": 2.0, "save_every": 2},
                              "ppo": {"iterations": 4, "save_every": 2}}, override))


@pytest.fixture(scope="module")
def reward_model(tiny_data, tiny_sft, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("rm")
    reward.run(_params(), tiny_data, tiny_sft, out, progress=False)
    return out / "model"




def _same_weights(a: Path, b: Path) -> bool:
    x, y = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


def _steps(last: int, every: int, rng: random.Random) -> list[int]:
    """The first step, a checkpoint step, the last step and one drawn at random."""
    return sorted({1, every, last, rng.randint(1, last)})


def _signal_during(monkeypatch, where: str, sig: signal.Signals) -> None:
    """Send `sig` to this process while the supervised loop computes step `where` (its loss check)."""
    real = supervised.check_finite

    def signalling(at, name, value):
        if at == where and name == "loss":
            os.kill(os.getpid(), sig)
        return real(at, name, value)
    monkeypatch.setattr(supervised, "check_finite", signalling)


@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_a_signal_stops_a_supervised_stage_at_its_step_and_the_rerun_equals_an_uninterrupted_run(
        stage, tiny_data, tiny_sft, tmp_path, monkeypatch):
    params = _params()
    go = supervised_run(stage, params, tiny_data, tiny_sft)
    full = go(tmp_path / "full")
    rng = random.Random(SEED)
    steps = _steps(full["train/steps"], 2, rng)
    for k in steps:
        note = f"({stage}, stopped at step {k} of {full['train/steps']}; steps {steps} drawn with seed {SEED})"
        out = tmp_path / f"stopped_{k}"
        sig = signal.SIGTERM if k % 2 else signal.SIGUSR1   # both stop signals
        _signal_during(monkeypatch, f"{stage} step {k}", sig)
        with pytest.raises(Stopped, match=rf"^{stage}: stopped by {sig.name} after step {k} of "
                                          rf"{full['train/steps']}; its checkpoint is saved"):
            go(out)
        monkeypatch.undo()
        state = json.loads((out / "checkpoint/state.json").read_text())
        assert state["step"] == k and len(state["logs"]["train"]["rows"]) == k, note
        assert not (out / "model").exists(), note
        resumed = go(out)
        assert without_time(resumed) == without_time(full), note
        assert _same_weights(tmp_path / "full/model", out / "model"), note
        for log in ("train.tsv", "eval.tsv"):
            assert step_rows(tmp_path / f"full/{log}") == step_rows(out / log), note
    # The handlers are the test process's own again once the stage is over.
    assert signal.getsignal(signal.SIGTERM) is not stopping._handler


def test_a_signal_stops_ppo_after_its_iteration_and_the_rerun_equals_an_uninterrupted_run(
        tiny_data, tiny_sft, reward_model, tmp_path, monkeypatch):
    params = _params()
    full = ppo.run(params, tiny_data, tiny_sft, reward_model, tmp_path / "full", progress=False)
    last = params.ppo.iterations
    steps = _steps(last, params.ppo.save_every, random.Random(SEED + 1))
    real = ppo_trainer.PPOTrainer.step
    for k in steps:
        note = f"(ppo, stopped in iteration {k} of {last}; drawn with seed {SEED + 1})"
        out = tmp_path / f"stopped_{k}"

        def signalling(self, k=k):
            if self.iteration == k - 1:          # during iteration k
                os.kill(os.getpid(), signal.SIGTERM)
            return real(self)
        monkeypatch.setattr(ppo_trainer.PPOTrainer, "step", signalling)
        with pytest.raises(Stopped, match=rf"^ppo: stopped by SIGTERM after iteration {k} of {last}"):
            ppo.run(params, tiny_data, tiny_sft, reward_model, out, progress=False)
        monkeypatch.undo()
        state = json.loads((out / "checkpoint/state.json").read_text())
        assert state["iteration"] == k and not (out / "model").exists(), note
        resumed = ppo.run(params, tiny_data, tiny_sft, reward_model, out, progress=False)
        assert without_time(resumed) == without_time(full), note
        assert _same_weights(tmp_path / "full/model", out / "model"), note
        assert step_rows(tmp_path / "full/train.tsv") == step_rows(out / "train.tsv"), note


def test_the_grace_ends_with_the_stage_so_a_process_that_goes_on_is_not_exited(tmp_path):
    """A stop's grace timer exits the process if the stop takes longer than the grace; once the
    stage is over (its handlers restored) the timer is gone, and the process (a notebook, a test
    worker) lives on past the grace."""
    script = ("import os, signal, time\n"
              "from pipeline.training import stopping\n"
              "with stopping.handling():\n"
              "    os.kill(os.getpid(), signal.SIGUSR1)\n"
              "    time.sleep(0.2)\n"
              "    assert stopping._requested == signal.SIGUSR1\n"
              "time.sleep(2.0)\n"
              "print('alive after the grace')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**run_env(), "PYTHONPATH": str(REPO), "PIPELINE_STOP_GRACE": "0.5"})
    assert "received SIGUSR1: stopping after the current step" in proc.stderr, proc.stderr
    assert (proc.returncode, proc.stdout.strip()) == (0, "alive after the grace"), proc.stderr[-2000:]


def test_the_same_signal_twice_at_once_is_one_request_and_later_a_second_one(tmp_path):
    """At a time limit SLURM signals every process of a step and srun forwards its own copy: two
    SIGTERMs within milliseconds are one request (the stage stops at its step); the same signal
    after REPEAT_SECONDS (shortened here) is a second one and exits at once with 128 + 15."""
    script = ("import os, signal, time\n"
              "from pipeline.training import stopping\n"
              "stopping.REPEAT_SECONDS = 0.5\n"
              "with stopping.handling():\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(0.1)\n"
              "    print('one request:', stopping._requested == signal.SIGTERM, flush=True)\n"
              "    time.sleep(0.6)\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    time.sleep(5)\n"
              "    print('not exited')\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**run_env(), "PYTHONPATH": str(REPO)})
    assert (proc.returncode, proc.stdout) == (128 + signal.SIGTERM, "one request: True\n"), proc.stderr[-2000:]
    assert proc.stderr.count("received SIGTERM") == 1, proc.stderr


# ---- Real processes ------------------------------------------------------------------------------


def test_sigterm_from_outside_stops_the_command_with_75_and_a_second_signal_exits_at_once(tiny_data, tmp_path):
    params = tmp_path / "params.yaml"
    write_params(params, merge(TINY, {"sft": {"epochs": 2.0, "save_every": 2}}))
    hook = slow_steps_hook(tmp_path / "hook", 0.2)
    env = {**run_env(), "PYTHONPATH": f"{hook}{os.pathsep}{REPO}"}
    cmd = [sys.executable, "-m", "pipeline", "sft", "--params", str(params), "--data", str(tiny_data),
           "--out", str(tmp_path / "out"), "--no-progress"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(tmp_path / "out/checkpoint/state.json", proc)   # the save of step 2: inside the loop
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 75, err[-2000:]
    line = err.strip().splitlines()[-1]
    assert line.startswith("sft: stopped by SIGTERM after step ") and "run the stage again to resume" in line, err
    step = int(line.split("after step ")[1].split()[0])
    assert json.loads((tmp_path / "out/checkpoint/state.json").read_text())["step"] == step >= 2
    assert "Traceback" not in err and not (tmp_path / "out/model").exists()
    # The re-run resumes there and finishes.
    done = subprocess.run(cmd, env={**run_env(), "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0 and "resuming" in done.stderr, done.stderr[-2000:]
    assert (tmp_path / "out/model/model.safetensors").is_file()

    # Two signals: the second ends the process at once, whatever step it is in.
    hook = slow_steps_hook(tmp_path / "slow", 60)
    proc = subprocess.Popen([*cmd[:-2], str(tmp_path / "again"), "--no-progress"],
                            env={**env, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(hook / "in_loop", proc)
    proc.send_signal(signal.SIGTERM)   # asks for a stop after this step (60 s away)
    time.sleep(stopping.REPEAT_SECONDS + 1)   # sooner, it would be the same request again
    started = time.time()
    proc.send_signal(signal.SIGTERM)   # no more grace
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert time.time() - started < 20, "the second signal did not exit at once"
    assert "received SIGTERM: stopping after the current step" in err


def test_a_signal_while_the_command_starts_gives_75_too_and_the_warning_signal_is_ignored(tmp_path):
    """A time limit can land while a job's command is still importing its libraries (seconds, more
    on a busy node): SIGTERM then exits at once with the same 75 as at a step; the warning signal,
    which SLURM may send that early, is ignored. The command here is `check`, which starts as every
    stage does."""
    params = tmp_path / "params.yaml"
    write_params(params, TINY)
    hook = slow_start_hook(tmp_path / "hook", 3)
    env = {**run_env(), "PYTHONPATH": f"{hook}{os.pathsep}{REPO}"}
    cmd = [sys.executable, "-m", "pipeline", "check", "--params", str(params)]
    outcome = {}
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        (hook / "importing").unlink(missing_ok=True)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        wait_for(hook / "importing", proc)   # the command is importing torch
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        outcome[sig.name] = (proc.returncode, out.strip(), err.strip().splitlines()[-1:] if err.strip() else [])
    assert outcome["SIGUSR1"] == (0, f"{params}: ok", []), outcome
    assert outcome["SIGTERM"] == (75, "", ["received SIGTERM outside a training step: exiting at once with "
                                           "status 75; run the command again"]), outcome


@pytest.mark.long
def test_the_warning_signal_to_the_launching_command_stops_both_ranks_of_ppo_at_one_iteration(
        tiny_data, tiny_sft, reward_model, tmp_path):
    """Two processes (DeepSpeed ZeRO-2 under torchrun): SIGUSR1 to the command the user ran, which
    forwards it to the ranks (not to torchrun); both stop after the same iteration (the checkpoint
    is collective), the command exits 75, and the re-run equals an uninterrupted run."""
    params = tmp_path / "params.yaml"
    write_params(params, merge(TINY, {"ppo": {"iterations": 6, "save_every": 2},
                                      "distributed": {"backend": "deepspeed", "zero_stage": 2, "num_processes": 2,
                                                      "master_port": free_port()}}))
    env = {**run_env(), "PYTHONPATH": str(REPO),
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}

    def cmd(out: str) -> list[str]:
        return [sys.executable, "-m", "pipeline", "ppo", "--params", str(params), "--data", str(tiny_data), "--sft",
                str(tiny_sft), "--reward", str(reward_model), "--out", str(tmp_path / out), "--no-progress"]
    full = subprocess.run(cmd("full"), env=env, capture_output=True, text=True, timeout=900)
    assert full.returncode == 0, full.stderr[-3000:]

    hook = tmp_path / "hook"   # every iteration a second longer, so the signal lands inside the loop
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, time\n"
        "if os.environ.get('LOCAL_RANK') is not None:\n"
        "    from pipeline.ppo import trainer\n"
        "    step = trainer.PPOTrainer.step\n"
        "    def slow(self):\n"
        "        time.sleep(1.0)\n"
        "        return step(self)\n"
        "    trainer.PPOTrainer.step = slow\n")
    proc = subprocess.Popen(cmd("stopped"), env={**env, "PYTHONPATH": f"{hook}{os.pathsep}{REPO}"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(tmp_path / "stopped/checkpoint/state.json", proc, timeout=600)   # iteration 2 saved
    proc.send_signal(signal.SIGUSR1)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 75, err[-3000:]
    iteration = json.loads((tmp_path / "stopped/checkpoint/state.json").read_text())["iteration"]
    assert 2 <= iteration < 6 and not (tmp_path / "stopped/model").exists(), err[-3000:]
    stops = [line for line in err.splitlines() if line.startswith("ppo: stopped by SIGUSR1 after iteration")]
    assert stops and all(f"after iteration {iteration} of 6" in line for line in stops), err[-3000:]

    resumed = subprocess.run(cmd("stopped"), env=env, capture_output=True, text=True, timeout=900)
    assert resumed.returncode == 0 and "resuming" in resumed.stderr, resumed.stderr[-3000:]
    assert step_rows(tmp_path / "full/train.tsv") == step_rows(tmp_path / "stopped/train.tsv")
    assert _same_weights(tmp_path / "full/model", tmp_path / "stopped/model")
