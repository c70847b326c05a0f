"""Scaling out on CPU: DeepSpeed engines in 1 and 2 processes (gloo), ZeRO-2/3, two nodes (two launches on
this host), LoRA, the generated DeepSpeed configs, the launch commands, and a killed-then-resumed 2-process PPO run.

The multi-process tests run the real stage command (`python -m pipeline <stage>`), which re-runs
itself under torchrun, on tiny params. The first DeepSpeed start on a machine compiles a small
communication op (about a minute); TORCH_EXTENSIONS_DIR (set by the Makefile) keeps it cached.
"""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from conftest import BIN, HELPERS, REPO, TINY, free_port, merge, project_copy, run, run_env, write_params
from pipeline.models import lora
from pipeline.config import DistributedConfig, LoraConfig, Params, PPOConfig, SamplingConfig, from_dict
from pipeline.training.distributed import launch_command, with_node
from pipeline.training.engines import deepspeed_config, validate_deepspeed_config
from pipeline.errors import ConfigError
from pipeline.models.checkpoints import load_policy
from pipeline.ppo.placement import AdapterOff, SharedValueHead, place_models
from pipeline.ppo.rollout import rollout
from pipeline.ppo.scoring import policy_logprobs
from pipeline.ppo.trainer import PPOTrainer

# Per-step losses of 2 processes vs 1 process with the same global batch. The maths is identical;
# only the order of float32 additions differs (gradients are summed over ranks by all-reduce).
LOSS_TOL = 1e-4
PROMPT = "Review the film Silent River . Focus on the music ."


def stage(name: str, params: Path, root: Path, out: str, *extra: str, check: bool = True) -> subprocess.CompletedProcess:
    with_rm = ["--data", "data", "--sft", "sft/model", "--reward", "rm/model"]
    paths = {"sft": ["--data", "data"], "reward": ["--data", "data", "--sft", "sft/model"], "ppo": with_rm,
             "dpo": ["--data", "data", "--sft", "sft/model"], "grpo": with_rm, "rs": with_rm}[name]
    cmd = [sys.executable, "-m", "pipeline", name, "--params", str(params), *paths, "--out", out, "--no-progress", *extra]
    env = {**run_env(), "PYTHONPATH": str(REPO)}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def tsv(path: Path) -> list[dict[str, float]]:
    with open(path) as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f, delimiter="\t")]


def params_file(root: Path, name: str, override: dict) -> Path:
    path = root / f"{name}.yaml"
    dist = override.get("distributed", {})
    if dist.get("backend") == "deepspeed":   # every launch its own rendezvous port
        override = merge(override, {"distributed": {"master_port": free_port()}})
    write_params(path, merge(TINY, override))
    return path


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """Prepared tiny data and plain single-process SFT and RM runs to compare against."""
    root = tmp_path_factory.mktemp("dist")
    base = params_file(root, "plain", {})
    subprocess.run([sys.executable, "-m", "pipeline", "prepare", "--params", str(base), "--out", "data"],
                   cwd=root, env={**run_env(), "PYTHONPATH": str(REPO)}, check=True, capture_output=True)
    stage("sft", base, root, "sft")
    stage("reward", base, root, "rm")
    return root


ZERO2_2PROC = {"distributed": {"backend": "deepspeed", "zero_stage": 2, "num_processes": 2}}


def one_node(root: Path, name: str, zero: int) -> str:
    """The folder of stage `name` run on one node with two processes at ZeRO-`zero` (run once per
    module: the tests comparing against it share it)."""
    out = f"{name}_1n_z{zero}"
    if not (root / out / "metrics.json").exists():
        p = params_file(root, f"one_node_z{zero}", {"distributed": {"backend": "deepspeed", "zero_stage": zero,
                                                                    "num_processes": 2}})
        assert "launching 2 processes" in stage(name, p, root, out).stdout
    return out


