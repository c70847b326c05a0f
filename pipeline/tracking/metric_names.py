"""What a metric name is; docs/metrics.md is generated from the names the stages declare.

A `Metric` is one name (or pattern) a stage writes: the stage, the file it is written to
(`metrics.json`, nested by the `/` in names, or a per-step TSV whose header holds the names), its
meaning and the condition under which it is written. Names are declared beside the code that
writes them: each stage module's `declared_metrics()` (its SPEC's `metrics`), built with the
declarations of the shared code it runs: the supervised loop's (training/supervised.py), PPO's
step-log columns (ppo/trainer.py), a sampled policy's (measurement/policy.py) and the stage
skeleton's resources (stages/skeleton.py). pipeline/stages/registry.py gathers them into the
registry (`registry.metrics()`), renders docs/metrics.md (`render_markdown`) and compares a
finished run's files with it (`check_run`):

    python -m pipeline.stages.registry metrics > docs/metrics.md     # regenerate the docs after an edit

Conditions: `None` means always written on the default task with the default params; `"key"` only
when the run has `key`; `"!key"` always unless the run has `key` (the keys are `CONDITIONS`).
Placeholders such as `{n}` in a name match one piece of a path segment (`best_of_{n}/rm` matches
`best_of_4/rm`).

Self-contained (standard library only), so it can move to another package.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import AbstractSet, Iterable, Optional

from ..config import flatten

METRICS_JSON = "metrics.json"


@dataclass(frozen=True)
class StageMetrics:
    """One stage's part of the registry: its names and its sections of docs/metrics.md."""
    stage: str
    title: str                     # its heading
    metrics: tuple["Metric", ...]
    files: dict                    # file -> the note under its heading
    notes: str = ""                # what follows its tables
    compare: bool = False          # compare/dvc.yaml's: a run's check expects it only with `compare`


@dataclass(frozen=True)
class Metric:
    stage: str                       # sft | reward | ppo | evaluate: written under outputs/<stage>/
    file: str                        # metrics.json, or the TSV file whose column this is
    name: str                        # the name, or a pattern with {placeholders}
    meaning: str                     # markdown
    condition: Optional[str] = None  # None: always; "key": only with key; "!key": unless key (CONDITIONS)
    copy_of: Optional[str] = None    # a metrics.json copy of this TSV column's last value (ppo's train/*)

    def satisfied(self, conditions: AbstractSet[str]) -> bool:
        """Whether a run with `conditions` writes this name."""
        if self.condition is None:
            return True
        if self.condition.startswith("!"):
            return self.condition[1:] not in conditions
        return self.condition in conditions

    @property
    def placeholders(self) -> tuple[str, ...]:
        return tuple(re.findall(r"\{(\w+)\}", self.name))

    def regex(self) -> re.Pattern:
        """The name with each placeholder matching one piece of a path segment."""
        parts = re.split(r"\{(\w+)\}", self.name)
        out = []
        for i, part in enumerate(parts):
            out.append(f"(?:{PLACEHOLDERS.get(part, PLACEHOLDER_DEFAULT)})" if i % 2 else re.escape(part))
        return re.compile("".join(out))


# A placeholder matches this within one path segment; specific ones are narrower.
PLACEHOLDER_DEFAULT = r"[^/]+"
PLACEHOLDERS = {"n": r"[1-9][0-9]*"}

