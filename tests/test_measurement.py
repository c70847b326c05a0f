"""The one policy-measurement function: what it samples is what generate_texts samples, its KL is
the per-token log-prob difference of each sequence on its own, its summary the shared statistics."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pipeline.config import ModelConfig, SamplingConfig
from pipeline.data.tokenizer import build_word_tokenizer, encode_prompt, encode_response
from pipeline.measurement.policy import measure, sequence_kl, summary
from pipeline.measurement.stats import distinct_n, mean_ci
from pipeline.models.checkpoints import tiny_config
from pipeline.models.generation import generate_texts
from pipeline.tasks import reviews

PROMPTS = ["Review the film Silent River . Focus on the music .",
           "What did you think of Lost Lantern ? Talk about the acting .",
           "Write a review of the film Bitter Road . Discuss the visuals ."]


@pytest.fixture(scope="module")
def models():
    tok = build_word_tokenizer(reviews.vocabulary())
    cfg = ModelConfig(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2)
    out = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        out.append(AutoModelForCausalLM.from_config(tiny_config(cfg, tok)).eval())
    return out[0], out[1], tok


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


def test_measure_samples_as_generate_texts_and_scores_each_response(models):
    policy, ref, tok = models
    sampling = SamplingConfig(max_new_tokens=12)
    texts, ended = generate_texts(policy, tok, PROMPTS, sampling, seed=5, greedy=False)
    m = measure(policy, tok, PROMPTS, sampling, 5, reward=lambda p, t: torch.tensor([float(len(x)) for x in t]),
                judge=reviews.gold_score, ref=ref)
    assert (m.texts, m.ended) == (texts, ended)
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
