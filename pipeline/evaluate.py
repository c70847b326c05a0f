"""The `evaluate` stage: SFT, best-of-n and PPO policies on the held-out prompts.

For each policy: reward-model score, gold score (when the task has a judge), KL to the reference
(SFT) policy, response length, end-of-response rate, distinct-n diversity. Then win rates of PPO
over SFT (gold and RM verdicts, ties count half) with bootstrap intervals, and the over-optimisation
signal: how much more the reward model prefers PPO than the gold annotator does.

Best-of-n samples n responses from SFT and keeps the one the reward model scores highest; its KL
to SFT is known analytically, log n - (n - 1) / n (Stiennon et al. 2020, appendix G.3), an upper
bound that is tight when responses rarely repeat. Each n of `evaluate.best_of_n` is measured from
one draw of max(n) samples per prompt: best-of-n keeps the favourite among the first n, so the
baselines are nested and cost as much as the largest alone; the KL-vs-score curve they trace is
what PPO has to beat at its own KL (Gao et al. 2023).

The verdict (first line of report.md, end of the console output, the MLflow parent run's
description) says in one paragraph whether PPO beat SFT and whether the RM was gamed.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .config import EvaluateConfig, Params, to_dict
from . import inputs
from .generation import generate_texts, left_pad
from .io import atomic_write_json, atomic_write_text
from .models import load_policy
from .plots import evaluation_plots
from .reward_source import RewardModelSource
from .tokenizer import encode_prompt, encode_response
from .mlflow_tracking import stage_tracking
from .tracking import StepLog, write_metrics


def policies(cfg: EvaluateConfig) -> tuple[str, ...]:
    """Policy names in report order: sft, best_of_<n> for each n, ppo."""
    return ("sft", *(f"best_of_{n}" for n in cfg.best_of_n), "ppo")


# ---- Pure statistics ------------------------------------------------------------------------------


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its normal-approximation 95% interval."""
    n = len(xs)
    mean = sum(xs) / n
    var = sum((x - mean) ** 2 for x in xs) / max(n - 1, 1)
    return mean, 1.96 * math.sqrt(var / n)


def win_rate(a: list[float], b: list[float], n_boot: int, seed: int) -> tuple[float, float, float]:
    """P(a beats b) on paired items, ties counting half, with a percentile bootstrap 95% interval
    over items (Efron & Tibshirani 1993). Returns (rate, low, high)."""
    wins = [1.0 if x > y else 0.5 if x == y else 0.0 for x, y in zip(a, b)]
    n = len(wins)
    rng = random.Random(seed)
    boots = sorted(sum(wins[rng.randrange(n)] for _ in range(n)) / n for _ in range(n_boot))
    return sum(wins) / n, boots[int(0.025 * (n_boot - 1))], boots[int(math.ceil(0.975 * (n_boot - 1)))]


def best_of_n_kl(n: int) -> float:
    """KL(best-of-n || base) = log n - (n - 1) / n for continuous, tie-free rewards."""
    return math.log(n) - (n - 1) / n


def best_of_n_kl_exact(probs: list[float], rewards: list[float], n: int) -> float:
    """Exact KL of best-of-n over a finite set of outcomes with distinct rewards (for testing the
    formula): P_bon(y) = F(y)^n - F(y-)^n with F the base CDF ordered by reward."""
    order = sorted(range(len(probs)), key=lambda i: rewards[i])
    kl, cdf = 0.0, 0.0
    for i in order:
        p_bon = (cdf + probs[i]) ** n - cdf ** n
        cdf += probs[i]
        if p_bon > 0:
            kl += p_bon * math.log(p_bon / probs[i])
    return kl


def best_of_n_choices(scores: list[list[float]], ns: tuple[int, ...]) -> dict[int, list[int]]:
    """Nested best-of-n. scores[k][i]: RM score of candidate k (k < max(ns)) on prompt i. Returns,
    for each n, per prompt the index of the RM's favourite among candidates 0..n-1 (the first on ties)."""
    n_prompts = len(scores[0])
    return {n: [max(range(n), key=lambda k: scores[k][i]) for i in range(n_prompts)] for n in ns}


