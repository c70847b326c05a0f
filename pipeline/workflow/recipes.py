"""Recipes: documented parameter sets for known setups, in `recipes/<name>.yaml`.

A recipe holds only the keys it changes. `python -m pipeline recipe <name>` merges it over
params.yaml (keeping params.yaml's comments and order) and writes the result back, after
validating it in full; then `dvc repro` or `dvc exp run` runs it, and `git checkout params.yaml`
goes back to the default. A recipe's `slurm` section is not params: it is the SLURM jobs its setup
needs (Snakemake resources per stage), merged into `set-resources` of profiles/slurm/config.yaml
beside the params file, and checked against the recipe's process shape first.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ruamel.yaml import YAML

from ..config import Params, read_yaml, validated
from . import cluster
from ..errors import ConfigError, shown
from ..files import atomic_write_text

FOLDER = Path(__file__).resolve().parents[2] / "recipes"


def names() -> list[str]:
    return sorted(p.stem for p in FOLDER.glob("*.yaml"))


def describe(name: str) -> str:
    """A recipe's first comment line (its head says what it is for), for `recipe --list`."""
    for line in (FOLDER / f"{name}.yaml").read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("#"):
            return line.lstrip().lstrip("#").strip()
    return "(no description)"


def merge(base: Any, override: Mapping[str, Any]) -> Any:
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), Mapping) and value:
            merge(base[key], value)
        else:
            base[key] = value
    return base


def _round_trip() -> YAML:
    yaml = YAML()                       # round trip: comments and key order survive
    yaml.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    return yaml


def _dump(yaml: YAML, doc: Any) -> str:
    buf = io.StringIO()
    yaml.dump(doc, buf)
    return buf.getvalue()


def render(name: str, params_path: Path, shapes: Sequence[str] = (),
           registered: Optional[Mapping[str, Sequence[str]]] = None) -> tuple[str, Params, dict[str, Any]]:
    """The params file with recipe `name` merged in, as text, its validated Params (`shapes` and
    `registered` as config.validated checks them when a params file is loaded), and the
    recipe's SLURM jobs (`slurm`: Snakemake resources per stage; empty when it has none)."""
    if name not in names():   # a name, never a path: `../params` would be the repository's own params.yaml
        raise ConfigError(f"recipe {shown(name)}: no such recipe (known: {', '.join(names())}); "
                          "a recipe is named by its file in recipes/, without .yaml")
    recipe = FOLDER / f"{name}.yaml"
    read_yaml(params_path)   # the guarded reader first: a file that is not YAML is one line naming it
    yaml = _round_trip()
    base = yaml.load(Path(params_path).read_text(encoding="utf-8"))
    if not isinstance(base, Mapping):
        raise ConfigError(f"{params_path}: expected a mapping of params sections, got {type(base).__name__}")
    changes = dict(read_yaml(recipe) or {})
    jobs = changes.pop("slurm", None) or {}
    merge(base, changes)
    text = _dump(yaml, base)
    plain = YAML(typ="safe", pure=True).load(text)
    params = validated(plain, f"{recipe.name} over {params_path}: ", shapes, registered)
    if not isinstance(jobs, Mapping) or not all(isinstance(v, Mapping) for v in jobs.values()):
        raise ConfigError(f"{recipe.name}: slurm: expected a mapping of stage -> resources")
    return text, params, {k: dict(v) for k, v in jobs.items()}


def profile_with(profile_path: Path, jobs: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]]:
    """The SLURM profile with `jobs` merged into its `set-resources`, as text, and as plain data."""
    yaml = _round_trip()
    doc = merge(yaml.load(profile_path.read_text(encoding="utf-8")), {"set-resources": jobs})
    text = _dump(yaml, doc)
    return text, YAML(typ="safe", pure=True).load(text)


def apply(name: str, params_path: Path, out: Path, shapes: Sequence[str] = (),
          cluster_stages: Sequence[str] = (), registered: Optional[Mapping[str, Sequence[str]]] = None) -> list[Path]:
    """Write the merged params to `out`; a recipe's SLURM jobs go into the profile beside `out`
    (profiles/slurm/config.yaml), after the shape check of `cluster_stages`' jobs, so neither file
    is written when it fails. Returns the files written. (`shapes` and `registered` as for `render`.)"""
    if Path(out).is_dir():
        raise ConfigError(f"--out {out}: is a folder; name the params file to write")
    text, params, jobs = render(name, params_path, shapes, registered)
    profile = Path(out).parent / cluster.PROFILE
    profile_text = None
    if jobs:
        if not profile.is_file():
            raise ConfigError(f"recipe {name}: its SLURM jobs go to {profile}, which is not there")
        profile_text, plain = profile_with(profile, jobs)
        cluster.check_shape(params, cluster.shapes_in_profile(plain, ("prepare", *cluster_stages)), cluster_stages)
    atomic_write_text(out, f"# params.yaml with recipes/{name}.yaml merged in (python -m pipeline recipe {name})\n" + text)
    if profile_text is None:
        return [Path(out)]
    atomic_write_text(profile, profile_text)
    return [Path(out), profile]
