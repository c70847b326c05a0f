"""MLflow tracking in one process: a server killed mid-run, an unreachable server, the default SQLite
store at the repository root, a PPO stage's logged model, the naming of per-step metrics and the
tracker's failure handling. Whole `dvc exp run`s feeding MLflow are tests/system/test_tracking_runs.py."""

import importlib.metadata
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlflow.artifacts
import mlflow.transformers
import pytest
from mlflow import MlflowClient

from conftest import flat, free_port, supervised_run, tiny_params, tiny_policy_and_reward_model
from mlflow_store import registered_weights, server, tracking_env, tsv  # noqa: F401 (fixtures)
from pipeline.tracking import mlflow_sink as tracking
from pipeline.stages import sft
from pipeline.config import DataConfig, ModelConfig, Params, PPOConfig, SamplingConfig, SFTConfig
from pipeline.errors import ConfigError
from pipeline.tracking.mlflow_sink import stage_tracking, tracking_uri
from pipeline.stages import ppo as ppo_stage
from pipeline.stages.prepare import write as prepare_run
from pipeline.models.checkpoints import load_policy
from pipeline.tracking.sinks import NO_TRACKER, StepLog, Tracker, write_metrics

TINY_MODEL = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64)


def _tiny_data(root: Path) -> Path:
    prepare_run(DataConfig(n_sft=32, n_sft_eval=8, n_pairs=8, n_pairs_eval=4, n_ppo_prompts=8, n_eval_prompts=4),
                root / "data")
    return root / "data"


TINY_SFT = Params(model=TINY_MODEL, sft=SFTConfig(epochs=1.0, batch_size=8, eval_every=2, n_eval_generations=4,
                                                  sampling=SamplingConfig(max_new_tokens=8)))


