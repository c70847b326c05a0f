"""The embedded review task and the prepare stage's pure parts.

Gold scores are hand-computed from the weights in `pipeline/tasks/reviews.py`:
  on-aspect +1 (else -0.5) + mean on-aspect polarity x1.0 + mean body polarity x0.5
  + closing polarity x0.5 (or -1.5 without a closing) - 1 per broken - 1 per repeat
  - 0.5 per body sentence beyond four.
Compared with pytest.approx(abs=1e-12): most are sums of dyadic fractions, but 1.2 ('quite') is not.
"""

from __future__ import annotations

import math
import random

import pytest

from pipeline.config import DataConfig
from pipeline.stages.prepare import SPLITS, bradley_terry_label, build_splits, check_leakage, make_pairs, noise_ceiling, write
from pipeline.files import read_jsonl
from pipeline.tasks import reviews as R

PROMPT = "Write a review of the film Crimson Harbor . Discuss the music ."
GOOD = "the music was good ."
CLOSE = "overall , I recommend it ."


def gold(response: str, prompt: str = PROMPT) -> float:
    return R.gold_score(prompt, response)


# ---- Gold annotator: hand-checked cases ----------------------------------------------------


def test_weights_are_the_documented_ones():
    # The hand computations below depend on these; if they change, every expected value must too.
    assert (R.W_ON_ASPECT, R.W_OFF_ASPECT) == (1.0, -0.5)
    assert (R.W_ASPECT_SENTIMENT, R.W_OVERALL_SENTIMENT, R.W_CLOSING_SENTIMENT) == (1.0, 0.5, 0.5)
    assert (R.P_BROKEN, R.P_REPEAT, R.P_EXTRA_SENTENCE, R.P_NO_CLOSING) == (1.0, 1.0, 0.5, 1.5)
    assert R.MAX_BODY_SENTENCES == 4


def test_requested_aspect_of_the_example_prompt():
    assert R.requested_aspect(PROMPT) == "music"
    assert R.requested_aspect("Write a review of the film Crimson Harbor .") is None


@pytest.mark.parametrize("response, expected", [
    # on +1, aspect mean +1, body mean 0.5*1, closing 0.5*1
    (f"{GOOD} {CLOSE}", 3.0),
    # feeling verb on the aspect, same arithmetic
    (f"I loved the music . {CLOSE}", 3.0),
    # a connective does not change the sentence's meaning
    (f"the plot was good . however the music was good . {CLOSE}", 3.0),
    # negative closing: 1 + 1 + 0.5 - 0.5
    (f"{GOOD} overall , skip it .", 2.0),
    # closing "a <adj> film" with intensifier: 1 + 1 + 0.5 + 0.5*1.5
    (f"{GOOD} in the end , a very fine film .", 3.25),
    # mixed aspects: on [+1] -> 1 + 1; body mean (-1 + 1)/2 = 0; closing -0.5
    ("the plot was bad . the music was good . overall , skip it .", 1.5),
    # two on-aspect sentences, mean (1.5 + (-1))/2 = 0.25; body mean 0.25*0.5; closing 0.5
    ("the music was very good . the music was dull . overall , I recommend it .", 1.875),
])
def test_gold_hand_checked(response, expected):
    assert gold(response) == pytest.approx(expected, abs=1e-12)


def test_negation_flips_polarity():
    plain = gold("the music was good .")        # 1 + 1 + 0.5 - 1.5 (no closing)
    negated = gold("the music was not good .")  # 1 - 1 - 0.5 - 1.5
    assert plain == pytest.approx(1.0, abs=1e-12)
    assert negated == pytest.approx(-2.0, abs=1e-12)
    assert negated < plain
    # "never bad" is positive: -1 * -1
    assert gold(f"the music was never bad . {CLOSE}") == pytest.approx(3.0, abs=1e-12)
    # an intensifier under negation does not amplify: "not very good" == "not good" == -1
    assert gold(f"the music was not very good . {CLOSE}") == pytest.approx(0.0, abs=1e-12)
    assert gold(f"the music was not good . {CLOSE}") == pytest.approx(0.0, abs=1e-12)


