"""The project's set-up as a stranger meets it: declared imports, licence, the venv script's
choices of Python and torch build."""

from __future__ import annotations

import ast
import importlib.metadata as md
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from conftest import REPO, load_script

# This project's own modules: the package, the tests' shared fixtures and helpers (imported by their bare
# names: tests/conftest.py), and the scripts and benchmarks that import each other.
LOCAL = {"pipeline", "conftest", "benchmarks",   # and the scripts, benchmarks and test helpers, imported by file name
         *(p.stem for folder in ("scripts", "benchmarks", "tests/helpers") for p in (REPO / folder).glob("*.py"))}
# Modules of an optional extra that the pipeline imports lazily: the extra, and the one module that
# imports it, inside a function (checked below), so that nothing else needs the extra installed.
# vLLM (the experimental rollout engine) cannot be installed here: its wheels need CUDA.
LAZY = {"vllm": ("vllm", "pipeline/models/vllm_engine.py")}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _declared() -> dict[str, set[str]]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    groups = {"dependencies": project["dependencies"], **project["optional-dependencies"]}
    return {g: {_norm(re.split(r"[=<>!~\[ ;]", d, maxsplit=1)[0]) for d in deps} for g, deps in groups.items()}


def _imports_in(tree: ast.AST) -> set[str]:
    """The top-level names of the absolute imports anywhere in `tree`."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found


def _imports_of(path: Path) -> set[str]:
    return _imports_in(ast.parse(path.read_text()))


def _imports(folder: str) -> set[str]:
    found = set().union(*(_imports_of(path) for path in (REPO / folder).rglob("*.py")))
    return found - LOCAL - set(sys.stdlib_module_names)


def test_every_import_is_declared_in_the_group_that_needs_it():
    """pipeline/ and scripts/ import only the dependencies; tests/ also the dev extra; benchmarks/
    also the bench extra. A module's distribution is what this environment says provides it."""
    provides = md.packages_distributions()
    declared = _declared()
    groups = {"pipeline": {"dependencies"}, "scripts": {"dependencies"}, "tests": {"dependencies", "dev"},
              "benchmarks": {"dependencies", "dev", "bench"}}
    missing = []
    for folder, allowed in groups.items():
        names = set().union(*(declared[g] for g in allowed))
        for module in sorted(_imports(folder)):
            dists = {_norm(d) for d in provides.get(module, [module])}
            if not dists & names and not (module in LAZY and dists & declared[LAZY[module][0]]):
                missing.append(f"{folder}: import {module} (from {', '.join(sorted(dists))})")
    assert missing == []
    for module, (_, where) in LAZY.items():
        importers = {str(p.relative_to(REPO)) for p in (REPO / "pipeline").rglob("*.py") if module in _imports_of(p)}
        assert importers == {where}, importers
        top = ast.parse((REPO / where).read_text()).body
        assert not any(module in _imports_in(node) for node in top if not isinstance(node, (ast.FunctionDef, ast.ClassDef))), \
            f"{where} imports {module} at module level"


def test_every_direct_dependency_is_imported_or_used_by_a_command():
    """A dependency nothing imports is dead weight, except the commands the project runs (dvc,
    snakemake and its SLURM plugin, gto) and what transformers and torch load by name."""
    provides = md.packages_distributions()
    used = {_norm(d) for folder in ("pipeline", "scripts") for m in _imports(folder) for d in provides.get(m, [m])}
    commands = {"dvc", "snakemake", "snakemake-executor-plugin-slurm", "gto", "accelerate"}
    assert sorted(_declared()["dependencies"] - used - commands) == []


def test_licence_file_and_metadata_agree():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (REPO / "LICENSE").read_text()
    assert text.split("\n", 3)[0].strip() == "Apache License" and "Version 2.0, January 2004" in text
    assert "Copyright 2026 The rlhf-pipeline authors" in text


