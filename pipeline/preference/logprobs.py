"""Per-sequence response log-probs of preference pairs, and the reference model's, cached once.

Layout: the rollout's (``pipeline/models/logprobs.py``): prompts left-padded, responses
right-padded, so the prompt is never gathered (its log-probs are not part of the sum) and the
numbers are the same gather PPO's reference log-probs and the evaluate stage's KL use. Chosen and
rejected go through one forward of 2N rows (each prompt twice), so a training step is one forward
and one backward, and each side sees the same padding of its prompt. Packed (`<stage>.packing`,
the training forwards only): the 2N sequences end to end in one row, no token of it padding.

The reference model's log-probs do not change during training: ``reference_logprobs`` computes
them once, without a graph, before the first step, so no second model is resident while the
policy trains: three models resident for the offline methods, not four.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..data.inputs import fit_lengths
from ..data.padding import left_pad, pack_responses, positions, right_pad
from ..data.preferences import Pair, check_distinct
from ..data.tokenizer import cut_prompt, encode_prompt, encode_response
from ..errors import DataError
from ..models.logprobs import packed_logprobs, response_logprobs


@dataclass(frozen=True)
class TokenPair:
    """One preference pair as token ids: the prompt as `encode_prompt` gives it, each response as
    `encode_response` gives it (eos included)."""
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]

    def __post_init__(self) -> None:
        if not self.prompt or not self.chosen or not self.rejected:
            raise ValueError("a preference pair needs a non-empty prompt, chosen and rejected response")

    @property
    def width(self) -> int:
        """Tokens of the longer of its two rows (prompt + response)."""
        return len(self.prompt) + max(len(self.chosen), len(self.rejected))

    @property
    def packed_width(self) -> int:
        """Tokens of its two sequences end to end (prompt + chosen, prompt + rejected)."""
        return 2 * len(self.prompt) + len(self.chosen) + len(self.rejected)


def fit_pairs(pairs: list[Pair], tok, max_length: int, overlong: str,
              section: str, distinct: bool = True) -> tuple[list[tuple[Pair, TokenPair]], int, int]:
    """Pairs as token ids, each with the pair it came from. One whose prompt + longer response
    exceeds `max_length` keeps both responses whole and its prompt's template and loses the left
    end of the user text (`truncate`, tokenizer.cut_prompt: the log-probs are of the whole
    responses, as the losses need), is left out (`drop`), or is an error naming it (`error`); a
    response that alone leaves no room for a prompt token is an error under `truncate`. Errors name
    `section`'s keys (`<section>.max_length`, `<section>.overlong`). With `distinct`, a pair whose
    responses tokenize alike is an error (data.preferences.check_distinct; KTO's examples are no
    pairs: their second response is another example's). Returns the kept pairs and how many were
    truncated and dropped."""
    encoded = [(p, encode_prompt(tok, p.prompt), encode_response(tok, p.chosen), encode_response(tok, p.rejected))
               for p in pairs]
    for pair, _, chosen, rejected in encoded if distinct else ():
        check_distinct(pair.where, chosen, rejected)
    kept, truncated, dropped = fit_lengths(encoded, lambda e: len(e[1]) + max(len(e[2]), len(e[3])),
                                           max_length, overlong, f"{section}.max_length", where=lambda e: e[0].where)
    out = []
    for pair, prompt, chosen, rejected in kept:
        room = max_length - max(len(chosen), len(rejected))
        if room < 1:
            raise DataError(f"{pair.where}: a response of {max(len(chosen), len(rejected))} tokens leaves no room "
                            f"for the prompt within {section}.max_length={max_length} ({section}.overlong: drop "
                            f"skips such pairs)")
        if not prompt:
            raise DataError(f"{pair.where}: the prompt encodes to no tokens")
        out.append((pair, TokenPair(cut_prompt(tok, pair.prompt, room, prompt), chosen, rejected)))
    return out, truncated, dropped


def sequence_logprobs(
    model,
    prompts: list[list[int]],
    responses: list[list[int]],
    pad_id: int,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # (B,) summed response log-probs, (B,) response lengths
    """Sum over each response's tokens of log pi(y_t | x, y_<t), with grad when the caller has
    it enabled. Temperature 1: these are the model's own probabilities, not a sampler's. Float32
    whatever the model's dtype (``response_logprobs`` upcasts the logits before the logsumexp).
    `packed`: the B sequences end to end in one row (`packed_sequence_logprobs`), the same sums up
    to floating-point rounding."""
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"need as many prompts as responses, at least one; got {len(prompts)} and {len(responses)}")
    if packed:
        return packed_sequence_logprobs(model, prompts, responses)
    device = next(model.parameters()).device
    p_ids, p_mask = left_pad(prompts, pad_id)  # (B, P)
    r_ids, r_mask = right_pad(responses, pad_id)  # (B, R)
    ids = torch.cat([p_ids, r_ids], 1).to(device)  # (B, T)
    mask = torch.cat([p_mask, r_mask], 1).to(device)  # (B, T) bool
    r_ids, r_mask = r_ids.to(device), r_mask.to(device)
    per_token, _ = response_logprobs(model, ids, mask.long(), positions(mask), r_ids, 1.0)  # (B, R)
    # where(), not a product: a pad's log-prob may be -inf, and 0 * -inf is NaN.
    summed = torch.where(r_mask, per_token, torch.zeros_like(per_token)).sum(1)  # (B,)
    return summed, r_mask.sum(1)


def packed_sequence_logprobs(
    model,
    prompts: list[list[int]],
    responses: list[list[int]],
) -> tuple[torch.Tensor, torch.Tensor]:  # (B,) summed response log-probs, (B,) response lengths
    """`sequence_logprobs` of prompt + response sequences packed end to end in one (1, N) row
    (data.padding.pack): no padding computed, attention within each sequence by its restarting
    position ids, and the LM head run only at the columns that predict a response token."""
    device = next(model.parameters()).device
    ids, pos, cols = pack_responses(prompts, responses)  # (1, N), (1, N), (K,): K = the responses' tokens
    per_token = packed_logprobs(model, ids.to(device), pos.to(device), cols.to(device))  # (K,)
    lengths = [len(r) for r in responses]
    summed = torch.stack([t.sum() for t in per_token.split(lengths)])  # (B,)
    return summed, torch.tensor(lengths, dtype=torch.long, device=device)


def pair_logprobs(
    model,
    pairs: list[TokenPair],
    pad_id: int,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # chosen (N,), rejected (N,): summed response log-probs
    """Chosen and rejected log-probs of N pairs in one forward of 2N rows, or (`packed`) of one
    row holding the 2N sequences, each pair's two side by side."""
    if packed:
        prompts = [p.prompt for p in pairs for _ in range(2)]
        responses = [r for p in pairs for r in (p.chosen, p.rejected)]
        summed, _ = sequence_logprobs(model, prompts, responses, pad_id, packed=True)  # (2N,)
        return summed[0::2], summed[1::2]
    prompts = [p.prompt for p in pairs] * 2
    responses = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    summed, _ = sequence_logprobs(model, prompts, responses, pad_id)  # (2N,)
    return summed[:len(pairs)], summed[len(pairs):]


def response_lengths(pairs: list[TokenPair]) -> tuple[torch.Tensor, torch.Tensor]:
    """(N,) int64 token counts of the chosen and of the rejected responses (SimPO, averaged IPO)."""
    return (torch.tensor([len(p.chosen) for p in pairs], dtype=torch.long, device="cpu"),
            torch.tensor([len(p.rejected) for p in pairs], dtype=torch.long, device="cpu"))


def _pad_id(model) -> int:
    pad_id = getattr(getattr(model, "config", None), "pad_token_id", None)
    if pad_id is None:
        raise ValueError("the model's config has no pad_token_id; pass pad_id")
    return int(pad_id)


@torch.no_grad()   # not inference_mode: see pipeline/ppo/scoring.py
def reference_logprobs(
    model,
    pairs: list[TokenPair],
    batch_size: int,
    pad_id: int | None = None,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # chosen (N,), rejected (N,): float32 on the CPU
    """The reference model's summed log-probs of every pair's chosen and rejected response, once,
    before training: no graph, no grad, the model put in eval mode for the pass
    (dropout off, as a frozen reference must be) and its previous mode restored. ``pad_id``
    defaults to the model config's; its value never changes a result (pads are masked). `packed`:
    each batch's sequences in one packed row (`pair_logprobs`)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not pairs:
        raise ValueError("no preference pairs to score")
    pad_id = _pad_id(model) if pad_id is None else pad_id
    was_training = model.training
    model.eval()
    try:
        chosen, rejected = [], []
        for start in range(0, len(pairs), batch_size):
            c, r = pair_logprobs(model, pairs[start:start + batch_size], pad_id, packed)  # (n,), (n,)
            chosen.append(c.cpu())
            rejected.append(r.cpu())
    finally:
        model.train(was_training)
    return torch.cat(chosen), torch.cat(rejected)
