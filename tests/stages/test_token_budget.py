"""Micro-batches by a token budget (distributed.max_tokens_per_micro_batch): the same global batches
cut by padded tokens, longest first, give the fixed-row path's gradients (every loss is normalised
by the global batch), so each supervised stage's step log equals the fixed-row run's within float
tolerance, with less padding computed."""

from __future__ import annotations

import json
import random

import pytest

from conftest import run_stage, step_rows, tiny_params
from pipeline.training.token_batches import micro_batches, padded_tokens

BUDGET = 160   # padded tokens per micro-batch: several micro-batches per tiny global batch of 16


def test_micro_batches_cover_each_item_once_within_the_budget_longest_first():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(20, 400)
        parts = micro_batches(lengths, 8, budget)
        assert sorted(i for p in parts for i in p) == list(range(len(lengths)))
        for p in parts:
            assert len(p) == 1 or len(p) * max(lengths[i] for i in p) <= budget
        firsts = [lengths[p[0]] for p in parts]
        assert firsts == sorted(firsts, reverse=True)            # the longest micro-batch runs first
        assert all(lengths[p[0]] == max(lengths[i] for i in p) for p in parts)
    assert micro_batches([5, 1, 9, 2, 7], 2, None) == [[0, 1], [2, 3], [4]]   # no budget: fixed rows, in order
    assert micro_batches([5, 1, 9, 2, 7], 2, 18) == [[2, 4], [0, 3, 1]]
    assert padded_tokens([5, 1, 9, 2, 7], [[2, 4], [0, 3, 1]]) == (24, 18 + 15)
    # a micro-batch the loss splits into forwards of its own (the reward model's sorted parts)
    halves = lambda sizes: [sorted(range(len(sizes)), key=sizes.__getitem__)[:2],   # noqa: E731
                            sorted(range(len(sizes)), key=sizes.__getitem__)[2:]]
    assert padded_tokens([5, 1, 9, 2, 7], [[0, 1, 2, 3, 4]], halves) == (24, 2 * 2 + 3 * 9)


@pytest.mark.parametrize("stage", ["sft", "reward", "dpo"])
def test_a_token_budget_trains_as_the_fixed_rows_do_with_less_padding(stage, tiny_data, tiny_models, tmp_path):
    folders = {"data": tiny_data, "sft": tiny_models[0], "reward": tiny_models[1]}
    runs = {}
    for name, budget in (("rows", None), ("tokens", BUDGET)):
        params = tiny_params({stage: {"distributed": {"max_tokens_per_micro_batch": budget}}})
        metrics = run_stage(stage, params, folders, tmp_path / name)
        runs[name] = (metrics, step_rows(tmp_path / name / "train.tsv"))
    (rows_metrics, rows_log), (tok_metrics, tok_log) = runs["rows"], runs["tokens"]
    assert len(rows_log) == len(tok_log) > 1
    for fixed, budgeted in zip(rows_log, tok_log):
        for column in ("loss", "grad_norm"):
            assert float(budgeted[column]) == pytest.approx(float(fixed[column]), rel=1e-4, abs=1e-6), (fixed["step"], column)
    assert tok_metrics["train/pad_share"] < rows_metrics["train/pad_share"]
    assert 0.0 <= tok_metrics["train/pad_share"] and rows_metrics["train/pad_share"] < 1.0
    written = json.loads((tmp_path / "tokens" / "config.json").read_text())
    assert "max_tokens_per_micro_batch" in json.dumps(written)
