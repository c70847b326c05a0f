"""Two runs, one workspace. A second `dvc repro`, Snakemake beside DVC (either way round), a second
Snakemake, or a stage command run by hand on a folder a stage is writing: each is refused in one
line while the first run goes on, and the first run ends with the models of an undisturbed run.
(Two queued experiments at once: tests/system/test_tracking_runs.py, against the experiments run one by one.)"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from ruamel.yaml import YAML

from conftest import BIN, TINY, TinyRun, copy_run, run, run_env, wait_for
from pipeline import files
from pipeline.config import DataConfig, Params, from_dict
from pipeline.errors import BusyError
from pipeline.stages import sft
from pipeline.stages.prepare import write as prepare_run


def test_a_second_run_on_a_folder_a_run_holds_is_refused_and_changes_nothing(tmp_path):
    prepare_run(from_dict(DataConfig, TINY["data"], "params.yaml: "), tmp_path / "data")
    params = from_dict(Params, {k: v for k, v in TINY.items() if k != "data"}, "params.yaml: ")
    out = tmp_path / "sft"
    sft.run(params, tmp_path / "data", out, progress=False)
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != files.LOCK}
    with files.exclusive(out, "sft"):   # another run holds the folder (the lock is per open file)
        with pytest.raises(BusyError, match=rf"^{out}: another run of a stage is writing this folder \(sft, pid "
                                            rf"{os.getpid()} on .*\); wait for it to end, or give this sft run another --out$"):
            sft.run(params, tmp_path / "data", out, progress=False)
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file() and p.name != files.LOCK} == before
    sft.run(params, tmp_path / "data", out, progress=False)   # released: the next run goes


def _held_at_first_step(tmp_path: Path) -> tuple[Path, Path]:
    """A sitecustomize (seen only by the stage processes) that holds the first supervised step
    until `release` exists, after touching `in_loop`: the other commands then certainly meet a run
    in progress. Returns (folder for PYTHONPATH, release file)."""
    hook = tmp_path / "hold"
    hook.mkdir()
    release = hook / "release"
    (hook / "sitecustomize.py").write_text(
        "import pathlib, time\n"
        "from pipeline.training import supervised\n"
        "real = supervised.check_finite\n"
        "def held(at, name, value):\n"
        f"    if name == 'loss' and not pathlib.Path({str(release)!r}).exists():\n"
        f"        pathlib.Path({str(hook / 'in_loop')!r}).touch()\n"
        "        end = time.time() + 600\n"
        f"        while not pathlib.Path({str(release)!r}).exists() and time.time() < end:\n"
        "            time.sleep(0.1)\n"
        "    return real(at, name, value)\n"
        "supervised.check_finite = held\n")
    return hook, release


def _md5(folder: Path) -> str:
    return hashlib.md5((folder / "model.safetensors").read_bytes()).hexdigest()


def _locked_md5(repo: Path, stage: str) -> str:
    """The md5 dvc.lock records for the stage's model folder."""
    lock = YAML(typ="safe", pure=True).load((repo / "dvc.lock").read_text())
    (out,) = [o for o in lock["stages"][stage]["outs"] if o["path"] == f"outputs/{stage}/model"]
    return out["md5"]


def _one_line_error(proc: subprocess.CompletedProcess, text: str) -> None:
    printed = proc.stdout + proc.stderr
    assert proc.returncode != 0 and text in printed and "Traceback" not in printed, printed[-3000:]


