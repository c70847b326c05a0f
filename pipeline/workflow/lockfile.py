"""A dvc.lock cut short by a kill, set aside so the next `dvc repro` can run.

DVC rewrites dvc.lock in place (open for writing, then dump: dvc/utils/serialize/_common.py), so a
kill during that write leaves a truncated file, and every later `dvc` command stops with "dvc.lock
validation failed". Nothing computed is lost: the outputs are in place, and each training stage's
resumable checkpoint (pipeline/training/resume.py) holds its finished run. `recover` moves such a
lock to `dvc.lock.corrupt` (it never deletes one), after which `dvc repro` runs every stage again:
prepare rewrites the same bytes, the training stages resume at their final step and retrain
nothing, and evaluate runs. `make pipeline` calls it before `dvc repro`.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import ConfigError


def problem(lock: Path) -> str | None:
    """Why DVC would refuse `lock` (None when it reads it, or when there is none)."""
    if not lock.exists():
        return None
    from dvc.schema import COMPILED_LOCKFILE_SCHEMA
    from ruamel.yaml import YAML
    from voluptuous import Invalid
    try:
        data = YAML(typ="safe", pure=True).load(lock.read_text(encoding="utf-8"))
        COMPILED_LOCKFILE_SCHEMA(data or {})
    except Invalid as err:
        return f"does not match DVC's lock schema ({err})"
    except Exception as err:           # noqa: BLE001 -- any parse failure: YAML, encoding, a cut line
        return f"is not readable YAML ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"
    return None


def recover(lock: Path) -> str:
    """Set aside an unreadable `lock`; the line to print."""
    why = problem(lock)
    if why is None:
        return f"{lock}: ok" if lock.exists() else f"{lock}: none yet"
    aside = lock.with_name(lock.name + ".corrupt")
    if aside.exists():
        raise ConfigError(f"{lock} {why}, and {aside} (set aside before) is in the way: look at both, "
                          f"then delete {aside}")
    os.replace(lock, aside)
    return (f"{lock} {why}: most likely a kill while DVC rewrote it. Moved to {aside}; the next dvc repro "
            f"re-runs every stage (training stages resume at their last checkpoint)")
