"""Functions chosen by name in params.yaml, each registered where it is defined.

An advantage estimator, a policy-loss reduction or a preference loss is one decorated function:

    ESTIMATORS = Registry("advantage estimator")

    @ESTIMATORS.register("rloo")
    def rloo_advantages(...): ...

and the params key that picks one is declared with `config.named(kind, default)`: its allowed
values are the registry's names, checked when the params file is loaded, so a new one needs no edit
to config.py. The functions live in modules that import torch; `HOMES` names the modules whose
import registers the built-in ones, and asking for the names or a function's facts imports them
first, so what the params may name never depends on which modules a caller happened to import. verl registers its advantage estimators and policy losses by
name the same way (`register_adv_est`, `register_policy_loss` in verl/trainer/ppo/core_algos.py).

Plain Python (no torch) until asked: config.py reads the names.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Mapping, TypeVar

# The modules that register the built-in functions when imported: a new registry kind in a new
# module is one line here; a new function in one of them, none.
HOMES = ("pipeline.ppo", "pipeline.preference.losses")

F = TypeVar("F", bound=Callable[..., Any])

_ALL: dict[str, "Registry"] = {}   # kind -> its registry, as the modules that define them are imported


class Registry:
    """Name -> function of one kind, with the facts each function declares about itself (e.g. the
    step-log columns it writes, whether it needs a critic)."""

    def __init__(self, kind: str):
        if kind in _ALL:
            raise RuntimeError(f"two registries of {kind!r}")
        self.kind = kind
        self._functions: dict[str, Callable[..., Any]] = {}
        self._facts: dict[str, dict[str, Any]] = {}
        _ALL[kind] = self

    def register(self, name: str, **facts: Any) -> Callable[[F], F]:
        def add(fn: F) -> F:
            if name in self._functions:
                raise RuntimeError(f"two {self.kind}s named {name!r}")
            self._functions[name], self._facts[name] = fn, dict(facts)
            return fn
        return add

    def __getitem__(self, name: str) -> Callable[..., Any]:
        try:
            return self._functions[name]
        except KeyError:
            raise ValueError(f"{self.kind} must be one of {', '.join(map(repr, self.names()))}, "
                             f"got {name!r}") from None

    def __contains__(self, name: object) -> bool:
        return name in self._functions

    def names(self) -> tuple[str, ...]:
        """In the order they were registered."""
        return tuple(self._functions)

    def facts(self, name: str) -> Mapping[str, Any]:
        self[name]   # an unknown name: the registry's error
        return self._facts[name]


def _load() -> None:
    for module in HOMES:
        importlib.import_module(module)


def names() -> dict[str, tuple[str, ...]]:
    """Every registry's names by kind: the built-in ones and any a module imported so far added."""
    _load()
    return {kind: r.names() for kind, r in _ALL.items()}


def declared(kind: str, name: str) -> Mapping[str, Any] | None:
    """The facts `name` of `kind` declared at registration; None when no function of that name is
    registered (config.py's checks that need a fact skip then: `config.check_named`, run when the
    params file is loaded, names the unknown name)."""
    _load()
    registry = _ALL.get(kind)
    return registry._facts.get(name) if registry is not None else None
