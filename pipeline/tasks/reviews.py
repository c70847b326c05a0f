"""The embedded default task: short film reviews judged by a simulated annotator.

Real RLHF data needs people; like AlpacaFarm (Dubois et al. 2023) and Gao et al. 2023 ("Scaling
laws for reward model overoptimization") we replace them with a deterministic gold annotator. Every
later stage can then be measured against a truth that the reward model only approximates.

Text conventions: words and punctuation are separated by single spaces ("the music was good .").
That is also what the word-level default tokenizer decodes to, so gold scoring of generated text
needs no detokenisation.

A review is one to four body sentences followed by one closing sentence, e.g.
    prompt:   "Write a review of the film Crimson Harbor . Discuss the music ."
    response: "the music was really superb . however the plot was not good . overall , a fine film ."
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# ---- Vocabulary ------------------------------------------------------------------------------

ASPECTS = ("plot", "acting", "music", "ending", "dialogue", "visuals", "pacing", "characters",
           "script", "cast", "soundtrack", "direction")
# Polarity of each adjective: the annotator's sentiment lexicon.
POSITIVE = ("good", "great", "superb", "wonderful", "brilliant", "moving", "delightful", "gripping",
            "charming", "clever", "beautiful", "fresh", "stunning", "fine", "solid", "memorable")
NEGATIVE = ("bad", "dull", "awful", "boring", "weak", "clumsy", "tedious", "flat", "messy",
            "forgettable", "bland", "poor", "lifeless", "silly", "tiresome", "shallow")
ADJ_POLARITY = {**{a: 1.0 for a in POSITIVE}, **{a: -1.0 for a in NEGATIVE}}
# Intensifiers scale the polarity of the adjective they precede.
INTENSIFIERS = {"very": 1.5, "really": 1.5, "truly": 1.5, "extremely": 1.5, "quite": 1.2, "somewhat": 0.5}
VERBS = ("was", "is", "felt", "seemed")
NEGATIONS = ("not", "never")
CONNECTIVES = ("also", "however", "and", "still", "sadly", "happily", "then", "honestly")
# "I <verb> the <aspect> ." sentences carry polarity in the verb.
FEELING_VERBS = {"loved": 1.0, "liked": 1.0, "enjoyed": 1.0, "admired": 1.0,
                 "hated": -1.0, "disliked": -1.0, "regretted": -1.0}
CLOSING_OPENERS = ("overall", "in short", "all in all", "in the end")
# "overall , I recommend it ." (+1) / "overall , skip it ." (-1) / "overall , a <adj> film ."
RECOMMEND = {"I recommend it": 1.0, "see it": 1.0, "skip it": -1.0, "avoid it": -1.0}

TITLE_FIRST = ("Crimson", "Silent", "Broken", "Golden", "Hidden", "Last", "Lost", "Distant",
               "Burning", "Frozen", "Velvet", "Hollow", "Iron", "Paper", "Midnight", "Wild",
               "Quiet", "Electric", "Northern", "Bitter", "Painted", "Second", "Falling", "Secret")
TITLE_SECOND = ("Harbor", "River", "Garden", "Empire", "Letter", "Mirror", "Station", "Summer",
                "Orchard", "Frontier", "Lantern", "Island", "Compass", "Kingdom", "Voyage",
                "Promise", "Horizon", "Winter", "Signal", "Theater", "Meadow", "Engine")
TITLES = tuple(f"{a} {b}" for a in TITLE_FIRST for b in TITLE_SECOND)
PROMPT_TEMPLATES = ("Write a review of the film {title} . Discuss the {aspect} .",
                    "Review the film {title} . Focus on the {aspect} .",
                    "What did you think of {title} ? Talk about the {aspect} .")


def vocabulary() -> list[str]:
    """Every word the grammar and prompts can produce (the default tokenizer's vocabulary)."""
    words: set[str] = {".", ",", "?", "the", "I", "a", "film", "it"}
    for group in (ASPECTS, POSITIVE, NEGATIVE, INTENSIFIERS, VERBS, NEGATIONS, CONNECTIVES,
                  FEELING_VERBS, TITLE_FIRST, TITLE_SECOND):
        words.update(group)
    for phrase in (*CLOSING_OPENERS, *RECOMMEND, *PROMPT_TEMPLATES):
        words.update(w for w in phrase.split() if not w.startswith("{"))
    return sorted(words)


# ---- Prompts ---------------------------------------------------------------------------------


def make_prompt(title: str, aspect: str, template: int) -> str:
    return PROMPT_TEMPLATES[template].format(title=title, aspect=aspect)


def requested_aspect(prompt: str) -> str | None:
    """The aspect a prompt asks about: the word after the last 'the' before the final '.'."""
    words = prompt.split()
    for i in range(len(words) - 2, 0, -1):
        if words[i - 1] == "the" and words[i] in ASPECTS:
            return words[i]
    return None


def split_titles(rng: random.Random, eval_fraction: float) -> tuple[list[str], list[str]]:
    """Disjoint train/eval title sets, so evaluation prompts name films never seen in training."""
    titles = list(TITLES)
    rng.shuffle(titles)
    n_eval = max(1, round(len(titles) * eval_fraction))
    return sorted(titles[n_eval:]), sorted(titles[:n_eval])


# ---- Parsing and the gold annotator -----------------------------------------------------------


@dataclass(frozen=True)
class Sentence:
    """One parsed sentence. `aspect` is None for sentences about the film as a whole."""
    kind: str            # "body" | "closing" | "broken"
    aspect: str | None
    polarity: float
    words: tuple[str, ...]


def _adjective_phrase(words: list[str]) -> float | None:
    """Parse `[not|never] [intensifier] adjective` and return its signed strength, else None."""
    sign = 1.0
    if words and words[0] in NEGATIONS:
        sign, words = -1.0, words[1:]
    scale = 1.0
    if words and words[0] in INTENSIFIERS:
        scale, words = INTENSIFIERS[words[0]], words[1:]
    if len(words) != 1 or words[0] not in ADJ_POLARITY:
        return None
    # "not very good" is mildly negative, not strongly: negation flips the sign of the base
    # polarity and an intensifier under negation does not amplify it.
    return sign * ADJ_POLARITY[words[0]] * (1.0 if sign < 0 else scale)


def parse_sentence(words: list[str]) -> Sentence:
    """Parse one sentence (without its final '.') against the review grammar."""
    raw = tuple(words)
    for opener in CLOSING_OPENERS:
        op = opener.split()
        if words[:len(op)] == op and words[len(op):len(op) + 1] == [","]:
            rest = words[len(op) + 1:]
            if " ".join(rest) in RECOMMEND:
                return Sentence("closing", None, RECOMMEND[" ".join(rest)], raw)
            if len(rest) >= 3 and rest[0] == "a" and rest[-1] == "film":
                strength = _adjective_phrase(rest[1:-1])
                if strength is not None and rest[1] not in NEGATIONS:
                    return Sentence("closing", None, strength, raw)
            return Sentence("broken", None, 0.0, raw)
    if words and words[0] in CONNECTIVES:
        words = words[1:]
    if len(words) == 4 and words[0] == "I" and words[1] in FEELING_VERBS and words[2] == "the" \
            and words[3] in ASPECTS + ("film",):
        aspect = None if words[3] == "film" else words[3]
        return Sentence("body", aspect, FEELING_VERBS[words[1]], raw)
    if len(words) >= 4 and words[0] == "the" and words[1] in ASPECTS + ("film",) and words[2] in VERBS:
        strength = _adjective_phrase(words[3:])
        if strength is not None:
            aspect = None if words[1] == "film" else words[1]
            return Sentence("body", aspect, strength, raw)
    return Sentence("broken", None, 0.0, raw)


def parse_review(response: str) -> list[Sentence]:
    """Split on '.' and parse each sentence; a trailing fragment without '.' is broken."""
    words = response.split()
    sentences, current = [], []
    for w in words:
        if w == ".":
            sentences.append(parse_sentence(current) if current else Sentence("broken", None, 0.0, ()))
            current = []
        else:
            current.append(w)
    if current:
        sentences.append(Sentence("broken", None, 0.0, tuple(current)))
    return sentences


# Weights of the gold score. Sentiment counts as a mean (not a sum), so more praise is not better;
# repetition and excess length are penalised. A reward model trained on ordinary reviews, which
# rarely repeat, has no evidence of these penalties: that is the gap over-optimisation exploits.
W_ON_ASPECT, W_OFF_ASPECT = 1.0, -0.5
W_ASPECT_SENTIMENT, W_OVERALL_SENTIMENT, W_CLOSING_SENTIMENT = 1.0, 0.5, 0.5
P_BROKEN, P_REPEAT, P_EXTRA_SENTENCE, P_NO_CLOSING = 1.0, 1.0, 0.5, 1.5
MAX_BODY_SENTENCES = 4


def gold_score(prompt: str, response: str) -> float:
    """The simulated annotator's verdict: helpful (on the requested aspect), positive, well formed.

    Components: +1 if a body sentence discusses the requested aspect (else -0.5); the mean polarity
    of sentences on that aspect (x1.0), of all body sentences (x0.5) and of the closing (x0.5);
    -1 per broken sentence, -1 per repeated sentence, -0.5 per body sentence beyond four, and -1.5
    when the review does not end with a closing sentence. Negation flips polarity.
    """
    sentences = parse_review(response)
    if not sentences:
        return -3.0
    aspect = requested_aspect(prompt)
    body = [s for s in sentences if s.kind == "body"]
    closing = sentences[-1] if sentences[-1].kind == "closing" else None
    # A closing anywhere but last breaks the review's structure.
    misplaced = sum(1 for s in sentences[:-1] if s.kind == "closing")
    broken = sum(1 for s in sentences if s.kind == "broken") + misplaced
    seen: set[tuple[str, ...]] = set()
    repeats = 0
    for s in sentences:
        if s.kind != "broken" and s.words in seen:
            repeats += 1
        seen.add(s.words)
    on_aspect = [s.polarity for s in body if s.aspect == aspect]
    score = W_ON_ASPECT if on_aspect else W_OFF_ASPECT
    if on_aspect:
        score += W_ASPECT_SENTIMENT * sum(on_aspect) / len(on_aspect)
    if body:
        score += W_OVERALL_SENTIMENT * sum(s.polarity for s in body) / len(body)
    score += W_CLOSING_SENTIMENT * closing.polarity if closing else -P_NO_CLOSING
    score -= P_BROKEN * broken + P_REPEAT * repeats
    score -= P_EXTRA_SENTENCE * max(0, len(body) - MAX_BODY_SENTENCES)
    return float(score)


def is_well_formed(response: str) -> bool:
    """Grammatical and properly ended: every sentence parses and exactly the last one closes."""
    sentences = parse_review(response)
    return (bool(sentences) and sentences[-1].kind == "closing"
            and all(s.kind == "body" for s in sentences[:-1]))


# ---- Sampling reviews of mixed quality ----------------------------------------------------------


@dataclass(frozen=True)
class Style:
    """Knobs of the review sampler; demonstrations mix qualities so later stages can improve."""
    p_on_aspect: float = 0.55
    p_positive: float = 0.55
    p_negation: float = 0.15
    p_closing: float = 0.9
    p_repeat: float = 0.03
    p_broken: float = 0.03


def _body_sentence(rng: random.Random, aspect: str, style: Style, first: bool) -> str:
    positive = rng.random() < style.p_positive
    negate = rng.random() < style.p_negation
    if rng.random() < 0.2:
        verbs = [v for v, p in FEELING_VERBS.items() if (p > 0) == positive]
        words = ["I", rng.choice(verbs), "the", aspect]
    else:
        # Negation flips polarity: to say something positive with "not", use a negative adjective.
        pool = POSITIVE if positive != negate else NEGATIVE
        adj = [rng.choice(NEGATIONS)] if negate else []
        if rng.random() < 0.35:
            adj.append(rng.choice(list(INTENSIFIERS)))
        adj.append(rng.choice(pool))
        words = ["the", aspect, rng.choice(VERBS), *adj]
    if not first and rng.random() < 0.4:
        words.insert(0, rng.choice(CONNECTIVES))
    return " ".join(words) + " ."


def _closing(rng: random.Random, style: Style) -> str:
    opener = rng.choice(CLOSING_OPENERS)
    positive = rng.random() < style.p_positive
    if rng.random() < 0.5:
        rest = rng.choice([r for r, p in RECOMMEND.items() if (p > 0) == positive])
    else:
        rest = "a " + rng.choice(POSITIVE if positive else NEGATIVE) + " film"
    return f"{opener} , {rest} ."


def sample_review(rng: random.Random, prompt: str, style: Style = Style()) -> str:
    """One review of 1-4 body sentences and (usually) a closing, with the style's mix of faults."""
    asked = requested_aspect(prompt) or rng.choice(ASPECTS)
    n_body = rng.choice((1, 2, 2, 3, 3, 4))
    sentences = []
    for i in range(n_body):
        if i == 0 and rng.random() < style.p_on_aspect:
            aspect = asked
        else:
            aspect = rng.choice(ASPECTS + ("film",)) if rng.random() < 0.8 else asked
        sentences.append(_body_sentence(rng, aspect, style, first=i == 0))
    if sentences and rng.random() < style.p_repeat:
        sentences.append(rng.choice(sentences))
    if rng.random() < style.p_broken:
        cut = rng.choice(sentences).split()[:-2]
        sentences.insert(rng.randrange(len(sentences) + 1), " ".join(cut + ["."]))
    if rng.random() < style.p_closing:
        sentences.append(_closing(rng, style))
    return " ".join(sentences)


def swap_aspect(rng: random.Random, prompt: str, response: str) -> str | None:
    """The response with one aspect word replaced throughout, so that it turns to or away from the
    aspect the prompt asks for: the asked aspect becomes another one, or (when the review does not
    discuss it) an aspect it does discuss becomes the asked one. None when it names no aspect."""
    asked = requested_aspect(prompt)
    words = response.split()
    present = sorted({w for w in words if w in ASPECTS})
    if not present or asked is None:
        return None
    if asked in present:
        old, new = asked, rng.choice([a for a in ASPECTS if a not in present])
    else:
        old, new = rng.choice(present), asked
    return " ".join(new if w == old else w for w in words)


def exchange_aspects(rng: random.Random, prompt: str, response: str) -> str | None:
    """The response with the asked aspect and another aspect it discusses exchanged throughout, so
    that what it says about each moves to the other: what the review says about the asked aspect
    changes, and whether it discusses it and how positive it is overall do not. A reward model that
    has learnt only whether the asked aspect is named, not what is said of it, scores both alike.
    None when the review does not discuss the asked aspect and another one, or when the annotator
    scores the exchange the same (both aspects said alike)."""
    asked = requested_aspect(prompt)
    words = response.split()
    others = sorted({w for w in words if w in ASPECTS} - {asked})
    if asked is None or asked not in words or not others:
        return None
    other = rng.choice(others)
    swap = {asked: other, other: asked}
    out = " ".join(swap.get(w, w) for w in words)
    return None if gold_score(prompt, out) == gold_score(prompt, response) else out


CORRUPTIONS = ("drop_word", "merge_sentences", "insert_word", "replace_word", "cut_end")


def corrupt(rng: random.Random, response: str, kind: str | None = None) -> str | None:
    """The response with one local fault of the kind a sampling policy makes: a word dropped, two
    sentences run together (an inner '.' dropped), a vocabulary word inserted or put in place of
    one, or the end cut off (`kind`, else drawn from CORRUPTIONS). The annotator usually scores the
    result lower (a broken sentence: -1; a lost closing: -1.5); a few faults keep the grammar (one
    positive adjective for another). None when the kind does not apply or changes nothing.

    Reviews of the task's sampler break in one way only (a sentence losing its last two words), so
    a reward model trained on them has no evidence that other faults are bad, and PPO finds them:
    `the soundtrack is good in short , a fine film .` (two sentences run together) is what an
    earlier default's policy collapsed to."""
    kind = kind if kind is not None else rng.choice(CORRUPTIONS)
    if kind not in CORRUPTIONS:
        raise ValueError(f"unknown corruption {kind!r}; expected one of {CORRUPTIONS}")
    words = response.split()
    inner = [i for i, w in enumerate(words[:-1]) if w != "."]       # words that are not a full stop
    stops = [i for i, w in enumerate(words[:-1]) if w == "."]       # full stops between sentences
    if kind == "drop_word" and len(inner) > 1:
        del words[rng.choice(inner)]
    elif kind == "merge_sentences" and stops:
        del words[rng.choice(stops)]
    elif kind == "insert_word":
        words.insert(rng.randrange(len(words)), rng.choice(_CORRUPTION_WORDS))
    elif kind == "replace_word" and inner:
        words[rng.choice(inner)] = rng.choice(_CORRUPTION_WORDS)
    elif kind == "cut_end" and len(words) > 2:
        words = words[:rng.randrange(2, len(words))]
    else:
        return None                                                 # this kind does not apply
    out = " ".join(words)
    return None if out == response else out


_CORRUPTION_WORDS = tuple(w for w in vocabulary() if w != ".")


def gold_scores(prompts: list[str], responses: list[str]) -> list[float]:
    """Batch form of `gold_score`, usable as PPO's `reward_source` for an oracle run."""
    return [gold_score(p, r) for p, r in zip(prompts, responses)]
