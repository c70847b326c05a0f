"""The `rs` stage (pipeline/stages/rs.py): the winners are the reward model's favourites among the
SFT policy's candidates, a short run's outputs, resume after a kill during fine-tuning (the winners
reused, not sampled again), and its params' errors."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import assert_same_run, die_in_step, merge, read_sampled, redrawn, step_rows, tiny_params
from pipeline.config import Params, check_process_shape, from_dict, load_params
from pipeline.errors import ConfigError, DataError
from pipeline.models.checkpoints import load_policy
from pipeline.stages import rs, sampled

RS = {"n": 4, "n_prompts": 12, "batch_size": 4, "epochs": 1.0, "eval_every": 2, "save_every": 2,
      "n_eval_prompts": 4, "lr": 3e-3, "sampling": {"max_new_tokens": 8}}


def _params(**override) -> Params:
    return tiny_params({"rs": merge(RS, override)})


@pytest.fixture(scope="module")
def done(tiny_data, tiny_models, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("rs_run") / "rs"
    metrics = rs.run(_params(), tiny_data, *tiny_models, out, progress=False)
    return out, metrics




def test_pick_winners_takes_the_first_of_tied_best():
    # scores[k][i]: candidate k of prompt i
    assert rs.pick_winners([[1.0, 2.0, 0.5], [1.0, 3.0, 0.7], [0.9, 3.0, 0.6]]) == [0, 1, 1]


def test_winners_are_the_rm_argmax_of_each_prompts_candidates(done, tiny_data, tiny_models):
    """Candidates drawn again by hand (candidate k: prompt i alone from the stream of (rs.seed + k, i),
    over the first rs.n_prompts training prompts) and scored with score_texts: each winner is the first highest-scoring one."""
    out, _ = done
    params = _params()
    cfg = params.rs
    prompts, texts, scores = redrawn(params, tiny_data, tiny_models, cfg, cfg.n)   # scores (n, N)
    best = [int(torch.nonzero(scores[:, i] == scores[:, i].max())[0]) for i in range(len(prompts))]

    header, rows = read_sampled(out / rs.WINNERS)
    assert [r["prompt"] for r in rows] == prompts
    assert [r["response"] for r in rows] == [texts[k][i] for i, k in enumerate(best)]
    assert [r["rm"] for r in rows] == pytest.approx([float(scores[k, i]) for i, k in enumerate(best)], abs=1e-5)
    assert any(k != 0 for k in best), "every winner is the first candidate: the test could not fail"
    stats = header["stats"]
    assert stats["rs/rm_candidates"] == pytest.approx(float(scores.mean()), abs=1e-5)
    assert stats["rs/rm_winners"] == pytest.approx(float(scores.max(0).values.mean()), abs=1e-5)
    assert stats["rs/winners_kept"] == len(rows) == cfg.n_prompts


def test_a_short_run_writes_a_loadable_model_and_finite_metrics(done):
    out, metrics = done
    weights = load_file(out / "model/model.safetensors")
    assert weights and all(torch.isfinite(w).all() for w in weights.values())
    load_policy(out / "model")
    numbers = {k: v for k, v in metrics.items() if isinstance(v, (int, float))}
    assert numbers == metrics and all(math.isfinite(v) for v in numbers.values())
    for key in ("train/loss", "eval/loss", "rs/rm", "rs/kl", "rs/gold",
                "rs/eos_rate", "rs/rm_winners", "rs/rm_candidates", "rs/gold_winners", "rs/gold_candidates"):
        assert key in metrics, key
    assert metrics["rs/rm_winners"] >= metrics["rs/rm_candidates"]
    assert metrics["train/steps"] == 3   # 12 winners in batches of 4, one epoch
    assert json.loads((out / "metrics.json").read_text())
    assert json.loads((out / "config.json").read_text())["rs"]["n"] == 4
    assert len(step_rows(out / "train.tsv")) == 3 and len(step_rows(out / "eval.tsv")) == 2


def test_killed_during_fine_tuning_resumes_with_the_same_winners_and_weights(tiny_data, tiny_models, tmp_path, monkeypatch):
    params = _params(n_prompts=16)     # 4 steps: killed in step 4, the save of step 2 exists
    full = rs.run(params, tiny_data, *tiny_models, tmp_path / "full", progress=False)

    die_in_step(monkeypatch, "rs step 4")
    with pytest.raises(KeyboardInterrupt):
        rs.run(params, tiny_data, *tiny_models, tmp_path / "resumed", progress=False)
    assert json.loads((tmp_path / "resumed/checkpoint/state.json").read_text())["step"] == 2
    assert not (tmp_path / "resumed/model").exists()
    winners = (tmp_path / "resumed" / rs.WINNERS).read_bytes()
    monkeypatch.undo()

    def no_sampling(*args, **kwargs):
        raise AssertionError("the winners were sampled again")
    monkeypatch.setattr(sampled, "scored_draws", no_sampling)
    resumed = rs.run(params, tiny_data, *tiny_models, tmp_path / "resumed", progress=False)

    assert (tmp_path / "resumed" / rs.WINNERS).read_bytes() == winners == (tmp_path / "full" / rs.WINNERS).read_bytes()
    assert_same_run(tmp_path / "full", tmp_path / "resumed", full, resumed)

    # Fine-tuning params alone changed: the winners are still reused; a sampling param resamples.
    other = rs.run(_params(n_prompts=16, lr=1e-3), tiny_data, *tiny_models, tmp_path / "resumed", progress=False)
    assert other["train/loss"] != resumed["train/loss"]
    with pytest.raises(AssertionError, match="sampled again"):
        rs.run(_params(n_prompts=16, n=3), tiny_data, *tiny_models, tmp_path / "resumed", progress=False)


def test_min_score_leaves_low_winners_out(done, tiny_data, tiny_models, tmp_path):
    _, rows = read_sampled(done[0] / rs.WINNERS)
    cut = sorted(r["rm"] for r in rows)[len(rows) // 2]
    params = _params(min_score=cut)
    metrics = rs.run(params, tiny_data, *tiny_models, tmp_path, progress=False)
    _, kept = read_sampled(tmp_path / rs.WINNERS)
    assert kept and all(r["rm"] >= cut for r in kept)
    assert metrics["rs/winners_kept"] == len(kept) == sum(r["rm"] >= cut for r in rows)


@pytest.mark.parametrize("section, message", [
    ({"n": 1}, r"rs\.n: expected an integer >= 2, got 1"),
    ({"bogus": 3}, r"rs\.bogus: unknown key"),
    ({"n_prompts": 0}, r"rs\.n_prompts: expected an integer >= 1, got 0"),
    ({"lr": "fast"}, r"rs\.lr: expected a positive float"),
    ({"sampling": {"temprature": 1.0}}, r"rs\.sampling\.temprature: unknown key"),
])
def test_config_errors_name_the_file_and_key(section, message, tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(json.dumps({"rs": section}))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}: {message}"):   # the path as given
        load_params(path)


def test_batch_split_is_checked_when_the_stage_starts(tmp_path):
    # Not at load (its SPEC's shape: "start"): a distributed setup for the default pipeline must not be
    # refused over the sizes of a comparison stage it does not run.
    path = tmp_path / "params.yaml"
    path.write_text(json.dumps({"rs": {"batch_size": 3, "distributed": {"gradient_accumulation_steps": 2}}}))
    params = load_params(path)
    with pytest.raises(ConfigError, match=r"^rs\.batch_size: 3 must be divisible by processes x gradient_accumulation"):
        check_process_shape(params, "rs")


def test_defaults_load():
    cfg = from_dict(Params, {}, "params.yaml: ").rs
    assert cfg.n >= 2 and cfg.min_score is None and cfg.n_prompts is None and cfg.sampling.max_new_tokens > 0


def test_a_min_score_above_every_winner_is_an_error_naming_it(tiny_data, tiny_models, tmp_path):
    with pytest.raises(DataError, match=r"^rs\.min_score: every winner scores below 100\.0"):
        rs.run(_params(min_score=100.0), tiny_data, *tiny_models, tmp_path, progress=False)
    assert not (tmp_path / rs.WINNERS).exists() and not (tmp_path / "model").exists()


def test_more_prompts_than_the_split_holds_is_an_error_naming_the_key(tiny_data, tiny_models, tmp_path):
    with pytest.raises(DataError, match=r"^rs\.n_prompts: 17 prompts asked for, the train split of prompts.dataset has 16"):
        rs.run(_params(n_prompts=17), tiny_data, *tiny_models, tmp_path, progress=False)


def test_a_stop_token_of_two_tokens_is_refused_naming_rs_sampling_before_sampling(tiny_data, tiny_models,
                                                                                   tmp_path):
    with pytest.raises(ConfigError) as err:
        rs.run(_params(sampling={"stop_token": "good film"}), tiny_data, *tiny_models, tmp_path,
               progress=False)
    assert str(err.value) == "rs.sampling.stop_token: 'good film' is not a single token of the tokenizer"
    assert not (tmp_path / rs.WINNERS).exists()
