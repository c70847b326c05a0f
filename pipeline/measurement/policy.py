"""Measuring policies on prompts: the one function every site calls (SFT's evaluation, the reward
model's SFT-sample correlation, PPO's and GRPO's held-out comparison, DPO's and RS's measurement,
RS's candidates, and the evaluate and compare stages, best-of-n included).

`measure_policies` samples (or greedily decodes) one response per prompt from each policy and
scores each response: by a reward source (an RM), by the task's gold judge, and by its KL to a
reference policy, each only when given. `summary` turns the per-response lists into means with
95% intervals, the end-of-response rate, the mean length and distinct-2.

Where it runs: on each rank's device, with the models whole there (ZeRO-3 gathers each one in
turn, see `whole`), every rank taking its share of the prompts. The prompts are cut into batches
of GENERATION_BATCH in their global order, batch j goes to rank j mod N, and the results are
gathered in order: a batch is the same batch whatever the number of processes, so N processes
give what one gives. No forward is a collective, so no rank waits while another works, except at
the one gather at the end (at most one batch's time; the spread of batches over ranks is recorded
for the stage's metrics, see balance.py).

Random numbers: each prompt's response is drawn from its own stream, seeded by (the policy's
seed, the prompt's global index) (`prompt_seed`), on the device the policy samples on: the same
call gives the same responses wherever it is made and however the prompts are shared out.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from ..config import SamplingConfig
from ..data.padding import left_pad, pack_responses, positions, right_pad, unpack
from ..data.tokenizer import decode_response, encode_prompt, encode_response, end_ids
from ..models.generation import stop_ids
from ..models.logprobs import packed_stats, response_logprobs
from ..models.rollout_engine import TORCH, Request, RolloutEngine
from ..tracking.metric_names import METRICS_JSON, Metric
from ..context import SINGLE, Context
from . import balance
from .stats import best_of_n_choices, best_of_n_kl, distinct_n, mean_ci

Judge = Callable[[object, str], float]

GENERATION_BATCH = 64   # prompts per sampling call, and the unit the prompts are shared out in
KL_BATCH = 32           # sequences per forward of the KL's log-probs


@dataclass
class Measured:
    """Per-response measurements of one policy on a list of prompts (same order)."""
    texts: list[str]
    ended: list[bool]
    values: dict[str, list[float]] = field(default_factory=dict)   # "rm", "kl", "gold" when measured


@dataclass(frozen=True)
class Policy:
    """One policy to measure: `model` is a module or what holds one (a training engine, a placed
    frozen model), `seed` its sampling seed, `greedy` argmax decoding instead."""
    name: str
    model: Any
    seed: int
    greedy: bool = False


@contextlib.contextmanager
def whole(holder: Any) -> Iterator[Any]:
    """What `holder` holds, whole on this rank: its `gathered()` when it has one (a ZeRO-3 engine
    or frozen model, a reward source placed so), else `holder` itself; in eval mode meanwhile."""
    gathered = getattr(holder, "gathered", None)
    with (gathered() if gathered is not None else contextlib.nullcontext(holder)) as model:
        mode = getattr(model, "training", None)
        if isinstance(model, torch.nn.Module):
            model.eval()
        try:
            yield model
        finally:
            if isinstance(model, torch.nn.Module) and mode:
                model.train()


def prompt_seed(seed: int, index: int) -> int:
    """The seed of prompt `index`'s stream under `seed`: splitmix64 of the pair (Steele et al. 2014),
    so nearby pairs get unrelated streams even where only the low 32 bits seed the generator (the CPU's
    Mersenne Twister)."""
    z = ((seed << 32) ^ index) & 0xFFFFFFFFFFFFFFFF
    z = (z + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF


def shares(n: int, ctx: Context, batch_size: int = GENERATION_BATCH) -> list[tuple[int, int]]:
    """This rank's batches of `n` prompts, as (start, end): batch j is rank j mod N's."""
    starts = range(0, n, batch_size)
    return [(s, min(s + batch_size, n)) for j, s in enumerate(starts) if j % ctx.world_size == ctx.rank]


@dataclass
class _Part:
    """One batch of one policy on this rank."""
    texts: list[str]
    ended: list[bool]
    values: dict[str, list[float]] = field(default_factory=dict)
    logprobs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)   # KL chunks: (B, R) each


def measure_policies(policies: Sequence[Policy], tok, prompts: list, sampling: SamplingConfig, *,
                     ctx: Context = SINGLE, reward: Any = None, judge: Optional[Judge] = None, ref: Any = None,
                     max_prompt_length: int | None = None, batch_size: int = GENERATION_BATCH,
                     engine: RolloutEngine = TORCH, packed: bool = False) -> dict[str, Measured]:
    """Each policy's responses to `prompts` (sampled by `engine`) and, per response, the reward
    source's score ("rm"), the KL to `ref` ("kl") and the judge's gold score ("gold"), each only when
    given. Collective (every rank calls it with the same arguments and gets every result).
    `packed`: the KL's forwards on packed rows (the reward source packs its own when built to)."""
    mine = shares(len(prompts), ctx, batch_size)
    ids = {s: [encode_prompt(tok, p, max_prompt_length) for p in prompts[s:e]] for s, e in mine}
    parts: dict[str, dict[int, _Part]] = {}
    for pol in policies:                          # 1. sampling, each policy whole in turn
        with whole(pol.model) as model:
            parts[pol.name] = {s: _sample(model, tok, ids[s], sampling, pol, s, engine) for s, _ in mine}
    if ref is not None:                           # 2. KL: the policies' log-probs, then the reference's
        for pol in policies:
            with whole(pol.model) as model:
                for s, e in mine:
                    parts[pol.name][s].logprobs = _logprobs(model, tok, prompts[s:e], parts[pol.name][s].texts,
                                                            sampling.temperature, packed)
        with whole(ref) as model:
            for pol in policies:
                for s, e in mine:
                    part = parts[pol.name][s]
                    theirs = _logprobs(model, tok, prompts[s:e], part.texts, sampling.temperature, packed)
                    part.values["kl"] = [v for (lp, mask), (rlp, _) in zip(part.logprobs, theirs)
                                         for v in torch.where(mask, lp - rlp, 0.0).sum(1).tolist()]
                    part.logprobs = []
    if reward is not None:                        # 3. reward scores, the reward model whole once
        with whole(reward) as source:
            for pol in policies:
                for s, e in mine:
                    parts[pol.name][s].values["rm"] = source.score(prompts[s:e], parts[pol.name][s].texts).tolist()
    if judge is not None:                         # 4. the gold judge (plain Python)
        for pol in policies:
            for s, e in mine:
                part = parts[pol.name][s]
                part.values["gold"] = [judge(p, r) for p, r in zip(prompts[s:e], part.texts)]
    return _gathered(parts, ctx, [pol.name for pol in policies], len(mine))


