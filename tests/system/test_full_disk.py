"""A full disk loses nothing. ENOSPC while a stage writes its checkpoint, its model, a step log or its
metrics is one error naming the path and the cause; the temporary files are removed; the outputs of
the run before are byte for byte as they were, and so is its checkpoint unless the failing run had
already saved a complete one of its own (which a re-run then resumes). Fault injection runs
anywhere; the `root` tier repeats it on a real small tmpfs through the CLI, and fills MLflow's
artifact store."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, TINY, merge, run_env, tier_unavailable, tiny_params, write_params
from pipeline import files
from pipeline.config import Params
from pipeline.errors import StorageError
from pipeline.stages import skeleton, sft

ENOSPC = os.strerror(errno.ENOSPC)   # "No space left on device"


def _params(seed: int = 0) -> Params:
    return tiny_params({"sft": {"epochs": 2.0, "save_every": 2, "seed": seed}})


@pytest.fixture(scope="module")
def finished(tiny_data, tmp_path_factory) -> Path:
    """A finished SFT run's folder (seed 0): what every test's failing re-run must leave alone."""
    out = tmp_path_factory.mktemp("finished") / "sft"
    sft.run(_params(), tiny_data, out, progress=False)
    return out


def _snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, hidden ones included, by relative name (not the lock
    file, which names the last run that held the folder)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != files.LOCK}


def _outputs(snapshot: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in snapshot.items() if not k.startswith("checkpoint/")}


def _leftovers(folder: Path) -> list[str]:
    """Temporary names a writer makes (`.x.tmp`, `.checkpoint.staging`, `.pending`, `.model.old`)."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*") if p.name != files.LOCK)


def _fsync_fails_for(monkeypatch, name: str) -> None:
    """The disk fills while the file whose final name is `name` is written (its temporary file is
    named `.<name>.<random>.tmp`): fsync of it fails with ENOSPC, as a full disk reports a write
    whose blocks cannot be allocated."""
    real = os.fsync

    def fsync(fd):
        target = os.readlink(f"/proc/self/fd/{fd}")
        if Path(target).name.startswith(f".{name}."):
            raise OSError(errno.ENOSPC, ENOSPC)
        return real(fd)
    monkeypatch.setattr(os, "fsync", fsync)


def _torch_save_fails(monkeypatch) -> None:
    """torch.save on a full disk: half a file, then torch's own error, which names neither the
    cause nor the path (what torch 2.x raises), while the file system has no space left."""
    import torch

    def save(obj, f, *args, **kwargs):
        Path(f).write_bytes(b"\0" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    monkeypatch.setattr(torch, "save", save)
    monkeypatch.setattr(files.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 30, 1 << 30, 0))


def _model_fails(monkeypatch) -> None:
    """safetensors on a full disk: the files half written, then its own error."""
    real = skeleton.save_checkpoint

    def save(model, tok, out):
        real(model, tok, out)
        raise Exception("Error while serializing: I/O error: No space left on device (os error 28)")
    monkeypatch.setattr(skeleton, "save_checkpoint", save)


# (where the disk fills, how, the file the error names, whether the failing run saved a checkpoint first)
FAULTS = {
    "checkpoint": (_torch_save_fails, "checkpoint", False),
    "step_log": (lambda mp: _fsync_fails_for(mp, "train.tsv"), "train.tsv", False),
    "model": (_model_fails, "model", True),
    "metrics": (lambda mp: _fsync_fails_for(mp, "metrics.json"), "metrics.json", True),
}


@pytest.mark.parametrize("fault", FAULTS)
def test_a_full_disk_fails_in_one_line_and_leaves_the_earlier_run_as_it_was(fault, tiny_data, finished, tmp_path,
                                                                            monkeypatch):
    inject, named, saved_first = FAULTS[fault]
    folder = shutil.copytree(finished, tmp_path / "sft")
    before = _snapshot(folder)
    inject(monkeypatch)
    with pytest.raises(StorageError) as err:
        sft.run(_params(seed=1), tiny_data, folder, progress=False)   # another seed: another run
    monkeypatch.undo()
    message = str(err.value)
    assert "\n" not in message and named in message and ENOSPC in message, message
    assert _leftovers(folder) == []
    after = _snapshot(folder)
    assert _outputs(after) == _outputs(before)          # the earlier run's outputs, byte for byte
    state = json.loads((folder / "checkpoint/state.json").read_text())
    if saved_first:   # the failing run's own last complete checkpoint: its re-run resumes from it
        assert state["step"] == 8 and after != before
        again = sft.run(_params(seed=1), tiny_data, folder, progress=False)
        assert again["train/steps"] == 8 and _leftovers(folder) == []
        assert _outputs(_snapshot(folder)) != _outputs(before)
    else:             # it failed before its first checkpoint: the earlier one is untouched too
        assert after == before