def test_two_process_zero2_sft_and_rm_match_one_process(root):
    sft2, rm2 = one_node(root, "sft", 2), one_node(root, "reward", 2)
    for one, two, keys in (("sft", sft2, ("loss", "grad_norm", "lr")),
                           ("rm", rm2, ("loss", "accuracy", "grad_norm", "lr"))):
        a, b = tsv(root / one / "train.tsv"), tsv(root / two / "train.tsv")
        assert len(a) == len(b) == {"sft": 4, "rm": 3}[one]   # 64 demos, 48 pairs / global batch 16
        for ra, rb in zip(a, b):
            for k in keys:
                assert abs(ra[k] - rb[k]) <= LOSS_TOL * max(1.0, abs(ra[k])), (one, k, ra, rb)
        assert abs(tsv(root / one / "eval.tsv")[-1]["loss"] - tsv(root / two / "eval.tsv")[-1]["loss"]) <= LOSS_TOL
    # Training moved the weights (the comparison is not between two untrained models).
    assert tsv(root / "sft" / "train.tsv")[-1]["loss"] < tsv(root / "sft" / "train.tsv")[0]["loss"]
    ds = json.loads((root / sft2 / "deepspeed_config.json").read_text())
    assert ds["zero_optimization"]["stage"] == 2
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"]) == (16, 8, 1)
    # Only rank 0 wrote, and what it wrote loads as a plain HF model.
    AutoModelForCausalLM.from_pretrained(str(root / sft2 / "model"))
    assert not (root / "sft" / "deepspeed_config.json").exists()


def test_compare_methods_under_two_process_zero2(root):
    """The methods of compare/dvc.yaml scale out as the default stages do: DPO's steps in 2
    processes match 1 process (its cached reference log-probs included); GRPO runs without a critic
    (no critic in the DeepSpeed config); rejection sampling samples and fine-tunes on both."""
    plain, zero2 = params_file(root, "plain_methods", {}), params_file(root, "zero2_methods", ZERO2_2PROC)
    stage("dpo", plain, root, "dpo1")
    assert "launching 2 processes" in stage("dpo", zero2, root, "dpo2").stdout
    a, b = tsv(root / "dpo1" / "train.tsv"), tsv(root / "dpo2" / "train.tsv")
    assert len(a) == len(b) == 3                                   # 48 pairs / global batch 16
    for ra, rb in zip(a, b):
        for k in ("loss", "margin", "chosen_logp", "rejected_logp", "grad_norm"):
            assert abs(ra[k] - rb[k]) <= LOSS_TOL * max(1.0, abs(ra[k])), (k, ra, rb)
    stage("grpo", zero2, root, "grpo2")
    ds = json.loads((root / "grpo2" / "deepspeed_config.json").read_text())
    assert "actor" in ds and "critic" not in ds
    assert not list((root / "grpo2").rglob("critic*"))
    stage("rs", zero2, root, "rs2")
    winners = (root / "rs2" / "winners.jsonl").read_text().splitlines()
    assert len(winners) == 1 + TINY["rs"]["n_prompts"]              # the header, then one winner per prompt
    AutoModelForCausalLM.from_pretrained(str(root / "rs2" / "model"))


