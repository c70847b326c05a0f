"""The `onpolicy_dpo` stage: DPO on preference pairs the SFT policy samples itself, ranked by the
reward model: one round of on-policy (online) preference optimisation, the best against the worst
of a prompt's samples (Dong et al. 2024, RLHF Workflow; Xiong et al. 2024). Offline DPO
learns from pairs another policy wrote; here both responses of a pair are the policy's own, so the
loss pushes on what it actually generates. It runs the offline-pair sequence of
pipeline/stages/pair_method.py (steps 1-5 there) with the dpo stage's task, loss and final metrics;
what is its own is where the training pairs come from (`make_pairs`, that sequence's step 2):

1. The training prompts: the train split of `prompts.dataset` (as the rs stage reads them),
   fitted to `prompts.max_length`, the first `onpolicy_dpo.n_prompts` (or all). The held-out
   pairs of eval.tsv stay the dataset's (`onpolicy_dpo.dataset`), as the dpo stage's.
2. Sampling (every rank its share of the prompts): `samples_per_prompt` samples per prompt from
   the SFT policy, sample k with seed `onpolicy_dpo.seed + k` (the evaluate stage's best-of-n
   draws: measurement.policy.candidates), each scored by the reward model on its text as PPO and
   the rs stage score (`reward.max_length`).
3. Each prompt's highest-scored sample is the chosen response and its lowest the rejected one (the
   first of tied ones); a prompt whose two are tied, or tokenise alike, gives no pair.
   `pairs.jsonl`: a header line (the sampling fingerprint and statistics), then one row per pair
   (prompt, chosen, rejected, their RM and gold scores), written atomically by rank 0 (the sampled
   file of pipeline/stages/sampled.py, as the rs stage's winners). A re-run
   whose sampling fingerprint matches (the sampling params, the data, SFT and RM folders, the code)
   reuses it and samples nothing: after a kill during training, or with only training params changed.
4. DPO (the loss of `onpolicy_dpo.method`) on those pairs, from the SFT weights, against their
   reference log-probs, and the trained policy sampled on the held-out prompts: pair_method's
   steps 3-5 with dpo.py's task.

The reward model lives for the sampling only: it is freed before the first training step.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Optional

from ..config import Params
from ..data.preferences import Pair
from ..data.tokenizer import encode_response
from ..errors import DataError, check_finite
from ..measurement.stats import mean_ci
from ..tracking.metric_names import METRICS_JSON, Metric
from ..tracking.model_card import ModelFacts
from . import dpo, pair_method, rs, sampled
from .spec import StageSpec

if TYPE_CHECKING:   # the skeleton imports torch, which listing the stages must not
    from .skeleton import StageRun

NAME = "onpolicy_dpo"
PAIRS = "pairs.jsonl"
# The section's keys the sampled pairs depend on; every other declared section is part of their
# fingerprint whole (the prompts, the RM's max_length, the judge's condition).
SAMPLING_KEYS = ("seed", "samples_per_prompt", "n_prompts", "sampling")

# docs/metrics.md: the note under each file the stage writes
METRIC_FILES = {
    "train.tsv": "one row per optimizer step on the sampled pairs",
    "eval.tsv": "the dataset's held-out pairs during training (as the dpo stage's), with the log-prob drift",
    "metrics.json": f"how the pairs were sampled (`{NAME}/`), after training, then the trained policy sampled on "
                    "the held-out prompts",
}


def declared_metrics() -> list[Metric]:
    """What the stage writes (docs/metrics.md): the offline-pair sequence's names, those of dpo's
    task (it trains with that task) and the sampling's."""
    m = functools.partial(pair_method.metric, NAME)
    k = f"`{NAME}.samples_per_prompt`"
    sampling = {
        "data/prompts_truncated": "training prompts longer than `prompts.max_length` kept with their left end cut",
        "data/prompts_dropped": "such prompts left out (`prompts.overlong: drop`)",
        f"{NAME}/prompts": f"training prompts sampled (`{NAME}.n_prompts` of prompts.dataset's train split)",
        f"{NAME}/pairs": "pairs trained on: the prompts whose best and worst samples differ in RM score",
        f"{NAME}/rm_samples": f"mean RM score of all {k} samples of every prompt",
        f"{NAME}/rm_chosen": "mean RM score of the pairs' chosen responses (each prompt's best sample)",
        f"{NAME}/rm_rejected": "mean RM score of the pairs' rejected responses (each prompt's worst sample)",
        f"{NAME}/gold_chosen": "mean gold score of the chosen responses",
        f"{NAME}/gold_rejected": "mean gold score of the rejected responses",
        f"{NAME}/gold_agreement": "rate of pairs whose chosen response has the higher gold score too (a gold tie "
                                  "counts half): how often the reward model's order is gold's",
    }
    own = dpo.task_metrics(NAME) + [m(METRICS_JSON, name, meaning) for name, meaning in sampling.items()]
    return pair_method.declared_metrics(NAME, "pairs", f"the method's loss (`{NAME}.method`) over the step's sampled "
                                        "pairs", "the method's loss on the dataset's held-out pairs", own)


