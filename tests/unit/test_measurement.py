"""The one policy-measurement function: each prompt's response is the one its own seeded stream
draws (whatever its batch), its KL is the per-token log-prob difference of each sequence on its
own, its summary the shared statistics."""

from __future__ import annotations

import pytest
import torch

from pipeline.config import ModelConfig, SamplingConfig
from pipeline.data.tokenizer import encode_prompt, encode_response
from conftest import random_policies, sampled_alone
from pipeline.measurement.policy import GENERATION_BATCH, Policy, measure, measure_policies, prompt_seed, sequence_kl, summary
from pipeline.measurement.stats import distinct_n, mean_ci
from pipeline.tasks import reviews

PROMPTS = ["Review the film Silent River . Focus on the music .",
           "What did you think of Lost Lantern ? Talk about the acting .",
           "Write a review of the film Bitter Road . Discuss the visuals ."]


@pytest.fixture(scope="module")
def models():
    (policy, ref), tok = random_policies(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2))
    return policy, ref, tok


def test_sequence_kl_is_each_sequence_alone_summed_over_its_response(models):
    policy, ref, tok = models
    responses = ["the music is good . in short , a fine film .", "I loved the acting .", "the visuals felt dull ."]
    got = sequence_kl(policy, ref, tok, PROMPTS, responses, temperature=0.7)
    for prompt, response, value in zip(PROMPTS, responses, got):
        p, r = encode_prompt(tok, prompt), encode_response(tok, response)
        ids = torch.tensor([p + r])
        with torch.no_grad():
            diff = sum(sign * torch.log_softmax(m(input_ids=ids).logits[0, len(p) - 1:-1] / 0.7, -1)
                       .gather(-1, torch.tensor(r)[:, None]).sum() for m, sign in ((policy, 1), (ref, -1)))
        assert value == pytest.approx(float(diff), abs=1e-4)
    assert sequence_kl(policy, policy, tok, PROMPTS, responses, 1.0) == [0.0, 0.0, 0.0]


class Lengths:
    """A reward source scoring a response by its length in characters."""

    def score(self, prompts, responses):
        return torch.tensor([float(len(x)) for x in responses])


def test_measure_samples_each_prompt_from_its_own_stream_and_scores_each_response(models):
    policy, ref, tok = models
    sampling = SamplingConfig(max_new_tokens=12)
    texts = sampled_alone(policy, tok, PROMPTS, sampling, seed=5)
    m = measure(policy, tok, PROMPTS, sampling, 5, reward=Lengths(), judge=reviews.gold_score, ref=ref)
    assert m.texts == texts
    ended = m.ended
    assert m.values["rm"] == [float(len(t)) for t in texts]
    assert m.values["gold"] == [reviews.gold_score(p, t) for p, t in zip(PROMPTS, texts)]
    assert m.values["kl"] == pytest.approx(sequence_kl(policy, ref, tok, PROMPTS, texts, 1.0))
    s = summary(m, lambda key: f"x/{key}")
    for key in ("rm", "gold", "kl"):
        assert (s[f"x/{key}"], s[f"x/{key}_ci95"]) == mean_ci(m.values[key])
    assert s["x/eos_rate"] == sum(ended) / 3 and s["x/distinct_2"] == distinct_n(texts, 2)
    assert s["x/length"] == sum(len(t.split()) for t in texts) / 3
    # Only what is asked for is measured.
    assert measure(policy, tok, PROMPTS, sampling, 5).values == {}


def test_prompt_seeds_differ_in_the_low_32_bits_the_cpu_generator_uses():
    seeds = {prompt_seed(s, i) & 0xFFFFFFFF for s in range(4) for i in range(2000)}
    assert len(seeds) == 8000
    assert prompt_seed(0, 1) != prompt_seed(1, 0) and prompt_seed(3, 7) == prompt_seed(3, 7)


def test_a_prompts_response_does_not_depend_on_the_batch_it_is_sampled_in(models):
    """Responses to 70 prompts in batches of 64 (and 6) equal those in batches of 8 and of 70."""
    policy, _, tok = models
    prompts = (PROMPTS * 24)[:70]
    sampling = SamplingConfig(max_new_tokens=10)
    got = {b: measure_policies([Policy("p", policy, 3)], tok, prompts, sampling, batch_size=b)["p"].texts
           for b in (GENERATION_BATCH, 8, 70)}
    assert got[GENERATION_BATCH] == got[8] == got[70]
    assert len(set(got[8][::3])) > 1   # the same prompt, other indices: other responses


def test_the_tally_keeps_the_largest_spread_of_batches_over_ranks():
    """A stage's tally (measurement/balance.py) keeps the largest most-minus-fewest batches over its
    measurements; one tallied inside another keeps its own; nothing is kept outside a tally."""
    from pipeline.measurement import balance
    balance.record([3, 1])   # no tally open: dropped
    with balance.tallying() as outer:
        assert outer.imbalance is None
        balance.record([2, 2])
        with balance.tallying() as inner:
            balance.record([1, 0])
        balance.record([4, 3, 4])
    assert (outer.imbalance, inner.imbalance) == (1, 1)
    with balance.tallying() as tally:
        balance.record([5, 2])
        balance.record([1, 1])
    assert tally.imbalance == 3


def test_a_measurement_records_each_ranks_batches():
    """measure_policies records its batch count per rank: one process, none spread."""
    from pipeline.measurement import balance
    (model,), tok = random_policies(ModelConfig(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2),
                                    seeds=(0,))
    with balance.tallying() as tally:
        measure(model, tok, ["Review the film Silent River ."] * 3, SamplingConfig(max_new_tokens=2), seed=0)
    assert tally.imbalance == 0
