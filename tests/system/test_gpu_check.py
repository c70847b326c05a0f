"""scripts/gpu_check.py: what it computes, and its two-process path run on the CPU with gloo."""

from __future__ import annotations

import dataclasses
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


def test_throughput_and_model_flops_by_hand(tmp_path):
    from pipeline.config import Params, PPOConfig, PreferenceOptConfig, SFTConfig
    params = Params(sft=SFTConfig(batch_size=32), dpo=PreferenceOptConfig(batch_size=16))
    out = tmp_path / "sft"
    out.mkdir()
    (out / "metrics.json").write_text(json.dumps({"train": {"steps": 10, "seconds": 4.0},
                                                  "resources": {"peak_rss_gib": 1.5, "wall_seconds": 9.0}}))
    got = gpu_check.throughput(gpu_check.Run("sft", "sft", {}), out, params, n=1_000_000, tokens_per_example=50.0)
    # 10 steps x 32 examples x 50 tokens in 4 s; 6 N FLOPs per trained token.
    assert got["tokens_per_second"] == pytest.approx(10 * 32 * 50 / 4.0)
    assert got["tflops"] == pytest.approx(6 * 1e6 * 4000 / 1e12)
    assert (got["resources/peak_rss_gib"], got["resources/wall_seconds"]) == (1.5, 9.0)
    # The formula follows the section's kind: DPO's (a pair per example) as SFT's, at its own batch;
    # KTO's and rejection sampling's examples are not a file's rows: time and memory only.
    dpo = gpu_check.throughput(gpu_check.Run("dpo+lora", "dpo", {}), out, params, n=1_000_000, tokens_per_example=50.0)
    assert dpo["tokens_per_second"] == pytest.approx(10 * 16 * 50 / 4.0)
    for stage in ("kto", "rs", "evaluate"):
        got = gpu_check.throughput(gpu_check.Run(stage, stage, {}), out, params, n=1_000_000, tokens_per_example=50.0)
        assert sorted(got) == ["resources/peak_rss_gib", "resources/wall_seconds"], stage

    ppo = tmp_path / "ppo"
    ppo.mkdir()
    (ppo / "metrics.json").write_text("{}")
    (ppo / "train.tsv").write_text("step\ttokens_per_second/rollout\ttokens_per_second/update\tval/logprob_diff_mean"
                                   "\tval/logprob_diff_max\n1\t100\t50\t1e-6\t3e-5\n2\t200\t80\t2e-6\t1e-5\n")
    got = gpu_check.throughput(gpu_check.Run("ppo", "ppo", {}), ppo, params, n=1_000_000, tokens_per_example=0)
    # The last iteration's rates (the first carries warm-up); the worst log-prob difference of all.
    assert (got["tokens_per_second"], got["update_tokens_per_second"]) == (200.0, 80.0)
    assert got["rollout_tflops"] == pytest.approx(2 * 1e6 * 200 / 1e12)
    assert got["tflops"] == pytest.approx(6 * 1e6 * 2 * 80 / 1e12)       # actor and critic (GAE)
    assert (got["val/logprob_diff_mean"], got["val/logprob_diff_max"]) == (2e-6, 3e-5)
    grpo = gpu_check.throughput(gpu_check.Run("grpo", "grpo", {}), ppo, params, n=1_000_000, tokens_per_example=0)
    assert grpo["tflops"] == pytest.approx(6 * 1e6 * 80 / 1e12)          # no critic
    shared = Params(ppo=PPOConfig(shared_backbone=True))                  # the critic a head on the actor
    got = gpu_check.throughput(gpu_check.Run("ppo", "ppo", {}), ppo, shared, n=1_000_000, tokens_per_example=0)
    assert got["tflops"] == pytest.approx(6 * 1e6 * 80 / 1e12)


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


def test_the_plain_suites_run_every_registry_stage_in_its_order_reading_the_folders_its_spec_names():
    from pipeline.stages import registry
    specs = registry.specs()
    vllm = ["ppo+vllm"] if importlib.util.find_spec("vllm") is not None else []
    for suite in ("1", "2"):
        runs = gpu_check.runs(gpu_check.SUITES[suite])
        # Today's stages as the committed results name them (a stage added later runs in its place in
        # the registry's order, checked by the next line).
        shipped = ["sft", "sft+lora", "reward", "ppo", *vllm, "evaluate", "dpo+lora", "kto", "grpo+lora", "rs", "compare"]
        assert [r.name for r in runs if r.name.split("+")[0] in {n.split("+")[0] for n in shipped}] == shipped
        assert list(dict.fromkeys(r.stage for r in runs)) == [s for s in specs if s != "prepare"]
        # Each run reads its SPEC's folders: the data, the random base for the SFT policy, and the
        # model of the run standing for any other stage.
        for r in runs:
            assert list(r.inputs) == list(specs[r.stage].inputs), r.name
        by_name = {r.name: r for r in runs}
        assert by_name["evaluate"].inputs == {"data": "data", "sft": "base", "reward": "reward/model",
                                              "ppo": "ppo/model"}
        assert by_name["dpo+lora"].inputs == {"data": "data", "sft": "base"}
        # compare measures every method, GRPO's and DPO's as the LoRA runs that stand for them.
        policies = by_name["compare"].policies
        assert {name.split("+")[0] for name in policies} == set(registry.methods())
        assert {k: v for k, v in policies.items() if k.split("+")[0] in ("ppo", "dpo", "kto", "grpo", "rs")} == {
            "ppo": "ppo/model", "dpo+lora": "dpo-lora/model", "kto": "kto/model", "grpo+lora": "grpo-lora/model",
            "rs": "rs/model"}
        assert [r.name for r in runs if r.policies] == ["compare"]
        assert {r.name for r in runs if r.lora} == {"sft+lora", "dpo+lora", "grpo+lora"}
        assert by_name["grpo+lora"].params == {"grpo": {"lora": {"r": 16, "alpha": 32.0}}}
    # The docs order the results with every variant, installed here or not.
    every = [r.name for r in gpu_check.runs(gpu_check.SUITES["1"], every_variant=True)]
    assert every.index("ppo") + 1 == every.index("ppo+vllm")
    assert gpu_check.runs(gpu_check.SUITES["1"], every_variant=True)[every.index("ppo+vllm")].params == {
        "ppo": {"rollout_engine": "vllm"}}
    ds1 = gpu_check.runs(gpu_check.SUITES["ds1"])
    zero = {r.name: r.params.get(r.stage, {}).get("distributed", {}) for r in ds1}
    assert zero["sft"] == {"zero_stage": 2} and zero["sft+lora"] == {"zero_stage": 3, "gradient_checkpointing": True}
    assert gpu_check.check_params(gpu_check.TINY, gpu_check.SUITES["ds1"], False, Path("b"))["distributed"] == {
        "backend": "deepspeed", "num_processes": 1, "zero_stage": 3, "precision": "fp32", "device": "auto"}


