"""Offline preference losses on per-sequence response log-probs: DPO (with conservative label
smoothing), IPO and the reference-free SimPO.

Pure functions: tensors and floats in, a scalar loss (the mean over pairs) plus a dict of detached
float stats out. Inputs are (N,) per-sequence log-probs from ``pipeline.preference.logprobs``:
``logp_*`` with grad (the policy being trained), ``ref_*`` constants (the frozen reference,
computed once before training).

Why SimPO as the reference-free variant, not ORPO: SimPO needs nothing but the policy's own
per-sequence log-probs and lengths, the same inputs DPO already computes, so no reference pass and
no second model at all; its only extra knob is a target margin. ORPO's odds-ratio term is built
from the per-token mean probability (odds = p / (1 - p) of the length-normalised likelihood), so
it needs per-token probabilities, and it is added to an SFT negative log-likelihood term whose
weight has to be balanced against the preference term on every new dataset.

Stats (same names for every loss, so a run's table compares methods): ``loss``;
``rewards/chosen``, ``rewards/rejected`` the mean implicit rewards (beta * (logp - ref) for
DPO/IPO, beta * logp / |y| for SimPO); ``rewards/accuracy`` the fraction of pairs whose chosen
reward exceeds the rejected one; ``rewards/margin`` the mean of chosen minus rejected reward;
``logps/chosen``, ``logps/rejected`` the mean policy log-probs themselves (summed over tokens).
The last two expose the known DPO failure where both chosen and rejected log-probs drift down
while the margin still grows (Pal et al. 2024, "Smaug: Fixing Failure Modes of Preference
Optimisation with DPO-Positive").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _check_pairs(**tensors: torch.Tensor) -> int:
    """All inputs (N,) with the same N >= 1; returns N. Catches a (N, R) per-token tensor passed
    where a per-sequence sum was meant, which would otherwise broadcast silently."""
    n = None
    for name, t in tensors.items():
        if t.dim() != 1:
            raise ValueError(f"{name} must be (N,) per-sequence log-probs, got shape {tuple(t.shape)}")
        if n is None:
            n = t.shape[0]
        elif t.shape[0] != n:
            raise ValueError(f"{name} has {t.shape[0]} pairs, expected {n} like the others")
    if not n:
        raise ValueError("a preference batch needs at least one pair")
    return n


def _check_lengths(logp: torch.Tensor, lengths: torch.Tensor, name: str) -> torch.Tensor:
    """Response lengths (N,) > 0, as the log-probs' dtype (for division)."""
    if lengths.shape != logp.shape:
        raise ValueError(f"{name} must have shape {tuple(logp.shape)}, got {tuple(lengths.shape)}")
    if bool((lengths <= 0).any()):
        raise ValueError(f"{name} must be > 0 (a response has at least its eos token)")
    return lengths.to(logp.dtype)


def _stats(loss: torch.Tensor, chosen_rewards: torch.Tensor, rejected_rewards: torch.Tensor,
           logp_chosen: torch.Tensor, logp_rejected: torch.Tensor) -> dict[str, float]:
    """The shared stats; every input (N,) but the scalar loss, detached here."""
    with torch.no_grad():
        c, r = chosen_rewards.detach().double(), rejected_rewards.detach().double()
        return {
            "loss": float(loss.detach()),
            "rewards/chosen": c.mean().item(),
            "rewards/rejected": r.mean().item(),
            "rewards/accuracy": (c > r).double().mean().item(),   # ties count as wrong
            "rewards/margin": (c - r).mean().item(),
            "logps/chosen": logp_chosen.detach().double().mean().item(),
            "logps/rejected": logp_rejected.detach().double().mean().item(),
        }


