"""The `rs` stage: rejection-sampling fine-tuning, the simplest RL-free baseline (best-of-n from the
SFT policy, picked by the reward model, then SFT on the winners: Touvron et al. 2023, sec. 3.2.3;
Dong et al. 2023, RAFT).

1. Read and validate every input before a model is built: the training prompts (the train
   split, fitted to `prompts.max_length`; the first `rs.n_prompts`, or all),
   the SFT held-out demonstrations (the held-out loss) and the held-out prompts of the final measurement.
2. Sampling (rank 0; the others wait): `rs.n` candidates per prompt from the SFT policy, candidate
   k with seed `rs.seed + k` (each candidate is one seeded `measure` call over every prompt, as the
   evaluate stage's best-of-n draws them), scored by the reward model on their text as PPO and the
   evaluate stage score (`reward.max_length`). Each prompt keeps its RM favourite (ties: the first
   candidate), unless it scores below `rs.min_score`. `winners.jsonl`: a header line (the sampling
   fingerprint and the sampling statistics), then one row per winner (prompt, response, rm, ended,
   and gold with the task's judge), written atomically. A re-run whose sampling fingerprint matches
   (the sampling params, the data, SFT and RM folders, the code) reuses the file and samples
   nothing: after a kill during fine-tuning, or with only the fine-tuning params changed.
3. Fine-tuning: a fresh copy of the SFT policy trained on the winners with SFT's loss (response
   tokens only) in the shared supervised loop, held-out loss on SFT's held-out demonstrations; a
   killed run resumes from the loop's checkpoint as SFT does.
4. After training: the policy sampled on the held-out prompts as PPO and the evaluate stage sample
   (`prompts.sampling`): RM score, KL to the SFT policy, end-of-response rate, length, distinct-2 and,
   with the task's gold judge, the gold score, as `rs/*` (the names compare gives a policy).

The RM and SFT copies used for sampling live on the CPU, as every measurement does, and the RM is
freed before the first training step (the memory plan counts the fine-tuning and the sampler's cache).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..config import Params
from ..errors import DataError, check_finite
from ..measurement.stats import mean_ci
from ..context import SINGLE, Context
from ..tracking.metric_names import METRICS_JSON, Metric
from ..tracking.model_card import ModelFacts
from . import sampled
from .spec import StageSpec

if TYPE_CHECKING:   # annotations only: importing these loads torch, and listing the stages must not
    from ..measurement.policy import Measured
    from ..training import memory_plan
    from .skeleton import StageRun

# docs/metrics.md: the note under each file the stage writes
METRIC_FILES = {
    "train.tsv": "one row per optimizer step of the fine-tuning on the winners",
    "eval.tsv": "held-out loss (SFT's held-out demonstrations) during the fine-tuning",
    "metrics.json": "the sampling's statistics under `rs/`, the fine-tuning's, then the trained "
                    "policy sampled on the held-out prompts",
}

def declared_metrics() -> list[Metric]:
    from ..measurement.policy import sampled_declarations
    from ..training import supervised
    def m(file: str, name: str, meaning: str, condition: str = "compare") -> Metric:
        return Metric("rs", file, name, meaning, condition)

    out = [Metric("rs", x.file, x.name, x.meaning, "compare" if x.condition is None else "method_lora")
           for x in supervised.declared_metrics("rs", "winners", "cross-entropy per response token of the step's winners",
                                "cross-entropy per response token on SFT's held-out demonstrations", "adapters")]
    out += [m(METRICS_JSON, "data/prompts_truncated", "PPO training prompts longer than `ppo.max_prompt_length` "
                                                      "kept with their left end cut"),
            m(METRICS_JSON, "data/prompts_dropped", "such prompts left out (`ppo.overlong: drop`)"),
            m(METRICS_JSON, "rs/prompts", "prompts sampled (`rs.n_prompts` of the PPO training prompts)"),
            m(METRICS_JSON, "rs/winners_kept", "winners trained on (those at or above `rs.min_score`)"),
            m(METRICS_JSON, "rs/rm_candidates", "mean RM score of all `rs.n` candidates of every prompt"),
            m(METRICS_JSON, "rs/rm_winners", "mean RM score of the winners (each prompt's best candidate)"),
            m(METRICS_JSON, "rs/rm_winners_ci95", "half-width of its 95% interval"),
            m(METRICS_JSON, "rs/eos_rate_candidates", "rate of candidates that ended with eos or the stop token"),
            m(METRICS_JSON, "rs/eos_rate_winners", "the same rate among the winners"),
            m(METRICS_JSON, "rs/gold_candidates", "mean gold score of all candidates"),
            m(METRICS_JSON, "rs/gold_winners", "mean gold score of the winners"),
            m(METRICS_JSON, "rs/gold_winners_ci95", "half-width of its 95% interval")]
    return out + sampled_declarations("rs", ("rm", "gold", "kl"))


SPEC = StageSpec(
    "rs", help="rejection-sampling fine-tuning: best-of-n SFT samples by the reward model, then SFT on them",
    inputs=("data", "sft", "reward"), training=True, shape="start", pipeline="compare", policy=True,
    headline=("rs/gold", "rs/rm", "rs/kl"), parent_params=("rs.seed", "rs.lr", "rs.n"),
    model=ModelFacts("the rejection-sampling fine-tuned policy",
                     "the SFT policy, on its own best-of-n samples by the reward model", "rlhf-rs-policy",
                     "The SFT policy fine-tuned on its own best-of-n samples picked by the reward model (rejection "
                     "sampling; transformers text-generation)."),
    check_inputs=lambda params, data_dir: check_inputs(params, data_dir),
    metrics=declared_metrics, files=METRIC_FILES,
    plan=lambda params, shapes: memory_plan_of(params, shapes), reads=(
    "data.task", "model.trust_remote_code",
    "rs", "distributed",
    "reward.max_length",         # the reward model scores as it was trained
    "prompts",                   # training prompts (train split), held-out ones, how they are measured
    "sft.dataset",               # held-out demonstrations (held-out loss)
))

# The `rs` keys the sampling phase depends on; every other declared section is part of its
# fingerprint whole (the prompts, the RM's max_length, the judge's condition).
SAMPLING_KEYS = ("seed", "n", "n_prompts", "sampling", "min_score")
WINNERS = "winners.jsonl"


def pick_winners(scores: list[list[float]]) -> list[int]:
    """For each prompt i the candidate k with the highest `scores[k][i]`, the first on a tie.
    scores: n lists (one per candidate) of one score per prompt."""
    return [max(range(len(scores)), key=lambda k: scores[k][i]) for i in range(len(scores[0]))]


def select(prompts: list, cands: list[Measured], min_score: Optional[float]) -> tuple[list[dict], dict[str, float]]:
    """The winners' rows (prompts whose winner scores below `min_score` left out) and the sampling
    statistics: mean RM score (and gold) of the winners against every candidate."""
    import torch
    scores = [c.values["rm"] for c in cands]
    check_finite("rs sampling", "reward-model score of a candidate", torch.tensor(scores, device="cpu"))
    rows = []
    for i, k in enumerate(pick_winners(scores)):
        row = {"prompt": prompts[i], "response": cands[k].texts[i], "rm": scores[k][i], "ended": cands[k].ended[i]}
        if "gold" in cands[k].values:
            row["gold"] = cands[k].values["gold"][i]
        rows.append(row)
    kept = [r for r in rows if min_score is None or r["rm"] >= min_score]
    if not kept:
        raise DataError(f"rs.min_score: every winner scores below {min_score} (the best is "
                        f"{max(r['rm'] for r in rows):.3f}); lower it, or set it to null")
    ended = [e for c in cands for e in c.ended]
    stats: dict[str, float] = {"rs/prompts": len(prompts), "rs/winners_kept": len(kept),
                               "rs/eos_rate_candidates": sum(ended) / len(ended),
                               "rs/eos_rate_winners": sum(r["ended"] for r in rows) / len(rows)}
    for key in ("rm", "gold") if "gold" in cands[0].values else ("rm",):
        stats[f"rs/{key}_candidates"] = mean_ci([v for c in cands for v in c.values[key]])[0]
        stats[f"rs/{key}_winners"], stats[f"rs/{key}_winners_ci95"] = mean_ci([r[key] for r in rows])
    return kept, stats


def winner_problem(row: dict) -> Optional[str]:
    """What is wrong with a row of a winners file read back (sampled.read), or None."""
    rm = row.get("rm")
    if not isinstance(row.get("response"), str) or not isinstance(row.get("prompt"), (str, list)) \
            or isinstance(rm, bool) or not isinstance(rm, (int, float)) or not math.isfinite(rm):
        return "a winner needs a text prompt and response and a finite rm score"
    return None


def read_winners(path: Path, fp: str) -> Optional[tuple[list[dict], dict[str, float]]]:
    """(rows, stats) of a winners file written for fingerprint `fp`, or None (sampled.read)."""
    return sampled.read(path, fp, "winners", winner_problem)


def winners(run: StageRun, sft_policy, tok, prompts: list, reward_dir: Path, fp: str) -> tuple[list[dict], dict]:
    """Step 2 of the module doc: the winners and the sampling statistics, reused or sampled (every
    rank sampling its share of the prompts on its device; rank 0 writes the file)."""
    params, ctx = run.params, run.ctx

    def draw() -> Optional[tuple[list[dict], dict]]:
        cands = sampled.scored_draws(run, sft_policy, tok, prompts, reward_dir, params.rs.n)
        return select(prompts, cands, params.rs.min_score) if ctx.is_main else None
    return sampled.reused_or_sampled(run, run.folder / WINNERS, fp, "winners", winner_problem, draw)


def measure_policy(model, tok, params: Params, sft_dir: Path, reward_dir: Path, prompts: list,
                   ctx: Context = SINGLE) -> dict[str, Any]:
    """Collective. The trained policy (a module or an engine) sampled on the held-out `prompts` as in
    `prompts.sampling`, scored by the RM, with its KL to the SFT policy and the gold score with a judge,
    every rank its share on its device: `rs/<rm|kl|gold>` with `_ci95` half-widths,
    `rs/<eos_rate|length|distinct_2>`."""
    from ..data import inputs
    from ..measurement.policy import measure_trained
    from ..models.checkpoints import load_policy
    from ..models.reward_source import RewardModelSource
    dtype = next(getattr(model, "model", model).parameters()).dtype
    sft, _ = load_policy(sft_dir, params.model.trust_remote_code, dtype)
    reward = RewardModelSource(reward_dir, params.reward.max_length, params.model.trust_remote_code,
                               device=ctx.device, dtype=dtype, packed=params.rs.packing)
    return measure_trained("rs", model, tok, prompts, params.prompts.sampling, params.rs.seed, sft=sft.to(ctx.device),
                           reward=reward, judge=inputs.judge(params), max_prompt_length=params.prompts.max_length,
                           ctx=ctx, packed=params.rs.packing)[0]


def check_inputs(params: Params, data_dir: Path) -> None:
    """What the stage reads before its first step: the prompts (train and held-out, the held-out
    split checked for leaks from the train split) and the held-out demonstrations."""
    from ..data import inputs
    inputs.prompts(params, data_dir, "eval")
    inputs.demonstrations(params, data_dir, "eval")


def load_sft(params: Params, sft_dir: Path, ctx: Context = SINGLE) -> tuple[Any, Any]:
    """The SFT policy that RS samples from and then fine-tunes, and its tokenizer: in the dtype its
    optimizer steps (training/loading.py), and under ZeRO-3 partitioned as it loads."""
    from ..models.checkpoints import load_policy
    from ..training import loading
    with loading.partitioned(params.rs.distributed, ctx):
        return load_policy(sft_dir, params.model.trust_remote_code, loading.load_dtype(params.rs.distributed, True))


def train(run: StageRun, data_dir: Path, sft_dir: Path, reward_dir: Path,
          progress: bool = True) -> tuple[Any, Any, dict]:
    """Steps 1-4 of the module doc; in a multi-process run rank 0 returns the whole model, the
    other ranks (None, tokenizer, {})."""
    from ..data import inputs
    from ..training import demonstrations, supervised
    params, ctx, out = run.params, run.ctx, run.out
    cfg = params.rs
    # 1. Every input, validated before the first model is built.
    records = inputs.prompt_records(params, data_dir, "train")
    eval_rows = inputs.demonstrations(params, data_dir, "eval")
    eval_prompts = inputs.prompts(params, data_dir, "eval")[:cfg.n_eval_prompts]
    model, tok = load_sft(params, sft_dir, ctx)
    run.check_stop_tokens(tok)
    prompts, counts = sampled.training_prompts(params, records, tok, "rs")
    # 2. The winners (the SFT weights are untouched by sampling: the same model is trained next).
    fp = sampled.fingerprint(run, SAMPLING_KEYS, [data_dir, sft_dir, reward_dir, params.prompts.dataset.path], "winners")
    rows, sampling_stats = winners(run, model, tok, prompts, reward_dir, fp)
    # 3. SFT on the winners, from the SFT weights.
    recipe = demonstrations.recipe(
        "rs", model, tok, (rows, run.folder / WINNERS), (eval_rows, "sft held-out demonstrations"), cfg, ctx,
        measure=lambda engine: measure_policy(engine, tok, params, sft_dir, reward_dir, eval_prompts, ctx),  # every rank
        # 4. The sampling statistics and the trained policy's measurement.
        report=lambda model, result, measured: {**sampling_stats, **measured},
        counts=counts)
    model, metrics = supervised.run("rs", cfg, recipe, out, run.checkpoint, run.tracker, ctx, run.fingerprint, progress)
    return model, tok, metrics


def memory_plan_of(params: Params, shapes: memory_plan.Shapes) -> Optional[memory_plan.Planner]:
    """The SFT policy fine-tuned, after it sampled the candidates the reward model scored."""
    from ..training import memory_plan
    if not shapes.ready("sft", "reward"):
        return None
    sft, reward = shapes.model("sft"), shapes.model("reward", True)
    return memory_plan.supervised_planner(
        "rs", params, sft, (sft, reward),   # then its candidates, with the same policy
        sampled=lambda cfg: max(params.prompts.sampling.max_new_tokens, cfg.sampling.max_new_tokens),
        beside=(sft, reward))   # measured: the SFT policy for the KL and the reward model


def run(params: Params, data_dir: Path, sft_dir: Path, reward_dir: Path, out: Path,
        progress: bool = True) -> dict[str, Any]:
    """The stage: sample (or reuse) the winners, fine-tune, measure, then write model/,
    metrics.json, config.json and the step logs atomically (rank 0 writes; other ranks of a
    multi-process run return empty metrics)."""
    from .skeleton import stage_run
    with stage_run(SPEC, params, out, [data_dir, sft_dir, reward_dir, params.prompts.dataset.path]) as run:
        model, tok, metrics = train(run, data_dir, sft_dir, reward_dir, progress)
        run.finish(metrics, model, tok)
    return metrics
