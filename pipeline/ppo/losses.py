"""PPO policy and value losses, and per-token quantities from logits.

Pure functions: tensors and floats in, a loss (or tensor) plus a dict of
detached float stats out. Shapes follow the vocabulary in
``pipeline/ppo/__init__.py``; ``response_mask`` (B, R) bool is True on real
response tokens.

Micro-batch accumulation: both losses take ``loss_denominator``. Left as None
the loss is the token mean over this batch's real tokens. Given the number of
real tokens in the whole minibatch, the loss is this micro-batch's token sum
over that count, so the micro-batch losses (and their gradients) add up to the
full-minibatch token mean exactly, however unevenly the tokens are split.
"""

from __future__ import annotations

import torch


from .advantages import _check_mask, masked_mean
from .group_advantages import AGGREGATIONS, loss_aggregation


def _token_mean(
    per_token: torch.Tensor,  # (B, R)
    response_mask: torch.Tensor,  # (B, R) bool
    loss_denominator: float | None,
) -> torch.Tensor:  # scalar
    """Token mean, or token sum / loss_denominator for micro-batch accumulation."""
    if loss_denominator is None:
        return masked_mean(per_token, response_mask)
    if loss_denominator <= 0:
        raise ValueError(f"loss_denominator must be > 0 (real tokens in the minibatch), got {loss_denominator}")
    return torch.where(response_mask, per_token, torch.zeros_like(per_token)).sum() / loss_denominator


