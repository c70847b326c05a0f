"""How a supervised stage's global batch becomes forwards, without changing what it trains on.
Micro-batches by a token budget (distributed.max_tokens_per_micro_batch): the same global batches
cut by padded tokens, longest first, give the fixed-row path's gradients (every loss is normalised
by the global batch), so each supervised stage's step log equals the fixed-row run's within float
tolerance, with less padding computed. Packing (sft.packing, rs.packing, reward.packing, dpo.packing,
kto.packing, ppo.packing, evaluate.packing): a micro-batch's sequences in one row with restarting
positions give the padded rows' losses, scores, log-probs, values and gradients, a stage trains as
it does padded with no padding, and its reference, held-out and scoring passes measure the same."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import run_stage, step_rows, tiny_params
from pipeline.context import SINGLE
from pipeline.data.padding import micro_batches
from pipeline.training.token_batches import Run, agreed_runs, padded_tokens

BUDGET = 160   # padded tokens per micro-batch: several micro-batches per tiny global batch of 16


class _Ranks:
    """A process among several whose gather returns every rank's count."""
    world_size = 2

    def __init__(self, counts):
        self.counts = counts

    def gather(self, value):
        return [[n] for n in self.counts]


def test_every_rank_runs_the_largest_count_of_micro_batches_the_short_ones_zero_weighted_repeats():
    assert agreed_runs(2, None, SINGLE) == [Run(0, False, None), Run(1, False, None)]
    assert agreed_runs(2, 100, SINGLE) == [Run(0, False, False), Run(1, False, True)]
    # fixed rows: every rank has the same count and tells DeepSpeed nothing
    assert agreed_runs(1, None, _Ranks([3, 1])) == [Run(0, False, None)]
    assert agreed_runs(1, 100, _Ranks([3, 1])) == [Run(0, False, False), Run(0, True, False), Run(0, True, True)]
    assert agreed_runs(3, 100, _Ranks([3, 1])) == [Run(0, False, False), Run(1, False, False), Run(2, False, True)]


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


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_a_packed_row_gives_the_padded_rows_loss_and_gradients(attention):
    """Examples of uneven lengths: one packed row (position ids restarting, no mask) against
    right-padded rows, the SFT loss and every parameter's gradient equal within fp32 tolerance."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from pipeline.data.records import Example, collate_packed, collate_sft
    from pipeline.training.demonstrations import ce_sum
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0,
                                         attn_implementation=attention))
    gen = torch.Generator().manual_seed(1)
    examples = [Example(torch.randint(1, 50, (n,), generator=gen).tolist(), p) for n, p in ((9, 3), (23, 10), (4, 2), (15, 1))]
    out = []
    for batch in (collate_sft(examples, 0), collate_packed(examples)):
        model.zero_grad()
        loss, n = ce_sum(model, batch)
        loss.backward()
        out.append((loss.detach(), n, {k: p.grad.clone() for k, p in model.named_parameters()}))
    (padded, n_padded, g_padded), (packed, n_packed, g_packed) = out
    assert n_padded == n_packed == sum(len(e.input_ids) - e.n_prompt for e in examples)
    assert collate_packed(examples)["input_ids"].shape == (1, 9 + 23 + 4 + 15)
    torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-5)
    for name, grad in g_padded.items():
        torch.testing.assert_close(g_packed[name], grad, atol=1e-6, rtol=1e-4, msg=name)


def test_the_sft_stage_packed_trains_as_padded_with_no_padding(tiny_data, tmp_path):
    runs = {}
    for packing in (False, True):
        params = tiny_params({"sft": {"packing": packing}})
        metrics = run_stage("sft", params, {"data": tiny_data}, tmp_path / str(packing))
        runs[packing] = (metrics, step_rows(tmp_path / str(packing) / "train.tsv"))
    (padded, padded_log), (packed, packed_log) = runs[False], runs[True]
    for a, b in zip(padded_log, packed_log, strict=True):
        for column in ("loss", "grad_norm"):
            assert float(b[column]) == pytest.approx(float(a[column]), rel=1e-4, abs=1e-6), (a["step"], column)
    assert packed["train/pad_share"] == 0.0 < padded["train/pad_share"]
    assert packed["eval/loss"] == pytest.approx(padded["eval/loss"], rel=1e-4)


def _tiny_llama(cls, dtype=torch.float64):
    """A 2-layer Llama (SDPA attention) of `cls`, seeded, in `dtype`."""
    from transformers import LlamaConfig
    torch.manual_seed(0)
    return cls(LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, num_labels=1,
                           attn_implementation="sdpa")).to(dtype)


def _ids(*lengths: int, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 50, (n,), generator=gen).tolist() for n in lengths]


def _loss_and_grads(model, loss_of) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    loss = loss_of()
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and len(want) > 5
    for name, grad in want.items():
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(got[name], grad, atol=1e-9, rtol=1e-5, msg=name)


def test_a_packed_row_gives_the_padded_rows_reward_scores_loss_and_gradients():
    """Pairs of uneven lengths (one sequence a single token): their 2N sequences end to end in one
    row (reward.packing) against length-sorted padded rows (several parts), the scores, the
    Bradley-Terry loss and every parameter's gradient equal within 1e-5 relative (the model in
    float64; its scores are float32 whatever its dtype)."""
    from transformers import LlamaForSequenceClassification

    from pipeline.models import reward_model as rm
    model = _tiny_llama(LlamaForSequenceClassification)
    seqs = _ids(9, 23, 4, 1, 15, 7)                   # chosen, rejected of three pairs, side by side
    margin = torch.tensor([0.0, 0.5, -0.25])

    def loss(scores: torch.Tensor) -> torch.Tensor:
        return rm.pairwise_loss_sum(scores[0::2], scores[1::2], margin)[0]
    padded = rm.length_sorted_scores(model, seqs, 0, max_rows=4)
    packed = rm.packed_scores(model, seqs)
    assert padded.shape == packed.shape == (6,) and padded.std() > 1e-3
    torch.testing.assert_close(packed, padded, atol=1e-6, rtol=1e-5)
    l_padded, g_padded = _loss_and_grads(model, lambda: loss(rm.length_sorted_scores(model, seqs, 0, 4)))
    l_packed, g_packed = _loss_and_grads(model, lambda: loss(rm.packed_scores(model, seqs)))
    torch.testing.assert_close(l_packed, l_padded, atol=1e-6, rtol=1e-5)
    _assert_same_grads(g_packed, g_padded)
    with pytest.raises(ValueError, match="shared_prompt=False"):
        rm.pair_scores(model, None, [("p", "a", "b")], 16, shared_prompt=True, packed=True)


@pytest.mark.parametrize("head", ["positions", "chunked", "whole"])
def test_a_packed_row_gives_the_padded_rows_dpo_log_probs_loss_and_gradients(head, monkeypatch):
    """DPO's summed response log-probs of pairs of uneven lengths, their 2N sequences in one row
    (dpo.packing) against 2N rows of left-padded prompts and right-padded responses: log-probs, the
    DPO loss and every gradient equal within 1e-5 relative (float64 model, float32 log-probs). The
    LM head run at the response-predicting columns only (`positions`), chunk by chunk (`chunked`:
    a chunk budget of 3 positions), or on the whole row (a model that takes no positions)."""
    from transformers import LlamaForCausalLM

    from pipeline.models import logit_chunks, logprobs
    from pipeline.preference.logprobs import TokenPair, pair_logprobs, sequence_logprobs
    from pipeline.preference.losses import dpo_loss
    if head == "chunked":
        monkeypatch.setattr(logit_chunks, "LOGITS_CHUNK_BYTES", 3 * 50 * 4)
    if head == "whole":
        monkeypatch.setattr(logprobs, "keeps_logits_at", lambda model: False)
    model = _tiny_llama(LlamaForCausalLM)
    parts = _ids(5, 3, 7, 2, 9, 1, 11, 4, 4)
    pairs = [TokenPair(*parts[i:i + 3]) for i in range(0, 9, 3)]
    ref = (torch.tensor([-30.0, -20.0, -25.0]), torch.tensor([-28.0, -5.0, -20.0]))

    def loss(packed: bool) -> torch.Tensor:
        return dpo_loss(*pair_logprobs(model, pairs, 0, packed), *ref, beta=0.5, label_smoothing=0.1)[0]
    for padded, packed in zip(pair_logprobs(model, pairs, 0), pair_logprobs(model, pairs, 0, packed=True)):
        assert padded.shape == packed.shape == (3,)
        torch.testing.assert_close(packed, padded, atol=1e-5, rtol=1e-6)
    summed, lengths = sequence_logprobs(model, [p.prompt for p in pairs], [p.chosen for p in pairs], 0, True)
    assert lengths.tolist() == [3, 9, 4] and torch.equal(summed, pair_logprobs(model, pairs, 0, True)[0])
    l_padded, g_padded = _loss_and_grads(model, lambda: loss(False))
    l_packed, g_packed = _loss_and_grads(model, lambda: loss(True))
    torch.testing.assert_close(l_packed, l_padded, atol=1e-6, rtol=1e-5)
    _assert_same_grads(g_packed, g_padded)


@pytest.mark.parametrize("head", ["positions", "chunked", "whole"])
def test_a_packed_rollout_gives_the_padded_rows_log_probs_entropy_values_and_gradients(head, monkeypatch):
    """PPO's update forwards (ppo.packing): rollouts of uneven prompts and responses (prompts
    left-padded, responses right-padded, one response a single token) in one packed row against
    the padded rows: log-probs and entropy at temperature 0.7 and a critic's values equal within
    1e-9, zero on padding, and the gradients of a loss of all three equal. The LM head as in the
    dpo test above (at the predicting columns, chunk by chunk, or on the whole row)."""
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification

    from pipeline.data.padding import left_pad, right_pad
    from pipeline.models import logit_chunks, logprobs
    from pipeline.ppo.rollout import Rollout
    from pipeline.ppo.scoring import critic_values, packed_rollout, policy_logprobs
    if head == "chunked":
        monkeypatch.setattr(logit_chunks, "LOGITS_CHUNK_BYTES", 3 * 50 * 4)
    if head == "whole":
        monkeypatch.setattr(logprobs, "keeps_logits_at", lambda model: False)
    actor, critic = _tiny_llama(LlamaForCausalLM), _tiny_llama(LlamaForSequenceClassification)
    prompts, responses = _ids(4, 1, 7, 3), _ids(3, 1, 6, 2, seed=2)
    (p_ids, p_mask), (r_ids, r_mask) = left_pad(prompts, 0), right_pad(responses, 0)
    ro = Rollout([""] * 4, [""] * 4, torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1).long(),
                 r_mask, torch.ones(4, dtype=torch.bool), p_ids.size(1))
    ids, pos, predicting = packed_rollout(ro)
    assert ids[0].tolist() == [t for p, r in zip(prompts, responses) for t in p + r]
    assert pos[0].tolist() == [i for p, r in zip(prompts, responses) for i in range(len(p + r))]
    assert predicting.numel() == sum(map(len, responses)) == int(r_mask.sum())
    weights = torch.randn(3, *r_mask.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)

    def forwards(packed: bool):
        lp, ent = policy_logprobs(actor, ro, 0.7, with_entropy=True, packed=packed)
        return lp, ent, critic_values(critic, ro, packed=packed)

    out = {}
    for packed in (False, True):
        actor.zero_grad()
        critic.zero_grad()
        stats = forwards(packed)
        sum(((x * w).masked_fill(~r_mask, 0.0)).sum() for x, w in zip(stats, weights)).backward()
        grads = {f"{who}.{k}": p.grad.clone() for who, model in (("actor", actor), ("critic", critic))
                 for k, p in model.named_parameters() if p.grad is not None}
        out[packed] = ([x.detach() for x in stats], grads)
    (padded, g_padded), (packed, g_packed) = out[False], out[True]
    for got, want in zip(packed, padded):
        assert got.shape == want.shape == r_mask.shape and (got[~r_mask] == 0).all()
        torch.testing.assert_close(got[r_mask], want[r_mask].to(got.dtype), atol=1e-9, rtol=1e-7)
    _assert_same_grads(g_packed, g_padded)

@pytest.mark.parametrize("stage", ["reward", "dpo", "kto"])
def test_a_preference_stage_packed_trains_as_padded_with_no_padding(stage, tiny_data, tiny_models, tmp_path):
    """reward (two rows per pair: reward.shared_prompt false), dpo and kto with `packing`: every
    step's loss and gradient norm and the held-out loss equal the padded run's, and nothing the
    training forwards computed was padding."""
    folders = {"data": tiny_data, "sft": tiny_models[0], "reward": tiny_models[1]}
    own = {"shared_prompt": False} if stage == "reward" else {}
    runs = {}
    for packing in (False, True):
        params = tiny_params({stage: {**own, "packing": packing}})
        metrics = run_stage(stage, params, folders, tmp_path / str(packing))
        runs[packing] = (metrics, step_rows(tmp_path / str(packing) / "train.tsv"))
    (padded, padded_log), (packed, packed_log) = runs[False], runs[True]
    assert len(padded_log) > 1
    for a, b in zip(padded_log, packed_log, strict=True):
        for column in ("loss", "grad_norm"):
            assert float(b[column]) == pytest.approx(float(a[column]), rel=1e-4, abs=1e-6), \
                (stage, a["step"], column)
    assert packed["train/pad_share"] == 0.0 < padded["train/pad_share"]
    assert packed["eval/loss"] == pytest.approx(padded["eval/loss"], rel=1e-4)
    # The reference, held-out and final scoring passes pack too: every measured number agrees.
    _assert_same_metrics(packed, padded, stage)


def _assert_same_metrics(packed: dict, padded: dict, what: str) -> None:
    """Every number of two runs' metrics.json within float tolerance, but the padding share (what
    packing changes) and wall times. Sampling is unchanged by packing, so the responses are the
    same and so are the judge's scores; what was scored or measured by a forward moves only by
    rounding."""
    assert packed.keys() == padded.keys()
    numbers = [k for k, v in padded.items() if isinstance(v, (int, float)) and not isinstance(v, bool)
               and not k.startswith("resources/")
               and not any(part in k for part in ("pad_share", "time", "per_s", "seconds"))]
    assert len(numbers) > 10
    for key in numbers:
        # abs: a margin is the difference of two float32 sums of ~50 log-probs (rounding ~5e-6 each)
        assert packed[key] == pytest.approx(padded[key], rel=1e-4, abs=2e-5, nan_ok=True), (what, key)


@pytest.mark.parametrize("stage", ["ppo", "evaluate", "rs", "onpolicy_dpo"])
def test_packed_scoring_measures_as_padded(stage, tiny_data, tiny_models, tmp_path):
    """ppo.packing (scoring pass, update and held-out measurement), evaluate.packing (the KL's
    log-probs and the reward model's scores of every policy and best-of-n draw), and rs and
    onpolicy_dpo's (the reward model's scores of their draws too): the same metrics as padded
    rows, the KL and RM scores included."""
    folders = {"data": tiny_data, "sft": tiny_models[0], "reward": tiny_models[1], "ppo": tiny_models[0]}
    runs = {}
    for packing in (False, True):
        runs[packing] = run_stage(stage, tiny_params({stage: {"packing": packing}}), folders, tmp_path / str(packing))
    kl = "best_of_2/rm" if stage == "evaluate" else f"{stage}/kl"
    assert abs(runs[False][kl]) > 1e-3   # something was measured by a forward
    _assert_same_metrics(runs[True], runs[False], stage)


def test_a_token_budget_updates_ppo_as_fixed_micro_batches_do(tiny_data, tiny_models, tmp_path):
    """PPO's minibatches cut by padded tokens (prompt columns + each response) instead of
    micro_batch_size rows: the same losses are normalised by the whole minibatch, so every logged
    statistic of every iteration equals the fixed-row run's within float tolerance."""
    folders = {"data": tiny_data, "sft": tiny_models[0], "reward": tiny_models[1]}
    logs = {}
    for name, budget in (("rows", None), ("tokens", 90)):   # 90: micro-batches of 3 and 1 rows, not 2 and 2
        run_stage("ppo", tiny_params({"ppo": {"distributed": {"max_tokens_per_micro_batch": budget}}}),
                  folders, tmp_path / name)
        logs[name] = step_rows(tmp_path / name / "train.tsv")
    assert len(logs["rows"]) == len(logs["tokens"]) > 1
    for fixed, budgeted in zip(logs["rows"], logs["tokens"]):
        for column, value in fixed.items():
            assert float(budgeted[column]) == pytest.approx(float(value), rel=1e-3, abs=1e-5, nan_ok=True), column
