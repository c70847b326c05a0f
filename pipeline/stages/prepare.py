"""The `prepare` stage: write every split of the default task, deterministically from `data`.

Outputs (one folder, replaced atomically): sft_train/sft_eval (prompt, response), pairs_train/
pairs_eval (prompt, chosen, rejected), ppo_prompts and eval_prompts (prompt), pairs_val (fresh pairs
of training titles for the reward stage's restart check) and pairs_audit when asked for, the
tokenizer, and stats.json. Titles are split first, so every evaluation split names films never seen in training.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

from ..config import DataConfig, Params, to_dict
from ..files import atomic_dir, atomic_write_json, write_jsonl
from ..tasks import reviews
from ..data.tokenizer import build_word_tokenizer
from .spec import StageSpec

# No model, metrics or tracking: the stage writes one folder atomically (splits, tokenizer,
# stats.json and its config.json), so it needs none of the skeleton's other parts.
SPEC = StageSpec("prepare", help="write the default task's splits and tokenizer", reads=("data",), inputs=(),
                 out="data/prepared", out_help="the folder the prepared splits and tokenizer are written to",
                 parent_params=("data.task", "data.seed"), summary=lambda stats, folders: [
                     f"prepare: wrote {folders['out']} (noise ceiling on held-out pairs {stats['noise_ceiling']['pairs_eval']:.3f})"])

SPLITS = ("sft_train", "sft_eval", "pairs_train", "pairs_eval", "ppo_prompts", "eval_prompts")


def _prompts(rng: random.Random, titles: list[str], n: int) -> list[str]:
    return [reviews.make_prompt(rng.choice(titles), rng.choice(reviews.ASPECTS),
                                rng.randrange(len(reviews.PROMPT_TEMPLATES))) for _ in range(n)]


def _random_style(rng: random.Random) -> reviews.Style:
    """Pairs compare reviews written in different styles, so quality differences are common."""
    return reviews.Style(p_on_aspect=rng.uniform(0.1, 0.95), p_positive=rng.uniform(0.1, 0.95),
                         p_negation=rng.uniform(0.0, 0.3), p_closing=rng.uniform(0.5, 1.0),
                         p_repeat=rng.uniform(0.0, 0.06), p_broken=rng.uniform(0.0, 0.1))


def bradley_terry_label(rng: random.Random, gold_a: float, gold_b: float, temperature: float) -> bool:
    """True when a is preferred: P(a > b) = sigmoid((gold_a - gold_b) / temperature)."""
    z = (gold_a - gold_b) / temperature
    # Stable sigmoid: exp of a large positive argument overflows for small temperatures.
    p = 1.0 / (1.0 + math.exp(-z)) if z >= 0 else math.exp(z) / (1.0 + math.exp(z))
    return rng.random() < p


def make_pairs(rng: random.Random, prompts: list[str], temperature: float, contrast: float = 0.0,
               contrast_rng: random.Random | None = None, corrupt: float = 0.0,
               exchange: float = 0.0) -> list[dict]:
    """Preference pairs with noisy labels (their noise ceiling: `noise_ceiling`).

    With `contrast` > 0 that fraction of pairs compares a review with itself turned to or away from
    the asked aspect (reviews.swap_aspect), so the pair differs in nothing else. Two independent
    reviews differ in many ways at once, and a reward model learns the prompt-aspect match, the
    hardest part of the annotator's judgement, slowly from them (contrast sets, Gardner et al. 2020).
    With `corrupt` > 0 a further fraction compares a review with a copy of itself with one local
    fault (reviews.corrupt: a word dropped or inserted, sentences run together, the end cut), the
    faults a policy's samples have and the sampler's reviews lack. With `exchange` > 0 a further
    fraction compares a review that discusses the asked aspect and another with itself, the two
    exchanged (reviews.exchange_aspects): what is said of the asked aspect differs and nothing else,
    which the aspect swap does not teach (a model can learn that the asked aspect is named without
    learning what is said of it); where a review has no such pair of aspects the pair stays an
    ordinary one. One draw per pair from `contrast_rng` picks aspect contrast (below `contrast`),
    corruption (below `contrast + corrupt`), exchange (below `contrast + corrupt + exchange`) or
    neither; the swap, the fault and the exchange draw from it too, so `rng` is consumed as without
    contrast and every other split keeps its bytes (and `corrupt: 0`, `exchange: 0` keep these)."""
    rows = []
    for prompt in prompts:
        a = reviews.sample_review(rng, prompt, _random_style(rng))
        b = reviews.sample_review(rng, prompt, _random_style(rng))
        while b == a:
            b = reviews.sample_review(rng, prompt, _random_style(rng))
        if (contrast > 0 or corrupt > 0 or exchange > 0) and contrast_rng is not None:
            u = contrast_rng.random()
            if u < contrast:
                b = reviews.swap_aspect(contrast_rng, prompt, a) or b
            elif u < contrast + corrupt:
                b = reviews.corrupt(contrast_rng, a) or b
            elif u < contrast + corrupt + exchange:
                a, b = _exchange_pair(contrast_rng, prompt, a, b)
        ga, gb = reviews.gold_score(prompt, a), reviews.gold_score(prompt, b)
        a_wins = bradley_terry_label(rng, ga, gb, temperature)
        chosen, rejected = (a, b) if a_wins else (b, a)
        rows.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return rows


EXCHANGE_TRIES = 20


def _exchange_pair(rng: random.Random, prompt: str, a: str, b: str) -> tuple[str, str]:
    """A review and its aspect exchange: of `a`, else of `b`, else of a fresh review of the prompt
    (drawn from `rng`, up to EXCHANGE_TRIES); (a, b) unchanged when none has one. Few reviews discuss
    the asked aspect and another one said differently, so without the fresh draws most of the pairs
    meant as exchanges would stay ordinary ones."""
    for review in (a, b):
        exchanged = reviews.exchange_aspects(rng, prompt, review)
        if exchanged is not None:
            return review, exchanged
    for _ in range(EXCHANGE_TRIES):
        review = reviews.sample_review(rng, prompt, _random_style(rng))
        exchanged = reviews.exchange_aspects(rng, prompt, review)
        if exchanged is not None:
            return review, exchanged
    return a, b


def pair_key(row: dict) -> tuple[str, frozenset[str]]:
    """A pair regardless of which side the label chose."""
    return row["prompt"], frozenset((row["chosen"], row["rejected"]))


def fresh_pairs(cfg: DataConfig, train_titles: list[str], train_pairs: list[dict], n: int,
                stream: str) -> tuple[list[dict], float]:
    """`n` fresh preference pairs of the training titles, and their noise ceiling: drawn from their
    own seeded stream `stream`, so the training RM's pairs are neither reused nor taken away and
    every other split keeps its bytes, and without the aspect contrast, as the held-out pairs. A
    fresh pair that happens to equal a training pair is left out: the two sets are disjoint by
    construction. Used for an auditor reward model's pairs (ppo.detector.auditor) and for the
    reward stage's validation pairs (reward.restart)."""
    rng = random.Random(f"{cfg.seed}-{stream}")
    rows = make_pairs(rng, _prompts(rng, train_titles, n), cfg.label_temperature)
    train_keys = {pair_key(r) for r in train_pairs}
    rows = [r for r in rows if pair_key(r) not in train_keys]
    assert not train_keys & {pair_key(r) for r in rows}
    return rows, noise_ceiling(rows)


