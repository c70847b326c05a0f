"""GPU check: every stage of the pipeline on this machine's GPUs, on a model built here.

    make gpu-check                                   # the one-GPU suites; two processes too when two GPUs are visible
    .venv/bin/python scripts/gpu_check.py --budget-s 600 --out gpu_check.json
    .venv/bin/python scripts/gpu_check.py --tiny --suite ds1   # the same path on the CPU (gloo), tiny

Runs the stages' own commands (`python -m pipeline <stage>`, launched as `dvc repro` launches them)
in a scratch folder. Suite `1` (one process, `distributed.backend: none`: plain PyTorch, bf16
autocast) runs every stage of the registry (pipeline/stages/registry.py) but prepare, which the
check does itself, in the registry's order: a new method's module is run with no edit here. Each
run reads the folders its SPEC names and is sized by what its params section is (the supervised
loop's or the RL trainer's). The VARIANTS add SFT with LoRA, run GRPO and DPO with LoRA in place of
their plain runs, and PPO with vLLM's rollouts where vLLM is installed. The reward model's final
evaluation is on 2,048 held-out pairs (every rank its share on its GPU); evaluate measures
best-of-n; compare measures every method's policy. Suite `ds1` runs DeepSpeed at one process,
bf16: SFT under ZeRO-2, SFT with LoRA and gradient checkpointing, the reward model and PPO under
ZeRO-3 (it needs DeepSpeed installed; without it the suite is named as not run). Suite `2`, where
two GPUs are visible, runs every stage again over two NCCL processes under ZeRO-3. On the CPU
(`--tiny`, for the tests) the same settings run in fp32 with gloo. Without a CUDA device the check
stops at once (exit 2) unless `--tiny`.

The model is a Llama built from a config with random weights and a vocabulary of 32,768 tokens
(the default task's words and filler tokens), saved in bf16 as hub checkpoints are (the stages
train it as fp32 master weights) as a Hugging Face checkpoint that `model.name_or_path` names;
nothing is downloaded. The policy that every stage reading the SFT model starts from is that
random model, whose eos has about one chance in the vocabulary size per token, so their responses
run to `--new-tokens` (128).

Each stage process counts the matrix products it runs on CPU tensors while its device is a GPU
(`PIPELINE_COUNT_CPU_MATMULS`, pipeline/devices.py); a stage whose count passes CPU_MATMUL_GFLOP
fails the check, as a stage whose model forward ran on one rank's CPU (while the others waited in
a collective) would on a real run. The counting sees every operation in Python, so the rates
below are a little lower than an uncounted run's.

Per stage it prints the memory plan (`python -m pipeline plan`'s total per rank) next to the peak
measured (GPU: torch's peak allocation; CPU: the process's peak RSS), tokens per second, the model
FLOPs utilisation, and for the RL trainer's stages (PPO, GRPO) the sampler/trainer log-prob
difference `val/logprob_diff_mean`/`_max`. A stage that fails is shown with the end of its log;
the check goes on with the stages that do not need its output and exits 1. A stage the time budget
cannot fit is skipped and named; the check then exits 3. `--out` writes every number as JSON.

MFU counts model FLOPs only (Kaplan et al. 2020, "Scaling Laws for Neural Language Models": 2N per
token forward, 6N forward and backward; N the parameters less the input embedding, attention
ignored). Supervised stages whose example is a demonstration or a pair (`trained_example`: SFT, the
reward model, DPO): 6N per trained token (both sequences of a pair count); the token count is the
mean tokenized length of the stage's training file times the examples trained, so it is an
estimate; the others (KTO, rejection sampling) report time and memory only. The RL trainer's
stages (a PPOConfig section: PPO, GRPO): rollout 2N per generated token, update 6N per response
token per model trained (the actor, and a critic where the estimator has one of its own). The
peak is the GPU's dense bf16 rate from a table of common GPUs (GPU_PEAK_TFLOPS=<number> sets it
for others).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# Dense bf16 TFLOP/s without sparsity, from the vendors' data sheets (SXM parts where there are two).
PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "H800": 989.0, "H20": 148.0, "GH200": 989.0, "B200": 2250.0,
               "A100": 312.0, "A800": 312.0, "A10G": 70.0, "A10": 125.0, "L40S": 362.0, "L4": 121.0,
               "RTX 4090": 165.0, "RTX 3090": 71.0}
GIB = 2 ** 30


@dataclass(frozen=True)
class Size:
    hidden: int
    layers: int
    heads: int
    intermediate: int
    vocab: int
    new_tokens: int       # the responses' length (the random policy does not stop earlier)


# ~0.2B parameters (0.15B of transformer blocks, 2 x 33.5M of embeddings and output head). Responses of
# 128 tokens: every stage of both one-GPU suites in BUDGET_S on one H100, where each command's start
# (imports, CUDA context, model load) is some 15-20 s of it.
DEFAULT = Size(hidden=1024, layers=12, heads=16, intermediate=2816, vocab=32768, new_tokens=128)
BUDGET_S = 300.0
# More than this of matrix products on CPU tensors in a stage process whose device is a GPU fails the
# stage: model-sized work on one rank's CPU (one forward of the check's model on one sequence of 64
# tokens is ~20 GFLOP), where host-side bookkeeping does none.
CPU_MATMUL_GFLOP = 1.0
TINY = Size(hidden=32, layers=1, heads=2, intermediate=64, vocab=4096, new_tokens=24)


@dataclass(frozen=True)
class Run:
    """One stage command of the check."""
    name: str
    stage: str
    inputs: dict[str, str]                   # --data/--sft/--reward/--ppo: a folder under the scratch root
    params: dict[str, Any] = field(default_factory=dict)   # merged over the check's params
    lora: bool = False
    policies: dict[str, str] = field(default_factory=dict)  # compare's --policy NAME=FOLDER (this suite's)

    @property
    def folder(self) -> str:
        """Its output folder under the suite's (a name without "+", which --policy names refuse)."""
        return self.name.replace("+", "-")


