"""Sitecustomizes that slow a process down where a test wants a signal to land, for tests that
signal or time-limit a stage from outside: every supervised step (the step's time is sleep, the same
on any CPU and under any load, so a signal lands inside the loop and a time limit ends a job mid-run,
while the model is the one the steps compute), or the command's start (its import of torch)."""

from __future__ import annotations

from pathlib import Path


def _first_import_hook(folder: Path, module: str, body: str) -> Path:
    """`folder`, holding a sitecustomize.py whose meta-path finder runs `body` (the lines of
    `find_spec`'s rest, indented 8 spaces; it returns the spec to use, or None for the usual one)
    when the process first imports `module`, then leaves the import machinery."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(
        "import importlib.abc, importlib.util, pathlib, sys, time\n"
        "class Slow(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        f"        if name != {module!r}:\n"
        "            return None\n"
        "        sys.meta_path.remove(self)\n"
        f"{body}"
        "sys.meta_path.insert(0, Slow())\n")
    return folder


def slow_steps_hook(folder: Path, seconds: float) -> Path:
    """`folder`, holding a sitecustomize.py that makes each supervised step `seconds` longer (a
    process started with `folder` on PYTHONPATH) and touches `folder/in_loop` at the first step.
    It patches the training loop's module when it is first imported, so only the process that runs
    a stage (not Snakemake, sbatch or the launcher) is slowed."""
    return _first_import_hook(folder, "pipeline.training.supervised",
        "        spec = importlib.util.find_spec(name)\n"
        "        run = spec.loader.exec_module\n"
        "        def exec_module(module):\n"
        "            run(module)\n"
        "            real = module.check_finite\n"
        "            def slow(at, what, value):\n"
        "                if what == 'loss':\n"
        f"                    pathlib.Path({str(folder / 'in_loop')!r}).touch()\n"
        f"                    time.sleep({seconds})\n"
        "                return real(at, what, value)\n"
        "            module.check_finite = slow\n"
        "        spec.loader.exec_module = exec_module\n"
        "        return spec\n")


def slow_start_hook(folder: Path, seconds: float) -> Path:
    """`folder`, holding a sitecustomize.py that makes a process's first `import torch` wait
    `seconds`, after touching `folder/importing`: a signal sent then lands while the command starts."""
    return _first_import_hook(folder, "torch",
        f"        pathlib.Path({str(folder / 'importing')!r}).touch()\n"
        f"        time.sleep({seconds})\n"
        "        return None\n")
