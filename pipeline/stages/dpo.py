"""The `dpo` stage: offline preference optimisation of the SFT policy on preference pairs (DPO, IPO
or SimPO, `dpo.method`), the RM's pairs by default.

1. Read and validate every input before the first step: training and held-out pairs, and the
   held-out prompts the trained policy is measured on at the end.
2. The policy is the SFT checkpoint (with fresh LoRA adapters when `dpo.lora.r > 0`); every pair
   is tokenised, an overlong one following `dpo.overlong`.
3. The reference model's log-probs of every pair's chosen and rejected response are computed once,
   by the policy's own engine before its first step with any adapter switched off: the same
   weights, device and precision the policy computes with, so log pi - log pi_ref is exactly 0 at
   step 0 and no second model is resident while the policy trains. SimPO has no reference; its
   held-out pairs are still scored, for the log-prob drift. A resumed run recomputes them (they are
   deterministic, and the SFT weights are part of the resume fingerprint).
4. Training runs in the shared supervised loop: per micro-batch one forward of 2N rows, the
   method's loss (pipeline/preference/losses.py). train.tsv and eval.tsv carry the same columns
   (COLUMNS): the loss, the implicit-reward accuracy, margin and rewards, and the policy's mean
   summed log-probs of the chosen and rejected responses, so the known failure where both fall
   while the margin grows (Pal et al. 2024) is visible; eval.tsv adds their drift from the reference.
5. After training: the last held-out row as `eval/*`, and the policy sampled on the held-out prompts
   as PPO and the evaluate stage sample (`prompts.sampling`): KL to the SFT policy, end-of-response
   rate, length, distinct-2 and, with the task's gold judge, the gold score, as `dpo/*`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..config import Params, PreferenceOptConfig
from ..data import inputs
from ..data.preferences import Pair
from ..errors import check_finite
from ..measurement.policy import sampled_declarations, sampled_metrics
from ..models import lora
from ..models.checkpoints import load_policy
from ..preference.logprobs import TokenPair, fit_pairs, pair_logprobs, reference_logprobs, response_lengths
from ..preference.losses import dpo_loss, ipo_loss, simpo_loss
from ..training import loading, memory_plan, supervised
from ..training.distributed import SINGLE, Context
from ..training.engines import TrainEngine
from ..training.supervised import SupervisedTask
from .skeleton import StageRun, stage_run
from ..tracking.metric_names import METRICS_JSON, Metric
from .spec import StageSpec

# docs/metrics.md: the note under each file the stage writes
METRIC_FILES = {
    "train.tsv": "one row per optimizer step",
    "eval.tsv": "held-out pairs during training, with the log-prob drift from the reference",
    "metrics.json": "after training, then the trained policy sampled on the held-out prompts",
}

def declared_metrics() -> list[Metric]:
    def m(file: str, name: str, meaning: str) -> Metric:
        return Metric("dpo", file, name, meaning, "compare")

    out = supervised.declared_metrics("dpo", "pairs", "the method's loss (`dpo.method`) over the step's pairs",
                      "the method's loss on the held-out pairs", "adapters")
    out = [Metric("dpo", x.file, x.name, x.meaning, "compare" if x.condition is None else "method_lora") for x in out]
    columns = {"accuracy": "rate of pairs whose implicit reward (beta x log-ratio to the reference; SimPO: beta x "
                           "mean log-prob) is higher for the chosen response",
               "margin": "mean implicit reward of chosen minus rejected",
               "chosen_logp": "mean summed log-prob of the chosen responses under the policy",
               "rejected_logp": "mean summed log-prob of the rejected responses under the policy",
               "chosen_reward": "mean implicit reward of the chosen responses",
               "rejected_reward": "mean implicit reward of the rejected responses"}
    for file in ("train.tsv", "eval.tsv"):
        out += [m(file, k, v) for k, v in columns.items()]
    out += [m("eval.tsv", "chosen_logp_drift", "held-out chosen log-prob, policy minus reference: both drifts "
                                               "falling while the margin grows is DPO's known failure"),
            m("eval.tsv", "rejected_logp_drift", "held-out rejected log-prob, policy minus reference")]
    out += [m(METRICS_JSON, f"eval/{k}", f"`eval.tsv`'s last `{k}`") for k in (*columns, "chosen_logp_drift",
                                                                              "rejected_logp_drift")]
    out += [m(METRICS_JSON, "train/accuracy", "`train.tsv`'s last `accuracy`"),
            m(METRICS_JSON, "train/margin", "`train.tsv`'s last `margin`"),
            m(METRICS_JSON, "data/eval_truncated", "held-out pairs kept with their prompt's left end cut"),
            m(METRICS_JSON, "data/eval_dropped", "held-out pairs left out (`dpo.overlong: drop`)")]
    return out + sampled_declarations("dpo", ("gold", "kl"))


SPEC = StageSpec(
    "dpo", help="offline preference optimisation of the SFT policy on the pairs (DPO, IPO or SimPO)",
    inputs=("data", "sft"), training=True, shape="start", pipeline="compare", policy=True,
    headline=("eval/accuracy", "eval/margin", "dpo/gold", "dpo/kl"),
    metrics=declared_metrics, files=METRIC_FILES,
    plan=lambda params, shapes: memory_plan_of(params, shapes), reads=(
    "data.task", "model.trust_remote_code",
    "dpo", "distributed",
    "prompts",                   # held-out prompts, how they are sampled, the gold judge switch
))

# train.tsv / eval.tsv column -> the losses' stat of the same meaning (pipeline/preference/losses.py)
COLUMNS = {"loss": "loss", "accuracy": "rewards/accuracy", "margin": "rewards/margin",
           "chosen_logp": "logps/chosen", "rejected_logp": "logps/rejected",
           "chosen_reward": "rewards/chosen", "rejected_reward": "rewards/rejected"}
DRIFT = ("chosen_logp_drift", "rejected_logp_drift")   # eval.tsv only: policy minus reference log-prob


@dataclass(frozen=True)
class ScoredPair:
    """A tokenised pair with the reference model's summed log-probs of its two responses (0.0 for
    SimPO's training pairs, which need none)."""
    tokens: TokenPair
    ref_chosen: float
    ref_rejected: float


