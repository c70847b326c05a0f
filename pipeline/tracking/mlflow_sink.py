"""MLflow: the second sink of tracking.py, for browsing and comparing runs.

MLflow is a second sink, for browsing and comparing runs; it never delays or loses the local files.
- Runs: one parent per pipeline execution, one nested run per stage named after it. A stage's
  parent is env `MLFLOW_PARENT_RUN_ID` (owned by whoever made it); else the run tagged
  `pipeline_execution` = host:pid:start time of the nearest `dvc repro` / `dvc exp` process above
  the stage, found or made under a file lock; else (a stage run by hand) a parent of its own. A
  stage sets such a parent RUNNING when it starts and to its own end status when it ends, so the
  parent ends FINISHED when the last stage did.
- Metrics: a StepLog row is `<series>/<column>` at its step (`train/loss`, `eval/accuracy`); a
  column with a `/` keeps its name (PPO's `objective/kl`; its `lr` becomes `train/lr`). Final
  metrics (`write_metrics`) are logged at the last step, so the runs table shows them.
- Params: the resolved config flattened (`sft.lr`). Artifacts: `model/` and the stage's top-level
  png/tsv/json/md files. Tags: `stage`, `git_commit`, `dvc_exp_name` and `dvc_exp_baseline_rev`
  (set by `dvc exp run`), `deps_hash` and `deps_hash_source` (see `deps_hash`).
- Store: env `MLFLOW_TRACKING_URI`, else SQLite `mlflow.db` at the repository root (an absolute
  URI, so temp and queued experiments write to the workspace's database), artifacts in
  `mlartifacts/` beside it. Experiment: env `MLFLOW_EXPERIMENT_NAME`, else `rlhf-pipeline`.
  `PIPELINE_TRACKING=off` turns MLflow off; only the process with `RANK` unset or 0 logs.
- Orphans and resumes: every run this module makes is tagged `pipeline_process` (host:pid:start of
  the process that ends it: the stage's, or for a parent the `dvc` process). A stage starting on a
  host marks that host's RUNNING runs whose process is gone as KILLED (a SIGKILL or a node failure
  ends a process without ending its run). A stage that resumes a checkpoint tags its run
  `resumed_from` = the killed run of the same stage and fingerprint, which gets `resumed_by`.
  Parent names carry their start time (UTC), so a resumed pipeline's parent is told from the killed one.
- Parent run: the main params (every SPEC's `parent_params`) and headline metrics (its SPEC's `headline`) of
  each stage that ran, so the runs table compares pipelines without expanding each stage.
- Models: `mlflow_models.py` logs and registers the stage's `model/` (transformers flavour for the
  policies, pyfunc for the RM), listed among the run's outputs. Figures go through `log_figure`,
  evaluate's samples through `log_table`, the prepared data as a dataset input whose digest is
  DVC's md5 of it.
- Failures: the first failed MLflow call logs one warning naming the URI and the error and turns
  MLflow off for the rest of the stage. Per-step metrics are buffered and sent in batches when a
  StepLog is flushed, so a tiny run doesn't pay a request per step.
"""

from __future__ import annotations

import contextlib
import fnmatch
import hashlib
import json
import logging
import numbers
import os
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

from ..config import flatten
from ..errors import ConfigError, Stopped
from .model_card import ModelFacts
from .sinks import NO_TRACKER, Tracker
# What joins a run to git and DVC (lineage.py); deps_hash and lock_deps_hash are imported from here too.
from .lineage import (deps_hash, dvc_deps_of, dvc_project, execution_key, git_commit, inputs_hash,  # noqa: F401
                      join_tags, lock_deps_hash, process_alive, process_key, repo_root)

log = logging.getLogger(__name__)

