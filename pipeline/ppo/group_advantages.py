"""Group advantages for critic-free online RL: GRPO, Dr. GRPO, RLOO, REINFORCE++ with baseline,
registered as advantage estimators (advantages.ESTIMATORS); the loss aggregations (AGGREGATIONS).

Pure functions on per-sequence scores; per-token helpers take ``response_mask`` (B, R) bool as in
advantages.py (whose masked means they reuse).
"""

from __future__ import annotations

import torch

from ..registries import Registry
from .advantages import ESTIMATORS, _check_mask

# ---------------------------------------------------------------------------------------------
# Group advantages for critic-free online RL (GRPO, Dr. GRPO, RLOO, REINFORCE++ with baseline).
#
# The rollout samples k responses per prompt; the k rows of a prompt are consecutive, so a batch
# of B = n_prompts * k scores reshapes to (n_prompts, k). Each estimator turns the per-sequence
# scores (B,) into per-sequence advantages (B,): the same value for every token of a response
# (`broadcast_to_tokens`), since the score arrives once, at the end, and no critic estimates the
# value of the tokens in between. k = 1 is refused by every estimator: the baseline of a response
# is built from the other responses to its prompt, and with one response there are none (GRPO and
# REINFORCE++ would give every response exactly 0, RLOO would divide by k - 1 = 0).


def _groups(
    scores: torch.Tensor,  # (B,) per-sequence scores, B = n_prompts * k, a prompt's k rows consecutive
    k: int,
) -> torch.Tensor:  # (n_prompts, k)
    """The scores as one row per prompt, after checking the shape and k."""
    if scores.dim() != 1:
        raise ValueError(f"scores must be (B,) per-sequence scores, got shape {tuple(scores.shape)}")
    if k < 2:
        raise ValueError(f"samples per prompt k must be >= 2 for a group baseline, got k={k}: "
                         "with one response per prompt there is no other response to compare it with")
    if scores.shape[0] == 0 or scores.shape[0] % k:
        raise ValueError(f"B = {scores.shape[0]} scores is not a positive multiple of k = {k} samples per prompt")
    return scores.reshape(-1, k)


def _exact_zero_on_ties(
    groups: torch.Tensor,  # (n_prompts, k) scores
    advantages: torch.Tensor,  # (n_prompts, k)
) -> torch.Tensor:  # (n_prompts, k), exactly 0 on groups whose scores are all equal
    """A group of equal scores carries no signal, but its rounded mean differs from the scores by
    up to an ulp; GRPO divides that residue by (std + eps) with std of the same order, which turns
    it into an advantage of about ulp / eps (up to 0.3 in float32 with eps 1e-6 for scores in
    [0, 5], measured), the same sign for every response of the group. Zeroing such groups exactly removes it."""
    tied = (groups == groups[:, :1]).all(dim=1, keepdim=True)  # (n_prompts, 1)
    return torch.where(tied, torch.zeros_like(advantages), advantages)


@ESTIMATORS.register("grpo", critic=False, group=True, options={"scale": "grpo_scale"}, columns=(
    ("objective/group_std", "mean within-group standard deviation of the sequence rewards (k responses to one "
                            "prompt)"),
    ("objective/zero_std_frac", "fraction of groups whose k rewards are all equal (zero advantage, no gradient)"),
))
@torch.no_grad()  # advantages are fixed targets for the update
def grpo_advantages(
    scores: torch.Tensor,  # (B,) per-sequence scores, B = n_prompts * k
    k: int,
    scale: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, dict[str, float]]:  # (B,) per-sequence advantages, stats
    """GRPO's group-relative advantage (Shao et al. 2024, "DeepSeekMath", §4.1.2, outcome
    supervision): A_i = (r_i - mean(group)) / (std(group) + eps), std with Bessel's correction
    (torch's default, as TRL's GRPOTrainer computes it).

    ``scale=False`` is Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"):
    A_i = r_i - mean(group). Dividing by the group std up-weights prompts whose responses score
    nearly alike (too easy or too hard), a difficulty bias. Dr. GRPO removes a second bias in the
    loss, not here: GRPO averages each response's token losses over its own length before
    averaging over responses, which shrinks the per-token gradient of long responses (so long
    wrong answers are penalised less); Dr. GRPO sums token losses and divides by a constant
    (``loss_aggregation(..., "seq_sum_norm", max_len)``), the same for every response.

    A group whose scores are all equal gets advantage exactly 0 (no NaN, no rounding residue).
    Stats: ``objective/group_std`` mean within-group std, ``objective/zero_std_frac`` the fraction
    of groups with no spread (they contribute no policy gradient).
    """
    groups = _groups(scores, k)  # (n_prompts, k)
    if not eps > 0:
        raise ValueError(f"eps must be > 0 (it guards groups of equal scores), got {eps}")
    centred = groups - groups.mean(dim=1, keepdim=True)  # (n_prompts, k)
    std = groups.std(dim=1, keepdim=True)  # (n_prompts, 1) unbiased
    advantages = _exact_zero_on_ties(groups, centred / (std + eps) if scale else centred)
    stats = {"objective/group_std": std.double().mean().item(),
             "objective/zero_std_frac": (groups == groups[:, :1]).all(dim=1).double().mean().item()}
    return advantages.reshape(-1), stats