@pytest.mark.long
@pytest.mark.parametrize("first", ["dvc", "snakemake"])
def test_dvc_and_snakemake_refuse_to_run_beside_each_other_and_the_first_run_is_undisturbed(
        first, tiny_run: TinyRun, tmp_path):
    tiny_run.same_threads()
    repo = copy_run(tiny_run, tmp_path / "repo")
    shutil.rmtree(repo / "outputs/sft/checkpoint")   # so the re-run trains (and meets the hold)
    hook, release = _held_at_first_step(tmp_path)
    env = {**run_env(), "PYTHONPATH": f"{hook}{os.pathsep}{repo}"}
    dvc, snakemake = str(BIN / "dvc"), str(BIN / "snakemake")
    # The first run re-trains SFT (its params and inputs unchanged) while the others try.
    cmd = [dvc, "repro", "-f", "-s", "sft"] if first == "dvc" else \
        [snakemake, "--profile", "profiles/local", "--forcerun", "sft", "--until", "sft"]
    proc = subprocess.Popen(cmd, cwd=repo, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(hook / "in_loop", proc)
        # A second dvc repro: refused by DVC's locks (its rwlock while DVC runs a stage; its repository
        # lock, which Snakemake's onstart holds, while Snakemake runs).
        _one_line_error(run([dvc, "repro"], repo, check=False),
                        "is busy, it is being blocked by" if first == "dvc" else "Unable to acquire lock")
        # Snakemake: refused by DVC's running command when DVC leads; by its own lock when Snakemake does.
        again = run([snakemake, "--profile", "profiles/local", "--forcerun", "sft", "--until", "sft"], repo, check=False)
        _one_line_error(again, "error: .dvc/tmp/rwlock: DVC is running in this workspace (" if first == "dvc"
                        else "cannot be locked")
        assert first != "dvc" or "repro -f -s sft (pid " in again.stdout + again.stderr
        # The stage by hand on the folder the first run is writing: refused by the folder's lock.
        hand = run([sys.executable, "-m", "pipeline", "sft", "--params", "params.yaml", "--data", "data/prepared",
                    "--out", "outputs/sft", "--no-progress"], repo, check=False)
        assert hand.returncode == 2 and hand.stderr.strip().splitlines() == [
            f"error: outputs/sft: another run of a stage is writing this folder (sft, pid {_holder(repo)}); "
            "wait for it to end, or give this sft run another --out"], hand.stderr[-3000:]
    finally:
        release.touch()
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, (out + err)[-3000:]
    # The undisturbed run's model, byte for byte (the same threads as the shared run's).
    assert _md5(repo / "outputs/sft/model") == _md5(tiny_run.repo / "outputs/sft/model")
    if first == "dvc":
        assert _locked_md5(repo, "sft") == _locked_md5(tiny_run.repo, "sft")


def _holder(repo: Path) -> str:
    """`<pid> on <host>` as the folder's lock file names the run holding it."""
    return (repo / "outputs/sft" / files.LOCK).read_text().strip().split("pid ", 1)[1]


def test_the_refusal_names_the_running_dvc_command_whatever_the_checkout_path(tmp_path):
    """DVC's rwlock records the command by the path it was started with, as long as the user's
    checkout path: the refusal names the program by its file name, so the part the user needs
    (`repro -f -s sft`, its pid) is never cut off the quoted message."""
    import json

    from pipeline.workflow import workspace
    long = "/home/a-user-with-a-long-name/projects/rlhf-experiments-2026/a-checkout-of-the-pipeline"
    rwlock = tmp_path / ".dvc" / "tmp" / "rwlock"
    rwlock.parent.mkdir(parents=True)
    rwlock.write_text(json.dumps({"write": {"outputs/sft": {"pid": os.getpid(), "cmd": f"{long}/.venv/bin/dvc repro -f -s sft"}},
                                  "read": {"data": [{"pid": os.getpid(), "cmd": "dvc"}]}}))
    assert workspace.dvc_commands(rwlock) == [f"dvc (pid {os.getpid()})", f"dvc repro -f -s sft (pid {os.getpid()})"]
    rwlock.write_text(json.dumps({"write": {"outputs/sft": {"pid": os.getpid(), "cmd": f"{long}/.venv/bin/dvc repro -f -s sft"}}}))
    with pytest.raises(BusyError) as err:
        workspace.hold(tmp_path)
    assert str(err.value).endswith(f": DVC is running in this workspace (dvc repro -f -s sft (pid {os.getpid()})); "
                                   "wait for it to end, then run Snakemake again")
    # Started as `python .../dvc`: the long path is an argument; its middle goes, the command's end stays.
    deeper = f"{long}/worktrees/an-experiment-branch-with-a-descriptive-name"
    started = f"{deeper}/.venv/bin/python {deeper}/.venv/bin/dvc repro -f -s sft"
    rwlock.write_text(json.dumps({"write": {"outputs/sft": {"pid": os.getpid(), "cmd": started}}}))
    with pytest.raises(BusyError) as err:
        workspace.hold(tmp_path)
    quoted = str(err.value).split("DVC is running in this workspace (", 1)[1]
    assert quoted.startswith("python /home/a-user") and "..." in quoted
    assert quoted.endswith(f".venv/bin/dvc repro -f -s sft (pid {os.getpid()})); "
                           "wait for it to end, then run Snakemake again")
