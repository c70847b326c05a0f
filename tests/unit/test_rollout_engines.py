"""The rollout interface (pipeline/models/rollout_engine.py) and the vLLM engine behind it
(pipeline/models/vllm_engine.py), the latter against the fake `vllm` of tests/helpers/fake_vllm,
which takes exactly the calls the pinned vLLM has (scripts/vllm_api.py)."""

from __future__ import annotations

import ast
import importlib
import json
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, tiny_ppo_inputs
from pipeline.config import LoraConfig, Params, PPOConfig, SamplingConfig
from pipeline.data.tokenizer import encode_prompt, load_tokenizer
from pipeline.errors import ConfigError
from pipeline.measurement.policy import Policy, measure_policies, prompt_seed
from pipeline.models import lora, rollout_engine as engines
from pipeline.models.generation import sample, stop_ids
from pipeline.models.rollout_engine import TORCH, Request
from pipeline.ppo.placement import place_models
from pipeline.ppo.trainer import PPOTrainer

FAKE = REPO / "tests" / "helpers" / "fake_vllm"
PROMPTS = ["Review the film Silent River . Focus on the music .",
           "What did you think of Lost Harbor ? Talk about the plot .",
           "Review the film Red Canyon ."] * 2
SAMPLING = SamplingConfig(max_new_tokens=10)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    return tiny_ppo_inputs(tmp_path_factory.mktemp("engines"))


@pytest.fixture
def vllm(monkeypatch):
    """The fake `vllm`, imported fresh (its call log empty)."""
    monkeypatch.syspath_prepend(str(FAKE))
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    module = importlib.import_module("vllm")
    assert Path(module.__file__).is_relative_to(FAKE)
    yield module
    sys.modules.pop("vllm", None)


def _policy(dirs, peaked: bool = True):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(dirs / "sft").eval()
    if peaked:   # a trained policy's peaked next-token distributions (the untrained one is near uniform)
        with torch.no_grad():
            model.model.norm.weight.mul_(8.0)
    return model, load_tokenizer(dirs / "sft")


def _request(tok, model, **kw) -> Request:
    ids = [encode_prompt(tok, p) for p in PROMPTS]
    return Request(ids, tok.pad_token_id, tuple(stop_ids(tok, model, SAMPLING)), SAMPLING, **kw)


# ---- the interface ------------------------------------------------------------------------------