def test_repetition_costs_exactly_p_repeat():
    once = gold(f"{GOOD} {CLOSE}")
    twice = gold(f"{GOOD} {GOOD} {CLOSE}")  # same means; one repeat
    assert once == pytest.approx(3.0, abs=1e-12)
    assert twice == pytest.approx(2.0, abs=1e-12)
    assert once - twice == pytest.approx(R.P_REPEAT, abs=1e-12)
    # a repeated closing counts too (and the first closing is misplaced -> broken): 3 - 1 - 1
    assert gold(f"{GOOD} {CLOSE} {CLOSE}") == pytest.approx(1.0, abs=1e-12)


def test_missing_closing_costs_p_no_closing():
    # vs "good . I recommend it .": loses the closing's +0.5 and pays 1.5
    assert gold(GOOD) == pytest.approx(1.0, abs=1e-12)
    assert gold(f"{GOOD} {CLOSE}") - gold(GOOD) == pytest.approx(0.5 + R.P_NO_CLOSING, abs=1e-12)


def test_trailing_fragment_is_broken():
    # "overall , I recommend it" without "." is a broken fragment: no closing (-1.5), one broken (-1)
    assert gold("the music was good . overall , I recommend it") == pytest.approx(0.0, abs=1e-12)
    kinds = [s.kind for s in R.parse_review("the music was good . overall , I recommend it")]
    assert kinds == ["body", "broken"]


def test_closing_not_last_is_broken():
    # closing first, body last: no closing at the end (-1.5) and the misplaced one is broken (-1)
    assert gold(f"{CLOSE} {GOOD}") == pytest.approx(0.0, abs=1e-12)
    # closing then a fragment: fragment broken + misplaced closing broken, and no final closing
    assert gold(f"{GOOD} {CLOSE} the music") == pytest.approx(2.5 - 1.5 - 2.0, abs=1e-12)


def test_more_than_four_body_sentences_penalised():
    four = " ".join(f"the music was {a} ." for a in ("good", "great", "superb", "wonderful"))
    five = four + " the music was brilliant ."
    six = five + " the music was moving ."
    assert gold(f"{four} {CLOSE}") == pytest.approx(3.0, abs=1e-12)
    assert gold(f"{five} {CLOSE}") == pytest.approx(3.0 - 0.5, abs=1e-12)
    assert gold(f"{six} {CLOSE}") == pytest.approx(3.0 - 1.0, abs=1e-12)


def test_off_aspect_vs_on_aspect():
    on = gold(f"{GOOD} {CLOSE}")
    off = gold(f"the plot was good . {CLOSE}")           # -0.5 + 0.5 + 0.5
    film = gold(f"the film was good . {CLOSE}")          # the film as a whole is not the music
    assert off == pytest.approx(0.5, abs=1e-12)
    assert film == pytest.approx(0.5, abs=1e-12)
    assert on - off == pytest.approx(2.5, abs=1e-12)


@pytest.mark.parametrize("intensifier, expected", [
    ("very", 1 + 1.5 + 0.75 + 0.5),      # 3.75
    ("really", 3.75),
    ("quite", 1 + 1.2 + 0.6 + 0.5),      # 3.3
    ("somewhat", 1 + 0.5 + 0.25 + 0.5),  # 2.25
])
def test_intensifier_scaling(intensifier, expected):
    assert gold(f"the music was {intensifier} good . {CLOSE}") == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("response", ["", "   ", "\n"])
def test_empty_response(response):
    assert gold(response) == -3.0


def test_repetition_exploit_is_penalised():
    # k identical positive on-aspect sentences then a closing: sentiment means stay at +1, each
    # extra copy costs P_REPEAT, and copies beyond four also cost P_EXTRA_SENTENCE each.
    scores = [gold(" ".join([GOOD] * k + [CLOSE])) for k in range(1, 7)]
    expected = [3.0, 2.0, 1.0, 0.0, -1.5, -3.0]
    assert scores == pytest.approx(expected, abs=1e-12)
    assert all(a > b for a, b in zip(scores, scores[1:]))


# ---- Parsing and well-formedness ----------------------------------------------------------------


