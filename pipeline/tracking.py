"""Metric names and sinks.

The local files are the record DVC reads and are always written: a per-step TSV per series
(registered as DVC plots) and the stage's `metrics.json` (read by `dvc metrics` / `dvc exp show`).
Each is rewritten atomically, so a crash leaves the last complete version, never half a file.

Metric names of the SFT stage:
| name | meaning |
| --- | --- |
| `train/loss` | mean cross-entropy per response token of the optimizer step's batch |
| `train/lr`, `train/grad_norm` | learning rate of the step; gradient norm before clipping |
| `eval/loss` | cross-entropy per response token on the held-out demonstrations |
| `eval/gold_greedy`, `eval/gold_sampled` | mean gold score of greedy / sampled responses to evaluation prompts |
| `eval/gold_demonstrations` | mean gold score of the held-out demonstrations (what SFT imitates) |
| `eval/well_formed_greedy`, `eval/well_formed_sampled` | rate of grammatical reviews that end with a closing sentence |
| `eval/eos_rate_greedy`, `eval/eos_rate_sampled` | rate of responses that emit the end-of-response token |
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from .io import atomic_write_json, atomic_write_text


class StepLog:
    """One TSV file of per-step rows with a fixed column order (given, or the first row's keys)."""

    def __init__(self, path: Path, columns: list[str] | None = None):
        self.path = Path(path)
        self.columns = ["step", *columns] if columns is not None else None
        self.rows: list[dict[str, Any]] = []

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.columns is None:
            self.columns = ["step", *metrics]
        unknown = set(metrics) - set(self.columns)
        if unknown:
            raise KeyError(f"{self.path.name}: metrics {sorted(unknown)} are not columns of this log")
        self.rows.append({"step": step, **metrics})

    def flush(self) -> None:
        if self.columns is None:
            return
        lines = ["\t".join(self.columns)]
        for row in self.rows:
            lines.append("\t".join(_fmt(row.get(c, "")) for c in self.columns))
        atomic_write_text(self.path, "\n".join(lines) + "\n")


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def write_metrics(path: Path, metrics: Mapping[str, Any]) -> None:
    """`metrics.json`, nested by the `/` in metric names so `dvc exp show` groups them."""
    nested: dict[str, Any] = {}
    for name, value in metrics.items():
        node = nested
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    atomic_write_json(path, nested)
