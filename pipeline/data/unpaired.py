"""Unpaired feedback made from preference pairs, for KTO (Ethayarajh et al. 2024): each example is
one response to a prompt, marked desirable or not, with no partner to be compared with.

An example is a `Pair` (so it is tokenised by the pairs' one length rule,
preference.logprobs.fit_pairs): `chosen` is the example's own response, `rejected` its mismatched
response (another example's, for the KL reference point z_ref), and `margin` 1.0 marks it desirable,
0.0 undesirable (`is_desirable`).
"""

from __future__ import annotations

import random
from typing import Sequence

from .preferences import Pair


def mismatched(n: int) -> list[int]:
    """out[i]: the example whose response prompt i is paired with for the KL estimate, i -> i + 1
    (mod n): a permutation with no fixed point, so every prompt gets another example's response and
    the mismatched responses are the data's own. n == 1 is refused: the only response is the
    example's own, and z_ref would be its own reward."""
    if n < 2:
        raise ValueError(f"the KL estimate needs at least 2 examples, got {n}")
    return [(i + 1) % n for i in range(n)]


def unpaired(pairs: Sequence[Pair], seed: int) -> list[Pair]:
    """Unpaired examples from preference pairs (module doc). A seeded permutation splits the pairs
    into two disjoint halves: the chosen response of each pair of the first half is desirable, the
    rejected response of each pair of the second undesirable (the first half takes the extra pair of
    an odd count, so with lambda_d = lambda_u the ratio n_d / n_u stays in the paper's advised
    [1, 4/3] once counts are large), so the contrast DPO learns from is not in the data; the examples
    are shuffled, then each takes the next one's response as its mismatched one."""
    if len(pairs) < 2:
        raise ValueError(f"KTO needs at least 2 preference pairs, got {len(pairs)}")
    rng = random.Random(seed)
    order = list(range(len(pairs)))
    rng.shuffle(order)
    half = (len(pairs) + 1) // 2
    own = [(pairs[i], pairs[i].chosen, True) for i in order[:half]] + \
          [(pairs[i], pairs[i].rejected, False) for i in order[half:]]
    rng.shuffle(own)
    other = mismatched(len(own))
    return [Pair(p.prompt, response, own[other[k]][1], 1.0 if good else 0.0, p.where)
            for k, (p, response, good) in enumerate(own)]


def is_desirable(example: Pair) -> bool:
    """Whether an example of `unpaired` is a desirable one."""
    return example.margin > 0
