"""The best-of-n-targeted reward (pipeline/ppo/quantile_reward.py): the mid-rank log CDF against a
count by hand, and the claim it rests on, that PPO's optimum with this reward and kl_coef 1/(n-1) is
best-of-n's distribution, checked against best-of-n's exact distribution on a discrete policy."""

import math

import pytest
import torch

from pipeline.data.inputs import prompt_key
from pipeline.measurement.stats import best_of_n_kl
from pipeline.ppo.quantile_reward import ReferenceScores, log_quantile


def by_hand(score: float, reference: list[float]) -> float:
    below = sum(r < score for r in reference)
    tied = sum(r == score for r in reference)
    return math.log((below + tied / 2 + 0.5) / (len(reference) + 1))


def test_log_quantile_counts_below_and_ties_as_by_hand():
    gen = torch.Generator().manual_seed(0)
    reference = torch.randint(-3, 4, (64, 7), generator=gen).float()   # many ties
    scores = torch.randint(-4, 5, (64,), generator=gen).float()
    got = log_quantile(scores, reference)
    want = torch.tensor([by_hand(s, r) for s, r in zip(scores.tolist(), reference.tolist())])
    torch.testing.assert_close(got, want)
    k = reference.size(1)
    bounds = log_quantile(torch.tensor([-100.0, 100.0]), torch.zeros(2, k))
    torch.testing.assert_close(bounds, torch.tensor([math.log(0.5 / (k + 1)), math.log((k + 0.5) / (k + 1))]))


def test_reference_scores_are_looked_up_by_prompt_text_or_messages():
    chat = [{"role": "user", "content": "Review the film ."}]
    table = ReferenceScores({"plain": torch.tensor([0.0, 1.0, 2.0]), prompt_key(chat): torch.tensor([5.0, 6.0, 7.0])})
    got = table.log_cdf(["plain", chat, "plain"], torch.tensor([1.5, 5.0, -1.0]))
    torch.testing.assert_close(got, torch.tensor([math.log(2.5 / 4), math.log(1.0 / 4), math.log(0.5 / 4)]))
    assert table.stats()["within_prompt_std"] == pytest.approx(1.0)
    assert table.stats()["between_prompt_std"] == pytest.approx(math.sqrt(12.5))   # means 1 and 6


@pytest.mark.parametrize("n", [4, 16, 64])
def test_the_kl_regularised_optimum_of_the_log_cdf_reward_is_best_of_n(n):
    """A reference policy uniform over M responses with distinct scores: best-of-n picks response i
    (of rank i) with probability (i/M)^n - ((i-1)/M)^n. The policy maximising E[log F^] - KL / (n-1)
    is pi_ref F^^(n-1) normalised (the Gibbs form of a KL-regularised optimum), F^ the mid-rank CDF
    of the exact distribution. The two agree to a total variation under 1%, and the optimum's KL
    is best-of-n's log n - (n-1)/n to 1%."""
    M = 4000
    ranks = torch.arange(1, M + 1, dtype=torch.float64)
    best_of_n = (ranks / M) ** n - ((ranks - 1) / M) ** n                        # (M,)
    log_f = torch.log((ranks - 0.5) / M)                                          # mid-rank, k = M exact
    logits = (n - 1) * log_f                                                      # log pi_ref is constant
    optimum = torch.softmax(logits, 0)                                            # (M,)
    assert 0.5 * (optimum - best_of_n).abs().sum().item() < 0.01
    kl = (optimum * torch.log(optimum * M)).sum().item()
    assert kl == pytest.approx(best_of_n_kl(n), rel=0.01)
