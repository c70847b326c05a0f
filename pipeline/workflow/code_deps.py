"""Which project files a stage's code reaches: the import closure DVC's `deps` must cover.

A stage runs `python -m pipeline <stage>`: `pipeline/__main__.py` (its module-level imports; its
other stages' imports are function-local and are not followed) and `pipeline/stages/<stage>.py`,
then every project module either imports, at any depth, including imports inside functions (the
gold judge is imported where it is needed). Found statically with `ast`, so nothing is executed.
A package's `__init__.py` is reached with any of its modules. The command line finds the stages
through pipeline/stages/registry.py, which imports every stage module to read its SPEC: a stage's
process imports the others' code too, but runs only its own (`run` and its SPEC's functions), so
the others are not its deps.

dvc.yaml's code deps of a stage must cover this closure (a folder covers what is under it);
tests/unit/test_stage_declarations.py checks it. `EXEMPT` lists the only files that may stay out, each
with the reason it cannot change an output. Code that a user names in params (a
`ppo.reward_source: module:function`) is imported at run time and is theirs to track.
"""

from __future__ import annotations

import ast
from pathlib import Path

# Files a stage imports that cannot change what it writes.
EXEMPT = {
    "pipeline/errors.py": "error types and the finite-value check: they stop a run, never change an output",
    "pipeline/tracking/mlflow_sink.py": "the MLflow sink: a copy of what the stage writes, never read back",
    "pipeline/progress.py": "progress bars and lines on stderr: what a person watches, never an output",
    "pipeline/tracking/mlflow_models.py": "MLflow models: a copy of the checkpoint the stage wrote, never read back",
    "pipeline/tracking/metric_names.py": "the metric declarations (names, meanings, docs/metrics.md): never change "
                                         "what a stage computes or writes",
}


def module_file(root: Path, module: str) -> Path | None:
    """The file of a dotted project module (`pipeline.files`), or None when it is not one."""
    base = root / Path(*module.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path, path: Path, top_level_only: bool = False) -> set[Path]:
    """Project files that `path` imports (with the `__init__.py` of each package on the way)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    if not path.is_relative_to(root):   # a stage module found on the stages package's path elsewhere
        package = "pipeline.stages"
    else:
        package = _module_name(root, path) if path.name == "__init__.py" else _module_name(root, path).rpartition(".")[0]
    nodes = tree.body if top_level_only else ast.walk(tree)
    found: set[Path] = set()
    for node in nodes:
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            for i in range(1, len(parts) + 1):      # the packages on the way, then the module
                f = module_file(root, ".".join(parts[:i]))
                if f is not None:
                    found.add(f)
    return found


def closure(root: Path, stage: str, entry: Path | None = None) -> set[str]:
    """Repository-relative paths of every project file `python -m pipeline <stage>` can import (not
    descending into EXEMPT files: what they alone import serves only them). `entry`: the stage's
    module when it is not pipeline/stages/<stage>.py (a stage module outside the checkout is given
    by its absolute path)."""
    root = Path(root)
    main = root / "pipeline" / "__main__.py"
    entry = Path(entry) if entry is not None else root / "pipeline" / "stages" / f"{stage}.py"
    packages = {module_file(root, "pipeline"), module_file(root, "pipeline.stages")} - {None}
    todo = {entry, *packages} | imports(root, main, top_level_only=True)
    seen: set[Path] = {main}
    while todo:
        f = todo.pop()
        if f in seen:
            continue
        seen.add(f)
        if not f.is_relative_to(root) or str(f.relative_to(root)) not in EXEMPT:   # what only an exempt file imports serves it alone
            todo |= imports(root, f) - seen
    return {str(f.relative_to(root)) if f.is_relative_to(root) else str(f) for f in seen}


def empty_marker(root: Path, path: str) -> bool:
    """An empty package `__init__.py`: it holds no code, so no dep need cover it."""
    return path.endswith("__init__.py") and not (Path(root) / path).read_text(encoding="utf-8").strip()


def covered(path: str, deps: list[str]) -> bool:
    """Whether a dep of the list is `path` itself or a folder above it."""
    return any(path == d or path.startswith(d.rstrip("/") + "/") for d in deps)


def uncovered(root: Path, stage: str, deps: list[str]) -> list[str]:
    """Files of the stage's closure that no dep covers and that are not exempt (empty package
    markers are exempt: they hold no code)."""
    out = []
    for f in sorted(closure(root, stage)):
        if not (covered(f, deps) or f in EXEMPT or empty_marker(root, f)):
            out.append(f)
    return out


def coarse_deps(root: Path, stage: str) -> list[str]:
    """The closure as dvc.yaml deps: a folder where the stage reaches every Python file under it,
    else the files (so editing code one stage alone uses never re-runs another)."""
    files = {f for f in closure(root, stage) if f not in EXEMPT}
    root = Path(root)
    deps: list[str] = []
    folders = sorted({str(Path(f).parent) for f in files}, key=lambda d: (d.count("/"), d))
    for folder in folders:
        if folder == "pipeline" or covered(folder + "/x", deps):
            continue
        inside = {str(p.relative_to(root)) for p in (root / folder).rglob("*.py")}
        if inside and inside <= files:
            deps.append(folder)
    deps += sorted(f for f in files if not covered(f, deps) and not empty_marker(root, f))
    return deps


if __name__ == "__main__":   # print each stage's deps, for dvc.yaml (its stages by default)
    import sys
    from ruamel.yaml import YAML
    root = Path(__file__).resolve().parents[2]
    for stage in sys.argv[1:] or YAML(typ="safe").load((root / "dvc.yaml").read_text(encoding="utf-8"))["stages"]:
        print(f"{stage}:")
        for d in coarse_deps(root, stage):
            print(f"      - {d}")
