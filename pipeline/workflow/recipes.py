"""Recipes: documented parameter sets for known setups, in `recipes/<name>.yaml`.

A recipe holds only the keys it changes. `python -m pipeline recipe <name>` merges it over
params.yaml (keeping params.yaml's comments and order) and writes the result back, after
validating it in full; then `dvc repro` or `dvc exp run` runs it, and `git checkout params.yaml`
goes back to the default.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Mapping

from ruamel.yaml import YAML

from ..config import Params, from_dict, merge_distributed, read_yaml
from ..errors import ConfigError
from ..data.io import atomic_write_text

FOLDER = Path(__file__).resolve().parents[2] / "recipes"


def names() -> list[str]:
    return sorted(p.stem for p in FOLDER.glob("*.yaml"))


def describe(name: str) -> str:
    """A recipe's first comment line (its head says what it is for), for `recipe --list`."""
    for line in (FOLDER / f"{name}.yaml").read_text(encoding="utf-8").splitlines():
        if line.lstrip().startswith("#"):
            return line.lstrip().lstrip("#").strip()
    return "(no description)"


def _merge(base: Any, override: Mapping[str, Any]) -> Any:
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), Mapping) and value:
            _merge(base[key], value)
        else:
            base[key] = value
    return base


def render(name: str, params_path: Path) -> tuple[str, Params]:
    """The params file with recipe `name` merged in, as text, and its validated Params."""
    recipe = FOLDER / f"{name}.yaml"
    if not recipe.is_file():
        raise ConfigError(f"recipe {name!r}: no such recipe (known: {', '.join(names())})")
    yaml = YAML()                       # round trip: comments and key order of params.yaml survive
    yaml.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    base = yaml.load(Path(params_path).read_text(encoding="utf-8"))
    _merge(base, read_yaml(recipe) or {})
    buf = io.StringIO()
    yaml.dump(base, buf)
    text = buf.getvalue()
    plain = YAML(typ="safe", pure=True).load(text)
    where = f"{recipe.name} over {Path(params_path).name}: "
    params = from_dict(Params, merge_distributed(plain, where), where)
    return text, params


def apply(name: str, params_path: Path, out: Path) -> Params:
    text, params = render(name, params_path)
    atomic_write_text(out, f"# params.yaml with recipes/{name}.yaml merged in (python -m pipeline recipe {name})\n" + text)
    return params
