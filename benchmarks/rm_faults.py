"""Does a reward model notice a broken sentence, or a review on the wrong aspect? A review against
a copy of itself with one fault.

    .venv/bin/python benchmarks/rm_faults.py outputs/reward/model [OTHER_RM ...]

PPO finds what its reward model cannot see. Reviews of the task's sampler break in one way only (a
sentence losing its last two words), so a reward model trained on them may score a review with two
sentences run together, or a word dropped, as well as the intact one, while the annotator takes 1
point or more off. For each kind of fault of `reviews.corrupt`, this draws reviews on the
evaluation titles (the task's sampler, seed 778), corrupts each once, keeps the pairs where the
annotator scores the corrupted copy lower, and prints per model the fraction where the reward model
prefers the intact review (0.5: blind to that fault; 1: always sees it) and the mean score gap.
The column `aspect` does the same for `reviews.swap_aspect`: a review against itself turned
to or away from the asked aspect, the one the annotator prefers counted as the intact one. PPO's
residual losses are mostly reviews that praise another aspect, so a reward model that trades this
column for the fault columns trades one exploit for another. The last column, `exchange`, is
`reviews.exchange_aspects`: the asked aspect and another one the review discusses, traded, so that
only what is said of the asked aspect changes. A reward model can see that the asked aspect is named
(`aspect` near 1) and not what is said of it (`exchange` near 0.5).
Defaults follow params.yaml's `data` section and `reward.max_length`.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.config import load_params  # noqa: E402
from pipeline.models import reward_model as rm  # noqa: E402
from pipeline.stages import prepare  # noqa: E402
from pipeline.tasks import reviews  # noqa: E402

N_REVIEWS, SEED = 1000, 778


def fault_pairs(seed: int, eval_fraction: float) -> dict[str, tuple[list[str], list[str], list[str]]]:
    """Per fault kind, "aspect" and "exchange": (prompts, intact reviews, worse copies), only where
    gold differs; for "aspect" and "exchange" the review the annotator prefers comes first."""
    _, eval_titles = reviews.split_titles(random.Random(seed), eval_fraction)   # prepare's title split
    rng = random.Random(SEED)
    prompts = prepare._prompts(rng, eval_titles, N_REVIEWS)
    intact = [reviews.sample_review(rng, p) for p in prompts]
    out = {}
    for kind in reviews.CORRUPTIONS:
        rows = [(p, r, reviews.corrupt(rng, r, kind)) for p, r in zip(prompts, intact)]
        rows = [(p, r, c) for p, r, c in rows if c is not None and reviews.gold_score(p, c) < reviews.gold_score(p, r)]
        out[kind] = tuple(map(list, zip(*rows)))
    # A review against itself with its aspects moved: the version the annotator prefers first.
    for name, move in (("aspect", reviews.swap_aspect), ("exchange", reviews.exchange_aspects)):
        rows = []
        for p, r in zip(prompts, intact):
            s = move(rng, p, r)
            if s is not None and reviews.gold_score(p, s) != reviews.gold_score(p, r):
                rows.append((p, *sorted((r, s), key=lambda x: -reviews.gold_score(p, x))))
        out[name] = tuple(map(list, zip(*rows)))
    return out


def main(dirs: list[str]) -> None:
    params = load_params(ROOT / "params.yaml")
    pairs = fault_pairs(params.data.seed, params.data.eval_title_fraction)
    for d in dirs:
        model, tok = rm.load_reward_model(d)
        cells = []
        for kind, (prompts, intact, broken) in pairs.items():
            s_ok = rm.score_texts(model, tok, prompts, intact, params.reward.max_length)     # (N,)
            s_bad = rm.score_texts(model, tok, prompts, broken, params.reward.max_length)    # (N,)
            sees = float(torch.where(s_ok == s_bad, 0.5, (s_ok > s_bad).float()).mean())
            cells.append(f"{kind} {sees:.2f} (gap {float((s_ok - s_bad).mean()):+.2f}, n={len(prompts)})")
        print(f"{d}: prefers the intact review: " + "; ".join(cells))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1:])
