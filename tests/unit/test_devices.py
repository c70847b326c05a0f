"""Device discipline, checked without a GPU: the code paths that meet model outputs run on a device
that is not the CPU (tests/helpers/fake_device.py: CPU values, a CUDA kernel's operand rule) and give
the CPU's numbers; reductions run on the backend's device (a collective double with NCCL's rule);
a visible GPU is used without DeepSpeed; no tensor factory without a device in the code that
meets model outputs."""

from __future__ import annotations

import ast
import dataclasses
import math
import types
from pathlib import Path

import pytest
import torch

import fake_device
from conftest import HELPERS, flat, free_port, tiny_ppo_inputs
from pipeline import devices
from pipeline.config import DistributedConfig, Params, PPOConfig, SamplingConfig
from pipeline.errors import ConfigError
from pipeline.ppo.mismatch import resolve_recompute
from pipeline.ppo.placement import place_models
from pipeline.ppo.rollout import Rollout, rollout
from pipeline.ppo.scoring import score_rollout
from pipeline.ppo.trainer import PPOTrainer
from pipeline.stages.prepare import write as prepare_run
from pipeline.training import distributed
from pipeline import context
from pipeline.context import Context

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["Review the film Silent River . Focus on the music .",
           "What did you think of Lost Lantern ? Talk about the acting .",
           "Write a review of the film Bitter Road . Discuss the visuals .",
           "Review the film Silent River . Focus on the plot ."]
TINY_PPO = dict(iterations=2, rollout_batch_size=4, minibatch_size=2, micro_batch_size=1, ppo_epochs=2,
                save_every=2, n_eval_prompts=4, lr=1e-3, critic_lr=1e-3, sampling=SamplingConfig(max_new_tokens=8))


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_ppo_inputs(tmp_path_factory.mktemp("devices"))


def _params(**ppo) -> Params:
    return Params(ppo=PPOConfig(**{**TINY_PPO, **ppo}))


def _on(ro: Rollout, device: torch.device) -> Rollout:
    """The rollout with its tensors on `device` (as the sampler leaves them on a GPU)."""
    return dataclasses.replace(ro, **{f.name: getattr(ro, f.name).to(device) for f in dataclasses.fields(ro)
                                      if isinstance(getattr(ro, f.name), torch.Tensor)})


def _models_and_rollout(dirs, params: Params, device: torch.device):
    """The four models placed on `device` and one rollout sampled on the CPU (the same tokens on
    both sides), moved to `device`."""
    cpu = place_models(params, dirs / "sft", dirs / "rm")
    ro = rollout(cpu.actor.model, cpu.tok, PROMPTS, params.ppo.sampling, torch.Generator().manual_seed(0))
    if device.type == "cpu":
        return cpu, ro
    return place_models(params, dirs / "sft", dirs / "rm", Context(device=device)), _on(ro, device)


def _score(m, ro, recompute: bool):
    return score_rollout(m.actor.forward, m.ref, m.critic.model if m.critic else None, m.reward, ro, 1.0, 2,
                         missing_eos_score=-3.0, score_clip=None, recompute_logprobs=recompute, check_rows=3)


@pytest.mark.parametrize("recompute", [False, True])
def test_scoring_keeps_every_tensor_on_the_rollouts_device(dirs, recompute):
    params = _params()
    cpu, ro = _models_and_rollout(dirs, params, torch.device("cpu"))
    want = _score(cpu, ro, recompute)
    with fake_device.use_fake_gpu() as dev:
        m, ro_dev = _models_and_rollout(dirs, params, dev)
        got = _score(m, ro_dev, recompute)
        assert got.old_logprobs.device == got.scores.device == dev
    for name in ("old_logprobs", "ref_logprobs", "values", "scores", "raw_scores"):
        assert torch.allclose(fake_device.real(getattr(got, name)), getattr(want, name), atol=1e-5), name
    assert got.mismatch.keys() == want.mismatch.keys() and got.mismatch


def test_a_reward_functions_cpu_scores_join_the_rollouts_device(dirs):
    """A `module:function` reward source returns CPU scores; they meet the rollout's device tensors
    in the EOS rule and, for GRPO, in the group baseline."""
    from pipeline.tasks import reviews
    params = _params(reward_source="pipeline.tasks.reviews:gold_scores", advantage="grpo", samples_per_prompt=2,
                     kl_coef=0.0, kl_loss_coef=0.05, kl_estimator="k3", adaptive_kl=False)
    cpu, ro = _models_and_rollout(dirs, params, torch.device("cpu"))
    with fake_device.use_fake_gpu() as dev:
        m, ro_dev = _models_and_rollout(dirs, params, dev)
        got = _score(m, ro_dev, recompute=False)
        trainer = PPOTrainer(params.ppo, m, PROMPTS)
        batch, stats = trainer.make_batch(ro_dev, got)
        assert batch.advantages.device == dev
    gold = torch.tensor(reviews.gold_scores(ro.prompts, ro.responses), dtype=torch.float32)
    assert torch.equal(fake_device.real(got.raw_scores), gold)
    assert torch.equal(fake_device.real(got.scores), torch.where(ro.ended, gold, torch.tensor(-3.0)))
    assert set(stats) >= {"objective/scores", "objective/kl"}