def noise_ceiling(rows: list[dict]) -> float:
    """Share of the pairs whose label agrees with the gold ordering (a gold tie counts 1/2): the
    accuracy of the best any model can do, which predicts the gold ordering (a tie is a coin flip)."""
    gold = [(reviews.gold_score(r["prompt"], r["chosen"]), reviews.gold_score(r["prompt"], r["rejected"])) for r in rows]
    return sum(1.0 if gc > gr else 0.5 if gc == gr else 0.0 for gc, gr in gold) / max(len(rows), 1)


def check_leakage(splits: dict[str, list[dict]], eval_titles: list[str]) -> None:
    """No evaluation title and no evaluation prompt may appear in a training split."""
    train_prompts = {r["prompt"] for name in ("sft_train", "pairs_train", "ppo_prompts") for r in splits[name]}
    for name in ("sft_eval", "pairs_eval", "eval_prompts"):
        overlap = train_prompts & {r["prompt"] for r in splits[name]}
        if overlap:
            raise AssertionError(f"leakage: {len(overlap)} prompts of {name} appear in training splits")
    for prompt in train_prompts:
        for title in eval_titles:
            if f" {title} " in f" {prompt} ":
                raise AssertionError(f"leakage: evaluation title {title!r} in training prompt {prompt!r}")