def dpo_loss(
    logp_chosen: torch.Tensor,  # (N,) log pi_theta(y_c | x), summed over response tokens, with grad
    logp_rejected: torch.Tensor,  # (N,) log pi_theta(y_r | x), with grad
    ref_chosen: torch.Tensor,  # (N,) log pi_ref(y_c | x), constant
    ref_rejected: torch.Tensor,  # (N,) log pi_ref(y_r | x), constant
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DPO (Rafailov et al. 2023, eq. 7) with conservative label smoothing (cDPO, Mitchell 2023).

    h = (logp_c - ref_c) - (logp_r - ref_r), the difference of implicit rewards over beta;
    loss = mean over pairs of -(1 - eps) logsigmoid(beta h) - eps logsigmoid(-beta h).
    eps is the assumed probability that a pair's label is flipped: with eps > 0 the loss has a
    finite minimiser (beta h = log((1 - eps) / eps)) instead of pushing h to infinity.
    d loss_i / d logp_c = -beta (1 - eps) sigmoid(-beta h) + beta eps sigmoid(beta h) = -d / d logp_r.
    """
    _check_pairs(logp_chosen=logp_chosen, logp_rejected=logp_rejected, ref_chosen=ref_chosen,
                 ref_rejected=ref_rejected)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5) (0.5 makes the labels noise), got {label_smoothing}")
    chosen_logratio = logp_chosen - ref_chosen  # (N,)
    rejected_logratio = logp_rejected - ref_rejected  # (N,)
    h = chosen_logratio - rejected_logratio  # (N,)
    per_pair = (-(1.0 - label_smoothing) * F.logsigmoid(beta * h)
                - label_smoothing * F.logsigmoid(-beta * h))  # (N,); logsigmoid is stable for any h
    loss = per_pair.mean()
    stats = _stats(loss, beta * chosen_logratio, beta * rejected_logratio, logp_chosen, logp_rejected)
    return loss, stats


def ipo_loss(
    logp_chosen: torch.Tensor,  # (N,) summed log pi_theta(y_c | x), with grad
    logp_rejected: torch.Tensor,  # (N,) summed log pi_theta(y_r | x), with grad
    ref_chosen: torch.Tensor,  # (N,) summed log pi_ref(y_c | x), constant
    ref_rejected: torch.Tensor,  # (N,) summed log pi_ref(y_r | x), constant
    beta: float,
    chosen_lengths: torch.Tensor | None = None,  # (N,) response tokens of y_c; None: summed log-probs
    rejected_lengths: torch.Tensor | None = None,  # (N,) response tokens of y_r
) -> tuple[torch.Tensor, dict[str, float]]:
    """IPO (Azar et al. 2023, "A General Theoretical Paradigm to Understand Learning from Human
    Preferences", eq. 17): loss = mean over pairs of (h - 1 / (2 beta))^2, beta the paper's tau.

    Regressing h onto a finite target keeps IPO from the deterministic-preference overfitting of
    DPO, whose sigmoid loss is only minimised as h -> infinity.

    Summed or averaged: the paper writes h with sequence log-probs (sums over tokens), and that is
    the default here. TRL's DPOTrainer divides each sequence's log-prob by its number of response
    tokens for IPO (``concatenated_forward``: ``all_logps / loss_mask.sum(-1)`` when
    ``loss_type == "ipo"``), for the policy and the reference alike, so its target 1 / (2 beta) is
    a per-token margin. Pass ``chosen_lengths`` and ``rejected_lengths`` to get TRL's version:
    h = (logp_c - ref_c) / |y_c| - (logp_r - ref_r) / |y_r|. The rewards in the stats then use the
    same averaged log-ratios; the ``logps/*`` stats stay summed.
    """
    _check_pairs(logp_chosen=logp_chosen, logp_rejected=logp_rejected, ref_chosen=ref_chosen,
                 ref_rejected=ref_rejected)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    chosen_logratio = logp_chosen - ref_chosen  # (N,)
    rejected_logratio = logp_rejected - ref_rejected  # (N,)
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError("give both chosen_lengths and rejected_lengths (length-averaged IPO) or neither (summed)")
    if chosen_lengths is not None and rejected_lengths is not None:
        chosen_logratio = chosen_logratio / _check_lengths(logp_chosen, chosen_lengths, "chosen_lengths")
        rejected_logratio = rejected_logratio / _check_lengths(logp_rejected, rejected_lengths, "rejected_lengths")
    h = chosen_logratio - rejected_logratio  # (N,)
    loss = ((h - 1.0 / (2.0 * beta)) ** 2).mean()
    stats = _stats(loss, beta * chosen_logratio, beta * rejected_logratio, logp_chosen, logp_rejected)
    return loss, stats


def simpo_loss(
    logp_chosen: torch.Tensor,  # (N,) summed log pi_theta(y_c | x), with grad
    logp_rejected: torch.Tensor,  # (N,) summed log pi_theta(y_r | x), with grad
    chosen_lengths: torch.Tensor,  # (N,) response tokens of y_c (eos included), > 0
    rejected_lengths: torch.Tensor,  # (N,) response tokens of y_r, > 0
    beta: float,
    gamma: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free
    Reward", eq. 6): loss = mean over pairs of -logsigmoid(beta (logp_c / |y_c| - logp_r / |y_r|) - gamma).

    The implicit reward is beta times the average log-prob per token: the length normalisation
    removes the incentive to lengthen responses that a summed reward would have, and gamma >= 0 is
    a target margin between the two rewards. No reference model is involved at all.
    """
    _check_pairs(logp_chosen=logp_chosen, logp_rejected=logp_rejected)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if gamma < 0:
        raise ValueError(f"gamma (the target reward margin) must be >= 0, got {gamma}")
    chosen_rewards = beta * logp_chosen / _check_lengths(logp_chosen, chosen_lengths, "chosen_lengths")  # (N,)
    rejected_rewards = beta * logp_rejected / _check_lengths(logp_rejected, rejected_lengths, "rejected_lengths")
    loss = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma).mean()
    stats = _stats(loss, chosen_rewards, rejected_rewards, logp_chosen, logp_rejected)
    return loss, stats
