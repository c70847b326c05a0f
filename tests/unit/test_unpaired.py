"""KTO's unpaired examples made from preference pairs (pipeline/data/unpaired.py): the mismatched
pairing has no fixed point, and the two halves are disjoint, so no example has its partner."""

from __future__ import annotations

import pytest

from pipeline.data.preferences import Pair
from pipeline.data.unpaired import is_desirable, mismatched, unpaired


def test_mismatched_pairs_every_prompt_with_another_response():
    for n in range(2, 40):
        out = mismatched(n)
        assert sorted(out) == list(range(n)) and all(out[i] != i for i in range(n))
    with pytest.raises(ValueError, match="at least 2"):
        mismatched(1)


def test_unpaired_halves_are_disjoint_and_no_example_has_its_partner():
    pairs = [Pair(f"prompt {i}", f"good {i}", f"bad {i}", 0.0, f"pairs:{i + 1}") for i in range(11)]
    examples = unpaired(pairs, seed=3)
    assert len(examples) == 11
    good = [e for e in examples if is_desirable(e)]
    assert len(good) == 6 and all(e.chosen.startswith("good") for e in good)              # the odd pair: desirable
    assert all(e.chosen.startswith("bad") for e in examples if not is_desirable(e))
    sources = [e.chosen.split()[1] for e in examples]
    assert len(set(sources)) == 11                                    # one response of each pair, never both
    assert all(e.prompt == f"prompt {e.chosen.split()[1]}" for e in examples)   # each response with its own prompt
    # The mismatched response is another example's own, each exactly once.
    assert sorted(e.rejected for e in examples) == sorted(e.chosen for e in examples)
    assert all(e.rejected != e.chosen for e in examples)
    assert unpaired(pairs, seed=3) == examples and unpaired(pairs, seed=4) != examples
    with pytest.raises(ValueError, match="at least 2 preference pairs"):
        unpaired(pairs[:1], seed=0)