def test_parse_review_kinds_and_fields():
    s = R.parse_review("the music was very good . also I hated the film . overall , a dull film . the plot")
    assert [x.kind for x in s] == ["body", "body", "closing", "broken"]
    assert [x.aspect for x in s] == ["music", None, None, None]
    assert [x.polarity for x in s] == [1.5, -1.0, -1.0, 0.0]
    assert s[1].words == ("also", "I", "hated", "the", "film")
    assert s[3].words == ("the", "plot")


@pytest.mark.parametrize("sentence, kind", [
    ("the music was good .", "body"),
    ("I enjoyed the acting .", "body"),
    ("all in all , avoid it .", "closing"),
    ("in short , a great film .", "closing"),
    ("overall , a not good film .", "broken"),   # negation is not allowed in a closing's adjective
    ("overall , great .", "broken"),
    ("overall I recommend it .", "broken"),       # opener without its comma
    ("the music was .", "broken"),
    ("the music was good good .", "broken"),
    ("I loved the .", "broken"),
    ("the banana was good .", "broken"),
    (".", "broken"),
])
def test_parse_sentence_kinds(sentence, kind):
    (s,) = R.parse_review(sentence)
    assert s.kind == kind


@pytest.mark.parametrize("response, ok", [
    (f"{GOOD} {CLOSE}", True),
    (f"the plot was bad . the music was never dull . {CLOSE}", True),
    (f"{GOOD} {GOOD} {CLOSE}", True),           # repetition is a quality fault, not a grammar one
    ("", False),
    (GOOD, False),                              # no closing
    (f"{GOOD} {CLOSE} {GOOD}", False),          # closing not last
    (f"{GOOD} the music was . {CLOSE}", False),  # broken body sentence
    (f"{GOOD} overall , I recommend it", False),  # trailing fragment
    (f"{GOOD} {CLOSE} {CLOSE}", False),         # two closings
])
def test_is_well_formed(response, ok):
    assert R.is_well_formed(response) is ok


# ---- Sampling, prompts, titles ------------------------------------------------------------------


def test_sample_review_is_deterministic_and_in_vocabulary():
    vocab = set(R.vocabulary())
    prompts = [R.make_prompt(t, a, i) for t in R.TITLES[:5] for a in R.ASPECTS for i in range(3)]
    first = [R.sample_review(random.Random(7), p) for p in prompts]
    again = [R.sample_review(random.Random(7), p) for p in prompts]
    assert first == again
    rng_a, rng_b = random.Random(1), random.Random(1)
    seq_a = [R.sample_review(rng_a, PROMPT) for _ in range(50)]
    seq_b = [R.sample_review(rng_b, PROMPT) for _ in range(50)]
    assert seq_a == seq_b
    assert len(set(seq_a)) > 10  # the seeded stream does produce different reviews
    assert seq_a != [R.sample_review(random.Random(2), PROMPT) for _ in range(50)]
    rng = random.Random(3)
    for p in prompts:
        text = R.sample_review(rng, p, R.Style(p_repeat=0.5, p_broken=0.5, p_negation=0.5))
        assert set(text.split()) <= vocab, text
    for p in prompts:
        assert set(p.split()) <= vocab, p


def test_sample_review_style_extremes():
    rng = random.Random(0)
    clean = R.Style(p_on_aspect=1.0, p_closing=1.0, p_repeat=0.0, p_broken=0.0)
    for _ in range(200):
        text = R.sample_review(rng, PROMPT, clean)
        assert R.is_well_formed(text), text
        first = R.parse_review(text)[0]
        assert first.aspect == "music"
        assert 2 <= len(R.parse_review(text)) <= 5
    for _ in range(100):
        assert not R.is_well_formed(R.sample_review(rng, PROMPT, R.Style(p_closing=0.0, p_broken=0.0)))
    # Sampler and annotator agree on negation: "positive via not + negative adjective" is positive.
    for p_positive, sign in ((1.0, 1.0), (0.0, -1.0)):
        style = R.Style(p_positive=p_positive, p_negation=1.0, p_closing=1.0, p_repeat=0.0, p_broken=0.0)
        for _ in range(100):
            sentences = R.parse_review(R.sample_review(rng, PROMPT, style))
            assert all(s.polarity * sign > 0 for s in sentences), sentences