def _venv_script(tmp_path: Path, env: dict[str, str], *args: str,
                 gpus: int = 0, pause: float = 0.0) -> subprocess.CompletedProcess:
    """scripts/venv.sh in a copy of the project's two input files, with `pip` replaced by a
    recorder, so what it would create and install is seen without installing anything. The machine
    has `gpus` NVIDIA GPUs: an `nvidia-smi` that lists that many comes first on PATH (it hides this
    machine's own; `pause`: seconds between its lines), and the driver's /proc file is one that does
    not exist unless `env` names one."""
    work = tmp_path / "proj"
    (work / "scripts").mkdir(parents=True, exist_ok=True)
    for name in ("pyproject.toml", "requirements.lock", "requirements-dev.lock", "scripts/venv.sh"):
        if not (work / name).exists():   # copied once: a newer pyproject.toml means "install again"
            (work / name).write_bytes((REPO / name).read_bytes())
    smi = _fake_nvidia_smi(tmp_path / f"nvidia-{gpus}-{pause}", gpus, pause)
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "VENV_NVIDIA_PROC": str(tmp_path / "no-driver"),
           **env}
    env["PATH"] = f"{smi}:{env['PATH']}"
    return subprocess.run(["bash", "scripts/venv.sh", *args, ".venv"], cwd=work, capture_output=True,
                          text=True, env=env, timeout=600)


def _fake_nvidia_smi(folder: Path, gpus: int, pause: float = 0.0) -> Path:
    """A folder with an `nvidia-smi` whose `-L` lists `gpus` GPUs, as the real one does (none: its
    message and exit status 6), `pause` seconds between lines. Returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = "".join(f'echo "GPU {i}: NVIDIA H100 80GB HBM3 (UUID: GPU-{i:08d})"\n' + (f"sleep {pause}\n" if pause else "")
                    for i in range(gpus))
    (folder / "nvidia-smi").write_text("#!/bin/sh\n" + (lines or 'echo "No devices were found"; exit 6\n'))
    (folder / "nvidia-smi").chmod(0o755)
    return folder


def _fake_python(folder: Path, name: str, version: str) -> Path:
    """An interpreter that reports `version`, makes a venv whose python reports it too, and logs
    every pip call."""
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / name
    script.write_text(f"""#!/usr/bin/env bash
if [ "$1" = -c ]; then echo {version}; exit 0; fi
if [ "$1" = -m ] && [ "$2" = venv ]; then
    mkdir -p "$3/bin"; cp "$0" "$3/bin/python"; exit 0
fi
if [ "$1" = -m ] && [ "$2" = pip ]; then
    echo "pip $*" >> "$(dirname "$0")/../pip.log"
    # what pip installed: FAKE_TORCH, else the build the command asked for
    if [ "$3" = show ]; then echo "Version: ${{FAKE_TORCH:-}}"; fi
    exit 0
