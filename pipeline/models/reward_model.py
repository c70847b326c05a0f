"""The reward model: a causal-LM backbone with a scalar head, read at the last real token.

`AutoModelForSequenceClassification` with `num_labels=1` gives the architecture and a checkpoint
format anyone can load. We do not use its own pooling: it finds the last token by comparing ids with
`pad_token_id`, which breaks when pad == eos (GPT-2 style tokenizers) and the response ends with eos.
Instead the score is read at the last position where `attention_mask` is 1, so left- and
right-padded batches give the same scores.

Normalisation (Huang et al. 2024, "The N+ implementation details of RLHF with PPO", §reward
normalisation): after training, the mean raw score of reference responses is stored in the model's
config as `reward_offset`; `score` subtracts it, so every consumer (PPO, evaluation) applies it alike.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForSequenceClassification, PreTrainedModel, PreTrainedTokenizerBase

from ..data.padding import positions, right_pad
from ..errors import CheckpointError
from .lora import unwrap
from .checkpoints import fit_embeddings, from_checkpoint
from ..data.tokenizer import encode_prompt, encode_response, load_tokenizer

OFFSET_KEY = "reward_offset"


def head(model: torch.nn.Module) -> torch.nn.Module:
    """The scalar head of a sequence-classification model (`score` in Llama, GPT-2, Mistral...).
    Under LoRA it is PEFT's trainable copy of that Linear (a ModulesToSaveWrapper)."""
    layer = getattr(unwrap(model), "score", None)
    linear = getattr(layer, "original_module", layer)
    if not isinstance(linear, torch.nn.Linear) or linear.out_features != 1:
        raise CheckpointError(f"{type(model).__name__}: expected a `score` Linear(hidden, 1) head")
    return layer