def test_zero3_offload_under_the_deepspeed_launcher_and_bf16(root):
    """ZeRO-3 with optimizer and parameter offload (DeepSpeed's CPU Adam from the generated config),
    started by the `deepspeed` launcher, matches plain PyTorch; bf16 stays close to fp32."""
    runs = {"offload": {"zero_stage": 3, "offload_optimizer": True, "offload_param": True, "launcher": "deepspeed"},
            "bf16": {"zero_stage": 2, "precision": "bf16"}}
    for name, dist in runs.items():
        p = params_file(root, name, {"distributed": {"backend": "deepspeed", "num_processes": 2, **dist}})
        stage("sft", p, root, f"sft_{name}")
    plain = tsv(root / "sft" / "train.tsv")
    for tol, name in ((LOSS_TOL, "offload"), (2e-2, "bf16")):
        for a, b in zip(plain, tsv(root / f"sft_{name}" / "train.tsv"), strict=True):
            assert abs(a["loss"] - b["loss"]) <= tol * a["loss"], (name, a, b)
    ds = json.loads((root / "sft_offload" / "deepspeed_config.json").read_text())
    assert ds["optimizer"]["type"] == "AdamW" and ds["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert json.loads((root / "sft_bf16" / "deepspeed_config.json").read_text())["bf16"]["enabled"] is True


def test_two_process_ppo_zero2_and_zero3_agree(root):
    runs = {}
    folders = {"ppo_z2": one_node(root, "ppo", 2), "ppo_z3": one_node(root, "ppo", 3)}
    for name in folders:
        runs[name] = tsv(root / folders[name] / "train.tsv")
        assert [r["step"] for r in runs[name]] == [1, 2, 3]
        # Both ranks contributed: the update saw the whole global batch of 8 rollouts (4 per rank).
        assert all(r["rollouts"] == 8 for r in runs[name])
    for a, b in zip(runs["ppo_z2"], runs["ppo_z3"]):
        for k in ("objective/scores", "objective/kl", "loss/policy", "loss/value", "val/vpred"):
            assert abs(a[k] - b[k]) <= 1e-4 * max(1.0, abs(a[k])), (k, a[k], b[k])
    ds = json.loads((root / folders["ppo_z3"] / "deepspeed_config.json").read_text())
    # Reference and reward model were ZeRO-3 inference engines (partitioned, no optimizer).
    assert ds["frozen"]["zero_optimization"]["stage"] == 3 and "optimizer" not in ds["frozen"]
    assert ds["actor"]["zero_optimization"]["stage"] == 3
    assert json.loads((root / folders["ppo_z2"] / "deepspeed_config.json").read_text())["frozen"] is None   # replicated
    metrics = json.loads((root / folders["ppo_z3"] / "metrics.json").read_text())
    # The held-out comparison ran where the models were (ZeRO-3: each gathered in turn), shared out
    # over both ranks: the reference against itself has KL exactly 0, and ZeRO-2 measured the same.
    # (A policy three small updates from SFT draws, from the same per-prompt streams, nearly SFT's
    # responses: its sampled KL estimate sits at 0 and may fall a hair below it.)
    z2 = json.loads((root / folders["ppo_z2"] / "metrics.json").read_text())
    assert metrics["sft"]["kl"] == 0.0 and "gold_gain" in metrics["ppo"]
    for policy, key in (("ppo", "kl"), ("ppo", "rm"), ("sft", "rm"), ("ppo", "gold")):
        a, b = metrics[policy][key], z2[policy][key]
        assert abs(a - b) <= 1e-4 * max(1.0, abs(b)), (policy, key)


def test_two_process_ppo_killed_then_resumed_equals_uninterrupted(root, tmp_path):
    p = params_file(root, "resume", merge(ZERO2_2PROC, {"ppo": {"iterations": 4, "save_every": 2}}))
    stage("ppo", p, root, "full")
    # Kill both ranks at iteration 3 (after the checkpoint of iteration 2): a sitecustomize that
    # only this run sees makes PPOTrainer.step die there, like a node lost mid-run.
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os\n"
        "if os.environ.get('LOCAL_RANK') is not None:\n"
        "    from pipeline.ppo import trainer\n"
        "    step = trainer.PPOTrainer.step\n"
        "    def dying(self):\n"
        "        if self.iteration == 2:\n"
        "            os._exit(9)\n"
        "        return step(self)\n"
        "    trainer.PPOTrainer.step = dying\n")
    env = {**run_env(), "PYTHONPATH": f"{hook}{os.pathsep}{REPO}",
           "TORCH_EXTENSIONS_DIR": os.environ.get("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))}
    cmd = [sys.executable, "-m", "pipeline", "ppo", "--params", str(p), "--data", "data", "--sft", "sft/model",
           "--reward", "rm/model", "--out", "resumed", "--no-progress"]
    killed = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert killed.returncode != 0
    assert json.loads((root / "resumed/checkpoint/state.json").read_text())["iteration"] == 2
    assert not (root / "resumed/model").exists()
    proc = stage("ppo", p, root, "resumed")
    assert "resuming" in proc.stderr
    a, b = tsv(root / "full/train.tsv"), tsv(root / "resumed/train.tsv")
    timing = ("time/", "tokens_per_second/")
    assert [{k: v for k, v in r.items() if not k.startswith(timing)} for r in a] == \
           [{k: v for k, v in r.items() if not k.startswith(timing)} for r in b]
    wa = AutoModelForCausalLM.from_pretrained(str(root / "full/model")).state_dict()
    wb = AutoModelForCausalLM.from_pretrained(str(root / "resumed/model")).state_dict()
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# ---- Two nodes ----------------------------------------------------------------------------------


def two_nodes(name: str, params: Path, root: Path, out: str) -> list[str]:
    """The stage command twice at once on this host, as node 1 and node 0 of a two-node job (each
    starts torchrun with one process; master 127.0.0.1, gloo); what each printed."""
    with_rm = ["--data", "data", "--sft", "sft/model", "--reward", "rm/model"]
    paths = {"sft": ["--data", "data"], "reward": ["--data", "data", "--sft", "sft/model"], "ppo": with_rm}[name]
    cmd = [sys.executable, "-m", "pipeline", name, "--params", str(params), *paths, "--out", out, "--no-progress",
           "--master-addr", "127.0.0.1"]
    env = {**run_env(), "PYTHONPATH": str(REPO)}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    procs = [subprocess.Popen([*cmd, "--node-rank", str(rank)], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in (1, 0)]
    printed = []
    for proc in procs:
        out_, err = proc.communicate(timeout=900)
        assert proc.returncode == 0, f"{name} node: exit {proc.returncode}\n{out_[-2000:]}\n{err[-4000:]}"
        printed.append(out_ + err)
    return printed


# Each stage across nodes once, each ZeRO stage once: PPO (four models, each partitioned) under
# ZeRO-3; the one-node runs compared against are the ones the tests above made already.
@pytest.mark.parametrize("zero,stages", [(2, ("sft", "reward")), (3, ("ppo",))], ids=["zero2-sft-reward", "zero3-ppo"])
def test_two_nodes_train_sft_rm_and_ppo_as_one_node_of_two_processes_does(root, zero, stages, monkeypatch):
    """Two launches as nodes 0 and 1 (`num_nodes: 2`, one process each) equal, bit for bit, one node
    with two processes: the same two ranks doing the same sums in the same order; only how they were
    started differs. (On two hosts with different CPUs the bits could differ; the maths would not.)"""
    # torchrun sets OMP_NUM_THREADS=1 for its processes only when it starts several per node: the
    # one-node run would train at 1 thread and the two-node run (one process per node) at all cores,
    # which changes PPO's float sums. Both at 1 thread, as the test workers run.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    two = params_file(root, f"two_nodes_z{zero}", {"distributed": {"backend": "deepspeed", "zero_stage": zero,
                                                                   "num_processes": 1, "num_nodes": 2}})
    for name in stages:
        a, b = one_node(root, name, zero), f"{name}_2n_z{zero}"
        node1, node0 = two_nodes(name, two, root, b)
        for printed, rank in ((node0, 0), (node1, 1)):
            assert f"--nnodes=2 --node_rank={rank} --master_addr=127.0.0.1" in printed, printed[-2000:]
        assert f"{name}: wrote {b}" in node0 and f"{name}: wrote" not in node1   # rank 0 writes, on node 0
        weights = [(root / f / "model/model.safetensors").read_bytes() for f in (a, b)]
        assert weights[0] == weights[1], f"{name} ZeRO-{zero}: the two-node model differs from the one-node model"
        timing = ("time/", "tokens_per_second", "seconds")
        rows = [[{k: v for k, v in r.items() if not any(t in k for t in timing)} for r in tsv(root / f / "train.tsv")]
                for f in (a, b)]
        assert rows[0] == rows[1] and len(rows[1]) >= 3 and rows[1][0] != rows[1][-1], name   # and it trained