def test_a_full_disk_on_a_first_run_leaves_no_partial_files(tiny_data, tmp_path, monkeypatch):
    _torch_save_fails(monkeypatch)
    with pytest.raises(StorageError, match=rf"checkpoint: cannot write the checkpoint: {ENOSPC} \(.*unexpected pos"):
        sft.run(_params(), tiny_data, tmp_path / "sft", progress=False)
    assert sorted(p.name for p in (tmp_path / "sft").iterdir()) == [files.LOCK]


def test_a_writer_error_on_a_disk_with_room_is_a_bug_and_keeps_its_traceback(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug in a writer")
    monkeypatch.setattr(os, "fdopen", broken)
    with pytest.raises(RuntimeError, match="a bug in a writer"):
        files.atomic_write_text(tmp_path / "x.txt", "x")
    assert list(tmp_path.iterdir()) == []


# ---- root tier: a real small tmpfs ----------------------------------------------------------------


@pytest.fixture
def tmpfs(tmp_path):
    """A folder on a fresh tmpfs (root, CAP_SYS_ADMIN); unmounted after the test. `size(n)`
    remounts it with n bytes."""
    mount = tmp_path / "disk"
    mount.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mount)], capture_output=True, text=True)
    if proc.returncode != 0:
        tier_unavailable("root", f"root tier: cannot mount a tmpfs here ({proc.stderr.strip()})")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(mount: Path, leave: int) -> None:
    """Fill the tmpfs until `leave` bytes are free."""
    free = shutil.disk_usage(mount).free
    with open(mount / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


def _cli(tmp_path: Path, out: Path, tiny_data: Path, seed: int) -> subprocess.CompletedProcess:
    params = tmp_path / f"params{seed}.yaml"
    write_params(params, merge(TINY, {"sft": {"epochs": 2.0, "save_every": 2, "seed": seed}}))
    return subprocess.run([sys.executable, "-m", "pipeline", "sft", "--params", str(params), "--data", str(tiny_data),
                           "--out", str(out), "--no-progress"], cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=600)


@pytest.mark.root
def test_on_a_real_full_tmpfs_the_cli_fails_in_one_line_and_keeps_the_earlier_run(tiny_data, tmpfs, tmp_path):
    out = tmpfs / "sft"
    # 1. A first run on a disk too small for its checkpoint: one line, exit 2, nothing left behind.
    _fill(tmpfs, 200_000)
    proc = _cli(tmp_path, out, tiny_data, seed=0)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {out}") and ENOSPC in lines[0], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and _leftovers(out) == [] and [p.name for p in out.iterdir()] == [files.LOCK]
    # 2. Room for one run: it finishes. Then the disk fills and a re-run with another seed fails.
    (tmpfs / "filler").unlink()
    assert _cli(tmp_path, out, tiny_data, seed=0).returncode == 0
    before = _snapshot(out)
    _fill(tmpfs, 200_000)
    proc = _cli(tmp_path, out, tiny_data, seed=1)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and ENOSPC in lines[0], proc.stderr[-2000:]
    assert _leftovers(out) == [] and _snapshot(out) == before


@pytest.mark.root
def test_a_full_mlflow_artifact_store_is_one_warning_and_the_stage_files_are_intact(tiny_data, tmpfs, tmp_path,
                                                                                      monkeypatch):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    MlflowClient(uri).create_experiment("full", artifact_location=(tmpfs / "artifacts").as_uri())
    _fill(tmpfs, 20_000)
    env = {**run_env(), "PIPELINE_TRACKING": "on", "MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": "full"}
    params = tmp_path / "params.yaml"
    write_params(params, TINY)
    out = tmp_path / "sft"
    proc = subprocess.run([sys.executable, "-m", "pipeline", "sft", "--params", str(params), "--data", str(tiny_data),
                           "--out", str(out), "--no-progress"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [line for line in proc.stderr.splitlines() if "MLflow" in line and "failed" in line]
    assert len(warnings) == 1 and ENOSPC in warnings[0], proc.stderr[-3000:]
    assert {"model", "train.tsv", "eval.tsv", "config.json", "metrics.json"} <= {p.name for p in out.iterdir()}
    assert json.loads((out / "metrics.json").read_text())["train"]["steps"] == 4
    assert _leftovers(out) == []
