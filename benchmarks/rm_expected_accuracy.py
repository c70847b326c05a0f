"""Reward models compared without label noise: expected accuracy on fresh held-out pairs.

    .venv/bin/python benchmarks/rm_expected_accuracy.py outputs/reward/model [OTHER_RM ...]

The held-out accuracy in metrics.json is measured on one draw of 1000 noisy labels, which moves it by
about ±1.3 points. Here every reward model scores the same 5000 new pairs on the evaluation titles
(the default task's sampler, seed 777), and each pair counts with the annotator's probability that
the model's pick is the one a label would prefer: sigmoid((gold(pick) - gold(other)) / T). Its
ceiling is the same sum for the gold ordering. Prints, per model, expected accuracy / ceiling.
Defaults follow params.yaml's `data` section (seed, eval_title_fraction, label_temperature) and
`reward.max_length`.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.stages import prepare
from pipeline.models import reward_model as rm
from pipeline.config import load_params  # noqa: E402
from pipeline.tasks import reviews  # noqa: E402

N_PAIRS, SEED = 5000, 777


def fresh_pairs(seed: int, eval_fraction: float, temperature: float) -> tuple[list[str], list[str], list[str], torch.Tensor]:
    """N_PAIRS (prompt, chosen, rejected) on the evaluation titles, sampled as prepare samples them,
    and P(chosen preferred) under the annotator: (N,). Only the probability is used, not the label."""
    _, eval_titles = reviews.split_titles(random.Random(seed), eval_fraction)  # prepare's title split
    rng = random.Random(SEED)
    rows = prepare.make_pairs(rng, prepare._prompts(rng, eval_titles, N_PAIRS), temperature)
    prompts = [r["prompt"] for r in rows]
    chosen, rejected = [r["chosen"] for r in rows], [r["rejected"] for r in rows]
    gap = torch.tensor([reviews.gold_score(p, c) - reviews.gold_score(p, r)
                        for p, c, r in zip(prompts, chosen, rejected)], dtype=torch.float64)
    return prompts, chosen, rejected, torch.sigmoid(gap / temperature)


def main(dirs: list[str]) -> None:
    params = load_params(ROOT / "params.yaml")
    prompts, a, b, p_a = fresh_pairs(params.data.seed, params.data.eval_title_fraction, params.data.label_temperature)
    ceiling = float(torch.maximum(p_a, 1 - p_a).mean())
    for d in dirs:
        model, tok = rm.load_reward_model(d)
        s_a = rm.score_texts(model, tok, prompts, a, params.reward.max_length)      # (N,)
        s_b = rm.score_texts(model, tok, prompts, b, params.reward.max_length)      # (N,)
        p_pick = torch.where(s_a > s_b, p_a, torch.where(s_a < s_b, 1 - p_a, torch.full_like(p_a, 0.5)))
        expected = float(p_pick.mean())
        print(f"{d}: expected accuracy {expected:.4f} / ceiling {ceiling:.4f} = {100 * expected / ceiling:.1f}% of the ceiling")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1:])