def distinct_n(texts: list[str], n: int) -> float:
    """Distinct n-grams over all n-grams in the responses (Li et al. 2016): 1 = no repetition."""
    grams = [tuple(w[i:i + n]) for w in (t.split() for t in texts) for i in range(len(w) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 0.0


# ---- Policies ----------------------------------------------------------------------------------------


@torch.inference_mode()
def sequence_kl(policy, ref, tok, prompts: list[str], responses: list[str], temperature: float,
                batch_size: int = 32) -> list[float]:
    """Per response: sum over tokens of log pi(a_t) - log pi_ref(a_t). Its mean over responses
    sampled from pi estimates the sequence-level KL(pi || pi_ref). The text is re-encoded with eos
    appended: exact for responses that ended with eos (all of them on the default task); for one
    cut by the length limit or a stop token the eos term is one token the policy did not sample."""
    out: list[float] = []
    for start in range(0, len(prompts), batch_size):
        p_ids, p_mask = left_pad([encode_prompt(tok, p) for p in prompts[start:start + batch_size]], tok.pad_token_id)
        rs = [encode_response(tok, r) for r in responses[start:start + batch_size]]
        width = max(map(len, rs))
        r_ids = torch.full((len(rs), width), tok.pad_token_id, dtype=torch.long)
        r_mask = torch.zeros((len(rs), width), dtype=torch.bool)
        for i, r in enumerate(rs):
            r_ids[i, :len(r)], r_mask[i, :len(r)] = torch.tensor(r), True
        ids, mask = torch.cat([p_ids, r_ids], 1), torch.cat([p_mask, r_mask], 1).long()
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        P = p_ids.size(1)
        diff = 0.0
        for model, sign in ((policy, 1.0), (ref, -1.0)):
            logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, P - 1:-1].float()
            logp = torch.log_softmax(logits / temperature, -1).gather(-1, r_ids[..., None]).squeeze(-1)
            diff = diff + sign * logp
        out += torch.where(r_mask, diff, 0.0).sum(1).tolist()
    return out


def sample_policies(params: Params, sft_dir: Path, ppo_dir: Path, reward: RewardModelSource,
                    prompts: list[str]) -> dict[str, dict[str, list]]:
    """Responses and per-response measurements of each policy on `prompts`."""
    cfg, sampling = params.evaluate, params.ppo.sampling
    sft, tok = load_policy(sft_dir, params.model.trust_remote_code)
    ppo, _ = load_policy(ppo_dir, params.model.trust_remote_code)
    out: dict[str, dict[str, list]] = {}
    for name, policy in (("sft", sft), ("ppo", ppo)):
        texts, ended = generate_texts(policy, tok, prompts, sampling, cfg.seed, greedy=False)
        out[name] = {"text": texts, "ended": ended, "rm": reward.score(prompts, texts).tolist(),
                     "kl": sequence_kl(policy, sft, tok, prompts, texts, sampling.temperature)}
    # Best-of-n from SFT: max(n) samples per prompt (seed per sample), scored once; each n keeps
    # the RM's favourite among the first n.
    cands = [generate_texts(sft, tok, prompts, sampling, cfg.seed + 1 + k, greedy=False)
             for k in range(max(cfg.best_of_n))]
    scores = [reward.score(prompts, texts).tolist() for texts, _ in cands]
    for n, best in best_of_n_choices(scores, cfg.best_of_n).items():
        out[f"best_of_{n}"] = {"text": [cands[k][0][i] for i, k in enumerate(best)],
                               "ended": [cands[k][1][i] for i, k in enumerate(best)],
                               "rm": [scores[k][i] for i, k in enumerate(best)],
                               "kl": [best_of_n_kl(n)] * len(prompts)}
    return out


def summarise(per: dict[str, dict[str, list]], prompts: list[str], judge: Optional[Callable],
              n_boot: int, seed: int) -> dict[str, Any]:
    m: dict[str, Any] = {}
    for name, d in per.items():
        if judge is not None:
            d["gold"] = [judge(p, r) for p, r in zip(prompts, d["text"])]
        for key in ("rm", "gold", "kl"):
            if key in d:
                m[f"{name}/{key}"], m[f"{name}/{key}_ci95"] = mean_ci(d[key])
        m[f"{name}/length"] = sum(len(t.split()) for t in d["text"]) / len(d["text"])
        m[f"{name}/eos_rate"] = sum(d["ended"]) / len(d["ended"])
        m[f"{name}/distinct_2"] = distinct_n(d["text"], 2)
    for key in ("rm", "gold") if judge is not None else ("rm",):
        rate, low, high = win_rate(per["ppo"][key], per["sft"][key], n_boot, seed)
        m[f"win_rate/ppo_vs_sft_{key}"], m[f"win_rate/ppo_vs_sft_{key}_low"], m[f"win_rate/ppo_vs_sft_{key}_high"] = rate, low, high
    if judge is not None:
        # Over-optimisation: the RM's verdict minus the gold verdict on the same comparisons.
        m["overoptimisation/win_rate_gap"] = m["win_rate/ppo_vs_sft_rm"] - m["win_rate/ppo_vs_sft_gold"]
    return m


def samples_markdown(per: dict[str, dict[str, list]], prompts: list[str], k: int) -> str:
    has_gold = "gold" in per["sft"]
    lines = ["| prompt | SFT | PPO | RM (SFT / PPO) |" + (" gold (SFT / PPO) |" if has_gold else ""),
             "| --- | --- | --- | --- |" + (" --- |" if has_gold else "")]
    for i in range(min(k, len(prompts))):
        row = f"| {prompts[i]} | {per['sft']['text'][i]} | {per['ppo']['text'][i]} | " \
              f"{per['sft']['rm'][i]:.2f} / {per['ppo']['rm'][i]:.2f} |"
        if has_gold:
            row += f" {per['sft']['gold'][i]:.2f} / {per['ppo']['gold'][i]:.2f} |"
        lines.append(row.replace("\n", " "))
    return "\n".join(lines) + "\n"


def ppo_vs_best_of_n(m: dict[str, Any], ns: tuple[int, ...], key: str) -> list[str]:
    """Report lines: for each best-of-n, its KL and mean `key` score (gold, or RM without a judge)
    against PPO's; last, PPO against the best-of-n nearest to it in KL."""
    judge = "gold" if key == "gold" else "RM score"
    ppo_kl, ppo = m["ppo/kl"], m[f"ppo/{key}"]
    lines = []
    for n in ns:
        kl, b = m[f"best_of_{n}/kl"], m[f"best_of_{n}/{key}"]
        lines.append(f"- best_of_{n} sits at KL {kl:.2f} with {judge} {b:.3f}; PPO, at KL {ppo_kl:.2f} with "
                     f"{ppo:.3f}, {'beats' if ppo > b else 'does not beat'} it.")
    near = min(ns, key=lambda n: abs(m[f"best_of_{n}/kl"] - ppo_kl))
    lines.append(f"- PPO (KL {ppo_kl:.2f}) vs best-of-n at the nearest KL (best_of_{near}, KL "
                 f"{m[f'best_of_{near}/kl']:.2f}): {judge} {ppo:.3f} vs {m[f'best_of_{near}/{key}']:.3f}.")
    return lines


def verdict(m: dict[str, Any], detector: Optional[dict[str, Any]]) -> str:
    """One paragraph: did PPO beat SFT, and was the reward model gamed. `m` is evaluate's metrics;
    `detector` the `detector` section of outputs/ppo/metrics.json (None: no record). With a gold
    judge, an RM-vs-gold win-rate gap above 20 points is called over-optimisation."""
    rm = m["win_rate/ppo_vs_sft_rm"]
    if detector is None:
        alarm = "detector: no record"
    elif detector.get("first_fire"):
        stopped = (f", training stopped there and kept iteration {int(detector['kept_iteration'])}'s weights"
                   if detector.get("stopped_at") else "")
        alarm = f"the over-optimisation detector fired at iteration {int(detector['first_fire'])}{stopped}"
    else:
        alarm = "the over-optimisation detector stayed quiet"
    if "win_rate/ppo_vs_sft_gold" not in m:
        return (f"No gold annotator for this task: the reward model prefers PPO over SFT in {rm:.0%} of "
                f"held-out prompts; {alarm}.")
    gold = m["win_rate/ppo_vs_sft_gold"]
    if gold <= 0.5:
        head = (f"PPO does NOT beat SFT by the gold annotator ({gold:.0%} win rate; the reward model "
                f"prefers PPO in {rm:.0%} of prompts)")
    elif abs(rm - gold) > 0.20:
        head = f"over-optimisation: the reward model prefers PPO in {rm:.0%} of prompts, the gold annotator in {gold:.0%}"
    else:
        head = f"OK: PPO beats SFT in {gold:.0%} of prompts by the gold annotator and {rm:.0%} by the reward model"
    return f"{head}; {alarm}."


def detector_record(ppo_model_dir: Path) -> Optional[dict[str, Any]]:
    """The detector's section of the ppo stage's metrics.json, next to its model folder."""
    path = Path(ppo_model_dir).parent / "metrics.json"
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8")).get("detector")


def report_markdown(m: dict[str, Any], samples: str, has_gold: bool, names: tuple[str, ...],
                    ns: tuple[int, ...], verdict_text: str) -> str:
    rows = ["| policy | RM score | gold score | KL to SFT (nats) | length | eos rate | distinct-2 |",
            "| --- | --- | --- | --- | --- | --- | --- |"]
    for name in names:
        gold = f"{m[f'{name}/gold']:.3f} ± {m[f'{name}/gold_ci95']:.3f}" if has_gold else "n/a"
        rows.append(f"| {name} | {m[f'{name}/rm']:.3f} ± {m[f'{name}/rm_ci95']:.3f} | {gold} | "
                    f"{m[f'{name}/kl']:.2f} | {m[f'{name}/length']:.1f} | {m[f'{name}/eos_rate']:.2f} | "
                    f"{m[f'{name}/distinct_2']:.3f} |")
    wins = [f"- PPO beats SFT by the reward model's verdict in {m['win_rate/ppo_vs_sft_rm']:.1%} of prompts "
            f"(95% CI {m['win_rate/ppo_vs_sft_rm_low']:.1%}-{m['win_rate/ppo_vs_sft_rm_high']:.1%})."]
    if has_gold:
        wins.append(f"- By the gold annotator: {m['win_rate/ppo_vs_sft_gold']:.1%} "
                    f"(95% CI {m['win_rate/ppo_vs_sft_gold_low']:.1%}-{m['win_rate/ppo_vs_sft_gold_high']:.1%}); "
                    f"the gap between the two verdicts, {m['overoptimisation/win_rate_gap']:+.1%}, is the "
                    "over-optimisation signal (positive: the RM likes PPO more than the annotator does).")
    return "\n".join([
        "# Evaluation report", "", f"**{verdict_text}**", "",
        "Held-out prompts (films never seen in training); ± is a 95% interval of the mean. "
        "Best-of-n's KL is the analytic log n - (n-1)/n.", "", *rows, "", *wins, "",
        "PPO against best-of-n (means):", "", *ppo_vs_best_of_n(m, ns, "gold" if has_gold else "rm"), "",
        "![scores](scores.png)", "", "![KL vs score](kl_frontier.png)", "", "## Sample responses", "", samples])


def run(params: Params, data_dir: Path, sft_dir: Path, reward_dir: Path, ppo_dir: Path, out: Path) -> dict[str, Any]:
    resolved = {"data": {"task": params.data.task}, "evaluate": to_dict(params.evaluate),
                "ppo": {"sampling": to_dict(params.ppo.sampling)}}
    out.mkdir(parents=True, exist_ok=True)
    with stage_tracking("evaluate", resolved, [data_dir, sft_dir, reward_dir, ppo_dir]) as tracker:
        m, text = _run(params, data_dir, sft_dir, reward_dir, ppo_dir, out, resolved)
        write_metrics(out / "metrics.json", m, tracker)
        tracker.log_outputs(out)
        tracker.set_description(text)   # the pipeline's parent run, described by its verdict
    return m


def _run(params: Params, data_dir: Path, sft_dir: Path, reward_dir: Path, ppo_dir: Path, out: Path,
         resolved: dict) -> tuple[dict[str, Any], str]:
    cfg, judge = params.evaluate, inputs.judge(params)
    names = policies(cfg)
    prompts = inputs.prompts(params, data_dir, "eval")[:cfg.n_prompts]
    reward = RewardModelSource(reward_dir, params.reward.max_length, params.model.trust_remote_code)
    per = sample_policies(params, sft_dir, ppo_dir, reward, prompts)
    m = summarise(per, prompts, judge, cfg.bootstrap, cfg.seed)
    table = StepLog(out / "policies.tsv", ["rm", "gold", "kl"] if judge else ["rm", "kl"])
    for i, name in enumerate(names):
        table.log(i, {k: m[f"{name}/{k}"] for k in table.columns[1:]})
    table.flush()
    evaluation_plots(m, names, judge is not None, out)
    samples = samples_markdown(per, prompts, cfg.n_samples_shown)
    text = verdict(m, detector_record(ppo_dir))
    atomic_write_text(out / "samples.md", samples)
    atomic_write_text(out / "report.md", report_markdown(m, samples, judge is not None, names, cfg.best_of_n, text))
    atomic_write_json(out / "config.json", resolved)
    return m, text