@dataclass(frozen=True)
class Variant:
    """A run of a registry stage with settings of its own, after the stage's plain run or instead of it."""
    name: str
    stage: str
    params: dict[str, Any]                   # its overrides of the stage's section
    lora: bool = False
    replaces: bool = False                   # runs instead of the stage's plain run (and stands for it as an input)
    needs: Optional[str] = None              # a module that must be importable for it to run


@dataclass(frozen=True)
class Suite:
    """One set of runs and the distributed settings they share; `name` keys its results."""
    name: str
    processes: int
    deepspeed: bool

    def title(self, cuda: bool) -> str:
        precision = "bf16" if cuda else "fp32"
        if not self.deepspeed:
            return f"1 process: backend none (plain PyTorch), {'bf16 autocast' if cuda else 'fp32'}"
        return (f"{self.processes} process{'es' if self.processes > 1 else ''}: DeepSpeed "
                f"{'ZeRO-3' if self.processes > 1 else 'ZeRO-2 and ZeRO-3'}, {precision}, {'NCCL' if cuda else 'gloo'}")


# "1": every registry stage and compare in one plain process; "ds1": DeepSpeed at world size 1
# (ZeRO-2; ZeRO-3 with LoRA and gradient checkpointing, for the reward model and for PPO's four
# models), what a one-GPU machine can check of it; "2": every stage again over two processes (ZeRO-3), where two GPUs are visible.
SUITES = {"1": Suite("1", 1, False), "ds1": Suite("ds1", 1, True), "2": Suite("2", 2, True)}
LORA = {"r": 16, "alpha": 32.0}
# What the plain runs (one per registry stage, at the check's sizes) leave out. GRPO and DPO run
# with a LoRA actor only: their full fine-tuning is the path PPO and KTO take already (the same
# RL trainer; the same offline-pair loop), so within the budget their runs check the adapter paths
# (for GRPO, the reference as the actor with its adapter off). The names are those of the
# committed results (docs/data/gpu-check-*.json).
VARIANTS = (
    Variant("sft+lora", "sft", {"lora": LORA}, lora=True),
    # PPO again with its rollouts from vLLM, where installed: the same prompts and seeds, so the
    # two rows' rollout tokens/s and log-prob differences compare the engines.
    Variant("ppo+vllm", "ppo", {"rollout_engine": "vllm"}, needs="vllm"),
    Variant("grpo+lora", "grpo", {"lora": LORA}, lora=True, replaces=True),
    Variant("dpo+lora", "dpo", {"lora": LORA}, lora=True, replaces=True),
)


