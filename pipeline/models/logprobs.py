"""Log-probabilities of response tokens under a causal LM: the one gather every stage uses (PPO's
old, reference and new log-probs, the KL of a policy to its reference in measurement).

Layout (as a PPO rollout): prompt left-padded, response right-padded, T = P + R columns; the
logits at column t predict token t + 1, so the R response tokens are predicted by the R columns
before the last. Logits are divided by the sampling temperature, exactly as the sampler did.

Logits are never whole where they would be large: at a 152k vocabulary, 2k positions and 4 rows the
fp32 logits alone take ~5 GB, and their log-softmax and gradient as much again. Above
`logit_chunks.LOGITS_CHUNK_BYTES` the model's forward stops at the last hidden state, and the LM
head, the log-softmax and the entropy run on chunks of positions, each chunk's logits recomputed
in the backward pass rather than kept (activation checkpointing of the head alone). Below it (the
default task's every batch) the logits are made whole exactly as before, so no bit of those runs
moves.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Iterator, Optional

import torch
from torch.utils.checkpoint import checkpoint

from . import logit_chunks, lora


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


def hf_model(model) -> torch.nn.Module:
    """The Hugging Face model behind a DeepSpeed engine's forward (its `module`), a view that runs
    another model's forward (its `runs_forward_of`: the LoRA reference view of ppo/placement.py) or
    a PEFT wrapper."""
    inner = getattr(model, "module", model)
    inner = getattr(inner, "runs_forward_of", inner)
    return lora.unwrap(inner)


def keeps_logits(model) -> bool:
    """Whether the model's forward can compute logits for the last k positions only."""
    return _class_keeps_logits(type(hf_model(model)))


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
                   use_cache=False, **extra).logits                                             # (B, T or R + 1, V)
    return logits[:, -(n_response + 1):-1].float() / temperature


def chunked_head(model, positions: int) -> Optional[torch.nn.Linear]:
    """The LM head to run chunk by chunk for a forward that needs logits at `positions` positions
    in all (rows x positions each), or None where the logits are made whole: they fit in
    logit_chunks.LOGITS_CHUNK_BYTES, or the head is not a plain linear layer of a
    logit_chunks.PLAIN_HEAD_TYPES model (a PEFT-wrapped or adapted head), or its weight is
    partitioned by ZeRO-3 (each chunk would gather it again)."""
    hf = hf_model(model)
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or positions <= logit_chunks.chunk_positions(head.out_features):
        return None
    if getattr(hf.config, "model_type", None) not in logit_chunks.PLAIN_HEAD_TYPES or hasattr(head.weight, "ds_id"):
        return None
    return head


@contextlib.contextmanager
def hidden_out(head: torch.nn.Linear) -> Iterator[None]:
    """The model's forward returns its last hidden states as `.logits` meanwhile: the head's
    forward is the identity (an instance attribute shadows the class's), and the chunks apply the
    head themselves. Hooks on the head (DeepSpeed's) still run."""
    head.forward = lambda hidden: hidden
    try:
        yield
    finally:
        del head.forward


