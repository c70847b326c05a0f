"""scripts/gpu_check.py: what it computes, and its two-process path run on the CPU with gloo."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, run_env

spec = importlib.util.spec_from_file_location("gpu_check", REPO / "scripts" / "gpu_check.py")
gpu_check = importlib.util.module_from_spec(spec)
sys.modules["gpu_check"] = gpu_check   # dataclasses look their module up there
spec.loader.exec_module(gpu_check)


def _params(batch_size: int):
    from types import SimpleNamespace
    return SimpleNamespace(sft=SimpleNamespace(batch_size=batch_size))


def test_throughput_and_model_flops_by_hand(tmp_path):
    out = tmp_path / "sft"
    out.mkdir()
    (out / "metrics.json").write_text(json.dumps({"train": {"steps": 10, "seconds": 4.0},
                                                  "resources": {"peak_rss_gib": 1.5, "wall_seconds": 9.0}}))
    got = gpu_check.throughput(gpu_check.Run("sft", "sft", {}), out, _params(32), n=1_000_000, tokens_per_example=50.0)
    # 10 steps x 32 examples x 50 tokens in 4 s; 6 N FLOPs per trained token.
    assert got["tokens_per_second"] == pytest.approx(10 * 32 * 50 / 4.0)
    assert got["tflops"] == pytest.approx(6 * 1e6 * 4000 / 1e12)
    assert (got["resources/peak_rss_gib"], got["resources/wall_seconds"]) == (1.5, 9.0)

    ppo = tmp_path / "ppo"
    ppo.mkdir()
    (ppo / "metrics.json").write_text("{}")
    (ppo / "train.tsv").write_text("step\ttokens_per_second/rollout\ttokens_per_second/update\tval/logprob_diff_mean"
                                   "\tval/logprob_diff_max\n1\t100\t50\t1e-6\t3e-5\n2\t200\t80\t2e-6\t1e-5\n")
    got = gpu_check.throughput(gpu_check.Run("ppo", "ppo", {}), ppo, None, n=1_000_000, tokens_per_example=0)
    # The last iteration's rates (the first carries warm-up); the worst log-prob difference of all.
    assert (got["tokens_per_second"], got["update_tokens_per_second"]) == (200.0, 80.0)
    assert got["rollout_tflops"] == pytest.approx(2 * 1e6 * 200 / 1e12)
    assert got["tflops"] == pytest.approx(6 * 1e6 * 2 * 80 / 1e12)       # actor and critic
    assert (got["val/logprob_diff_mean"], got["val/logprob_diff_max"]) == (2e-6, 3e-5)
    grpo = gpu_check.throughput(gpu_check.Run("grpo", "grpo", {}), ppo, None, n=1_000_000, tokens_per_example=0)
    assert grpo["tflops"] == pytest.approx(6 * 1e6 * 80 / 1e12)          # no critic


def test_the_base_model_has_the_asked_vocabulary_and_ends_on_its_eos(tmp_path):
    from transformers import AutoConfig, GenerationConfig

    from pipeline.data.tokenizer import load_tokenizer
    size = gpu_check.Size(hidden=16, layers=1, heads=2, intermediate=32, vocab=5000, new_tokens=8)
    got = gpu_check.build_base(size, tmp_path / "base")
    tok, cfg = load_tokenizer(tmp_path / "base"), AutoConfig.from_pretrained(tmp_path / "base")
    assert got["vocab"] == len(tok) == cfg.vocab_size == 5000
    assert GenerationConfig.from_pretrained(tmp_path / "base").eos_token_id == tok.eos_token_id == cfg.eos_token_id
    assert got["saved_dtype"] == "bfloat16" and str(cfg.dtype).removeprefix("torch.") == "bfloat16"   # as the hub saves
    assert got["parameters"] - got["parameters_counted"] == 5000 * 16     # the input embedding
    # The default task's prompts encode without an unknown word.
    ids = tok("Review the film Silent River . Focus on the music .")["input_ids"]
    assert tok.unk_token_id not in ids
    assert gpu_check.DEFAULT.vocab >= 32_000 and gpu_check.DEFAULT.new_tokens >= 128


def test_the_plain_suite_runs_every_registry_stage_and_the_deepspeed_one_each_zero_stage():
    from pipeline.stages import registry
    assert {r.stage for r in gpu_check.runs(gpu_check.SUITES["1"])} == set(registry.specs()) - {"prepare"}
    assert {r.stage for r in gpu_check.runs(gpu_check.SUITES["2"])} == set(registry.specs()) - {"prepare"}
    ds1 = gpu_check.runs(gpu_check.SUITES["ds1"])
    zero = {r.name: r.params.get(r.stage, {}).get("distributed", {}) for r in ds1}
    assert zero["sft"] == {"zero_stage": 2} and zero["sft+lora"] == {"zero_stage": 3, "gradient_checkpointing": True}
    assert gpu_check.check_params(gpu_check.TINY, gpu_check.SUITES["ds1"], False, Path("b"))["distributed"] == {
        "backend": "deepspeed", "num_processes": 1, "zero_stage": 3, "precision": "fp32", "device": "auto"}


def test_a_stage_that_computed_on_the_cpu_while_on_the_gpu_fails_the_check():
    assert gpu_check.cpu_compute({}) is None                                   # not counted (the CPU's runs)
    assert gpu_check.cpu_compute({"resources/cpu_matmul_gflop": 0.0}) is None
    assert gpu_check.cpu_compute({"resources/cpu_matmul_gflop": gpu_check.CPU_MATMUL_GFLOP}) is None
    why = gpu_check.cpu_compute({"resources/cpu_matmul_gflop": 12.5})
    assert why.startswith("its process ran 12.5 GFLOP of matrix products on CPU tensors while its device was the GPU")


def test_a_failing_stage_is_named_with_its_log_and_fails_the_check(tmp_path, monkeypatch, capsys):
    # evaluate given a causal LM where the reward model belongs fails when it loads it.
    monkeypatch.setattr(gpu_check, "runs", lambda suite: [
        gpu_check.Run("evaluate", "evaluate", {"data": "data", "sft": "base", "reward": "base", "ppo": "base"}),
        gpu_check.Run("after", "ppo", {"data": "data", "sft": "base", "reward": "missing/model"})])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = gpu_check.main(["--tiny", "--processes", "1", "--new-tokens", "4", "--out", str(tmp_path / "r.json"),
                           "--keep", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert code == 1
    assert "evaluate   FAILED (exit" in out and "the end of its log" in out
    assert "after      not run: its input" in out
    results = json.loads((tmp_path / "r.json").read_text())
    assert results["failed"] == ["1p evaluate", "1p after"] and "error" in results["suites"]["1"]["evaluate"]


@pytest.mark.long
def test_two_processes_and_deepspeed_at_one_run_every_stage_on_the_cpu_with_gloo(tmp_path):
    """The check's DeepSpeed suites on a tiny model: two processes (ZeRO-3, the stages' own commands
    under torchrun: every stage) and one (ZeRO-2; ZeRO-3 with LoRA and gradient checkpointing: its
    two SFT runs; the reward model and PPO under ZeRO-3 are the two-process suite's already): each
    runs, and every number it prints is there and plausible."""
    env = {**run_env(), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--tiny", "--suite", "2", "--suite", "ds1",
                           "--only", "ds1:sft", "--only", "ds1:sft+lora",
                           "--budget-s", "1200",   # the default 360 s is a GPU's; a busy CPU takes minutes
                           "--out", str(tmp_path / "r.json"), "--keep", str(tmp_path / "work")], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().endswith("gpu_check: every stage ran")
    results = json.loads((tmp_path / "r.json").read_text())
    suite = results["suites"]["2"]
    assert sorted(suite) == sorted(r.name for r in gpu_check.runs(gpu_check.SUITES["2"]))
    for name, r in suite.items():
        assert r["plan_gib"] > 0 and r["resources/peak_rss_gib"] > 0, name
        assert f"\n{name:10s} " in proc.stdout
        if r["stage"] in ("sft", "reward", "dpo", "ppo", "grpo"):   # kto, rs and evaluate: time and memory only
            assert r["tokens_per_second"] > 0 and r["tflops"] > 0, name
    for name in ("ppo", "grpo+lora"):
        # fp32 on the CPU: the sampler's and the trainer's log-probs agree to float rounding.
        assert 0 <= suite[name]["val/logprob_diff_mean"] <= suite[name]["val/logprob_diff_max"] < 1e-3
    assert {n for n in suite if suite[n]["lora"]} == {"sft+lora", "grpo+lora", "dpo+lora"}
    ds1 = results["suites"]["ds1"]
    assert sorted(ds1) == ["sft", "sft+lora"] and ds1["sft+lora"]["lora"]
    for name, r in ds1.items():
        assert r["tokens_per_second"] > 0 and r["resources/peak_rss_gib"] > 0, name
    # Each ran as the suite says: ZeRO-2 for SFT, ZeRO-3 with gradient checkpointing for SFT+LoRA.
    work = tmp_path / "work"
    zero = {name: json.loads((work / "pds1" / name.replace("+", "-") / "config.json").read_text())["sft"]
            ["distributed"] for name in ("sft", "sft+lora")}
    assert (zero["sft"]["zero_stage"], zero["sft+lora"]["zero_stage"], zero["sft+lora"]["gradient_checkpointing"]) \
        == (2, 3, True)
    print(proc.stdout)
    assert results["failed"] == [] and results["skipped"] == [] and results["size"]["vocab"] == gpu_check.TINY.vocab


def test_without_cuda_it_stops_at_once_in_one_line(capsys):
    """`make gpu-check` on a machine without a GPU: one line saying so, exit 2, nothing built."""
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check would run")
    assert gpu_check.main([]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.count("\n") == 1
    assert out.err.startswith("gpu_check: torch ") and "sees no CUDA device" in out.err and "--tiny" in out.err