def runs(suite: Suite = SUITES["1"], every_variant: bool = False) -> list[Run]:
    """The runs of `suite` in order; `inputs` name the scratch folders they read ("base" is the random model).
    Suites 1 and 2: every registry stage but prepare (the check prepares the data itself), in the
    registry's order, each with its VARIANTS (`every_variant`: those whose module is not installed
    here too, as the docs order the results); ds1: its ZeRO stages."""
    if suite.name == "ds1":
        return [
            Run("sft", "sft", {"data": "data"}, {"sft": {"distributed": {"zero_stage": 2}}}),
            Run("sft+lora", "sft", {"data": "data"}, {"sft": {"lora": LORA, "distributed": {
                "zero_stage": 3, "gradient_checkpointing": True}}}, lora=True),
            Run("reward", "reward", {"data": "data", "sft": "base"}),
            Run("ppo", "ppo", {"data": "data", "sft": "base", "reward": "reward/model"}),
        ]
    from pipeline.stages import registry
    specs = {name: s for name, s in registry.specs().items() if name != "prepare"}
    for v in VARIANTS:
        if v.stage not in specs:
            raise ValueError(f"gpu_check: the variant {v.name} runs the stage {v.stage!r}, which no module of "
                             f"pipeline/stages/ declares; the stages are {', '.join(specs)}")
    variants = [v for v in VARIANTS
                if every_variant or v.needs is None or importlib.util.find_spec(v.needs) is not None]
    plain = {name: Run(name, name, {}) for name in specs}
    for v in variants:
        if v.replaces:
            plain[v.stage] = Run(v.name, v.stage, {}, {v.stage: v.params}, lora=v.lora)
    # What a stage's folder argument is here: the prepared data; for the SFT policy the random base
    # (every policy starts from the model the check sized, whether or not the SFT run succeeded);
    # else the model that the run standing for the stage of that name writes.
    def folder(stage: str, name: str) -> str:
        if name in ("data", "sft"):
            return {"data": "data", "sft": "base"}[name]
        if name not in plain:
            raise ValueError(f"gpu_check: the stage {stage} reads --{name}, which no run of the check writes")
        return f"{plain[name].folder}/model"

    out: list[Run] = []
    for stage, spec in specs.items():
        inputs = {name: folder(stage, name) for name in spec.inputs}
        # The compare stage measures each method's policy, given as --policy NAME=FOLDER.
        policies = {plain[m].name: f"{plain[m].folder}/model" for m in registry.methods()} if stage == "compare" else {}
        out.append(Run(plain[stage].name, stage, inputs, plain[stage].params, plain[stage].lora, policies))
        out += [Run(v.name, stage, inputs, {stage: v.params}, v.lora) for v in variants
                if v.stage == stage and not v.replaces]
    return out


def say(*parts: object) -> None:
    print(*parts, flush=True)


def merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for k, v in override.items():
        out[k] = merge(out.get(k, {}), v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def stage_sections() -> dict[str, type]:
    """Each registry stage's params section (named after its stage) -> its config class."""
    import typing

    from pipeline import config
    from pipeline.stages import registry
    sections = typing.get_type_hints(config.Params)
    return {name: sections[name] for name in registry.specs() if name in sections}


def section_params(section: type, supervised: dict[str, Any], rl: dict[str, Any]) -> dict[str, Any]:
    """The check's sizes for one stage's section, from what its config class is: the supervised
    loop's (SupervisedConfig) or the RL trainer's (PPOConfig), each key only where the class has
    that field; {} for another kind."""
    from pipeline.config import PPOConfig, SupervisedConfig
    fields = {f.name: f for f in dataclasses.fields(section)}
    if issubclass(section, SupervisedConfig):
        return {k: v for k, v in supervised.items() if k in fields}
    if not issubclass(section, PPOConfig):
        return {}
    got = {k: v for k, v in rl.items() if k in fields}
    if fields["samples_per_prompt"].default > 1:
        # A group estimator's section (one that samples several responses per prompt by default):
        # 4 per prompt, 16 prompts of the 64 rollouts (tiny: 2 of 8), whole groups on each of 2 ranks.
        got["samples_per_prompt"] = 4
    return got


def check_params(size: Size, suite: Suite, cuda: bool, base: Path) -> dict[str, Any]:
    """The overrides of the repository's params.yaml every run shares: small data, a few steps of
    each stage, responses of `size.new_tokens`, and the distributed settings of `suite`. Each
    stage's section is sized by what it is (`section_params`), so a new stage is sized unnamed."""
    processes = suite.processes
    gen = {"max_new_tokens": size.new_tokens}
    seq = 64 + size.new_tokens           # the longest prompt the check keeps plus a whole response
    if not suite.deepspeed:
        dist = {"backend": "none", "device": "auto", "precision": "bf16" if cuda else "fp32"}
    else:
        dist = {"backend": "deepspeed", "num_processes": processes, "zero_stage": 3,
                "precision": "bf16" if cuda else "fp32", "device": "auto"}
    batch = 32
    rl = {"iterations": 2, "rollout_batch_size": 64, "minibatch_size": 32, "micro_batch_size": 8, "ppo_epochs": 1,
          "save_every": 100, "n_eval_prompts": 16, "max_prompt_length": 64, "sampling": gen}
    if size is TINY:
        rl.update(rollout_batch_size=8, minibatch_size=4, micro_batch_size=2, n_eval_prompts=4)
        batch = 8
    held_out = rl["n_eval_prompts"]
    # The supervised loop's sizes, then the fields some supervised sections add: sequences that hold
    # a whole response, held-out samples as many as the RL sections take, and rejection sampling's
    # one batch of training prompts at the fewest candidates a best-of picks among.
    supervised = {"batch_size": batch, "epochs": 1.0, "eval_every": 100, "save_every": 100, "max_length": seq,
                  "sampling": gen, "n_eval_prompts": held_out, "n_eval_generations": held_out,
                  "n_sft_samples": held_out, "n_prompts": batch, "n": 2}
    # The reward model's final evaluation on a validation split of real size: a stage whose held-out
    # work ran on one rank's CPU (or on rank 0 alone) shows there, not on a few dozen pairs.
    held_out_pairs = batch if size is TINY else 2048
    out = {
        "data": {"n_sft": 4 * batch, "n_sft_eval": batch, "n_pairs": 4 * batch, "n_pairs_eval": held_out_pairs,
                 "n_ppo_prompts": 256, "n_eval_prompts": 32},
        "model": {"name_or_path": str(base), "max_position_embeddings": 2 * seq},
        "distributed": dist,
    }
    for name, section in stage_sections().items():
        got = section_params(section, supervised, rl)
        if got:
            out[name] = got
    # evaluate's best-of-n baseline at its fewest samples and its bootstrap at its fewest resamples;
    # compare measures at params.yaml's sizes.
    out["evaluate"] = {"n_prompts": held_out, "best_of_n": [2], "bootstrap": 100}
    return out


def build_base(size: Size, folder: Path) -> dict[str, Any]:
    """The random Llama every stage starts from, with its word tokenizer, as a checkpoint saved in
    bf16 as hub checkpoints are (the stages train it as fp32 master weights all the same)."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from pipeline.data.tokenizer import build_word_tokenizer
    from pipeline.tasks import reviews

    words = reviews.vocabulary()
    filler = size.vocab - len(build_word_tokenizer(words))
    if filler < 0:
        raise ValueError(f"vocabulary {size.vocab}: the task's words and special tokens alone are more")
    tok = build_word_tokenizer(words + [f"w{i}" for i in range(filler)])   # no task word looks like w<digits>
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=size.hidden, num_hidden_layers=size.layers, num_attention_heads=size.heads,
        num_key_value_heads=size.heads, intermediate_size=size.intermediate,
        max_position_embeddings=2 * (64 + size.new_tokens), tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    model.generation_config = GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                               pad_token_id=tok.pad_token_id)
    model.to(torch.bfloat16).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    total = sum(p.numel() for p in model.parameters())
    return {"vocab": len(tok), "parameters": total, "saved_dtype": "bfloat16",
            "parameters_counted": total - model.get_input_embeddings().weight.numel()}


def trained_example(cfg: Any) -> Optional[tuple[str, tuple[str, ...]]]:
    """What one example of a supervised section's batch is, by its config class: the prepare stage's
    training file and the response columns whose sequences (the prompt, then that response) it
    trains; None for the others, which report time and memory only (KTO's examples carry a
    mismatched response each for its KL point; rejection sampling trains on winners it samples first)."""
    from pipeline.config import PreferenceOptConfig, RewardConfig, SFTConfig
    if isinstance(cfg, SFTConfig):
        return "sft_train.jsonl", ("response",)
    if isinstance(cfg, (RewardConfig, PreferenceOptConfig)):   # a pair: both of its sequences train
        return "pairs_train.jsonl", ("chosen", "rejected")
    return None


def mean_tokens(data: Path, base: Path, example: tuple[str, tuple[str, ...]]) -> float:
    """Mean tokens of one training example (`trained_example`'s: a pair's two sequences for reward and DPO)."""
    from pipeline.files import read_jsonl
    from pipeline.data.tokenizer import load_tokenizer

    tok = load_tokenizer(base)
    file, responses = example
    rows = read_jsonl(data / file, ("prompt", *responses))
    texts = [r["prompt"] + " " + r[k] for r in rows for k in responses]
    lengths = [len(tok(t)["input_ids"]) + 1 for t in texts]   # + eos
    return len(responses) * sum(lengths) / len(lengths) if lengths else 0.0


def peak_tflops() -> Optional[float]:
    if os.environ.get("GPU_PEAK_TFLOPS"):
        return float(os.environ["GPU_PEAK_TFLOPS"])
    import torch
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in sorted(PEAK_TFLOPS.items(), key=lambda kv: -len(kv[0])) if k in name), None)


def read_tsv(path: Path) -> list[dict[str, float]]:
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [{k: float(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(f, delimiter="\t")]


def throughput(run: Run, out: Path, params: Any, n: int, tokens_per_example: float) -> dict[str, float]:
    """Tokens per second and model TFLOP/s of one finished stage (see the module doc)."""
    from pipeline.config import PPOConfig, flatten
    metrics = flatten(json.loads((out / "metrics.json").read_text()), sep="/")
    got: dict[str, float] = {}
    cfg = getattr(params, run.stage, None)   # the stage's section: its kind picks the formula
    if trained_example(cfg) is not None:
        seconds = metrics.get("train/seconds") or 0.0
        tokens = metrics.get("train/steps", 0) * cfg.batch_size * tokens_per_example
        if seconds > 0:
            got["tokens_per_second"] = tokens / seconds
            got["tflops"] = 6 * n * tokens / seconds / 1e12
    elif isinstance(cfg, PPOConfig):
        rows = read_tsv(out / "train.tsv")
        if rows:
            last = rows[-1]   # the first iteration carries compilation and allocator warm-up
            trained = 2 if cfg.uses_critic and not cfg.shared_backbone else 1   # the actor, and a critic model
            got["tokens_per_second"] = last.get("tokens_per_second/rollout", 0.0)
            got["update_tokens_per_second"] = last.get("tokens_per_second/update", 0.0)
            got["rollout_tflops"] = 2 * n * got["tokens_per_second"] / 1e12
            got["tflops"] = 6 * n * trained * got["update_tokens_per_second"] / 1e12
            for key in ("val/logprob_diff_mean", "val/logprob_diff_max"):
                if key in last:
                    got[key] = max(r[key] for r in rows if key in r)
    for key in ("resources/peak_device_gib", "resources/peak_rss_gib", "resources/wall_seconds",
                "resources/cpu_matmul_gflop"):
        if isinstance(metrics.get(key), (int, float)):
            got[key] = float(metrics[key])
    return got


def planned_gib(stage: str, params: Any, inputs: dict[str, Path]) -> Optional[float]:
    """`python -m pipeline plan`'s total per rank for the stage (None while an input is missing)."""
    from pipeline.stages import registry
    from pipeline.training import memory_plan
    plan = memory_plan.stage_plan(stage, registry.spec(stage).plan, params, inputs)
    return None if plan is None else plan.total / GIB


def cpu_compute(r: dict[str, Any]) -> Optional[str]:
    """Why a finished stage fails the check for the work its process did on CPU tensors while its
    device was a GPU (`resources/cpu_matmul_gflop`, counted only there); None when it does not."""
    gflop = r.get("resources/cpu_matmul_gflop")
    if gflop is None or gflop <= CPU_MATMUL_GFLOP:
        return None
    return (f"its process ran {gflop:.3g} GFLOP of matrix products on CPU tensors while its device was the GPU "
            f"(more than {CPU_MATMUL_GFLOP:g}): model work on one rank's CPU, which on several GPUs the other ranks "
            "wait for in a collective")


def line(name: str, r: dict[str, Any], peak: Optional[float], cuda: bool) -> str:
    measured = r.get("resources/peak_device_gib" if cuda else "resources/peak_rss_gib")
    # The stage's own time (resources/wall_seconds), then the command's with start-up and launcher.
    parts = [f"{name:10s} {r.get('resources/wall_seconds', 0.0):6.1f}s ({r.get('seconds', 0.0):.0f}s with start-up)"]
    plan = r.get("plan_gib")
    parts.append(f"memory plan {'n/a' if plan is None else f'{plan:.3g}'} GiB, measured "
                 f"{'n/a' if measured is None else f'{measured:.3g}'} GiB ({'GPU peak' if cuda else 'peak RSS'})")
    if "tokens_per_second" in r:
        rate = f"{r['tokens_per_second']:,.0f} tok/s"
        if "update_tokens_per_second" in r:
            rate = f"rollout {rate}, update {r['update_tokens_per_second']:,.0f} tok/s"
        parts.append(rate)
    if "tflops" in r:
        mfu = f", MFU {100 * r['tflops'] / peak:.1f}%" if peak else ""
        parts.append(f"{r['tflops']:.2f} TFLOP/s{mfu}")
    if "val/logprob_diff_max" in r:
        parts.append(f"logprob_diff mean {r['val/logprob_diff_mean']:.2e} max {r['val/logprob_diff_max']:.2e}")
    return "  ".join(parts[:2]) + ("; " + "; ".join(parts[2:]) if parts[2:] else "")


def run_suite(suite: Suite, size: Size, cuda: bool, root: Path, deadline: float, results: dict[str, Any],
              save, only: Optional[set[str]] = None) -> tuple[list[str], list[str]]:
    """Every run of `runs(suite)` (of those named in `only`, when given); returns (failed, skipped) names."""
    from pipeline.config import load_params
    from pipeline.devices import COUNT_CPU_MATMULS
    from pipeline.files import atomic_write_text
    from pipeline.training.distributed import _free_port   # each run its own port (see below)

    say(f"\n== {suite.title(cuda)}")
    done: dict[str, Any] = results.setdefault("suites", {}).setdefault(suite.name, {})
    tag = f"{suite.name}p" if suite.name.isdigit() else suite.name   # how failures name the suite
    from ruamel.yaml import YAML
    repo_params = YAML(typ="safe", pure=True).load((REPO / "params.yaml").read_text())
    shared = check_params(size, suite, cuda, root / "base")
    here = root / f"p{suite.name}"
    failed: list[str] = []
    skipped: list[str] = []
    # PYTHONFAULTHANDLER: a rank that dies of a signal (an abort in a library's threads) prints its
    # Python stacks before it goes, so its log says where.
    env = {**os.environ, "PIPELINE_TRACKING": "off", "PYTHONUNBUFFERED": "1", "PYTHONFAULTHANDLER": "1",
           COUNT_CPU_MATMULS: "1"}
    durations: list[float] = []
    for run in [r for r in runs(suite) if only is None or r.name in only]:
        out = here / run.folder
        # The data and the random base are shared; the other inputs are this suite's own outputs.
        inputs = {k: root / v if v in ("data", "base") else here / v for k, v in run.inputs.items()}
        policies = {name: here / folder for name, folder in run.policies.items()}
        missing = [str(p) for p in [*inputs.values(), *policies.values()] if not p.exists()]
        if missing:
            say(f"{run.name:10s} not run: its input {missing[0]} was not written (a stage above failed)")
            failed.append(f"{tag} {run.name}")
            continue
        typical = max(durations, default=0.0)
        if time.monotonic() + typical > deadline:
            say(f"{run.name:10s} skipped: the time budget has {max(0, deadline - time.monotonic()):.0f}s left, "
                f"a stage here took up to {typical:.0f}s")
            skipped.append(f"{tag} {run.name}")
            continue
        values = merge(merge(repo_params, shared), run.params)
        # Each run its own free port: a launcher still releasing the last one, or another job on
        # this machine, must not meet this one.
        values["distributed"]["master_port"] = _free_port()
        path = root / f"params-{tag}-{run.folder}.yaml"
        atomic_write_text(path, json.dumps(values, indent=1) + "\n")   # JSON is YAML
        params = load_params(path)
        record: dict[str, Any] = {"stage": run.stage, "lora": run.lora}
        try:
            record["plan_gib"] = planned_gib(run.stage, params, inputs)
        except Exception as err:   # the check measures anyway
            record["plan_gib"], record["plan_error"] = None, f"{type(err).__name__}: {err}"
        cmd = [sys.executable, "-m", "pipeline", run.stage, "--params", str(path), "--no-progress",
               *(x for k, p in inputs.items() for x in (f"--{k}", str(p))),
               *(x for name, p in policies.items() for x in ("--policy", f"{name.replace('+', '-')}={p}")),
               "--out", str(out)]
        log = root / "logs" / f"{tag}-{run.folder}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        start = time.monotonic()
        with open(log, "w") as f:
            proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=max(60.0, deadline - start + 120))
        record["seconds"] = time.monotonic() - start
        durations.append(record["seconds"])
        if proc.returncode != 0:
            text = log.read_text(errors="replace").splitlines()
            # The first traceback (or a rank's abort) says what went wrong; the launcher's summary
            # after it only who died.
            first = next((i for i, t in enumerate(text) if t.startswith(("Traceback", "Fatal Python error"))
                          or "Error" in t or "terminate called" in t), None)
            tail = (text[first:first + 30] + ["    ..."] if first is not None else []) + text[-12:]
            say(f"{run.name:10s} FAILED (exit {proc.returncode} after {record['seconds']:.0f}s): "
                + " ".join(cmd[2:4]) + f" ...; the end of its log ({log}):")
            for text in tail:
                say(f"    {text}")
            record["error"] = "\n".join(tail)
            failed.append(f"{tag} {run.name}")
        else:
            try:
                n = results["model"]["parameters_counted"]
                example = trained_example(getattr(params, run.stage, None))
                per_example = mean_tokens(root / "data", root / "base", example) if example else 0.0
                record.update(throughput(run, out, params, n, per_example))
                say(line(run.name, record, results.get("peak_tflops"), cuda))
                wrong = cpu_compute(record)
                if wrong:
                    say(f"{run.name:10s} FAILED: {wrong}")
                    record["error"] = wrong
                    failed.append(f"{tag} {run.name}")
            except Exception as err:   # the stage ran; reading its numbers did not: a failure of the check
                say(f"{run.name:10s} FAILED reading its results: {type(err).__name__}: {err}")
                record["error"] = f"{type(err).__name__}: {err}"
                failed.append(f"{tag} {run.name}")
        done[run.name] = record
        save()
    return failed, skipped


