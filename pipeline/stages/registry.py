"""Every stage, found once: the modules of this package that declare a `SPEC`.

A new method is one module here (its SPEC and its `run`), one params section and its tests; the
command line, the memory plan, the metric registry, the MLflow headline, the cluster's shape check
and the methods benchmark list stages from `specs()`, so none of them names a stage. dvc.yaml and
compare/dvc.yaml stay hand-written (a stage's command, deps and outs are read there by DVC and
Snakemake) and tests/unit/test_stage_declarations.py checks them against the registry.

Order: the default pipeline's stages before compare/dvc.yaml's, each in the order their inputs
allow (a stage after the stages whose folders it reads), training before measuring, then by name.
"""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Optional

from ..errors import ConfigError
from .spec import StageSpec

# Modules of this package that are the skeleton every stage shares, not stages.
_NOT_STAGES = {"spec", "skeleton", "registry", "metric_registry"}


def _modules() -> dict[str, ModuleType]:
    """Every module of the package with a SPEC, by its stage name (found anew each call: a test
    may add a folder to the package's path)."""
    from . import __path__ as package_path
    found: dict[str, ModuleType] = {}
    for info in sorted(pkgutil.iter_modules(package_path), key=lambda i: i.name):
        if info.name in _NOT_STAGES or info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{__package__}.{info.name}")
        spec = getattr(module, "SPEC", None)
        if isinstance(spec, StageSpec):
            if spec.name in found:
                raise RuntimeError(f"two stage modules declare the stage {spec.name!r}")
            found[spec.name] = module
    return found


def _depth(name: str, specs: dict[str, StageSpec], seen: tuple[str, ...] = ()) -> int:
    """How many stages run before this one along its inputs (data is the prepare stage's)."""
    if name in seen:
        raise RuntimeError(f"stages read each other's folders in a circle: {' -> '.join((*seen, name))}")
    parents = ["prepare" if f == "data" else f for f in specs[name].inputs]
    return 1 + max((_depth(p, specs, (*seen, name)) for p in parents if p in specs), default=-1)


def modules() -> dict[str, ModuleType]:
    """Stage name -> its module, in pipeline order (module doc)."""
    found = _modules()
    specs = {n: m.SPEC for n, m in found.items()}
    order = sorted(specs, key=lambda n: (specs[n].pipeline != "default", specs[n].measuring, _depth(n, specs), n))
    return {n: found[n] for n in order}


def specs() -> dict[str, StageSpec]:
    """Stage name -> its SPEC, in pipeline order."""
    return {n: m.SPEC for n, m in modules().items()}


def module(name: str) -> ModuleType:
    try:
        return modules()[name]
    except KeyError:
        raise ConfigError(f"no stage {name!r}; the stages are {', '.join(specs())}") from None


def spec(name: str) -> StageSpec:
    return module(name).SPEC


def training() -> tuple[str, ...]:
    return tuple(n for n, s in specs().items() if s.training)


def distributed() -> tuple[str, ...]:
    """Stages that run in a distributed session of their own section's settings."""
    return tuple(n for n, s in specs().items() if s.distributed)


def methods() -> dict[str, tuple[str, ...]]:
    """The policies the compare stage measures: stage -> the model folders it reads (after data)."""
    return {n: tuple(f for f in s.inputs if f != "data") for n, s in specs().items() if s.policy}


def shape_checked(when: str, pipeline: Optional[str] = None) -> tuple[str, ...]:
    """Stages whose batch shape is checked `when` ("load" or "start"), of one pipeline or all."""
    return tuple(n for n, s in specs().items() if s.shape == when and pipeline in (None, s.pipeline))


def parent_params() -> tuple[str, ...]:
    """Every stage's knobs that reach the MLflow parent run (each stage copies those its config has)."""
    return tuple(dict.fromkeys(p for s in specs().values() for p in s.parent_params))


def cluster_checked() -> tuple[str, ...]:
    """The default pipeline's distributed stages: their SLURM job shapes are checked against their
    `distributed` settings before Snakemake submits anything (compare/dvc.yaml's are left out, so a
    cluster setup for the default pipeline is not refused over stages it does not run)."""
    return tuple(n for n, s in specs().items() if s.distributed and s.pipeline == "default")


def registered() -> dict[str, tuple[str, ...]]:
    """Every registry's names by kind (pipeline/registries.py): the stage modules, and so every
    module that registers a function, imported first."""
    from .. import registries
    modules()
    return registries.names()


def load_params(path):
    """The params file loaded and validated in full, with the batch sizes of every stage whose
    SPEC says "load" checked against its processes, and every key naming a registered function
    (`config.named`) checked against its registry."""
    from ..config import load_params as load
    return load(path, shape_checked("load"), registered())
