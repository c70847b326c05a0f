"""MLflow tracking: a real `mlflow server` fed by `dvc exp run` (one parent, nested stage runs, params,
per-step and final metrics, checkpoints, DVC/git tags), a server killed mid-run, an unreachable
server, the default SQLite store at the repository root, and the naming of per-step metrics."""

import hashlib
import json
import math
import logging
import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import mlflow.artifacts
import mlflow.pyfunc
import mlflow.transformers
import pandas as pd
import pytest
import torch
from PIL import Image
from mlflow import MlflowClient
from ruamel.yaml import YAML

from conftest import BIN, TINY, flat, merge, run, run_env, tiny_policy_and_reward_model, write_params
from pipeline.tracking import mlflow_sink as tracking
from pipeline.stages import sft
from pipeline.config import DataConfig, ModelConfig, Params, PPOConfig, SamplingConfig, SFTConfig, load_params
from pipeline.errors import ConfigError
from pipeline.tracking.mlflow_sink import deps_hash, lock_deps_hash, stage_tracking, tracking_uri
from pipeline.stages import ppo as ppo_stage
from pipeline.stages.prepare import write as prepare_run
from pipeline.models.checkpoints import load_policy
from pipeline.models.reward_model import load_reward_model, score_texts
from pipeline.tracking.mlflow_models import REGISTERED
from pipeline.tracking.sinks import NO_TRACKER, StepLog, Tracker, write_metrics

TINY_MODEL = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


