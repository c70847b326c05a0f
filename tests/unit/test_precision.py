"""The loading rule (pipeline/training/loading.py) on a checkpoint saved as the hub saves them (bf16
weights, a BPE tokenizer with a chat template, several eos ids, no pad token): a trained model's
weights and optimizer states are fp32 whatever the checkpoint's dtype, so a bf16 checkpoint and its
exact fp32 upcast train to the same bits at a hub learning rate, and the reference computes as the
actor does before the first update."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import HELPERS, REPO, run_env

# One process: the DeepSpeed engines share one group of one (DeepSpeed keeps its groups for the
# process's life, so a second session in the same process would find them stale).
SCRIPT = textwrap.dedent("""
    import json, sys
    from pathlib import Path
    import torch
    sys.path.insert(0, sys.argv[2])
    from real_checkpoints import qwen25_like
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from pipeline.config import DistributedConfig, ModelConfig
    from pipeline.models.checkpoints import from_checkpoint, init_policy
    from pipeline.models.logprobs import logprobs_from_logits
    from pipeline.context import SINGLE
    from pipeline.training import distributed, loading
    from pipeline.training.engines import FrozenModel, make_engine

    root = Path(sys.argv[1])
    saved = {"bf16": qwen25_like(root / "bf16", torch.bfloat16)}
    upcast = AutoModelForCausalLM.from_pretrained(str(saved["bf16"]), dtype=torch.float32)   # exact
    upcast.save_pretrained(str(root / "fp32"))
    AutoTokenizer.from_pretrained(str(saved["bf16"])).save_pretrained(str(root / "fp32"))
    saved["fp32"] = root / "fp32"
    BACKENDS = {"none-fp32": {}, "none-bf16": {"precision": "bf16"}, "zero0-fp32": {"backend": "deepspeed"},
                "zero0-bf16": {"backend": "deepspeed", "precision": "bf16"}}
    out = {"saved": {k: json.loads((p / "config.json").read_text())["dtype"] for k, p in saved.items()}}
    with distributed.session(DistributedConfig(backend="deepspeed")) as group:
        for name, kw in BACKENDS.items():
            dist = DistributedConfig(**kw)
            ctx = group if dist.backend == "deepspeed" else SINGLE
            runs = {}
            for which, folder in saved.items():
                model, tok = init_policy(ModelConfig(name_or_path=str(folder)), root, 0, loading.load_dtype(dist, True))
                start = {k: v.detach().float().clone() for k, v in model.state_dict().items()}
                engine = make_engine(model, lr=1e-5, weight_decay=0.0, schedule=lambda s: 1.0, max_grad_norm=1.0,
                                     dist=dist, ctx=ctx, micro_batch_size=4, accumulation_steps=1)
                # The reference as PPO places it, before any update: its log-probs against the actor's.
                ref = FrozenModel(from_checkpoint(AutoModelForCausalLM, folder, strict=False, dtype=loading.load_dtype(dist, False)),
                                  dist, ctx, 4).model
                g = torch.Generator().manual_seed(0)
                ids = torch.randint(0, len(tok), (4, 24), generator=g)
                with torch.no_grad(), engine.autocast():
                    actor_lp, ref_lp = (logprobs_from_logits(m(input_ids=ids).logits[:, :-1].float(), ids[:, 1:])
                                        for m in (engine.forward, ref))
                first = (actor_lp - ref_lp).abs().max()
                losses = []
                for step in range(10):
                    with engine.autocast():
                        loss = engine.forward(input_ids=ids, labels=ids).loss
                    engine.backward(loss)
                    engine.step()
                    losses.append(loss.item())
                    ids = torch.randint(0, len(tok), (4, 24), generator=g)
                end = {k: v.detach().float() for k, v in engine.full_model().state_dict().items()}
                # What the optimizer steps: plain AdamW's own parameters, or DeepSpeed's fp32 master copy.
                opt = getattr(engine._optimizer, "optimizer", engine._optimizer)
                states = {str(v.dtype) for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim()}
                stepped = {str(p.dtype) for group in opt.param_groups for p in group["params"]}
                runs[which] = {"losses": losses, "end": end, "first_logprob_gap": float(first),
                               "changed": sum(int((end[k] != start[k]).sum()) for k in end) / sum(v.numel() for v in end.values()),
                               "states": sorted(states), "stepped": sorted(stepped)}
            a, b = runs["bf16"], runs["fp32"]
            out[name] = {"same_losses": a["losses"] == b["losses"],
                         "same_weights": all(torch.equal(a["end"][k], b["end"][k]) for k in a["end"]),
                         "changed": a["changed"], "states": a["states"], "stepped": a["stepped"],
                         "first_logprob_gap": max(a["first_logprob_gap"], b["first_logprob_gap"]),
                         "recorded": loading.dtypes(dist)}
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("precision")
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(root), str(HELPERS)], cwd=REPO, env=run_env(),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.split("RESULT", 1)[1])


