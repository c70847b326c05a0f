"""Reward model: loss, scoring position, normalisation, data layouts and their errors, calibration."""

import json
import math

import datasets
import pytest
import torch
from transformers import AutoModelForSequenceClassification, GPT2Config, LlamaConfig

from pipeline.data.padding import right_pad
from pipeline.models import reward_model as rm
from pipeline.errors import CheckpointError, DataError
from pipeline.data.preferences import Pair, load_pairs
from pipeline.stages.reward import calibration, gold_order_agreement


def test_pairwise_loss_hand_computed():
    rc, rr = torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0.0, 0.5], dtype=torch.float64)
    # -log sigmoid(1) = log(1 + e^-1) = 0.3132617; -log sigmoid(-0.5) = log(1 + e^0.5) = 0.9740770
    expected = (math.log1p(math.exp(-1.0)) + math.log1p(math.exp(0.5))) / 2
    loss, stats = rm.pairwise_loss(rc, rr)
    assert loss.item() == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(0.6436694, abs=1e-6)
    assert stats["accuracy"] == 0.5
    # A margin of 1 on the first pair: -log sigmoid(1 - 1) = log 2.
    loss_m, _ = rm.pairwise_loss(rc, rr, torch.tensor([1.0, 0.0], dtype=torch.float64))
    assert loss_m.item() == pytest.approx((math.log(2) + math.log1p(math.exp(0.5))) / 2, abs=1e-12)


def test_pairwise_loss_gradient_pushes_chosen_up():
    rc = torch.tensor([0.0], requires_grad=True)
    rr = torch.tensor([0.0], requires_grad=True)
    rm.pairwise_loss(rc, rr)[0].backward()
    assert rc.grad.item() == pytest.approx(-0.5) and rr.grad.item() == pytest.approx(0.5)


def _tiny_rm(arch):
    torch.manual_seed(0)
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=30, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, num_labels=1)
    else:  # GPT-2 convention: pad == eos, where HF's own pad-based pooling picks the wrong token
        cfg = GPT2Config(vocab_size=30, n_embd=16, n_layer=2, n_head=2, n_positions=64, pad_token_id=1,
                         eos_token_id=1, num_labels=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return AutoModelForSequenceClassification.from_config(cfg).eval()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_score_read_at_last_real_token_any_padding_side(arch):
    model = _tiny_rm(arch)
    pad = model.config.pad_token_id
    seqs = [[5, 6, 7, 8, 1], [9, 10, 1], [11, 12, 13, 1]]      # each ends with eos = 1
    right_ids, right_mask = right_pad(seqs, pad)
    right_mask = right_mask.long()
    width = right_ids.size(1)
    left_ids = torch.full_like(right_ids, pad)
    left_mask = torch.zeros_like(right_mask)
    for i, s in enumerate(seqs):
        left_ids[i, width - len(s):] = torch.tensor(s)
        left_mask[i, width - len(s):] = 1
    with torch.no_grad():
        right = rm.raw_scores(model, right_ids, right_mask)
        left = rm.raw_scores(model, left_ids, left_mask)
        alone = torch.cat([rm.raw_scores(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))
                           for s in seqs])
    assert torch.allclose(right, alone, atol=1e-5)
    assert torch.allclose(left, alone, atol=1e-5)
    assert rm.last_token_index(right_mask).tolist() == [4, 2, 3]
    assert rm.last_token_index(left_mask).tolist() == [4, 4, 4]



def test_length_sorted_parts_equal_one_padded_batch_in_scores_and_gradients():
    """The RM trains on length-sorted parts of each batch; scores (in the input order) and the
    gradient of the loss must be those of the whole batch padded at once."""
    model = _tiny_rm("llama").double()
    pad = model.config.pad_token_id
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(2, 20, (int(n),), generator=gen).tolist() + [1]
            for n in torch.randint(2, 12, (7,), generator=gen)]
    whole = rm.raw_scores(model, right_pad(seqs, pad)[0], right_pad(seqs, pad)[1].long())
    weights = torch.linspace(-1.0, 1.0, len(seqs), dtype=whole.dtype)
    grads_whole = torch.autograd.grad((whole * weights).sum(), list(model.parameters()))
    parts = rm.length_sorted_scores(model, seqs, pad, max_rows=3)     # 3 parts of 2-3 rows
    grads_parts = torch.autograd.grad((parts * weights).sum(), list(model.parameters()))
    assert torch.allclose(parts, whole, atol=1e-10)
    assert parts.argsort().tolist() == whole.argsort().tolist()
    for a, b in zip(grads_parts, grads_whole):
        assert torch.allclose(a, b, atol=1e-10)