EXPERIMENT = "rlhf-pipeline"
EXECUTION_TAG = "pipeline_execution"
# MLflow retries a failed request 7 times with backoff and waits 120 s for an answer (minutes per
# call in an outage, mlflow/environment_variables.py); one try and a short wait cost seconds.
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}
# SQLite allows one writer at a time; parallel queued experiments may find the database busy for
# longer than its own 5 s wait. Seconds between retries of a call that failed with "database is locked".
SQLITE_BUSY_WAITS = (0.5, 1.0, 2.0, 4.0)
# As measurement/plots.py saves the PNG files, so MLflow's copy is the same picture.
FIGURE_SAVE = {"dpi": 110, "bbox_inches": "tight"}
PROCESS_TAG, FINGERPRINT_TAG = "pipeline_process", "resume_fingerprint"
# Per-request limits of log_batch (mlflow/utils/validation.py).
METRICS_PER_BATCH, PARAMS_PER_BATCH = 1000, 100


# ---- Where MLflow writes (what joins a run to git and DVC is lineage.py's) ------------------------


def tracking_uri() -> str:
    """Env MLFLOW_TRACKING_URI (e.g. a team's server), else `sqlite:////<repo root>/mlflow.db`.
    MLflow 3.13+ refuses the old ./mlruns file store, and a relative URI would split runs by cwd."""
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{repo_root() / 'mlflow.db'}"


