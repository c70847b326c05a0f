"""The stage graph, read from `dvc.yaml`: the one declaration both DVC and Snakemake run.

`dvc.yaml` stays the source of truth. The Snakefile builds one rule per stage from what this
module returns (same command, inputs, outputs and params), so the two workflow engines cannot
drift; a test compares Snakemake's DAG with DVC's.

What Snakemake must not own: outputs DVC marks `persist: true`. Snakemake deletes a job's outputs
before running it, which would throw away state a later run relies on, so such outputs are left out
of the rule and kept as they are by both engines. (The stages' own resumable checkpoints are not
outs at all, for either engine: see the head of dvc.yaml.)

Params: DVC records the values of each stage's declared params in dvc.lock and re-runs a stage
when they change. Snakemake compares modification times, and its own record of rule params lives
in `.snakemake/metadata`, which a `dvc repro` never writes (so it used to miss a change made after
DVC ran). Here each stage's declared values become a file, `.snakemake/params/<stage>.json`, an
input of its rule: rewritten only when the values change, and dated when params.yaml was edited,
so outputs built after the edit (by either engine) stay up to date and older ones are re-run; a
first file whose values dvc.lock records for the stage is dated at the epoch (DVC built with them).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..config import read_yaml
from ..files import atomic_write_text
from ..errors import ConfigError

PARAM_DIR = Path(".snakemake/params")      # one <stage>.json per stage (Snakemake's side only)
BENCHMARK_DIR = Path("logs/benchmarks")    # one <stage>.tsv per stage: Snakemake's `benchmark:` files


@dataclass(frozen=True)
class Stage:
    name: str
    cmd: str
    deps: tuple[str, ...]          # files and folders the stage reads (data and code)
    outs: tuple[str, ...]          # what it writes: outs, metrics and plots, persistent ones excluded
    persistent: tuple[str, ...]    # `persist: true` outputs (resumable state), not Snakemake outputs
    params: tuple[str, ...]        # params.yaml sections or dotted keys it reads

    def is_dir(self, path: str) -> bool:
        """Outputs without a file extension are folders (`outputs/sft/model`, `data/prepared`)."""
        return Path(path).suffix == ""


# The pipeline files: the default pipeline, then the alignment methods compared on its outputs
# (stages there run from the root, `wdir: ..`). Snakemake reads both; its default target is the first.
PIPELINE_FILES = ("dvc.yaml", "compare/dvc.yaml")


def load_all(root: str | Path = ".") -> list[Stage]:
    """Every stage of every pipeline file under `root` that exists, paths relative to `root`."""
    return [s for f in PIPELINE_FILES if (Path(root) / f).is_file() for s in load(Path(root) / f, root)]


def load(path: str | Path = "dvc.yaml", root: str | Path | None = None) -> list[Stage]:
    """The stages of a dvc.yaml in file order (which is a topological order here), as DVC itself
    resolves them: `vars`, `foreach` and `matrix` expanded (a `foreach` stage `train` over a, b is
    `train@a` and `train@b`), `${...}` interpolated. Paths are made relative to `root` (default: the
    file's folder) through each stage's `wdir`, where its command runs; a stage whose wdir is not
    `root` cannot be run by the Snakefile (its command would run in the wrong folder) and is refused.
    Params must be params.yaml keys (the Snakefile's param files read only that file)."""
    from dvc.dvcfile import load_file
    from dvc.exceptions import DvcException
    from dvc.repo import Repo

    path = Path(path)
    here = path.parent
    root = here if root is None else Path(root)
    try:
        # DVC's own reader, without needing `dvc init` where the file lies (the tests' scratch folders).
        with Repo(str(here.resolve()), uninitialized=True) as repo:
            resolved = list(load_file(repo, str(path.resolve())).stages.values())
    except DvcException as err:
        raise ConfigError(f"{path}: {err}") from None
    stages = []
    for st in resolved:
        base = Path(st.wdir)
        if os.path.normpath(base) != os.path.normpath(root.resolve()):
            raise ConfigError(f"{path}: stage {st.name}: its wdir must be the repository root ({root}), "
                              f"got {os.path.relpath(base, here.resolve())!r}")
        outs, persistent = [], []
        for out in st.outs:
            (persistent if out.persist else outs).append(_rel(out.def_path, base))
        deps, params = [], []
        for dep in st.deps:
            if type(dep).__name__ == "ParamsDependency":
                if os.path.normpath(dep.def_path) != "params.yaml":
                    raise ConfigError(f"{path}: stage {st.name}: only params.yaml keys are supported in params, "
                                      f"got {dep.def_path}")
                params += list(dep.params or [])
            else:
                deps.append(_rel(dep.def_path, base))
        stages.append(Stage(name=st.name, cmd=shell_command(st.cmd), deps=tuple(deps),
                            outs=tuple(outs), persistent=tuple(persistent), params=tuple(params)))
    return stages


def shell_command(cmd: str | list[str]) -> str:
    """A stage's `cmd` as one shell command. DVC also takes a list, run in order until one fails:
    it becomes `sh -c 'a && b'`, still one command, as a job's `exec` and `srun` need
    (cluster.job_command)."""
    parts = [" ".join(str(c).split()) for c in (cmd if isinstance(cmd, (list, tuple)) else [cmd])]
    return parts[0] if len(parts) == 1 else f"sh -c {shlex.quote(' && '.join(parts))}"


def _rel(def_path: str, wdir: Path) -> str:
    """A dvc.yaml path (relative to the stage's wdir, which is the root here) as written."""
    return os.path.normpath(def_path) if not os.path.isabs(def_path) else os.path.relpath(def_path, wdir)


def rule_name(stage: Stage) -> str:
    """A Snakemake rule name for the stage: DVC's `train@a` or `grid@1-0` with `_` for what a rule
    name cannot hold."""
    return re.sub(r"\W", "_", stage.name)


def param_values(stage: Stage, params: Mapping[str, Any]) -> dict[str, Any]:
    """The values of the params.yaml keys a stage declares (`ppo`, `data.task`), by dotted name,
    as DVC reads them; a key params.yaml does not hold is left out (its default applies)."""
    values = {}
    for key in stage.params:
        node: Any = params
        for part in key.split("."):
            if not isinstance(node, Mapping) or part not in node:
                break
            node = node[part]
        else:
            values[key] = node
    return values


def param_file(stage: Stage, root: str | Path = ".") -> Path:
    return Path(root) / PARAM_DIR / f"{stage.name}.json"


def locked_params(lock: str | Path) -> dict[str, Any]:
    """Each stage's param values as dvc.lock records them (what DVC last built it with), by
    stage; empty without a readable lock."""
    try:
        raw = read_yaml(lock) if Path(lock).is_file() else {}
    except ConfigError:
        return {}
    stages = raw.get("stages") if isinstance(raw, Mapping) else None
    out = {}
    for name, entry in (stages if isinstance(stages, Mapping) else {}).items():
        params = entry.get("params") if isinstance(entry, Mapping) else None
        if isinstance(params, Mapping) and isinstance(params.get("params.yaml"), Mapping):
            out[name] = dict(params["params.yaml"])
    return out


def _canonical(values: Any) -> str:
    return json.dumps(values, sort_keys=True, default=str)


def write_param_files(stages: list[Stage], params_path: str | Path = "params.yaml", root: str | Path = ".",
                      lock: str | Path | None = None) -> list[Path]:
    """Write each stage's declared param values to its param file when they differ from what the
    file holds; return the files that changed.

    A rewritten file is dated when params.yaml was last modified, the latest the change can have
    happened: outputs made after it (by `dvc repro` too) are newer and stay, older ones re-run.
    Should that date not move forward (params.yaml restored with its old date), the file is dated
    now instead, so a change is never hidden. An unchanged file keeps its date. A first file whose
    values dvc.lock records for the stage is dated at the epoch: DVC built the stage's outputs with
    them, so they are not older (a first `snakemake -n` after `dvc repro` and a params edit plans
    only the stages the edit reaches)."""
    raw = read_yaml(params_path) or {}
    edited = os.stat(params_path).st_mtime
    locked = None
    changed = []
    for stage in stages:
        path = param_file(stage, root)
        values = param_values(stage, raw)
        text = json.dumps({"stage": stage.name, "params": values}, indent=1, sort_keys=True, default=str) + "\n"
        try:
            before = path.stat().st_mtime
            if path.read_text(encoding="utf-8") == text:
                continue
        except FileNotFoundError:
            before = None
        atomic_write_text(path, text)
        if before is None:
            if locked is None:   # every pipeline file's lock (dvc.lock, compare/dvc.lock) unless one is given
                locks = [lock] if lock is not None else [Path(root) / Path(f).with_suffix(".lock") for f in PIPELINE_FILES]
                locked = {k: v for f in locks for k, v in locked_params(f).items()}
            built_with = stage.name in locked and _canonical(locked[stage.name]) == _canonical(values)
            stamp = 0.0 if built_with else edited
        else:
            stamp = edited if edited > before else time.time()
        os.utime(path, (stamp, stamp))
        changed.append(path)
    return changed


def drop_stale_benchmarks(stages: list[Stage], root: str | Path = ".") -> list[Path]:
    """Remove the Snakemake benchmark of a stage whose outputs were rebuilt after it (by `dvc repro`):
    it no longer describes those outputs, and Snakemake dates a job's outputs by the oldest of them
    and its benchmark, so a stale one would make a stage DVC just rebuilt look out of date.

    Snakemake writes the benchmark once the job's files are written, and marks a folder output it
    made with a `.snakemake_timestamp` file; a file output newer than the benchmark, or a folder
    output without that mark, was made by something else."""
    dropped = []
    for stage in stages:
        bench = Path(root) / BENCHMARK_DIR / f"{stage.name}.tsv"
        if not bench.is_file():
            continue
        made = bench.stat().st_mtime
        outs = [Path(root) / o for o in stage.outs]
        if any(o.is_dir() and not (o / ".snakemake_timestamp").exists()
               or o.is_file() and o.stat().st_mtime > made for o in outs):
            bench.unlink()
            dropped.append(bench)
    return dropped


def check_no_overrides(overrides: Mapping[str, Any]) -> None:
    """Refuse `snakemake --config ...` / `--configfile ...`: the jobs and DVC read params.yaml, so an
    override would reach neither, and outputs would not match the params either engine records."""
    if overrides:
        keys = ", ".join(sorted(overrides))
        raise ConfigError(f"snakemake --config/--configfile ({keys}): overrides are not supported, the jobs read "
                          "params.yaml; edit params.yaml (or run `dvc exp run -S key=value`)")


def edges(stages: list[Stage]) -> set[tuple[str, str]]:
    """(upstream, downstream) pairs: a stage depends on another when it reads one of its outputs."""
    producer = {out: s.name for s in stages for out in s.outs}
    return {(producer[d], s.name) for s in stages for d in s.deps if d in producer}