def test_the_update_loop_runs_on_the_rollouts_device_and_matches_the_cpu(dirs):
    """PPO's minibatch loop (the shuffle, the length-sorted micro-batches, the losses, both optimizer
    steps) on the device gives the CPU's statistics."""
    params = _params()
    out = {}
    for where in ("cpu", "device"):
        with (fake_device.use_fake_gpu() if where == "device" else _cpu()) as dev:
            m, ro = _models_and_rollout(dirs, params, dev)
            trainer = PPOTrainer(params.ppo, m, PROMPTS)
            batch, _ = trainer.make_batch(ro, _score(m, ro, recompute=False))
            out[where] = trainer.update(batch)
    assert out["device"].keys() == out["cpu"].keys()
    for key, value in out["cpu"].items():
        assert out["device"][key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


class _cpu:
    def __enter__(self):
        return torch.device("cpu")

    def __exit__(self, *exc):
        return False


class NcclRule:
    """A stand-in for torch.distributed under NCCL with `world` identical ranks: a collective takes
    tensors on the accelerator only, as NCCL does (it has no CPU transport)."""
    ReduceOp = torch.distributed.ReduceOp

    def __init__(self, world: int):
        self.world, self.seen = world, []

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def all_reduce(self, tensor: torch.Tensor, op=None) -> None:
        self.seen.append(tensor.device.type)
        if tensor.device.type != fake_device.NAME:
            raise RuntimeError(f"NCCL: tensor on {tensor.device}, not on the GPU")
        if op == self.ReduceOp.SUM:
            tensor.mul_(self.world)

    def all_gather_object(self, out: list, obj) -> None:
        out[:] = [obj] * self.world


def test_reductions_run_on_the_backends_device(monkeypatch):
    """Context.sum and reduce_stats of host tensors and floats move them to the backend's device
    for the collective and hand the result back where the caller had it."""
    double = NcclRule(world=2)
    monkeypatch.setattr(context, "_dist", lambda: types.SimpleNamespace(**{k: getattr(double, k) for k in (
        "ReduceOp", "is_available", "is_initialized", "all_reduce", "all_gather_object")}))
    with fake_device.use_fake_gpu() as dev:
        ctx = Context(rank=0, world_size=2, device=dev)
        sums = ctx.sum(torch.tensor([1.5, 2.0], dtype=torch.float64, device="cpu"))
        assert sums.device.type == "cpu" and sums.tolist() == [3.0, 4.0]
        on_device = ctx.sum(torch.tensor([3.0], device=dev))
        assert on_device.device == dev and on_device.tolist() == [6.0]
        stats = ctx.reduce_stats({"a": 1.0, "b": 4.0, "c": 2.5}, sum_keys={"a"}, max_keys={"b"})
    assert stats == {"a": 2.0, "b": 4.0, "c": 2.5}
    assert double.seen and set(double.seen) == {fake_device.NAME}


# ---- pipeline/devices.py: every branch a GPU takes, taken by the fake accelerator -------------------


def test_a_device_that_is_not_the_cpu_is_an_accelerator():
    dev = fake_device.install()
    assert [devices.is_accelerator(d) for d in (dev, "fakegpu", torch.device("cuda", 1), "cpu", torch.device("cpu"))] \
        == [True, True, True, False, False]


def test_sampling_streams_are_asked_of_the_device_and_the_cpu_keeps_its_own(monkeypatch):
    """On an accelerator the stream is asked for on the device (a CUDA device gets one there). The
    fake backend, registered from Python, cannot make one (torch raises NotImplementedError): it
    gets the CPU's stream with the same seed, so its draws are the CPU run's. The CPU is asked for
    the CPU's stream, as the committed runs were."""
    dev = fake_device.install()
    with pytest.raises(NotImplementedError):
        torch.Generator(device=dev)
    plain = torch.Generator().manual_seed(11)
    asked = _spy_on_generators(monkeypatch)
    on_device, on_cpu = devices.generator(dev, 11), devices.generator(torch.device("cpu"), 11)
    assert asked == ["fakegpu:0", "cpu", "cpu"]   # the device's stream tried first, then the CPU's
    assert on_device.device.type == on_cpu.device.type == "cpu"
    assert on_device.initial_seed() == on_cpu.initial_seed() == 11
    draws = [torch.randint(1000, (6,), generator=g, device="cpu").tolist() for g in (on_device, on_cpu, plain)]
    assert draws[0] == draws[1] == draws[2]


def _spy_on_generators(monkeypatch) -> list[str]:
    """From now on, every `torch.Generator(...)` made records the device it was asked for (the list
    returned); the streams are real ones."""
    asked: list[str] = []

    class Spy(torch.Generator):
        def __new__(cls, device="cpu"):
            asked.append(str(device))
            return super().__new__(cls, device)

    monkeypatch.setattr(torch, "Generator", Spy)
    return asked


def test_the_collective_backend_follows_the_devices_type():
    """gloo between CPU processes, NCCL between CUDA GPUs, torch's pairing for another accelerator
    (XCCL for XPU), gloo for one torch pairs with none (the fake one: the tests' collective double
    checks NCCL's rule over a gloo group)."""
    dev = fake_device.install()
    assert [devices.collective_backend(d) for d in ("cpu", torch.device("cuda", 0), torch.device("xpu", 0), dev)] \
        == ["gloo", "nccl", "xccl", "gloo"]


def test_memory_counters_are_read_on_an_accelerator_only(monkeypatch):
    """The fake device's module counts 0 bytes (its tensors' memory is the CPU's); the CPU has no
    device counters (None, not 0); a CUDA device is asked through torch.cuda, about itself."""
    dev = fake_device.install()
    assert (devices.peak_memory_gib(dev), devices.allocated(dev)) == (0.0, 0)
    devices.reset_peak(dev)
    cpu = torch.device("cpu")
    assert (devices.peak_memory_gib(cpu), devices.allocated(cpu), devices.free_memory(cpu)) == (None, None, None)
    assert devices.free_memory(dev) is None   # the fake module has no mem_get_info: no number, not a made-up one
    asked = []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d: asked.append(("peak", d)) or 3 * 2 ** 30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d: asked.append(("reset", d)))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: asked.append(("now", d)) or 5)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: asked.append(("free", d)) or (7, 8))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "H100")
    gpu = torch.device("cuda", 1)
    assert (devices.peak_memory_gib(gpu), devices.allocated(gpu), devices.free_memory(gpu)) == (3.0, 5, (7, "H100"))
    devices.reset_peak(gpu)
    assert asked == [("peak", gpu), ("now", gpu), ("free", gpu), ("reset", gpu)]
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)   # nothing allocated yet: not started for it
    assert devices.peak_memory_gib(gpu) is None and len(asked) == 4


