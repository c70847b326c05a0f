"""PPO towards best-of-n: the reward as where a response's score falls among the SFT policy's own
responses to the same prompt (`ppo.quantile_reward_samples`).

Best-of-n from a policy pi_ref (draw n responses, keep the one the reward model scores highest)
has, for a score r without ties, the density

    pi_bon(y | x) = n F_x(r(x, y))^(n-1) pi_ref(y | x),

F_x the distribution function of the score over pi_ref's responses to the prompt x. The policy
closest to best-of-n in reverse KL therefore maximises

    E_pi[log F_x(r)] - 1/(n-1) KL(pi || pi_ref)

(Amini et al. 2025, "Variational best-of-N alignment"; Sessa et al. 2024, BOND, distil the same
target): PPO's own objective with the reward log F_x(r) and `kl_coef` 1/(n-1). PPO then climbs
towards best-of-n's distribution rather than towards the reward model's highest scores: a response
already better than everything SFT says to the prompt earns almost nothing more, so the scores'
tail, where a reward model is least right, stops paying.

F_x is estimated per prompt from k responses of the SFT policy, sampled once before training (the
same k for every prompt; each process samples the whole table, from one seeded stream) and scored as
rollouts are (reward source, missing-eos rule, clip). The estimate is the mid-rank empirical CDF
with half a sample of room at either end,

    F^(r) = (#{j : r_j < r} + #{j : r_j = r} / 2 + 1/2) / (k + 1),

inside (0, 1), so log F^ is finite: from log(1 / (2k + 2)) below every SFT response to
log(1 - 1 / (2k + 2)) above all of them. k bounds the target: above the k samples' best, F^ cannot
tell responses apart, so an n much larger than k is not reached (k >= n is the safe choice).

Tensor maths first (shapes on every tensor), then the table's sampling.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch

from ..config import SamplingConfig
from ..data.inputs import prompt_key
from ..models.reward_source import RewardSource
from ..progress import Progress

if TYPE_CHECKING:   # annotations only (pipeline/models/checkpoints.py says why)
    from transformers import PreTrainedTokenizerBase


def log_quantile(scores: torch.Tensor, reference: torch.Tensor) -> torch.Tensor:
    """(B,) log F^(score): `scores` (B,) against each row's `reference` (B, k) scores of the
    reference policy's responses to the same prompt (module doc's mid-rank estimate)."""
    k = reference.size(1)
    s = scores[:, None]                                                             # (B, 1)
    below = (reference < s).sum(1).to(scores.dtype)                                # (B,)
    tied = (reference == s).sum(1).to(scores.dtype)                                # (B,)
    return torch.log((below + 0.5 * tied + 0.5) / (k + 1))


@dataclass
class ReferenceScores:
    """The SFT policy's scores on each training prompt: k per prompt, keyed by the prompt."""
    by_prompt: dict[str, torch.Tensor]   # prompt_key(prompt) -> (k,) float32 scores, CPU

    def log_cdf(self, prompts: Sequence[Any], scores: torch.Tensor) -> torch.Tensor:
        """(B,) log F^_x(score) of `scores` (B,) for the rows' `prompts` (B prompts), on their device."""
        reference = torch.stack([self.by_prompt[prompt_key(p)] for p in prompts]).to(scores.device)   # (B, k)
        return log_quantile(scores.float(), reference)

    def stats(self) -> dict[str, float]:
        """The table's spread, once per run: the mean over prompts of the k scores' std, and the std over
        prompts of their mean (a large second one is why a per-prompt F and not one for all prompts)."""
        table = torch.stack(list(self.by_prompt.values()))                            # (N, k)
        return {"within_prompt_std": table.std(1).mean().item(), "between_prompt_std": table.mean(1).std().item()}


@torch.no_grad()
def sample_reference_scores(policy: Any, tok: PreTrainedTokenizerBase, reward: RewardSource, prompts: Sequence[Any],
                            k: int, sampling: SamplingConfig, generator: torch.Generator,
                            shape_scores: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                            rows_per_call: int, max_prompt_length: int | None = None,
                            progress: bool = False, **rollout_options: Any) -> ReferenceScores:
    """k responses of `policy` (the SFT policy, whole on this rank) to each distinct prompt of
    `prompts`, sampled `rows_per_call` rows at a time (whole prompts' k rows; at least one prompt)
    from `generator` as rollouts are sampled (`rollout_options`: ppo.rollout's micro-batch, token
    budget, drop-finished), scored by `reward` and shaped by `shape_scores(raw (B,), ended (B,))`
    exactly as a rollout's scores are. The prompts' order fixes the bits: the same prompts, seed
    and machine give the same table."""
    from .rollout import rollout
    distinct = list({prompt_key(p): p for p in prompts}.items())
    per_call = max(1, rows_per_call // k)
    table: dict[str, torch.Tensor] = {}
    bar = Progress(len(distinct), "reference scores", unit="prompts", enabled=progress)
    for start in range(0, len(distinct), per_call):
        chunk = distinct[start:start + per_call]
        batch = [p for _, p in chunk for _ in range(k)]                               # each prompt k times, consecutive
        ro = rollout(policy, tok, batch, sampling, generator, max_prompt_length, **rollout_options)
        raw = reward.score(ro.prompts, ro.responses).float().cpu()                    # (B,)
        scores = shape_scores(raw, ro.ended.cpu()).view(len(chunk), k)                 # (P, k)
        for (key, _), row in zip(chunk, scores):
            table[key] = row.clone()
        bar.update(len(chunk))
    bar.close()
    return ReferenceScores(table)
