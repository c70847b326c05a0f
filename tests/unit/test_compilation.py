"""distributed.compile (pipeline/training/compilation.py): every transformer block compiled, the
training forward's log-probs and gradients equal eager's within float tolerance, and the sampler's
cached decode steps routed to the eager blocks."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from pipeline.config import DistributedConfig
from pipeline.data.padding import positions
from pipeline.errors import ConfigError
from pipeline.models import logprobs
from pipeline.training import compilation

V = 300


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def _batch(B: int, P: int, R: int, seed: int):
    """Left-padded prompts and right-padded responses of uneven lengths, as a rollout holds them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, V, (B, P + R), generator=g)                   # (B, T)
    mask = torch.ones(B, P + R, dtype=torch.long)                          # (B, T)
    mask[0, :2] = 0
    mask[-1, P + R - 3:] = 0
    return ids, mask, positions(mask), ids[:, P:]


def _step(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    ids, mask, pos, labels = batch
    lp, _ = logprobs.response_logprobs(model, ids, mask, pos, labels, 0.7)   # (B, R)
    (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
    return lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_compiled_blocks_give_eager_logprobs_and_gradients_at_every_length():
    eager = _llama()
    compiled = copy.deepcopy(eager)
    assert compilation.compile_blocks(compiled) == 3
    # two lengths: one dynamic-shape graph serves both (a recompile per length would be the failure
    # the dynamic compile avoids; the values must hold either way)
    for B, P, R, seed in ((3, 5, 7, 1), (2, 9, 4, 2)):
        lp_e, g_e = _step(eager, _batch(B, P, R, seed))
        lp_c, g_c = _step(compiled, _batch(B, P, R, seed))
        assert lp_c.shape == (B, R)
        torch.testing.assert_close(lp_c, lp_e, atol=1e-5, rtol=1e-5)
        assert g_c.keys() == g_e.keys() and len(g_e) > 10
        for name in g_e:
            torch.testing.assert_close(g_c[name], g_e[name], atol=1e-5, rtol=1e-4, msg=name)


def _routed(monkeypatch, model) -> dict[str, int]:
    """compile_blocks with torch.compile replaced by a recorder: how many block calls each path took."""
    calls = {"compiled": 0}

    def fake_compile(fn, dynamic):
        assert dynamic is True

        def run(*args, **kwargs):
            calls["compiled"] += 1
            return fn(*args, **kwargs)
        return run
    monkeypatch.setattr(compilation.torch, "compile", fake_compile)
    compilation.compile_blocks(model)
    return calls


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_training_forwards_take_the_compiled_blocks_and_cached_decoding_the_eager_ones(arch, monkeypatch):
    if arch == "llama":
        model = _llama()
    else:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    n_blocks = len(compilation.blocks(model))
    assert n_blocks == model.config.num_hidden_layers
    calls = _routed(monkeypatch, model)
    _step(model, _batch(2, 4, 5, 3))
    assert calls["compiled"] == n_blocks                   # one forward: each block once, compiled
    before = calls["compiled"]
    ids = torch.randint(3, V, (1, 4))
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 9)
    assert calls["compiled"] == before                     # every cached step ran eager


def test_a_model_without_blocks_and_zero3_are_refused():
    with pytest.raises(ConfigError, match="distributed.compile: Linear has no transformer blocks"):
        compilation.compile_blocks(torch.nn.Linear(3, 3))
    with pytest.raises(ConfigError, match="distributed.compile: not with zero_stage 3"):
        DistributedConfig(backend="deepspeed", zero_stage=3, compile=True)