def aggregate(
    per_token: torch.Tensor,  # (B, R) per-token loss of a micro-batch
    response_mask: torch.Tensor,  # (B, R) bool
    mode: str = "token_mean",   # a name in group_advantages.AGGREGATIONS
    loss_denominator: float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:  # scalar
    """A per-token loss reduced as ``mode`` says (group_advantages.loss_aggregation), such that the
    micro-batch losses of a minibatch add up to the minibatch's loss. ``loss_denominator`` counts
    what the mode averages over in the whole minibatch (its `counts`): real tokens for a mean over
    tokens (the token sum over it, as ``_token_mean``), responses for seq_mean and seq_sum_norm
    (this micro-batch's aggregate weighted by its share of the minibatch's responses,
    B / loss_denominator). None: this batch is the whole minibatch."""
    if AGGREGATIONS.facts(mode)["counts"] == "tokens":
        return _token_mean(per_token, response_mask, loss_denominator)
    loss = loss_aggregation(per_token, response_mask, mode, max_len)
    if loss_denominator is None:
        return loss
    if loss_denominator <= 0:
        raise ValueError(f"loss_denominator must be > 0 (responses in the minibatch), got {loss_denominator}")
    return loss * (response_mask.shape[0] / loss_denominator)


def _masked_float(x: torch.Tensor, mask: torch.Tensor) -> float:
    return masked_mean(x.detach().to(torch.float64), mask).item()


def policy_loss(
    logprobs: torch.Tensor,  # (B, R) log pi_theta(a_t|s_t), current policy, with grad
    old_logprobs: torch.Tensor,  # (B, R) log pi_old(a_t|s_t) at sampling time
    advantages: torch.Tensor,  # (B, R) from gae, usually whitened
    response_mask: torch.Tensor,  # (B, R) bool
    clip_eps: float,
    dual_clip: float | None = None,
    loss_denominator: float | None = None,
    tis_weights: torch.Tensor | None = None,  # (B, R) detached, from `truncated_is_weights`; None: off
    aggregation: str = "token_mean",   # a name in group_advantages.AGGREGATIONS
    max_len: int | None = None,   # the generation budget, for aggregation="seq_sum_norm"
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip surrogate loss (Schulman et al. 2017, eq. 7), as a loss to minimise.

    objective_t = min(rho_t A_t, clip(rho_t, 1 - eps, 1 + eps) A_t), rho_t = pi_theta / pi_old.
    The min is pessimistic: it caps the gain from moving further in the
    advantage's direction and never caps the correction of a mistake (seed 003 §3).

    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games", eq. 5):
    for A_t < 0, objective_t = max(objective_t, dual_clip * A_t) with dual_clip > 1.
    Plain PPO-clip is unbounded below when A_t < 0 and rho_t -> inf (the
    unclipped branch rho_t A_t wins the min); the floor bounds the loss of such
    a token by -dual_clip * A_t and zeroes its gradient once rho_t > dual_clip.

    Truncated importance sampling: with ``tis_weights`` each token's objective
    (after both clips) is multiplied by its weight, a constant (see ``truncated_is_weights``).

    The per-token objective is reduced by ``aggregate(..., aggregation, loss_denominator, max_len)``:
    the token mean by default, or a per-response reduction (GRPO, Dr. GRPO).

    Stats: policy/clipfrac counts tokens where the PPO-clip branch is taken
    (zero gradient); policy/dual_clipfrac the tokens held at the dual-clip floor.
    """
    _check_mask(response_mask, logprobs, old_logprobs, advantages)
    if not 0.0 < clip_eps < 1.0:
        raise ValueError(f"clip_eps must be in (0, 1), got {clip_eps}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise ValueError(f"dual_clip must be > 1 (Ye et al. 2020), got {dual_clip}")
    # Masking the log-ratio before exp keeps garbage log-probs on pads from
    # overflowing: exp(inf) on a pad would give a NaN gradient through where().
    log_ratio = torch.where(response_mask, logprobs - old_logprobs, torch.zeros_like(logprobs))
    ratio = torch.exp(log_ratio)
    surrogate = ratio * advantages
    surrogate_clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * advantages
    objective = torch.minimum(surrogate, surrogate_clipped)
    if dual_clip is not None:
        floor = dual_clip * advantages
        dual_clipped = (advantages < 0) & (objective < floor)
        objective = torch.where(advantages < 0, torch.maximum(objective, floor), objective)
    if tis_weights is not None:
        _check_mask(response_mask, tis_weights)
        objective = objective * tis_weights.detach()
    loss = aggregate(-objective, response_mask, aggregation, loss_denominator, max_len)

    with torch.no_grad():
        clipped = surrogate_clipped < surrogate  # min picked the clipped branch
        masked_ratio = torch.where(response_mask, ratio, torch.full_like(ratio, -torch.inf))
        stats = {
            # 0.5 E[(log rho)^2] (k2): TRL's approxkl, low variance, >= 0.
            "policy/approxkl": 0.5 * _masked_float(log_ratio**2, response_mask),
            # k1 estimate of KL(pi_old || pi_theta) from tokens sampled from pi_old.
            "policy/approxkl_k1": _masked_float(-log_ratio, response_mask),
            "policy/clipfrac": _masked_float(clipped.double(), response_mask),
            "val/ratio": _masked_float(ratio, response_mask),
            "val/ratio_max": masked_ratio.max().item() if response_mask.any() else float("nan"),
        }
        if dual_clip is not None:
            stats["policy/dual_clipfrac"] = _masked_float(dual_clipped.double(), response_mask)
    return loss, stats


def truncated_is_weights(
    old_logprobs: torch.Tensor,  # (B, R) log pi_old(a_t|s_t), recomputed by a training forward
    sampler_logprobs: torch.Tensor,  # (B, R) log pi_sampler(a_t|s_t), as the sampler computed it
    response_mask: torch.Tensor,  # (B, R) bool
    cap: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Truncated importance-sampling weights, (B, R), detached, 1 on pads:
    w_t = min(pi_old(a_t|s_t) / pi_sampler(a_t|s_t), cap) = min(exp(old - sampler), cap).

    The tokens were drawn from the sampler's distribution, but PPO's surrogate is an expectation
    under pi_old (the trainer's numbers for the same weights); w_t re-weights each token's policy
    loss to the trainer's distribution, and the cap bounds the variance a token whose sampler
    probability is tiny would add (Yao et al. 2025, "Your efficient RL framework secretly brings
    you off-policy RL training", token-level TIS; the same weight as verl's
    `compute_policy_loss_vanilla`, `tis_imp_ratio_cap`). Only an upper cap: a weight below 1 only
    shrinks a token's gradient.

    Stats: policy/tis_weight (mean weight after the cap), policy/tis_capfrac (tokens at the cap).
    """
    _check_mask(response_mask, old_logprobs, sampler_logprobs)
    if not cap > 1.0:
        raise ValueError(f"the TIS cap must be > 1 (a weight of 1 is no correction), got {cap}")
    log_w = torch.where(response_mask, old_logprobs.detach() - sampler_logprobs.detach(),
                        torch.zeros_like(old_logprobs))   # masked before exp: no overflow on pads
    raw = torch.exp(log_w)
    weights = raw.clamp(max=cap)
    stats = {"policy/tis_weight": _masked_float(weights, response_mask),
             "policy/tis_capfrac": _masked_float((raw > cap).double(), response_mask)}
    return weights, stats


def value_loss(
    values: torch.Tensor,  # (B, R) V_phi(s_t), current critic, with grad
    old_values: torch.Tensor,  # (B, R) V_phi_old(s_t) at rollout time
    returns: torch.Tensor,  # (B, R) targets from gae
    response_mask: torch.Tensor,  # (B, R) bool
    clip_eps_value: float | None,
    loss_denominator: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss, 0.5 * max((V - R)^2, (V_clip - R)^2), token mean
    (seed 000 §16.2.6; Schulman et al. 2017 baselines' ppo2).

    V_clip = V_old + clamp(V - V_old, -eps, eps). The max means a prediction
    that moved more than eps from V_old gets no credit for being closer to the
    return, so the critic cannot jump in one update. ``clip_eps_value=None``
    gives the plain 0.5 * (V - R)^2.
    """
    _check_mask(response_mask, values, old_values, returns)
    error = (values - returns) ** 2
    if clip_eps_value is None:
        per_token = 0.5 * error
        clipped = torch.zeros_like(response_mask)
    else:
        if clip_eps_value <= 0:
            raise ValueError(f"clip_eps_value must be > 0 or None, got {clip_eps_value}")
        values_clipped = old_values + torch.clamp(values - old_values, -clip_eps_value, clip_eps_value)
        error_clipped = (values_clipped - returns) ** 2
        per_token = 0.5 * torch.maximum(error, error_clipped)
        clipped = error_clipped > error  # max picked the clipped branch: zero gradient
    loss = _token_mean(per_token, response_mask, loss_denominator)
    stats = {
        "val/clipfrac": _masked_float(clipped.double(), response_mask),
        "val/vpred": _masked_float(values, response_mask),
        "val/error": _masked_float(error, response_mask),
    }
    return loss, stats