def _sample(model, tok, ids: list[list[int]], sampling: SamplingConfig, pol: Policy, start: int,
            engine: RolloutEngine) -> _Part:
    seeds = [prompt_seed(pol.seed, start + i) for i in range(len(ids))]
    out = engine.generate(model, Request(ids, tok.pad_token_id, tuple(stop_ids(tok, model, sampling)), sampling,
                                         greedy=pol.greedy, seeds=seeds))
    ends = end_ids(tok, model)
    return _Part([decode_response(tok, row.tolist(), ends) for row in out.response_ids], out.ended.tolist())


@torch.no_grad()   # not inference_mode: see pipeline/ppo/scoring.py
def _logprobs(model, tok, prompts: list, responses: list[str], temperature: float,
              packed: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per KL_BATCH chunk: (B, R) log pi(a_t) of each response token (its text re-encoded with eos
    appended) and the (B, R) response mask. `packed`: each chunk's sequences in one packed row
    (data.padding.pack), zero on padding; the same numbers up to rounding."""
    out = []
    device = next(model.parameters()).device
    for start in range(0, len(prompts), KL_BATCH):
        p_seqs = [encode_prompt(tok, p) for p in prompts[start:start + KL_BATCH]]
        r_seqs = [encode_response(tok, r) for r in responses[start:start + KL_BATCH]]
        r_ids, r_mask = right_pad(r_seqs, tok.pad_token_id)                                         # (B, R) each
        if packed:
            ids, pos, predicting = pack_responses(p_seqs, r_seqs)                                   # (1, N), (1, N), (K,)
            lp, _ = packed_stats(model, ids.to(device), pos.to(device), predicting.to(device), temperature)   # (K,)
            out.append((unpack(lp, r_mask.to(device)), r_mask.to(device)))
            continue
        p_ids, p_mask = left_pad(p_seqs, tok.pad_token_id)
        ids, mask = torch.cat([p_ids, r_ids], 1).to(device), torch.cat([p_mask, r_mask], 1).long().to(device)
        lp, _ = response_logprobs(model, ids, mask, positions(mask), r_ids.to(device), temperature)   # (B, R)
        out.append((lp, r_mask.to(device)))
    return out


def _gathered(parts: dict[str, dict[int, _Part]], ctx: Context, names: list[str], batches: int) -> dict[str, Measured]:
    """Every rank's parts, in the prompts' order, on every rank (`batches`: this rank's count,
    recorded with the others')."""
    local = [(name, s, p.texts, p.ended, p.values) for name in names for s, p in parts[name].items()]
    ranks = ctx.gather((batches, local))
    balance.record([n for n, _ in ranks])
    everything = sorted((row for _, rows in ranks for row in rows), key=lambda row: row[1])
    out = {name: Measured([], []) for name in names}
    for name, _, texts, ended, values in everything:
        m = out[name]
        m.texts += texts
        m.ended += ended
        for key, vals in values.items():
            m.values.setdefault(key, []).extend(vals)
    return out


def measure(policy, tok, prompts: list, sampling: SamplingConfig, seed: int, *, greedy: bool = False,
            reward: Any = None, judge: Optional[Judge] = None, ref: Any = None,
            max_prompt_length: int | None = None, ctx: Context = SINGLE, packed: bool = False) -> Measured:
    """`measure_policies` of one policy."""
    return measure_policies([Policy("policy", policy, seed, greedy)], tok, prompts, sampling, ctx=ctx, reward=reward,
                            judge=judge, ref=ref, max_prompt_length=max_prompt_length, packed=packed)["policy"]


def measure_trained(name: str, policy, tok, prompts: list, sampling: SamplingConfig, seed: int, *,
                    sft: Any = None, reward: Any = None, judge: Optional[Judge] = None,
                    max_prompt_length: int | None = None, ctx: Context = SINGLE, beside_sft: bool = False,
                    greedy: bool = False, packed: bool = False) -> tuple[dict[str, float], dict[str, Measured]]:
    """Collective. The measurement every training stage makes of the policy it trained (a module or
    an engine) called `name`, on held-out `prompts`, every rank its share: sampled as `sampling` says
    from `seed`, with its KL to `sft` when given and the RM and gold scores when `reward` and `judge`
    are: `<name>/<key>` and `<name>/<key>_ci95` for each measured value and
    `<name>/<length|eos_rate|distinct_2>`, the names the evaluate and compare stages give a policy.
    `beside_sft`: `sft` sampled the same way too (`sft/...`), and the per-prompt gold gain of the
    policy over it (`<name>/gold_gain`, with `_ci95`, with a judge). `greedy`: its greedy responses
    too (`<name>/<...>_greedy`). Returns the metrics and the responses by policy ("sft", `name`,
    "greedy"). `packed`: as measure_policies'."""
    policies = [Policy(name, policy, seed)]
    if beside_sft:
        policies.insert(0, Policy("sft", sft, seed))
    if greedy:
        policies.insert(0, Policy("greedy", policy, seed, greedy=True))
    per = measure_policies(policies, tok, prompts, sampling, ctx=ctx, reward=reward, judge=judge, ref=sft,
                           max_prompt_length=max_prompt_length, packed=packed)
    out: dict[str, float] = {}
    for pol in policies:
        if pol.name == "greedy":
            out.update(summary(per["greedy"], lambda key: f"{name}/{key}_greedy"))
        else:
            out.update(summary(per[pol.name], lambda key, who=pol.name: f"{who}/{key}"))
    if beside_sft and judge is not None:
        gains = [a - b for a, b in zip(per[name].values["gold"], per["sft"].values["gold"])]
        out[f"{name}/gold_gain"], out[f"{name}/gold_gain_ci95"] = mean_ci(gains)
    return out, per


# What each of `measure`'s values is, as a method stage's declarations name it.
SCORES = {"rm": "mean RM score", "gold": "mean gold score", "kl": "mean sequence-level sampled KL to SFT"}


def sampled_declarations(stage: str, scores: Sequence[str] | Mapping[str, str], *, policy: Optional[str] = None,
                         condition: Optional[str] = "compare",
                         conditions: Optional[Mapping[str, Optional[str]]] = None) -> list[Metric]:
    """The metrics.json names `summary` gives one sampled policy (`<policy>/...`; `policy`: the
    stage by default), as `stage` writes them under `condition` (`conditions`: a score's own): each
    score and the half-width of its 95% interval, then the responses' length, end rate and
    distinct-2. `scores`: each score's key with its meaning, or the keys alone: a method stage's
    trained policy sampled on its held-out prompts (`measure_trained`)."""
    policy = stage if policy is None else policy
    if not isinstance(scores, Mapping):
        scores = {key: f"{SCORES[key]} of the trained policy's responses to the first `{stage}.n_eval_prompts` "
                       "held-out prompts (`prompts.sampling`)" for key in scores}

    def m(name: str, meaning: str, when: Optional[str] = condition) -> Metric:
        return Metric(stage, METRICS_JSON, f"{policy}/{name}", meaning, when)
    out = []
    for key, meaning in scores.items():
        when = (conditions or {}).get(key, condition)
        out += [m(key, meaning, when), m(f"{key}_ci95", "half-width of its 95% interval", when)]
    return out + [m("length", "mean length of the policy's responses, words"),
                  m("eos_rate", "rate of the policy's responses that ended with eos or the stop token"),
                  m("distinct_2", "distinct bigrams / bigrams over the policy's responses (words)")]


def sequence_kl(policy, ref, tok, prompts: list, responses: list[str], temperature: float) -> list[float]:
    """Per response: sum over its tokens of log pi(a_t) - log pi_ref(a_t) (the text re-encoded with eos
    appended). Its mean over responses sampled from pi estimates the sequence-level KL(pi || pi_ref):
    exact for responses that ended with eos (all of them on the default task); for one cut by the
    length limit or a stop token the eos term is one token the policy did not sample."""
    mine = _logprobs(policy, tok, prompts, responses, temperature)
    theirs = _logprobs(ref, tok, prompts, responses, temperature)
    return [v for (lp, mask), (rlp, _) in zip(mine, theirs) for v in torch.where(mask, lp - rlp, 0.0).sum(1).tolist()]


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


def candidates(policy, seed: int, n: int, prefix: str = "candidate") -> list[Policy]:
    """`n` draws of `policy` for best-of-n: draw k with seed `seed + k`."""
    return [Policy(f"{prefix}_{k}", policy, seed + k) for k in range(n)]


def best_of_n(draws: list[Measured], prompts: list, ns: tuple[int, ...],
              judge: Optional[Judge] = None) -> dict[str, Measured]:
    """Best-of-n for each n of `ns` from max(ns) `draws` scored by the reward ("rm"): each n keeps the
    reward's favourite among the first n (nested: one draw serves every n); the judge scores the kept
    responses. KL is the analytic log n - (n-1)/n. {"best_of_<n>": ...}."""
    scores = [c.values["rm"] for c in draws]
    out = {}
    for n, best in best_of_n_choices(scores, ns).items():
        texts = [draws[k].texts[i] for i, k in enumerate(best)]
        out[f"best_of_{n}"] = Measured(texts, [draws[k].ended[i] for i, k in enumerate(best)],
                                       {"rm": [scores[k][i] for i, k in enumerate(best)],
                                        "kl": [best_of_n_kl(n)] * len(prompts)})
        if judge is not None:
            out[f"best_of_{n}"].values["gold"] = [judge(p, r) for p, r in zip(prompts, texts)]
    return out