BACKENDS = ["none-fp32", "none-bf16", "zero0-fp32", "zero0-bf16"]


def test_the_checkpoint_is_saved_as_the_hubs_are(trained):
    assert trained["saved"] == {"bf16": "bfloat16", "fp32": "float32"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_bf16_checkpoint_and_its_fp32_upcast_train_to_the_same_bits(trained, backend):
    """10 AdamW steps at lr 1e-5: loss for loss and weight for weight the same run. Loaded as bf16
    weights (the checkpoint's own dtype, what `from_pretrained` gives by default), AdamW's updates
    fall below half a bf16 step and about 85% of the weights never move."""
    run = trained[backend]
    assert run["same_losses"] and run["same_weights"]
    if backend != "zero0-bf16":   # there the module holds DeepSpeed's bf16 copy of the fp32 master
        assert run["changed"] > 0.99


@pytest.mark.parametrize("backend", BACKENDS)
def test_what_the_optimizer_steps_is_fp32_and_config_json_says_so(trained, backend):
    run = trained[backend]
    assert run["stepped"] == run["states"] == ["torch.float32"]
    assert run["recorded"] == {"weights": "float32", "optimizer_states": "float32",
                               "compute": "bfloat16" if backend.endswith("bf16") else "float32"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_reference_computes_as_the_actor_before_the_first_update(trained, backend):
    """KL(actor || reference) and the ratio are exactly 0 and 1 at iteration 0: with plain PyTorch's
    bf16 autocast over an fp32 actor, a bf16 reference was 2e-3 nats per token away."""
    assert trained[backend]["first_logprob_gap"] <= 1e-6


# Where each loader takes its dtype: positional index (0-based) or keyword; `init_reward_model`
# takes it inside its `load_kwargs` (models.checkpoints.load_kwargs, or {"dtype": ...}).
LOADERS = {"init_policy": (3, "dtype"), "load_policy": (2, "dtype"), "load_reward_model": (2, "dtype"),
           "init_reward_model": (4, "load_kwargs"), "from_checkpoint": (None, "dtype")}


def test_every_load_site_in_the_pipeline_names_its_dtype():
    """No model is loaded "as saved": every call of a loader in pipeline/ states the dtype (the
    loading rule's, or the dtype of the model it sits beside), so a bf16 checkpoint never becomes
    bf16 weights that an fp32 optimizer steps. The one exception is MLflow's serving wrapper, which
    loads a finished model for inference outside any stage."""
    import ast

    bad = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        if path.name == "mlflow_models.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = getattr(node.func, "attr", getattr(node.func, "id", None))
            if name not in LOADERS:
                continue
            index, keyword = LOADERS[name]
            named = any(k.arg in (keyword, None) for k in node.keywords)   # None: **kwargs
            if not named and (index is None or len(node.args) <= index):
                bad.append(f"{path.relative_to(REPO)}:{node.lineno}: {name}")
    assert bad == []


# What each stage loads with `from_pretrained` on the inputs below: (kind, input folder, role).
# Kind: "policy" (a causal LM) or "scalar" (a reward model or critic); role: "trained" when the
# model (or a LoRA wrapper around it) is what a training engine steps, "frozen" otherwise (a
# reference, a reward, a policy measured). The sft stage loads `model.name_or_path`, set to the
# SFT checkpoint; evaluate's PPO policy and compare's method are the folder "tuned".
LOADS = {
    "sft": {("policy", "sft", "trained")},
    "reward": {("scalar", "sft", "trained"), ("policy", "sft", "frozen")},
    "ppo": {("policy", "sft", "trained"), ("scalar", "rm", "trained"), ("policy", "sft", "frozen"),
            ("scalar", "rm", "frozen")},
    "evaluate": {("policy", "sft", "frozen"), ("scalar", "rm", "frozen"), ("policy", "tuned", "frozen")},
    "dpo": {("policy", "sft", "trained"), ("policy", "sft", "frozen")},
    "kto": {("policy", "sft", "trained"), ("policy", "sft", "frozen")},
    "grpo": {("policy", "sft", "trained"), ("policy", "sft", "frozen"), ("scalar", "rm", "frozen")},
    "rs": {("policy", "sft", "trained"), ("scalar", "rm", "frozen"), ("policy", "sft", "frozen")},
    "compare": {("policy", "sft", "frozen"), ("scalar", "rm", "frozen"), ("policy", "tuned", "frozen")},
}


def test_every_stage_loads_its_trained_models_in_fp32_and_its_frozen_ones_as_the_rule_says(tmp_path, monkeypatch):
    """Every stage that loads a model, run on checkpoints saved in bf16 (as the hub saves them) with
    `precision: bf16` under `backend: none`, with `from_pretrained` (where every load of
    transformers ends) and the training engines spied: each load is the one LOADS lists for its
    stage, asks for fp32 and holds fp32 parameters, trained and frozen alike (loading.load_dtype:
    without DeepSpeed the 16-bit precision is autocast over fp32 weights)."""
    import shutil
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedModel

    from conftest import TINY, merge, tiny_policy_and_reward_model
    from pipeline.config import DataConfig, Params, from_dict
    from pipeline.stages import registry
    from pipeline.stages.prepare import write as prepare_run
    from pipeline.training import engines

    data = tmp_path / "data"
    prepare_run(DataConfig(n_sft=8, n_sft_eval=4, n_pairs=8, n_pairs_eval=4, n_ppo_prompts=8, n_eval_prompts=4), data)
    sft, rm = tiny_policy_and_reward_model(tmp_path, data)
    for folder, auto in ((sft, AutoModelForCausalLM), (rm, AutoModelForSequenceClassification)):
        auto.from_pretrained(folder).to(torch.bfloat16).save_pretrained(folder)
    shutil.copytree(sft, tmp_path / "tuned")   # a trained policy for evaluate and compare
    for folder in (sft, rm, tmp_path / "tuned"):
        assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"

    loads, trained = [], []
    load = PreTrainedModel.from_pretrained.__func__
    start_engine = engines.TrainEngine.__init__

    def spy_load(cls, path, *args, **kwargs):
        out = load(cls, path, *args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out   # output_loading_info=True gives (model, info)
        loads.append((cls.__name__, Path(path).name, kwargs.get("dtype"), {p.dtype for p in model.parameters()}, model))
        return out

    def spy_engine(self, model, *args, **kwargs):
        trained.append(model)
        start_engine(self, model, *args, **kwargs)

    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(spy_load))
    monkeypatch.setattr(engines.TrainEngine, "__init__", spy_engine)
    bf16 = {stage: {"distributed": {"precision": "bf16"}} for stage in registry.distributed()}
    short = {"sampling": {"max_new_tokens": 6}}
    params = from_dict(Params, merge(merge(TINY, bf16), {
        "model": {"name_or_path": str(sft)}, "prompts": short, "sft": short, "rs": short,
        "ppo": {"iterations": 1, **short}, "grpo": {"iterations": 1, **short},
        "evaluate": {"n_prompts": 4, "best_of_n": [2]}, "compare": {"n_prompts": 4}}), "tiny: ")
    folders = {"data": data, "sft": sft, "reward": rm, "ppo": tmp_path / "tuned"}
    seen = {}
    for name, spec in registry.specs().items():
        if not spec.inputs:   # prepare: it loads no model
            continue
        loads.clear()
        trained.clear()
        extra = {"policy": [f"tuned={tmp_path / 'tuned'}"]} if name == "compare" else {}
        registry.module(name).run(params, *[folders[i] for i in spec.inputs], tmp_path / "out" / name, progress=False,
                                  **extra)
        rows = [("policy" if cls.endswith("ForCausalLM") else "scalar", folder,
                 "trained" if any(m is model for engine in trained for m in engine.modules()) else "frozen", asked, held)
                for cls, folder, asked, held, model in loads]
        seen[name] = {row[:3] for row in rows}
        assert [row for row in rows if row[3:] != (torch.float32, {torch.float32})] == [], name
    # A stage LOADS does not list yet (a new method) is held to the rule above; the listed ones to their loads too.
    assert {name: got for name, got in seen.items() if name in LOADS} == LOADS