# The keys of `Metric.condition`: facts of a run that add names to it or take names away.
CONDITIONS = {
    "no_judge": "no gold annotator: `sft.dataset.path`, `reward.dataset.path` or `ppo.dataset.path` is set (a "
                "task's judge scores only the task's own data), or `data.task` has no judge",
    "custom_pairs": "`reward.dataset.path` is set (your own pairs: no noise ceiling from the prepare stage); "
                    "implies `no_judge`",
    "no_normalize": "`reward.normalize: false`",
    "restart_checked": "the reward run reached `reward.restart.at_step` with `reward.restart.min_accuracy` set (not "
                       "the demo's shorter run)",
    "sft_lora": "`sft.lora.r > 0`",
    "reward_lora": "`reward.lora.r > 0`",
    "no_detector": "`ppo.detector.enabled: false`",
    "auditor": "`ppo.detector.auditor` is set and the detector is enabled",
    "dual_clip": "`ppo.dual_clip` is set",
    "cuda": "the stage's process sees a CUDA device (`torch.cuda.is_available()`)",
    "cpu_matmuls": "`PIPELINE_COUNT_CPU_MATMULS` is set (scripts/gpu_check.py sets it) and the stage's device is "
                   "not the CPU",
    "method_lora": "`lora.r > 0` in the section of a compare/dvc.yaml method (`dpo`, `rs`)",
    "compare": "the alignment methods of compare/dvc.yaml ran (`dvc repro compare/dvc.yaml`, `make compare`)",
    "tis": "`ppo.tis_cap` is set (truncated importance sampling)",
    "quantile_reward": "`ppo.quantile_reward_samples` (`grpo.quantile_reward_samples` for grpo) >= 2: the reward is "
                       "the score's log CDF among the SFT policy's",
}
IMPLIES = {"custom_pairs": ("no_judge",)}


# ---- The registry ---------------------------------------------------------------------------------


# ---- docs/metrics.md ------------------------------------------------------------------------------

INTRO = """\
# Metrics

Every metric a stage writes, what it means and where it is. Per-step series go to the stage's
`*.tsv` files (registered as DVC plots; `step` is the optimizer step, or the PPO iteration); final
values go to `metrics.json` (read by `dvc metrics show` and `dvc exp show`), nested by the `/` in
their names (`eval/accuracy` is `{"eval": {"accuracy": ...}}`). MLflow gets the same values, a TSV
column as `<series>/<column>` (`train/loss`) unless it has a `/` of its own (`objective/kl`). Names
follow TRL's PPO trainer where the quantity is the same.

A policy measured on the held-out prompts has one scheme of names wherever it is measured:
`<policy>/<quantity>` (`ppo/rm`, `ppo/gold`, `ppo/kl`, `ppo/eos_rate`, each mean with its
`_ci95` half-width), where the policy is `sft`, a method (`ppo`, `grpo`, `dpo`, `rs`, `kto`) or
`best_of_<n>`. A training stage measures its own policy under its own name (the PPO stage also
SFT's, as `sft/*`, on the same prompts); the evaluate and compare stages measure every policy on
theirs; the file (or MLflow run) says which stage measured it.

This file is generated from each stage's metric declarations (its SPEC's `metrics`, declared
beside the code that writes them; pipeline/tracking/metric_names.py says where); edit them and run
`REGENERATE`. `tests/unit/test_metric_names.py` fails when the
two differ, or when the committed run in `outputs/` writes a name the registry does not define or
lacks one it defines. The last column says when a name is written: always (default task, default
params), `only with` or `unless` one of the conditions below.
"""

CONDITIONS_HEADING = """\
## Conditions

| condition | the run has it when |
| --- | --- |
"""

def _when(condition: Optional[str]) -> str:
    if condition is None:
        return "always"
    return f"unless `{condition[1:]}`" if condition.startswith("!") else f"only with `{condition}`"


def _files(metrics: Iterable[Metric]) -> list[str]:
    """A stage's files in registry order, metrics.json last."""
    files = list(dict.fromkeys(m.file for m in metrics))
    return [f for f in files if f != METRICS_JSON] + [METRICS_JSON]


def render_markdown(stages: Iterable[StageMetrics], regenerate: str) -> str:
    """The whole of docs/metrics.md (`regenerate`: the command that writes it)."""
    stages = list(stages)
    declared = [m for st in stages for m in st.metrics]
    parts = [INTRO.replace("REGENERATE", regenerate)]
    for st in stages:
        stage = st.stage
        parts.append(f"## {st.title}\n")
        for file in _files(st.metrics):
            parts.append(f"### `{file}`: {st.files[file]}\n")
            rows = ["| name | meaning | written |", "| --- | --- | --- |"]
            copies = []
            for m in declared:
                if m.stage != stage or m.file != file:
                    continue
                if m.copy_of is not None:
                    copies.append(m)
                    continue
                rows.append(f"| `{m.name}` | {m.meaning} | {_when(m.condition)} |")
            if copies:
                source = {m.copy_of for m in copies}
                tsv = next(m.file for m in declared if m.stage == stage and m.name in source and m.copy_of is None)
                rows.insert(2, f"| `train/<column>` | the last row's value of each column of `{tsv}` but `step`, "
                               f"its `/` written `_` (`train/objective_kl`); {len(copies)} names | as the column |")
            parts.append("\n".join(rows) + "\n")
        if st.notes:
            parts.append(st.notes)
    parts.append(CONDITIONS_HEADING + "\n".join(f"| `{k}` | {v} |" for k, v in CONDITIONS.items()) + "\n")
    return "\n".join(parts)