def _tiny_sft(folder, words: list[str], hidden_size: int):
    """`folder` holding an untrained one-layer Llama policy of `hidden_size` and its word tokenizer
    over `words`, as the SFT stage saves its model: what a reward model is initialised from."""
    from transformers import AutoModelForCausalLM
    from pipeline.data.tokenizer import build_word_tokenizer
    tok = build_word_tokenizer(words)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, pad_token_id=tok.pad_token_id)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_head_init_std_and_offset(tmp_path):
    model, _ = rm.init_reward_model(_tiny_sft(tmp_path / "sft", ["a", "b", "good", "."], 64), seed=0, head_std=None)
    w = rm.head(model).weight
    assert w.shape == (1, 64)
    assert w.std().item() == pytest.approx(1 / math.sqrt(65), rel=0.35)   # 64 draws of N(0, 1/65)
    assert rm.offset(model) == 0.0


def test_normalisation_makes_reference_mean_zero(tmp_path):
    from pipeline.config import Params
    from pipeline.stages.reward import normalise
    from pipeline.tasks import reviews
    model, tok = rm.init_reward_model(_tiny_sft(tmp_path / "sft", reviews.vocabulary(), 16), seed=1, head_std=1.0)
    demos = [{"prompt": "Review the film Lost River . Focus on the music .", "response": r}
             for r in ("the music was good . overall , see it .", "I hated the plot .", "the film is bad .")]
    (tmp_path / "sft_eval.jsonl").write_text("".join(json.dumps(d) + "\n" for d in demos))
    (tmp_path / "sft_train.jsonl").write_text(json.dumps({"prompt": "Review the film Silent Harbor .",
                                                          "response": "I loved the plot ."}) + "\n")
    from pipeline.data import inputs
    raw_mean, raw_std = normalise(model, tok, Params(), inputs.demonstrations(Params(), tmp_path, "eval"))
    prompts, responses = [d["prompt"] for d in demos], [d["response"] for d in demos]
    scores = rm.score_texts(model, tok, prompts, responses, 96)
    assert abs(raw_mean) > 1e-3                       # the offset did something
    assert scores.mean().item() == pytest.approx(0.0, abs=1e-5)
    assert rm.offset(model) == pytest.approx(raw_mean)
    assert rm.scale(model) == pytest.approx(scores.std().item(), rel=1e-5) == pytest.approx(raw_std)
    # ppo.normalize_reward's source: the same scores in units of that spread (unit variance here)
    from pipeline.models.reward_source import RewardModelSource
    unit = RewardModelSource(None, 96, loaded=(model, tok), unit_variance="ppo.normalize_reward").score(prompts, responses)
    torch.testing.assert_close(unit, scores / raw_std)
    assert unit.std().item() == pytest.approx(1.0, rel=1e-5)
    setattr(model.config, rm.SCALE_KEY, None)          # an RM that stores no scale is refused, naming the key
    with pytest.raises(CheckpointError, match=r"^ppo.normalize_reward: .*stores no reward_scale"):
        RewardModelSource(None, 96, loaded=(model, tok), unit_variance="ppo.normalize_reward")


# ---- Data layouts -------------------------------------------------------------------------------

HH = [{"chosen": "\n\nHuman: Is the sky blue?\n\nAssistant: Yes, on a clear day.",
       "rejected": "\n\nHuman: Is the sky blue?\n\nAssistant: No."},
      {"chosen": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Name a colour.\n\nAssistant: Red.",
       "rejected": "\n\nHuman: Hi\n\nAssistant: Hello!\n\nHuman: Name a colour.\n\nAssistant: Seven."}]
UF = [{"prompt": "Name a colour.",
       "chosen": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}],
       "rejected": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Seven."}],
       "score_chosen": 8.0, "score_rejected": 2.0}]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_text_layout_jsonl(tmp_path):
    src = _jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "good", "rejected": "bad", "m": 0.5}])
    assert load_pairs(src, margin_column="m") == [Pair("q", "good", "bad", 0.5)]