def pick_pairs(scores: list[list[float]]) -> list[Optional[tuple[int, int]]]:
    """For each prompt i the samples (best, worst) by `scores[k][i]`, the first of tied ones (rs's
    pick, and the same of the negated scores); None where the best and worst scores are equal.
    scores: k lists (one per sample) of one score per prompt."""
    best = rs.pick_winners(scores)
    worst = rs.pick_winners([[-s for s in sample] for sample in scores])
    return [(b, w) if scores[b][i] > scores[w][i] else None for i, (b, w) in enumerate(zip(best, worst))]


def select(prompts: list, samples: list, tok) -> tuple[list[dict], dict[str, float]]:
    """The pairs' rows (prompts whose best and worst samples tie, or tokenise alike, left out) and
    the sampling statistics. samples: k measurement.policy.Measured of the same prompts, scored."""
    import torch
    scores = [s.values["rm"] for s in samples]
    check_finite(f"{NAME} sampling", "reward-model score of a sample", torch.tensor(scores, device="cpu"))
    rows = []
    for i, picked in enumerate(pick_pairs(scores)):
        if picked is None:
            continue
        b, w = picked
        chosen, rejected = samples[b].texts[i], samples[w].texts[i]
        if encode_response(tok, chosen) == encode_response(tok, rejected):
            continue   # one response drawn twice: its two scores differ only by the batches it was scored in
        row = {"prompt": prompts[i], "chosen": chosen, "rejected": rejected,
               "rm_chosen": scores[b][i], "rm_rejected": scores[w][i]}
        if "gold" in samples[b].values:
            row["gold_chosen"], row["gold_rejected"] = samples[b].values["gold"][i], samples[w].values["gold"][i]
        rows.append(row)
    if not rows:
        raise DataError(f"{NAME}: every prompt's {len(samples)} samples tie on the reward model, so there is no pair "
                        f"to train on; raise {NAME}.samples_per_prompt or {NAME}.sampling.temperature")
    stats: dict[str, float] = {f"{NAME}/prompts": len(prompts), f"{NAME}/pairs": len(rows),
                               f"{NAME}/rm_samples": mean_ci([v for s in scores for v in s])[0],
                               f"{NAME}/rm_chosen": mean_ci([r["rm_chosen"] for r in rows])[0],
                               f"{NAME}/rm_rejected": mean_ci([r["rm_rejected"] for r in rows])[0]}
    if "gold_chosen" in rows[0]:
        stats[f"{NAME}/gold_chosen"] = mean_ci([r["gold_chosen"] for r in rows])[0]
        stats[f"{NAME}/gold_rejected"] = mean_ci([r["gold_rejected"] for r in rows])[0]
        stats[f"{NAME}/gold_agreement"] = sum((r["gold_chosen"] > r["gold_rejected"]) + 0.5 * (
            r["gold_chosen"] == r["gold_rejected"]) for r in rows) / len(rows)
    return rows, stats


def pair_problem(row: dict) -> Optional[str]:
    """What is wrong with a row of a pairs file read back (sampled.read), or None."""
    scores = (row.get("rm_chosen"), row.get("rm_rejected"))
    texts = all(isinstance(row.get(k), str) for k in ("chosen", "rejected"))
    finite = all(isinstance(s, (int, float)) and not isinstance(s, bool) and math.isfinite(s) for s in scores)
    if not isinstance(row.get("prompt"), (str, list)) or not texts or not finite or not scores[0] > scores[1]:
        return "a pair needs a prompt, two text responses and finite RM scores, the chosen one's higher"
    return None