@ESTIMATORS.register("rloo", critic=False, group=True, options={}, columns=(
    ("objective/baseline", "mean leave-one-out baseline (the other k - 1 responses' mean reward)"),
))
@torch.no_grad()
def rloo_advantages(
    scores: torch.Tensor,  # (B,) per-sequence scores, B = n_prompts * k
    k: int,
) -> tuple[torch.Tensor, dict[str, float]]:  # (B,) per-sequence advantages, stats
    """REINFORCE leave-one-out (Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization
    for Learning from Human Feedback in LLMs"; Kool et al. 2019):
    A_i = r_i - mean_{j != i} r_j, the baseline of each response the mean of the other k - 1
    responses to its prompt. The baseline does not depend on r_i, so the estimator stays unbiased;
    it equals k / (k - 1) times the group-mean-centred score, computed here as
    r_i - (sum_j r_j - r_i) / (k - 1)."""
    groups = _groups(scores, k)  # (n_prompts, k)
    baseline = (groups.sum(dim=1, keepdim=True) - groups) / (k - 1)  # (n_prompts, k)
    advantages = _exact_zero_on_ties(groups, groups - baseline)
    return advantages.reshape(-1), {"objective/baseline": baseline.double().mean().item()}


@ESTIMATORS.register("reinforce_baseline", critic=False, group=True, options={}, columns=(
    ("objective/batch_std", "standard deviation of the baselined rewards over the batch"),
))
@torch.no_grad()
def reinforce_baseline_advantages(
    scores: torch.Tensor,  # (B,) per-sequence scores, B = n_prompts * k
    k: int,
) -> tuple[torch.Tensor, dict[str, float]]:  # (B,) per-sequence advantages, stats
    """REINFORCE++ with baseline (Hu 2025, "REINFORCE++"; OpenRLHF's ``reinforce_baseline``
    estimator): subtract the group mean, then divide by the std of the whole batch,
    A_i = c_i / sqrt(var_batch(c) + 1e-8), c_i = r_i - mean(group of i).

    The batch std (not the group's) keeps the scale of the update comparable across steps without
    GRPO's per-prompt difficulty weighting. The variance is the population one with 1e-8 inside
    the root, as OpenRLHF's normalisation; the batch mean of c is 0 by construction, so
    re-centring is a no-op. OpenRLHF whitens after broadcasting to tokens (every real token one
    sample, so long responses weigh more in the std); at the sequence level used here every
    response weighs the same. A batch of all-equal groups gives 0, not NaN.
    """
    groups = _groups(scores, k)  # (n_prompts, k)
    centred = _exact_zero_on_ties(groups, groups - groups.mean(dim=1, keepdim=True)).reshape(-1)  # (B,)
    var = (centred - centred.mean()).pow(2).mean()
    advantages = centred * torch.rsqrt(var + 1e-8)
    return advantages, {"objective/batch_std": var.sqrt().item()}


