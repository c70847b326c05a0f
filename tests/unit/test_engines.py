"""The engine contract (engines.py): `backward` only adds gradients, `step` updates and says what it
did, with the same meaning for the plain and the DeepSpeed engine."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap

import pytest
import torch

from conftest import REPO, run_env
from pipeline.training.engines import StepResult, TorchEngine, warmup_cosine


def tiny_engine(seed: int = 0) -> TorchEngine:
    torch.manual_seed(seed)
    return TorchEngine(torch.nn.Linear(4, 1), lr=0.1, weight_decay=0.0, schedule=warmup_cosine(1, 4), max_grad_norm=1.0)


def test_plain_engine_backward_never_updates_and_step_reports_the_lr_it_used():
    engine = tiny_engine()
    before = engine.model.weight.detach().clone()
    x = torch.ones(2, 4)
    engine.backward(engine.forward(x).sum())
    engine.backward(engine.forward(x).sum())
    assert torch.equal(engine.model.weight, before)                 # two micro-batches, no update yet
    first = engine.step()                                           # warmup step 0: lr multiplier 0
    assert isinstance(first, StepResult) and first.lr == 0.0 and not first.skipped
    assert first.grad_norm == torch.tensor([4.0] * 5).norm().item()   # (x, 1) summed over 2 x 2 rows
    assert engine.lr == 0.1                                         # the next step's rate
    engine.backward(engine.forward(x).sum())
    second = engine.step()
    assert second.lr == 0.1 and not torch.equal(engine.model.weight, before)


def test_plain_engine_skips_a_non_finite_gradient_and_says_so():
    engine = tiny_engine()
    engine.step()                                                    # past the warmup's zero rate
    before = engine.model.weight.detach().clone()
    engine.backward(engine.forward(torch.full((1, 4), float("nan"))).sum())
    result = engine.step()
    assert result.skipped and math.isnan(result.grad_norm)
    assert torch.equal(engine.model.weight, before)
    assert engine.model.weight.grad is None                          # cleared for the next batch


DEEPSPEED_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from pipeline.training import distributed
    from pipeline.config import DistributedConfig
    from pipeline.training.engines import TorchEngine, DeepSpeedEngine, warmup_cosine
    dist = DistributedConfig(backend="deepspeed", zero_stage=int(sys.argv[1]), gradient_accumulation_steps=2)
    out = {}
    with distributed.session(dist) as ctx:
        engines = {}
        for name in ("plain", "deepspeed"):
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
            kw = dict(lr=0.1, weight_decay=0.0, schedule=warmup_cosine(1, 4), max_grad_norm=1.0)
            engines[name] = (TorchEngine(model, **kw) if name == "plain" else
                             DeepSpeedEngine(model, **kw, dist=dist, ctx=ctx, micro_batch_size=2, accumulation_steps=2))
        gen = torch.Generator().manual_seed(1)
        batches = [torch.randn(4, 4, generator=gen) for _ in range(3)]
        for name, engine in engines.items():
            results = []
            for x in batches:
                for k, half in enumerate(x.split(2)):
                    engine.backward(engine.forward(half).pow(2).sum() / 4)
                    if name == "deepspeed" and not results and k == 0:
                        try:
                            engine.step()
                            out["early_step"] = "allowed"
                        except RuntimeError as err:
                            out["early_step"] = str(err)
                results.append(list(engine.step()))
            out[name] = {"results": results, "weight": engine.model.weight.detach().flatten().tolist()}
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.parametrize("zero_stage", [0, 1])
def test_deepspeed_engine_has_the_plain_engines_meaning(zero_stage):
    """Gradient accumulation over two micro-batches: the update happens in `step`, not in the last
    `backward`; lr used, gradient norm and weights equal the plain engine's; a `step` before the
    global batch is complete is refused. ZeRO-0 (the default) too: there DeepSpeed's optimizer
    reports no gradient norm, and a missing norm once stopped every run as non-finite."""
    proc = subprocess.run([sys.executable, "-c", DEEPSPEED_SCRIPT, str(zero_stage)], cwd=REPO, env=run_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert "before the last micro-batch" in out["early_step"]
    plain, ds = out["plain"], out["deepspeed"]
    assert [r[0] for r in plain["results"]] == [r[0] for r in ds["results"]] == [0.0, 0.1, 0.1 * 0.5 * (1 + math.cos(math.pi / 3))]
    for a, b in zip(plain["results"], ds["results"]):
        assert abs(a[1] - b[1]) <= 1e-6 * max(1.0, a[1]) and a[2] is b[2] is False
    assert max(abs(a - b) for a, b in zip(plain["weight"], ds["weight"])) <= 1e-6


VARIABLE_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from pipeline.training import distributed
    from pipeline.config import DistributedConfig
    from pipeline.training.engines import TorchEngine, DeepSpeedEngine, warmup_cosine
    dist = DistributedConfig(backend="deepspeed", zero_stage=int(sys.argv[1]))
    splits = [[4], [1, 1, 2], [3, 1], [2, 2]]   # micro-batch rows of each global batch of 4
    out = {}
    with distributed.session(dist) as ctx:
        for name in ("plain", "deepspeed"):
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 1)
            kw = dict(lr=0.1, weight_decay=0.0, schedule=warmup_cosine(1, 4), max_grad_norm=1.0)
            engine = (TorchEngine(model, **kw) if name == "plain" else
                      DeepSpeedEngine(model, **kw, dist=dist, ctx=ctx, micro_batch_size=4, accumulation_steps=1))
            gen = torch.Generator().manual_seed(1)
            results = []
            for split in splits:
                x = torch.randn(4, 4, generator=gen)
                for k, part in enumerate(x.split(split)):
                    engine.backward(engine.forward(part).pow(2).sum() / 4, boundary=k == len(split) - 1)
                results.append(list(engine.step()))
            out[name] = {"results": results, "weight": engine.model.weight.detach().flatten().tolist()}
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_a_varying_number_of_micro_batches_updates_as_the_plain_engine_does(zero_stage):
    """A token budget gives each global batch its own number of micro-batches: the boundary given
    to `backward` (DeepSpeed's set_gradient_accumulation_boundary) makes the last one reduce and
    the step update, with the plain engine's lr, gradient norms and weights."""
    proc = subprocess.run([sys.executable, "-c", VARIABLE_SCRIPT, str(zero_stage)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.split("RESULT", 1)[1])
    plain, ds = out["plain"], out["deepspeed"]
    assert len(plain["results"]) == len(ds["results"]) == 4
    for a, b in zip(plain["results"], ds["results"]):
        assert a[0] == b[0] and abs(a[1] - b[1]) <= 1e-6 * max(1.0, a[1]) and a[2] is b[2] is False
    assert max(abs(a - b) for a, b in zip(plain["weight"], ds["weight"])) <= 1e-6


def _tiny_lm(seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=2)
    return AutoModelForCausalLM.from_config(cfg)


def _layer_calls(model) -> list[int]:
    calls = [0]
    # The layer's first submodule, as it starts: checkpointing wraps the layer's forward (the layer's
    # own hooks run once either way), and the recompute stops once it has what the backward needs.
    model.model.layers[0].input_layernorm.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_gradient_checkpointing_recomputes_layers_and_keeps_the_gradients(mode):
    """distributed.gradient_checkpointing: each layer runs again in the backward pass (its activations
    were not kept) and the gradients equal those of a plain backward. In eval mode (PPO's update:
    dropout off) the engine's `recomputing()` is what turns it on."""
    from pipeline.config import DistributedConfig
    from pipeline.context import SINGLE
    from pipeline.training.engines import make_engine
    ids = torch.randint(0, 40, (3, 9), generator=torch.Generator().manual_seed(1))
    grads, calls = [], []
    for checkpointing in (False, True):
        model = _tiny_lm()
        engine = make_engine(model, lr=0.1, weight_decay=0.0, schedule=lambda s: 1.0, max_grad_norm=1.0,
                             dist=DistributedConfig(gradient_checkpointing=checkpointing), ctx=SINGLE,
                             micro_batch_size=3, accumulation_steps=1)
        engine.train() if mode == "train" else engine.eval()
        count = _layer_calls(engine.model)
        with engine.recomputing():
            loss = engine.forward(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        calls.append(count[0])
        grads.append([p.grad.clone() for p in engine.model.parameters()])
        assert engine.model.training == (mode == "train")   # recomputing() left the modes as they were
    assert calls == [1, 2]
    for a, b in zip(*grads):
        assert torch.allclose(a, b, atol=1e-6)


def test_bf16_without_deepspeed_is_autocast_over_fp32_weights():
    """precision: bf16 with backend none: the weights and AdamW stay fp32, the forward computes in
    bf16 (its output is bf16) and lands near the fp32 forward."""
    from pipeline.config import DistributedConfig
    from pipeline.context import SINGLE
    from pipeline.training.engines import make_engine
    ids = torch.randint(0, 40, (2, 7), generator=torch.Generator().manual_seed(2))
    engine = make_engine(_tiny_lm(), lr=0.1, weight_decay=0.0, schedule=lambda s: 1.0, max_grad_norm=1.0,
                         dist=DistributedConfig(precision="bf16"), ctx=SINGLE, micro_batch_size=2, accumulation_steps=1)
    with engine.autocast():
        logits = engine.forward(input_ids=ids).logits
    assert logits.dtype == torch.bfloat16 and next(engine.model.parameters()).dtype == torch.float32
    assert torch.allclose(logits.float(), engine.forward(input_ids=ids).logits, atol=5e-2)
    engine.backward(logits.float().logsumexp(-1).mean())
    assert engine.step().grad_norm > 0 and next(engine.model.parameters()).dtype == torch.float32


NAN_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from pipeline.training import distributed
    from pipeline.config import DistributedConfig
    from pipeline.training.engines import DeepSpeedEngine, warmup_cosine
    dist = DistributedConfig(backend="deepspeed", zero_stage=int(sys.argv[1]))
    with distributed.session(dist) as ctx:
        torch.manual_seed(0)
        engine = DeepSpeedEngine(torch.nn.Linear(4, 1), lr=0.1, weight_decay=0.0, schedule=warmup_cosine(1, 8),
                                 max_grad_norm=1.0, dist=dist, ctx=ctx, micro_batch_size=2, accumulation_steps=1)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))

        def weights():
            with engine.gathered() as model:
                return torch.cat([p.detach().flatten().clone() for p in model.parameters()])

        steps = []
        for poison in (False, False, True, False):
            before = weights()
            loss = engine.forward(x).pow(2).sum()
            engine.backward(loss * float("nan") if poison else loss)
            lr, norm, skipped = engine.step()
            steps.append({"lr": lr, "norm": norm, "skipped": skipped, "moved": not torch.equal(before, weights()),
                          "finite": bool(torch.isfinite(weights()).all())})
    print("RESULT" + json.dumps(steps))
""")


@pytest.mark.parametrize("zero_stage", [0, 2, 3])
def test_deepspeed_engine_skips_a_non_finite_gradient_at_every_zero_stage(zero_stage):
    """A NaN gradient at the third step: no update (weights unchanged), reported as skipped with a
    non-finite norm, and the schedule held (the fourth step uses the third's rate). ZeRO-0 in fp32
    once applied it: DeepSpeed hands that stage's gradients to the optimizer as they are."""
    proc = subprocess.run([sys.executable, "-c", NAN_SCRIPT, str(zero_stage)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert [s["skipped"] for s in steps] == [False, False, True, False]
    assert [s["moved"] for s in steps] == [False, True, False, True]     # step 1: warmup's rate 0
    assert not math.isfinite(steps[2]["norm"]) and all(math.isfinite(s["norm"]) for s in steps[:2] + steps[3:])
    assert steps[3]["lr"] == steps[2]["lr"] != steps[1]["lr"]
    assert all(s["finite"] for s in steps)


def test_the_zero3_export_container_keeps_the_generation_config(tmp_path):
    """ZeRO-3's whole model is rebuilt from the config (lora.fresh_copy) and saved from there: a hub
    model's generation config (its several eos ids, its sampling defaults) must come along, or the
    saved policy stops at one eos only."""
    from transformers import AutoModelForCausalLM

    from pipeline.config import LoraConfig
    from pipeline.models import lora
    from real_checkpoints import qwen25_like
    hub = qwen25_like(tmp_path / "hub")   # config.json: one eos id; generation_config.json: two
    ends = AutoModelForCausalLM.from_pretrained(str(hub)).generation_config.eos_token_id
    assert isinstance(ends, list) and len(ends) == 2
    for r in (0, 4):   # PEFT wraps the model it is given in place: a fresh one each time
        copy = lora.fresh_copy(lora.wrap(AutoModelForCausalLM.from_pretrained(str(hub)),
                                         LoraConfig(r=r, target_modules="q_proj,v_proj"), "CAUSAL_LM", "x"))
        assert lora.is_peft(copy) == (r > 0)
        assert lora.unwrap(copy).generation_config.eos_token_id == ends
        assert lora.unwrap(copy).generation_config.temperature == 0.7


def test_a_build_lock_left_by_a_killed_build_is_removed_a_fresh_one_kept(tmp_path, monkeypatch, caplog):
    """torch's build lock of an extension op (its `lock` file, which other processes wait on until it
    is deleted): one older than ten minutes was left by a killed build and is removed with a warning
    naming it (DeepSpeed's start would wait on it for ever); a fresh one is a build running, kept.
    TORCH_EXTENSIONS_DIR is where they are looked for, torch's versioned subfolder included."""
    import os
    import time

    from pipeline.training.distributed import STALE_BUILD_LOCK_S, clear_stale_build_locks
    stale, fresh, nested = (tmp_path / "deepspeed_shm_comm" / "lock", tmp_path / "cpu_adam" / "lock",
                            tmp_path / "py311_cpu" / "fused_adam" / "lock")
    for lock in (stale, fresh, nested):
        lock.parent.mkdir(parents=True)
        lock.touch()
    old = time.time() - STALE_BUILD_LOCK_S - 60
    for lock in (stale, nested):
        os.utime(lock, (old, old))
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    with caplog.at_level("WARNING", logger="pipeline.training.distributed"):
        removed = clear_stale_build_locks()
    assert sorted(removed) == sorted([stale, nested])
    assert not stale.exists() and not nested.exists() and fresh.exists()
    assert [r.getMessage().split(",")[0] for r in caplog.records] == [f"removed {p}" for p in removed]
    assert clear_stale_build_locks(tmp_path / "none") == []
