"""Step 2 of a PPO iteration: one forward pass per model over the rollout.

Actor log-probs (the `old_logprobs` every ratio is taken against), reference log-probs, critic
values (none without a critic) and sequence scores. Log-probs use the sampling temperature (logits / T), exactly as the
update does, so the ratio is 1 at the first minibatch.

The update's forwards are these functions too. Over padded rows, or with `ppo.packing` over one
packed row per micro-batch (`packed_rollout`) in scoring and update alike: the same numbers up to
rounding, with no forward computing a padding token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..data.padding import unpack
from ..models import logprobs
from ..models import reward_model as rm
from ..models.reward_source import RewardSource
from .mismatch import logprob_diff
from .rollout import Rollout

if TYPE_CHECKING:   # annotations only (pipeline/models/checkpoints.py says why)
    from transformers import PreTrainedModel

    from .quantile_reward import ReferenceScores


def policy_logprobs(model: PreTrainedModel, ro: Rollout, temperature: float, with_entropy: bool = False,
                    entropy_grad: bool = True,
                    packed: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, R) log pi(a_t|s_t) of the response tokens, and (B, R) entropy when asked (without a
    graph when `entropy_grad` is False: logged, not trained on). `packed`: from one packed row
    (`packed_rollout`), zero on padding; the same numbers up to floating-point rounding."""
    if not packed:
        return logprobs.response_logprobs(model, ro.input_ids, ro.attention_mask, ro.position_ids,
                                          ro.input_ids[:, ro.n_prompt:], temperature, with_entropy,
                                          entropy_grad)
    ids, pos, predicting = packed_rollout(ro)
    lp, ent = logprobs.packed_stats(model, ids, pos, predicting, temperature, with_entropy, entropy_grad)
    return unpack(lp, ro.response_mask), (unpack(ent, ro.response_mask) if ent is not None else None)


def critic_values(critic: PreTrainedModel, ro: Rollout, packed: bool = False) -> torch.Tensor:
    """(B, R) V(s_t): the value head on the state that precedes response token t (`packed`: from
    one packed row, zero on padding).

    A critic initialised from the reward model keeps its normalisation offset, so its first
    values are on the same scale as the (normalised) scores they predict."""
    if packed:
        ids, pos, predicting = packed_rollout(ro)
        hidden = rm.hidden_states(critic, ids, None, pos)[0, predicting]      # (K, H)
        return unpack(rm.head(critic)(hidden).squeeze(-1).float() - rm.offset(critic), ro.response_mask)
    hidden = rm.hidden_states(critic, ro.input_ids, ro.attention_mask)     # (B, T, H)
    return rm.head(critic)(hidden[:, ro.n_prompt - 1:-1]).squeeze(-1).float() - rm.offset(critic)