@pytest.mark.parametrize("template", range(len(R.PROMPT_TEMPLATES)))
def test_requested_aspect_of_every_prompt(template):
    for aspect in R.ASPECTS:
        for title in ("Crimson Harbor", "Last Theater", "Secret Engine"):
            prompt = R.make_prompt(title, aspect, template)
            assert title in prompt
            assert R.requested_aspect(prompt) == aspect


def test_split_titles_disjoint_and_covering():
    assert len(R.TITLES) == 24 * 22 == len(set(R.TITLES))
    train, held = R.split_titles(random.Random(0), 0.2)
    assert len(held) == 106            # round(528 * 0.2) = round(105.6)
    assert len(train) == 528 - 106
    assert not set(train) & set(held)
    assert set(train) | set(held) == set(R.TITLES)
    assert R.split_titles(random.Random(0), 0.2) == (train, held)
    assert R.split_titles(random.Random(1), 0.2)[1] != held
    assert len(R.split_titles(random.Random(0), 1e-6)[1]) == 1  # at least one evaluation title


# ---- Bradley-Terry labels -----------------------------------------------------------------------


@pytest.mark.parametrize("d, T", [(0.0, 0.5), (0.5, 0.5), (-1.0, 0.5), (1.0, 1.0), (2.0, 1.0), (-0.3, 0.2)])
def test_bradley_terry_rate(d, T):
    n = 20000
    rng = random.Random(1234)
    rate = sum(bradley_terry_label(rng, 1.0 + d, 1.0, T) for _ in range(n)) / n
    p = 1.0 / (1.0 + math.exp(-d / T))
    se = math.sqrt(p * (1 - p) / n)
    assert abs(rate - p) < 4 * se, (rate, p)
    if d == 0.0:
        assert p == 0.5 and abs(rate - 0.5) < 0.015


def test_bradley_terry_consumes_one_draw():
    # label == (u < sigmoid(d/T)) with u the rng's next uniform draw
    rng, ref = random.Random(5), random.Random(5)
    p = 1.0 / (1.0 + math.exp(-1.0 / 0.5))  # sigmoid(2) = 0.8808
    for _ in range(200):
        assert bradley_terry_label(rng, 2.0, 1.0, 0.5) == (ref.random() < p)


def test_bradley_terry_small_temperature_does_not_overflow():
    rng = random.Random(0)
    assert bradley_terry_label(rng, 0.0, 8.0, 0.01) is False   # P(a > b) = sigmoid(-800) ~ 0
    assert bradley_terry_label(rng, 8.0, 0.0, 0.01) is True


# ---- Pairs and splits ---------------------------------------------------------------------------


def test_make_pairs_rows_and_noise_ceiling():
    prompts = [R.make_prompt(t, a, i % 3) for i, (t, a) in enumerate(zip(R.TITLES[:60], R.ASPECTS * 5))]
    rows = make_pairs(random.Random(11), prompts, temperature=0.5)
    ceiling = noise_ceiling(rows)
    assert [r["prompt"] for r in rows] == prompts
    assert all(set(r) == {"prompt", "chosen", "rejected"} for r in rows)
    assert all(r["chosen"] != r["rejected"] for r in rows)
    agree = 0.0
    for r in rows:
        gc, gr = R.gold_score(r["prompt"], r["chosen"]), R.gold_score(r["prompt"], r["rejected"])
        agree += 1.0 if gc > gr else 0.5 if gc == gr else 0.0
    assert ceiling == pytest.approx(agree / len(rows), abs=1e-12)
    assert 0.5 < ceiling < 1.0  # labels follow gold more often than not, but with noise
    assert make_pairs(random.Random(11), prompts, 0.5) == rows