@pytest.mark.slurm
def test_two_slurm_nodes_train_sft_as_one_node_of_two_processes_does(root, tmp_path):
    """The same through SLURM: the Snakemake profile's job for a `nodes: 2` stage (partition `two`
    of the local cluster: two slurmd on this host, scripts/slurm-local.sh) starts the stage command
    once per node with `srun`, each copy takes its node rank from SLURM_NODEID and rank 0's host from
    the job's node list, and the model equals the one-node two-process model bit for bit."""
    out = subprocess.run(["sinfo", "-h", "-p", "two", "-o", "%D"], capture_output=True, text=True).stdout.split()
    if sum(int(n) for n in out) < 2:
        import conftest
        conftest.tier_unavailable("slurm", "SLURM tier: no partition `two` of two nodes here (`make slurm-setup` "
                                           "makes one)")
    one = one_node(root, "sft", 2)
    two = {"backend": "deepspeed", "zero_stage": 2, "num_processes": 1, "num_nodes": 2, "master_port": free_port()}
    repo = project_copy(tmp_path, "two_nodes", {"sft": {"distributed": two}},
                        jobs={"sft": {"nodes": 2, "slurm_partition": "two", "cpus_per_task": 1, "mem_mb": 4000}})
    env = {**run_env(), "OMP_NUM_THREADS": "1"}   # as torchrun gives each of the one-node run's two processes
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    run([str(BIN / "snakemake"), "--profile", "profiles/slurm", "--slurm-init-seconds-before-status-checks", "1",
         "--seconds-between-status-checks", "2", "sft"], repo, timeout=1200, env=env)
    log = (repo / "logs/sft.log").read_text()
    # Each node's copy launched its one local process as that node: both ranks of the job ran.
    for rank in (0, 1):
        assert f"--nnodes=2 --node_rank={rank} --master_addr=" in log, log[-3000:]
    job = next((repo / "logs/slurm/rule_sft").glob("*.log")).stem
    state = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    assert "JobState=COMPLETED" in state and "NumNodes=2" in state, state
    weights = [(f / "model/model.safetensors").read_bytes() for f in (root / one, repo / "outputs/sft")]
    assert weights[0] == weights[1], "the SLURM two-node SFT model differs from the one-node two-process model"


