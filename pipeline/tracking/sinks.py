"""Metric names and sinks.

The local files are the record DVC reads and are always written, and written first: a per-step TSV
per series (registered as DVC plots) and the stage's `metrics.json` (read by `dvc metrics` /
`dvc exp show`). Each is rewritten atomically, so a crash leaves the last complete version.

Every metric name, its meaning and the file it goes to is declared beside the code that writes it
(metric_names.py says how); pipeline/stages/registry.py gathers the declarations, docs/metrics.md
is generated from them and a test checks both against what a run writes.

MLflow, the second sink, lives in `mlflow_sink.py` (models: `mlflow_models.py`); it never delays or loses these files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from ..files import atomic_write_json, atomic_write_text


# ---- Sinks ----------------------------------------------------------------------------------------


class Tracker:
    """The no-op tracker: what a stage gets when MLflow tracking is off. `MlflowTracker` is the real one."""

    enabled = False

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Buffer metrics of `step`; they are sent at the next `flush`."""

    def flush(self) -> None:
        """Send the buffered metrics."""

    def log_final(self, metrics: Mapping[str, Any]) -> None:
        """The stage's final metrics (what `metrics.json` holds)."""

    def log_artifacts(self, path: Path, artifact_path: str | None = None) -> None:
        """Upload the folder `path` under `artifact_path`."""

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Upload the file `path`."""

    def log_figure(self, figure: Any, name: str) -> None:
        """A matplotlib figure the stage drew (and saved as `name`), as a figure of the run."""

    def log_table(self, rows: Mapping[str, Any], name: str) -> None:
        """Columns of equal length (a dict of lists) as a table named `name` (e.g. samples.json)."""

    def mark_resumed(self, step: int) -> None:
        """This run continues an interrupted one from `step` (MLflow: links the two runs)."""

    def restart(self, why: str) -> None:
        """The stage abandons what it trained so far and trains again from step 1 (a restart check,
        training/restart.py). MLflow: the abandoned attempt's run ends KILLED with `why`, and a new
        run of the stage takes the rest, so no run holds two points at one step of a series."""

    def set_description(self, text: str) -> None:
        """Describe the pipeline execution (MLflow: the parent run's description)."""

    def alias_evaluated(self, stage: str, name: str, alias: str) -> None:
        """Name the model `stage` registered as `name` in this execution `alias` (MLflow: a registry alias)."""

    def log_outputs(self, out: Path) -> None:
        """The stage's checkpoint `out/model` (as artifact path `model`) and its top-level files."""
        if (out / "model").is_dir():
            self.log_artifacts(out / "model", "model")
        for path in sorted(out.iterdir()):
            if path.is_file() and path.suffix in (".png", ".tsv", ".json", ".md"):
                self.log_artifact(path)


NO_TRACKER = Tracker()


class StepLog:
    """One TSV file of per-step rows with a fixed column order (given, or the first row's keys).

    Rows are also given to `tracker` as `<series>/<column>` (see the module doc) and sent to it
    after each flush of the file."""

    def __init__(self, path: Path, columns: list[str] | None = None, tracker: Tracker | None = None,
                 series: str = "", write: bool = True):
        self.path = Path(path)
        # Which rows go to the tracker (all by default). A log that outlives a restart (the restart
        # check's own) sends only the current attempt's: the abandoned ones are in their own runs.
        self.tracked: Callable[[Mapping[str, Any]], bool] = lambda row: True
        self.write = write  # False on every rank but 0 of a multi-process run: one writer per file
        self.columns = ["step", *columns] if columns is not None else None
        self.rows: list[dict[str, Any]] = []
        self.tracker = tracker if tracker is not None else NO_TRACKER
        self.series = series

    def metric_name(self, column: str) -> str:
        return column if "/" in column or not self.series else f"{self.series}/{column}"

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.columns is None:
            self.columns = ["step", *metrics]
        unknown = set(metrics) - set(self.columns)
        if unknown:
            raise KeyError(f"{self.path.name}: metrics {sorted(unknown)} are not columns of this log")
        self.rows.append({"step": step, **metrics})
        if self.tracked(self.rows[-1]):
            self.tracker.log_metrics(step, {self.metric_name(k): v for k, v in metrics.items()})

    def restore(self, rows: list[dict[str, Any]], columns: list[str] | None = None) -> None:
        """Take over the rows of an interrupted run (resume); the tracker's new run gets them too.
        `columns` (with "step") keeps the interrupted run's column order."""
        self.rows = []
        self.columns = list(columns) if columns else (list(rows[0]) if rows else self.columns)
        for row in rows:   # a checkpoint's strict JSON holds a NaN or inf as null: it comes back as NaN
            self.log(row["step"], {k: float("nan") if v is None else v for k, v in row.items() if k != "step"})

    def flush(self) -> None:
        if self.columns is None or not self.write:
            return
        lines = ["\t".join(self.columns)]
        for row in self.rows:
            lines.append("\t".join(_fmt(row.get(c, "")) for c in self.columns))
        atomic_write_text(self.path, "\n".join(lines) + "\n")
        self.tracker.flush()


def _fmt(value: Any) -> str:
    return f"{value:.6g}" if isinstance(value, float) else str(value)


def write_metrics(path: Path, metrics: Mapping[str, Any], tracker: Tracker | None = None) -> None:
    """`metrics.json`, nested by the `/` in metric names so `dvc exp show` groups them; then the
    tracker's final metrics."""
    nested: dict[str, Any] = {}
    for name, value in metrics.items():
        node = nested
        *parents, leaf = name.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    atomic_write_json(path, nested)
    (tracker or NO_TRACKER).log_final(metrics)
