"""Rewards, advantages and KL control for PPO on language models.

Pure functions: tensors and floats in, tensors plus a dict of detached float
stats out. Shapes follow the vocabulary in ``pipeline/ppo/__init__.py``.
Every per-token tensor is (B, R) and comes with ``response_mask`` (B, R) bool,
True on real response tokens; responses are right-padded, so each row of the
mask is a contiguous prefix of True followed by False.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..registries import Registry

# `ppo.kl_estimator`: single-sample estimators of KL(pi || pi_ref) from tokens sampled from pi, each
# a function of the per-token log r = log pi_ref - log pi (Schulman 2020, "Approximating KL divergence").
KL_ESTIMATORS = Registry("KL estimator")

# `ppo.advantage`: the advantage estimators, each declaring at registration what the trainer and the
# config need to know of it:
#   critic   True: it needs a critic and is called as (rewards, values, response_mask, **options),
#            each (B, R), -> (advantages, returns), each (B, R); the trainer builds, trains and
#            checkpoints a critic and writes the critic's step-log columns (trainer.CRITIC_COLUMNS).
#            False: it is called as (scores (B,), k, **options) -> (advantages (B,), stats), on each
#            response's summed reward, and its advantage goes to every token of the response.
#   group    its baseline is the other responses to the same prompt, so it needs samples_per_prompt >= 2.
#   options  keyword argument -> the params key of the section that sets it.
#   columns  the step-log columns its stats add: (name, meaning), as docs/metrics.md shows them.
ESTIMATORS = Registry("advantage estimator")


def _check_mask(mask: torch.Tensor, *tensors: torch.Tensor) -> None:
    """Fail early on the two mistakes that silently corrupt masked math:
    a float/int mask (wrong polarity or weights) and a shape mismatch."""
    if mask.dtype != torch.bool:
        raise TypeError(f"response_mask must be torch.bool, got {mask.dtype}")
    for t in tensors:
        if t.shape != mask.shape:
            raise ValueError(f"expected shape {tuple(mask.shape)} like response_mask, got {tuple(t.shape)}")


def _check_right_padded(mask: torch.Tensor) -> None:
    """Raise unless every row of ``mask`` (B, R) is a contiguous prefix of True.

    GAE and reward assembly treat the first False as the end of the episode;
    a True after a False (a hole, or left padding) would be silently mishandled.
    """
    if mask.shape[-1] > 1 and bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError("response_mask rows must be right-padded: True on a prefix, then only False")


def local(t: torch.Tensor) -> torch.Tensor:
    """The `reduce` of one process: its own sums are the batch's."""
    return t


def masked_mean(
    x: torch.Tensor,  # (B, R) any per-token quantity
    mask: torch.Tensor,  # (B, R) bool response_mask
    dim: int | None = None,
    reduce: Callable[[torch.Tensor], torch.Tensor] = local,
) -> torch.Tensor:
    """Mean of ``x`` over real tokens: a scalar, or per row/column along ``dim``.

    ``torch.where`` rather than ``x * mask`` so that inf/NaN garbage on pads
    cannot leak into the sum (0 * inf = NaN). Empty slices give 0, not NaN.
    ``reduce`` sums a tensor over processes (scalar means only): with the batch
    split across ranks, the mean is still over the whole batch's tokens.
    """
    total = torch.where(mask, x, torch.zeros_like(x)).sum(dim=dim)
    count = mask.sum(dim=dim)
    if reduce is not local and dim is None:
        both = reduce(torch.stack([total, count.to(total.dtype)]))
        total, count = both[0], both[1]
    return total / count.clamp_min(1)


def masked_var(
    x: torch.Tensor,  # (B, R)
    mask: torch.Tensor,  # (B, R) bool response_mask
    unbiased: bool = True,
    reduce: Callable[[torch.Tensor], torch.Tensor] = local,
) -> torch.Tensor:
    """Variance of ``x`` over all real tokens of the batch (a scalar)."""
    mean = masked_mean(x, mask, reduce=reduce)
    var = masked_mean((x - mean) ** 2, mask, reduce=reduce)
    if unbiased:
        n = int(reduce(mask.sum()))
        if n < 2:
            raise ValueError(f"unbiased masked variance needs at least 2 real tokens, got {n}")
        var = var * n / (n - 1)  # Bessel's correction
    return var