# ---- LoRA ---------------------------------------------------------------------------------------

TINY_PPO = dict(iterations=2, rollout_batch_size=8, minibatch_size=4, micro_batch_size=2, ppo_epochs=2,
                n_eval_prompts=8, lr=1e-2, critic_lr=1e-2, sampling=SamplingConfig(max_new_tokens=10))


def test_lora_ppo_trains_only_adapters_and_reference_is_the_sft_model(root):
    params = Params(ppo=PPOConfig(**TINY_PPO, lora=LoraConfig(r=4), critic_lora=LoraConfig(r=4)))
    m = place_models(params, root / "sft/model", root / "rm/model")
    assert isinstance(m.ref, AdapterOff) and not list(m.ref.parameters())   # no second copy of the weights
    before = {k: v.clone() for k, v in m.actor.model.named_parameters()}
    sft, _ = load_policy(root / "sft/model")
    trainer = PPOTrainer(params.ppo, m, [PROMPT] * 8)
    for _ in range(2):
        trainer.step()
    after = dict(m.actor.model.named_parameters())
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all("lora_" in k for k in changed)
    assert any("lora_B" in k for k in changed)     # B starts at 0: the adapter is now active
    # The reference log-probs are the SFT model's, even though the adapter has moved the actor.
    ro = rollout(m.actor.model, m.tok, [PROMPT] * 4, params.ppo.sampling, torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref_lp, _ = policy_logprobs(m.ref, ro, 1.0)
        sft_lp, _ = policy_logprobs(sft, ro, 1.0)
        actor_lp, _ = policy_logprobs(m.actor.forward, ro, 1.0)
    mask = ro.response_mask
    assert torch.allclose(ref_lp[mask], sft_lp[mask], atol=1e-6)
    assert not torch.allclose(actor_lp[mask], sft_lp[mask], atol=1e-3)
    # The merged export is a plain model equal to the actor with its adapter on.
    merged = lora.export(m.actor.model, None)
    assert not lora.is_peft(merged)
    with torch.no_grad():
        merged_lp, _ = policy_logprobs(merged, ro, 1.0)
    assert torch.allclose(merged_lp[mask], actor_lp[mask], atol=1e-5)


def test_lora_sft_and_ppo_stage_outputs(root):
    p = params_file(root, "lora", {"sft": {"lora": {"r": 4}}, "ppo": {"lora": {"r": 4}, "iterations": 2}})
    stage("sft", p, root, "sft_lora")
    assert (root / "sft_lora/adapter/adapter_config.json").is_file()
    metrics = json.loads((root / "sft_lora/metrics.json").read_text())
    assert 0 < metrics["train"]["trainable_params"] < metrics["train"]["total_params"] / 2
    model = AutoModelForCausalLM.from_pretrained(str(root / "sft_lora/model"))   # merged: plain keys only
    assert not any("lora" in k for k in model.state_dict())
    stage("ppo", p, root, "ppo_lora")
    assert (root / "ppo_lora/adapter/adapter_model.safetensors").is_file()
    assert not any("lora" in k for k in AutoModelForCausalLM.from_pretrained(str(root / "ppo_lora/model")).state_dict())


def test_shared_backbone_critic_is_a_head_on_the_actor(root):
    params = Params(ppo=PPOConfig(**TINY_PPO, shared_backbone=True))
    m = place_models(params, root / "sft/model", root / "rm/model")
    assert isinstance(m.critic.model, SharedValueHead)
    assert [n for n, _ in m.critic.model.named_parameters()] == ["score.weight", "score.bias"]
    trunk = {k: v.clone() for k, v in m.actor.model.named_parameters()}
    trainer = PPOTrainer(params.ppo, m, [PROMPT] * 8)
    trainer.step()
    assert m.critic.model.score.weight.abs().sum() > 0          # the value head learned
    moved = [k for k, v in m.actor.model.named_parameters() if not torch.equal(trunk[k], v)]
    assert moved


# ---- Generated DeepSpeed configs and launch commands ---------------------------------------------

@pytest.mark.parametrize("stage_no", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("offload", ["none", "optimizer", "optimizer+param"])
def test_generated_deepspeed_config_is_valid(stage_no, precision, offload):
    raw = {"backend": "deepspeed", "zero_stage": stage_no, "precision": precision,
           "offload_optimizer": offload != "none", "offload_param": offload == "optimizer+param",
           "gradient_accumulation_steps": 2, "num_processes": 4}
    try:
        dist = from_dict(DistributedConfig, raw, "params.yaml: distributed")
    except ConfigError as err:   # the combinations ZeRO cannot do are refused by name, before any compute
        assert (stage_no == 0 and offload != "none") or (stage_no < 3 and "param" in offload)
        assert "distributed.offload_" in str(err)
        return
    cfg = deepspeed_config(dist, world_size=4, micro_batch_size=3, accumulation_steps=2, max_grad_norm=1.0,
                           lr=1e-4, weight_decay=0.0)
    validate_deepspeed_config(cfg, world_size=4)
    assert cfg["train_batch_size"] == 3 * 2 * 4
    assert cfg["zero_optimization"]["stage"] == stage_no
    assert cfg["bf16"]["enabled"] == (precision == "bf16") and cfg["fp16"]["enabled"] == (precision == "fp16")
    assert ("optimizer" in cfg) == (offload != "none")
    assert ("offload_param" in cfg["zero_optimization"]) == (offload == "optimizer+param")
    assert cfg["gradient_clipping"] == 1.0


def test_invalid_deepspeed_config_is_reported():
    dist = DistributedConfig(backend="deepspeed", zero_stage=2)
    cfg = deepspeed_config(dist, world_size=2, micro_batch_size=4, accumulation_steps=1, max_grad_norm=1.0)
    validate_deepspeed_config(cfg, world_size=2)
    with pytest.raises(ConfigError, match="generated DeepSpeed config is invalid: train_batch_size 8 != micro"):
        validate_deepspeed_config(cfg, world_size=1)   # 4 x 1 x 1 != 8
    bad = {**cfg, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "tape"}}}
    with pytest.raises(ConfigError, match="generated DeepSpeed config is invalid"):   # DeepSpeed's own check
        validate_deepspeed_config(bad, world_size=2)


