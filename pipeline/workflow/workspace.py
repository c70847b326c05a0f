"""One workflow engine at a time in a workspace.

DVC guards a workspace with two locks in `.dvc/tmp`: `lock` (an exclusive `flock`), held by `dvc
repro` while it plans and between stages, and `rwlock` (a JSON file of the paths each running DVC
command reads and writes, with its pid), held while a stage's command runs. A second DVC command
refuses to start on either. Snakemake locks only the outputs it is about to write, and neither
engine knows the other: beside `dvc repro`, Snakemake would rebuild the stages DVC is building, and
DVC would delete outputs (it removes a stage's outs before running it) that a Snakemake job is
reading. So the Snakefile's `onstart` calls `hold`: it refuses to start while a DVC command holds
either lock, and otherwise keeps DVC's `lock` for the length of the Snakemake run, so that DVC
refuses to start beside it. A training stage also holds its own folder (pipeline/files.py
`exclusive`), which covers a stage command run by hand.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import BusyError, shown
from ..files import writing

_held: list[int] = []   # the open lock of this process: closing it (or exiting) releases the lock


def dvc_lock(root: Path) -> Path:
    return root / ".dvc" / "tmp" / "lock"


def hold(root: Path) -> None:
    """Take DVC's repository lock of the workspace at `root` for the rest of this process; a
    BusyError when a DVC command (or another Snakemake) holds it or runs a stage."""
    import fcntl

    path = dvc_lock(root)
    with writing(path, "lock file"):
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise BusyError(f"{path}: DVC or another Snakemake is running in this workspace (it holds this lock); "
                        "wait for it to end, then run Snakemake again") from None
    running = dvc_commands(path.with_name("rwlock"))
    if running:
        os.close(fd)   # at once: the DVC command takes this lock again after its stage
        raise BusyError(f"{path.with_name('rwlock')}: DVC is running in this workspace "
                        f"({shown(running[0], 160, keep_end=True)}); "
                        "wait for it to end, then run Snakemake again")
    _held.append(fd)


def dvc_commands(rwlock: Path) -> list[str]:
    """`<cmd> (pid N)` of the live processes DVC's rwlock file lists (a stage's command runs under
    them), the program named by its file name (DVC records the path it was started by, as long as
    the user's checkout path, which would push what the user needs out of a quoted message);
    entries of dead processes, which DVC itself ignores, are left out."""
    try:
        doc = json.loads(rwlock.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    infos = [*(doc.get("write") or {}).values(), *(i for v in (doc.get("read") or {}).values() for i in v)]
    live = []
    for info in infos:
        try:
            os.kill(int(info["pid"]), 0)
        except ProcessLookupError:
            continue
        except (PermissionError, KeyError, TypeError, ValueError):
            pass
        program, _, args = str(info.get("cmd", "?")).partition(" ")
        cmd = " ".join(filter(None, (os.path.basename(program), args)))
        live.append(f"{cmd} (pid {info.get('pid', '?')})")
    return sorted(set(live))