def _chunk_stats(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, temperature: float,
                 entropy: bool, entropy_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(n,) log-probs of (n,) `labels` under the temperature-scaled logits of (n, H) `hidden`, and
    their (n,) entropy (with a graph only when `entropy_grad`) or an empty tensor."""
    logits = head(hidden).float() / temperature                                     # (n, V)
    lp = logprobs_from_logits(logits, labels)                                        # (n,)
    if not entropy:
        return lp, lp.new_empty(0)
    if entropy_grad:
        return lp, entropy_from_logits(logits)
    with torch.no_grad():
        return lp, entropy_from_logits(logits.detach())


def chunked_stats(head: torch.nn.Linear, hidden: torch.Tensor, labels: torch.Tensor, temperature: float,
                  entropy: bool = False, entropy_grad: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(N,) log-probs of (N,) `labels` and, when asked, their (N,) entropy, from (N, H) last hidden
    states, logit_chunks.LOGITS_CHUNK_BYTES of fp32 logits at a time. With grad, each chunk's logits are
    recomputed in the backward pass (so at most one chunk's are alive); labels must be valid ids
    (clamp ignored ones and mask their log-probs after)."""
    rows = logit_chunks.chunk_positions(head.out_features)
    lps, ents = [], []
    for start in range(0, hidden.size(0), rows):
        part = (head, hidden[start:start + rows], labels[start:start + rows], temperature, entropy, entropy_grad)
        if torch.is_grad_enabled() and hidden.requires_grad:
            lp, ent = checkpoint(_chunk_stats, *part, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(*part)
        lps.append(lp)
        ents.append(ent)
    return torch.cat(lps), (torch.cat(ents) if entropy else None)


def response_logprobs(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                      labels: torch.Tensor, temperature: float, entropy: bool = False,
                      entropy_grad: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(B, R) log pi(label_t) of the R = labels.size(1) response tokens that end (B, T) `input_ids`
    under the temperature-scaled distribution, and their (B, R) entropy when `entropy` (with a
    graph only when `entropy_grad`: logged, not trained on, otherwise). The logits are whole
    (`response_logits`) or chunked (the module doc)."""
    B, R = labels.shape
    head = chunked_head(model, B * R)
    if head is None:
        logits = response_logits(model, input_ids, attention_mask, position_ids, R, temperature)   # (B, R, V)
        return stats_from_logits(logits, labels, entropy, entropy_grad)
    extra = {"logits_to_keep": R + 1} if keeps_logits(model) else {}
    with hidden_out(head):
        hidden = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=False, **extra).logits[:, -(R + 1):-1]                                 # (B, R, H)
    lp, ent = chunked_stats(head, hidden.reshape(B * R, -1), labels.reshape(-1), temperature, entropy, entropy_grad)
    return lp.view(B, R), (ent.view(B, R) if ent is not None else None)


def stats_from_logits(logits: torch.Tensor, labels: torch.Tensor, entropy: bool,
                      entropy_grad: bool) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(...,) log-probs of `labels` under (..., V) `logits`, and their (...,) entropy when `entropy`
    (with a graph only when `entropy_grad`)."""
    lp = logprobs_from_logits(logits, labels)
    if not entropy:
        return lp, None
    if entropy_grad:
        return lp, entropy_from_logits(logits)
    with torch.no_grad():
        return lp, entropy_from_logits(logits.detach())


def keeps_logits_at(model) -> bool:
    """Whether the model's forward takes `logits_to_keep` as a tensor of positions: transformers'
    own classes do (slice_logits_to_keep); a class of remote code may take a count only."""
    return keeps_logits(model) and type(hf_model(model)).__module__.startswith("transformers.")


def packed_logprobs(model, input_ids: torch.Tensor, position_ids: torch.Tensor,
                    predicting: torch.Tensor) -> torch.Tensor:
    """(K,) log pi(input_ids[0, c + 1]) given its sequence up to column c, for each of the K columns
    c of `predicting`, in a packed (1, N) row (data.padding.pack: no attention mask, position ids
    restarting per sequence, so attention stays within each), temperature 1 (`packed_stats`)."""
    return packed_stats(model, input_ids, position_ids, predicting)[0]


def packed_stats(model, input_ids: torch.Tensor, position_ids: torch.Tensor, predicting: torch.Tensor,
                 temperature: float = 1.0, entropy: bool = False,
                 entropy_grad: bool = True) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(K,) log pi(input_ids[0, c + 1]) under the temperature-scaled distribution at each of the K
    columns c of `predicting` in a packed (1, N) row, and their (K,) entropy when `entropy` (with a
    graph only when `entropy_grad`), as `response_logprobs` gives them for padded rows. The LM head
    runs on those columns only where the model takes them (`keeps_logits_at`), and chunk by chunk
    above logit_chunks.LOGITS_CHUNK_BYTES."""
    labels = input_ids[0, predicting + 1]                                                           # (K,)
    at = keeps_logits_at(model)
    head = chunked_head(model, labels.numel())
    extra = {"logits_to_keep": predicting} if at else {}
    with hidden_out(head) if head is not None else contextlib.nullcontext():
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **extra).logits
    # out: (1, K) columns, or all N without `at`; V logits each, or H hidden states when chunked
    out = out[0] if at else out[0, predicting]                                                  # (K, V or H)
    if head is not None:
        return chunked_stats(head, out, labels, temperature, entropy, entropy_grad)
    return stats_from_logits(out.float() / temperature, labels, entropy, entropy_grad)         # (K, V) logits