def test_launch_commands():
    torchrun = launch_command(DistributedConfig(backend="deepspeed", num_processes=8, num_nodes=2, node_rank=1,
                                                master_addr="node0", master_port=29400), ["ppo", "--params", "p.yaml"])
    assert Path(torchrun[0]).name == "torchrun"
    assert torchrun[1:] == ["--nproc_per_node=8", "--nnodes=2", "--node_rank=1", "--master_addr=node0",
                            "--master_port=29400", "-m", "pipeline", "ppo", "--params", "p.yaml"]
    ds = launch_command(DistributedConfig(backend="deepspeed", launcher="deepspeed", num_processes=8, num_nodes=2,
                                          hostfile="hosts"), ["sft"])
    assert Path(ds[0]).name == "deepspeed"
    assert "--hostfile=hosts" in ds and "--num_nodes=2" in ds and "--num_gpus=8" in ds
    assert ds[-3:] == ["--module", "pipeline", "sft"]


def test_node_rank_and_master_addr_from_the_command_line():
    from pipeline.config import merge_distributed
    raw = {"distributed": {"backend": "deepspeed", "num_nodes": 2, "num_processes": 4},
           "ppo": {"micro_batch_size": 4}}
    params = from_dict(Params, merge_distributed(raw, "params.yaml: "), "params.yaml: ")
    moved = with_node(params, "ppo", 1, "node7")
    assert (moved.ppo.distributed.node_rank, moved.ppo.distributed.master_addr) == (1, "node7")
    assert moved.sft == params.sft and params.ppo.distributed.node_rank == 0
    assert "--node_rank=1" in launch_command(moved.ppo.distributed, ["ppo"])
    with pytest.raises(ConfigError, match=r"--node-rank/--master-addr: distributed.node_rank: 2 must be below num_nodes=2"):
        with_node(params, "sft", 2, None)


