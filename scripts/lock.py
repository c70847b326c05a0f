"""Write the locks: one per part of the install, from the packages installed in this environment.

    .venv/bin/python scripts/lock.py            # make lock (after installing every extra)
    .venv/bin/python scripts/lock.py --check    # exit 1 when a lock differs from what it would write
    .venv/bin/python scripts/lock.py --resolve  # requirements-vllm.lock, resolved by uv (network)

`requirements.lock` pins what the pipeline itself needs (pyproject's `dependencies` and everything
they pull in); `requirements-<extra>.lock` pins what one optional extra adds on top of it (`dev`:
the tests; `bench`: TRL for the benchmarks). Each holds exact versions, as pip freeze names them,
of the packages reachable from its requirements through the installed packages' own metadata, so a
user who installs the pipeline alone is pinned to the same versions as the tests, and an extra's
packages never creep into the pipeline's lock. The installs pass the locks as constraints
(`pip install -c requirements.lock -c requirements-dev.lock -e '.[dev]'`).

The `vllm` extra cannot be installed here (its wheels need CUDA, its mistral-common Python 3.13)
and moves torch and transformers to older releases, so its lock is a whole environment of its own,
resolved for its platform by `uv pip compile` rather than read off this one:
`pip install -c requirements-vllm.lock -e '.[vllm]'` on Python 3.13.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
HEAD = ("# Exact versions of {what}.\n"
        "# pip constraints of 'make install', so that a fresh install is repeatable.\n"
        "# Written by scripts/lock.py ('make lock'); do not edit by hand.\n")
# The installer's own tools, which pip freeze leaves out too: the venv brings its own.
INSTALLER = {"pip", "setuptools", "wheel"}
# What one build of torch brings and another does not (the CUDA build's runtime libraries and its
# compiler): the build a user installs (scripts/venv.sh, TORCH=) picks them, the lock does not.
BUILD_SPECIFIC = re.compile(r"^(nvidia-.*|cuda-.*|triton)$")
# Extras resolved for another platform (Python version, uv's platform tag), each into a whole lock.
RESOLVED = {"vllm": ("3.13", "x86_64-manylinux_2_28")}
RESOLVED_HEAD = ("# Exact versions of a whole environment with the '{extra}' extra, on Python {python} ({platform}).\n"
                 "# pip constraints of `pip install -c requirements-{extra}.lock -e '.[{extra}]'`.\n"
                 "# Resolved by `uv pip compile` (scripts/lock.py --resolve); do not edit by hand.\n")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _applies(req: Requirement, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    env = default_environment()
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras or {""}))


def closure(roots: list[Requirement]) -> dict[str, str]:
    """canonical name -> installed version of every package `roots` reach through the installed
    packages' requirements (extras followed)."""
    seen: dict[str, str] = {}
    todo = [(r, set(r.extras)) for r in roots if _applies(r, set())]
    wanted_extras: dict[str, set[str]] = {}
    while todo:
        req, extras = todo.pop()
        name = canonical(req.name)
        if name in INSTALLER or BUILD_SPECIFIC.match(name):
            continue
        known = wanted_extras.setdefault(name, set())
        if name in seen and extras <= known:
            continue
        known |= extras
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            sys.exit(f"lock: {req.name} is required but not installed here (make install first, with every extra)")
        seen[name] = dist.version
        for text in dist.requires or []:
            sub = Requirement(text)
            if _applies(sub, known):
                todo.append((sub, set(sub.extras)))
    return seen


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def extras() -> list[str]:
    """The extras whose lock is read off this environment (every extra but the resolved ones)."""
    return sorted(set(_project().get("optional-dependencies", {})) - set(RESOLVED))


def locks(only: list[str] | None = None) -> dict[str, str]:
    """File name -> text of the pipeline's lock and of each extra's (`only` these extras)."""
    project = _project()
    core = closure([Requirement(r) for r in project["dependencies"]])
    out = {"requirements.lock": _text("every package the pipeline needs", core)}
    for extra, reqs in sorted(project.get("optional-dependencies", {}).items()):
        if extra in RESOLVED or (only is not None and extra not in only):
            continue
        added = {k: v for k, v in closure([Requirement(r) for r in reqs]).items() if k not in core}
        out[f"requirements-{extra}.lock"] = _text(f"what the '{extra}' extra adds to requirements.lock", added)
    return out


def _text(what: str, pins: dict[str, str]) -> str:
    # A local version tag (torch's +cpu, +cu130) names a build, not a release: the lock pins the
    # release, and the install picks the build (scripts/venv.sh, TORCH=).
    lines = [f"{md.distribution(name).metadata['Name']}=={version.split('+')[0]}" for name, version in pins.items()]
    return HEAD.format(what=what) + "".join(f"{line}\n" for line in sorted(lines, key=str.lower))


def resolve(extra: str) -> str:
    """The text of requirements-<extra>.lock: pyproject's dependencies with `extra`, resolved by uv
    for RESOLVED[extra]'s Python and platform (it reads the wheels' metadata from the index)."""
    python, platform = RESOLVED[extra]
    cmd = [sys.executable, "-m", "uv", "pip", "compile", "pyproject.toml", "--extra", extra, "--python-version", python,
           "--python-platform", platform, "--no-header", "--no-annotate", "--quiet"]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    except FileNotFoundError:
        sys.exit(f"lock: {sys.executable} does not run")
    if proc.returncode != 0:
        if "No module named uv" in proc.stderr:
            sys.exit("lock: --resolve needs uv in this environment (pip install uv)")
        sys.exit(f"lock: uv could not resolve the '{extra}' extra for Python {python}:\n{proc.stderr.strip()}")
    lines = sorted((line for line in proc.stdout.splitlines() if line and not line.startswith(("#", "-e"))),
                   key=str.lower)
    return RESOLVED_HEAD.format(extra=extra, python=python, platform=platform) + "".join(f"{line}\n" for line in lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed locks; write nothing")
    ap.add_argument("--extras", nargs="*", default=None, help="only these extras' locks (default: every extra)")
    ap.add_argument("--resolve", action="store_true",
                    help=f"write the locks of the extras resolved for another platform ({', '.join(RESOLVED)}) with uv")
    args = ap.parse_args()
    stale = []
    written = {f"requirements-{e}.lock": resolve(e) for e in RESOLVED} if args.resolve else locks(args.extras)
    for name, text in written.items():
        path = ROOT / name
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(name)
            continue
        tmp = path.with_suffix(".lock.tmp")
        tmp.write_text(text)
        tmp.replace(path)
        print(f"lock: wrote {name} ({text.count(chr(10)) - HEAD.count(chr(10))} packages)")
    if stale:
        print(f"lock: {', '.join(stale)} differ from this environment (make lock)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
