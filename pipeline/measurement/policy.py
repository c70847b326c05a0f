"""Measuring a policy on prompts: the one function SFT's evaluation, the reward model's
SFT-sample correlation, PPO's held-out comparison and the evaluate stage all call.

`measure` samples (or greedily decodes) one response per prompt and scores each response: by a
reward function (an RM), by the task's gold judge, and by its KL to a reference policy;
`summary` turns the per-response lists into means with 95% intervals, the end-of-response rate,
the mean length and distinct-2. What is measured depends only on what is passed: a stage without a
judge passes none. Random numbers: one seeded generator per call (`seed`), used by sampling only,
so the same call gives the same responses wherever it is made.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from ..config import SamplingConfig
from ..data.padding import left_pad, positions, right_pad
from ..data.tokenizer import encode_prompt, encode_response
from ..models.generation import generate_texts
from ..models.logprobs import logprobs_from_logits, response_logits
from .stats import best_of_n_choices, best_of_n_kl, distinct_n, mean_ci

Judge = Callable[[object, str], float]
Scorer = Callable[[list, list[str]], torch.Tensor]


@dataclass
class Measured:
    """Per-response measurements of one policy on a list of prompts (same order)."""
    texts: list[str]
    ended: list[bool]
    values: dict[str, list[float]] = field(default_factory=dict)   # "rm", "kl", "gold" when measured


@torch.inference_mode()
def sequence_kl(policy, ref, tok, prompts: list, responses: list[str], temperature: float,
                batch_size: int = 32) -> list[float]:
    """Per response: sum over tokens of log pi(a_t) - log pi_ref(a_t). Its mean over responses
    sampled from pi estimates the sequence-level KL(pi || pi_ref). The text is re-encoded with eos
    appended: exact for responses that ended with eos (all of them on the default task); for one
    cut by the length limit or a stop token the eos term is one token the policy did not sample."""
    out: list[float] = []
    for start in range(0, len(prompts), batch_size):
        p_ids, p_mask = left_pad([encode_prompt(tok, p) for p in prompts[start:start + batch_size]], tok.pad_token_id)
        r_ids, r_mask = right_pad([encode_response(tok, r) for r in responses[start:start + batch_size]],
                                  tok.pad_token_id)
        ids, mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1).long()   # (B, P + R)
        diff = 0.0
        for model, sign in ((policy, 1.0), (ref, -1.0)):
            logits = response_logits(model, ids, mask, positions(mask), r_ids.size(1), temperature)   # (B, R, V)
            diff = diff + sign * logprobs_from_logits(logits, r_ids)                                  # (B, R)
        out += torch.where(r_mask, diff, 0.0).sum(1).tolist()
    return out


def measure(policy, tok, prompts: list, sampling: SamplingConfig, seed: int, *, greedy: bool = False,
            reward: Optional[Scorer] = None, judge: Optional[Judge] = None, ref=None,
            max_prompt_length: int | None = None) -> Measured:
    """Responses of `policy` to `prompts` and, for each one, the reward's score ("rm"), the KL to
    `ref` ("kl") and the judge's gold score ("gold"), each only when that scorer is given."""
    texts, ended = generate_texts(policy, tok, prompts, sampling, seed, greedy=greedy,
                                  max_prompt_length=max_prompt_length)
    m = Measured(texts, ended)
    if reward is not None:
        m.values["rm"] = reward(prompts, texts).tolist()
    if ref is not None:
        m.values["kl"] = sequence_kl(policy, ref, tok, prompts, texts, sampling.temperature)
    if judge is not None:
        m.values["gold"] = [judge(p, r) for p, r in zip(prompts, texts)]
    return m


def summary(m: Measured, name: Callable[[str], str]) -> dict[str, float]:
    """Means with 95% half-widths (`name("rm")`, `name("rm_ci95")`, ...) of every measured value,
    then the end-of-response rate, mean length in words and distinct-2 (`name("eos_rate")`, ...)."""
    out: dict[str, float] = {}
    for key, values in m.values.items():
        out[name(key)], out[name(f"{key}_ci95")] = mean_ci(values)
    out[name("length")] = sum(len(t.split()) for t in m.texts) / len(m.texts)
    out[name("eos_rate")] = sum(m.ended) / len(m.ended)
    out[name("distinct_2")] = distinct_n(m.texts, 2)
    return out


def best_of_n(policy, tok, prompts: list, sampling: SamplingConfig, seed: int, ns: tuple[int, ...],
              reward: Scorer, judge: Optional[Judge] = None) -> dict[str, Measured]:
    """Best-of-n from `policy` for each n of `ns`: max(ns) samples per prompt (sample k with seed
    `seed + k`), scored once by `reward`; each n keeps the reward's favourite among the first n
    (nested: one draw serves every n). KL is the analytic log n - (n-1)/n. {"best_of_<n>": ...}."""
    cands = [measure(policy, tok, prompts, sampling, seed + k, reward=reward) for k in range(max(ns))]
    scores = [c.values["rm"] for c in cands]
    out = {}
    for n, best in best_of_n_choices(scores, ns).items():
        texts = [cands[k].texts[i] for i, k in enumerate(best)]
        out[f"best_of_{n}"] = Measured(texts, [cands[k].ended[i] for i, k in enumerate(best)],
                                       {"rm": [scores[k][i] for i, k in enumerate(best)],
                                        "kl": [best_of_n_kl(n)] * len(prompts)})
        if judge is not None:
            out[f"best_of_{n}"].values["gold"] = [judge(p, r) for p, r in zip(prompts, texts)]
    return out
