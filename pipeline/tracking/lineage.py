"""What joins a stage's run to its code, data and process: the git commit and DVC's context
(`join_tags`), the DVC project and the repository root, the hash of a stage's deps as DVC records
them (or of its inputs when DVC is not running it), and the key of the process that ran it. The
MLflow integration (mlflow_sink.py) tags its runs with these; nothing here talks to MLflow."""

from __future__ import annotations

import getpass
import hashlib
import logging
import os
import socket
import subprocess
from pathlib import Path
from typing import Sequence

from ..files import content_hash

log = logging.getLogger(__name__)


def dvc_project(start: Path | None = None) -> Path | None:
    """The nearest folder at or above `start` (default: the cwd) that holds dvc.yaml."""
    start = (start or Path.cwd()).resolve()
    return next((d for d in (start, *start.parents) if (d / "dvc.yaml").is_file()), None)


def repo_root() -> Path:
    """DVC_ROOT when set: DVC sets it for every stage command, and `dvc exp run --temp` / queued
    runs point it at the workspace rather than their temporary copy
    (dvc/repo/experiments/queue/base.py), so all of them share one database. Else the nearest
    folder above the cwd with dvc.yaml; else the cwd."""
    if os.environ.get("DVC_ROOT"):
        return Path(os.environ["DVC_ROOT"]).resolve()
    return dvc_project() or Path.cwd().resolve()


def git_commit() -> str | None:
    """HEAD of the git repository the cwd is in, if any."""
    try:
        proc = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


def join_tags() -> dict[str, str]:
    try:
        tags = {"mlflow.user": getpass.getuser()}
    except (KeyError, OSError):         # no login name and no passwd entry, as in some containers
        tags = {"mlflow.user": "unknown"}
    commit = git_commit()
    if commit:
        tags.update({"git_commit": commit, "mlflow.source.git.commit": commit})
    for tag, env in (("dvc_exp_name", "DVC_EXP_NAME"), ("dvc_exp_baseline_rev", "DVC_EXP_BASELINE_REV")):
        if os.environ.get(env):
            tags[tag] = os.environ[env]
    return tags


def process_key(pid: int | None = None) -> str:
    """`host:pid:start time` of a process (default: this one)."""
    import psutil
    proc = psutil.Process(pid)
    return f"{socket.gethostname()}:{proc.pid}:{proc.create_time():.3f}"


def process_alive(key: str) -> bool | None:
    """Whether the process of a `process_key` still runs; None when it ran on another host."""
    import psutil
    host, pid, created = (key.rsplit(":", 2) + ["", ""])[:3]
    if host != socket.gethostname():
        return None
    try:
        return abs(psutil.Process(int(pid)).create_time() - float(created)) < 0.01
    except (psutil.Error, ValueError):
        return False


def execution_key() -> str | None:
    """`host:pid:start time` of the nearest `dvc repro` / `dvc exp ...` process above this one.
    DVC runs every stage of one execution as a child of that process, so the stages share the key;
    the start time keeps a reused pid from joining an old execution."""
    import psutil
    try:
        parents = psutil.Process().parents()
    except psutil.Error:
        return None
    for proc in parents:
        try:
            args = proc.cmdline()
            if "dvc" in map(os.path.basename, args) and {"repro", "exp"} & set(args):
                return process_key(proc.pid)
        except psutil.Error:            # a process that ended or that we may not inspect
            continue
    return None


def deps_hash(stage: str, inputs: Sequence[Path], dvc_deps: list[tuple[str, str]] | None = None) -> tuple[str, str]:
    """(hash, source) of what the stage reads. When DVC runs this stage (env DVC_STAGE names it):
    sha256 over the stage's `deps` paths and their hashes as DVC computes them for this run, i.e.
    the value `lock_deps_hash` gives for the dvc.lock DVC writes when the stage ends. dvc.lock
    can't be read instead: DVC rewrites a stage's entry only after its command exits, so during the
    run it still describes the previous run. Otherwise (a stage run by hand, tests): sha256 over
    the contents of the caller's input paths. `dvc_deps`: `dvc_deps_of(stage)` when the caller has it."""
    deps = dvc_deps_of(stage) if dvc_deps is None else dvc_deps
    return (_digest(deps), "dvc") if deps else (inputs_hash(inputs), "inputs")


def dvc_deps_of(stage: str) -> list[tuple[str, str]]:
    """`_dvc_deps` of `stage` when DVC is running it (env DVC_STAGE names it), else []."""
    addressing = os.environ.get("DVC_STAGE", "")
    if addressing.rpartition(":")[2] != stage:
        return []
    try:
        return _dvc_deps(addressing)
    except Exception as err:           # noqa: BLE001 -- DVC internals; the callers fall back to sha256
        log.info("DVC could not hash the deps of %s (%s); hashing the inputs", addressing, err)
        return []


def _dvc_deps(addressing: str) -> list[tuple[str, str]]:
    """(path, hash) of each path dependency of the stage, from DVC's own hashing of the repository
    the stage runs in (a temporary copy under `dvc exp run --temp`). DVC hashed them just before
    starting the stage, so its state cache answers without rereading the files."""
    from dvc.dependency.param import ParamsDependency
    from dvc.repo import Repo
    root = dvc_project()
    if root is None:
        raise FileNotFoundError("no dvc.yaml at or above the cwd")
    file, _, name = addressing.rpartition(":")
    with Repo(str(root)) as repo:
        (stage,) = repo.stage.collect(f"{root / (file or 'dvc.yaml')}:{name}")
        deps = [(d.def_path, d.get_hash().value) for d in stage.deps if not isinstance(d, ParamsDependency)]
    missing = [path for path, value in deps if value is None]
    if missing:
        raise FileNotFoundError(f"missing dependencies {missing}")
    return deps


def lock_deps_hash(lock: Path, stage: str) -> str | None:
    """The `deps_hash` of `stage` from a dvc.lock written after its run; None if it isn't listed."""
    from ruamel.yaml import YAML
    entry = ((YAML(typ="safe", pure=True).load(Path(lock).read_text()) or {}).get("stages") or {}).get(stage)
    return _digest([(d["path"], d.get("md5")) for d in entry.get("deps", [])]) if entry else None


def _digest(deps: list[tuple[str, str]]) -> str:
    return hashlib.sha256("".join(f"{path}\t{value}\n" for path, value in sorted(deps)).encode()).hexdigest()


def inputs_hash(paths: Sequence[Path]) -> str:
    """sha256 over the files under each path (files.content_hash)."""
    return content_hash(paths)


# ---- The MLflow tracker -----------------------------------------------------------------------------