def _sqlite_file(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")).resolve() if uri.startswith("sqlite:///") else None


def tracking_enabled() -> bool:
    value = (os.environ.get("PIPELINE_TRACKING") or "on").strip().lower()
    if value not in ("on", "off"):
        raise ConfigError(f"environment variable PIPELINE_TRACKING: expected 'on' or 'off', got {value!r}")
    # Only rank 0 of a multi-process run logs, or every rank would make a run of its own.
    return value == "on" and os.environ.get("RANK", "0") in ("", "0")


def yaml_value(value: Any) -> str:
    """A param value as params.yaml writes it (`null`, `false`, `[4, 16, 64]`), not Python's repr,
    so a filter like `params.ppo.target_kl = 'null'` reads as the file does."""
    if value is None or isinstance(value, (bool, list, tuple, dict)):
        return json.dumps(value)      # JSON's null/true/false, lists and maps are YAML flow style too
    return str(value)


@dataclass(frozen=True)
class StageFacts:
    """What the tracker is told of a stage, by its SPEC (the stage skeleton builds it). The parent run
    gets what tells two pipelines apart (seeds, sizes, the knobs experiments sweep) and what they are
    judged by (gold and RM score per policy, win rates, RM accuracy)."""
    headline: tuple[str, ...] = ()        # metrics.json names (fnmatch patterns) copied to the parent run,
    headline_prefixed: bool = True        # as `<stage>/<name>`; False: names that already say the policy
    parent_params: tuple[str, ...] = ()   # the params (dotted) any stage copies to the parent when its config has them
    model: Optional[ModelFacts] = None    # its model/ folder, logged and registered
    evaluation: bool = False              # its input datasets are evaluation data, not training data


class MlflowTracker(Tracker):
    """The nested MLflow run of one stage. Every MLflow call goes through `_guard`."""

    def __init__(self, uri: str):
        self.uri, self.enabled = uri, True
        self.client: Any = None
        self.stage = ""
        self.facts = StageFacts()
        self.config: Mapping[str, Any] = {}
        self.experiment_id: str | None = None
        self.run_id: str | None = None
        self.parent_id: str | None = None
        self.owns_parent = False          # whether this stage sets the parent's status
        self._pending: list[tuple[str, float, int, int]] = []   # (name, value, time ms, step)
        self._latest: dict[str, tuple[int, float]] = {}          # name -> (step, value) last logged
        self._last_step = 0
        self._figures: set[str] = set()   # file names logged with log_figure
        self.model_id: str | None = None  # the stage's MLflow logged model (stages that register one)
        self._system: Any = None          # MLflow's system metrics monitor of the run
        self._tags: dict[str, str] = {}   # the stage run's tags (a restarted attempt's run gets them too)

    def _guard(self, doing: str, call: Callable[[], Any], soft: bool = False) -> Any:
        """Run one MLflow call; on the first failure warn once and turn this tracker off, so the
        stage goes on at full speed with its local files, which were written before any call.
        `soft`: a call whose failure loses only what it adds (a parent's summary, a model version, a
        link between runs): one warning line, and the stage's own run goes on being logged. A
        failure of the storage itself (an OSError: a full disk, a read-only store) would fail every
        later call too, so it turns the tracker off even then."""
        if not self.enabled:
            return None
        try:
            return _retrying(call)
        except Exception as err:        # noqa: BLE001 -- any failure of this sink must not stop training
            if soft and not isinstance(err, OSError):
                log.warning("MLflow: %s failed (%s: %s)", doing, type(err).__name__,
                            (str(err).splitlines() or [""])[0][:300])
            else:
                self._off(doing, err)
            return None

    def _soft(self, doing: str, call: Callable[[], Any]) -> Any:
        return self._guard(doing, call, soft=True)

    def _off(self, doing: str, err: Exception) -> None:
        self.enabled, self._pending = False, []
        text = (str(err).strip().splitlines() or [""])[0][:600]
        log.warning("MLflow tracking at %s failed while %s (%s: %s); the stage goes on without MLflow, "
                    "its TSV and metrics.json files are unaffected", self.uri, doing, type(err).__name__, text)

    def start(self, stage: str, config: Mapping[str, Any], inputs: Sequence[Path], fingerprint: str = "",
              facts: StageFacts = StageFacts()) -> None:
        self.stage, self.config, self.facts = stage, config, facts
        tags = self._guard("reading git and DVC state", lambda: {**join_tags(), "stage": stage})
        dvc = self._guard("reading DVC's hashes of the stage's deps", lambda: dvc_deps_of(stage)) or []
        digest = self._guard("hashing the stage's inputs", lambda: deps_hash(stage, inputs, dvc))
        self._guard("starting the stage's run", lambda: self._start(stage, config, {
            **tags, "deps_hash": digest[0], "deps_hash_source": digest[1], PROCESS_TAG: process_key(),
            **({FINGERPRINT_TAG: fingerprint} if fingerprint else {})}))
        self._soft("recording the parent's params", lambda: self._log_parent_params(config))
        self._soft("logging the input datasets", lambda: self._log_datasets(stage, inputs, dict(dvc)))

    def _start(self, stage: str, config: Mapping[str, Any], tags: dict[str, str]) -> None:
        for key, value in HTTP_DEFAULTS.items():
            os.environ.setdefault(key, value)
        from filelock import FileLock
        from mlflow import MlflowClient
        # Stages of parallel queued experiments may start at once: one finds-or-creates at a time.
        # The client is made under the lock too: its SQLite store creates the database's tables on
        # first use, and two processes doing that at once fail ("table experiments already exists").
        with FileLock(str(self._lock_path()), timeout=60):
            # The registry in the same store: else MLflow takes the process-wide default (a relative
            # sqlite:///mlflow.db), which in a queued experiment's temporary copy is another database.
            self.client = MlflowClient(self.uri, registry_uri=self.uri)
            exp_id = self.experiment_id = self._experiment_id()
            self._soft("marking orphaned runs KILLED", lambda: self._reap_orphans(exp_id))
            self.parent_id, self.owns_parent = self._parent(exp_id, tags)
        self._tags = tags
        self._create_run(stage, config, tags)

    def _create_run(self, stage: str, config: Mapping[str, Any], tags: dict[str, str]) -> None:
        """The stage's own run under `self.parent_id`, with its params, system metrics and logged model."""
        from mlflow.entities import Param
        exp_id = self.experiment_id
        # `mlflow.parentRunId` is the tag MLflow's UI nests runs by (mlflow/utils/mlflow_tags.py).
        run = self.client.create_run(exp_id, run_name=stage, tags={**tags, "mlflow.parentRunId": self.parent_id})
        self.run_id = run.info.run_id
        self._soft("starting the system metrics monitor", self._start_system_metrics)
        params = [Param(k, yaml_value(v)) for k, v in flatten(config).items()]
        from . import mlflow_models
        if self.facts.model is not None and mlflow_models.enabled():
            # The stage's model exists from the start, with the run's params, so every metric point
            # is linked to it; its files come with log_outputs, which marks it READY.
            self.model_id = self._soft("creating the stage's logged model", lambda: mlflow_models.create_logged(
                self.client, exp_id, self.run_id, stage, {p.key: p.value for p in params},
                {k: v for k, v in tags.items() if not k.startswith("mlflow.")}))
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i:i + PARAMS_PER_BATCH])

    def _lock_path(self) -> Path:
        """Next to the SQLite file; for a server, in the temp dir (execution keys are per host)."""
        db = _sqlite_file(self.uri)
        if db is not None:
            return db.with_name(db.name + ".lock")
        digest = hashlib.sha256(self.uri.encode()).hexdigest()[:16]
        return Path(tempfile.gettempdir()) / f"pipeline-mlflow-{digest}.lock"

    def _experiment_id(self) -> str:
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or EXPERIMENT
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        db = _sqlite_file(self.uri)
        # A server stores artifacts where it was told to; with SQLite they go beside the database.
        location = (db.parent / "mlartifacts").as_uri() if db is not None else None
        return self.client.create_experiment(name, artifact_location=location)

    def _reap_orphans(self, exp_id: str) -> list[str]:
        """Mark KILLED the RUNNING runs of this host whose process is gone; their ids. Runs of other
        hosts are left alone: from here nobody can tell a live process there from a dead one."""
        host = socket.gethostname().replace("'", "")
        found = self.client.search_runs([exp_id], f"attributes.status = 'RUNNING' and tags.{PROCESS_TAG} LIKE '{host}:%'",
                                        max_results=1000)
        reaped = []
        for run in found:
            key = run.data.tags.get(PROCESS_TAG, "")
            if process_alive(key) is False:
                self.client.set_tag(run.info.run_id, "pipeline_end", f"its process {key} ended without ending "
                                    f"the run (killed); marked KILLED by the next stage to start on this host")
                self.client.set_terminated(run.info.run_id, "KILLED")
                reaped.append(run.info.run_id)
        if reaped:
            log.warning("MLflow: marked %d run(s) KILLED whose process was killed: %s", len(reaped), ", ".join(reaped))
        return reaped

    def _parent(self, exp_id: str, tags: dict[str, str]) -> tuple[str, bool]:
        """(parent run id, whether this stage sets its status); the order is in the module doc."""
        if os.environ.get("MLFLOW_PARENT_RUN_ID"):
            return os.environ["MLFLOW_PARENT_RUN_ID"], False
        key = execution_key()
        if key is not None:
            found = self.client.search_runs([exp_id], f"tags.{EXECUTION_TAG} = '{key}'", max_results=1)
            if found:
                if found[0].info.status != "RUNNING":
                    self.client.update_run(found[0].info.run_id, status="RUNNING")
                return found[0].info.run_id, True
        label = tags.get("dvc_exp_name") or tags.get("git_commit", "")[:7] or "outside git"
        parent_tags = {k: v for k, v in tags.items() if k not in ("stage", "deps_hash", "deps_hash_source",
                                                                  FINGERPRINT_TAG)}
        if key is not None:
            parent_tags[EXECUTION_TAG] = parent_tags[PROCESS_TAG] = key   # the dvc process ends it
        started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
        return self.client.create_run(exp_id, run_name=f"pipeline {label} {started}",
                                      tags=parent_tags).info.run_id, True

    def _log_parent_params(self, config: Mapping[str, Any]) -> None:
        """The main params (`StageFacts.parent_params`) this stage's config has, on the parent run."""
        from mlflow.entities import Param
        flat = flatten(config)
        params = [Param(k, yaml_value(flat[k])) for k in self.facts.parent_params if k in flat]
        if params and self.parent_id is not None and not os.environ.get("MLFLOW_PARENT_RUN_ID"):
            have = self.client.get_run(self.parent_id).data.params
            params = [p for p in params if p.key not in have]   # logged by an earlier stage; params are immutable
            if params:
                self.client.log_batch(self.parent_id, params=params)

    def _log_datasets(self, stage: str, inputs: Sequence[Path], dvc: dict[str, str]) -> None:
        """Each data input (a folder or file that holds no model weights) as a dataset input of the
        run: name, source path, digest = DVC's md5 of it when DVC runs the stage (what dvc.lock
        records), else a sha256 prefix of its files (tag `digest_source` says which)."""
        from mlflow.entities import Dataset, DatasetInput, InputTag
        datasets = []
        for path in map(Path, inputs):
            if path.is_dir() and any((path / f).exists() for f in ("model.safetensors", "adapter_model.safetensors",
                                                                     "model.safetensors.index.json")):
                continue
            rel = _relative(path)
            digest, source = (dvc[rel], "dvc") if rel in dvc else (inputs_hash([path])[:32], "sha256")
            datasets.append(DatasetInput(
                Dataset(name=path.name, digest=digest[:36], source_type="local", source=json_source(path)),
                tags=[InputTag("mlflow.data.context", "evaluation" if self.facts.evaluation else "training"),
                      InputTag("digest_source", source)]))
        if datasets:
            self.client.log_inputs(self.run_id, datasets=datasets)

    def log_metrics(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        now = int(time.time() * 1000)
        for name, value in metrics.items():
            if isinstance(value, numbers.Real):
                self._pending.append((name, float(value), now, int(step)))
                self._latest[name] = (int(step), float(value))
        self._last_step = max(self._last_step, int(step))

    def flush(self) -> None:
        if not self.enabled or not self._pending:
            return
        from mlflow.entities import Metric
        pending, self._pending = self._pending, []
        # Linked to the stage's logged model (when it makes one): MLflow's Models tab shows and
        # compares a model's metrics by this link.
        metrics = [Metric(name, value, ts, step, model_id=self.model_id) for name, value, ts, step in pending]
        for i in range(0, len(metrics), METRICS_PER_BATCH):
            self._guard("sending metrics", lambda i=i: self.client.log_batch(
                self.run_id, metrics=metrics[i:i + METRICS_PER_BATCH]))

    def series_name(self, name: str) -> str:
        """The per-step series a final metric repeats, when there is one: metrics.json can't hold a
        `/` inside a key, so PPO's final `objective/kl` is `train/objective_kl` there; in MLflow it
        stays one metric, `objective/kl`, whose last point is the final value."""
        if name in self._latest or not name.startswith("train/"):
            return name
        rest = name.removeprefix("train/")
        for i, char in enumerate(rest):
            if char == "_" and f"{rest[:i]}/{rest[i + 1:]}" in self._latest:
                return f"{rest[:i]}/{rest[i + 1:]}"
        return name

    def log_final(self, metrics: Mapping[str, Any]) -> None:
        """At the last step logged, so the runs table shows them, under their series' names; a
        value that equals the series' point at that step (SFT's final `train/loss` is its last
        step's) isn't logged twice. The headline ones also go to the parent run."""
        step = self._last_step
        final = {self.series_name(k): float(v) for k, v in metrics.items() if isinstance(v, numbers.Real)}
        self.log_metrics(step, {k: v for k, v in final.items() if self._latest.get(k) != (step, v)})
        self.flush()
        self._soft("copying headline metrics to the parent run", lambda: self._log_headline(metrics))

    def _log_headline(self, metrics: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric
        if self.parent_id is None or os.environ.get("MLFLOW_PARENT_RUN_ID"):
            return   # a parent the user made is theirs to fill
        prefix = f"{self.stage}/" if self.facts.headline_prefixed else ""
        now = int(time.time() * 1000)
        chosen = [Metric(prefix + k, float(v), now, 0) for k, v in metrics.items()
                  if isinstance(v, numbers.Real) and any(fnmatch.fnmatchcase(k, pat) for pat in self.facts.headline)
                  and not k.endswith("_ci95")]
        if chosen:
            self.client.log_batch(self.parent_id, metrics=chosen)

    def log_artifacts(self, path: Path, artifact_path: str | None = None) -> None:
        self._guard(f"uploading {path}", lambda: self.client.log_artifacts(self.run_id, str(path), artifact_path))

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self._guard(f"uploading {path}", lambda: self.client.log_artifact(self.run_id, str(path), artifact_path))

    def log_figure(self, figure: Any, name: str) -> None:
        """A figure the stage drew, with MLflow's log_figure; `log_outputs` then skips its PNG file."""
        self._guard(f"logging the figure {name}", lambda: self.client.log_figure(
            self.run_id, figure, name, save_kwargs=FIGURE_SAVE))
        self._figures.add(name)

    def log_table(self, rows: Mapping[str, Sequence[Any]], name: str) -> None:
        """Columns of equal length as an MLflow table (`name`.json; the UI's table viewer)."""
        self._guard(f"logging the table {name}", lambda: self.client.log_table(self.run_id, dict(rows), name))

    def log_outputs(self, out: Path) -> None:
        """The stage's model as a registered MLflow model (policies and RM), then its top-level files
        as artifacts, except the figures already logged with `log_figure`."""
        from . import mlflow_models
        if (out / "model").is_dir() and self.model_id is not None:   # made at the start: a registered stage
            tags = {k: v for k, v in join_tags().items() if not k.startswith("mlflow.")}
            version = self._soft(f"registering the {self.stage} model", lambda: mlflow_models.log_and_register(
                self.client, self.run_id, self.stage, self.facts.model, out / "model", flatten(self.config),
                {**tags, "stage": self.stage}, self.model_id, self._last_step))
            if version is not None:
                self._guard("tagging the model version", lambda: self.client.set_tag(
                    self.run_id, "registered_model", f"{self.facts.model.registered}/{version}"))
                log.info("MLflow: registered %s version %s (model %s)", self.facts.model.registered,
                         version, self.model_id)
        for path in sorted(out.iterdir()):
            if path.is_file() and path.suffix in (".png", ".tsv", ".json", ".md") and path.name not in self._figures:
                self.log_artifact(path)

    def mark_resumed(self, step: int) -> None:
        """This run continues a killed one: link the two (`resumed_from`, `resumed_by`); the killed
        one is the latest ended run of this stage with the same resume fingerprint."""
        def call() -> None:
            fp = self.client.get_run(self.run_id).data.tags.get(FINGERPRINT_TAG)
            if not fp:
                return
            found = self.client.search_runs(
                [self.experiment_id], f"tags.stage = '{self.stage}' and tags.{FINGERPRINT_TAG} = '{fp}' "
                f"and attributes.status != 'RUNNING' and attributes.status != 'FINISHED'",
                order_by=["attributes.start_time DESC"], max_results=5)
            previous = next((r for r in found if r.info.run_id != self.run_id), None)
            self.client.set_tag(self.run_id, "resumed_at_step", str(step))
            if previous is not None:
                self.client.set_tag(self.run_id, "resumed_from", previous.info.run_id)
                self.client.set_tag(previous.info.run_id, "resumed_by", self.run_id)
        self._soft("linking the resumed run to the killed one", call)

    def restart(self, why: str) -> None:
        """The abandoned attempt's run ends KILLED, tagged `pipeline_end` = `why`; a new run of the
        stage (same params and tags, under the same parent) takes the next attempt. The two are
        linked (`restarted_by`, `restart_of`), as a resumed run is to the one it continues."""
        if not self.enabled:
            return
        abandoned = self.run_id
        self._end_run("KILLED")
        self._guard("ending the abandoned attempt's run", lambda: self.client.set_tag(abandoned, "pipeline_end", why))
        self._pending, self._latest, self._last_step, self._figures = [], {}, 0, set()
        self.model_id = self._system = None
        self._guard("starting the restarted run", lambda: self._create_run(
            self.stage, self.config, {**self._tags, "restart_of": abandoned}))
        self._soft("linking the abandoned run to the restarted one",
                   lambda: self.client.set_tag(abandoned, "restarted_by", self.run_id))

    def alias_evaluated(self, stage: str, name: str, alias: str) -> None:
        """Point `alias` (e.g. `champion`) of `stage`'s registered model `name` at the version this
        pipeline execution registered (the run beside this one under the same parent), else at its
        newest: evaluate points `models:/rlhf-policy@champion` at the policy it judged, when its verdict
        is OK (stages/evaluate.py `name_champion`)."""

        def call() -> None:
            versions = self.client.search_model_versions(f"name = '{name}'")
            if not versions:
                return
            siblings = {r.info.run_id for r in self.client.search_runs(
                [self.experiment_id], f"tags.mlflow.parentRunId = '{self.parent_id}' and tags.stage = '{stage}'")} \
                if self.parent_id else set()
            mine = [v for v in versions if v.run_id in siblings]
            chosen = max(mine or versions, key=lambda v: int(v.version))
            self.client.set_registered_model_alias(name, alias, chosen.version)
            log.info("MLflow: %s@%s is version %s", name, alias, chosen.version)
        self._soft(f"setting the alias {alias} of {name}", call)

    def set_description(self, text: str) -> None:
        """The parent run's description: MLflow's UI shows the tag `mlflow.note.content` as the run's
        note (mlflow/utils/mlflow_tags.py); evaluate puts its verdict there."""
        if self.parent_id is not None:
            self._guard("describing the parent run", lambda: self.client.set_tag(
                self.parent_id, "mlflow.note.content", text))

    def _start_system_metrics(self) -> None:
        """MLflow's CPU, memory, disk, network (and with pynvml GPU) series of the stage's process,
        `system/*`, every MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL seconds (MLflow's default 10);
        MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING=false turns them off."""
        if os.environ.get("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "true").strip().lower() in ("false", "0", "off"):
            return
        from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        # Its start and stop notices (INFO) are noise in a stage's log.
        logging.getLogger("mlflow.system_metrics").setLevel(logging.WARNING)
        interval = float(os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL") or 10)
        self._system = SystemMetricsMonitor(self.run_id, sampling_interval=interval, tracking_uri=self.uri)
        self._system.start()

    def finish(self, status: str) -> None:
        self._end_run(status)
        if self.owns_parent:
            self._guard("ending the parent run", lambda: self.client.set_terminated(self.parent_id, status))

    def _end_run(self, status: str) -> None:
        """End the stage's current run (not the parent): its system metrics, buffered points, logged model."""
        if self._system is not None:
            self._soft("stopping the system metrics monitor", self._system.finish)
        self.flush()
        if self.model_id is not None and status != "FINISHED":   # log_outputs never ran: no files
            self._soft("marking the logged model failed",
                       lambda: self.client.finalize_logged_model(self.model_id, "FAILED"))
        self._guard("ending the stage's run", lambda: self.client.set_terminated(self.run_id, status))


def _retrying(call: Callable[[], Any]) -> Any:
    """`call()`, retried while SQLite is busy: parallel queued experiments may find the database
    locked by another writer for longer than its own 5 s wait."""
    for wait in SQLITE_BUSY_WAITS:
        try:
            return call()
        except Exception as err:        # noqa: BLE001 -- re-raised below unless it is the busy lock
            if "database is locked" not in str(err):
                raise
            time.sleep(wait)            # another process holds SQLite's write lock: wait, then retry
    return call()


def _relative(path: Path) -> str:
    """`path` as dvc.yaml names it: relative to the DVC project when inside it."""
    root = dvc_project()
    try:
        return Path(path).resolve().relative_to(root).as_posix() if root else str(path)
    except ValueError:
        return str(path)


def json_source(path: Path) -> str:
    return json.dumps({"uri": Path(path).resolve().as_uri()})


@contextlib.contextmanager
def stage_tracking(stage: str, config: Mapping[str, Any], inputs: Sequence[Path] = (),
                   enabled: bool = True, fingerprint: str = "", facts: StageFacts = StageFacts()) -> Iterator[Tracker]:
    """Around the body of a stage's `run`: yields the stage's MLflow tracker, or `NO_TRACKER` when
    tracking is off. `config` is the resolved config the stage writes as config.json (its flattened
    keys are the run's params); `inputs` are the stage's input paths, hashed when DVC isn't running
    the stage. `fingerprint` (the resume fingerprint) tags the run, to link a resumed run to the
    killed one. `facts`: what its SPEC says the parent run, the model registry and the datasets'
    context get. The run ends FINISHED, FAILED (an exception) or KILLED (Ctrl-C). `enabled=False`
    (ranks other than 0 of a multi-process run) yields `NO_TRACKER`."""
    if not enabled or not tracking_enabled():
        yield NO_TRACKER
        return
    tracker = MlflowTracker(tracking_uri())
    tracker.start(stage, config, inputs, fingerprint, facts)
    status = "FAILED"
    try:
        yield tracker
        status = "FINISHED"
    except (KeyboardInterrupt, Stopped):   # Ctrl-C, or a stop signal after the checkpoint was saved
        status = "KILLED"
        raise
    finally:
        tracker.finish(status)