fi
exit 1
""")
    script.chmod(0o755)
    return script


def test_venv_picks_the_newest_supported_python_and_rebuilds_a_stale_venv(tmp_path):
    bin_ = tmp_path / "bin"
    _fake_python(bin_, "python3.12", "3.12")
    _fake_python(bin_, "python3.11", "3.11")
    _fake_python(bin_, "python3.14", "3.14")      # not supported: never picked
    path = f"{bin_}:/usr/bin:/bin"
    proc = _venv_script(tmp_path, {"PATH": path}, gpus=1)
    venv = tmp_path / "proj" / ".venv"
    assert proc.returncode == 0, proc.stderr
    assert subprocess.run([str(venv / "bin/python"), "-c", ""], capture_output=True, text=True).stdout.strip() == "3.12"
    log = (venv / "pip.log").read_text()
    assert "install -q -c requirements.lock -c requirements-dev.lock -e .[dev]" in log and "download.pytorch.org" not in log
    assert (venv / ".installed").read_text().strip() == "torch=pypi"
    # Up to date: nothing runs again, and on a machine without a GPU the venv keeps the build it has.
    (venv / "pip.log").unlink()
    assert _venv_script(tmp_path, {"PATH": path}).returncode == 0 and not (venv / "pip.log").exists()
    # Another Python asked for: one line says why, the venv is rebuilt with it.
    proc = _venv_script(tmp_path, {"PATH": path, "PYTHON": "python3.11"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[0] == (
        "venv: rebuilding .venv with python3.11 (Python 3.11): it was made with Python 3.12 and PYTHON=python3.11 is 3.11")
    # A venv whose interpreter no longer runs.
    (venv / "bin/python").write_text("#!/bin/sh\nexit 1\n")
    proc = _venv_script(tmp_path, {"PATH": path})
    assert "venv: rebuilding .venv with python3.12 (Python 3.12): its python does not run" in proc.stdout


def test_venv_torch_build_choice_and_refusals(tmp_path):
    bin_ = tmp_path / "bin"
    _fake_python(bin_, "python3.13", "3.13")
    path = f"{bin_}:/usr/bin:/bin"
    venv = tmp_path / "proj" / ".venv"
    assert _venv_script(tmp_path, {"PATH": path, "TORCH": "pypi"}).returncode == 0
    (venv / "pip.log").unlink()
    # Switching to the CPU build: its index, and the pinned torch reinstalled from it.
    proc = _venv_script(tmp_path, {"PATH": path, "TORCH": "cpu"})
    assert proc.returncode == 0 and "venv: replacing torch with the cpu build" in proc.stdout
    log = (venv / "pip.log").read_text()
    pinned = next(line for line in (REPO / "requirements.lock").read_text().splitlines() if line.startswith("torch=="))
    assert f"--force-reinstall --no-deps --extra-index-url https://download.pytorch.org/whl/cpu {pinned}" in log
    assert "install -q -c requirements.lock -c requirements-dev.lock -e .[dev]" in log   # the rest: PyPI alone
    assert (venv / ".installed").read_text().strip() == "torch=cpu"
    bad = _venv_script(tmp_path, {"PATH": path, "TORCH": "rocm"})
    assert bad.returncode == 1
    assert bad.stderr.strip() == ("venv: TORCH=rocm: expected cpu, pypi (PyPI's default build) or a CUDA tag "
                                  "such as cu126 (unset: picked from this machine)")
    old = tmp_path / "old"
    _fake_python(old, "python3.10", "3.10")
    bad = _venv_script(tmp_path, {"PATH": f"{old}:/usr/bin:/bin", "PYTHON": "python3.10"})
    assert bad.returncode == 1 and "Python 3.10; this project needs one of 3.11 3.12 3.13" in bad.stderr


def test_venv_says_when_pip_installed_another_torch_build_than_it_asked_for(tmp_path):
    """No NVIDIA GPU, so the CPU-only build is asked for; where its index is out of reach pip takes
    PyPI's torch (no local version label): one line on stderr says so, and the venv records the
    build it has (pypi), so the next run neither repeats the line nor reinstalls. The CPU build
    installed as asked: no line, `torch=cpu`."""
    bin_ = tmp_path / "bin"
    _fake_python(bin_, "python3.13", "3.13")
    path = f"{bin_}:/usr/bin:/bin"
    venv = tmp_path / "proj" / ".venv"
    proc = _venv_script(tmp_path, {"PATH": path, "FAKE_TORCH": "2.13.0"})
    assert proc.returncode == 0
    assert proc.stderr.strip().splitlines() == [
        "venv: torch 2.13.0 is installed, not the CPU-only build (https://download.pytorch.org/whl/cpu): pip could "
        "not use that index and took PyPI's build, which runs here too; TORCH=pypi keeps it, TORCH=cpu with the "
        "index reachable replaces it"]
    assert (venv / ".installed").read_text() == "torch=pypi\n"
    (venv / "pip.log").unlink()
    again = _venv_script(tmp_path, {"PATH": path, "FAKE_TORCH": "2.13.0"})
    assert again.returncode == 0 and again.stdout == again.stderr == "" and not (venv / "pip.log").exists()
    ok = _venv_script(tmp_path / "cpu", {"PATH": path, "FAKE_TORCH": "2.13.0+cpu"})
    assert ok.returncode == 0 and ok.stderr == ""
    assert (tmp_path / "cpu" / "proj" / ".venv" / ".installed").read_text() == "torch=cpu\n"


CPU_INDEX = "--extra-index-url https://download.pytorch.org/whl/cpu"
PINNED = next(line for line in (REPO / "requirements.lock").read_text().splitlines() if line.startswith("torch=="))


def _torch_alone(index: str) -> str:
    """The command that installs torch by itself from a build's index, before everything else."""
    return f".venv/bin/python -m pip install -q --no-deps {index} {PINNED}"


def _dry_run(tmp_path: Path, env: dict[str, str], gpus: int = 0, pause: float = 0.0) -> tuple[str, list[str]]:
    """`venv.sh --dry-run` on a machine with `gpus` GPUs: (the line naming the torch build, the
    commands it would run). It changes nothing: no venv appears."""
    proc = _venv_script(tmp_path, env, "--dry-run", gpus=gpus, pause=pause)
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "proj" / ".venv").exists()
    choice, *commands = proc.stdout.strip().splitlines()
    return choice, commands


