"""Policies side by side on the held-out prompts: the one measurement the evaluate stage (SFT,
best-of-n and PPO) and the compare stage (SFT, best-of-n and every method) both are.

Every policy answers the same prompts, sampled as `prompts.sampling` says with one seed per
prompt (policy.prompt_seed: a response does not depend on which other policies, ranks or batches
there are); the reward model scores each response on its text, the gold judge too where there is
one, and the KL to the SFT policy is measured on the same responses. Best-of-n from SFT draws
max(n) samples per prompt once and keeps the reward model's favourite among the first n. The
summary is each policy's means with 95% half-widths and, for the policies asked, the bootstrap win
rate over SFT per judge.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

from ..config import SamplingConfig
from ..data.tokenizer import load_tokenizer
from ..errors import CheckpointError
from ..models.checkpoints import load_policy
from ..models.generation import check_stop_tokens
from ..models.reward_source import RewardModelSource
from ..context import SINGLE, Context
from .policy import Measured, Policy, best_of_n, candidates, measure_policies, summary
from .stats import win_rate


def measure_against_sft(sft_dir: Path, policies: dict[str, Path], reward_dir: Path, prompts: list,
                        judge: Optional[Callable], *, sampling: SamplingConfig, seed: int, best_of: tuple[int, ...],
                        reward_max_length: int, trust_remote_code: bool, dtype: Optional[torch.dtype],
                        ctx: Context = SINGLE) -> dict[str, Measured]:
    """Collective. Each policy's responses and per-response measures (rm, gold with a judge, kl to
    SFT), every rank its share of the prompts, the models on its device in `dtype`, one trained
    policy at a time. Keys in report order: sft, best_of_<n> by n, then `policies` as given."""
    sft, tok = load_policy(sft_dir, trust_remote_code, dtype)
    same_vocabulary(tok, sft_dir, policies, trust_remote_code)   # before minutes of sampling
    check_stop_tokens(tok, {"prompts.sampling": sampling})   # what the evaluate and compare stages pass
    sft = sft.to(ctx.device)
    reward = RewardModelSource(reward_dir, reward_max_length, trust_remote_code, device=ctx.device, dtype=dtype)
    per = measure_policies([Policy("sft", sft, seed)], tok, prompts, sampling, ctx=ctx, reward=reward, ref=sft,
                           judge=judge)
    if best_of:   # draw k with seed seed + 1 + k, scored once; each n keeps the RM's favourite of the first n
        draws = candidates(sft, seed + 1, max(best_of))
        cands = measure_policies(draws, tok, prompts, sampling, ctx=ctx, reward=reward)
        per.update(best_of_n([cands[d.name] for d in draws], prompts, best_of, judge))
    for name, folder in policies.items():
        policy, _ = load_policy(folder, trust_remote_code, dtype)
        per.update(measure_policies([Policy(name, policy.to(ctx.device), seed)], tok, prompts, sampling, ctx=ctx,
                                    reward=reward, ref=sft, judge=judge))
        del policy
    return per


def same_vocabulary(tok: Any, sft_dir: Path, policies: dict[str, Path], trust_remote_code: bool) -> None:
    """Every policy speaks the SFT policy's token ids (its responses are decoded with the SFT
    tokenizer and its KL to SFT compared token by token); a folder that does not, or is no
    checkpoint, is one CheckpointError naming it, before anything is sampled."""
    vocab = tok.get_vocab()
    for name, folder in policies.items():
        other = load_tokenizer(folder, trust_remote_code).get_vocab()
        if other != vocab:
            raise CheckpointError(f"{folder}: the {name} policy's vocabulary differs from the SFT policy's at "
                                  f"{sft_dir} ({len(other)} tokens, SFT {len(vocab)}); compare measures policies "
                                  "fine-tuned from that SFT model")


def summarise(per: dict[str, Measured], n_boot: int, seed: int, versus: Iterable[str]) -> dict[str, Any]:
    """`<policy>/<measure>` means with `_ci95` half-widths for every policy, and for each policy of
    `versus` its win rate over SFT per judge (rm; gold with a judge): `win_rate/<policy>_vs_sft_<judge>`
    with `_low`/`_high` bootstrap 95% bounds (ties count half)."""
    m: dict[str, Any] = {}
    for name, measured in per.items():
        m.update(summary(measured, lambda key: f"{name}/{key}"))
    judges = ("rm", "gold") if "gold" in per["sft"].values else ("rm",)
    for name in versus:
        for key in judges:
            rate, low, high = win_rate(per[name].values[key], per["sft"].values[key], n_boot, seed)
            base = f"win_rate/{name}_vs_sft_{key}"
            m[base], m[f"{base}_low"], m[f"{base}_high"] = rate, low, high
    return m
