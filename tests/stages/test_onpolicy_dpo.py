"""The `onpolicy_dpo` stage (pipeline/stages/onpolicy_dpo.py): its pairs are the reward model's best
and worst of the SFT policy's own samples of each training prompt, a run trains on them with DPO's
task and writes what it declares, reused pairs give the same run, and its params' errors."""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import assert_same_run, merge, read_sampled, redrawn, tiny_params
from pipeline.config import load_params
from pipeline.data.preferences import load_pairs
from pipeline.data.tokenizer import load_tokenizer
from pipeline.errors import ConfigError, DataError
from pipeline.measurement.policy import Measured
from pipeline.models.checkpoints import load_policy
from pipeline.stages import metric_registry, onpolicy_dpo, sampled
from pipeline.tracking import metric_names

SECTION = {"samples_per_prompt": 3, "n_prompts": 8, "batch_size": 4, "epochs": 1.0, "eval_every": 1,
           "save_every": 1, "n_eval_prompts": 4, "lr": 3e-3, "sampling": {"max_new_tokens": 8}}


def _params(**override):
    return tiny_params({"onpolicy_dpo": merge(SECTION, override)})


@pytest.fixture(scope="module")
def done(tiny_data, tiny_models, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("onpolicy_run") / "onpolicy_dpo"
    return out, onpolicy_dpo.run(_params(), tiny_data, *tiny_models, out, progress=False)


def test_pick_pairs_takes_the_best_and_worst_sample_and_skips_ties():
    # scores[k][i]: sample k of prompt i
    scores = [[1.0, 2.0, 0.5, 3.0], [1.0, 3.0, 0.7, 1.0], [1.0, 3.0, 0.5, 0.0]]
    assert onpolicy_dpo.pick_pairs(scores) == [None, (1, 0), (1, 0), (0, 2)]


def test_one_response_scored_twice_is_no_pair(tiny_data):
    """The same text drawn twice is scored in two batches, so its two scores may differ in the last
    bits: that is no preference, and such a prompt gives no pair (two equal responses would be refused
    as a pair anyway)."""
    tok = load_tokenizer(tiny_data / "tokenizer")
    samples = [Measured(["a great film", "the music"], [True, True], {"rm": [1.0, 0.2]}),
               Measured(["a great film", "the music is awful"], [True, True], {"rm": [1.0 + 1e-6, -0.4]})]
    rows, stats = onpolicy_dpo.select(["p0", "p1"], samples, tok)
    assert rows == [{"prompt": "p1", "chosen": "the music", "rejected": "the music is awful",
                     "rm_chosen": 0.2, "rm_rejected": -0.4}]
    assert stats["onpolicy_dpo/pairs"] == 1 and stats["onpolicy_dpo/prompts"] == 2
    assert stats["onpolicy_dpo/rm_samples"] == pytest.approx((1.0 + 0.2 + 1.0 + 1e-6 - 0.4) / 4)


def test_pairs_are_each_prompts_best_and_worst_own_sample_by_the_reward_model(done, tiny_data, tiny_models):
    """The samples drawn again by hand (sample k: prompt i alone from the stream of (seed + k, i),
    over the first n_prompts training prompts) and scored with score_texts: each pair is the first
    highest- against the first lowest-scoring one, none of them a response of the dataset."""
    out, _ = done
    params = _params()
    cfg = params.onpolicy_dpo
    prompts, texts, scores = redrawn(params, tiny_data, tiny_models, cfg, cfg.samples_per_prompt)   # scores (k, N)

    header, rows = read_sampled(out / onpolicy_dpo.PAIRS)
    assert 0 < len(rows) <= len(prompts) == header["stats"]["onpolicy_dpo/prompts"]
    assert all(r["rm_chosen"] > r["rm_rejected"] for r in rows)
    by_prompt = {r["prompt"]: r for r in rows}
    assert len(by_prompt) == len(rows)   # one pair per prompt at most
    for i, prompt in enumerate(prompts):
        column = scores[:, i]
        best, worst = int(torch.argmax(column)), int(torch.argmin(column))   # the first of tied ones
        if column[best] == column[worst]:
            assert prompt not in by_prompt
            continue
        pair = by_prompt[prompt]
        assert (pair["chosen"], pair["rejected"]) == (texts[best][i], texts[worst][i])
        assert (pair["rm_chosen"], pair["rm_rejected"]) == pytest.approx((float(column[best]), float(column[worst])),
                                                                         abs=1e-5)
    assert any(r["chosen"] != texts[0][prompts.index(r["prompt"])] for r in rows), "the test could not fail"
    dataset = {text for split in ("pairs_train.jsonl", "pairs_eval.jsonl")
               for p in load_pairs(tiny_data / split) for text in (p.chosen, p.rejected)}
    assert not dataset & {text for r in rows for text in (r["chosen"], r["rejected"])}
    stats = header["stats"]
    assert stats["onpolicy_dpo/pairs"] == len(rows)
    assert stats["onpolicy_dpo/rm_samples"] == pytest.approx(float(scores.mean()), abs=1e-5)
    assert stats["onpolicy_dpo/rm_chosen"] > stats["onpolicy_dpo/rm_rejected"]


def test_a_run_trains_on_the_pairs_and_writes_what_it_declares(done):
    out, metrics = done
    _, rows = read_sampled(out / onpolicy_dpo.PAIRS)
    assert metrics["train/steps"] == math.ceil(len(rows) / 4)   # one epoch of the sampled pairs, batches of 4
    assert metrics["onpolicy_dpo/pairs"] == len(rows) and 0.0 <= metrics["eval/accuracy"] <= 1.0
    numbers = [v for v in metrics.values() if isinstance(v, (int, float))]
    assert len(numbers) == len(metrics) and all(math.isfinite(v) for v in numbers)
    load_policy(out / "model")
    assert json.loads((out / "config.json").read_text())["onpolicy_dpo"]["samples_per_prompt"] == 3
    # Every name written is declared for the stage, and every name declared for it was written.
    declared = [s for s in metric_registry.stage_metrics() if s.stage == "onpolicy_dpo"]
    assert metric_names.check_run(out.parent, declared, {"compare"}) == ([], [])


def test_reused_pairs_give_the_same_run_and_a_sampling_change_samples_again(done, tiny_data, tiny_models, tmp_path,
                                                                             monkeypatch):
    """A run in a fresh folder holding the first run's pairs file samples nothing and trains the
    same weights bit for bit (the training is deterministic given its pairs); a changed sampling
    param samples again."""
    first, metrics = done
    (tmp_path / "again").mkdir()
    shutil.copy(first / onpolicy_dpo.PAIRS, tmp_path / "again" / onpolicy_dpo.PAIRS)

    def no_sampling(*args, **kwargs):
        raise AssertionError("the pairs were sampled again")
    monkeypatch.setattr(sampled, "scored_draws", no_sampling)
    again = onpolicy_dpo.run(_params(), tiny_data, *tiny_models, tmp_path / "again", progress=False)
    assert_same_run(first, tmp_path / "again", metrics, again)
    with pytest.raises(AssertionError, match="sampled again"):
        onpolicy_dpo.run(_params(samples_per_prompt=2), tiny_data, *tiny_models, tmp_path / "again", progress=False)


@pytest.mark.parametrize("section, message", [
    ({"samples_per_prompt": 1}, r"onpolicy_dpo\.samples_per_prompt: expected an integer >= 2 and <= 4, got 1"),
    ({"samples_per_prompt": 5}, r"onpolicy_dpo\.samples_per_prompt: expected an integer >= 2 and <= 4, got 5"),
    ({"n_prompts": 0}, r"onpolicy_dpo\.n_prompts: expected an integer >= 1, got 0"),
    ({"sampling": {"temprature": 1.0}}, r"onpolicy_dpo\.sampling\.temprature: unknown key"),
    ({"dataset": {"margin_column": "m"}}, r"onpolicy_dpo\.dataset\.margin_column: DPO, IPO and SimPO use no per-pair"),
])
def test_config_errors_name_the_file_and_key(section, message, tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(json.dumps({"onpolicy_dpo": section}))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {message}"):   # the path as given
        load_params(path)


def test_more_prompts_than_the_split_holds_is_an_error_naming_the_key(tiny_data, tiny_models, tmp_path):
    with pytest.raises(DataError, match=r"^onpolicy_dpo\.n_prompts: 17 prompts asked for, the train split"):
        onpolicy_dpo.run(_params(n_prompts=17), tiny_data, *tiny_models, tmp_path, progress=False)
    assert not (tmp_path / onpolicy_dpo.PAIRS).exists() and not (tmp_path / "model").exists()


def test_its_plan_counts_the_sampling_and_the_sft_policy_it_measures_against(tiny_data):
    """The memory plan's measurement term: the SFT policy loaded beside the trained one for the KL
    (fp32 here) and the sampling work of the longer of its two samplings (as the rs stage's)."""
    from pipeline.config import Params
    from pipeline.stages import registry
    from pipeline.training import memory_plan as mp, memory_terms as mt
    params = Params()
    sft = mt.shape_of(mt.policy_config(params, tiny_data))
    plan, = mp.planned(params, tiny_data, {"onpolicy_dpo": registry.spec("onpolicy_dpo").plan})
    new = max(params.prompts.sampling.max_new_tokens, params.onpolicy_dpo.sampling.max_new_tokens)
    assert plan.device["measurement"] == 4 * sft.params + mt.measurement_bytes(sft, params.prompts.max_length, new, 4)