def test_our_sampler_behind_the_interface_is_the_sampler_itself(dirs):
    model, tok = _policy(dirs)
    req = _request(tok, model, stream=torch.Generator().manual_seed(3))
    got = TORCH.generate(model, req)
    want = sample(model, req.prompts, tok.pad_token_id, req.stop_ids, SAMPLING, torch.Generator().manual_seed(3))
    seeds = [prompt_seed(5, i) for i in range(len(PROMPTS))]
    rows = TORCH.generate(model, _request(tok, model, seeds=seeds))
    want_rows = sample(model, req.prompts, tok.pad_token_id, req.stop_ids, SAMPLING,
                       row_generators=[torch.Generator().manual_seed(s) for s in seeds])
    for a, b in ((got, want), (rows, want_rows)):
        for name in ("prompt_ids", "response_ids", "response_mask", "logprobs", "ended"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert not torch.equal(got.response_ids, rows.response_ids)   # the two kinds of seeding differ


def test_every_site_samples_through_the_interface_and_measurement_through_the_engine_given(dirs):
    # Statically: generation.sample is called by the torch engine only.
    callers = []
    for path in sorted((REPO / "pipeline").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "sample":
                callers.append(str(path.relative_to(REPO)))
    assert callers == ["pipeline/models/rollout_engine.py"]
    # Dynamically: measure_policies asks the engine it is given, with each prompt's own seed.
    model, tok = _policy(dirs)
    asked = []

    class Recording:
        name = "recording"

        def generate(self, m, request):
            asked.append(request)
            return TORCH.generate(m, request)
    prompts = PROMPTS * 12   # 72: two batches of 64 and 8
    mine = measure_policies([Policy("p", model, 5)], tok, prompts, SAMPLING, engine=Recording())["p"]
    default = measure_policies([Policy("p", model, 5)], tok, prompts, SAMPLING)["p"]
    assert mine.texts == default.texts and mine.ended == default.ended
    assert [len(r.prompts) for r in asked] == [64, 8]
    assert list(asked[1].seeds) == [prompt_seed(5, 64 + i) for i in range(8)] and asked[0].stream is None


# ---- the vLLM engine against the fake -----------------------------------------------------------

def test_the_fake_takes_exactly_the_pinned_vllm_calls(vllm):
    api = json.loads((FAKE / "vllm_api.json").read_text())
    assert api["version"] == "0.33.0"
    assert {"LLM", "SamplingParams", "TokensPrompt"} <= set(api["exports"])
    assert "processed_logprobs" in api["literals"]["LogprobsMode"]
    # Each name the engine uses is in the extract, and the fake refuses one that is not.
    llm = {p["name"] for p in api["classes"]["LLM"]["methods"]["__init__"]} | set(api["classes"]["EngineArgs"]["fields"])
    assert {"enable_sleep_mode", "distributed_executor_backend", "logprobs_mode", "load_format", "tensor_parallel_size",
            "gpu_memory_utilization", "max_model_len", "skip_tokenizer_init"} <= llm
    assert {"seed", "max_tokens", "stop_token_ids", "logprobs", "detokenize", "temperature"} <= set(
        api["classes"]["SamplingParams"]["fields"])
    assert [p["name"] for p in api["classes"]["LlamaForCausalLM"]["methods"]["load_weights"]] == ["weights"]
    with pytest.raises(TypeError, match="unexpected keyword arguments \\['enable_sleeping'\\]"):
        vllm.LLM(model="x", enable_sleeping=True)
    with pytest.raises(TypeError, match="SamplingParams has no fields \\['stop_ids'\\]"):
        vllm.SamplingParams(stop_ids=[2])


def test_each_rank_runs_an_engine_of_its_own(vllm, dirs):
    """One engine per training process with tensor parallelism 1 and no vLLM data-parallel group, as
    TRL's colocate mode and verl make theirs: each rank samples its own prompts and waits on no other."""
    _engine(vllm, dirs)
    made = vllm.calls[0][1]
    assert made["distributed_executor_backend"] == "external_launcher" and made["tensor_parallel_size"] == 1
    assert "data_parallel_size" not in made


def test_the_extract_is_what_the_script_reads_from_a_wheel(tmp_path):
    """scripts/vllm_api.py on a wheel written here with the files it reads (a miniature vLLM)."""
    import zipfile
    spec = importlib.util.spec_from_file_location("vllm_api", REPO / "scripts" / "vllm_api.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    files = {
        "vllm/__init__.py": '_MAP = {"LLM": ".entrypoints.llm:LLM", "SamplingParams": ".sampling_params:SamplingParams",'
                            ' "TokensPrompt": ".inputs:TokensPrompt"}\n',
        "vllm/entrypoints/llm.py": "class LLM:\n    def __init__(self, model: str, *, seed: int = 0, **kwargs): ...\n"
                                   "    def generate(self, prompts, sampling_params=None, *, use_tqdm=True): ...\n"
                                   "    def sleep(self, level: int = 1): ...\n    def wake_up(self, tags=None): ...\n"
                                   "    def apply_model(self, func): ...\n",
        "vllm/engine/arg_utils.py": "class EngineArgs:\n    enable_sleep_mode: bool = False\n    _private: int = 0\n",
        "vllm/sampling_params.py": "class SamplingParams:\n    seed: int | None = None\n    max_tokens: int = 16\n",
        "vllm/inputs/llm.py": "class TokensPrompt:\n    prompt_token_ids: list[int]\n",
        "vllm/outputs.py": "class RequestOutput:\n    def __init__(self, request_id, outputs, finished=True): ...\n"
                           "class CompletionOutput:\n    token_ids: list\n    finish_reason: str | None = None\n",
        "vllm/logprobs.py": "class Logprob:\n    logprob: float\n",
        "vllm/model_executor/models/llama.py": "class LlamaForCausalLM:\n    def load_weights(self, weights): ...\n",
        "vllm/config/model.py": 'LogprobsMode = Literal["raw_logprobs", "processed_logprobs"]\n',
    }
    wheel = tmp_path / "vllm-9.9.9-cp38-abi3-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    api = script.extract(wheel)
    assert api["version"] == "9.9.9" and api["exports"] == ["LLM", "SamplingParams", "TokensPrompt"]
    assert api["classes"]["LLM"]["methods"]["__init__"] == [
        {"name": "model", "kind": "positional", "default": False}, {"name": "seed", "kind": "keyword_only", "default": True},
        {"name": "kwargs", "kind": "var_keyword", "default": True}]
    assert api["classes"]["EngineArgs"]["fields"] == ["enable_sleep_mode"]
    assert api["literals"]["LogprobsMode"] == ["raw_logprobs", "processed_logprobs"]
    # The committed extract is the pinned version's.
    committed = json.loads((FAKE / "vllm_api.json").read_text())
    assert committed["version"] == script.PIN
    del files["vllm/logprobs.py"]
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    with pytest.raises(KeyError):
        script.extract(wheel)


def _engine(vllm, dirs, **kw):
    from pipeline.models.vllm_engine import VllmEngine
    return VllmEngine(dirs / "sft", dtype="float32", seed=0, memory_fraction=0.5, max_model_len=128, **kw)


def test_a_rollout_from_vllm_is_our_samplers_layout_with_the_trainers_weights(vllm, dirs):
    model, tok = _policy(dirs)
    engine = _engine(vllm, dirs)
    assert [c[0] for c in vllm.calls] == ["LLM", "sleep"]
    assert vllm.calls[0][1]["logprobs_mode"] == "processed_logprobs" and vllm.calls[0][1]["load_format"] == "dummy"
    req = _request(tok, model, stream=torch.Generator().manual_seed(1))
    got = engine.generate(model, req)
    assert [c[0] for c in vllm.calls[2:]] == ["wake_up", "apply_model", "wake_up", "generate", "sleep"]
    # The weights it sampled with are the trainer's, by name and shape (the placeholders were zero).
    fake = dict(engine.llm.model.hf.named_parameters())
    mine = dict(model.named_parameters())
    assert fake.keys() == mine.keys() and all(torch.equal(fake[n], mine[n]) for n in mine)
    # Our sampler's layout: prompts left-padded as ours pads them, responses right-padded, the
    # log-prob of each sampled token under the temperature-scaled distribution, ended at a stop id.
    ours = TORCH.generate(model, req)
    assert torch.equal(got.prompt_ids, ours.prompt_ids) and torch.equal(got.prompt_mask, ours.prompt_mask)
    B, R = got.response_ids.shape
    assert B == len(PROMPTS) and R <= SAMPLING.max_new_tokens and got.logprobs.shape == (B, R)
    lengths = got.response_mask.sum(1)
    for i in range(B):
        n = int(lengths[i])
        assert got.response_mask[i, :n].all() and not got.response_mask[i, n:].any()
        assert (got.response_ids[i, n:] == tok.pad_token_id).all() and (got.logprobs[i, n:] == 0).all()
        last = int(got.response_ids[i, n - 1])
        assert bool(got.ended[i]) == (last in req.stop_ids) and (got.ended[i] or n == SAMPLING.max_new_tokens)
    # Those log-probs are the trainer's own, to float rounding: the mismatch a fast engine brings is measured
    # against this (a forward over prompt + response).
    from pipeline.models.logprobs import logprobs_from_logits, response_logits
    from pipeline.data.padding import positions
    ids = torch.cat([got.prompt_ids, got.response_ids], 1)
    mask = torch.cat([got.prompt_mask, got.response_mask], 1).long()
    with torch.no_grad():
        trainer = logprobs_from_logits(response_logits(model, ids, mask, positions(mask), R, SAMPLING.temperature),
                                       got.response_ids)
    assert (trainer - got.logprobs).abs().masked_fill(~got.response_mask, 0).max() < 1e-5


def test_the_caching_allocator_gives_memory_back_around_the_engines_wake_and_sleep(vllm, dirs, monkeypatch):
    """On a GPU the trainer's freed blocks are returned before the engine wakes and the engine's
    after it sleeps (PyTorch's allocator would keep them reserved, and colocated, the two would not
    fit): torch.cuda.empty_cache at both places in the call order."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: vllm.calls.append(("empty_cache", {})))
    model, tok = _policy(dirs)
    engine = _engine(vllm, dirs)
    del vllm.calls[:]
    engine.generate(model, _request(tok, model, stream=torch.Generator().manual_seed(1)))
    assert [c[0] for c in vllm.calls] == ["empty_cache", "wake_up", "apply_model", "wake_up", "generate", "sleep",
                                          "empty_cache"]


def test_lora_weights_reach_vllm_merged_and_the_trainers_stay_untouched(vllm, dirs):
    model, tok = _policy(dirs)
    peft = lora.wrap(model, LoraConfig(r=4, alpha=8, target_modules="q_proj,v_proj"), "CAUSAL_LM", "ppo.lora")
    torch.manual_seed(1)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)   # a trained adapter (fresh ones are zero)
    before = {n: p.detach().clone() for n, p in peft.named_parameters()}
    engine = _engine(vllm, dirs)
    engine.generate(peft, _request(tok, model, seeds=list(range(len(PROMPTS)))))
    after = dict(peft.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)   # bit for bit: no merge and unmerge
    import copy
    merged = dict(copy.deepcopy(peft).merge_and_unload().named_parameters())
    fake = dict(engine.llm.model.hf.named_parameters())
    assert fake.keys() == merged.keys()
    assert all(torch.allclose(fake[n], merged[n], atol=1e-6, rtol=0) for n in merged)
    assert not torch.equal(fake["model.layers.0.self_attn.q_proj.weight"],
                           before["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"])


def test_stop_ids_seeds_and_length_cuts(vllm, dirs):
    model, tok = _policy(dirs)
    engine = _engine(vllm, dirs)
    seeds = [prompt_seed(7, i) for i in range(len(PROMPTS))]
    req = _request(tok, model, seeds=seeds)
    a, b = engine.generate(model, req), engine.generate(model, req)
    assert torch.equal(a.response_ids, b.response_ids)   # each row from its own seed
    params = [engine.params(req, s) for s in engine.seeds(req)]
    assert all(p.stop_token_ids == list(req.stop_ids) and p.logprobs == 0 and p.max_tokens == 10 for p in params)
    assert [p.seed for p in params] == [s % 2 ** 31 for s in seeds]
    # A stop id sampled third in the first response ends it there, kept as its last token.
    third = int(a.response_ids[0, 2])
    first = int(a.response_ids[0, :3].eq(third).long().argmax())   # where it first appears
    stopped = engine.generate(model, Request(req.prompts, req.pad_id, req.stop_ids + (third,), SAMPLING, seeds=seeds))
    assert bool(stopped.ended[0]) and int(stopped.response_mask[0].sum()) == first + 1
    assert torch.equal(stopped.response_ids[0, :first + 1], a.response_ids[0, :first + 1])
    # A stop set without eos: nothing ends, every response is cut at the length limit.
    none = engine.generate(model, Request(req.prompts, req.pad_id, (tok.pad_token_id,), SAMPLING, seeds=seeds))
    assert not none.ended.any() and none.response_mask.all() and none.response_ids.size(1) == SAMPLING.max_new_tokens
    # Greedy: temperature 0 in vLLM's terms; the argmax path of ours gives the same tokens.
    greedy = engine.generate(model, _request(tok, model, greedy=True))
    assert torch.equal(greedy.response_ids, TORCH.generate(model, _request(tok, model, greedy=True)).response_ids)


def test_ppo_with_the_vllm_engine_recomputes_and_logs_the_mismatch_every_iteration(vllm, dirs):
    tiny = dict(iterations=2, rollout_batch_size=6, minibatch_size=3, micro_batch_size=3, ppo_epochs=1,
                lr=1e-3, critic_lr=1e-3, sampling=SamplingConfig(max_new_tokens=8), rollout_engine="vllm")
    params = Params(ppo=PPOConfig(**tiny))
    trainer = PPOTrainer(params.ppo, place_models(params, dirs / "sft", dirs / "rm"), PROMPTS, engine=_engine(vllm, dirs))
    assert trainer.recompute is True and "rollout_engine: vllm" in trainer.recompute_reason
    for _ in range(2):
        stats = trainer.step()
        assert 0 <= stats["val/logprob_diff_mean"] <= stats["val/logprob_diff_max"] < 1e-4
        assert stats["val/first_ratio_max_dev"] < 1e-5
    assert [c[0] for c in vllm.calls].count("generate") == 2 and [c[0] for c in vllm.calls].count("apply_model") == 2


def test_what_vllm_would_do_otherwise_is_refused_at_load():
    with pytest.raises(ConfigError, match=r"^ppo.sampling.top_k: 20 with ppo.rollout_engine: vllm: vLLM's log-probs"):
        PPOConfig(rollout_engine="vllm", sampling=SamplingConfig(top_k=20))
    with pytest.raises(ConfigError, match=r"^ppo.sampling.top_p: 0.9 with"):
        PPOConfig(rollout_engine="vllm", sampling=SamplingConfig(top_p=0.9))
    with pytest.raises(ConfigError, match=r"^ppo.recompute_logprobs: false with ppo.rollout_engine: vllm"):
        PPOConfig(rollout_engine="vllm", recompute_logprobs=False)
    PPOConfig(sampling=SamplingConfig(top_k=20, top_p=0.9))   # our sampler filters both sides alike


def test_the_engines_memory_is_what_the_plan_leaves():
    from pipeline.models.vllm_engine import max_model_len, memory_fraction
    assert memory_fraction(40.0, 80.0) == 0.45
    with pytest.raises(ConfigError, match="leaves 0% of the device's 80.0 GiB"):
        memory_fraction(78.0, 80.0)
    assert max_model_len(256, 48) == 304 and max_model_len(250, 48) == 304 and max_model_len(1, 1) == 16


def test_the_engine_module_imports_without_vllm_and_asks_for_it_only_when_made(dirs, monkeypatch):
    monkeypatch.delitem(sys.modules, "vllm", raising=False)
    monkeypatch.setitem(sys.modules, "vllm", None)   # not installed
    from pipeline.models import vllm_engine
    with pytest.raises(ImportError):
        vllm_engine.VllmEngine(dirs / "sft", dtype="float32", seed=0, memory_fraction=0.5, max_model_len=64)
    assert engines.TORCH.name == "torch"


def test_the_stage_asks_for_vllm_only_on_cuda_and_otherwise_uses_ours():
    from types import SimpleNamespace
    from pipeline.stages.ppo import rollout_engine
    run = SimpleNamespace(params=Params(ppo=PPOConfig(rollout_engine="vllm")), spec=SimpleNamespace(name="ppo"),
                          ctx=SimpleNamespace(device=torch.device("cpu")))
    with pytest.raises(ConfigError, match=r"^ppo.rollout_engine: vllm needs a CUDA device; this process has cpu$"):
        rollout_engine(run, [])
    run.params = Params(ppo=PPOConfig())
    assert rollout_engine(run, []) is TORCH


def test_the_stage_gives_vllm_what_its_plan_leaves_beside_the_trainer(vllm, dirs, monkeypatch):
    """The plan of a vLLM rollout counts the engine's own weights and least KV pool; the engine's
    share of an (80 GiB) device is what the plan leaves beside what the trainer holds then (its
    states: its activations are freed), in GiB against GiB."""
    from types import SimpleNamespace
    from transformers import AutoConfig
    from pipeline.models.vllm_engine import memory_fraction
    from pipeline.stages import registry
    from pipeline.stages.ppo import rollout_engine
    from pipeline.training import memory_plan, memory_terms as mt

    spec = registry.spec("ppo")
    folders = dict(zip(spec.inputs, [dirs / "data", dirs / "sft", dirs / "rm"]))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: SimpleNamespace(total_memory=80 * 2 ** 30))
    plans = {}
    for name in ("torch", "vllm"):
        params = Params(ppo=PPOConfig(rollout_engine=name))
        plans[name] = memory_plan.stage_plan("ppo", spec.plan, params, folders)
    ours, theirs = plans["torch"], plans["vllm"]
    actor = mt.shape_of(AutoConfig.from_pretrained(dirs / "sft"))
    cfg = PPOConfig()
    rows, tokens = cfg.rollout_batch_size, cfg.max_prompt_length + cfg.sampling.max_new_tokens
    assert ours.engine == 0 and theirs.engine == mt.engine_bytes(actor, rows, tokens, 4, 4) > actor.params * 4
    assert theirs.device["rollout"] == theirs.engine      # fp32, one process: no gathered copy
    assert {k: v for k, v in theirs.device.items() if k != "rollout"} == \
        {k: v for k, v in ours.device.items() if k != "rollout"}
    assert theirs.beside_engine == sum(theirs.device[r] for r in mt.STATES) < theirs.total
    run = SimpleNamespace(params=Params(ppo=PPOConfig(rollout_engine="vllm")), spec=spec,
                          ctx=SimpleNamespace(device=torch.device("cuda", 0), world_size=1))
    rollout_engine(run, list(folders.values()))
    share = vllm.calls[0][1]["gpu_memory_utilization"]
    assert share == memory_fraction(theirs.beside_engine / 2 ** 30, 80.0) and 0.9 < share <= 0.95
