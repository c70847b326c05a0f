"""Crashes: every training stage resumes from its last checkpoint and ends where an uninterrupted run
ends; NaN/inf losses and gradients stop the stage at the step they appear, keeping the last good
checkpoint, or (`on_nonfinite: skip`) drop that update and count it. The in-process tests pin the mechanics; `test_dvc_repro_after_sigkill_*` kills real
`dvc repro` processes with SIGKILL and re-runs them."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import subprocess
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import (BIN, TINY, assert_same_run, copy_repo, die_in_step, flat, merge, run, run_env, step_rows,
                      supervised_run, tiny_params, without_time, write_params)
from pipeline import errors
from pipeline.training import demonstrations, resume
from pipeline.stages import reward, sft
from pipeline.config import Params
from pipeline.errors import ConfigError, NumericalError



def _params(**override) -> Params:
    return tiny_params(merge({"sft": {"epochs": 2.0, "save_every": 2}, "reward": {"epochs": 2.0, "save_every": 2}},
                             override))




@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_killed_and_resumed_equals_uninterrupted(stage, tiny_data, tiny_sft, tmp_path, monkeypatch):
    params = _params()
    go = supervised_run(stage, params, tiny_data, tiny_sft)
    full = go(tmp_path / "full")

    die_in_step(monkeypatch, f"{stage} step 4")   # killed in step 4; the save of step 2 exists
    with pytest.raises(KeyboardInterrupt):
        go(tmp_path / "resumed")
    state = json.loads((tmp_path / "resumed/checkpoint/state.json").read_text())
    assert state["step"] == 2 and len(state["logs"]["train"]["rows"]) == 2
    assert not (tmp_path / "resumed/model").exists()
    monkeypatch.undo()
    resumed = go(tmp_path / "resumed")

    assert_same_run(tmp_path / "full", tmp_path / "resumed", full, resumed)
    assert resumed["train/seconds"] > 0

    # Another config never resumes from the stale save: it trains from step 1 (and would die at 4).
    other = _params(**{stage: {"lr": 5e-4}})
    die_in_step(monkeypatch, f"{stage} step 4")
    with pytest.raises(KeyboardInterrupt):
        (sft.run(other, tiny_data, tmp_path / "resumed", progress=False) if stage == "sft"
         else reward.run(other, tiny_data, tiny_sft, tmp_path / "resumed", progress=False))
    state2 = json.loads((tmp_path / "resumed/checkpoint/state.json").read_text())
    assert state2["fingerprint"] != state["fingerprint"] and state2["step"] == 2


def test_checkpoint_left_between_the_two_renames_is_recovered(tmp_path):
    """A kill between `target -> .target.old` and `staging -> target` leaves only the old folder."""
    old = tmp_path / ".checkpoint.old"
    old.mkdir()
    (old / "state.json").write_text(json.dumps({"fingerprint": "f", "step": 6}))
    state = resume.read_state(tmp_path / "checkpoint", "f")
    assert state["step"] == 6 and (tmp_path / "checkpoint/state.json").is_file() and not old.exists()


def _nan_grad(loss: torch.Tensor, model) -> torch.Tensor:
    """`loss` unchanged in value, but every gradient NaN (the masked branch of a where still
    back-propagates 0 * inf)."""
    p = next(model.parameters())
    poison = torch.where(torch.tensor(False), torch.sqrt(-(p.abs().sum() + 1)), torch.tensor(0.0))
    return loss + poison


@pytest.mark.parametrize("quantity", ["loss", "gradient norm"])
def test_sft_nan_stops_at_the_step_and_keeps_the_checkpoint(quantity, tiny_data, tmp_path, monkeypatch):
    real, calls = demonstrations.ce_sum, {"n": 0}

    def broken(model, batch):
        loss, n = real(model, batch)
        if torch.is_grad_enabled():          # training forwards only (evaluation is no_grad)
            calls["n"] += 1
            if calls["n"] == 3:
                loss = loss * float("nan") if quantity == "loss" else _nan_grad(loss, model)
        return loss, n
    monkeypatch.setattr(demonstrations, "ce_sum", broken)   # the sft stage's loss
    with pytest.raises(NumericalError, match=rf"^sft step 3: {quantity} is NaN or infinite; stopped, the last "
                                             rf"checkpoint is kept$"):
        sft.run(_params(), tiny_data, tmp_path, progress=False)
    assert json.loads((tmp_path / "checkpoint/state.json").read_text())["step"] == 2
    assert not (tmp_path / "model").exists() and not (tmp_path / "metrics.json").exists()


def test_reward_nan_stops_at_the_step(tiny_data, tiny_sft, tmp_path, monkeypatch):
    from pipeline.models import reward_model as rm
    real, calls = rm.pairwise_loss_sum, {"n": 0}

    def broken(rc, rr, margin):
        loss, correct = real(rc, rr, margin)
        if torch.is_grad_enabled():
            calls["n"] += 1
            loss = loss * float("inf") if calls["n"] == 5 else loss
        return loss, correct
    monkeypatch.setattr(rm, "pairwise_loss_sum", broken)
    with pytest.raises(NumericalError, match=r"^reward step 5: loss is NaN or infinite"):
        reward.run(_params(), tiny_data, tiny_sft, tmp_path, progress=False)
    assert json.loads((tmp_path / "checkpoint/state.json").read_text())["step"] == 4


def _sft_faults(monkeypatch, faults: dict[int, str], weights: dict[int, torch.Tensor] | None = None) -> None:
    """SFT's training forward number n (one per step here) gets `faults[n]`: "loss" (NaN), "gradient"
    (a finite loss, NaN gradients) or "kill" (KeyboardInterrupt). `weights[n]`: the model's weights
    as forward n sees them (those after step n - 1)."""
    real, calls = demonstrations.ce_sum, {"n": 0}

    def broken(model, batch):
        loss, n = real(model, batch)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if weights is not None:
                weights[calls["n"]] = torch.cat([p.detach().flatten() for p in model.parameters()])
            fault = faults.get(calls["n"])
            if fault == "kill":
                raise KeyboardInterrupt
            if fault == "loss":
                loss = loss * float("nan")
            elif fault == "gradient":
                loss = _nan_grad(loss, model)
        return loss, n
    monkeypatch.setattr(demonstrations, "ce_sum", broken)


SKIP = {"on_nonfinite": "skip"}


@pytest.mark.parametrize("fault", ["loss", "gradient"])
def test_sft_skip_drops_the_update_counts_it_and_holds_the_schedule(fault, tiny_data, tmp_path, monkeypatch):
    weights: dict[int, torch.Tensor] = {}
    _sft_faults(monkeypatch, {3: fault}, weights)
    sft.run(_params(sft=SKIP), tiny_data, tmp_path, progress=False)
    rows = step_rows(tmp_path / "train.tsv")
    assert [int(r["skipped_updates"]) for r in rows] == [0, 0, 1, 1, 1, 1, 1, 1]
    assert torch.equal(weights[3], weights[4])              # step 3 changed nothing
    assert not torch.equal(weights[2], weights[3])          # the steps around it did
    assert not torch.equal(weights[4], weights[5])
    assert rows[3]["lr"] == rows[2]["lr"] != rows[1]["lr"]  # step 4 trains at the rate step 3 did not use
    assert rows[2]["grad_norm"] == "nan"                     # in the step log as it happened
    assert json.loads((tmp_path / "metrics.json").read_text())["train"]["skipped_updates"] == 1
    assert all(bool(torch.isfinite(t).all()) for t in load_file(tmp_path / "model/model.safetensors").values())


def test_sft_skip_stops_after_more_than_its_bound(tiny_data, tmp_path, monkeypatch):
    _sft_faults(monkeypatch, {3: "loss", 5: "gradient"})
    with pytest.raises(NumericalError, match=r"^sft step 5: 2 updates skipped for a NaN or infinite loss or gradient, "
                                             r"more than sft.max_skipped_updates \(1\); stopped, the last checkpoint is kept$"):
        sft.run(_params(sft={**SKIP, "max_skipped_updates": 1}), tiny_data, tmp_path, progress=False)
    assert json.loads((tmp_path / "checkpoint/state.json").read_text())["step"] == 4
    assert not (tmp_path / "model").exists()


def test_sft_skip_count_survives_a_resume(tiny_data, tmp_path, monkeypatch):
    """Killed after a skipped step and resumed: the count, the step log and the model are those of an
    uninterrupted run with the same fault."""
    _sft_faults(monkeypatch, {3: "loss"})
    sft.run(_params(sft=SKIP), tiny_data, tmp_path / "once", progress=False)
    _sft_faults(monkeypatch, {3: "loss", 6: "kill"})
    with pytest.raises(KeyboardInterrupt):
        sft.run(_params(sft=SKIP), tiny_data, tmp_path / "twice", progress=False)
    assert json.loads((tmp_path / "twice/checkpoint/state.json").read_text())["step"] == 4
    _sft_faults(monkeypatch, {})
    sft.run(_params(sft=SKIP), tiny_data, tmp_path / "twice", progress=False)
    assert step_rows(tmp_path / "twice/train.tsv") == step_rows(tmp_path / "once/train.tsv")
    assert (tmp_path / "twice/model/model.safetensors").read_bytes() == \
        (tmp_path / "once/model/model.safetensors").read_bytes()


def test_check_finite_names_where_and_what():
    errors.check_finite("x step 1", "loss", torch.tensor([1.0, 2.0]))
    with pytest.raises(NumericalError, match="^x step 9: advantages is NaN or infinite"):
        errors.check_finite("x step 9", "advantages", torch.tensor([1.0, float("-inf")]))


# ---- SIGKILL under dvc repro -------------------------------------------------------------------

# Enough steps that a kill lands inside each stage: sft 6 x 4 steps, reward 8 x 3, ppo 8 iterations.
LONGER = {"sft": {"epochs": 6.0, "eval_every": 4, "save_every": 4},
          "reward": {"epochs": 8.0, "eval_every": 4, "save_every": 4},
          "ppo": {"iterations": 8, "save_every": 2}}


def _repro_killed_at(repo: Path, stage: str, key: str, at: int, log: Path) -> str:
    """Start `dvc repro`, SIGKILL its whole process group once `stage`'s checkpoint holds `key` >= at;
    returns what it printed."""
    state = repo / f"outputs/{stage}/checkpoint/state.json"
    with open(log, "w") as out:
        proc = subprocess.Popen([str(BIN / "dvc"), "repro", "ppo"], cwd=repo, env=run_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 900
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                reached = json.loads(state.read_text())[key] >= at
            except (OSError, ValueError, KeyError):
                reached = False
            if reached:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return log.read_text()
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGKILL)
    raise AssertionError(f"{stage} ended before its checkpoint reached {key} {at}:\n{log.read_text()[-3000:]}")


def _final(repo: Path) -> dict:
    out = {}
    for stage in ("sft", "reward", "ppo"):
        out[stage] = without_time(flat(json.loads((repo / f"outputs/{stage}/metrics.json").read_text())))
        out[f"{stage}.tsv"] = step_rows(repo / f"outputs/{stage}/train.tsv")
    return out


@pytest.mark.long
def test_dvc_repro_after_sigkill_in_each_training_stage_resumes(tmp_path):
    params = merge(TINY, LONGER)
    whole = copy_repo(tmp_path / "whole")
    write_params(whole / "params.yaml", params)
    run([str(BIN / "dvc"), "repro", "ppo"], whole)

    killed = copy_repo(tmp_path / "killed")
    write_params(killed / "params.yaml", params)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    note = f"(kill points drawn with seed {seed})"
    done: list[str] = []
    for stage, key, points in (("sft", "step", [4, 8, 12, 16]), ("reward", "step", [4, 8, 12, 16]),
                               ("ppo", "iteration", [2, 4, 6])):
        at = rng.choice(points)
        printed = _repro_killed_at(killed, stage, key, at, tmp_path / f"{stage}.log")
        for earlier in done[:-1]:  # stages finished in an earlier round are not re-run
            assert f"Stage '{earlier}' didn't change, skipping" in printed, note + printed[-3000:]
        if done:                  # the killed stage of the previous round resumed
            assert f"{done[-1]}: resuming from" in printed, note + printed[-3000:]
        assert not (killed / f"outputs/{stage}/model").exists(), note   # killed inside the stage
        assert (killed / f"outputs/{stage}/checkpoint/state.json").is_file(), note
        done.append(stage)
    proc = run([str(BIN / "dvc"), "repro", "ppo"], killed)
    printed = proc.stdout + proc.stderr
    assert "Stage 'reward' didn't change, skipping" in printed and "ppo: resuming from" in printed, printed[-3000:]
    assert _final(killed) == _final(whole), note
    assert run([str(BIN / "dvc"), "status", "ppo"], killed).stdout.strip().endswith("up to date.")


@pytest.mark.parametrize("stage", ["sft", "reward"])
def test_resume_from_the_final_checkpoint_rewrites_every_output(stage, tiny_data, tiny_sft, tmp_path):
    """Killed after its last save (held-out evaluation, samples, calibration) and re-run, or re-run
    by `dvc repro -f`: DVC has removed the stage's outputs, the checkpoint says "done". The re-run
    trains no step and still writes every output, equal to the uninterrupted run's."""
    params = _params()
    out = tmp_path / stage
    go = (lambda: sft.run(params, tiny_data, out, progress=False)) if stage == "sft" else \
        (lambda: reward.run(params, tiny_data, tiny_sft, out, progress=False))
    first = go()
    files = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    weights = (out / "model/model.safetensors").read_bytes()
    assert {"train.tsv", "eval.tsv", "metrics.json", "config.json"} <= set(files)
    for p in out.iterdir():                              # what DVC removes before re-running a stage
        if p.name != "checkpoint":
            shutil.rmtree(p) if p.is_dir() else p.unlink()
    again = go()
    assert without_time(again) == without_time(first)
    assert (out / "model/model.safetensors").read_bytes() == weights
    for name, content in files.items():
        if name != "metrics.json":                       # its training seconds differ
            assert (out / name).read_bytes() == content, name