def make_pairs(run: StageRun, policy, tok, folders: Mapping[str, Any]) -> tuple[list[Pair], dict[str, Any]]:
    """pair_method's step 2 for this stage (steps 1-3 of the module doc): the training pairs, reused
    or sampled, and the metrics saying how they were made."""
    from ..data import inputs
    params, ctx = run.params, run.ctx
    records = inputs.prompt_records(params, folders["data"], "train")
    prompts, counts = sampled.training_prompts(params, records, tok, NAME)
    fp = sampled.fingerprint(run, SAMPLING_KEYS, [folders[k] for k in ("data", "sft", "reward", "prompts")], "pairs")

    def draw() -> Optional[tuple[list[dict], dict[str, float]]]:
        samples = sampled.scored_draws(run, policy, tok, prompts, folders["reward"], params.onpolicy_dpo.samples_per_prompt)
        return select(prompts, samples, tok) if ctx.is_main else None
    rows, stats = sampled.reused_or_sampled(run, run.folder / PAIRS, fp, "pairs", pair_problem, draw)
    return [Pair(r["prompt"], r["chosen"], r["rejected"], where=r["where"]) for r in rows], {**counts, **stats}


def check_inputs(params: Params, data_dir: Path) -> None:
    """What the stage reads before its first step: the dataset's held-out pairs (against its train
    split) and the held-out prompts, as the dpo stage reads them, and the training prompts."""
    from ..data import inputs
    pair_method.read_inputs(METHOD, params, data_dir)
    inputs.prompt_records(params, data_dir, "train")


def memory_plan_of(params: Params, shapes) -> Any:
    """The SFT policy trained on pairs (two sequences each), after it sampled the responses the reward
    model scored; its reference log-probs come from its own engine, and the measurement loads the
    SFT policy beside it for the KL."""
    from ..training import memory_plan
    if not shapes.ready("sft", "reward"):
        return None
    sft, reward = shapes.model("sft"), shapes.model("reward", True)
    return memory_plan.supervised_planner(
        NAME, params, sft, (sft, reward), rows=2,
        sampled=lambda cfg: max(params.prompts.sampling.max_new_tokens, cfg.sampling.max_new_tokens),
        beside=(sft,))


SPEC = StageSpec(
    NAME, help="on-policy DPO: the SFT policy's best and worst samples by the reward model as pairs, then DPO on them",
    inputs=("data", "sft", "reward"), training=True, shape="start", pipeline="compare", policy=True,
    headline=("eval/accuracy", "eval/margin", f"{NAME}/gold", f"{NAME}/kl"),
    parent_params=(f"{NAME}.seed", f"{NAME}.lr", f"{NAME}.beta", f"{NAME}.method", f"{NAME}.samples_per_prompt"),
    model=ModelFacts("the on-policy DPO policy", "the SFT policy, on its own samples paired by the reward model",
                     "rlhf-onpolicy-dpo-policy",
                     "The SFT policy tuned by DPO on pairs of its own samples, the reward model's best against its "
                     "worst of each prompt (transformers text-generation)."),
    check_inputs=lambda params, data_dir: check_inputs(params, data_dir),
    metrics=declared_metrics, files=METRIC_FILES,
    plan=lambda params, shapes: memory_plan_of(params, shapes), reads=(
    "data.task", "model.trust_remote_code",
    NAME, "distributed",
    "reward.max_length",         # the reward model scores as it was trained
    "prompts",                   # training prompts (train split), held-out ones, how they are sampled, the gold judge
))

METHOD = pair_method.PairMethod(SPEC, dpo.task, dpo.final_metrics, pairs=make_pairs)


def run(params: Params, data_dir: Path, sft_dir: Path, reward_dir: Path, out: Path,
        progress: bool = True) -> dict[str, Any]:
    """The stage (pair_method.run with the sampled pairs): sample (or reuse) the pairs, train,
    measure, write the outputs."""
    return pair_method.run(METHOD, params, data_dir, sft_dir, out, progress, reward=reward_dir,
                           prompts=params.prompts.dataset.path)