def test_conversation_layout_like_hh_rlhf(tmp_path):
    pairs = load_pairs(_jsonl(tmp_path / "hh.jsonl", HH))
    assert pairs[0] == Pair("Human: Is the sky blue?\n\nAssistant:", "Yes, on a clear day.", "No.")
    assert pairs[1].prompt == "Human: Hi\n\nAssistant: Hello!\n\nHuman: Name a colour.\n\nAssistant:"
    assert (pairs[1].chosen, pairs[1].rejected) == ("Red.", "Seven.")


def test_messages_layout_like_ultrafeedback_parquet_and_saved_dataset(tmp_path):
    ds = datasets.Dataset.from_list(UF)
    ds.to_parquet(str(tmp_path / "uf.parquet"))
    expected = [Pair("Name a colour.", "Red.", "Seven.")]
    assert load_pairs(tmp_path / "uf.parquet") == expected
    datasets.DatasetDict({"train_prefs": ds, "test_prefs": ds}).save_to_disk(str(tmp_path / "uf_saved"))
    assert load_pairs(tmp_path / "uf_saved", split="test_prefs") == expected
    # Without a prompt column the prompt is the conversation before the answer, kept as messages
    # (a chat template renders it; without one it reads as `role: content` lines).
    no_prompt = [{k: v for k, v in UF[0].items() if k != "prompt"}]
    prompt = load_pairs(_jsonl(tmp_path / "np.jsonl", no_prompt))[0].prompt
    assert prompt == [{"role": "user", "content": "Name a colour."}]
    from pipeline.data.tokenizer import prompt_text
    assert prompt_text(prompt) == "user: Name a colour."


def test_csv_text_layout(tmp_path):
    (tmp_path / "p.csv").write_text("prompt,chosen,rejected\nq,yes,no\n")
    assert load_pairs(tmp_path / "p.csv") == [Pair("q", "yes", "no")]


@pytest.mark.parametrize("row, message", [
    ({"prompt": "q", "chosen": "a"}, "missing field 'rejected'"),
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "chosen and rejected are identical"),
    ({"prompt": "q", "chosen": "  ", "rejected": "b"}, "field 'chosen' is empty"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, "field 'prompt' is empty"),
    ({"prompt": "q", "chosen": 3, "rejected": "b"}, "field 'chosen' must be a string, got int"),
])
def test_malformed_pair_names_file_and_line(tmp_path, row, message):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    src = tmp_path / "pairs.jsonl"
    src.write_text(json.dumps(good) + "\n\n" + json.dumps(row) + "\n")   # the bad row is on line 3
    with pytest.raises(DataError) as err:
        load_pairs(src)
    assert str(err.value) == f"{src}:3: {message}"