def _repro_killed_after(repo: Path, seconds: float | None, log: Path, when_exists: Path | None = None) -> bool:
    """Start `dvc repro` (the whole pipeline) and SIGKILL its process group after `seconds`, or as
    soon as `when_exists` appears; returns whether it was killed (False: it finished first)."""
    with open(log, "a") as out:
        proc = subprocess.Popen([str(BIN / "dvc"), "repro"], cwd=repo, env=run_env(), stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < 900:
            if (seconds is not None and time.monotonic() - t0 >= seconds) or \
                    (when_exists is not None and when_exists.exists()):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return True
            time.sleep(0.002)
        return False


@pytest.mark.long
def test_dvc_repro_killed_at_random_times_ends_identical(tmp_path, tiny_run):
    """SIGKILLs of a real `dvc repro` of the whole pipeline at random moments (not only at
    checkpoints), and once in the window between a stage's last write and DVC's lock update: the
    next `dvc repro` completes, with every model, metric and step log equal to an uninterrupted run
    (the shared run of the same params)."""
    tiny_run.same_threads()
    whole, duration = tiny_run.repo, tiny_run.seconds

    killed = copy_repo(tmp_path / "killed")
    write_params(killed / "params.yaml", TINY)
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    note = f"(kill times drawn with seed {seed}, a whole run took {duration:.0f} s)"
    log = tmp_path / "killed.log"
    # The stage wrote its last output (metrics.json comes last) and DVC has not recorded it yet.
    assert _repro_killed_after(killed, None, log, when_exists=killed / "outputs/sft/metrics.json"), note
    kills = [round(rng.uniform(0.5, duration), 2) for _ in range(4)]
    for at in kills:
        _repro_killed_after(killed, at, log)
    # A kill inside DVC's own rewrite of dvc.lock (in place, not atomic) leaves it cut short, and DVC
    # then refuses to run: `make pipeline` sets such a lock aside first. Cut it here, so that case is
    # tested every time rather than when a random kill lands in that window.
    lock = killed / "dvc.lock"
    if lock.exists():
        lines = lock.read_text().splitlines(keepends=True)
        lock.write_text("".join(lines[:rng.randrange(1, max(2, len(lines)))]))
    printed = run([str(BIN / "python"), "-m", "pipeline", "recover-lock"], killed).stdout
    assert not lock.exists() or printed.startswith("dvc.lock: ok"), printed
    proc = run([str(BIN / "dvc"), "repro"], killed)
    assert _final(killed) == _final(whole), note + f" kills at {kills} s\n" + proc.stdout[-2000:]
    evaluate = [without_time(flat(json.loads((repo / "outputs/evaluate/metrics.json").read_text())))
                for repo in (killed, whole)]
    assert evaluate[0] == evaluate[1], note
    for stage in ("sft", "reward", "ppo"):
        a = load_file(killed / f"outputs/{stage}/model/model.safetensors")
        b = load_file(whole / f"outputs/{stage}/model/model.safetensors")
        assert all(torch.equal(a[k], b[k]) for k in b), (stage, note)
    assert run([str(BIN / "dvc"), "status", "dvc.yaml"], killed).stdout.strip().endswith("up to date."), note


def test_a_code_change_never_resumes_a_checkpoint(tmp_path):
    """The fingerprint covers the code the stage imports: after an edit DVC re-runs the stage, and
    the finished run's checkpoint must not hand back the old code's model; unchanged code resumes
    (at the final step: nothing to train, every output rewritten)."""
    repo = copy_repo(tmp_path / "repo")
    write_params(repo / "params.yaml", TINY)
    sft_cmd = [sys.executable, "-m", "pipeline", "sft", "--params", "params.yaml", "--no-progress",
               "--data", "data/prepared", "--out", "outputs/sft"]
    run([sys.executable, "-m", "pipeline", "prepare", "--params", "params.yaml", "--out", "data/prepared"], repo)
    assert "resuming" not in (lambda p: p.stdout + p.stderr)(run(sft_cmd, repo))
    again = run(sft_cmd, repo)
    assert "sft: resuming from outputs/sft/checkpoint at step 4" in again.stdout + again.stderr
    with open(repo / "pipeline/training/batches.py", "a") as f:      # code SFT imports
        f.write("\n# an edit\n")
    edited = run(sft_cmd, repo)
    assert "resuming" not in edited.stdout + edited.stderr


def test_a_long_runs_state_is_read_whole(tmp_path):
    """state.json holds the step logs so far: a long run's is megabytes, and must resume, not be
    refused as an oversized record."""
    rows = [{"step": i, "loss": 1.0 / (i + 1), "lr": 1e-4, "grad_norm": 0.5} for i in range(40000)]
    (tmp_path / "state.json").write_text(json.dumps({"fingerprint": "f", "logs": {"train": {"rows": rows}}}))
    assert (tmp_path / "state.json").stat().st_size > 2 << 20
    assert len(resume.read_state(tmp_path, "f")["logs"]["train"]["rows"]) == 40000


def test_a_lock_cut_short_is_set_aside_never_deleted(tmp_path):
    """DVC refuses a truncated dvc.lock; recover-lock moves it to dvc.lock.corrupt, leaves a good
    one alone, and refuses to overwrite an earlier corrupt copy."""
    from pipeline.workflow import lockfile
    good = ("schema: '2.0'\nstages:\n  prepare:\n    cmd: bin/pipeline prepare\n    outs:\n    - path: data/prepared\n"
            "      hash: md5\n      md5: f250db13abbd2f016c7720e39edfa4ab.dir\n      size: 1\n      nfiles: 1\n")
    lock = tmp_path / "dvc.lock"
    lock.write_text(good)
    assert lockfile.problem(lock) is None and lockfile.recover(lock) == f"{lock}: ok"
    lock.write_text(good[:good.index("      hash")] + "      ha")      # cut inside a key, as a kill does
    assert lockfile.problem(lock) is not None
    assert "Moved to" in lockfile.recover(lock)
    assert not lock.exists() and (tmp_path / "dvc.lock.corrupt").read_text().endswith("      ha")
    lock.write_text("stages: [")                                       # cut YAML
    with pytest.raises(ConfigError, match="dvc.lock.corrupt .* is in the way"):
        lockfile.recover(lock)
    assert lock.exists()
