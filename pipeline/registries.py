"""Functions chosen by name in params.yaml, each registered where it is defined.

An advantage estimator, a policy-loss reduction or a preference loss is one decorated function:

    ESTIMATORS = Registry("advantage estimator")

    @ESTIMATORS.register("rloo")
    def rloo_advantages(...): ...

and the params key that picks one is declared with `config.named(kind, default)`: its allowed
values are the registry's names, checked when the params file is loaded (pipeline.stages.registry
.load_params imports every stage, and so every module that registers, before it validates), so a
new one needs no edit to config.py. verl registers its advantage estimators and policy losses by
name the same way (`register_adv_est`, `register_policy_loss` in verl/trainer/ppo/core_algos.py).

Plain Python (no torch): config.py reads the names.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, TypeVar

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


def names() -> dict[str, tuple[str, ...]]:
    """Every registry's names by kind, of the modules imported so far."""
    return {kind: r.names() for kind, r in _ALL.items()}


def declared(kind: str, name: str) -> Mapping[str, Any] | None:
    """The facts `name` of `kind` declared at registration; None while no module imported so far
    registered it. config.py's checks that need a fact wait for it then: the stages' load_params
    imports every registering module before it builds the params, and names an unknown name."""
    registry = _ALL.get(kind)
    return registry._facts.get(name) if registry is not None else None