def init_reward_model(path: str | Path, seed: int, head_std: float | None, trust_remote_code: bool = False,
                      load_kwargs: dict | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Backbone from a causal-LM checkpoint (the SFT model by default, or any `name_or_path`) plus
    a fresh scalar head; a tokenizer without pad gets one (embeddings resized). `load_kwargs`:
    dtype / attention implementation (models.load_kwargs).

    Head init N(0, 1/sqrt(hidden + 1)), bias 0, as in Stiennon et al. 2020 / lm-human-preferences.
    """
    tok = load_tokenizer(path, trust_remote_code, add_pad=True)
    kwargs = {"trust_remote_code": trust_remote_code, **(load_kwargs or {})}
    # A fresh head is expected; an unexpected weight is the causal LM's own head (an untied lm_head).
    model = from_checkpoint(AutoModelForSequenceClassification, path, strict=False, expected_missing=("score.",),
                            num_labels=1, pad_token_id=tok.pad_token_id, **kwargs)
    model = fit_embeddings(model, tok)
    layer = head(model)
    assert isinstance(layer, torch.nn.Linear)
    std = head_std if head_std is not None else 1.0 / math.sqrt(layer.in_features + 1)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen) * std)
        if layer.bias is not None:
            layer.bias.zero_()
    setattr(model.config, OFFSET_KEY, 0.0)
    return model, tok


def load_reward_model(path: str | Path, trust_remote_code: bool = False) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a trained reward model (safetensors only) and check it has one scalar output."""
    path = Path(path)
    if not list(path.glob("*.safetensors")):
        raise CheckpointError(f"{path}: no safetensors weights; this pipeline does not load pickled checkpoints")
    model = from_checkpoint(AutoModelForSequenceClassification, path, strict=True,
                            trust_remote_code=trust_remote_code, use_safetensors=True)
    if model.config.num_labels != 1:
        raise CheckpointError(f"{path}: a reward model has num_labels=1, this one has {model.config.num_labels}")
    head(model)
    return model, load_tokenizer(path, trust_remote_code)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the rightmost real token of each row of a (B, T) mask, any padding side."""
    T = attention_mask.size(1)
    return T - 1 - attention_mask.flip(-1).long().argmax(-1)


def hidden_states(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, T, H) last hidden states of the backbone, positions counted from each row's first real token."""
    out = unwrap(model).base_model(input_ids=input_ids, attention_mask=attention_mask,
                                   position_ids=positions(attention_mask))
    return out.last_hidden_state


def raw_scores(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) head output at the last real token, before normalisation (what training optimises)."""
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    hidden = hidden_states(model, input_ids, attention_mask)                       # (B, T, H)
    last = hidden[torch.arange(hidden.size(0)), last_token_index(attention_mask)]  # (B, H)
    return head(model)(last).squeeze(-1).float()


def length_sorted_scores(model: PreTrainedModel, seqs: list[list[int]], pad_id: int,
                         device: torch.device | None = None, max_rows: int = 32) -> torch.Tensor:
    """(N,) raw scores of `seqs`, as `raw_scores` of the whole padded batch would give, computed in
    length-sorted parts of at most `max_rows` rows, each padded only to its own longest sequence.

    On the default task a random batch of 64 sequences carries 39% padding; two sorted halves carry
    19% (measured on the prepared pairs), so the forward and backward do that much less work. The
    scores are per row, so the split changes nothing but floating-point rounding; gradients flow
    through every part."""
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))
    n_parts = -(-len(seqs) // max_rows)
    bounds = [round(k * len(seqs) / n_parts) for k in range(n_parts + 1)]   # equal-sized parts
    parts = []
    for lo, hi in zip(bounds, bounds[1:]):
        ids, mask = right_pad([seqs[i] for i in order[lo:hi]], pad_id)
        mask = mask.long()
        if device is not None:
            ids, mask = ids.to(device), mask.to(device)
        parts.append(raw_scores(model, ids, mask))
    sorted_scores = torch.cat(parts)                                   # (N,) in length order
    return sorted_scores[torch.argsort(torch.tensor(order, device=sorted_scores.device))]


def offset(model: PreTrainedModel) -> float:
    return float(getattr(model.config, OFFSET_KEY, 0.0) or 0.0)


def encode_pair_text(tok: PreTrainedTokenizerBase, prompt: str, response: str, max_length: int) -> list[int]:
    """prompt + response + eos, the prompt losing its left end when the whole is too long."""
    p, r = encode_prompt(tok, prompt), encode_response(tok, response)
    if len(r) >= max_length:
        r = r[:max_length - 1]  # keep one prompt token; an over-long response is scored on its start
    return p[max(0, len(p) + len(r) - max_length):] + r


@torch.inference_mode()
def score_texts(model: PreTrainedModel, tok: PreTrainedTokenizerBase, prompts: list[str], responses: list[str],
                max_length: int, batch_size: int = 64) -> torch.Tensor:
    """(N,) normalised scores of (prompt, response) texts: raw score minus the stored offset."""
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(prompts), batch_size):
        seqs = [encode_pair_text(tok, p, r, max_length)
                for p, r in zip(prompts[start:start + batch_size], responses[start:start + batch_size])]
        out.append(length_sorted_scores(model, seqs, tok.pad_token_id))
    model.train(was_training)
    return torch.cat(out) - offset(model)


def pairwise_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor,
                  margin: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Bradley-Terry loss -log sigmoid(r_c - r_r - m), mean over pairs (Ouyang et al. 2022, eq. 1;
    the margin as in Llama 2, Touvron et al. 2023, eq. 2). r_chosen, r_rejected, margin: (B,)."""
    total, correct = pairwise_loss_sum(r_chosen, r_rejected, margin)
    loss = total / r_chosen.numel()
    return loss, {"loss": loss.item(), "accuracy": correct / r_chosen.numel()}


def pairwise_loss_sum(r_chosen: torch.Tensor, r_rejected: torch.Tensor,
                      margin: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The loss of `pairwise_loss` summed over the pairs (for batches split across micro-batches and processes,
    divided by the global batch size by the caller), and the number ranked correctly."""
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).sum(), int((r_chosen > r_rejected).sum())