def test_swap_aspect_turns_a_review_to_or_away_from_the_asked_aspect():
    on = "the music was good . I liked the plot . overall , I recommend it ."
    off = "the plot was good . I liked the acting . overall , I recommend it ."
    away = R.swap_aspect(random.Random(0), PROMPT, on)
    toward = R.swap_aspect(random.Random(0), PROMPT, off)
    # Only the one aspect word changes, everywhere it occurs.
    for before, after in ((on, away), (off, toward)):
        changed = [(a, b) for a, b in zip(before.split(), after.split()) if a != b]
        assert len(before.split()) == len(after.split()) and len({c for c in changed}) == 1
    assert "music" not in away.split() and away.split()[1] not in ("plot", "music")
    assert "music" in toward.split()
    # The annotator's on-aspect bonus moves with it: +1 on the aspect, -0.5 off it (W_ON/W_OFF),
    # and the on-aspect sentiment term (+1 x mean polarity 1) comes and goes too.
    assert gold(on) - gold(away) == pytest.approx(R.W_ON_ASPECT - R.W_OFF_ASPECT + R.W_ASPECT_SENTIMENT)
    assert gold(toward) - gold(off) == pytest.approx(R.W_ON_ASPECT - R.W_OFF_ASPECT + R.W_ASPECT_SENTIMENT)
    assert R.swap_aspect(random.Random(0), PROMPT, "I loved the film . overall , I recommend it .") is None


def test_aspect_contrast_pairs_leave_other_splits_byte_identical():
    plain, _ = build_splits(DataConfig(**{**SMALL.__dict__, "n_pairs": 400, "aspect_contrast": 0.0}))
    contrast, stats = build_splits(DataConfig(**{**SMALL.__dict__, "n_pairs": 400, "aspect_contrast": 0.5}))
    for name in SPLITS:
        if name != "pairs_train":
            assert contrast[name] == plain[name]
    # A contrast pair is one review against itself with one aspect word swapped.
    def one_word_apart(r):
        a, b = r["chosen"].split(), r["rejected"].split()
        return len(a) == len(b) and len({(x, y) for x, y in zip(a, b) if x != y}) == 1
    share = sum(map(one_word_apart, contrast["pairs_train"])) / 400
    assert 0.35 < share < 0.6          # half drawn, minus reviews that name no aspect
    assert sum(map(one_word_apart, plain["pairs_train"])) / 400 < 0.05
    assert [r["prompt"] for r in contrast["pairs_train"]] == [r["prompt"] for r in plain["pairs_train"]]


def test_exchange_aspects_moves_what_is_said_between_the_asked_aspect_and_another():
    review = "the music was good . the plot was dull . I liked the plot . " + CLOSE
    swapped = R.exchange_aspects(random.Random(0), PROMPT, review)
    assert swapped == "the plot was good . the music was dull . I liked the music . " + CLOSE
    # Still on the asked aspect, as positive overall: only the asked aspect's sentiment moves, from +1
    # to the mean of (-1, +1) = 0, so gold falls by W_ASPECT_SENTIMENT x 1.
    assert gold(review) - gold(swapped) == pytest.approx(R.W_ASPECT_SENTIMENT)
    assert R.exchange_aspects(random.Random(0), PROMPT, "the music was good . " + CLOSE) is None       # no other aspect
    assert R.exchange_aspects(random.Random(0), PROMPT, "the plot was good . the acting was bad . " + CLOSE) is None
    assert R.exchange_aspects(random.Random(0), PROMPT, "the music was good . the plot was great . " + CLOSE) is None  # said alike


def test_aspect_exchange_pairs_leave_other_splits_byte_identical():
    base = {**SMALL.__dict__, "n_pairs": 400, "aspect_contrast": 0.25, "corrupt_contrast": 0.15}
    plain, _ = build_splits(DataConfig(**{**base, "aspect_exchange": 0.0}))
    exchanged, _ = build_splits(DataConfig(**{**base, "aspect_exchange": 0.3}))
    for name in SPLITS:                                # the exchanges draw from the contrast stream
        if name != "pairs_train":
            assert exchanged[name] == plain[name]
    assert [r["prompt"] for r in exchanged["pairs_train"]] == [r["prompt"] for r in plain["pairs_train"]]

    def an_exchange(r):                 # same words in place but the asked aspect and one other, traded
        a, b = r["chosen"].split(), r["rejected"].split()
        asked = R.requested_aspect(r["prompt"])
        diff = {(x, y) for x, y in zip(a, b) if x != y}
        return len(a) == len(b) and len(diff) == 2 and any(asked in d for d in diff) and \
            {frozenset(d) for d in diff} == {frozenset(next(iter(diff)))}
    share = sum(map(an_exchange, exchanged["pairs_train"])) / 400
    # 30% drawn; a fresh review stands in where neither of the pair's has two aspects said differently.
    assert 0.22 < share < 0.38 and sum(map(an_exchange, plain["pairs_train"])) == 0
    assert all(gold(r["chosen"], r["prompt"]) != gold(r["rejected"], r["prompt"])
               for r in exchanged["pairs_train"] if an_exchange(r))


