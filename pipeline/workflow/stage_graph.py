"""The stage graph, read from `dvc.yaml`: the one declaration both DVC and Snakemake run.

`dvc.yaml` stays the source of truth. The Snakefile builds one rule per stage from what this
module returns (same command, inputs, outputs and params), so the two workflow engines cannot
drift; a test compares Snakemake's DAG with DVC's.

What Snakemake must not own: outputs DVC marks `persist: true`. Snakemake deletes a job's outputs
before running it, which would throw away state a later run relies on, so such outputs are left out
of the rule and kept as they are by both engines. (The stages' own resumable checkpoints are not
outs at all, for either engine: see the head of dvc.yaml.)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ..config import read_yaml
from ..errors import ConfigError


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


def _entries(items: Any) -> list[tuple[str, Mapping[str, Any]]]:
    """DVC's list form: plain `path` or `{path: {options}}`."""
    out = []
    for item in items or []:
        if isinstance(item, str):
            out.append((item, {}))
        elif isinstance(item, Mapping) and len(item) == 1:
            (path, opts), = item.items()
            out.append((str(path), opts or {}))
        else:
            raise ConfigError(f"dvc.yaml: unexpected entry {item!r}")
    return out


def load(path: str | Path = "dvc.yaml") -> list[Stage]:
    """The stages of `dvc.yaml` in file order (which is a topological order here)."""
    raw = read_yaml(path)
    stages = []
    for name, spec in (raw.get("stages") or {}).items():
        outs, persistent = [], []
        for section in ("outs", "metrics", "plots"):
            for out, opts in _entries(spec.get(section)):
                (persistent if opts.get("persist") else outs).append(out)
        params = []
        for entry in spec.get("params") or []:
            if not isinstance(entry, str):
                raise ConfigError(f"{path}: stage {name}: only params.yaml keys are supported in params, got {entry!r}")
            params.append(entry)
        stages.append(Stage(name=name, cmd=" ".join(str(spec["cmd"]).split()),
                            deps=tuple(p for p, _ in _entries(spec.get("deps"))),
                            outs=tuple(outs), persistent=tuple(persistent), params=tuple(params)))
    return stages


def param_values(stage: Stage, config: Mapping[str, Any]) -> dict[str, Any]:
    """The values of the params a stage reads, named `data_task` for `data.task` (Snakemake
    re-runs a job when one of them changes, as `dvc repro` does)."""
    values = {}
    for key in stage.params:
        node: Any = config
        for part in key.split("."):
            node = node[part]
        values[key.replace(".", "_")] = node
    return values


def edges(stages: list[Stage]) -> set[tuple[str, str]]:
    """(upstream, downstream) pairs: a stage depends on another when it reads one of its outputs."""
    producer = {out: s.name for s in stages for out in s.outs}
    return {(producer[d], s.name) for s in stages for d in s.deps if d in producer}
