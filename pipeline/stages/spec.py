"""What a stage reads, declared once.

Each stage module has a `SPEC`: the params sections and dotted keys it reads (spelled as dvc.yaml's
`params:` lists them) and its input folders. From the declaration come
- the params the stage's code sees: `declared(params, spec)` is a view that raises
  `UndeclaredParam` on any key the declaration omits, so code cannot read a param that DVC would
  not re-run the stage for;
- the resolved config: `resolve(params, spec)`, written as the stage's config.json, logged as its
  MLflow params and hashed into the resume fingerprint;
- dvc.yaml's `params:` of the stage, which tests/test_stage_declarations.py checks against it.

A distributed stage's own `<stage>.distributed` (the training stages', evaluate's and compare's) is
merged over the top-level `distributed` section when params are loaded (config.merge_distributed),
so such a stage declares `distributed` too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..config import Params, to_dict

ALL = None   # a leaf of the allowed tree: everything below it is declared


class UndeclaredParam(RuntimeError):
    """Stage code read a param its SPEC does not declare (a bug in the stage, not in params)."""


@dataclass(frozen=True)
class StageSpec:
    name: str                   # the DVC stage and `python -m pipeline <name>`
    reads: tuple[str, ...]      # params sections or dotted keys, as in dvc.yaml's `params:`
    inputs: tuple[str, ...]     # command-line folders it reads (`--data`, `--sft`, ...)
    training: bool = False      # trains (a checkpointed loop, a memory plan checked before it builds a model)
    measuring: bool = False     # measures policies on its section's `distributed` devices without training

    @property
    def distributed(self) -> bool:
        """Runs in a distributed session of its own section's `distributed` settings."""
        return self.training or self.measuring

    def allowed(self) -> dict[str, Any]:
        """The declared keys as a tree: {"ppo": {"dataset": {"path": ALL}}, "sft": ALL}."""
        tree: dict[str, Any] = {}
        for key in self.reads:
            node = tree
            *parents, leaf = key.split(".")
            for part in parents:
                if node.get(part, {}) is ALL:
                    break
                node = node.setdefault(part, {})
            else:
                node[leaf] = ALL
        return tree


class ParamsView:
    """Attribute access to the declared part of a params tree; anything else raises."""

    def __init__(self, obj: Any, allowed: dict[str, Any], stage: str, path: str = ""):
        object.__setattr__(self, "_obj", obj)
        object.__setattr__(self, "_allowed", allowed)
        object.__setattr__(self, "_stage", stage)
        object.__setattr__(self, "_path", path)

    def __getattr__(self, name: str) -> Any:
        if name not in self._allowed:
            raise UndeclaredParam(f"the {self._stage} stage reads `{self._path}{name}`, which its SPEC "
                                  f"(pipeline/stages/{self._stage}.py) does not declare; add it there and to "
                                  f"dvc.yaml's params of the stage")
        value = getattr(self._obj, name)
        sub = self._allowed[name]
        return value if sub is ALL else ParamsView(value, sub, self._stage, f"{self._path}{name}.")

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("params are read-only")


def declared(params: Params, spec: StageSpec) -> Params:
    """`params` as the stage may read it (typed as Params for the stage's code)."""
    return ParamsView(params, spec.allowed(), spec.name)  # type: ignore[return-value]


def resolve(params: Params, spec: StageSpec) -> dict[str, Any]:
    """The declared params as plain nested data (sections and keys as declared)."""
    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return to_dict(value)
        return list(value) if isinstance(value, tuple) else value

    def walk(obj: Any, tree: dict[str, Any]) -> dict[str, Any]:
        return {k: plain(getattr(obj, k)) if sub is ALL else walk(getattr(obj, k), sub) for k, sub in sorted(tree.items())}
    return walk(params, spec.allowed())