# ---- Checking a finished run ----------------------------------------------------------------------


def emitted(outputs_dir: Path, stages: Iterable[str]) -> dict[tuple[str, str], list[str]]:
    """(stage, file) -> the names a finished run wrote: the flattened keys of each stage's
    metrics.json and the header of each of its TSV files."""
    out: dict[tuple[str, str], list[str]] = {}
    for stage in stages:
        folder = Path(outputs_dir) / stage
        path = folder / METRICS_JSON
        if path.is_file():
            out[(stage, METRICS_JSON)] = list(flatten(json.loads(path.read_text(encoding="utf-8")), sep="/"))
        for tsv in sorted(folder.glob("*.tsv")):
            with tsv.open(encoding="utf-8") as f:
                header = f.readline().rstrip("\n")
            out[(stage, tsv.name)] = header.split("\t") if header else []
    return out


def _placeholder_values(outputs_dir: Path) -> dict[str, list[str]]:
    """Values a placeholder takes in this run, where the run's resolved config says: `{n}` is each
    n of `evaluate.best_of_n` (outputs/evaluate/config.json)."""
    path = Path(outputs_dir) / "evaluate" / "config.json"
    try:
        ns = json.loads(path.read_text(encoding="utf-8"))["evaluate"]["best_of_n"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    return {"n": [str(n) for n in ns]}


def check_run(outputs_dir: Path, stages: Iterable[StageMetrics],
              conditions: AbstractSet[str] = frozenset()) -> tuple[list[str], list[str]]:
    """Compare a finished run under `outputs_dir` (stage folders sft, reward, ppo, evaluate) with
    the registry. Returns (names written that the registry does not define, names the registry
    defines for a run with `conditions` that were not written), each as `<stage>/<file>: <name>`.
    A pattern's placeholders take the run's values where known (`{n}`: evaluate.best_of_n from
    outputs/evaluate/config.json); otherwise one matching name satisfies it."""
    unknown_keys = set(conditions) - set(CONDITIONS)
    if unknown_keys:
        raise ValueError(f"unknown conditions {sorted(unknown_keys)}; known: {', '.join(CONDITIONS)}")
    conditions = set(conditions)
    for key in list(conditions):
        conditions.update(IMPLIES.get(key, ()))
    stages = list(stages)
    declared = [m for st in stages for m in st.metrics]
    compare_stages = {st.stage for st in stages if st.compare}
    written = emitted(outputs_dir, [st.stage for st in stages])
    values = _placeholder_values(outputs_dir)
    undefined, missing = [], []
    for (stage, file), names in written.items():
        entries = [m for m in declared if m.stage == stage and m.file == file]
        for name in names:
            if not any(m.regex().fullmatch(name) for m in entries):
                undefined.append(f"{stage}/{file}: {name}")
    for m in declared:
        if not m.satisfied(conditions) or (m.stage in compare_stages and "compare" not in conditions):
            continue
        names = written.get((m.stage, m.file), [])
        holes = m.placeholders
        if not holes:
            expected = [m.name]
        elif all(h in values for h in holes) and len(set(holes)) == 1:
            expected = [m.name.replace(f"{{{holes[0]}}}", v) for v in values[holes[0]]]
        else:
            if not any(m.regex().fullmatch(n) for n in names):
                missing.append(f"{m.stage}/{m.file}: {m.name}")
            continue
        missing += [f"{m.stage}/{m.file}: {e}" for e in expected if e not in names]
    return undefined, missing
