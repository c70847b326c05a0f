"""Step 2 of a PPO iteration: one forward pass per model over the rollout.

Actor log-probs (the `old_logprobs` every ratio is taken against), reference log-probs, critic
values and sequence scores. Log-probs use the sampling temperature (logits / T), exactly as the
update does, so the ratio is 1 at the first minibatch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from .. import reward_model as rm
from ..reward_source import RewardSource
from .losses import entropy_from_logits, logprobs_from_logits
from .rollout import Rollout


def response_logits(model: PreTrainedModel, ro: Rollout, temperature: float) -> torch.Tensor:
    """(B, R, V) temperature-scaled logits that predict each response token."""
    logits = model(input_ids=ro.input_ids, attention_mask=ro.attention_mask,
                   position_ids=ro.position_ids).logits                     # (B, T, V)
    return logits[:, ro.n_prompt - 1:-1].float() / temperature


def policy_logprobs(model: PreTrainedModel, ro: Rollout, temperature: float,
                    with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(B, R) log pi(a_t|s_t) of the response tokens, and (B, R) entropy when asked."""
    logits = response_logits(model, ro, temperature)
    labels = ro.input_ids[:, ro.n_prompt:]
    logprobs = logprobs_from_logits(logits, labels)
    return logprobs, (entropy_from_logits(logits) if with_entropy else None)


def critic_values(critic: PreTrainedModel, ro: Rollout) -> torch.Tensor:
    """(B, R) V(s_t): the value head on the state that precedes response token t.

    A critic initialised from the reward model keeps its normalisation offset, so its first
    values are on the same scale as the (normalised) scores they predict."""
    hidden = rm.hidden_states(critic, ro.input_ids, ro.attention_mask)     # (B, T, H)
    return rm.head(critic)(hidden[:, ro.n_prompt - 1:-1]).squeeze(-1).float() - rm.offset(critic)


@dataclass
class Scored:
    """What step 2 adds to a rollout."""
    old_logprobs: torch.Tensor   # (B, R) log pi_old(a_t|s_t), the actor at sampling time
    ref_logprobs: torch.Tensor   # (B, R) log pi_ref(a_t|s_t)
    values: torch.Tensor         # (B, R) V_old(s_t), the critic at sampling time
    scores: torch.Tensor         # (B,) sequence scores after the missing-eos rule and clipping
    raw_scores: torch.Tensor     # (B,) scores as the reward source gave them


# no_grad, not inference_mode: under ZeRO-3 these forwards gather parameters into buffers that
# training forwards reuse, and inference tensors must never reach autograd.
@torch.no_grad()
def score_rollout(actor: PreTrainedModel, ref: PreTrainedModel, critic: PreTrainedModel, reward: RewardSource,
                  ro: Rollout, temperature: float, micro_batch_size: int,
                  missing_eos_score: float | None, score_clip: float | None) -> Scored:
    """Run the four models over `ro` in micro-batches (bounded memory)."""
    parts: dict[str, list[torch.Tensor]] = {"old": [], "ref": [], "values": []}
    for start in range(0, len(ro.prompts), micro_batch_size):
        mb = ro.select(torch.arange(start, min(start + micro_batch_size, len(ro.prompts))))
        parts["old"].append(policy_logprobs(actor, mb, temperature)[0])
        parts["ref"].append(policy_logprobs(ref, mb, temperature)[0])
        parts["values"].append(critic_values(critic, mb))
    mask = ro.response_mask
    old, refp, values = (torch.cat(parts[k]).masked_fill(~mask, 0.0) for k in ("old", "ref", "values"))
    raw = reward.score(ro.prompts, ro.responses).float()
    scores = raw.clone()
    if missing_eos_score is not None:
        # The "EOS trick" (Huang et al. 2024, N+ details): a response cut off by the length limit
        # gets a fixed low score, so the policy learns to finish instead of rambling.
        scores = torch.where(ro.ended, scores, torch.full_like(scores, missing_eos_score))
    if score_clip is not None:
        scores = scores.clamp(-score_clip, score_clip)
    return Scored(old, refp, values, scores, raw)
