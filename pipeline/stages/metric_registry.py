"""The metric registry: every stage's metric declarations, docs/metrics.md rendered from them, and
a finished run's files checked against them.

Each stage module declares its names beside the code that writes them (its SPEC's `metrics`,
pipeline/tracking/metric_names.py says how); the stage skeleton adds what every stage's process
cost. Apart from pipeline/stages/registry.py because no stage imports it: the declarations are
documentation, so a stage's DVC code deps (pipeline/workflow/code_deps.py) need not follow them.

    python -m pipeline.stages.metric_registry metrics > docs/metrics.md
    python -m pipeline.stages.metric_registry check outputs [CONDITION ...]
"""

from __future__ import annotations

from ..tracking import metric_names as mn
from .registry import specs
from .skeleton import declared_metrics as resources


REGENERATE = "python -m pipeline.stages.metric_registry metrics > docs/metrics.md"


def stage_metrics() -> list:
    """Each stage's metric declarations (its SPEC's `metrics`, then what the stage skeleton adds
    to every stage: its resources), in pipeline order."""
    out = []
    for name, s in specs().items():
        if s.metrics is None:
            continue
        compare = s.pipeline == "compare"
        title = f"{name} (`{s.output}/`" + (", compare/dvc.yaml)" if compare else ")")
        declared = (*s.metrics(), *resources(name, "compare" if compare else None))
        out.append(mn.StageMetrics(name, title, declared, dict(s.files), s.notes, compare))
    return out


def metrics() -> tuple:
    """Every metric name (or pattern) every stage writes."""
    return tuple(m for st in stage_metrics() for m in st.metrics)


def render_metrics() -> str:
    """The whole of docs/metrics.md."""
    return mn.render_markdown(stage_metrics(), REGENERATE)


def check_run(outputs_dir, conditions=frozenset()) -> tuple[list[str], list[str]]:
    """A finished run's files against the registry: (names written that no stage declares, names
    declared for a run with `conditions` that were not written)."""
    return mn.check_run(outputs_dir, stage_metrics(), conditions)


if __name__ == "__main__":
    import sys
    from pathlib import Path
    usage = "usage: python -m pipeline.stages.metric_registry metrics | check OUTPUTS_DIR [CONDITION ...]"
    if sys.argv[1:2] == ["metrics"]:
        sys.stdout.write(render_metrics())
    elif sys.argv[1:2] == ["check"] and len(sys.argv) >= 3:
        undefined, missing = check_run(Path(sys.argv[2]), frozenset(sys.argv[3:]))
        for line in undefined:
            print(f"not in the registry: {line}")
        for line in missing:
            print(f"not written: {line}")
        sys.exit(1 if undefined or missing else 0)
    else:
        sys.exit(usage)