def versions() -> dict[str, str]:
    import importlib.metadata as md
    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "deepspeed", "peft", "accelerate"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = "not installed"
    return out


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help="a tiny model with short responses (the tests' CPU run)")
    ap.add_argument("--suite", choices=sorted(SUITES), action="append", default=None,
                    help="run this suite (repeatable): 1 (plain PyTorch, every stage), ds1 (DeepSpeed at one "
                         "process), 2 (two processes, ZeRO-3); default: 1 and ds1, and 2 when two GPUs are visible; "
                         "--tiny: 1")
    ap.add_argument("--processes", type=int, choices=(1, 2), action="append", default=None,
                    help="the same as --suite 1 or --suite 2")
    ap.add_argument("--only", action="append", default=[], metavar="SUITE:RUN",
                    help="run only these runs of a suite, e.g. ds1:sft (repeatable; a suite named in none runs whole)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help=f"skip a stage that would end after this many seconds (default: {BUDGET_S:.0f} for the "
                         f"one-GPU suites, {BUDGET_S:.0f} more for the two-process one)")
    ap.add_argument("--new-tokens", type=int, default=None,
                    help=f"response length (default: {DEFAULT.new_tokens}; --tiny: {TINY.new_tokens})")
    ap.add_argument("--out", type=Path, default=None, help="write every number measured as JSON here")
    ap.add_argument("--keep", type=Path, default=None, help="work in this folder and keep it (default: a temporary one)")
    args = ap.parse_args(argv)
    start = time.monotonic()
    import torch
    cuda = torch.cuda.is_available()
    if not cuda and not args.tiny:
        print(f"gpu_check: torch {torch.__version__} sees no CUDA device; run it on a GPU machine "
              "(or --tiny for the same path on the CPU)", file=sys.stderr)
        return 2
    gpus = torch.cuda.device_count() if cuda else 0
    asked = (args.suite or []) + [str(p) for p in args.processes or []]
    deepspeed = importlib.util.find_spec("deepspeed") is not None
    default = ["1"] if args.tiny else ["1", "ds1"] + ["2"] * (gpus >= 2)
    suites = [SUITES[name] for name in dict.fromkeys(asked or default)]
    only: dict[str, set[str]] = {}
    for item in args.only:
        name, _, run = item.partition(":")
        if name not in SUITES or run not in {r.name for r in runs(SUITES[name])}:
            ap.error(f"--only {item}: not a suite:run of this check (e.g. ds1:sft)")
        only.setdefault(name, set()).add(run)
    if cuda and max(s.processes for s in suites) > gpus:
        ap.error(f"suite 2: only {gpus} GPU visible")
    size = TINY if args.tiny else DEFAULT
    if args.new_tokens is not None:
        size = Size(**{**size.__dict__, "new_tokens": args.new_tokens})
    budget = args.budget_s if args.budget_s is not None else BUDGET_S * (1 + any(s.processes > 1 for s in suites))
    deadline = start + budget
    device = ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)) if cuda else "cpu (no CUDA device)"
    results: dict[str, Any] = {"device": device, "gpus": gpus, "versions": versions(), "size": size.__dict__,
                               "budget_s": budget, "peak_tflops": peak_tflops()}
    say(f"gpu_check: {time.strftime('%Y-%m-%d %H:%M:%S')}  device: {device}")
    say("  " + "  ".join(f"{k} {v}" for k, v in results["versions"].items()))
    if cuda and results["peak_tflops"] is None:
        say("  MFU n/a: this GPU is not in the table; set GPU_PEAK_TFLOPS=<dense bf16 TFLOP/s>")

    def save() -> None:
        if args.out is not None:
            from pipeline.files import atomic_write_json
            atomic_write_json(args.out, results)

    failed: list[str] = []
    skipped: list[str] = []
    with tempfile.TemporaryDirectory(prefix="gpu_check.") as tmp:
        root = args.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        results["model"] = build_base(size, root / "base")
        m = results["model"]
        say(f"model: Llama {size.hidden} wide, {size.layers} layers, vocabulary {m['vocab']:,}: "
            f"{m['parameters'] / 1e6:.1f}M parameters ({m['parameters_counted'] / 1e6:.1f}M counted for MFU); "
            f"responses of {size.new_tokens} tokens")
        from pipeline.config import load_params
        from pipeline.files import atomic_write_text
        from pipeline.stages.prepare import write as prepare
        from ruamel.yaml import YAML
        values = merge(YAML(typ="safe", pure=True).load((REPO / "params.yaml").read_text()),
                       check_params(size, SUITES["1"], cuda, root / "base"))
        atomic_write_text(root / "params-prepare.yaml", json.dumps(values, indent=1) + "\n")
        prepare(load_params(root / "params-prepare.yaml").data, root / "data")
        save()
        for suite in suites:
            if suite.deepspeed and not deepspeed:
                say(f"\n== {suite.title(cuda)}: not run, DeepSpeed is not installed here")
                skipped.append(f"{suite.name} (DeepSpeed not installed)")
                continue
            f, s = run_suite(suite, size, cuda, root, deadline, results, save, only.get(suite.name))
            failed += f
            skipped += s
    results["seconds"] = time.monotonic() - start
    results["failed"], results["skipped"] = failed, skipped
    save()
    say(f"\ngpu_check: {results['seconds']:.0f}s in all")
    if failed:
        say(f"gpu_check: FAILED: {', '.join(failed)}")
        return 1
    if skipped:
        say(f"gpu_check: incomplete: {', '.join(skipped)} not run (the budget, --budget-s, or as said)")
        return 3
    say("gpu_check: every stage ran")
    return 0


if __name__ == "__main__":
    sys.exit(main())