def test_corrupt_makes_one_local_fault_of_each_kind():
    review = "the music was good . I liked the plot . overall , I recommend it ."
    words = review.split()
    for seed in range(20):
        rng = lambda: random.Random(seed)  # noqa: E731
        dropped = R.corrupt(rng(), review, "drop_word").split()
        assert len(dropped) == len(words) - 1 and dropped.count(".") == 3
        assert any(words[:i] + words[i + 1:] == dropped for i in range(len(words)))
        merged = R.corrupt(rng(), review, "merge_sentences").split()
        assert merged.count(".") == 2 and [w for w in merged if w != "."] == [w for w in words if w != "."]
        inserted = R.corrupt(rng(), review, "insert_word").split()
        assert len(inserted) == len(words) + 1 and any(inserted[:i] + inserted[i + 1:] == words for i in range(len(inserted)))
        replaced = R.corrupt(rng(), review, "replace_word")
        if replaced is not None:                       # None only when the word drawn was the same one
            changed = [i for i, (a, b) in enumerate(zip(words, replaced.split())) if a != b]
            assert len(replaced.split()) == len(words) and len(changed) == 1 and words[changed[0]] != "."
        cut = R.corrupt(rng(), review, "cut_end").split()
        assert 2 <= len(cut) < len(words) and words[:len(cut)] == cut
    # Sentences run together: one broken sentence where there were two good ones (-1 broken, and the
    # on-aspect body sentence is gone: +1 -> -0.5, its polarity term too).
    assert gold("the music was good overall , I recommend it .") < gold("the music was good . " + CLOSE) - 1
    assert R.corrupt(random.Random(0), "the music was good .", "merge_sentences") is None   # one sentence
    with pytest.raises(ValueError, match="unknown corruption 'typo'"):
        R.corrupt(random.Random(0), review, "typo")


def test_corrupt_contrast_pairs_leave_other_splits_byte_identical():
    base = {**SMALL.__dict__, "n_pairs": 400, "aspect_contrast": 0.25}
    plain, _ = build_splits(DataConfig(**{**base, "corrupt_contrast": 0.0}))
    default, _ = build_splits(DataConfig(**{**base, "corrupt_contrast": DataConfig().corrupt_contrast}))
    faulty, _ = build_splits(DataConfig(**{**base, "corrupt_contrast": 0.4}))
    assert DataConfig().corrupt_contrast == 0.15 and default["pairs_train"] != plain["pairs_train"]
    for name in SPLITS:                                # the fault draws come from the contrast stream
        if name != "pairs_train":
            assert faulty[name] == default[name] == plain[name]
    assert [r["prompt"] for r in faulty["pairs_train"]] == [r["prompt"] for r in plain["pairs_train"]]

    def one_fault_apart(r):
        a, b = sorted((r["chosen"].split(), r["rejected"].split()), key=len)
        if len(b) - len(a) == 1:                        # a word dropped or inserted, sentences run together
            return any(b[:i] + b[i + 1:] == a for i in range(len(b)))
        if len(a) == len(b):                            # a word replaced (an aspect swap is the other contrast)
            diff = [(x, y) for x, y in zip(a, b) if x != y]
            return len(diff) == 1 and not (diff[0][0] in R.ASPECTS and diff[0][1] in R.ASPECTS)
        return b[:len(a)] == a                          # the end cut off

    share = sum(map(one_fault_apart, faulty["pairs_train"])) / 400
    assert 0.3 < share < 0.5 and sum(map(one_fault_apart, plain["pairs_train"])) / 400 < 0.05
    # The fault moves the annotator's score in most of those pairs (that it lowers it is asserted per
    # kind by test_rm_faults_benchmark_pairs_are_intact_against_worse_copies).
    moved = [gold(r["chosen"], r["prompt"]) != gold(r["rejected"], r["prompt"])
             for r in faulty["pairs_train"] if one_fault_apart(r)]
    assert sum(moved) / len(moved) > 0.8