def test_a_variant_of_a_stage_the_registry_lacks_is_an_error(monkeypatch):
    monkeypatch.setattr(gpu_check, "VARIANTS", (*gpu_check.VARIANTS, gpu_check.Variant("orpo+lora", "orpo", {})))
    with pytest.raises(ValueError, match="the variant orpo\\+lora runs the stage 'orpo', which no module"):
        gpu_check.runs(gpu_check.SUITES["1"])


def test_each_section_is_sized_by_its_kind_and_the_check_params_load(tmp_path):
    from ruamel.yaml import YAML

    from pipeline.config import PPOConfig, SupervisedConfig, check_process_shape
    from pipeline.stages import registry
    seq = 64 + gpu_check.TINY.new_tokens
    repo_params = YAML(typ="safe", pure=True).load((REPO / "params.yaml").read_text())
    for suite in gpu_check.SUITES.values():
        got = gpu_check.check_params(gpu_check.TINY, suite, False, tmp_path / "base")
        sections = gpu_check.stage_sections()
        for name, section in sections.items():
            fields = {f.name for f in dataclasses.fields(section)}
            assert set(got.get(name, {})) <= fields, name      # only keys the section's class has
            if issubclass(section, SupervisedConfig):
                assert {k: got[name][k] for k in ("batch_size", "epochs", "max_length")} == {
                    "batch_size": 8, "epochs": 1.0, "max_length": seq}, name
            if issubclass(section, PPOConfig):
                assert (got[name]["iterations"], got[name]["rollout_batch_size"], got[name]["sampling"]) == (
                    2, 8, {"max_new_tokens": gpu_check.TINY.new_tokens}), name
        # The fields some sections add: SFT's samples, the RM's SFT samples, each method's held-out
        # prompts; rejection sampling's training prompts and candidates; GRPO's groups.
        assert (got["sft"]["n_eval_generations"], got["reward"]["n_sft_samples"], got["dpo"]["n_eval_prompts"],
                got["kto"]["n_eval_prompts"]) == (4, 4, 4, 4)
        assert (got["rs"]["n_prompts"], got["rs"]["n"], got["rs"]["sampling"]) == (8, 2, got["sft"]["sampling"])
        assert "sampling" not in got["reward"] and "n_eval_prompts" not in got["sft"]
        assert got["grpo"]["samples_per_prompt"] == 4 and "samples_per_prompt" not in got["ppo"]
        # Merged over params.yaml, they load and pass every stage's checks at this suite's processes.
        path = tmp_path / f"params-{suite.name}.yaml"
        path.write_text(json.dumps(gpu_check.merge(repo_params, got)))
        params = registry.load_params(path)
        for name in registry.shape_checked("start"):   # the others' are checked at load
            check_process_shape(params, name)


def test_a_new_stage_module_is_in_the_check_with_its_spec_folders_and_its_kind_sizes(toy_stage):
    # The throwaway method reads the reward model too; its section is SFT's kind (ToyParams).
    text = toy_stage.read_text()
    assert 'inputs=("data", "sft")' in text
    toy_stage.write_text(text.replace('inputs=("data", "sft")', 'inputs=("data", "sft", "reward")'))
    runs = gpu_check.runs(gpu_check.SUITES["1"])
    names = [r.name for r in runs]
    toy = runs[names.index("toy")]
    assert (toy.stage, toy.inputs, toy.params, toy.lora) == (
        "toy", {"data": "data", "sft": "base", "reward": "reward/model"}, {}, False)
    assert names.index("rs") < names.index("toy") < names.index("compare")       # the registry's order
    assert runs[names.index("compare")].policies["toy"] == "toy/model"           # a method compare measures
    params = gpu_check.check_params(gpu_check.TINY, gpu_check.SUITES["1"], False, Path("b"))
    assert params["toy"] == params["sft"]


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