def _tiny_models(root: Path) -> tuple[Path, Path]:
    """An untrained tiny policy and reward model on a prepared tokenizer (conftest's), under `root`."""
    from conftest import tiny_policy_and_reward_model
    from pipeline.config import DataConfig
    from pipeline.stages.prepare import write as prepare_run
    prepare_run(DataConfig(n_sft=8, n_sft_eval=4, n_pairs=8, n_pairs_eval=4, n_ppo_prompts=8, n_eval_prompts=4),
                root / "data")
    return tiny_policy_and_reward_model(root, root / "data")


def _two_ranks(helper: str, args: list, out: Path) -> list[dict]:
    """tests/helpers/`helper` as the 2 ranks of a DeepSpeed group on this machine (gloo, one thread
    each), given `args` and `out`; what each rank wrote to `out`.rank<r>.json."""
    env = {**run_env(), "PYTHONPATH": str(REPO), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(free_port()), "OMP_NUM_THREADS": "1"}
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))
    procs = [subprocess.Popen([sys.executable, str(HELPERS / helper), *map(str, args), str(out)],
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err[-4000:]
    return [json.loads(out.with_suffix(f".rank{r}.json").read_text()) for r in range(2)]


def test_zero3_partitions_each_model_as_it_loads(tmp_path):
    """Under ZeRO-3 a model is built partitioned (zero.Init through transformers' DeepSpeed
    integration): after loading, each of 2 ranks holds about half of every model's weights and no
    rank materialises a whole weight; a fresh reward head still gets its seeded initialisation; the
    rs stage loads its SFT policy so and samples from it what the whole checkpoint samples."""
    sft, _ = _tiny_models(tmp_path)
    ranks = _two_ranks("zero3_load_ranks.py", [sft], tmp_path / "held")
    for held in ranks:
        for name in ("policy", "reward"):
            h = held[name]
            assert h["zero_params"] == h["params"] > 0, name          # every weight is a ZeRO-3 parameter
            assert h["materialised"] == 0, name                       # none is whole on this rank
            assert h["partition"] <= h["whole"] / 2 + 2 * h["params"], name   # a half, up to padding
        assert held["head_as_seeded"]
        # The rs stage's SFT policy: partitioned as it loads, in its training dtype, and sampled from
        # (gathered whole) as the same checkpoint loaded whole is.
        assert held["rs"]["zero_params"] == held["rs"]["params"] > 0 and held["rs"]["materialised"] == 0
        assert held["rs_dtype"] == "torch.float32"
        assert held["sampled"]["partitioned"] == held["sampled"]["whole"] and len(held["sampled"]["whole"]) == 2
    assert sum(r["policy"]["partition"] for r in ranks) >= ranks[0]["policy"]["whole"]
    assert ranks[0]["sampled"] == ranks[1]["sampled"]


def test_offload_frozen_builds_each_model_under_its_own_roles_config(tmp_path):
    """PPO at ZeRO-3 with `offload_frozen`, 2 processes: the actor and the critic are built (zero.Init)
    under their engines' config, whose parameters stay on the device, and only the reference and
    reward model under the frozen config that keeps their partitions on the CPU; after
    `deepspeed.initialize` the trained engines do not offload parameters and the frozen one does.
    (Built under the frozen config, the trained models' partitions were left on the CPU while
    their engines did not offload them.)"""
    for placed in _two_ranks("zero3_placement_ranks.py", list(_tiny_models(tmp_path)), tmp_path / "placed"):
        # Built in this order: actor, critic (their own models), reference, reward model.
        assert placed["built_under"] == ["none", "none", "cpu", "cpu"]
        assert placed["engine_offload"] == {"actor": [False, "None"], "critic": [False, "None"], "frozen": [True, "cpu"]}


# A process that joins a group of one, then runs `python -m pipeline`'s end. Its exit handler and a
# thread still working write files; an object alive at the end prints when the interpreter finalizes it.
END_OF_A_RANK = """
import atexit, os, runpy, sys, threading, time
from pipeline.config import DistributedConfig
from pipeline.training import distributed

class Finalized:
    def __del__(self):
        print("finalized", flush=True)

alive = Finalized()
ctx = distributed.init(DistributedConfig(backend="deepspeed", device="cpu"))
handler = sys.argv[1]
atexit.register(lambda: open(handler, "w").write(str(ctx.world_size)))
threading.Thread(target=lambda: (time.sleep(1), open(handler + ".thread", "w").write("done"))).start()
print("buffered", end="")
distributed.shutdown(ctx)
sys.argv = ["pipeline", "check", "--params", sys.argv[2]]
runpy.run_module("pipeline", run_name="__main__")
"""


@pytest.mark.parametrize("launched", [True, False], ids=["launched", "alone"])
def test_a_launched_rank_ends_without_finalizing_the_interpreter_and_keeps_its_exit_handlers(tmp_path, launched):
    """A rank that a launcher started ends, after `python -m pipeline` returns, with os._exit: gloo's
    worker threads, still alive while DeepSpeed holds its groups, can then never meet a finalizing
    interpreter (pipeline.training.distributed.end_process says why). Its threads finish, its exit
    handlers run and its output arrives; a process that joined no launched group ends as any Python
    program does."""
    params = tmp_path / "params.yaml"
    write_params(params, TINY)
    env = {k: v for k, v in run_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    if launched:   # what torchrun gives each process
        env.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run([sys.executable, "-c", END_OF_A_RANK, str(tmp_path / "handler"), str(params)], cwd=REPO,
                          env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"\nbuffered{params}: ok\n" in proc.stdout, proc.stdout    # check's report too, flushed before the exit
    assert (tmp_path / "handler").read_text() == "1" and (tmp_path / "handler.thread").read_text() == "done"
    assert ("finalized" in proc.stdout) is not launched