@pytest.mark.parametrize("split, key", [("pairs_audit", "n_audit_pairs"), ("pairs_val", "n_val_pairs")])
def test_fresh_pairs_are_disjoint_from_the_training_pairs(split, key):
    from pipeline.stages.prepare import pair_key
    plain, _ = build_splits(DataConfig(**{**SMALL.__dict__, "n_pairs": 300}))
    splits, stats = build_splits(DataConfig(**{**SMALL.__dict__, "n_pairs": 300, key: 300}))
    for name in SPLITS:                       # opting in changes no other split
        assert splits[name] == plain[name]
    fresh, train = splits[split], splits["pairs_train"]
    assert not {pair_key(r) for r in fresh} & {pair_key(r) for r in train}
    assert 250 < len(fresh) <= 300 and stats["sizes"][split] == len(fresh)
    assert not _titles_in(fresh) & _titles_in(splits["pairs_eval"])     # training titles only
    assert split not in plain
    if split == "pairs_val":                  # its ceiling, as make_pairs counts it for the other splits
        assert stats["noise_ceiling"]["pairs_val"] == noise_ceiling(fresh) and 0.8 < noise_ceiling(fresh) < 0.95
        assert noise_ceiling(splits["pairs_eval"]) == stats["noise_ceiling"]["pairs_eval"]


SMALL = DataConfig(seed=3, n_sft=40, n_sft_eval=20, n_pairs=30, n_pairs_eval=20, n_ppo_prompts=25,
                   n_eval_prompts=20, label_temperature=0.5, eval_title_fraction=0.2, n_val_pairs=0)
TRAIN = ("sft_train", "pairs_train", "ppo_prompts")
EVAL = ("sft_eval", "pairs_eval", "eval_prompts")


def _titles_in(rows: list[dict]) -> set[str]:
    return {t for r in rows for t in R.TITLES if f" {t} " in f" {r['prompt']} "}


@pytest.fixture(scope="module")
def small_splits():
    return build_splits(SMALL)


def test_build_splits_shape_and_determinism(small_splits):
    splits, stats = small_splits
    assert build_splits(SMALL) == (splits, stats)
    other, _ = build_splits(DataConfig(**{**SMALL.__dict__, "seed": 4}))
    assert other["sft_train"] != splits["sft_train"]
    assert tuple(splits) == SPLITS
    sizes = {"sft_train": 40, "sft_eval": 20, "pairs_train": 30, "pairs_eval": 20,
             "ppo_prompts": 25, "eval_prompts": 20}
    assert {k: len(v) for k, v in splits.items()} == sizes
    assert stats["sizes"] == sizes
    assert stats["titles"] == {"train": 422, "eval": 106}
    ids = [r["id"] for rows in splits.values() for r in rows]
    assert len(ids) == len(set(ids)) == sum(sizes.values())
    assert splits["sft_train"][0]["id"] == "sft_train-0"
    keys = {"sft_train": {"id", "prompt", "response"}, "pairs_train": {"id", "prompt", "chosen", "rejected"},
            "ppo_prompts": {"id", "prompt"}}
    for name, want in keys.items():
        assert all(set(r) == want for r in splits[name])


def test_build_splits_stats_recomputed(small_splits):
    splits, stats = small_splits
    for name in ("pairs_train", "pairs_eval"):
        agree = 0.0
        for r in splits[name]:
            gc, gr = R.gold_score(r["prompt"], r["chosen"]), R.gold_score(r["prompt"], r["rejected"])
            agree += 1.0 if gc > gr else 0.5 if gc == gr else 0.0
        assert stats["noise_ceiling"][name] == pytest.approx(agree / len(splits[name]), abs=1e-12)
    demos = splits["sft_train"]
    gm = sum(R.gold_score(r["prompt"], r["response"]) for r in demos) / len(demos)
    assert stats["demonstrations"]["gold_mean"] == pytest.approx(gm, abs=1e-12)
    wf = sum(R.is_well_formed(r["response"]) for r in demos) / len(demos)
    assert stats["demonstrations"]["well_formed_rate"] == pytest.approx(wf, abs=1e-12)