def broadcast_to_tokens(
    advantages: torch.Tensor,  # (B,) per-sequence advantages
    response_mask: torch.Tensor,  # (B, R) bool, right-padded
) -> torch.Tensor:  # (B, R) each response's advantage on its real tokens, zero on pads
    """Every token of a response gets its sequence's advantage (outcome supervision)."""
    if response_mask.dtype != torch.bool:
        raise TypeError(f"response_mask must be torch.bool, got {response_mask.dtype}")
    if advantages.shape != response_mask.shape[:1]:
        raise ValueError(f"advantages must have shape ({response_mask.shape[0]},), got {tuple(advantages.shape)}")
    return torch.where(response_mask, advantages[:, None], torch.zeros((), dtype=advantages.dtype, device=advantages.device))


# `ppo.loss_aggregation`: how a per-token loss becomes the scalar minimised; the methods differ
# here, not in the per-token loss. Each is called as (masked (B, R) per-token loss, zero on pads,
# response_mask (B, R), max_len) -> scalar and declares what it averages over, `counts`, so that
# losses.aggregate splits it over micro-batches exactly: "tokens" (the token mean: a micro-batch's
# token sum over the minibatch's real tokens) or "responses" (a micro-batch's aggregate weighted by
# its share of the minibatch's responses).
AGGREGATIONS = Registry("loss aggregation")


@AGGREGATIONS.register("token_mean", counts="tokens")
def token_mean(masked: torch.Tensor, response_mask: torch.Tensor, max_len: int | None) -> torch.Tensor:
    """Sum over all real tokens / their number (PPO as this project trains it, DAPO's token-level
    loss): every token weighs the same, so long responses weigh more."""
    return masked.sum() / response_mask.sum().clamp_min(1)


@AGGREGATIONS.register("seq_mean", counts="responses")
def seq_mean(masked: torch.Tensor, response_mask: torch.Tensor, max_len: int | None) -> torch.Tensor:
    """Mean over responses of each response's token mean (GRPO as published): every response
    weighs the same, so a token of a long response weighs less. A response with no real token
    contributes 0."""
    per_seq = masked.sum(dim=1) / response_mask.sum(dim=1).clamp_min(1)  # (B,)
    return per_seq.mean()


@AGGREGATIONS.register("seq_sum_norm", counts="responses")
def seq_sum_norm(masked: torch.Tensor, response_mask: torch.Tensor, max_len: int | None) -> torch.Tensor:
    """Sum over real tokens / (B * max_len), a constant (Dr. GRPO, Liu et al. 2025): no length
    normalisation at all. ``max_len`` is the generation budget (``max_new_tokens``), not this
    batch's padded width, so the normaliser is the same for every batch; required, and at least R."""
    if max_len is None or max_len < response_mask.shape[1]:
        raise ValueError(f"seq_sum_norm needs max_len (the generation budget) >= R = {response_mask.shape[1]}, "
                         f"got {max_len}")
    return masked.sum() / (response_mask.shape[0] * max_len)


def loss_aggregation(
    per_token: torch.Tensor,  # (B, R) per-token loss, e.g. -objective_t of the clipped surrogate
    response_mask: torch.Tensor,  # (B, R) bool
    mode: str,  # a name in AGGREGATIONS
    max_len: int | None = None,
) -> torch.Tensor:  # scalar
    """Reduce a per-token loss to a scalar as the aggregation `mode` names (token_mean, seq_mean,
    seq_sum_norm above); garbage on pads never reaches it."""
    reduce = AGGREGATIONS[mode]
    _check_mask(response_mask, per_token)
    masked = torch.where(response_mask, per_token, torch.zeros_like(per_token))  # (B, R)
    return reduce(masked, response_mask, max_len)


def sequence_rewards(
    rewards: torch.Tensor,  # (B, R) per-token rewards from advantages.assemble_rewards
    response_mask: torch.Tensor,  # (B, R) bool
) -> torch.Tensor:  # (B,) each response's total reward
    """The sequence score with the KL-in-reward penalty summed over the response:
    score - kl_coef * sum_t KL_t, the quantity the group baseline is taken of. verl does the same
    for GRPO/RLOO with `use_kl_in_reward` (token-level rewards summed, then grouped); OpenRLHF instead
    takes the baseline of the bare score and adds the KL per token as a return-to-go."""
    _check_mask(response_mask, rewards)
    return torch.where(response_mask, rewards, torch.zeros_like(rewards)).sum(dim=1)