def packed_rollout(ro: Rollout) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows of `ro` end to end in one row, the row data.padding.pack makes of each rollout's
    prompt and response (its real tokens, in order): (1, N) ids and (1, N) position ids restarting
    at each rollout (so attention stays within it), N the real tokens; and the (K,) columns whose
    logits predict each real response token, K = response_mask.sum(), in the row-major order of
    `response_mask` (`unpack`). Built on the rollout's device (the boolean selections read their
    sizes from it once)."""
    real = ro.attention_mask.bool()                          # (B, T) the prompt's mask, then the response's
    flat = real.flatten().long().cumsum(0).view_as(real) - 1  # (B, T) each real token's column in the row
    predicting = flat[:, ro.n_prompt:][ro.response_mask] - 1  # (K,) the column before each response token
    return ro.input_ids[real][None], ro.position_ids[real][None], predicting


def length_sorted_chunks(mask: torch.Tensor, rows: torch.Tensor, size: int) -> list[torch.Tensor]:
    """`rows` split into chunks of `size`, longest responses first, so each chunk is padded only to
    its own longest response (with `Rollout.select(trim=True)`). Which rows share a chunk changes
    only the order of summation, never a result."""
    lengths = mask[rows].sum(1)
    order = rows[torch.argsort(lengths, descending=True, stable=True)]
    return list(order.split(size))


def update_chunks(mask: torch.Tensor, rows: torch.Tensor, size: int, prompt_lengths: torch.Tensor,
                  budget: int | None) -> list[torch.Tensor]:
    """The update's micro-batches of `rows`: `length_sorted_chunks` of `size` rows, or with a token
    `budget` (distributed.max_tokens_per_micro_batch) as many rows, longest response first, as keep
    the micro-batch's padded size within it: rows x (its longest prompt + its longest response),
    the columns `Rollout.select(trim=True)` keeps of left-padded prompts and right-padded responses.
    A row over the budget alone is a micro-batch of its own. `prompt_lengths`: (B,) real prompt
    tokens of every row of the rollout."""
    if budget is None:
        return length_sorted_chunks(mask, rows, size)
    order = rows[torch.argsort(mask[rows].sum(1), descending=True, stable=True)]   # (N,) longest response first
    responses, prompts = mask[order].sum(1).tolist(), prompt_lengths[order].tolist()
    parts: list[list[int]] = []
    widest = longest = 0                # the open micro-batch's longest prompt and response
    for k, (p, r) in enumerate(zip(prompts, responses)):
        p, r = max(p, 1), max(r, 1)     # select(trim=True) keeps a column of each at least
        if parts and (len(parts[-1]) + 1) * (max(widest, p) + longest) <= budget:
            parts[-1].append(k)
            widest = max(widest, p)
        else:
            parts.append([k])
            widest, longest = p, r      # the first row's response is the micro-batch's longest
    return [order[torch.tensor(part, device=rows.device)] for part in parts]


@dataclass
class Scored:
    """What step 2 adds to a rollout."""
    old_logprobs: torch.Tensor   # (B, R) log pi_old(a_t|s_t), the actor at sampling time
    ref_logprobs: torch.Tensor   # (B, R) log pi_ref(a_t|s_t)
    values: torch.Tensor | None  # (B, R) V_old(s_t), the critic at sampling time; None: no critic
    scores: torch.Tensor         # (B,) sequence scores after the missing-eos rule and clipping
    raw_scores: torch.Tensor     # (B,) scores as the reward source gave them
    mismatch: dict[str, float]   # val/logprob_diff_{mean,max}: sampler vs training forward (mismatch.py)


# no_grad, not inference_mode: under ZeRO-3 these forwards gather parameters into buffers that
# training forwards reuse, and inference tensors must never reach autograd.
@torch.no_grad()
def score_rollout(actor: PreTrainedModel, ref: PreTrainedModel, critic: PreTrainedModel | None, reward: RewardSource,
                  ro: Rollout, temperature: float, micro_batch_size: int,
                  missing_eos_score: float | None, score_clip: float | None,
                  recompute_logprobs: bool = False, check_rows: int = 0, packed: bool = False,
                  quantiles: ReferenceScores | None = None) -> Scored:
    """Run the models over `ro` in micro-batches (bounded memory). The actor's log-probs are the
    ones the sampler computed (its forward passes *are* the actor's pass over the rollout), unless
    `recompute_logprobs`. Micro-batches take rows of similar length and drop all-padding columns.

    The sampler/trainer difference is measured either way: over every row when recomputing (free:
    both are at hand), else over the first `check_rows` rows by one extra training forward (the
    prompts are a random draw already, so the first rows are a random sample; no generator is
    touched). That forward's log-probs are only measured, never used.

    `packed`: each micro-batch's forwards over one packed row (`packed_rollout`); the reward
    source packs its own forwards when it was built to (RewardModelSource's `packed`).
    `quantiles`: the scores become their log CDF among the SFT policy's scores on each prompt
    (`ppo.quantile_reward_samples`); `raw_scores` stay the reward source's."""
    B, R = ro.response_mask.shape
    mask = ro.response_mask
    recompute = recompute_logprobs or ro.logprobs is None
    names = ("old", "ref", "values") if critic is not None else ("old", "ref")
    out = {k: torch.zeros(B, R, device=mask.device) for k in names}
    for idx in length_sorted_chunks(mask, torch.arange(B, device=mask.device), micro_batch_size):
        mb = ro.select(idx, trim=True)
        r = mb.response_mask.size(1)
        if recompute:
            out["old"][idx, :r] = policy_logprobs(actor, mb, temperature, packed=packed)[0]
        out["ref"][idx, :r] = policy_logprobs(ref, mb, temperature, packed=packed)[0]
        if critic is not None:
            out["values"][idx, :r] = critic_values(critic, mb, packed=packed)
    if not recompute:
        out["old"] = ro.logprobs.float()
    old, refp = (out[k].masked_fill(~mask, 0.0) for k in ("old", "ref"))
    values = out["values"].masked_fill(~mask, 0.0) if critic is not None else None
    mismatch = {}
    if ro.logprobs is not None and recompute:
        mismatch = logprob_diff(ro.logprobs.float(), old, mask)
    elif ro.logprobs is not None and check_rows > 0:
        mismatch = sampler_trainer_diff(actor, ro, temperature, micro_batch_size, min(check_rows, B), packed)
    # A reward function scores on the CPU, a reward model where it lives: the scores join the rollout's device.
    raw = reward.score(ro.prompts, ro.responses).float().to(mask.device)
    scores = shaped_scores(raw, ro.ended, missing_eos_score, score_clip)
    if quantiles is not None:   # the score's place among SFT's on the prompt (quantile_reward.py)
        scores = quantiles.log_cdf(ro.prompts, scores)
    return Scored(old, refp, values, scores, raw, mismatch)


def shaped_scores(raw: torch.Tensor, ended: torch.Tensor, missing_eos_score: float | None,
                  score_clip: float | None) -> torch.Tensor:
    """(B,) sequence scores from the (B,) `raw` ones and (B,) bool `ended`: the missing-eos rule, then
    the clip."""
    scores = raw.clone()
    if missing_eos_score is not None:
        # The "EOS trick" (Huang et al. 2024, N+ details): a response cut off by the length limit
        # gets a fixed low score, so the policy learns to finish instead of rambling.
        scores = torch.where(ended, scores, torch.full_like(scores, missing_eos_score))
    if score_clip is not None:
        scores = scores.clamp(-score_clip, score_clip)
    return scores


@torch.no_grad()
def sampler_trainer_diff(actor: PreTrainedModel, ro: Rollout, temperature: float, micro_batch_size: int,
                         n_rows: int, packed: bool = False) -> dict[str, float]:
    """val/logprob_diff_{mean,max} over the first `n_rows` rows of `ro`: the sampler's log-probs
    against a training forward's, in micro-batches laid out as scoring lays them out (`packed`:
    one packed row each)."""
    rows = torch.arange(n_rows, device=ro.response_mask.device)
    trainer = torch.zeros(n_rows, ro.response_mask.size(1), device=ro.response_mask.device)
    for idx in length_sorted_chunks(ro.response_mask, rows, micro_batch_size):
        mb = ro.select(idx, trim=True)
        trainer[idx, :mb.response_mask.size(1)] = policy_logprobs(actor, mb, temperature, packed=packed)[0]
    return logprob_diff(ro.logprobs[rows].float(), trainer, ro.response_mask[rows])