def test_venv_picks_the_torch_build_from_the_machine_unless_torch_says(tmp_path):
    """TORCH unset: the CPU-only build from PyTorch's CPU index where no NVIDIA GPU is found, PyPI's
    default build (no extra index) where nvidia-smi lists one or the driver's /proc file exists;
    TORCH names a build whatever the machine has. One line says which and why."""
    bin_ = tmp_path / "bin"
    _fake_python(bin_, "python3.12", "3.12")
    path = f"{bin_}:/usr/bin:/bin"
    install = ".venv/bin/python -m pip install -q {}-c requirements.lock -c requirements-dev.lock -e .[dev]"

    choice, commands = _dry_run(tmp_path, {"PATH": path})
    assert choice == ("venv: torch: the CPU-only build (https://download.pytorch.org/whl/cpu): no NVIDIA GPU "
                      f"here (no nvidia-smi on PATH lists one, no {tmp_path / 'no-driver'}); TORCH=pypi "
                      "installs PyPI's default build")
    # torch alone from the CPU index, then the rest from PyPI only: an index out of reach costs one lookup
    assert commands == ["python3.12 -m venv .venv", ".venv/bin/python -m pip install -q --upgrade pip",
                        _torch_alone(CPU_INDEX), install.format("")]

    choice, commands = _dry_run(tmp_path, {"PATH": path}, gpus=2)
    assert choice == ("venv: torch: PyPI's default build (on Linux x86_64 the CUDA build, several GB): "
                      "nvidia-smi lists a GPU; TORCH=cpu installs the CPU-only build")
    assert commands[-1] == install.format("") and not any("--no-deps" in c for c in commands)
    # Eight GPUs listed slowly: the first line decides, and nvidia-smi still writing the next ones
    # (SIGPIPE once a reader stops) does not turn the answer into "no GPU".
    choice, _ = _dry_run(tmp_path, {"PATH": path}, gpus=8, pause=0.05)
    assert choice.startswith("venv: torch: PyPI's default build") and "nvidia-smi lists a GPU" in choice

    driver = tmp_path / "version"
    driver.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module\n")
    choice, commands = _dry_run(tmp_path, {"PATH": path, "VENV_NVIDIA_PROC": str(driver)})
    assert f"{driver} exists (an NVIDIA driver is loaded)" in choice and commands[-1] == install.format("")

    choice, commands = _dry_run(tmp_path, {"PATH": path, "TORCH": "cpu"}, gpus=1)
    assert choice == ("venv: torch: the CPU-only build (https://download.pytorch.org/whl/cpu): "
                      "as TORCH=cpu asks")
    assert commands[-2:] == [_torch_alone(CPU_INDEX), install.format("")]
    choice, commands = _dry_run(tmp_path, {"PATH": path, "TORCH": "pypi"})
    assert choice.endswith("as TORCH=pypi asks") and commands[-1] == install.format("")
    choice, commands = _dry_run(tmp_path, {"PATH": path, "TORCH": "cu126"})
    assert commands[-2:] == [_torch_alone("--extra-index-url https://download.pytorch.org/whl/cu126"), install.format("")]

    # Installed, the choice is recorded; on a GPU machine later the venv keeps it (nothing runs again).
    proc = _venv_script(tmp_path, {"PATH": path})
    venv = tmp_path / "proj" / ".venv"
    assert proc.returncode == 0 and proc.stdout.startswith("venv: torch: the CPU-only build"), proc.stdout
    assert CPU_INDEX in (venv / "pip.log").read_text() and (venv / ".installed").read_text() == "torch=cpu\n"
    (venv / "pip.log").unlink()
    assert _venv_script(tmp_path, {"PATH": path}, gpus=1).stdout == "" and not (venv / "pip.log").exists()
    # A stamp of before the build was picked (pip's default) counts as PyPI's build: kept, not replaced.
    (venv / ".installed").write_text("torch=\n")
    (tmp_path / "proj" / "pyproject.toml").touch()     # newer than the stamp: install again
    proc = _venv_script(tmp_path, {"PATH": path})
    assert proc.stdout.splitlines()[0] == (
        "venv: torch: PyPI's default build (on Linux x86_64 the CUDA build, several GB): the build this venv has "
        "(TORCH=cpu, pypi or cu126 replaces it)")
    assert "download.pytorch.org" not in (venv / "pip.log").read_text() and "replacing" not in proc.stdout
    assert (venv / ".installed").read_text() == "torch=pypi\n"