def test_build_splits_no_title_leakage(small_splits):
    splits, _ = small_splits
    train_titles = set().union(*(_titles_in(splits[n]) for n in TRAIN))
    eval_titles = set().union(*(_titles_in(splits[n]) for n in EVAL))
    assert train_titles and eval_titles
    assert not train_titles & eval_titles
    _, held = R.split_titles(random.Random(SMALL.seed), SMALL.eval_title_fraction)
    assert eval_titles <= set(held)
    assert not train_titles & set(held)


def test_check_leakage_raises_on_leaky_splits(small_splits):
    splits, _ = small_splits
    _, held = R.split_titles(random.Random(SMALL.seed), SMALL.eval_title_fraction)
    check_leakage(splits, held)  # the real splits are clean
    # an evaluation prompt copied into training
    leaky = {k: list(v) for k, v in splits.items()}
    leaky["ppo_prompts"] = leaky["ppo_prompts"] + [{"prompt": splits["eval_prompts"][0]["prompt"]}]
    with pytest.raises(AssertionError, match="leakage: 1 prompts of eval_prompts appear in training"):
        check_leakage(leaky, held)
    # a fresh training prompt naming an evaluation film
    leaky = {k: list(v) for k, v in splits.items()}
    bad = R.make_prompt(held[0], "music", 1)
    leaky["sft_train"] = leaky["sft_train"] + [{"prompt": bad, "response": "x"}]
    with pytest.raises(AssertionError, match=f"evaluation title '{held[0]}'"):
        check_leakage(leaky, held)


def test_run_writes_every_split(tmp_path, small_splits):
    splits, stats = small_splits
    out = tmp_path / "prepared"
    assert write(SMALL, out) == stats
    for name in SPLITS:
        rows = read_jsonl(out / f"{name}.jsonl", required=("id", "prompt"))
        assert rows == splits[name]
    assert (out / "stats.json").is_file() and (out / "config.json").is_file()
    assert (out / "tokenizer").is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prepared"]  # no temp folders left


def test_rm_faults_benchmark_pairs_are_intact_against_worse_copies():
    import importlib.util
    from pathlib import Path
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "rm_faults.py"
    spec = importlib.util.spec_from_file_location("rm_faults", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    pairs = bench.fault_pairs(0, 0.2)
    assert list(pairs) == [*R.CORRUPTIONS, "aspect", "exchange"]
    _, eval_titles = R.split_titles(random.Random(0), 0.2)
    for kind, (prompts, intact, broken) in pairs.items():
        if kind == "exchange":      # only reviews on the asked aspect and another one, said otherwise
            assert 0.1 * bench.N_REVIEWS < len(prompts) < 0.5 * bench.N_REVIEWS
        else:                       # most faults cost the annotator points
            assert 0.8 * bench.N_REVIEWS < len(prompts) <= bench.N_REVIEWS
        assert all(R.gold_score(p, c) < R.gold_score(p, r) for p, r, c in zip(prompts, intact, broken))
        assert all(any(f" {t} " in f" {p} " for t in eval_titles) for p in prompts[:50])
    # The aspect pairs differ in aspect words only, and the first review is the one on the asked aspect.
    for p, good, bad in zip(*pairs["aspect"]):
        asked = R.requested_aspect(p)
        assert [w for w in good.split() if w not in R.ASPECTS] == [w for w in bad.split() if w not in R.ASPECTS]
        assert asked in good.split() and asked not in bad.split()
    # The exchange pairs name the asked aspect both, and trade it with one other aspect.
    for p, good, bad in zip(*pairs["exchange"]):
        asked = R.requested_aspect(p)
        assert asked in good.split() and asked in bad.split() and len(good.split()) == len(bad.split())
        assert len({frozenset((x, y)) for x, y in zip(good.split(), bad.split()) if x != y}) == 1