def pair_sources(params: Params, data_dir: Path) -> tuple[list[Pair], list[Pair]]:
    """Training and held-out pairs (`dpo.dataset`: the RM's prepared pairs by default)."""
    return inputs.preference_pairs(params.dpo.dataset, data_dir, "dpo")


def tokenize_pairs(pairs: list[Pair], tok, max_length: int, overlong: str) -> tuple[list[TokenPair], int, int]:
    """The pairs as token ids within `dpo.max_length` (preference.logprobs.fit_pairs), and how many
    were truncated and dropped."""
    kept, truncated, dropped = fit_pairs(pairs, tok, max_length, overlong, "dpo")
    return [tokens for _, tokens in kept], truncated, dropped


def attach_reference(pairs: list[TokenPair], ref_chosen: torch.Tensor, ref_rejected: torch.Tensor) -> list[ScoredPair]:
    """Each pair with its reference log-probs; `ref_chosen`, `ref_rejected`: (N,) for N pairs, finite."""
    for name, t in (("ref_chosen", ref_chosen), ("ref_rejected", ref_rejected)):
        if tuple(t.shape) != (len(pairs),):
            raise ValueError(f"{name}: the reference log-probs of {len(pairs)} pairs must have shape "
                             f"({len(pairs)},), got {tuple(t.shape)}")
        check_finite("dpo reference pass", f"{name} (the SFT model's log-prob of a response)", t)
    return [ScoredPair(p, c, r) for p, c, r in zip(pairs, ref_chosen.tolist(), ref_rejected.tolist())]


def score_reference(engine: TrainEngine, pairs: list[TokenPair], batch_size: int, pad_id: int,
                    needed: bool = True) -> list[ScoredPair]:
    """The reference log-probs of `pairs`, from the engine's model before its first step with any
    adapter off (the SFT policy itself); zeros when not `needed` (SimPO's training pairs)."""
    if not needed:
        zeros = torch.zeros(len(pairs), device="cpu")
        return attach_reference(pairs, zeros, zeros)
    model = engine.model
    adapter_off = model.disable_adapter() if lora.is_peft(model) else contextlib.nullcontext()
    with adapter_off:
        chosen, rejected = reference_logprobs(model, pairs, batch_size, pad_id)
    return attach_reference(pairs, chosen, rejected)