@pytest.fixture(autouse=True)
def tracking_env(monkeypatch):
    """Tracking on, no parent or DVC context from outside; MLflow's HTTP settings the tracker sets
    with setdefault are undone after each test."""
    for name in ("MLFLOW_PARENT_RUN_ID", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_TRACKING_URI", "DVC_ROOT", "DVC_STAGE",
                 "DVC_EXP_NAME", "DVC_EXP_BASELINE_REV", "RANK", *tracking.HTTP_DEFAULTS):
        monkeypatch.setenv(name, "x")     # recorded, so the teardown restores the outside value
        monkeypatch.delenv(name)
    monkeypatch.setenv("PIPELINE_TRACKING", "on")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`mlflow server` on a free localhost port, SQLite backend and proxied artifacts under `root`."""

    def __init__(self, root: Path):
        root.mkdir(parents=True)
        self.port = _free_port()
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


def _tsv(path: Path) -> list[dict[str, str]]:
    header, *rows = path.read_text().splitlines()
    return [dict(zip(header.split("\t"), row.split("\t"))) for row in rows]


def test_dvc_exp_run_logs_one_parent_with_nested_stage_runs(tiny_repo, tmp_path, server, monkeypatch):
    head = run(["git", "rev-parse", "HEAD"], tiny_repo).stdout.strip()
    server.wait()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    run([str(BIN / "dvc"), "exp", "run", "-n", "tiny-exp", "reward"], tiny_repo)

    client = MlflowClient(server.uri)
    runs = client.search_runs([client.get_experiment_by_name("rlhf-pipeline").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    # The start time in the name tells a resumed pipeline's parent from the killed one's.
    assert re.fullmatch(r"pipeline tiny-exp \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", parent.info.run_name)
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["pipeline_execution"].count(":") == 2          # host:pid:start time of `dvc exp run`
    stages = {r.info.run_name: r for r in runs if r is not parent}
    assert set(stages) == {"sft", "reward"}
    for name, r in stages.items():
        out = tiny_repo / "outputs" / name
        tags = r.data.tags
        assert tags["mlflow.parentRunId"] == parent.info.run_id and r.info.status == "FINISHED"
        assert (tags["stage"], tags["git_commit"], tags["dvc_exp_name"]) == (name, head, "tiny-exp")
        # The hash DVC recorded for this run's deps in the dvc.lock it wrote after the stage.
        assert tags["deps_hash_source"] == "dvc"
        assert tags["deps_hash"] == lock_deps_hash(tiny_repo / "dvc.lock", name)
        # Per-step metrics: one point per TSV row, at its step.
        for series in ("train", "eval"):
            rows = _tsv(out / f"{series}.tsv")
            history = client.get_metric_history(r.info.run_id, f"{series}/loss")
            assert [m.step for m in history] == [int(row["step"]) for row in rows]
            assert [m.value for m in history] == pytest.approx([float(row["loss"]) for row in rows], rel=1e-5)
        # Final metrics: every number of metrics.json.
        # (null in metrics.json: a metric undefined on this run's data, which MLflow holds as NaN)
        final = {k: math.nan if v is None else v for k, v in flat(json.loads((out / "metrics.json").read_text())).items()}
        assert {k: r.data.metrics[k] for k in final} == pytest.approx(final, nan_ok=True)
        # The checkpoint is a registered model version of this run; the step logs are artifacts.
        (version,) = client.search_model_versions(f"name = '{REGISTERED[name]}'")
        assert (version.run_id, version.version, tags["registered_model"]) == (r.info.run_id, "1", f"{REGISTERED[name]}/1")
        assert {"train.tsv", "eval.tsv", "metrics.json", "config.json"} <= {a.path for a in client.list_artifacts(r.info.run_id)}
        # The prepared data is the run's dataset input; its digest is DVC's md5 of it in dvc.lock.
        (data_input,) = r.inputs.dataset_inputs
        assert (data_input.dataset.name, data_input.dataset.digest) == ("prepared", _lock_md5(tiny_repo, name, "data/prepared"))
        # Headline metrics on the parent, under the stage's name.
        headline = {"sft": "eval/loss", "reward": "eval/accuracy"}[name]
        assert parent.data.metrics[f"{name}/{headline}"] == pytest.approx(final[headline])
    sft_run, rm_run = stages["sft"].data, stages["reward"].data
    params = load_params(tiny_repo / "params.yaml")
    assert sft_run.params["sft.lr"] == str(params.sft.lr) and sft_run.params["model.hidden_size"] == "32"
    assert sft_run.params["sft.sampling.max_new_tokens"] == str(TINY["sft"]["sampling"]["max_new_tokens"])
    assert rm_run.params["reward.batch_size"] == str(TINY["reward"]["batch_size"])
    assert rm_run.params["sft.sampling.temperature"] == str(params.sft.sampling.temperature)
    assert len(client.get_metric_history(stages["sft"].info.run_id, "train/loss")) == 4     # 64 demos / batch 16
    # The calibration figure, logged with log_figure, renders as the PNG the stage wrote.
    assert "calibration.png" in {a.path for a in client.list_artifacts(stages["reward"].info.run_id)}
    logged = client.download_artifacts(stages["reward"].info.run_id, "calibration.png", str(tmp_path / "fig"))
    assert Image.open(logged).size == Image.open(tiny_repo / "outputs/reward/calibration.png").size
    # Param values as params.yaml writes them, not Python's repr; the main params on the parent.
    assert (sft_run.params["model.trust_remote_code"], sft_run.params["sft.sampling.stop_token"]) == ("false", "null")
    assert (parent.data.params["sft.lr"], parent.data.params["reward.seed"]) == (str(params.sft.lr), "0")

    # The registered versions load with MLflow's loaders and give the checkpoints' outputs.
    sft_model, tok = load_policy(tiny_repo / "outputs/sft/model")
    generator = mlflow.transformers.load_model("models:/rlhf-sft-policy/1")
    ids = tok("title : a film . aspect : plot . review :", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.equal(generator.model(ids).logits, sft_model(ids).logits)
    prompts, responses = ["title : a film . aspect : plot ."] * 2, ["the plot is good .", "the acting is bad ."]
    rm, rm_tok = load_reward_model(tiny_repo / "outputs/reward/model")
    expected = score_texts(rm, rm_tok, prompts, responses, params.reward.max_length).tolist()
    got = mlflow.pyfunc.load_model("models:/rlhf-reward-model/1").predict(
        pd.DataFrame({"prompt": prompts, "response": responses}))
    assert got == pytest.approx(expected, abs=1e-6) and expected[0] != expected[1]

    # deps_hash describes the deps as they are now, not the dvc.lock of the last run.
    monkeypatch.chdir(tiny_repo)
    monkeypatch.setenv("DVC_STAGE", "sft")
    source = tiny_repo / "pipeline/stages/sft.py"
    text = source.read_text()
    source.write_text(text + "# changed\n")
    changed, how = deps_hash("sft", [])
    source.write_text(text)
    assert how == "dvc" and changed != lock_deps_hash(tiny_repo / "dvc.lock", "sft")
    assert deps_hash("sft", []) == (lock_deps_hash(tiny_repo / "dvc.lock", "sft"), "dvc")


def _lock_md5(repo: Path, stage: str, path: str) -> str:
    lock = YAML(typ="safe", pure=True).load((repo / "dvc.lock").read_text())
    return next(d["md5"] for d in lock["stages"][stage]["deps"] if d["path"] == path)


def _tiny_data(root: Path) -> Path:
    prepare_run(DataConfig(n_sft=32, n_sft_eval=8, n_pairs=8, n_pairs_eval=4, n_ppo_prompts=8, n_eval_prompts=4),
                root / "data")
    return root / "data"


TINY_SFT = Params(model=TINY_MODEL, sft=SFTConfig(epochs=1.0, batch_size=8, eval_every=2, n_eval_generations=4,
                                                  sampling=SamplingConfig(max_new_tokens=8)))


def _tracking_records(caplog) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.levelno >= logging.WARNING
            and r.name.startswith(("pipeline", "mlflow", "urllib3", "requests"))]


def test_server_killed_mid_run_warns_once_and_the_stage_completes(tmp_path, server, monkeypatch, caplog, capfd):
    data = _tiny_data(tmp_path)          # while the server starts
    server.wait()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    seen = {}
    real_flush = tracking.MlflowTracker.flush

    def flush_after_killing_the_server(self):
        if not seen:
            seen.update(run_id=self.run_id, enabled=self.enabled)
            server.kill()
        real_flush(self)
    monkeypatch.setattr(tracking.MlflowTracker, "flush", flush_after_killing_the_server)
    caplog.set_level(logging.WARNING)
    t0 = time.perf_counter()
    metrics = sft.run(TINY_SFT, data, tmp_path / "out", progress=False)
    elapsed = time.perf_counter() - t0

    assert seen["run_id"] and seen["enabled"]            # the run was live on the server before the kill
    assert [int(r["step"]) for r in _tsv(tmp_path / "out/train.tsv")] == [1, 2, 3, 4]
    assert [int(r["step"]) for r in _tsv(tmp_path / "out/eval.tsv")] == [2, 4]
    assert flat(json.loads((tmp_path / "out/metrics.json").read_text())) == metrics
    assert (tmp_path / "out/model/model.safetensors").is_file()
    (warning,) = _tracking_records(caplog)
    assert server.uri in warning.getMessage() and "sending metrics" in warning.getMessage()
    assert "WARNING mlflow" not in capfd.readouterr().err           # MLflow's own logger said nothing
    assert elapsed < 60


def test_unreachable_server_costs_one_warning_and_little_time(tmp_path, monkeypatch, caplog):
    uri = f"http://127.0.0.1:{_free_port()}"             # nothing listens there
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    caplog.set_level(logging.WARNING)
    (tmp_path / "input.txt").write_text("x")
    t0 = time.perf_counter()
    with stage_tracking("sft", {"sft": {"lr": 1e-3}}, [tmp_path / "input.txt"]) as tracker:
        steps = StepLog(tmp_path / "train.tsv", ["loss"], tracker, series="train")
        for step in range(1, 6):
            steps.log(step, {"loss": 1.0 / step})
            steps.flush()
        write_metrics(tmp_path / "metrics.json", {"train/loss": 0.2}, tracker)
        tracker.log_outputs(tmp_path)
    elapsed = time.perf_counter() - t0
    (warning,) = _tracking_records(caplog)
    assert uri in warning.getMessage() and "Connection refused" in warning.getMessage()
    assert not tracker.enabled and elapsed < 15          # MLflow's own retries would take minutes
    assert len(_tsv(tmp_path / "train.tsv")) == 5
    assert json.loads((tmp_path / "metrics.json").read_text()) == {"train": {"loss": 0.2}}


def test_default_store_is_sqlite_at_the_repository_root_by_absolute_path(tmp_path, monkeypatch):
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "a/b").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "a/b")
    assert tracking_uri() == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert tracking_uri().startswith("sqlite:////")             # four slashes: an absolute path
    # `dvc exp run --temp` runs in a copy; DVC_ROOT names the workspace, whose database is the one.
    monkeypatch.setenv("DVC_ROOT", str(tmp_path / "a"))
    assert tracking_uri() == f"sqlite:///{(tmp_path / 'a').resolve()}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://team:5000")
    assert tracking_uri() == "http://team:5000"


def _tiny_ppo_inputs(root: Path) -> tuple[Path, Path, Path]:
    """Prepared data, an untrained tiny policy and a reward model built from it (as in test_ppo)."""
    data = _tiny_data(root)
    return (data, *tiny_policy_and_reward_model(root, data))


def test_ppo_stage_on_the_default_sqlite_store(tmp_path, monkeypatch):
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", "0.2")
    data, sft_dir, rm_dir = _tiny_ppo_inputs(tmp_path / "in")
    params = Params(ppo=PPOConfig(iterations=2, rollout_batch_size=4, minibatch_size=4, micro_batch_size=2,
                                  ppo_epochs=1, save_every=1, n_eval_prompts=4, sampling=SamplingConfig(max_new_tokens=6)))
    metrics = ppo_stage.run(params, data, sft_dir, rm_dir, tmp_path / "out", progress=False)

    client = MlflowClient(f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    exp = client.get_experiment_by_name("rlhf-pipeline")
    assert exp.artifact_location == (tmp_path.resolve() / "mlartifacts").as_uri()
    (ppo,) = client.search_runs([exp.experiment_id], "tags.stage = 'ppo'")
    parent = client.get_run(ppo.data.tags["mlflow.parentRunId"])   # a parent of its own: no DVC above pytest
    assert parent.info.run_name.startswith("pipeline ") and parent.info.status == "FINISHED"
    assert ppo.data.tags["deps_hash"] == tracking.inputs_hash([data, sft_dir, rm_dir])
    assert ppo.data.params["ppo.sampling.temperature"] == "1.0" and ppo.data.params["ppo.iterations"] == "2"
    rows = _tsv(tmp_path / "out/train.tsv")
    kl = client.get_metric_history(ppo.info.run_id, "objective/kl")    # PPO's own names keep their slash
    assert [(m.step, m.value) for m in kl] == [(int(r["step"]), pytest.approx(float(r["objective/kl"]), rel=1e-5))
                                               for r in rows]
    assert [m.step for m in client.get_metric_history(ppo.info.run_id, "train/kl_coef")] == [1, 2]
    assert ppo.data.metrics["ppo/rm"] == pytest.approx(metrics["ppo/rm"])
    # The registered version holds the checkpoint's weights byte for byte, under the store's folder.
    weights = _registered_weights(client, ppo.info.run_id, tmp_path / "dl")
    assert weights.read_bytes() == (tmp_path / "out/model/model.safetensors").read_bytes()
    (version,) = client.search_model_versions("name = 'rlhf-policy'")
    assert version.source.startswith(exp.artifact_location)     # beside the runs' artifacts
    # Final metrics under the series' names: no `train/objective_kl` beside `objective/kl`.
    assert "train/objective_kl" not in ppo.data.metrics and "objective/kl" in ppo.data.metrics
    # The logged model carries the stage's params and final metrics (the Models tab compares them).
    (logged,) = client.search_logged_models([exp.experiment_id], filter_string="name = 'ppo'")
    assert client.get_model_version("rlhf-policy", version.version).model_id in (None, logged.model_id)
    assert (logged.params["ppo.iterations"], logged.params["ppo.sampling.max_new_tokens"]) == ("2", "6")
    on_model = {m.key: m.value for m in logged.metrics}
    assert on_model["ppo/rm"] == pytest.approx(metrics["ppo/rm"]) and "objective/kl" in on_model
    # MLflow's system metrics of the stage's process.
    assert ppo.data.metrics["system/cpu_utilization_percentage"] >= 0
    assert ppo.data.metrics["system/system_memory_usage_megabytes"] > 0
    # evaluate names the policy it judged: the alias follows the newest version of this execution.
    from pipeline.tracking.mlflow_sink import stage_tracking
    with stage_tracking("evaluate", {"evaluate": {"seed": 0}}) as tracker:
        tracker.alias_evaluated("ppo", "champion")
    assert client.get_model_version_by_alias("rlhf-policy", "champion").version == version.version


def _registered_weights(client: MlflowClient, run_id: str, dest: Path) -> Path:
    """model.safetensors of the model version registered from run `run_id`, downloaded to `dest`."""
    (version,) = client.search_model_versions(f"run_id = '{run_id}'")
    folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=version.source, dst_path=str(dest),
                                                      tracking_uri=client.tracking_uri))
    (weights,) = [p for p in folder.rglob("model.safetensors")]
    return weights


class Recorder(Tracker):
    def __init__(self):
        self.points, self.flushes = [], 0

    def log_metrics(self, step, metrics):
        self.points += [(name, step, value) for name, value in metrics.items()]

    def flush(self):
        self.flushes += 1


def test_step_log_names_metrics_by_series_and_resends_restored_rows(tmp_path):
    rec = Recorder()
    log = StepLog(tmp_path / "train.tsv", tracker=rec, series="train")
    log.log(1, {"objective/kl": 0.5, "lr": 0.1})
    log.flush()
    assert rec.points == [("objective/kl", 1, 0.5), ("train/lr", 1, 0.1)] and rec.flushes == 1
    rec2 = Recorder()
    resumed = StepLog(tmp_path / "train.tsv", tracker=rec2, series="train")
    resumed.restore(log.rows)
    resumed.log(2, {"objective/kl": 0.25, "lr": 0.05})
    resumed.flush()
    assert [p[:2] for p in rec2.points] == [("objective/kl", 1), ("train/lr", 1), ("objective/kl", 2), ("train/lr", 2)]
    assert _tsv(tmp_path / "train.tsv") == [{"step": "1", "objective/kl": "0.5", "lr": "0.1"},
                                           {"step": "2", "objective/kl": "0.25", "lr": "0.05"}]


def test_tracking_off_or_not_rank_zero_is_a_no_op(tmp_path, monkeypatch):
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PIPELINE_TRACKING", "off")
    with stage_tracking("sft", {"sft": {"lr": 1e-3}}, []) as tracker:
        assert tracker is NO_TRACKER
    monkeypatch.setenv("PIPELINE_TRACKING", "on")
    monkeypatch.setenv("RANK", "1")
    with stage_tracking("sft", {"sft": {"lr": 1e-3}}, []) as tracker:
        assert tracker is NO_TRACKER
    assert not (tmp_path / "mlflow.db").exists()
    monkeypatch.setenv("PIPELINE_TRACKING", "of")
    with pytest.raises(ConfigError, match="PIPELINE_TRACKING: expected 'on' or 'off', got 'of'"):
        with stage_tracking("sft", {}, []):
            pass


def test_two_queued_experiments_at_once_lose_no_run_metric_or_artifact(tiny_repo, tmp_path):
    """`dvc queue start -j 2` on the default SQLite store: both experiments' stage runs are in
    mlflow.db, complete (every TSV row a metric point, every metrics.json number, the weights), and
    their models are byte for byte those of the same experiments run one by one in the workspace
    (both at this process's OMP_NUM_THREADS, which the queue's workers and `dvc repro` inherit)."""
    dvc = str(BIN / "dvc")
    for name, lr in (("exp-a", "0.001"), ("exp-b", "0.003")):
        run([dvc, "exp", "run", "--queue", "-n", name, "-S", f"sft.lr={lr}", "reward"], tiny_repo)
    run([dvc, "queue", "start", "-j", "2"], tiny_repo)
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        status = run([dvc, "queue", "status"], tiny_repo).stdout
        if status.count("Success") == 2 or "Failed" in status:
            break
        time.sleep(3)
    assert status.count("Success") == 2, status + run([dvc, "queue", "logs", "exp-a"], tiny_repo, check=False).stdout

    shown = json.loads(run([dvc, "exp", "show", "--json"], tiny_repo).stdout)
    exps = {e["name"]: e for rev in shown for e in (rev.get("experiments") or []) for e in e["revs"]}
    assert {"exp-a", "exp-b"} <= set(exps)

    client = MlflowClient(f"sqlite:///{tiny_repo.resolve()}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("rlhf-pipeline").experiment_id])
    parents = {r.info.run_name: r for r in runs if "mlflow.parentRunId" not in r.data.tags}
    parents = {n.rsplit(" ", 3)[0]: r for n, r in parents.items()}     # the names end with their start time
    assert set(parents) == {"pipeline exp-a", "pipeline exp-b"}
    for name in ("exp-a", "exp-b"):
        lock = YAML(typ="safe", pure=True).load(run(["git", "show", f"{exps[name]['rev']}:dvc.lock"], tiny_repo).stdout)
        parent = parents[f"pipeline {name}"]
        assert parent.info.status == "FINISHED"
        stages = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
        assert set(stages) == {"sft", "reward"} and all(r.info.status == "FINISHED" for r in stages.values())
        assert stages["sft"].data.params["sft.lr"] == ("0.001" if name == "exp-a" else "0.003")
        metrics = exps[name]["data"]["metrics"]
        for stage, r in stages.items():
            final = {k: math.nan if v is None else v for k, v in flat(metrics[f"outputs/{stage}/metrics.json"]["data"]).items()}
            assert {k: r.data.metrics[k] for k in final} == pytest.approx(final, nan_ok=True)
            steps = final["train/steps"]
            assert [m.step for m in client.get_metric_history(r.info.run_id, "train/loss")] == list(range(1, steps + 1))
            assert "registered_model" in r.data.tags, run([dvc, "queue", "logs", name], tiny_repo, check=False).stdout[-3000:]
            weights = _registered_weights(client, r.info.run_id, tmp_path / name / stage)
            # ... byte for byte the weights DVC cached for this experiment's stage
            (out,) = [o for o in lock["stages"][stage]["outs"] if o["path"] == f"outputs/{stage}/model"]
            listing = json.loads((tiny_repo / ".dvc/cache/files/md5" / out["md5"][:2] / out["md5"][2:]).read_text())
            (entry,) = [e for e in listing if e["relpath"] == "model.safetensors"]
            assert hashlib.md5(weights.read_bytes()).hexdigest() == entry["md5"]

    # The same two experiments one by one in the workspace (the run cache off: DVC would otherwise
    # restore the queued runs' outputs instead of training): the same models.
    for name, lr in (("exp-a", "0.001"), ("exp-b", "0.003")):
        params = YAML(typ="safe", pure=True).load((tiny_repo / "params.yaml").read_text())
        params["sft"]["lr"] = float(lr)
        with open(tiny_repo / "params.yaml", "w") as f:
            YAML(typ="safe", pure=True).dump(params, f)
        run([dvc, "repro", "--no-run-cache", "reward"], tiny_repo)
        alone = YAML(typ="safe", pure=True).load((tiny_repo / "dvc.lock").read_text())
        queued = YAML(typ="safe", pure=True).load(run(["git", "show", f"{exps[name]['rev']}:dvc.lock"], tiny_repo).stdout)
        for stage in ("sft", "reward"):
            md5s = [{o["path"]: o["md5"] for o in lock["stages"][stage]["outs"]}[f"outputs/{stage}/model"]
                    for lock in (alone, queued)]
            assert md5s[0] == md5s[1], f"{name} {stage}: one by one {md5s[0]}, queued {md5s[1]}"


def test_busy_sqlite_is_retried_and_other_failures_turn_mlflow_off(monkeypatch, caplog):
    monkeypatch.setattr(tracking, "SQLITE_BUSY_WAITS", (0.0, 0.0, 0.0))
    tracker, calls = tracking.MlflowTracker("sqlite:////nowhere/mlflow.db"), []

    def busy_twice():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("(sqlite3.OperationalError) database is locked")
        return "done"
    assert tracker._guard("logging", busy_twice) == "done" and tracker.enabled and len(calls) == 3
    assert not _tracking_records(caplog)

    def always_busy():
        calls.append(1)
        raise RuntimeError("(sqlite3.OperationalError) database is locked")
    calls.clear()
    assert tracker._guard("logging", always_busy) is None and not tracker.enabled and len(calls) == 4
    assert len(_tracking_records(caplog)) == 1


def test_training_stage_with_the_server_down_from_the_start_completes(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_free_port()}")   # nothing listens there
    caplog.set_level(logging.WARNING)
    metrics = sft.run(TINY_SFT, _tiny_data(tmp_path), tmp_path / "out", progress=False)
    assert len(_tracking_records(caplog)) == 1
    assert [int(r["step"]) for r in _tsv(tmp_path / "out/train.tsv")] == [1, 2, 3, 4]
    assert [int(r["step"]) for r in _tsv(tmp_path / "out/eval.tsv")] == [2, 4]
    assert flat(json.loads((tmp_path / "out/metrics.json").read_text())) == metrics
    assert metrics["train/steps"] == 4 and (tmp_path / "out/model/model.safetensors").is_file()


def test_parent_run_description_is_set_and_outage_tolerant(tmp_path, caplog):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = client.create_experiment("e", artifact_location=(tmp_path / "art").as_uri())
    parent = client.create_run(exp).info.run_id
    tracker = tracking.MlflowTracker(uri)
    tracker.client, tracker.parent_id = client, parent
    tracker.set_description("PPO does NOT beat SFT")
    assert client.get_run(parent).data.tags["mlflow.note.content"] == "PPO does NOT beat SFT"

    class Down:
        def set_tag(self, *args):
            raise ConnectionError("server down")
    tracker.client = Down()
    tracker.set_description("anything")            # warns once, turns MLflow off, raises nothing
    # This thread's records only: an earlier test's MLflow client thread may still be retrying
    # its stopped server (urllib3 warns from that thread) while this test runs in the same worker.
    mine = [r for r in _tracking_records(caplog) if r.thread == threading.get_ident()]
    assert not tracker.enabled and len(mine) == 1 and "describing the parent run" in mine[0].getMessage()
    NO_TRACKER.set_description("no-op")


def test_a_killed_stage_ends_killed_and_its_resumed_run_says_which_it_continues(tiny_repo, monkeypatch):
    """SIGKILL `dvc repro sft` mid-training: nothing ends its MLflow runs. The next stage to start
    marks them KILLED (their process is gone); the resumed SFT run links to the killed one."""
    params = merge(TINY, {"sft": {"epochs": 6.0, "eval_every": 4, "save_every": 4}})
    write_params(tiny_repo / "params.yaml", params)
    env = {**run_env(), "PIPELINE_TRACKING": "on"}
    state = tiny_repo / "outputs/sft/checkpoint/state.json"
    proc = subprocess.Popen([str(BIN / "dvc"), "repro", "sft"], cwd=tiny_repo, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 600
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if json.loads(state.read_text())["step"] >= 8:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.01)
    assert proc.poll() is None, "sft ended before the kill"
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    client = MlflowClient(f"sqlite:///{tiny_repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name("rlhf-pipeline").experiment_id
    (killed,) = [r for r in client.search_runs([exp]) if r.info.run_name == "sft"]
    assert killed.info.status == "RUNNING"          # nobody was left to end it

    printed = run([str(BIN / "dvc"), "repro", "sft"], tiny_repo, env=env)
    assert "sft: resuming from" in printed.stdout + printed.stderr
    runs = {r.info.run_id: r for r in client.search_runs([exp])}
    first, resumed = runs[killed.info.run_id], next(r for r in runs.values()
                                                    if r.info.run_name == "sft" and r.info.run_id != killed.info.run_id)
    old_parent, new_parent = runs[first.data.tags["mlflow.parentRunId"]], runs[resumed.data.tags["mlflow.parentRunId"]]
    assert (first.info.status, old_parent.info.status) == ("KILLED", "KILLED")
    assert (resumed.info.status, new_parent.info.status) == ("FINISHED", "FINISHED")
    assert resumed.data.tags["resumed_from"] == first.info.run_id and first.data.tags["resumed_by"] == resumed.info.run_id
    assert int(resumed.data.tags["resumed_at_step"]) >= 8
    assert old_parent.info.run_name != new_parent.info.run_name      # both carry their start time
    # Findable the way a user would look: the runs that resumed another.
    assert [r.info.run_id for r in client.search_runs([exp], "tags.resumed_from != ''")] == [resumed.info.run_id]


def test_params_are_written_as_yaml_values():
    assert [tracking.yaml_value(v) for v in (None, False, True, [4, 16, 64], 3e-05, "all-linear", 2)] == \
        ["null", "false", "true", "[4, 16, 64]", "3e-05", "all-linear", "2"]


def test_final_metrics_keep_the_name_of_the_series_they_end():
    tracker = tracking.MlflowTracker("sqlite:///unused")
    tracker.log_metrics(7, {"objective/kl": 3.5, "tokens_per_second/rollout": 9.0, "train/loss": 1.0})
    assert [tracker.series_name(n) for n in ("train/objective_kl", "train/tokens_per_second_rollout",
                                             "train/loss", "train/seconds", "ppo/gold")] == \
        ["objective/kl", "tokens_per_second/rollout", "train/loss", "train/seconds", "ppo/gold"]


def test_a_process_key_tells_a_live_process_from_a_gone_one():
    mine = tracking.process_key()
    child = subprocess.Popen(["sleep", "0"])
    gone = tracking.process_key(child.pid)
    child.wait()
    host, pid, created = mine.rsplit(":", 2)
    assert tracking.process_alive(mine) is True and tracking.process_alive(gone) is False
    # The same pid started at another time (a reused pid) is not the same process.
    assert tracking.process_alive(f"{host}:{pid}:{float(created) - 100:.3f}") is False
    assert tracking.process_alive(f"another-host:{pid}:{created}") is None     # can't be judged from here


def test_a_figure_logged_as_such_is_not_uploaded_again_as_a_file(tmp_path, monkeypatch):
    """log_figure hands MLflow the figure; the stage's PNG of it is then not sent a second time,
    while a PNG no figure was logged for still goes up (as a file)."""
    calls = []

    class Client:
        def log_figure(self, run_id, figure, name, save_kwargs=None):
            calls.append(("figure", name, save_kwargs))

        def log_artifact(self, run_id, path, artifact_path=None):
            calls.append(("file", Path(path).name, None))

    tracker = tracking.MlflowTracker("sqlite:///unused")
    tracker.client, tracker.run_id, tracker.stage = Client(), "r", "evaluate"
    import matplotlib.pyplot as plt
    for name in ("scores.png", "other.png"):
        fig, ax = plt.subplots()
        fig.savefig(tmp_path / name)
        if name == "scores.png":
            tracker.log_figure(fig, name)
        plt.close(fig)
    (tmp_path / "metrics.json").write_text("{}")
    tracker.log_outputs(tmp_path)
    assert calls == [("figure", "scores.png", tracking.FIGURE_SAVE), ("file", "metrics.json", None),
                     ("file", "other.png", None)]


def test_logging_a_policy_by_a_relative_path_asks_no_hub(tmp_path, monkeypatch):
    """A stage's model folder is a relative path under DVC (`outputs/sft/model`); mlflow.transformers
    looks a model's name up on the hub (card, licence), and a relative path reads as a repository
    id: offline that was about a minute of retries per stage. No host is looked up now."""
    from pipeline.tracking import mlflow_models
    data = _tiny_data(tmp_path / "in")
    policy, _ = tiny_policy_and_reward_model(tmp_path / "in", data)
    monkeypatch.chdir(tmp_path)
    looked_up = []

    def no_network(host, *args, **kwargs):
        looked_up.append(host)
        raise socket.gaierror(socket.EAI_NONAME, "no network in this test")
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    mlflow_models.save_policy(Path("in/sft"), tmp_path / "logged")
    assert looked_up == []
    loaded = mlflow.transformers.load_model(str(tmp_path / "logged"), return_type="components")
    assert loaded["model"].config.vocab_size == load_policy(tmp_path / "in/sft")[0].config.vocab_size
