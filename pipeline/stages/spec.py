"""What a stage reads, declared once.

Each stage module has a `SPEC`: the params sections and dotted keys it reads (spelled as dvc.yaml's
`params:` lists them) and its input folders. From the declaration come
- the params the stage's code sees: `declared(params, spec)` is a view that raises
  `UndeclaredParam` on any key the declaration omits, so code cannot read a param that DVC would
  not re-run the stage for;
- the resolved config: `resolve(params, spec)`, written as the stage's config.json, logged as its
  MLflow params and hashed into the resume fingerprint;
- dvc.yaml's `params:` of the stage, which tests/unit/test_stage_declarations.py checks against it.

A distributed stage's own `<stage>.distributed` (the training stages', evaluate's and compare's) is
merged over the top-level `distributed` section when params are loaded (config.merge_distributed),
so such a stage declares `distributed` too.

The SPEC is the stage's whole description, read by everything that lists stages
(pipeline/stages/registry.py finds them): its command-line help and input folders (whose
defaults are where the stage of that name writes, `default_path`), whether it trains or measures
(and so runs on the section's devices), when its batch shape is checked, which pipeline it belongs
to and whether it writes a policy that the compare stage measures, its MLflow headline metrics, its
memory plan, its metric declarations and its console summary. Every stage module's `run` has one
signature: `run(params, *folders, out, progress=True, **options)`, the folders in `inputs` order
and `options` the stage's own command-line options (`add_options`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Literal, Mapping, Optional

from ..config import Params, to_dict
from ..tracking.model_card import ModelFacts

ALL = None   # a leaf of the allowed tree: everything below it is declared


class UndeclaredParam(RuntimeError):
    """Stage code read a param its SPEC does not declare (a bug in the stage, not in params)."""


def reads_held_out_prompts(params: Params, data_dir: Path) -> None:
    """`check_inputs` of a stage whose only input of its own is the held-out prompts (the measuring
    stages): reads, and so validates, them."""
    from ..data import inputs
    inputs.prompts(params, data_dir, "eval")


def default_path(folder: str) -> str:
    """Where an input folder is by default: what the stage of that name writes (`data` is the
    prepare stage's output; a model is its stage's `model/`), as dvc.yaml passes it."""
    return "data/prepared" if folder == "data" else f"outputs/{folder}/model"


@dataclass(frozen=True)
class StageSpec:
    name: str                   # the DVC stage, `python -m pipeline <name>` and the params section
    reads: tuple[str, ...]      # params sections or dotted keys, as in dvc.yaml's `params:`
    inputs: tuple[str, ...]     # command-line folders it reads (`--data`, `--sft`, ...), defaults by default_path
    training: bool = False      # trains (a checkpointed loop, a memory plan checked before it builds a model)
    measuring: bool = False     # measures policies on its section's `distributed` devices without training
    help: str = ""              # one line: `python -m pipeline --help`
    out: Optional[str] = None   # its output folder by default (None: outputs/<name>)
    # When its batch sizes are checked against its process count: "load" when the params file is
    # loaded (the default pipeline's stages, so a bad setup fails before anything runs), "start"
    # when the stage starts (compare/dvc.yaml's methods: a distributed setup for the default
    # pipeline is not refused over the sizes of stages it does not run); None: no batches.
    shape: Optional[Literal["load", "start"]] = None
    pipeline: Literal["default", "compare"] = "default"   # dvc.yaml, or compare/dvc.yaml
    policy: bool = False        # writes a policy (model/) that the compare stage measures as a method
    headline: tuple[str, ...] = ()   # metrics.json names (fnmatch patterns) copied to the MLflow parent run,
    headline_prefixed: bool = True   # as `<stage>/<name>`; False: names that already say the policy (evaluate's)
    parent_params: tuple[str, ...] = ()   # its knobs (dotted params) copied to the MLflow parent run
    model: Optional[ModelFacts] = None    # what its model/ is: its card's words, its MLflow registered model
    # (params, data folder) -> None: reads, and so validates, every input the stage reads from its
    # data folder and the user's datasets, as it does before its first step (`python -m pipeline
    # check --data`); None: it reads none of its own.
    check_inputs: Optional[Callable[[Any, Path], None]] = None
    out_help: str = "the folder the stage writes its outputs to"   # --out's help
    # (params, shapes) -> a memory_plan.Planner of its own section, or None while an input is missing;
    # `shapes` gives the models by folder name (memory_plan.PredictedShapes / FolderShapes).
    plan: Optional[Callable[..., Any]] = None
    metrics: Optional[Callable[[], list]] = None   # () -> its metric_names.Metric declarations (stages/metric_registry.py)
    files: Mapping[str, str] = field(default_factory=dict)   # docs/metrics.md: a note per file it writes
    notes: str = ""             # docs/metrics.md: what follows the stage's tables
    # (metrics, folders) -> the lines printed when it finishes (`folders`: its inputs by name and
    # "out"); None: "wrote <out>", its eval/* values and those of its own policy (<name>/*)
    summary: Optional[Callable[[dict, dict], list[str]]] = None
    add_options: Optional[Callable[[Any], None]] = None   # (argparse parser) -> its own options

    @property
    def distributed(self) -> bool:
        """Runs in a distributed session of its own section's `distributed` settings (and so on
        the GPUs it is given)."""
        return self.training or self.measuring

    @property
    def output(self) -> str:
        return self.out or f"outputs/{self.name}"

    def console(self, metrics: dict, folders: dict[str, Path]) -> list[str]:
        """What the command prints when the stage has finished (rank 0)."""
        if self.summary is not None:
            return self.summary(metrics, folders)
        return [f"{self.name}: wrote {folders['out']}; " + ", ".join(f"{k}={v:.3f}" for k, v in metrics.items()
                                                         if k.startswith(("eval/", f"{self.name}/"))
                                                         and isinstance(v, (int, float)))]

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


def declared_of_type(params: Params, spec: StageSpec, cls: type) -> dict[str, Any]:
    """The values of type `cls` in what the stage declares, by dotted key: e.g. every sampling
    section it reads, `{"rs.sampling": ..., "prompts.sampling": ...}`, for errors that name the key."""
    def within(value: Any, key: str) -> dict[str, Any]:
        if isinstance(value, cls):
            return {key: value}
        if not dataclasses.is_dataclass(value):
            return {}
        return {k: v for f in dataclasses.fields(value)
                for k, v in within(getattr(value, f.name), f"{key}.{f.name}").items()}

    def walk(obj: Any, tree: dict[str, Any], prefix: str) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for name, sub in sorted(tree.items()):
            value = getattr(obj, name)
            found.update(within(value, prefix + name) if sub is ALL else walk(value, sub, f"{prefix}{name}."))
        return found
    return walk(params, spec.allowed(), "")


def resolve(params: Params, spec: StageSpec) -> dict[str, Any]:
    """The declared params as plain nested data (sections and keys as declared)."""
    def plain(value: Any) -> Any:
        if dataclasses.is_dataclass(value):
            return to_dict(value)
        return list(value) if isinstance(value, tuple) else value

    def walk(obj: Any, tree: dict[str, Any]) -> dict[str, Any]:
        return {k: plain(getattr(obj, k)) if sub is ALL else walk(getattr(obj, k), sub) for k, sub in sorted(tree.items())}
    return walk(params, spec.allowed())