def test_malformed_json_and_bad_conversation(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"prompt": "q", "chosen": "a", "rejected": "b"}\n{"prompt": \n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed JSON"):
        load_pairs(src)
    hh = _jsonl(tmp_path / "hh.jsonl", [{"chosen": "\n\nHuman: a\n\nAssistant: b",
                                         "rejected": "\n\nHuman: DIFFERENT\n\nAssistant: c"}])
    with pytest.raises(DataError, match=r"hh\.jsonl:1: chosen and rejected conversations differ"):
        load_pairs(hh)


def test_bad_row_in_parquet_names_row(tmp_path):
    datasets.Dataset.from_list([{"prompt": "q", "chosen": "a", "rejected": "b"},
                                {"prompt": "q", "chosen": "x", "rejected": "x"}]).to_parquet(str(tmp_path / "p.parquet"))
    with pytest.raises(DataError) as err:
        load_pairs(tmp_path / "p.parquet")
    assert str(err.value) == f"{tmp_path / 'p.parquet'}: row 2: chosen and rejected are identical"


# ---- Calibration --------------------------------------------------------------------------------

def test_calibration_bins_and_error():
    # Two pairs with predicted P = sigmoid(0) = 0.5: both orders land in the 0.5 bin, observed 0.5.
    bins, ece = calibration(torch.zeros(2), bins=10)
    assert bins == [{"bin": 5, "predicted": 0.5, "observed": 0.5, "count": 4}]
    assert ece == 0.0
    # A confident model (P = 0.99) that is always right: bins 9 (obs 1) and 0 (obs 0); ECE = 0.01.
    bins, ece = calibration(torch.full((3,), math.log(99.0), dtype=torch.float64), bins=10)
    assert [(b["bin"], b["observed"], b["count"]) for b in bins] == [(0, 0.0, 3), (9, 1.0, 3)]
    assert ece == pytest.approx(0.01, abs=1e-9)


def test_gold_order_agreement_hand_computed():
    # Pairs: model agrees with gold; disagrees; model tie (1/2); gold tie (1/2) -> (1 + 0 + .5 + .5) / 4.
    rc = torch.tensor([2.0, 0.0, 1.0, 3.0])
    rr = torch.tensor([1.0, 1.0, 1.0, 0.0])
    gold = torch.tensor([[1.0, 2.0, 0.0, 0.5],
                         [0.0, 1.0, 1.0, 0.5]])
    assert gold_order_agreement(rc, rr, gold) == pytest.approx(0.5)
    # The model now agrees on pair 2 as well: (1 + 1 + .5 + .5) / 4.
    assert gold_order_agreement(torch.tensor([2.0, 2.0, 1.0, 3.0]), rr, gold) == pytest.approx(0.75)


def test_overlong_pairs_truncated_or_dropped_and_counted():
    from pipeline.stages.reward import fit_pairs
    from pipeline.tasks import reviews
    from pipeline.data.tokenizer import build_word_tokenizer
    tok = build_word_tokenizer(reviews.vocabulary())
    short = Pair("Review the film Lost River .", "the plot was good .", "the plot was bad .")
    long = Pair("Review the film Lost River .", "the plot was good . " * 6, "the plot was bad .")
    # short: 9 prompt + 6 answer tokens = 15; long: 9 + 31 = 40
    assert fit_pairs([short, long], rm.EncodedPairs(tok, 20), "truncate") == ([short, long], 1, 0)
    assert fit_pairs([short, long], rm.EncodedPairs(tok, 20), "drop") == ([short], 0, 1)
    with pytest.raises(DataError, match=r"every record is longer than reward.max_length=10"):
        fit_pairs([short, long], rm.EncodedPairs(tok, 10), "drop")


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_shared_prompt_rows_equal_separate_sequences_in_scores_and_gradients(arch):
    """One row [prompt, chosen, rejected] under the block mask gives each response the score and the
    gradient of prompt + response run as its own sequence; a pair whose prompt was cut to fit
    max_length differently for its two responses falls back to two rows."""
    from pipeline.data.tokenizer import build_word_tokenizer
    from pipeline.tasks import reviews
    tok = build_word_tokenizer(reviews.vocabulary())
    if arch == "llama":
        cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, pad_token_id=tok.pad_token_id, num_labels=1)
    else:
        cfg = GPT2Config(vocab_size=len(tok), n_embd=16, n_layer=2, n_head=2, n_positions=64,
                         pad_token_id=tok.pad_token_id, num_labels=1, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = AutoModelForSequenceClassification.from_config(cfg).double().eval()
    triples = [("Review the film Lost River . Focus on the plot .", "the plot was good . overall , see it .",
                "the music was bad ."),
               ("Review the film Iron Summer . Focus on the cast .", "the cast was great .",
                "the cast was not very dull . also the plot is fine . in short , skip it ."),
               # the long chosen answer cuts the prompt at max_length 34, the short rejected does not
               ("What did you think of Wild Garden ? Talk about the music .", "the music was good . " * 4,
                "the music was bad ."),
               ("Review the film Lost River . Focus on the acting .", "I loved the acting .", "I loved the acting .")]
    max_length = 34
    rows = [rm.shared_prefix_rows(tok, *t, max_length) for t in triples]
    assert [len(r) for r in rows] == [1, 1, 2, 1]
    whole = [rm.encode_pair_text(tok, p, x, max_length) for p, c, r in triples for x in (c, r)]
    assert [len(s) <= max_length for s in whole] == [True] * 8
    shared_c, shared_r = rm.pair_scores(model, tok, triples, max_length, shared_prompt=True)
    sep_c, sep_r = rm.pair_scores(model, tok, triples, max_length, shared_prompt=False)
    alone = torch.stack([rm.raw_scores(model, torch.tensor([s]), torch.ones(1, len(s), dtype=torch.long))[0]
                         for s in whole]).view(-1, 2)                       # (B, 2)
    # scores come out in float32 (raw_scores), so they agree to its rounding, not float64's
    assert torch.allclose(shared_c, alone[:, 0], atol=1e-7) and torch.allclose(shared_r, alone[:, 1], atol=1e-7)
    assert torch.allclose(sep_c, alone[:, 0], atol=1e-7) and torch.allclose(sep_r, alone[:, 1], atol=1e-7)
    assert abs(float(shared_c[3].detach()) - float(shared_r[3].detach())) < 1e-7     # same response, same score
    loss = lambda c, r: rm.pairwise_loss_sum(c, r)[0]
    g_shared = torch.autograd.grad(loss(shared_c, shared_r), list(model.parameters()))
    g_sep = torch.autograd.grad(loss(sep_c, sep_r), list(model.parameters()))
    for a, b in zip(g_shared, g_sep):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert max(float(g.abs().max()) for g in g_sep) > 1e-3          # a real gradient, not two zeros
    # fewer tokens is the point: one prompt per pair instead of two
    tokens = sum(len(p) + sum(map(len, bs)) for rs in rows for p, bs in rs)
    assert tokens < sum(map(len, whole))


@pytest.mark.parametrize("shared", [True, False])
def test_kept_token_ids_give_the_same_scores_and_are_encoded_once(shared, monkeypatch):
    """The reward stage keeps every pair's ids (`EncodedPairs`): scores equal tokenising afresh bit
    for bit, a second pass tokenises nothing, and ids of another max_length are refused."""
    from pipeline.data.tokenizer import build_word_tokenizer
    from pipeline.tasks import reviews
    tok = build_word_tokenizer(reviews.vocabulary())
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, pad_token_id=tok.pad_token_id, num_labels=1)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_config(cfg).eval()
    triples = [("Review the film Lost River . Focus on the plot .", "the plot was good .", "the music was bad ."),
               ("What did you think of Wild Garden ? Talk about the music .", "the music was good . " * 4,
                "the music was bad .")]
    afresh = rm.pair_scores(model, tok, triples, 34, shared_prompt=shared)
    kept = rm.EncodedPairs(tok, 34)
    uncut = [len(rm.encode_pair_text(tok, p, c, 100)) for p, c, _ in triples]     # chosen is the longer
    calls = []
    for name in ("encode_prompt", "encode_response"):
        monkeypatch.setattr(rm, name, lambda tok, text, f=getattr(rm, name): calls.append(text) or f(tok, text))
    # The length check before training tokenises every text once, and the scores then reuse the ids.
    assert [kept.length(t) for t in triples] == uncut
    texts = {x for t in triples for x in t}
    assert sorted(calls) == sorted(texts)                 # "the music was bad ." twice, tokenised once
    first = rm.pair_scores(model, tok, triples, 34, shared_prompt=shared, encoded=kept)
    assert sorted(calls) == sorted(texts)
    monkeypatch.undo()

    def no_tokenising(*args, **kwargs):
        raise AssertionError("tokenised again")
    for name in ("encode_prompt", "encode_response", "encode_pair_parts"):
        monkeypatch.setattr(rm, name, no_tokenising)
    second = rm.pair_scores(model, tok, triples, 34, shared_prompt=shared, encoded=kept)
    for a, b, c in zip(afresh, first, second):
        assert torch.equal(a, b) and torch.equal(a, c)
    assert float((afresh[0] - afresh[1]).abs().max()) > 0          # real, distinct scores
    with pytest.raises(ValueError, match="encoded pairs of max_length 34, asked 40"):
        rm.pair_scores(model, tok, triples, 40, shared_prompt=shared, encoded=kept)
    # A chat prompt (list of messages, unhashable) is kept under its JSON, apart from any text prompt.
    chat = ([{"role": "user", "content": "Review the film Lost River ."}], "the plot was good .", "the plot was bad .")
    as_text = (json.dumps(chat[0], sort_keys=True), chat[1], chat[2])
    assert rm.EncodedPairs.key(chat) != rm.EncodedPairs.key(as_text)
    assert hash(rm.EncodedPairs.key(chat)) == hash(rm.EncodedPairs.key(([dict(chat[0][0])], *chat[1:])))


def test_branch_mask_blocks_other_branches():
    ids, mask, pos, last_row, last_col = rm.branch_batch([([5, 6], [[7, 8], [9]]), ([5], [[7]])], 0, torch.float32)
    assert ids.tolist() == [[5, 6, 7, 8, 9], [5, 7, 0, 0, 0]]
    assert pos.tolist() == [[0, 1, 2, 3, 2], [0, 1, 0, 0, 0]]
    assert (last_row.tolist(), last_col.tolist()) == ([0, 0, 1], [3, 4, 1])
    seen = (mask[0, 0] == 0).int().tolist()                      # what each token of row 0 attends to
    assert seen == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]