def preference_loss(cfg: PreferenceOptConfig, part: list[ScoredPair], logp_chosen: torch.Tensor,
                    logp_rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The method's mean loss over the pairs of `part` and its stats; logp_*: (n,) the policy's
    summed log-probs of the responses of `part`."""
    dev, dtype = logp_chosen.device, logp_chosen.dtype
    if cfg.method == "simpo":
        len_chosen, len_rejected = (t.to(dev) for t in response_lengths([s.tokens for s in part]))
        return simpo_loss(logp_chosen, logp_rejected, len_chosen, len_rejected, cfg.beta, cfg.simpo_gamma)
    ref_chosen = torch.tensor([s.ref_chosen for s in part], dtype=dtype, device=dev)      # (n,)
    ref_rejected = torch.tensor([s.ref_rejected for s in part], dtype=dtype, device=dev)  # (n,)
    if cfg.method == "ipo":
        return ipo_loss(logp_chosen, logp_rejected, ref_chosen, ref_rejected, cfg.beta)
    return dpo_loss(logp_chosen, logp_rejected, ref_chosen, ref_rejected, cfg.beta, cfg.label_smoothing)


def batch_loss(model, cfg: PreferenceOptConfig, part: list[ScoredPair], pad_id: int) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy's loss on `part`: one forward of its 2n sequences, then the method's loss."""
    logp_chosen, logp_rejected = pair_logprobs(model, [s.tokens for s in part], pad_id)   # (n,), (n,)
    return preference_loss(cfg, part, logp_chosen, logp_rejected)


@torch.no_grad()   # not inference_mode: see pipeline/ppo/scoring.py
def eval_pairs(model, cfg: PreferenceOptConfig, items: list[ScoredPair], pad_id: int, ctx: Context = SINGLE,
               batch_size: int = 64) -> dict[str, float]:
    """The COLUMNS and DRIFT over every held-out pair (pair-weighted means), every rank scoring its
    share; every rank runs the same number of forwards (ZeRO-3 gathers per forward)."""
    model.eval()
    sums = torch.zeros(len(COLUMNS) + 3, dtype=torch.float64, device="cpu")   # the columns, reference chosen, rejected, count
    for part in ctx.eval_parts(items, batch_size):
        _, stats = batch_loss(model, cfg, part or items[:1], pad_id)
        if part:
            n = len(part)
            sums += torch.tensor([stats[key] * n for key in COLUMNS.values()]
                                 + [sum(s.ref_chosen for s in part), sum(s.ref_rejected for s in part), n],
                                 dtype=torch.float64, device="cpu")
    model.train()
    sums = ctx.sum(sums)
    out = {column: float(sums[i] / sums[-1]) for i, column in enumerate(COLUMNS)}
    out["chosen_logp_drift"] = out["chosen_logp"] - float(sums[-3] / sums[-1])
    out["rejected_logp_drift"] = out["rejected_logp"] - float(sums[-2] / sums[-1])
    return out


def judge(params: Params):
    """The gold judge, only while the pairs are the default task's too."""
    return inputs.judge(params) if params.dpo.dataset.path is None else None


def measure_policy(model, tok, params: Params, sft_dir: Path, prompts: list, ctx: Context = SINGLE) -> dict[str, Any]:
    """Collective. The trained policy (a module or an engine) sampled on the held-out `prompts` as in
    `prompts.sampling`, with its KL to the SFT policy (loaded now, after training, onto this rank's
    device): `dpo/<gold|kl>` with `_ci95` half-widths, `dpo/<eos_rate|length|distinct_2>`."""
    dtype = next(getattr(model, "model", model).parameters()).dtype
    sft, _ = load_policy(sft_dir, params.model.trust_remote_code, dtype)
    return sampled_metrics("dpo", model, tok, prompts, params.prompts.sampling, params.dpo.seed, sft=sft.to(ctx.device),
                           judge=judge(params), max_prompt_length=params.prompts.max_length, ctx=ctx)


def final_metrics(eval_row: dict[str, Any], train_row: dict[str, Any]) -> dict[str, Any]:
    """The last held-out row as `eval/*` (its loss is already `eval/loss`) and the last step's
    implicit-reward accuracy and margin as `train/*`."""
    out = {f"eval/{c}": eval_row[c] for c in (*COLUMNS, *DRIFT) if c != "loss"}
    out.update({f"train/{c}": train_row[c] for c in ("accuracy", "margin")})
    return out


def train(run: StageRun, data_dir: Path, sft_dir: Path, progress: bool = True) -> tuple[Any, Any, dict]:
    """Steps 1-5 of the module doc; in a multi-process run rank 0 returns the whole model, the
    other ranks (None, tokenizer, {})."""
    params, ctx, out = run.params, run.ctx, run.out
    cfg = params.dpo
    # 1. Every input, validated before the first step.
    train_pairs, held_pairs = pair_sources(params, data_dir)
    prompts = inputs.prompts(params, data_dir, "eval")[:cfg.n_eval_prompts]
    # 2. The policy and its pairs.
    with loading.partitioned(cfg.distributed, ctx):   # ZeRO-3: each rank loads its partition only
        model, tok = load_policy(sft_dir, params.model.trust_remote_code, loading.load_dtype(cfg.distributed, True))
    train_tok, n_trunc, n_drop = tokenize_pairs(train_pairs, tok, cfg.max_length, cfg.overlong)
    eval_tok, e_trunc, e_drop = tokenize_pairs(held_pairs, tok, cfg.max_length, cfg.overlong)
    torch.manual_seed(cfg.seed)
    model = lora.wrap(model, cfg.lora, "CAUSAL_LM", "dpo.lora")
    pad, width = tok.pad_token_id, 2 * cfg.batch_size

    def task(engine, micro: int) -> SupervisedTask:
        # 3. The reference log-probs, once, before the first step (and before a resumed state is loaded).
        train_items = score_reference(engine, train_tok, width, pad, needed=cfg.method != "simpo")
        eval_items = score_reference(engine, eval_tok, width, pad)   # every method: the drift columns

        # 4. The loss of a micro-batch, normalised by the global batch (pairs).
        def loss(part: list[ScoredPair], batch: list[ScoredPair]) -> tuple[torch.Tensor, list[float]]:
            value, stats = batch_loss(engine.forward, cfg, part, pad)
            return value * len(part) / len(batch), [stats[key] * len(part) for key in COLUMNS.values()]

        return SupervisedTask("dpo", train_items, list(COLUMNS), loss, normaliser=len,
                              eval_columns=[*COLUMNS, *DRIFT],
                              evaluate=lambda: eval_pairs(engine.model, cfg, eval_items, pad, ctx, width))

    recipe = supervised.Recipe(
        model, len(train_tok), task,
        measure=lambda engine: measure_policy(engine, tok, params, sft_dir, prompts, ctx),   # every rank
        # 5. Final metrics and the sampled measurement.
        report=lambda model, result, measured: {
            **final_metrics(result.eval_log.rows[-1], result.train_log.rows[-1]), **measured},
        counts={"data/truncated": n_trunc, "data/dropped": n_drop, "data/eval_truncated": e_trunc,
                "data/eval_dropped": e_drop})
    model, metrics = supervised.run("dpo", cfg, recipe, out, run.checkpoint, run.tracker, ctx, run.fingerprint, progress)
    return model, tok, metrics


def memory_plan_of(params: Params, shapes: memory_plan.Shapes) -> Optional[memory_plan.Planner]:
    """The SFT policy trained on pairs (two sequences per pair in one forward); its reference
    log-probs come from the same engine, so no second model."""
    if not shapes.ready("sft"):
        return None
    sft = shapes.model("sft")
    return memory_plan.supervised_planner("dpo", params, sft, (sft,), rows=2,   # a pair: two sequences
                                          sampled=lambda cfg: params.prompts.sampling.max_new_tokens,
                                          beside=(sft,))   # the SFT policy, loaded for the KL


def run(params: Params, data_dir: Path, sft_dir: Path, out: Path, progress: bool = True) -> dict[str, Any]:
    """The stage: train, measure, then write model/, metrics.json, config.json and the step logs
    atomically (rank 0 writes; other ranks of a multi-process run return empty metrics)."""
    with stage_run(SPEC, params, out, [data_dir, sft_dir, params.dpo.dataset.path]) as run:
        model, tok, metrics = train(run, data_dir, sft_dir, progress)
        run.finish(metrics, model, tok)
    return metrics
