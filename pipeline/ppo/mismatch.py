"""The sampler/trainer log-prob mismatch: whose log-probs are the old policy's, and how far apart
the two are.

PPO's ratio pi_theta / pi_old must be exactly 1 at the first minibatch (seed 000, 16.2.5; seed
003 §2): pi_old must be what the *training* forward computes for the sampled tokens. The KV-cached
sampler computes log-probs of the same weights as it goes, and reusing them saves one actor forward
per iteration, but they equal the training forward's only where both run the same arithmetic: in
float32 on this CPU they agree to ~1e-7. In bf16/fp16, or on a GPU or any other device that is not
the CPU (other kernels for one-token cached attention than for the full sequence, reduced-precision
accumulation) they do not, and the ratio is off from the first step, with clipping hiding it (Yao
et al. 2025, "Your efficient RL framework secretly brings you off-policy RL training"). So the
trainer recomputes them there.

Pure functions: settings, dtypes and tensors in, a decision or a dict of detached float stats out.
Shapes follow ``pipeline/ppo/__init__.py``.
"""

from __future__ import annotations

from typing import Literal, Union

import torch

from .. import devices
from .advantages import _check_mask

RecomputeSetting = Union[bool, Literal["auto"]]

# Above this max |diff| (nats) the sampler's log-probs are not a stand-in for the trainer's: the
# ratio at the first minibatch is then off by about as much (float32 CPU measures ~1e-7).
TOLERANCE = 1e-4


def resolve_recompute(setting: RecomputeSetting, precision: str, param_dtype: torch.dtype,
                      device_type: str, tis: bool = False, engine: str = "torch") -> tuple[bool, str]:
    """Whether the old log-probs come from a training forward (True) or from the sampler (False),
    and why, in words for the log. `auto` recomputes wherever the two can differ: a precision other
    than fp32 (`distributed.precision`), weights stored in another dtype (`model.dtype` reaches PPO
    as the dtype of the SFT checkpoint), or a device that is not the CPU (`device_type`: a GPU's
    kernels are not the ones whose agreement was measured); and whenever truncated importance
    sampling is on (its weight is the ratio of the two, so both must exist), and whenever another
    engine than our sampler samples (`engine`: a different implementation of the same policy)."""
    where = f"{precision} precision, {str(param_dtype).removeprefix('torch.')} weights on {device_type}"
    if setting is True or setting is False:
        return setting, f"ppo.recompute_logprobs: {str(setting).lower()}; {where}"
    if setting != "auto":
        raise ValueError(f"recompute setting must be true, false or 'auto', got {setting!r}")
    reasons = []
    if precision != "fp32":
        reasons.append(f"{precision} precision")
    if param_dtype != torch.float32:
        reasons.append(f"{str(param_dtype).removeprefix('torch.')} weights")
    if devices.is_accelerator(device_type):
        reasons.append(f"a {device_type} device")
    if tis:
        reasons.append("ppo.tis_cap is set")
    if engine != "torch":
        reasons.append(f"rollout_engine: {engine}")
    if reasons:
        return True, f"auto: {', '.join(reasons)}"
    return False, f"auto: fp32 on {device_type}, where the sampler's and the trainer's are shown equal"


def logprob_diff(
    sampler_logprobs: torch.Tensor,  # (B, R) log pi(a_t|s_t) as the sampler computed it
    trainer_logprobs: torch.Tensor,  # (B, R) the same tokens' log-probs from a training forward
    response_mask: torch.Tensor,  # (B, R) bool
) -> dict[str, float]:
    """Mean and max of |sampler - trainer| over real tokens, in nats (float64 sums)."""
    _check_mask(response_mask, sampler_logprobs, trainer_logprobs)
    diff = (sampler_logprobs.double() - trainer_logprobs.double()).abs()
    return _mean_max(diff, response_mask, "val/logprob_diff")


def ratio_deviation(
    logprobs: torch.Tensor,  # (B, R) log pi_theta(a_t|s_t) of the update's forward
    old_logprobs: torch.Tensor,  # (B, R) log pi_old(a_t|s_t)
    response_mask: torch.Tensor,  # (B, R) bool
) -> dict[str, float]:
    """|exp(logprobs - old_logprobs) - 1| over real tokens: its mean and max. At the first
    minibatch, before any optimizer step, this is how far PPO's ratio is from 1 (0 in exact
    arithmetic)."""
    _check_mask(response_mask, logprobs, old_logprobs)
    log_ratio = torch.where(response_mask, logprobs.detach().double() - old_logprobs.double(), 0.0)
    dev = torch.expm1(log_ratio).abs()   # expm1: no cancellation near ratio 1
    return _mean_max(dev, response_mask, "val/first_ratio", suffix="_dev")


def _mean_max(x: torch.Tensor, response_mask: torch.Tensor, name: str, suffix: str = "") -> dict[str, float]:
    """`<name>_mean<suffix>` and `<name>_max<suffix>` of x (B, R) >= 0 over real tokens (0 without any)."""
    x = torch.where(response_mask, x, torch.zeros_like(x))
    n = int(response_mask.sum())
    return {f"{name}_mean{suffix}": float(x.sum() / max(n, 1)), f"{name}_max{suffix}": float(x.max()) if n else 0.0}
