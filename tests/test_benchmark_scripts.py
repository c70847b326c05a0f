"""The benchmark scripts run against today's code: a benchmark that rots is found by the tests, not
by the next person who needs its number (ppo_vs_trl.py's set-up called a removed signature of
sft.train for two days). TRL itself is an optional install (`make bench`), so only our side runs."""

import importlib.util
import json
import math
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ppo_vs_trl_builds_the_shared_models_and_times_our_trainer(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PIPELINE_TRACKING", "off")
    bench = load("ppo_vs_trl")
    bench.build(tmp_path, sft_epochs=0.1)
    for name in ("policy", "reward"):
        assert (tmp_path / name / "model.safetensors").is_file()
    # The policy is the SFT stage's model, saved again: same config, and the reward model shares its trunk size.
    policy = json.loads((tmp_path / "policy" / "config.json").read_text())
    reward = json.loads((tmp_path / "reward" / "config.json").read_text())
    assert policy["hidden_size"] == reward["hidden_size"] == 96 and len(reward["id2label"]) == 1
    assert reward["architectures"] == ["LlamaForSequenceClassification"]
    assert len(bench.prompts(tmp_path)) == 1024
    result = bench.run_ours(tmp_path, updates=1)
    assert set(result) == {"episodes_per_s", "tokens_per_s", "seconds", "peak_rss_mb"}
    assert result["seconds"] > 0 and math.isclose(result["episodes_per_s"], bench.BATCH / result["seconds"])
    assert 0 < result["tokens_per_s"] <= bench.RESPONSE * result["episodes_per_s"]

    # The reward-model step benchmarks, on the same SFT model and the (eight) prepared pairs.
    for name, ways in (("rm_step", ("tokenised afresh", "ids kept")),
                       ("rm_shared_prompt", ("two rows per pair", "shared prompt"))):
        monkeypatch.setattr("sys.argv", [name, "--steps", "2", "--data", str(tmp_path / "data"),
                                         "--sft", str(tmp_path / "sft" / "model")])
        load(name).main()
        out = capsys.readouterr().out
        for way in ways:
            ms = float(out.split(f"{way}:", 1)[1].split("ms/step", 1)[0].split()[-1])
            assert ms > 0, (name, way, out)
        if name == "rm_step":                                  # the set-up line: both ways timed, same rows
            setup = out.split("set-up, ", 1)[1].splitlines()[0]
            assert setup.startswith("8 pairs") and setup.endswith("lengths and rows equal"), out
            assert float(setup.split("once:", 1)[1].split(" ms", 1)[0]) >= 0, out
            assert float(setup.split("(", 1)[1].split("x)", 1)[0]) > 0, out
        ratio = out.strip().splitlines()[-1]                     # "ratio ...: 1.14x ..."
        assert ratio.startswith("ratio") and float(ratio.split(": ", 1)[1].split("x", 1)[0]) > 0, out


def test_stages_benchmark_runs_both_sides_and_compares_their_models(tmp_path):
    """benchmarks/stages.py --base HEAD on the tiny params: every stage of both sides ran, the ratio
    is each side's time, and the models of the working tree and HEAD are compared by md5 (a fresh
    clone's tree is HEAD: identical models)."""
    import subprocess
    import sys

    from conftest import TINY, run_env, write_params
    write_params(tmp_path / "tiny.yaml", TINY)
    out = tmp_path / "stages.tsv"
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "pipeline", "dvc.yaml"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks/stages.py"), "--base", "HEAD", "--params",
                           str(tmp_path / "tiny.yaml"), "--out", str(out)], cwd=ROOT, env=run_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    header, *rows = [line.split("\t") for line in out.read_text().splitlines()]
    table = [dict(zip(header, r)) for r in rows]
    assert [r["stage"] for r in table] == ["prepare", "sft", "reward", "ppo", "evaluate"]
    for r in table:
        assert float(r["ratio"]) == pytest.approx(float(r["head_s"]) / float(r["base_s"]), rel=0.02)
        assert (r["head_md5"] == "-") == (r["stage"] in ("prepare", "evaluate"))
        if not dirty:   # HEAD against itself
            assert r["same_model"] == "True" and r["head_md5"] == r["base_md5"], r
    assert "head/base" in proc.stdout
