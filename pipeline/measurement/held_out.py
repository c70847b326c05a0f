"""Policies side by side on the held-out prompts: the one measurement the evaluate stage (SFT,
best-of-n and PPO) and the compare stage (SFT, best-of-n and every method) both are.

Every policy answers the same prompts, sampled as `prompts.sampling` says with one seed per
prompt (policy.prompt_seed: a response does not depend on which other policies, ranks or batches
there are); the reward model scores each response on its text, the gold judge too where there is
one, and the KL to the SFT policy is measured on the same responses. Best-of-n from SFT draws
max(n) samples per prompt once and keeps the reward model's favourite among the first n. The
summary is each policy's means with 95% half-widths and, for the policies asked, the bootstrap win
rate over SFT per judge and, with a gold judge, the gap to the best-of-n frontier at the policy's
KL (frontier_gap.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch

from ..config import SamplingConfig
from ..data.tokenizer import load_tokenizer
from ..errors import CheckpointError
from ..tracking.metric_names import METRICS_JSON, Metric
from ..models.checkpoints import load_policy
from ..models.generation import check_stop_tokens
from ..models.reward_source import RewardModelSource
from ..context import SINGLE, Context
from .frontier_gap import Gap, Series, gaps
from .policy import Measured, Policy, best_of_n, candidates, measure_policies, summary
from .stats import win_rate


def measure_against_sft(sft_dir: Path, policies: dict[str, Path], reward_dir: Path, prompts: list,
                        judge: Optional[Callable], *, sampling: SamplingConfig, seed: int, best_of: tuple[int, ...],
                        reward_max_length: int, trust_remote_code: bool, dtype: Optional[torch.dtype],
                        ctx: Context = SINGLE, packed: bool = False) -> dict[str, Measured]:
    """Collective. Each policy's responses and per-response measures (rm, gold with a judge, kl to
    SFT), every rank its share of the prompts, the models on its device in `dtype`, one trained
    policy at a time. Keys in report order: sft, best_of_<n> by n, then `policies` as given.
    `packed`: the scoring forwards (KL log-probs, reward model) in packed rows."""
    sft, tok = load_policy(sft_dir, trust_remote_code, dtype)
    same_vocabulary(tok, sft_dir, policies, trust_remote_code)   # before minutes of sampling
    check_stop_tokens(tok, {"prompts.sampling": sampling})   # what the evaluate and compare stages pass
    sft = sft.to(ctx.device)
    reward = RewardModelSource(reward_dir, reward_max_length, trust_remote_code, device=ctx.device, dtype=dtype,
                               packed=packed)
    per = measure_policies([Policy("sft", sft, seed)], tok, prompts, sampling, ctx=ctx, reward=reward, ref=sft,
                           judge=judge, packed=packed)
    if best_of:   # draw k with seed seed + 1 + k, scored once; each n keeps the RM's favourite of the first n
        draws = candidates(sft, seed + 1, max(best_of))
        cands = measure_policies(draws, tok, prompts, sampling, ctx=ctx, reward=reward)
        per.update(best_of_n([cands[d.name] for d in draws], prompts, best_of, judge))
    for name, folder in policies.items():
        policy, _ = load_policy(folder, trust_remote_code, dtype)
        per.update(measure_policies([Policy(name, policy.to(ctx.device), seed)], tok, prompts, sampling, ctx=ctx,
                                    reward=reward, ref=sft, judge=judge, packed=packed))
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


def summarise(per: dict[str, Measured], n_boot: int, seed: int, versus: Iterable[str],
              against_frontier: Iterable[str] = ()) -> dict[str, Any]:
    """`<policy>/<measure>` means with `_ci95` half-widths for every policy, and for each policy of
    `versus` its win rate over SFT per judge (rm; gold with a judge): `win_rate/<policy>_vs_sft_<judge>`
    with `_low`/`_high` bootstrap 95% bounds (ties count half); with a judge, `frontier_metrics` of
    the policies `against_frontier`."""
    m: dict[str, Any] = {}
    for name, measured in per.items():
        m.update(summary(measured, lambda key: f"{name}/{key}"))
    judges = ("rm", "gold") if "gold" in per["sft"].values else ("rm",)
    for name in versus:
        for key in judges:
            rate, low, high = win_rate(per[name].values[key], per["sft"].values[key], n_boot, seed)
            base = f"win_rate/{name}_vs_sft_{key}"
            m[base], m[f"{base}_low"], m[f"{base}_high"] = rate, low, high
    if "gold" in judges:
        m.update(frontier_metrics(per, tuple(against_frontier), n_boot, seed))
    return m


def frontier_metrics(per: dict[str, Measured], names: tuple[str, ...], n_boot: int,
                     seed: int) -> dict[str, Any]:
    """For each policy of `names`, its gold minus the best-of-n curve at its mean KL
    (frontier_gap.gaps over the `best_of_<n>` of `per`, paired bootstrap over the prompts with the
    win rates' resamples): `frontier/<policy>_gap_gold` with `_low`/`_high` 95% bounds (NaN where
    there is no gap: beyond best-of-n's largest KL, or fewer than two best-of-n) and
    `frontier/<policy>_beyond_best_of_n` (None without a best-of-n); and the same gap in the reward
    model's score, `frontier/<policy>_gap_rm`: with the gold gap it tells a policy that gets less of
    the score it optimises per nat than best-of-n (both below) from one whose score gains are worth
    less gold (only gold below: over-optimisation)."""
    if not names:
        return {}

    def found(score: str) -> dict[str, Gap]:
        best = [Series(p.values["kl"], p.values[score]) for name, p in per.items() if name.startswith("best_of_")]
        policies = {n: Series(per[n].values["kl"], per[n].values[score]) for n in names}
        return gaps(per["sft"].values[score], best, policies, n_boot, seed)
    out: dict[str, Any] = {}
    for name, g in found("rm").items():
        base = f"frontier/{name}_gap_rm"
        out[base], out[f"{base}_low"], out[f"{base}_high"] = g.gap, g.low, g.high
    for name, g in found("gold").items():
        base = f"frontier/{name}_gap_gold"
        out[base], out[f"{base}_low"], out[f"{base}_high"] = g.gap, g.low, g.high
        out[f"frontier/{name}_beyond_best_of_n"] = g.beyond
        margin = f"frontier/{name}_margin_gold"
        out[margin], out[f"{margin}_low"], out[f"{margin}_high"] = g.margin, g.margin_low, g.margin_high
    return out


def frontier_declarations(stage: str, policy: str, condition: Optional[str]) -> list[Metric]:
    """The `frontier/` names `frontier_metrics` gives `policy` (a name, or the pattern `{policy}`)."""
    base = f"frontier/{policy}_gap_gold"
    meanings = {
        base: "the policy's mean gold minus the best-of-n curve (Gao et al. 2023's form, fitted through SFT "
              "and the best-of-n points) at its mean KL; negative: below the frontier; null past best-of-n's "
              "largest KL or with fewer than two best-of-n",
        f"{base}_low": "lower end of its paired bootstrap 95% interval (the win rates' resamples of the "
                       "prompts, every policy's the same, the curve refitted on each); null where the gap "
                       "is, or where over 5% of resamples put the policy past that KL",
        f"{base}_high": "upper end of that interval",
        f"frontier/{policy}_beyond_best_of_n": "true when the policy's mean KL is past best-of-n's largest "
                                               "(no gap measured there); null without a best-of-n",
        f"frontier/{policy}_margin_gold": "the policy's mean gold minus the best mean gold SFT or a best-of-n "
                                          "reaches at no more KL (defined at every KL; negative: dominated by a "
                                          "point that spends less KL); null without a best-of-n",
        f"frontier/{policy}_margin_gold_low": "lower end of its paired bootstrap 95% interval",
        f"frontier/{policy}_margin_gold_high": "upper end of that interval",
        f"frontier/{policy}_gap_rm": "the same gap in the reward model's score (its curve fitted the same way "
                                     "through SFT's and best-of-n's mean scores); null where the gold gap is",
        f"frontier/{policy}_gap_rm_low": "lower end of its paired bootstrap 95% interval",
        f"frontier/{policy}_gap_rm_high": "upper end of that interval"}
    return [Metric(stage, METRICS_JSON, name, meaning, condition) for name, meaning in meanings.items()]