def build_splits(cfg: DataConfig) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """All splits and their stats; pure in `cfg` (same seed, same bytes)."""
    rng = random.Random(cfg.seed)
    train_titles, eval_titles = reviews.split_titles(rng, cfg.eval_title_fraction)
    demo = lambda titles, n: [{"prompt": p, "response": reviews.sample_review(rng, p)}  # noqa: E731
                              for p in _prompts(rng, titles, n)]
    splits: dict[str, list[dict]] = {"sft_train": demo(train_titles, cfg.n_sft),
                                     "sft_eval": demo(eval_titles, cfg.n_sft_eval)}
    splits["pairs_train"] = make_pairs(rng, _prompts(rng, train_titles, cfg.n_pairs), cfg.label_temperature,
                                       cfg.aspect_contrast, random.Random(f"{cfg.seed}-aspect-contrast"),
                                       cfg.corrupt_contrast, cfg.aspect_exchange)
    splits["pairs_eval"] = make_pairs(rng, _prompts(rng, eval_titles, cfg.n_pairs_eval), cfg.label_temperature)
    splits["ppo_prompts"] = [{"prompt": p} for p in _prompts(rng, train_titles, cfg.n_ppo_prompts)]
    splits["eval_prompts"] = [{"prompt": p} for p in _prompts(rng, eval_titles, cfg.n_eval_prompts)]
    ceilings = {name: noise_ceiling(splits[name]) for name in ("pairs_train", "pairs_eval")}
    if cfg.n_audit_pairs:
        splits["pairs_audit"], _ = fresh_pairs(cfg, train_titles, splits["pairs_train"], cfg.n_audit_pairs, "audit")
    if cfg.n_val_pairs:
        splits["pairs_val"], ceilings["pairs_val"] = fresh_pairs(cfg, train_titles, splits["pairs_train"],
                                                                 cfg.n_val_pairs, "validation")
    for name, rows in splits.items():
        for i, row in enumerate(rows):
            row["id"] = f"{name}-{i}"
    check_leakage(splits, eval_titles)
    demos = splits["sft_train"]
    gold = [reviews.gold_score(r["prompt"], r["response"]) for r in demos]
    stats = {
        "sizes": {name: len(rows) for name, rows in splits.items()},
        "titles": {"train": len(train_titles), "eval": len(eval_titles)},
        "noise_ceiling": ceilings,
        "demonstrations": {
            "gold_mean": sum(gold) / len(gold),
            "well_formed_rate": sum(map(reviews.is_well_formed, (r["response"] for r in demos))) / len(demos),
        },
        "vocabulary_words": len(reviews.vocabulary()),
    }
    return splits, stats


def run(params: Params, out: Path, progress: bool = True) -> dict[str, Any]:
    """The stage (the `data` section)."""
    return write(params.data, out)


def write(cfg: DataConfig, out: Path) -> dict[str, Any]:
    """Write the splits, the tokenizer, stats.json and config.json under `out` atomically."""
    splits, stats = build_splits(cfg)
    with atomic_dir(out) as tmp:
        for name, rows in splits.items():
            write_jsonl(tmp / f"{name}.jsonl", rows)
        build_word_tokenizer(reviews.vocabulary()).save_pretrained(str(tmp / "tokenizer"))
        atomic_write_json(tmp / "stats.json", stats)
        atomic_write_json(tmp / "config.json", {"data": to_dict(cfg)})
    return stats