def masked_whiten(
    x: torch.Tensor,  # (B, R)
    mask: torch.Tensor,  # (B, R) bool response_mask
    shift_mean: bool = True,
    reduce: Callable[[torch.Tensor], torch.Tensor] = local,
) -> torch.Tensor:  # (B, R), zero on pads
    """Normalise ``x`` to mean 0, std 1 over real tokens of the whole batch.

    Used for advantage normalisation (seed 000 §16.2.5, step 2). With
    ``shift_mean=False`` the mean is restored after scaling, as TRL does when
    whitening rewards, so only the scale changes.
    """
    mean = masked_mean(x, mask, reduce=reduce)
    var = masked_var(x, mask, reduce=reduce)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)  # 1e-8: guard a constant batch
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, torch.zeros_like(whitened))


@KL_ESTIMATORS.register("k1")
def kl_k1(log_ratio: torch.Tensor) -> torch.Tensor:  # (B, R) log r -> (B, R)
    """k1 = -log r: unbiased, high variance, can be negative."""
    return -log_ratio


@KL_ESTIMATORS.register("k2")
def kl_k2(log_ratio: torch.Tensor) -> torch.Tensor:  # (B, R) log r -> (B, R)
    """k2 = 0.5 (log r)^2: biased, low variance, >= 0."""
    return 0.5 * log_ratio**2


@KL_ESTIMATORS.register("k3")
def kl_k3(log_ratio: torch.Tensor) -> torch.Tensor:  # (B, R) log r -> (B, R)
    """k3 = (r - 1) - log r: unbiased, low variance, >= 0 (seed 000 §16.2.7)."""
    return torch.expm1(log_ratio) - log_ratio  # expm1: exact near log r = 0


def kl_penalty(
    logprobs: torch.Tensor,  # (B, R) log pi(a_t|s_t) of the sampled tokens
    ref_logprobs: torch.Tensor,  # (B, R) log pi_ref(a_t|s_t) of the same tokens
    estimator: str,  # a name in KL_ESTIMATORS
) -> torch.Tensor:  # (B, R) per-token estimate of KL(pi || pi_ref); pads are not masked
    """The single-sample estimate of KL(pi || pi_ref) from tokens sampled from pi that
    `estimator` names (k1, k2, k3 above), of log r = logref - logp."""
    return KL_ESTIMATORS[estimator](ref_logprobs - logprobs)