def _tracking_records(caplog) -> list[logging.LogRecord]:
    """This thread's tracking warnings: the sink warns from the stage's own thread, while an
    earlier test's MLflow client thread may still be retrying its stopped server in this worker
    (urllib3 warns from that thread) and would be counted as this test's."""
    return [r for r in caplog.records if r.levelno >= logging.WARNING
            and r.thread == threading.get_ident()
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
    assert [int(r["step"]) for r in tsv(tmp_path / "out/train.tsv")] == [1, 2, 3, 4]
    assert [int(r["step"]) for r in tsv(tmp_path / "out/eval.tsv")] == [2, 4]
    assert flat(json.loads((tmp_path / "out/metrics.json").read_text())) == metrics
    assert (tmp_path / "out/model/model.safetensors").is_file()
    (warning,) = _tracking_records(caplog)
    assert server.uri in warning.getMessage() and "sending metrics" in warning.getMessage()
    assert "WARNING mlflow" not in capfd.readouterr().err           # MLflow's own logger said nothing
    assert elapsed < 60


def test_unreachable_server_costs_one_warning_and_little_time(tmp_path, monkeypatch, caplog):
    uri = f"http://127.0.0.1:{free_port()}"             # nothing listens there
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
    assert len(tsv(tmp_path / "train.tsv")) == 5
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
    rows = tsv(tmp_path / "out/train.tsv")
    kl = client.get_metric_history(ppo.info.run_id, "objective/kl")    # PPO's own names keep their slash
    assert [(m.step, m.value) for m in kl] == [(int(r["step"]), pytest.approx(float(r["objective/kl"]), rel=1e-5))
                                               for r in rows]
    assert [m.step for m in client.get_metric_history(ppo.info.run_id, "train/kl_coef")] == [1, 2]
    assert ppo.data.metrics["ppo/rm"] == pytest.approx(metrics["ppo/rm"])
    # The registered version holds the checkpoint's weights byte for byte, under the store's folder.
    weights = registered_weights(client, ppo.info.run_id, tmp_path / "dl")
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
        tracker.alias_evaluated("ppo", "rlhf-policy", "champion")
    assert client.get_model_version_by_alias("rlhf-policy", "champion").version == version.version


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
    assert tsv(tmp_path / "train.tsv") == [{"step": "1", "objective/kl": "0.5", "lr": "0.1"},
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
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{free_port()}")   # nothing listens there
    caplog.set_level(logging.WARNING)
    metrics = sft.run(TINY_SFT, _tiny_data(tmp_path), tmp_path / "out", progress=False)
    assert len(_tracking_records(caplog)) == 1
    assert [int(r["step"]) for r in tsv(tmp_path / "out/train.tsv")] == [1, 2, 3, 4]
    assert [int(r["step"]) for r in tsv(tmp_path / "out/eval.tsv")] == [2, 4]
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
    mine = _tracking_records(caplog)
    assert not tracker.enabled and len(mine) == 1 and "describing the parent run" in mine[0].getMessage()
    NO_TRACKER.set_description("no-op")


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


def _registered_stage(root: Path, stage: str, model_dir: Path, step: int) -> tuple[str, str]:
    """A run of `stage` on the default SQLite store under `root` that logs `model_dir` as its model
    (its SPEC's facts: a policy or the reward model) after `step` logged steps: (run id, model id)."""
    from pipeline.stages import registry
    out = root / f"{stage}_out"
    shutil.copytree(model_dir, out / "model")
    facts = tracking.StageFacts(model=registry.spec(stage).model)
    with stage_tracking(stage, {stage: {"max_length": 64}}, [], facts=facts) as tracker:
        tracker.log_metrics(step, {"train/loss": 0.5})
        tracker.flush()
        tracker.log_outputs(out)
    return tracker.run_id, tracker.model_id


def test_a_logged_model_is_its_runs_output_with_pinned_needs_and_only_its_code(tmp_path, monkeypatch):
    """The run lists the model it logged (as MLflow's Model.log does); the reward model's pyfunc pins
    what it needs to the installed versions and carries only the pipeline modules that score, with
    which it scores as the pipeline does in a fresh process."""
    from pipeline.models.reward_model import load_reward_model, score_texts
    from pipeline.tracking import mlflow_models
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    _, rm_dir = tiny_policy_and_reward_model(tmp_path / "in", _tiny_data(tmp_path / "in"), offset=0.625)
    run_id, model_id = _registered_stage(tmp_path, "reward", rm_dir, step=3)

    client = MlflowClient(f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    (output,) = client.get_run(run_id).outputs.model_outputs
    (logged,) = client.search_logged_models([client.get_run(run_id).info.experiment_id])
    assert (output.model_id, output.step) == (model_id, 3) and logged.model_id == model_id
    dest, uri = str(tmp_path / "dl"), client.tracking_uri
    folder = Path(mlflow.artifacts.download_artifacts(artifact_uri=logged.artifact_location, dst_path=dest,
                                                      tracking_uri=uri))
    # Pinned: `mlflow models serve` installs the versions that wrote it, not the newest.
    requirements = (folder / "requirements.txt").read_text().split()
    assert requirements and all("==" in r for r in requirements), requirements
    installed = importlib.metadata.version("transformers")
    assert f"transformers=={installed}" in requirements
    assert f"torch=={importlib.metadata.version('torch').split('+')[0]}" in requirements
    # Only the modules scoring imports: not the stages, PPO or the training loops.
    code = {str(p.relative_to(folder / "code")) for p in (folder / "code").rglob("*.py")}
    assert {"pipeline/models/reward_model.py", "pipeline/tracking/mlflow_models.py"} <= code
    assert not any(p.startswith(("pipeline/stages", "pipeline/ppo", "pipeline/training")) for p in code), code
    assert len(code) < len(list(mlflow_models.PACKAGE.rglob("*.py"))) / 3
    # A fresh process, away from this checkout, loads it with that code alone and scores as the pipeline.
    prompts = ["Review the film Silent River . Focus on the music ."] * 2
    responses = ["the music is good .", "the music was dull ."]
    script = ("import json, sys, mlflow.pyfunc, pandas as pd\n"
              f"model = mlflow.pyfunc.load_model({str(folder)!r})\n"
              f"scores = model.predict(pd.DataFrame({{'prompt': {prompts!r}, 'response': {responses!r}}}))\n"
              "print(json.dumps({'scores': list(scores), 'pipeline': sys.modules['pipeline'].__file__}))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path / "dl", env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(got["pipeline"]).resolve() == (folder / "code/pipeline/__init__.py").resolve()
    model, tok = load_reward_model(rm_dir)
    assert got["scores"] == pytest.approx(score_texts(model, tok, prompts, responses, 64).tolist(), abs=1e-6)


def test_the_champion_is_the_last_policy_whose_verdict_was_ok(tmp_path, monkeypatch):
    """evaluate names `rlhf-policy@champion` only when its verdict is OK: a policy that lost to SFT,
    gamed the reward model or fell below the best-of-n frontier leaves the alias on the last one that
    passed."""
    from mlflow.exceptions import MlflowException
    from pipeline.stages import evaluate
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    policy, _ = tiny_policy_and_reward_model(tmp_path / "in", _tiny_data(tmp_path / "in"))
    client = MlflowClient(f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    ok = {"win_rate/ppo_vs_sft_gold": 0.75, "win_rate/ppo_vs_sft_rm": 0.8}
    failing = [{"win_rate/ppo_vs_sft_gold": 0.4, "win_rate/ppo_vs_sft_rm": 0.5},     # lost to SFT
               {"win_rate/ppo_vs_sft_gold": 0.6, "win_rate/ppo_vs_sft_rm": 0.95},    # the RM gamed
               {"win_rate/ppo_vs_sft_rm": 0.9},                                      # no gold verdict
               {**ok, "frontier/ppo_gap_gold": -0.45, "frontier/ppo_gap_gold_high": -0.3}]   # below best-of-n

    def judged(verdicts: list[dict]) -> list[bool]:
        """A new version of rlhf-policy, judged by evaluate once per verdict: whether each named it."""
        root = tmp_path / f"version{len(client.search_model_versions())}"
        run_id, model_id = _registered_stage(root, "ppo", policy, step=2)
        (output,) = client.get_run(run_id).outputs.model_outputs     # the policy is its run's output too
        assert output.model_id == model_id
        with stage_tracking("evaluate", {"evaluate": {"seed": 0}}) as tracker:
            return [evaluate.name_champion(tracker, m) for m in verdicts]

    assert judged(failing) == [False, False, False, False]
    with pytest.raises(MlflowException, match="champion"):
        client.get_model_version_by_alias("rlhf-policy", "champion")
    assert judged([ok]) == [True]
    assert int(client.get_model_version_by_alias("rlhf-policy", "champion").version) == 2
    assert judged(failing) == [False, False, False, False]
    assert int(client.get_model_version_by_alias("rlhf-policy", "champion").version) == 2   # not 3


def test_a_restarted_reward_stage_logs_each_attempt_in_a_run_of_its_own(tiny_data, tiny_sft, tmp_path, monkeypatch):
    # The tiny reward run whose check always fails (a bar of 1.0): 12 steps, checked at step 6, once.
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
    params = tiny_params({"reward": {"epochs": 4.0, "save_every": 2,
                                     "restart": {"at_step": 6, "window": 2, "min_accuracy": 1.0}}})
    metrics = supervised_run("reward", params, tiny_data, tiny_sft)(tmp_path / "out")
    assert metrics["train/restarts"] == 1

    client = MlflowClient(f"sqlite:///{tmp_path.resolve()}/mlflow.db")
    exp = client.get_experiment_by_name("rlhf-pipeline")
    runs = client.search_runs([exp.experiment_id], "tags.stage = 'reward'")
    (abandoned,) = [r for r in runs if "restart_of" not in r.data.tags]
    (kept,) = [r for r in runs if "restart_of" in r.data.tags]
    assert (abandoned.info.status, kept.info.status) == ("KILLED", "FINISHED")
    assert kept.data.tags["restart_of"] == abandoned.info.run_id
    assert abandoned.data.tags["restarted_by"] == kept.info.run_id
    assert abandoned.data.tags["pipeline_end"].startswith("restarted: validation accuracy ")
    assert "seed 1000 trains again" in abandoned.data.tags["pipeline_end"]
    assert kept.data.tags["mlflow.parentRunId"] == abandoned.data.tags["mlflow.parentRunId"]
    assert kept.data.params == abandoned.data.params and kept.data.params["reward.seed"] == "0"

    def points(run, name):
        return [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, name)]
    # Each run holds one attempt's steps, each once: the kept run's series is train.tsv's.
    assert [s for s, _ in points(abandoned, "train/loss")] == list(range(1, 7))
    rows = tsv(tmp_path / "out/train.tsv")
    assert points(kept, "train/loss") == [(int(r["step"]), pytest.approx(float(r["loss"]), rel=1e-5)) for r in rows]
    assert len(rows) == 12
    assert points(abandoned, "restart/attempt") == [(4, 0.0), (6, 0.0)]
    assert points(kept, "restart/attempt") == [(4, 1.0), (6, 1.0)]
    assert kept.data.metrics["train/restarts"] == 1 and "train/restarts" not in abandoned.data.metrics
    # Each run its own logged model: the abandoned one failed, the kept one holds the weights.
    models = {m.source_run_id: str(m.status) for m in
              client.search_logged_models([exp.experiment_id], filter_string="name = 'reward'")}
    assert set(models) == {abandoned.info.run_id, kept.info.run_id}
    assert "FAILED" in models[abandoned.info.run_id] and "READY" in models[kept.info.run_id]


def test_a_step_log_sends_the_tracker_only_the_rows_it_tracks(tmp_path):
    rec = Recorder()
    log = StepLog(tmp_path / "restart.tsv", ["attempt", "accuracy"], tracker=rec, series="restart")
    log.tracked = lambda row: row["attempt"] == 1
    log.restore([{"step": 4, "attempt": 0, "accuracy": 0.5}, {"step": 4, "attempt": 1, "accuracy": 0.7}])
    log.log(6, {"attempt": 1, "accuracy": 0.8})
    log.flush()
    assert rec.points == [("restart/attempt", 4, 1), ("restart/accuracy", 4, 0.7),
                          ("restart/attempt", 6, 1), ("restart/accuracy", 6, 0.8)]
    assert [r["step"] for r in tsv(tmp_path / "restart.tsv")] == ["4", "4", "6"]   # the file keeps every row
