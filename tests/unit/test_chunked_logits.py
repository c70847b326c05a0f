"""Logits never whole: above LOGITS_CHUNK_BYTES the LM head, the log-softmax and the entropy run on
chunks of positions (pipeline/models/logprobs.py). Equivalence with the whole logits (values and
gradients, fp32), the largest vocabulary-wide tensor one chunk's, and the heads that are not chunked."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Gemma2Config, Gemma2ForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from pipeline.data.padding import positions
from pipeline.data.records import IGNORE
from pipeline.models import logit_chunks, logprobs
from pipeline.training.demonstrations import ce_sum

V = 1000            # vocabulary: 4 kB of fp32 logits per position
H = 32              # hidden size
ROWS = 7            # positions per chunk in the chunked runs
SMALL = ROWS * V * 4


def _model(kind: str) -> torch.nn.Module:
    torch.manual_seed(0)
    shape = dict(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=128)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**shape, tie_word_embeddings=False))
    return Qwen2ForCausalLM(Qwen2Config(**shape, tie_word_embeddings=True))


def _batch(B: int = 3, P: int = 6, R: int = 9):
    """Left-padded prompts and right-padded responses of uneven lengths, as a rollout holds them."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (B, P + R), generator=g)                   # (B, T)
    mask = torch.ones(B, P + R, dtype=torch.long)                          # (B, T)
    mask[0, :2] = 0                                                        # a left-padded prompt
    mask[1, P + R - 3:] = 0                                                # a short response
    return ids, mask, positions(mask), ids[:, P:]


def _stats(model, chunk_bytes: int, monkeypatch, entropy_grad: bool):
    monkeypatch.setattr(logit_chunks, "LOGITS_CHUNK_BYTES", chunk_bytes)
    model.zero_grad()
    ids, mask, pos, labels = _batch()
    lp, ent = logprobs.response_logprobs(model, ids, mask, pos, labels, 0.7, entropy=True, entropy_grad=entropy_grad)
    w = torch.linspace(-1, 1, lp.numel()).view_as(lp)                      # (B, R) a loss that weighs every position
    loss = (lp * w).sum() + ((ent * w.flip(-1)).sum() if entropy_grad else 0.0)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return lp.detach(), ent.detach(), grads


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("entropy_grad", [True, False])
def test_chunked_logprobs_entropy_and_gradients_equal_the_whole_logits(kind, entropy_grad, monkeypatch):
    model = _model(kind)
    whole = _stats(model, 1 << 40, monkeypatch, entropy_grad)
    assert logprobs.chunked_head(model, 27) is None                        # 27 positions fit the default
    chunked = _stats(model, SMALL, monkeypatch, entropy_grad)
    assert logprobs.chunked_head(model, 27) is not None                    # ... and 4 chunks of 7 do not
    torch.testing.assert_close(chunked[0], whole[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(chunked[1], whole[1], atol=1e-5, rtol=1e-5)
    assert chunked[2].keys() == whole[2].keys() and "lm_head.weight" in whole[2] or kind == "qwen2"
    for name, grad in whole[2].items():
        torch.testing.assert_close(chunked[2][name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_sft_loss_and_gradients_equal_the_whole_logits(monkeypatch):
    model = _model("llama")
    ids, mask, _, _ = _batch()
    labels = ids.masked_fill(mask == 0, IGNORE)
    labels[:, :6] = IGNORE                                                 # the prompt is context, not a target
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    out = []
    for chunk_bytes in (1 << 40, SMALL):
        monkeypatch.setattr(logit_chunks, "LOGITS_CHUNK_BYTES", chunk_bytes)
        model.zero_grad()
        loss, n = ce_sum(model, batch)
        loss.backward()
        out.append((loss.detach(), n, {k: p.grad.clone() for k, p in model.named_parameters()}))
    (whole, n_whole, g_whole), (chunked, n_chunked, g_chunked) = out
    assert n_whole == n_chunked == int((labels[:, 1:] != IGNORE).sum())
    torch.testing.assert_close(chunked, whole, atol=1e-4, rtol=1e-6)
    for name, grad in g_whole.items():
        torch.testing.assert_close(g_chunked[name], grad, atol=1e-5, rtol=1e-4, msg=name)


class _Widest(TorchDispatchMode):
    """The most elements of any tensor an op makes whose last dimension is the vocabulary, the head's
    (H, V) transposed weight aside."""
    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim() and t.size(-1) == V and t.shape != (H, V):
                self.most = max(self.most, t.numel())
        return out


@pytest.mark.parametrize("chunk_bytes, widest", [(1 << 40, 3 * 10 * V), (SMALL, ROWS * V)])
def test_no_tensor_of_the_vocabulary_is_wider_than_one_chunk(chunk_bytes, widest, monkeypatch):
    """Forward and backward: with chunks, no op makes a vocabulary-wide tensor of more than one
    chunk's positions (the whole path makes the (B, R + 1, V) logits)."""
    model = _model("llama")
    monkeypatch.setattr(logit_chunks, "LOGITS_CHUNK_BYTES", chunk_bytes)
    ids, mask, pos, labels = _batch()
    with _Widest() as seen:
        lp, ent = logprobs.response_logprobs(model, ids, mask, pos, labels, 1.0, entropy=True)
        (lp.sum() + ent.sum()).backward()
    assert seen.most == widest


def test_heads_that_transform_their_logits_are_not_chunked(monkeypatch):
    """Gemma 2 soft-caps its logits after the head: chunking the head alone would skip that, so its
    logits stay whole, and its log-probs are the whole logits' at any chunk size."""
    monkeypatch.setattr(logit_chunks, "LOGITS_CHUNK_BYTES", SMALL)
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                           num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                           final_logit_softcapping=5.0))
    assert logprobs.chunked_head(model, 10_000) is None
    ids, mask, pos, labels = _batch()
    lp, _ = logprobs.response_logprobs(model, ids, mask, pos, labels, 1.0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -(labels.size(1) + 1):-1]
    assert logits.abs().max() < 5.0                                         # capped
    torch.testing.assert_close(lp, logprobs.logprobs_from_logits(logits.float(), labels))


def test_the_memory_plan_counts_one_chunk_of_a_chunked_head():
    """A Qwen2.5-sized vocabulary at 4 x 2k positions: the plan's logits term is one chunk's, not
    the ~8k positions' whole logits; a soft-capping head's stays whole."""
    from pipeline.training import memory_terms
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2)
    qwen = memory_terms.shape_of(Qwen2Config(vocab_size=151_936, **small))
    gemma = memory_terms.shape_of(Gemma2Config(vocab_size=151_936, head_dim=16, **small))
    assert qwen.chunked_logits and not gemma.chunked_logits
    positions, per_position = 4 * 2048, 151_936 * (2 + 8)
    chunk = logit_chunks.chunk_positions(151_936)
    assert chunk == 1766 < positions
    assert memory_terms.logits_bytes(qwen, positions, 2) == chunk * per_position
    assert memory_terms.logits_bytes(gemma, positions, 2) == positions * per_position
    assert memory_terms.logits_bytes(qwen, 100, 2) == 100 * per_position   # below a chunk: whole