def assemble_rewards(
    scores: torch.Tensor,  # (B,) reward-model score of each full response
    kl: torch.Tensor,  # (B, R) per-token KL estimate from kl_penalty
    response_mask: torch.Tensor,  # (B, R) bool, right-padded
    kl_coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token rewards: dense KL penalty plus the sparse score at the end.

    r_t = -kl_coef * KL_t + score * 1[t is the last real token]
    (Ziegler et al. 2019 §2.2; InstructGPT eq. 2; seed 000 §16.2.4). Zero on pads.
    Returns rewards (B, R) and stats.
    """
    _check_mask(response_mask, kl)
    _check_right_padded(response_mask)
    if scores.shape != response_mask.shape[:1]:
        raise ValueError(f"scores must have shape ({response_mask.shape[0]},), got {tuple(scores.shape)}")
    zeros = torch.zeros_like(kl)
    non_score = torch.where(response_mask, -kl_coef * kl, zeros)
    # The last real token is the one whose successor is a pad (or the end of
    # the row). One-hot per non-empty row, so no loop over samples is needed.
    next_is_pad = torch.ones_like(response_mask)
    next_is_pad[:, :-1] = ~response_mask[:, 1:]
    last_token = response_mask & next_is_pad
    rewards = non_score + torch.where(last_token, scores[:, None].to(kl.dtype), zeros)
    kl_per_seq = torch.where(response_mask, kl, zeros).sum(dim=1)
    non_score_per_seq = non_score.sum(dim=1)
    stats = {
        "objective/kl": kl_per_seq.mean().item(),
        "objective/non_score_reward": non_score_per_seq.mean().item(),
        "objective/scores": scores.detach().float().mean().item(),
        "objective/rlhf_reward": (non_score_per_seq + scores).mean().item(),
    }
    return rewards, stats


@ESTIMATORS.register("gae", critic=True, group=False, options={"gamma": "gamma", "lam": "lam"}, columns=())
@torch.no_grad()  # advantages and returns are fixed targets for the update
def gae(
    rewards: torch.Tensor,  # (B, R) per-token rewards from assemble_rewards
    values: torch.Tensor,  # (B, R) V(s_t) from the critic at rollout time
    response_mask: torch.Tensor,  # (B, R) bool, right-padded
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # advantages, returns: (B, R), zero on pads
    """Generalised advantage estimation along the response axis (Schulman et al. 2016).

    delta_t = r_t + gamma * V(s_{t+1}) - V(s_t);  A_t = delta_t + gamma * lam * A_{t+1}.
    Same values as seed 000's per-sample ``compute_gae_for_llm`` except that
    the state after the last real token is terminal (V = 0, A = 0) even when
    the row is padded; the seed bootstraps from the pad's value there.
    Assumes right-padded masks (checked). One loop over R, none over samples.
    """
    _check_mask(response_mask, rewards, values)
    _check_right_padded(response_mask)
    zeros = torch.zeros_like(values)
    # Zeroing pads makes V(s_{t+1}) = 0 and A_{t+1} = 0 past each row's end,
    # which is exactly the terminal condition.
    values = torch.where(response_mask, values, zeros)
    rewards = torch.where(response_mask, rewards, zeros)
    num_steps = values.shape[1]
    next_value = values.new_zeros(values.shape[0])  # (B,)
    next_advantage = values.new_zeros(values.shape[0])  # (B,)
    advantages_reversed = []
    for t in reversed(range(num_steps)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = torch.where(response_mask[:, t], delta + gamma * lam * next_advantage, 0.0)
        advantages_reversed.append(advantage)
        next_value, next_advantage = values[:, t], advantage
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = torch.where(response_mask, advantages + values, zeros)  # the critic's target
    return advantages, returns


# Below (ROUNDING_ULPS ulps of the largest return)^2, a variance of returns is rounding noise.
ROUNDING_ULPS = 16


def explained_variance(
    values: torch.Tensor,  # (B, R) critic predictions
    returns: torch.Tensor,  # (B, R) targets from gae
    mask: torch.Tensor,  # (B, R) bool response_mask
    reduce: Callable[[torch.Tensor], torch.Tensor] = local,
    largest: Callable[[float], float] = float,
) -> float:
    """1 - Var[returns - values] / Var[returns] over real tokens (CleanRL's
    ``explained_variance``): 1 is a perfect critic, 0 no better than a constant.
    NaN when the returns are constant up to rounding, since the ratio is then undefined: returns
    assembled in float32 (``(returns - values) + values``) keep a variance of rounding noise,
    about (eps * |returns|)^2, and dividing by it gave values near -1e33.
    With the batch split across ranks, ``reduce`` sums over them and ``largest`` takes the largest
    value of any rank, so every rank gets the whole batch's number."""
    _check_mask(mask, values, returns)
    var_returns = masked_var(returns, mask, unbiased=False, reduce=reduce)
    scale = largest(float(returns.abs().masked_fill(~mask, 0.0).max()) if mask.any() else 0.0)
    rounding = (ROUNDING_ULPS * torch.finfo(returns.dtype).eps * scale) ** 2
    if float(var_returns) <= rounding:
        return float("nan")
    return float(1.0 - masked_var(returns - values, mask, unbiased=False, reduce=reduce) / var_returns)


class AdaptiveKLController:
    """Adaptive KL coefficient (Ziegler et al. 2019, §2.2).

    e_t = clip(KL_t / target - 1, -0.2, 0.2);  beta <- beta * (1 + e_t * n_steps / horizon).
    The clip bounds each change so one noisy KL estimate cannot blow up beta.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: float) -> None:
        if init_kl_coef < 0 or target <= 0 or horizon <= 0:
            raise ValueError(
                f"need init_kl_coef >= 0, target > 0, horizon > 0; got {init_kl_coef}, {target}, {horizon}"
            )
        self.kl_coef = float(init_kl_coef)
        self.target = float(target)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> float:
        """Update from the KL measured over the last ``n_steps`` steps, in the horizon's unit (the PPO
        trainer's: iterations, one per call); returns the new kl_coef."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.kl_coef *= 1.0 + proportional_error * n_steps / self.horizon
        return self.kl_coef

    def state_dict(self) -> dict[str, float | str]:
        return {"kind": "adaptive", "kl_coef": self.kl_coef}

    def load_state_dict(self, state: dict[str, float | str]) -> None:
        _check_kind(state, "adaptive")
        self.kl_coef = float(state["kl_coef"])


class FixedKLController:
    """Constant KL coefficient; same interface as AdaptiveKLController."""

    def __init__(self, kl_coef: float) -> None:
        if kl_coef < 0:
            raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
        self.kl_coef = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> float:
        return self.kl_coef

    def state_dict(self) -> dict[str, float | str]:
        return {"kind": "fixed", "kl_coef": self.kl_coef}

    def load_state_dict(self, state: dict[str, float | str]) -> None:
        _check_kind(state, "fixed")
        self.kl_coef = float(state["kl_coef"])


def _check_kind(state: dict[str, float | str], expected: str) -> None:
    """Refuse to resume one controller kind from the other's checkpoint."""
    if state.get("kind") != expected or "kl_coef" not in state:
        raise ValueError(f"expected a {expected!r} KL controller state with 'kl_coef', got {state!r}")