def test_a_linked_venv_is_used_as_it_is_never_installed_into(tmp_path):
    """A copy of the project whose .venv links to another checkout's (the tests' scratch
    repositories): installing there would point that venv's editable install at the copy."""
    bin_ = tmp_path / "bin"
    _fake_python(bin_, "python3.12", "3.12")
    path = f"{bin_}:/usr/bin:/bin"
    other = tmp_path / "other"
    subprocess.run([str(bin_ / "python3.12"), "-m", "venv", str(other / ".venv")], check=True)
    (tmp_path / "proj").mkdir()
    (tmp_path / "proj" / ".venv").symlink_to(other / ".venv")
    proc = _venv_script(tmp_path, {"PATH": path})
    assert proc.returncode == 0 and proc.stdout == "" and not (other / ".venv" / "pip.log").exists()


def test_one_lock_per_part_of_the_install_and_each_matches_this_environment():
    """requirements.lock pins the pipeline's own closure; each extra's lock pins only what it adds;
    the committed pipeline and dev locks are what scripts/lock.py writes from this (tested) environment."""
    lock = load_script(REPO / "scripts" / "lock.py")
    assert lock.extras() == ["bench", "dev"]

    def pins(text: str) -> dict[str, str]:
        return dict(line.split("==") for line in text.splitlines() if line and not line.startswith("#"))
    written = lock.locks(["dev"])
    for name, text in written.items():
        assert (REPO / name).read_text() == text, f"{name} differs from this environment: make lock"
    core, dev = pins(written["requirements.lock"]), pins(written["requirements-dev.lock"])
    bench = pins((REPO / "requirements-bench.lock").read_text())
    assert {"torch", "transformers", "dvc", "mlflow", "snakemake", "deepspeed", "peft"} <= core.keys()
    assert {"pytest", "pytest-xdist", "pytest-timeout"} <= dev.keys() and "trl" in bench
    assert not (core.keys() & dev.keys()) and not (core.keys() & bench.keys())   # an extra adds, never repeats
    assert "pip" not in core and not any("+" in v for v in core.values())       # releases, not local builds


def test_the_vllm_lock_is_a_whole_environment_inside_the_projects_ranges():
    """requirements-vllm.lock is resolved for another platform (scripts/lock.py --resolve), not read
    off this environment: it pins the vLLM that scripts/vllm_api.py read the API of, and every direct
    dependency at a version pyproject.toml admits, as requirements.lock does. Where the two locks
    differ (torch, transformers) pyproject's range admits both and nothing newer than the newer."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    lock, api = (load_script(REPO / "scripts" / f"{name}.py") for name in ("lock", "vllm_api"))

    def pins(path: Path) -> dict[str, str]:
        lines = [line for line in path.read_text().splitlines() if line and not line.startswith("#")]
        return {_norm(name): version for name, version in (line.split("==") for line in lines)}
    core, whole = pins(REPO / "requirements.lock"), pins(REPO / "requirements-vllm.lock")
    python, platform = lock.RESOLVED["vllm"]
    assert (REPO / "requirements-vllm.lock").read_text().startswith(lock.RESOLVED_HEAD.format(
        extra="vllm", python=python, platform=platform))
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["optional-dependencies"]["vllm"] == [f"vllm=={api.PIN}"] and whole["vllm"] == api.PIN
    differ = []
    for text in project["dependencies"]:
        req = Requirement(text)
        name = _norm(req.name)
        assert req.specifier.contains(core[name]) and req.specifier.contains(whole[name]), (text, core[name], whole[name])
        if core[name] != whole[name]:
            differ.append(name)
            # The range's ends are the two tested releases: nothing newer than the newer lock's.
            newest = max(Version(core[name]), Version(whole[name]))
            assert not any(req.specifier.contains(v) for v in (f"{newest.major}.{newest.minor}.{newest.micro + 1}",
                                                               f"{newest.major}.{newest.minor + 1}.0")), text
    assert sorted(differ) == ["torch", "transformers"]
