"""Log-probabilities of response tokens under a causal LM: the one gather every stage uses (PPO's
old, reference and new log-probs, the KL of a policy to its reference in measurement).

Layout (as a PPO rollout): prompt left-padded, response right-padded, T = P + R columns; the
logits at column t predict token t + 1, so the R response tokens are predicted by the R columns
before the last. Logits are divided by the sampling temperature, exactly as the sampler did.
"""

from __future__ import annotations

import functools
import inspect

import torch

from . import lora


def logprobs_from_logits(
    logits: torch.Tensor,  # (B, R, V) next-token logits aligned with labels
    labels: torch.Tensor,  # (B, R) int64 token ids whose log-prob is wanted
) -> torch.Tensor:  # (B, R) log softmax(logits)[labels]
    """log p(label) = logit[label] - logsumexp(logits).

    Avoids keeping a (B, R, V) log_softmax copy alive for backward; logsumexp
    is stable (max-shifted). Pass float32 or wider logits: logsumexp over a
    large vocabulary in bfloat16 loses the precision PPO ratios need.
    """
    picked = torch.gather(logits, dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(
    logits: torch.Tensor,  # (B, R, V)
) -> torch.Tensor:  # (B, R) entropy of softmax(logits) in nats
    """H = logsumexp(z) - sum_v softmax(z)_v z_v, the stable form of -sum p log p.

    The sum over V is an einsum (a batched dot product) rather than
    ``(probs * logits).sum(-1)``, which would allocate a second (B, R, V)
    tensor. Logits must be finite (-inf gives 0 * -inf = NaN).
    """
    probs = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - torch.einsum("...v,...v->...", probs, logits)


def _hf_model(model) -> torch.nn.Module:
    """The Hugging Face model behind a DeepSpeed engine's forward (its `module`), a view that runs
    another model's forward (its `runs_forward_of`: the LoRA reference view of ppo/placement.py) or
    a PEFT wrapper."""
    inner = getattr(model, "module", model)
    inner = getattr(inner, "runs_forward_of", inner)
    return lora.unwrap(inner)


def keeps_logits(model) -> bool:
    """Whether the model's forward can compute logits for the last k positions only."""
    return _class_keeps_logits(type(_hf_model(model)))


@functools.cache
def _class_keeps_logits(cls: type) -> bool:   # once per class: this runs on every training forward
    return "logits_to_keep" in inspect.signature(cls.forward).parameters


def response_logits(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                    n_response: int, temperature: float) -> torch.Tensor:
    """(B, R, V) temperature-scaled logits that predict each of the last R = `n_response` tokens of
    (B, T) `input_ids`. Only the last R + 1 positions go through the LM head when the model allows
    it (prompt logits are never used)."""
    extra = {"logits_to_keep": n_response + 1} if keeps_logits(model) else {}
    logits = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                   **extra).logits                                             # (B, T or R + 1, V)
    return logits[:, -(n_response + 1):-1].float() / temperature
