"""Offline preference losses on per-sequence response log-probs: DPO (with conservative label
smoothing), IPO and the reference-free SimPO on pairs, each registered by name
(`PREFERENCE_LOSSES`, the values of `dpo.method`); and KTO's loss on unpaired examples with its KL
reference point.

Pure functions: tensors and floats in, a scalar loss (the mean over pairs) plus a dict of detached
float stats out (KTO: per-example terms and rewards, which its stage sums over a global batch).
Inputs are (N,) per-sequence log-probs from ``pipeline.preference.logprobs``: ``logp_*`` with grad
(the policy being trained), ``ref_*`` constants (the frozen reference, computed once before
training).

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

from ..registries import Registry

# dpo.method -> its loss. Facts the stage reads: `reference`, whether the loss takes the reference
# model's log-probs (SimPO does not, so its training pairs need no reference pass); `lengths`,
# whether it takes the responses' token counts; `options`, its keyword hyperparameters beyond beta.
PREFERENCE_LOSSES = Registry("preference loss")


def _check_batch(**tensors: torch.Tensor) -> int:
    """All inputs (N,) with the same N >= 1 (N pairs or N examples); returns N. Catches a (N, R)
    per-token tensor passed where a per-sequence sum was meant, which would otherwise broadcast
    silently."""
    n = None
    for name, t in tensors.items():
        if t.dim() != 1:
            raise ValueError(f"{name} must be (N,) per-sequence values, got shape {tuple(t.shape)}")
        if n is None:
            n = t.shape[0]
        elif t.shape[0] != n:
            raise ValueError(f"{name} has {t.shape[0]} entries, expected {n} like the others")
    if not n:
        raise ValueError("a batch needs at least one pair or example")
    return n


def _logratios(logp_chosen: torch.Tensor, logp_rejected: torch.Tensor, ref_chosen: torch.Tensor,
               ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs checked, then each side's log-ratio to the reference, log pi - log pi_ref: (N,), (N,)."""
    _check_batch(logp_chosen=logp_chosen, logp_rejected=logp_rejected, ref_chosen=ref_chosen,
                 ref_rejected=ref_rejected)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    return logp_chosen - ref_chosen, logp_rejected - ref_rejected


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


@PREFERENCE_LOSSES.register("dpo", reference=True, lengths=False, options=("label_smoothing",))
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
    chosen_logratio, rejected_logratio = _logratios(logp_chosen, logp_rejected, ref_chosen, ref_rejected, beta)
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5) (0.5 makes the labels noise), got {label_smoothing}")
    h = chosen_logratio - rejected_logratio  # (N,)
    per_pair = (-(1.0 - label_smoothing) * F.logsigmoid(beta * h)
                - label_smoothing * F.logsigmoid(-beta * h))  # (N,); logsigmoid is stable for any h
    loss = per_pair.mean()
    stats = _stats(loss, beta * chosen_logratio, beta * rejected_logratio, logp_chosen, logp_rejected)
    return loss, stats


# Registered summed, as the paper writes it; the length-averaged variant is for callers that pass lengths.
@PREFERENCE_LOSSES.register("ipo", reference=True, lengths=False, options=())
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
    chosen_logratio, rejected_logratio = _logratios(logp_chosen, logp_rejected, ref_chosen, ref_rejected, beta)
    if (chosen_lengths is None) != (rejected_lengths is None):
        raise ValueError("give both chosen_lengths and rejected_lengths (length-averaged IPO) or neither (summed)")
    if chosen_lengths is not None and rejected_lengths is not None:
        chosen_logratio = chosen_logratio / _check_lengths(logp_chosen, chosen_lengths, "chosen_lengths")
        rejected_logratio = rejected_logratio / _check_lengths(logp_rejected, rejected_lengths, "rejected_lengths")
    h = chosen_logratio - rejected_logratio  # (N,)
    loss = ((h - 1.0 / (2.0 * beta)) ** 2).mean()
    stats = _stats(loss, beta * chosen_logratio, beta * rejected_logratio, logp_chosen, logp_rejected)
    return loss, stats


@PREFERENCE_LOSSES.register("simpo", reference=False, lengths=True, options=("gamma",))
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
    _check_batch(logp_chosen=logp_chosen, logp_rejected=logp_rejected)
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if gamma < 0:
        raise ValueError(f"gamma (the target reward margin) must be >= 0, got {gamma}")
    chosen_rewards = beta * logp_chosen / _check_lengths(logp_chosen, chosen_lengths, "chosen_lengths")  # (N,)
    rejected_rewards = beta * logp_rejected / _check_lengths(logp_rejected, rejected_lengths, "rejected_lengths")
    loss = -F.logsigmoid(chosen_rewards - rejected_rewards - gamma).mean()
    stats = _stats(loss, chosen_rewards, rejected_rewards, logp_chosen, logp_rejected)
    return loss, stats


# ---- KTO: unpaired examples ----------------------------------------------------------------------


def reference_point(kl_logp: torch.Tensor, kl_ref_logp: torch.Tensor) -> torch.Tensor:
    """KTO's z_ref (Ethayarajh et al. 2024): the mean of log pi(y'|x) - log pi_ref(y'|x) over
    mismatched prompt-response pairs (N,), clamped at 0 (a KL is >= 0; a batch's estimate can dip
    below) and detached: the paper's reference point is not trained through."""
    _check_batch(kl_logp=kl_logp, kl_ref_logp=kl_ref_logp)
    return (kl_logp - kl_ref_logp).detach().mean().clamp(min=0)


def kto_loss(logp: torch.Tensor, ref_logp: torch.Tensor, desirable: torch.Tensor, z_ref: torch.Tensor,
             beta: float, lambda_d: float = 1.0, lambda_u: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example KTO terms (N,) and the implicit rewards beta r (N,), detached.

    logp (N,) the policy's summed response log-probs (with grad); ref_logp (N,) the reference's;
    desirable (N,) bool; z_ref () from `reference_point`. With r = logp - ref_logp:
    desirable   lambda_d (1 - sigmoid(beta (r - z_ref)))
    undesirable lambda_u (1 - sigmoid(beta (z_ref - r)))
    (the paper's L = E[lambda_y - v(x, y)]; TRL's kto_loss is the same). 1 - sigmoid(t) is computed as
    sigmoid(-t), which loses nothing when beta |r - z_ref| is large. The gradient pushes a desirable
    response's log-prob up and an undesirable one's down, saturating once |r - z_ref| >> 1 / beta."""
    _check_batch(logp=logp, ref_logp=ref_logp, desirable=desirable)
    if desirable.dtype != torch.bool:
        raise ValueError(f"desirable must be a bool tensor, got {desirable.dtype}")
    if z_ref.dim() != 0 or z_ref.requires_grad:
        raise ValueError("z_ref must be a detached scalar (reference_point)")
    reward = logp - ref_logp   # (N,)
    terms = torch.where(desirable, lambda_d * torch.sigmoid(beta * (z_ref - reward)),
                        lambda_u * torch.sigmoid(beta * (reward - z_ref)))   # (N,)
    return terms, beta * reward.detach()
