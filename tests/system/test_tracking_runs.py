"""MLflow tracking of whole runs: `dvc exp run` feeding a real `mlflow server` (one parent, nested
stage runs, params, per-step and final metrics, registered checkpoints, DVC/git tags), two queued
experiments at once on the default SQLite store, and a killed stage's runs after its resume."""

import hashlib
import json
import math
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import mlflow.pyfunc
import mlflow.transformers
import pandas as pd
import pytest
import torch
from PIL import Image
from mlflow import MlflowClient
from ruamel.yaml import YAML

from conftest import BIN, TINY, flat, merge, run, run_env, write_params
from mlflow_store import registered_weights, server, tracking_env, tsv  # noqa: F401 (fixtures)
from pipeline.config import load_params
from pipeline.models.checkpoints import load_policy
from pipeline.models.reward_model import load_reward_model, score_texts
from pipeline.stages import registry
from pipeline.tracking.mlflow_sink import deps_hash, lock_deps_hash


@pytest.mark.long
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
            rows = tsv(out / f"{series}.tsv")
            history = client.get_metric_history(r.info.run_id, f"{series}/loss")
            assert [m.step for m in history] == [int(row["step"]) for row in rows]
            assert [m.value for m in history] == pytest.approx([float(row["loss"]) for row in rows], rel=1e-5)
        # Final metrics: every number of metrics.json.
        # (null in metrics.json: a metric undefined on this run's data, which MLflow holds as NaN)
        final = {k: math.nan if v is None else v for k, v in flat(json.loads((out / "metrics.json").read_text())).items()}
        assert {k: r.data.metrics[k] for k in final} == pytest.approx(final, nan_ok=True)
        # The checkpoint is a registered model version of this run; the step logs are artifacts.
        registered = registry.spec(name).model.registered
        (version,) = client.search_model_versions(f"name = '{registered}'")
        assert (version.run_id, version.version, tags["registered_model"]) == (r.info.run_id, "1", f"{registered}/1")
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


@pytest.mark.long
def test_two_queued_experiments_at_once_lose_no_run_metric_or_artifact(tiny_repo, tmp_path):
    """`dvc queue start -j 2` on the default SQLite store: both experiments' stage runs are in
    mlflow.db, complete (every TSV row a metric point, every metrics.json number, the weights), and
    the second one's models are byte for byte those of the same experiment run alone in the
    workspace (both at this process's OMP_NUM_THREADS, which the queue's workers and `dvc repro` inherit)."""
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
            weights = registered_weights(client, r.info.run_id, tmp_path / name / stage)
            # ... byte for byte the weights DVC cached for this experiment's stage
            (out,) = [o for o in lock["stages"][stage]["outs"] if o["path"] == f"outputs/{stage}/model"]
            listing = json.loads((tiny_repo / ".dvc/cache/files/md5" / out["md5"][:2] / out["md5"][2:]).read_text())
            (entry,) = [e for e in listing if e["relpath"] == "model.safetensors"]
            assert hashlib.md5(weights.read_bytes()).hexdigest() == entry["md5"]

    # The second experiment again alone in the workspace (the run cache off: DVC would otherwise
    # restore the queued run's outputs instead of training): the same models. Either experiment
    # would show a run disturbed by the other one beside it; one of them is enough.
    for name, lr in (("exp-b", "0.003"),):
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