def test_an_accelerator_becomes_the_current_device_and_joins_its_backend(monkeypatch):
    """distributed.init on a device that is not the CPU makes it this process's current device
    (torch.cuda.set_device on a GPU) before joining the group, with the device's collective backend."""
    dev = fake_device.install()
    made_current, joined = [], []
    monkeypatch.setattr(torch.get_device_module(dev), "set_device", made_current.append, raising=False)
    monkeypatch.setattr(distributed, "resolve_device", lambda cfg, local_rank=0: dev)
    monkeypatch.setattr(distributed, "import_deepspeed", lambda: types.SimpleNamespace(
        init_distributed=lambda dist_backend, timeout: joined.append(dist_backend)))
    monkeypatch.setattr(distributed, "dist", types.SimpleNamespace(
        is_initialized=lambda: False, get_world_size=lambda: 1, get_rank=lambda: 0))
    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):   # init sets them for the process
        monkeypatch.setattr(distributed.c10d, name, getattr(distributed.c10d, name))
    monkeypatch.setattr(distributed, "_joined_launched_group", False)
    for key, value in {"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "1"}.items():   # one launched rank
        monkeypatch.setenv(key, value)
    ctx = distributed.init(DistributedConfig(backend="deepspeed"))
    assert ctx.device == dev and made_current == [dev] and joined == ["gloo"]
    made_current.clear()
    devices.set_current(torch.device("cpu"))
    assert made_current == []


def test_an_accelerator_gets_recomputed_logprobs_whatever_its_name():
    """auto: the sampler's log-probs are trusted only on the CPU, where their agreement was measured."""
    dev = fake_device.install()
    assert resolve_recompute("auto", "fp32", torch.float32, dev.type) == (True, "auto: a fakegpu device")
    assert resolve_recompute("auto", "fp32", torch.float32, "cuda") == (True, "auto: a cuda device")
    assert resolve_recompute("auto", "fp32", torch.float32, "cpu")[0] is False


def test_the_ppo_trainer_on_a_device_that_is_not_the_cpu_takes_the_gpu_branches(dirs, monkeypatch):
    """Placed and stepped on the fake accelerator, PPO recomputes the old log-probs (its reason names
    the device), asks for its sampling stream and a measurement's per-row streams on the device
    (devices.generator: the fake one falls back to the CPU's), meters each placed model's memory
    and reports the iteration's peak (0 bytes on the fake device); on the CPU it keeps the
    sampler's log-probs and has no memory figures."""
    from pipeline.models.rollout_engine import TORCH, Request
    params = _params(iterations=1)
    cpu = place_models(params, dirs / "sft", dirs / "rm")
    on_cpu = PPOTrainer(params.ppo, cpu, PROMPTS)
    cpu_stats = on_cpu.step()
    assert (on_cpu.recompute, cpu.memory) == (False, None) and "memory/peak_gib" not in cpu_stats
    with fake_device.use_fake_gpu() as dev:
        m = place_models(params, dirs / "sft", dirs / "rm", Context(device=dev))
        asked = _spy_on_generators(monkeypatch)
        trainer = PPOTrainer(params.ppo, m, PROMPTS)
        assert asked.count("fakegpu:0") == 1
        assert trainer.sample_gen.initial_seed() == on_cpu.sample_gen.initial_seed() == params.ppo.seed + 1
        TORCH.generate(m.actor.model, Request([m.tok(PROMPTS[0])["input_ids"]], m.tok.pad_token_id,
                                              (m.tok.eos_token_id,), params.ppo.sampling, seeds=[5, 6]))
        assert asked.count("fakegpu:0") == 3   # one per seeded row
        stats = trainer.step()
    assert (trainer.recompute, trainer.recompute_reason) == (True, "auto: a fakegpu device")
    assert m.memory == {"actor": 0.0, "critic": 0.0, "reference": 0.0, "reward": 0.0}
    assert stats["memory/peak_gib"] == 0.0
    assert stats["objective/scores"] == pytest.approx(cpu_stats["objective/scores"], rel=1e-5)   # the same draws


def test_a_stage_on_a_device_that_is_not_the_cpu_reports_its_devices_and_their_memory():
    """The skeleton's resources: the process count of GPUs (0 on the CPU) and, where the device
    counts its memory, its peak."""
    import time
    from pipeline.measurement.balance import Tally
    from pipeline.stages.skeleton import StageRun
    dev = fake_device.install()
    on = {where: StageRun.resources(types.SimpleNamespace(ctx=Context(world_size=2, device=d),
                                                          started=time.perf_counter(), cpu_matmuls=None,
                                                          measured=Tally()))
          for where, d in (("device", dev), ("cpu", torch.device("cpu")))}
    assert on["device"]["resources/gpus"] == 2 and on["device"]["resources/peak_device_gib"] == 0.0
    assert on["cpu"]["resources/gpus"] == 0 and "resources/peak_device_gib" not in on["cpu"]


def test_backend_none_uses_the_gpu_torch_sees(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert distributed.init(DistributedConfig()).device == torch.device("cuda", 0)
    assert distributed.init(DistributedConfig(device="cpu")).device == torch.device("cpu")
    assert DistributedConfig(precision="bf16").precision == "bf16"   # autocast, no DeepSpeed needed
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.init(DistributedConfig()).device == torch.device("cpu")
    with pytest.raises(ConfigError, match="distributed.device: cuda, but torch sees no GPU"):
        distributed.init(DistributedConfig(device="cuda"))
    with pytest.raises(ConfigError, match="distributed.precision: fp16 needs backend: deepspeed"):
        DistributedConfig(precision="fp16")


def test_auto_says_so_when_the_machine_has_a_gpu_torch_cannot_use(monkeypatch, tmp_path, caplog):
    """A CPU build of torch on a GPU machine runs on the CPU, with one warning saying why."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert distributed.unusable_gpu(tmp_path) is None                       # no GPU: nothing to say
    (tmp_path / "nvidia0").touch()
    (tmp_path / "nvidiactl").touch()
    monkeypatch.setattr(torch.version, "cuda", None)
    assert distributed.unusable_gpu(tmp_path) == f"this machine has a GPU (/dev/nvidia0) but torch {torch.__version__} is a CPU build"
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    assert "(CUDA 13.0) cannot use it" in distributed.unusable_gpu(tmp_path)
    monkeypatch.setattr(distributed, "unusable_gpu", lambda: "a reason")
    with caplog.at_level("WARNING", logger="pipeline.training.distributed"):
        assert distributed.resolve_device(DistributedConfig()) == torch.device("cpu")
        assert distributed.resolve_device(DistributedConfig(device="cpu")) == torch.device("cpu")
    assert [r.getMessage() for r in caplog.records] == ["distributed.device: auto runs on the CPU: a reason"]


def test_the_collective_timeout_reaches_the_groups_deepspeed_makes():
    """`timeout_minutes` is the world group's and every later group's, DeepSpeed's copy of the world
    group (ZeRO's collectives) included: torch gives a group made without one its backend's default
    (10 minutes under NCCL, 30 under gloo)."""
    import subprocess
    import sys
    from conftest import REPO, run_env
    script = ("import torch\n"
              "from pipeline.config import DistributedConfig\n"
              "from pipeline.training import distributed\n"
              "with distributed.session(DistributedConfig(backend='deepspeed', timeout_minutes=7)):\n"
              "    from deepspeed.utils import groups\n"
              "    print('RESULT', groups._clone_world_group()._get_backend(torch.device('cpu')).options._timeout)\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=run_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split("RESULT", 1)[1].strip() == "0:07:00"


def test_offload_frozen_below_zero_3_is_refused_with_its_key():
    with pytest.raises(ConfigError, match="distributed.offload_frozen: needs zero_stage 3"):
        DistributedConfig(backend="deepspeed", zero_stage=2, offload_frozen=True)
    assert DistributedConfig(backend="deepspeed", zero_stage=3, offload_frozen=True).offload_frozen


FACTORIES = {"tensor", "zeros", "ones", "full", "empty", "arange", "randperm", "rand", "randn", "randint",
             "linspace", "eye"}


def test_no_tensor_factory_without_a_device_where_model_outputs_are_met():
    """Everywhere in pipeline/ every `torch.<factory>(...)` names its device: on a GPU a device-less
    factory makes a CPU tensor that the first operation with a model output refuses (host-side
    bookkeeping, a batch built before it is moved, says device="cpu")."""
    bad = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "torch"
                    and node.func.attr in FACTORIES and not any(k.arg == "device" for k in node.keywords)):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: torch.{node.func.attr}")
    assert bad == []


def test_no_inference_mode_in_the_pipeline():
    """Forwards without a graph use `torch.no_grad`: under ZeRO-3 a forward gathers parameters into
    buffers that later training forwards reuse, and a tensor made under `torch.inference_mode` there
    fails the next backward ("Inference tensors cannot be saved for backward"; DPO's reference
    pass did, on two processes)."""
    bad = [f"{p.relative_to(REPO)}:{n}" for p in sorted((REPO / "pipeline").rglob("*.py"))
           for n, line in enumerate(p.read_text().splitlines(), 1) if "inference_mode(" in line]
    assert bad == []


def test_the_static_check_sees_a_device_less_factory(tmp_path):
    """The check above can fail: the pattern it refuses is found in a sample."""
    tree = ast.parse("import torch\nrows = torch.arange(4)\nok = torch.arange(4, device=x.device)\n")
    found = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "attr", None) in FACTORIES
             and not any(k.arg == "device" for k in n.keywords)]
    assert [n.lineno for n in found] == [2]


# Sizes at which every collective path of the stages runs at 2 processes: global batches of 4 (2 per
# rank), and 17 held-out rows, so an evaluation pass in spans of 2 x 8 rows ends on a span of one
# row, one rank scoring it while the other runs its dummy forward (DPO's, KTO's and the
# demonstrations' loss of rs, whose evaluation batch is twice the training batch).
COLLECTIVE_DATA = dict(n_sft=8, n_sft_eval=17, n_pairs=8, n_pairs_eval=17, n_ppo_prompts=8, n_eval_prompts=4)
SUPERVISED = {"batch_size": 4, "epochs": 1.0, "eval_every": 2, "save_every": 2}
COLLECTIVE_PARAMS = {
    "model": {"hidden_size": 32, "num_layers": 1, "num_heads": 2, "intermediate_size": 64},
    "prompts": {"sampling": {"max_new_tokens": 4}},
    "reward": {**SUPERVISED, "n_sft_samples": 3},
    "dpo": {**SUPERVISED, "n_eval_prompts": 3},
    # Micro-batches by tokens: the ranks cut their shares into different numbers of micro-batches,
    # the one with fewer adding zero-weighted repeats.
    "kto": {**SUPERVISED, "n_eval_prompts": 3, "distributed": {"max_tokens_per_micro_batch": 24}},
    "rs": {**SUPERVISED, "n": 2, "n_prompts": 8, "n_eval_prompts": 3, "sampling": {"max_new_tokens": 4}},
    # One minibatch per epoch: the global minibatch is the whole rollout whatever the rank count
    # (each rank shuffles only its own rows).
    "ppo": {"iterations": 1, "rollout_batch_size": 4, "minibatch_size": 4, "micro_batch_size": 1, "ppo_epochs": 2,
            "save_every": 1, "n_eval_prompts": 3, "whiten_rewards": True, "sampling": {"max_new_tokens": 4}},
}


@pytest.fixture(scope="module")
def groups(tmp_path_factory) -> tuple[Path, dict, dict]:
    """tests/helpers/measure_ranks.py run by 1 process and by the 2 ranks of a gloo group, both at
    once (the single process mostly fills the pair's waits on each other): (their folder, what the
    one process wrote, what the pair's rank 0 wrote)."""
    import json
    import os
    import subprocess
    import sys

    from conftest import tiny_policy_and_reward_model
    from pipeline.config import DataConfig
    root = tmp_path_factory.mktemp("ranks")
    prepare_run(DataConfig(**COLLECTIVE_DATA), root / "inputs" / "data")
    tiny_policy_and_reward_model(root / "inputs", root / "inputs" / "data")
    (root / "params.json").write_text(json.dumps(COLLECTIVE_PARAMS))
    procs = []
    for world in (1, 2):
        (root / str(world)).mkdir()
        env = {**os.environ, "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "OMP_NUM_THREADS": "1"}
        procs += [(f"rank {r} of {world}", subprocess.Popen(
            [sys.executable, str(HELPERS / "measure_ranks.py"), str(root / str(world)), str(root / "inputs"),
             str(root / "params.json")], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)) for r in range(world)]
    # Every failed rank's last words: where one rank fails, its peer's error is only the broken link.
    failed = [f"{name}: {err[-2000:]}" for name, p in procs for _, err in [p.communicate(timeout=600)] if p.returncode]
    assert not failed, "\n\n".join(failed)
    one, two = (json.loads((root / str(world) / "result.json").read_text()) for world in (1, 2))
    return root, one, two


def test_two_processes_measure_what_one_measures(groups):
    """measure_policies and the reward model's final evaluation in 2 gloo processes (the prompts and
    pairs shared out, every collective refusing host tensors as NCCL does, the models on a non-CPU
    device where no CPU matrix product is allowed) equal 1 process, value for value and in order."""
    _, one, two = groups
    assert two["per"] == one["per"]
    # The same scores in the same order; a pair's batch-mates (and so its padding) differ, hence float tolerance.
    assert len(one["pairs"][0]) == len(two["pairs"][1]) == 151 and one["pairs"][0] != one["pairs"][1]
    assert two["pairs"][0] == pytest.approx(one["pairs"][0], rel=1e-5, abs=1e-6)
    assert two["pairs"][1] == pytest.approx(one["pairs"][1], rel=1e-5, abs=1e-6)
    assert (one["imbalance"], two["imbalance"]) == (0, 1)   # spans of 64 pairs: 32 + 32, 32 + 32, then 12 + 11
    assert (one["ranks"], two["ranks"]) == (1.0, 2.0)   # the group really had two ranks
    assert two["collectives"] >= 2
    texts, ended, values = one["per"]["a"]
    assert len(texts) == len(values["kl"]) == len(values["rm"]) == len(values["gold"]) == 70
    assert values["kl"][0] != 0.0 and one["per"]["b"][2]["kl"] == [0.0] * 70   # b is the reference itself


# What is not the same value at 2 processes by design: timings and the process's resources (the
# process count of devices among them); PPO's per-rank statistic that its step averages over ranks
# (a rollout's distinct bigrams); the most minus
# the fewest held-out pairs a rank scored. Each as the step logs and as metrics.json spell it
# ("time/update", "train/time_update").
# train/pad_share: each process pads its own share's micro-batches, so the padding follows the layout
PER_RANK = ("resources/", "train/seconds", "time/", "time_", "tokens_per_second", "objective/distinct_2",
            "objective_distinct_2", "eval/pairs_imbalance", "train/pad_share")


def _stage_outputs(folder: Path) -> dict:
    """metrics.json and the step logs of a stage's folder, and its model's weights (float64)."""
    import csv
    import json

    from safetensors.torch import load_file
    out = {f"metrics/{k}": v for k, v in flat(json.loads((folder / "metrics.json").read_text())).items()}
    for log in ("train", "eval"):
        if (folder / f"{log}.tsv").exists():
            for i, row in enumerate(csv.DictReader((folder / f"{log}.tsv").open(), delimiter="\t")):
                out.update({f"{log}/{i}/{k}": float(v) for k, v in row.items()})
    out.update({f"weights/{k}": v.double() for k, v in load_file(folder / "model" / "model.safetensors").items()})
    return out


def test_every_collective_of_the_stages_reduces_over_two_processes_as_one_process(groups):
    """The stop decision, the PPO trainer's whitening, and the stages reward, dpo, kto, rs and ppo,
    whole (tests/helpers/stage_collectives.py), in 2 gloo processes on the fake accelerator with
    every collective refusing host tensors as NCCL does: the sharded training steps' sums, the
    held-out losses (uneven shares and an empty one), PPO's token counts and step statistics, and
    the barriers of the resumable state and of the stages run, and every metric, step-log value and
    trained weight equals the single process's, but those that are per rank by design (PER_RANK)."""
    root, one, two = groups
    one, two = one["stages"], two["stages"]
    # The last rank alone was asked to stop: every rank stops, with its signal; then none does.
    assert one["stop"] == [15, 0] and two["stop"] == [15, 0, 15, 0]
    # Whitened over the global batch: each rank's rows as one process whitens all six (float64 sums).
    assert len(two["whitened"]) == 6
    assert torch.tensor(two["whitened"]).allclose(torch.tensor(one["whitened"]), rtol=0, atol=1e-12)
    assert two["collectives"] > 0
    # PPO's rollout: the same rows at both counts, and the ranks' shares of its tokens unequal, so a
    # rank's own token count times the rank count is not the global batch's.
    (rows,), ((first,), (second,)) = one["rollout_lengths"][0], two["rollout_lengths"]
    assert first + second == rows and len(rows) == 4 and sum(first) != sum(second)
    for stage in ("reward", "dpo", "kto", "rs", "ppo"):
        want, got = (_stage_outputs(root / str(world) / stage) for world in (1, 2))
        assert got.keys() == want.keys() and any(k.startswith(("eval/", "train/")) for k in want), stage
        for key, value in want.items():
            if any(part in key for part in PER_RANK):
                continue
            # The sums add in another order, and a row's batch-mates (its padding) differ: float32
            # log-prob sums keep about 1e-5 of absolute error (DPO's margins are their differences).
            if isinstance(value, torch.Tensor):
                assert torch.allclose(got[key], value, rtol=1e-4, atol=1e-5), (stage, key)
            else:
                assert got[key] == pytest.approx(value, rel=1e-4, abs=5e-5, nan_ok=True), (stage, key)
    # Each stage measures 3 held-out prompts (and the reward model its pairs, in equal forwards per
    # rank): one batch, which rank 0 samples while rank 1 waits, as metrics.json states.
    for stage in ("reward", "dpo", "kto", "rs", "ppo"):
        spread = [_stage_outputs(root / str(world) / stage)["metrics/resources/measure_imbalance"] for world in (1, 2)]
        assert spread == [0, 1], stage


def gpu_only(stage: str) -> set[str]:
    """The metrics.json names a stage writes on a GPU only: its peak device memory and, for the RL
    stages, the last iteration's (pipeline/devices.py counts it where the device's module does)."""
    return {"resources/peak_device_gib"} | ({"train/memory_peak_gib"} if stage in ("ppo", "grpo") else set())


def on_cpu_then_fake_gpu(stages, root: Path, monkeypatch) -> None:
    """`stages(root / "cpu")`, then `stages(root / "dev")` with every model on the fake accelerator:
    the device `distributed.resolve_device` gives each stage, for the rest of the test."""
    stages(root / "cpu")
    with fake_device.use_fake_gpu() as dev:
        monkeypatch.setattr(distributed, "resolve_device", lambda cfg, local_rank=0: dev)
        stages(root / "dev")


def test_the_tiny_pipeline_on_a_device_that_is_not_the_cpu_measures_what_the_cpu_does(tmp_path, monkeypatch):
    """sft, reward, ppo and evaluate in this process with every model on the fake accelerator (the
    device `distributed.device` resolves to): no device mix anywhere on their paths, config.json
    records the device, metrics.json the GPU's resources (one process on one device, its peak memory:
    0 bytes on the fake device), and every metric but the timings equals the CPU run's."""
    import json
    import shutil

    from conftest import TINY
    from pipeline.config import from_dict
    from pipeline.stages import evaluate, ppo, reward, sft
    params = from_dict(Params, TINY, "tiny: ")
    prepare_run(params.data, tmp_path / "cpu" / "data")
    shutil.copytree(tmp_path / "cpu" / "data", tmp_path / "dev" / "data")

    def pipeline(root: Path) -> None:
        sft.run(params, root / "data", root / "sft", progress=False)
        reward.run(params, root / "data", root / "sft/model", root / "reward", progress=False)
        ppo.run(params, root / "data", root / "sft/model", root / "reward/model", root / "ppo", progress=False)
        evaluate.run(params, root / "data", root / "sft/model", root / "reward/model", root / "ppo/model",
                     root / "evaluate")

    on_cpu_then_fake_gpu(pipeline, tmp_path, monkeypatch)
    timings = ("resources/", "train/seconds", "train/time_", "train/tokens_per_second")
    for stage in ("sft", "reward", "ppo", "evaluate"):
        runtime = json.loads((tmp_path / "dev" / stage / "config.json").read_text())["runtime"]
        assert {k: runtime[k] for k in ("device", "processes", "threads")} == \
            {"device": fake_device.NAME, "processes": 1, "threads": torch.get_num_threads()}
        assert runtime.get("dtypes") == (None if stage == "evaluate" else
                                         {"weights": "float32", "optimizer_states": "float32", "compute": "float32"})
        want, got = (flat(json.loads((tmp_path / w / stage / "metrics.json").read_text())) for w in ("cpu", "dev"))
        assert got.keys() == want.keys() | gpu_only(stage)
        assert {k: got[k] for k in gpu_only(stage)} == dict.fromkeys(gpu_only(stage), 0.0)
        assert (got["resources/gpus"], want["resources/gpus"]) == (1, 0)
        for key, value in want.items():
            if key.startswith(timings):
                continue
            if value is None:                          # a gap not measured (beyond best-of-n's range)
                assert got[key] is None, (stage, key)
            elif key.startswith("frontier/"):
                # The best-of-n curve is refitted on each resample through the policies' mean KLs,
                # whose float differences (~1e-6) move a percentile bound by about 1e-5.
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-4, nan_ok=True), (stage, key)
            else:
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), (stage, key)


# Every method stage and the options that take their own code paths, on tiny inputs: DPO with LoRA
# (its reference is the adapter switched off), KTO, rejection sampling, GRPO sampling in sub-batches
# that drop their ended rows, PPO with one trunk for actor and critic, LoRA and a reward function,
# and compare over the policies they trained.
METHODS = {
    "dpo": {"batch_size": 16, "epochs": 1.0, "eval_every": 2, "save_every": 2, "n_eval_prompts": 8, "lora": {"r": 4}},
    "kto": {"batch_size": 16, "epochs": 1.0, "eval_every": 2, "save_every": 2, "n_eval_prompts": 8},
    "grpo": {"rollout_micro_batch_size": 4, "rollout_drop_finished": True},
    "ppo": {"shared_backbone": True, "lora": {"r": 4}, "reward_source": "pipeline.tasks.reviews:gold_scores"},
}


def test_every_method_and_option_on_a_device_that_is_not_the_cpu_measures_what_the_cpu_does(tmp_path, monkeypatch):
    """dpo, kto, rs, grpo, ppo (the options above) and compare in this process with every model on
    the fake accelerator, where a device mix or a model-sized CPU matrix product fails: every metric
    but the timings equals the CPU run's."""
    import json
    import shutil

    from conftest import TINY, merge, run_stage, tiny_policy_and_reward_model
    from pipeline.config import from_dict
    params = from_dict(Params, merge(TINY, METHODS), "tiny: ")
    prepare_run(params.data, tmp_path / "cpu" / "data")
    tiny_policy_and_reward_model(tmp_path / "cpu", tmp_path / "cpu" / "data")
    shutil.copytree(tmp_path / "cpu", tmp_path / "dev")

    trained = ("dpo", "kto", "rs", "grpo", "ppo")

    def methods(root: Path) -> None:
        folders = {"data": root / "data", "sft": root / "sft", "reward": root / "rm"}
        for stage in trained:
            run_stage(stage, params, folders, root / stage)
        run_stage("compare", params, folders, root / "compare",
                  policy=[f"{m}={root / m / 'model'}" for m in trained])

    on_cpu_then_fake_gpu(methods, tmp_path, monkeypatch)
    timings = ("resources/", "train/seconds", "train/time_", "train/tokens_per_second", "compare/seconds")
    for stage in ("dpo", "kto", "rs", "grpo", "ppo", "compare"):
        assert json.loads((tmp_path / "dev" / stage / "config.json").read_text())["runtime"]["device"] == fake_device.NAME
        want, got = (flat(json.loads((tmp_path / w / stage / "metrics.json").read_text())) for w in ("cpu", "dev"))
        assert got.keys() == want.keys() | gpu_only(stage)
        for key, value in want.items():
            # The fake device runs other CPU kernels (no fused attention): log-prob differences
            # of nearly equal numbers (DPO's implicit rewards) keep about 1e-5 of absolute error.
            # GRPO divides by the spread of one prompt's rewards, which the untrained reward model
            # makes tiny: those errors grow into another training path (a 0.2% different gradient
            # norm at the first update), so its policy's numbers (and compare's row of it) are only
            # required to be there and finite; its code ran on the device all the same.
            if key.startswith(timings) or "/seconds" in key or "stage_" in key:
                continue
            if stage == "grpo" or key.startswith(("grpo/", "frontier/grpo_")):
                assert got[key] is None or math.isfinite(got[key]), (stage, key)
            elif value is None:                        # a gap not measured (beyond best-of-n's range)
                assert got[key] is None, (stage, key)
            elif key.startswith("frontier/"):          # refitted curves: see the test above
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-4, nan_ok=True), (stage, key)
            else:
                assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-5, nan_ok=True), (stage, key)
