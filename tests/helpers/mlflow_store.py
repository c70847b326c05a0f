"""MLflow for the tracking tests (tests/unit/test_tracking.py and tests/system/test_tracking_runs.py):
tracking on in a clean environment, a real `mlflow server`, and readers of what a run logged."""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import mlflow.artifacts
import pytest
from mlflow import MlflowClient

from conftest import BIN, free_port
from pipeline.tracking import mlflow_sink as tracking


@pytest.fixture(autouse=True)
def tracking_env(monkeypatch):
    """Tracking on, no parent or DVC context from outside; MLflow's HTTP settings the tracker sets
    with setdefault are undone after each test."""
    for name in ("MLFLOW_PARENT_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_TRACKING_URI", "DVC_ROOT", "DVC_STAGE",
                 "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV", "RANK", *tracking.HTTP_DEFAULTS):
        monkeypatch.setenv(name, "x")     # recorded, so the teardown restores the outside value
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIPELINE_TRACKING", "on")


class Server:
    """`mlflow server` on a free localhost port, SQLite backend and proxied artifacts under `root`."""

    def __init__(self, root: Path):
        root.mkdir(parents=True)
        self.port = free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        # Its background job runners are seven more processes a test doesn't need.
        env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
        self.log = open(root / "server.log", "w")
        # A session of its own: the server forks uvicorn, and kill() must end both.
        self.proc = subprocess.Popen(
            [str(BIN / "mlflow"), "server", "--backend-store-uri", f"sqlite:///{root}/db.sqlite",
             "--artifacts-destination", str(root / "art"), "--host", "127.0.0.1", "--port", str(self.port),
             "--workers", "1"], stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"mlflow server exited {self.proc.returncode}: {Path(self.log.name).read_text()}")
            try:
                with urllib.request.urlopen(self.uri + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise AssertionError(f"mlflow server not healthy after {timeout}s: {Path(self.log.name).read_text()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


@pytest.fixture
def server(tmp_path):
    srv = Server(tmp_path / "mlflow")
    yield srv
    srv.kill()


def tsv(path: Path) -> list[dict[str, str]]:
    header, *rows = path.read_text().splitlines()
    return [dict(zip(header.split("\t"), row.split("\t"))) for row in rows]


def registered_weights(client: MlflowClient, run_id: str, dest: Path) -> Path:
    """model.safetensors of the model version registered from run `run_id`, downloaded to `dest`."""
    (version,) = client.search_model_versions(f"run_id = '{run_id}'")
    folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(dest),
                                                      tracking_uri=client.tracking_uri))
    (weights,) = [p for p in folder.rglob("model.safetensors")]
    return weights
