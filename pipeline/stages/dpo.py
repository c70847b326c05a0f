"""The `dpo` stage: offline preference optimisation of the SFT policy on preference pairs (DPO, IPO
or SimPO, `dpo.method`: a loss of preference.losses.PREFERENCE_LOSSES), the RM's pairs by default.
It runs the offline-pair sequence of pipeline/stages/pair_method.py (steps 1-5 there); what is its own:

1. The examples are the pairs themselves; a pair whose responses tokenise alike is refused.
3. The reference pass scores the training pairs only for a loss that takes reference log-probs
   (SimPO is reference-free); the held-out pairs are scored for every method, for the log-prob drift.
4. Per micro-batch one forward of 2N rows (`dpo.packing`: one row), the method's loss
   (pipeline/preference/losses.py).
   train.tsv and eval.tsv carry the same columns (COLUMNS): the loss, the implicit-reward accuracy,
   margin and rewards, and the policy's mean summed log-probs of the chosen and rejected responses,
   so the known failure where both fall while the margin grows (Pal et al. 2024) is visible;
   eval.tsv adds their drift from the reference.
5. The last held-out row as `eval/*`, the last step's accuracy and margin as `train/*`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import Params, PreferenceOptConfig
from ..errors import check_finite
from ..context import SINGLE, Context
from ..tracking.metric_names import METRICS_JSON, Metric
from ..tracking.model_card import ModelFacts
from . import pair_method
from .pair_method import PairMethod, Prepared
from .spec import StageSpec

if TYPE_CHECKING:   # annotations only: importing these loads torch, and listing the stages must not
    import torch
    from ..preference.logprobs import TokenPair
    from ..training.engines import TrainEngine
    from ..training.supervised import SupervisedResult, SupervisedTask

# docs/metrics.md: the note under each file the stage writes
METRIC_FILES = {
    "train.tsv": "one row per optimizer step",
    "eval.tsv": "held-out pairs during training, with the log-prob drift from the reference",
    "metrics.json": "after training, then the trained policy sampled on the held-out prompts",
}

def task_metrics(stage: str) -> list[Metric]:
    """The names `task` and `final_metrics` write, as `stage` (dpo, or a stage training with them)
    declares them: the step logs' COLUMNS and DRIFT, their last rows in metrics.json."""
    m = functools.partial(pair_method.metric, stage)
    columns = {"accuracy": "rate of pairs whose implicit reward (beta x log-ratio to the reference; SimPO: beta x "
                           "mean log-prob) is higher for the chosen response",
               "margin": "mean implicit reward of chosen minus rejected",
               "chosen_logp": "mean summed log-prob of the chosen responses under the policy",
               "rejected_logp": "mean summed log-prob of the rejected responses under the policy",
               "chosen_reward": "mean implicit reward of the chosen responses",
               "rejected_reward": "mean implicit reward of the rejected responses"}
    out = [m(file, k, v) for file in ("train.tsv", "eval.tsv") for k, v in columns.items()]
    out += [m("eval.tsv", "chosen_logp_drift", "held-out chosen log-prob, policy minus reference: both drifts "
                                               "falling while the margin grows is DPO's known failure"),
            m("eval.tsv", "rejected_logp_drift", "held-out rejected log-prob, policy minus reference")]
    out += [m(METRICS_JSON, f"eval/{k}", f"`eval.tsv`'s last `{k}`") for k in (*columns, *DRIFT)]
    out += [m(METRICS_JSON, "train/accuracy", "`train.tsv`'s last `accuracy`"),
            m(METRICS_JSON, "train/margin", "`train.tsv`'s last `margin`")]
    return out


def declared_metrics() -> list[Metric]:
    return pair_method.declared_metrics("dpo", "pairs", "the method's loss (`dpo.method`) over the step's pairs",
                                        "the method's loss on the held-out pairs", task_metrics("dpo"))


SPEC = StageSpec(
    "dpo", help="offline preference optimisation of the SFT policy on the pairs (DPO, IPO or SimPO)",
    inputs=("data", "sft"), training=True, shape="start", pipeline="compare", policy=True,
    headline=("eval/accuracy", "eval/margin", "dpo/gold", "dpo/kl"),
    parent_params=("dpo.seed", "dpo.lr", "dpo.beta", "dpo.method"),
    model=ModelFacts("the DPO-family policy", "the SFT policy, on preference pairs", "rlhf-dpo-policy",
                     "The SFT policy tuned offline on the preference pairs by DPO, IPO or SimPO (dpo.method; "
                     "transformers text-generation)."),
    check_inputs=lambda params, data_dir: pair_method.read_inputs(METHOD, params, data_dir),
    metrics=declared_metrics, files=METRIC_FILES,
    plan=lambda params, shapes: pair_method.memory_plan_of("dpo", params, shapes), reads=(
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


def attach_reference(pairs: list[TokenPair], ref_chosen: torch.Tensor, ref_rejected: torch.Tensor) -> list[ScoredPair]:
    """Each pair with its reference log-probs; `ref_chosen`, `ref_rejected`: (N,) for N pairs, finite."""
    for name, t in (("ref_chosen", ref_chosen), ("ref_rejected", ref_rejected)):
        if tuple(t.shape) != (len(pairs),):
            raise ValueError(f"{name}: the reference log-probs of {len(pairs)} pairs must have shape "
                             f"({len(pairs)},), got {tuple(t.shape)}")
        check_finite("dpo reference pass", f"{name} (the SFT model's log-prob of a response)", t)
    return [ScoredPair(p, c, r) for p, c, r in zip(pairs, ref_chosen.tolist(), ref_rejected.tolist())]


def score_reference(engine: TrainEngine, pairs: list[TokenPair], batch_size: int, pad_id: int,
                    needed: bool = True, packed: bool = False) -> list[ScoredPair]:
    """The reference log-probs of `pairs` (pair_method.reference_logprobs_of: the SFT policy itself;
    `packed`: in packed rows); zeros when not `needed` (the training pairs of a reference-free loss)."""
    import torch
    if not needed:
        zeros = torch.zeros(len(pairs), device="cpu")
        return attach_reference(pairs, zeros, zeros)
    return attach_reference(pairs, *pair_method.reference_logprobs_of(engine, pairs, batch_size, pad_id, packed))


def preference_loss(cfg: PreferenceOptConfig, part: list[ScoredPair], logp_chosen: torch.Tensor,
                    logp_rejected: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """The method's mean loss over the pairs of `part` and its stats; logp_*: (n,) the policy's
    summed log-probs of the responses of `part`. The loss takes the reference log-probs, the
    responses' lengths and its own options as its registration says."""
    import torch
    from ..preference.logprobs import response_lengths
    from ..preference.losses import PREFERENCE_LOSSES
    loss, facts = PREFERENCE_LOSSES[cfg.method], PREFERENCE_LOSSES.facts(cfg.method)
    dev, dtype = logp_chosen.device, logp_chosen.dtype
    given: dict[str, Any] = {}
    if facts["lengths"]:
        lengths = response_lengths([s.tokens for s in part])   # (n,), (n,)
        given["chosen_lengths"], given["rejected_lengths"] = (t.to(dev) for t in lengths)
    if facts["reference"]:
        given["ref_chosen"] = torch.tensor([s.ref_chosen for s in part], dtype=dtype, device=dev)      # (n,)
        given["ref_rejected"] = torch.tensor([s.ref_rejected for s in part], dtype=dtype, device=dev)  # (n,)
    options = {"label_smoothing": cfg.label_smoothing, "gamma": cfg.simpo_gamma}   # each loss takes its own
    return loss(logp_chosen, logp_rejected, beta=cfg.beta, **given, **{k: options[k] for k in facts["options"]})


def batch_loss(model, cfg: PreferenceOptConfig, part: list[ScoredPair], pad_id: int,
               packed: bool = False) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy's loss on `part`: one forward of its 2n sequences (2n rows, or one `packed` row),
    then the method's loss."""
    from ..preference.logprobs import pair_logprobs
    logp_chosen, logp_rejected = pair_logprobs(model, [s.tokens for s in part], pad_id, packed)   # (n,), (n,)
    return preference_loss(cfg, part, logp_chosen, logp_rejected)


def eval_pairs(model, cfg: PreferenceOptConfig, items: list[ScoredPair], pad_id: int, ctx: Context = SINGLE,
               batch_size: int = 64, packed: bool = False) -> dict[str, float]:
    """The COLUMNS and DRIFT over every held-out pair (pair-weighted means), every rank scoring its
    share; every rank runs the same number of forwards (ZeRO-3 gathers per forward; `packed`: each
    a packed row)."""
    import torch
    with torch.no_grad():  # not inference_mode: see pipeline/ppo/scoring.py
        model.eval()
        sums = torch.zeros(len(COLUMNS) + 3, dtype=torch.float64, device="cpu")   # the columns, reference chosen, rejected, count
        for part in ctx.eval_parts(items, batch_size):
            _, stats = batch_loss(model, cfg, part or items[:1], pad_id, packed)
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


def final_metrics(result: SupervisedResult) -> dict[str, Any]:
    """The last held-out row as `eval/*` (its loss is already `eval/loss`) and the last step's
    implicit-reward accuracy and margin as `train/*`."""
    eval_row, train_row = result.eval_log.rows[-1], result.train_log.rows[-1]
    out = {f"eval/{c}": eval_row[c] for c in (*COLUMNS, *DRIFT) if c != "loss"}
    out.update({f"train/{c}": train_row[c] for c in ("accuracy", "margin")})
    return out


def task(cfg: PreferenceOptConfig, engine: TrainEngine, micro: int, prepared: Prepared) -> SupervisedTask:
    """Steps 3-4: the reference log-probs, then the method's loss of a micro-batch."""
    import torch
    from ..preference.losses import PREFERENCE_LOSSES
    from ..training import token_batches
    from ..training.supervised import SupervisedTask
    pad, width = prepared.pad, prepared.width
    # 3. The reference log-probs, once, before the first step (and before a resumed state is loaded).
    # With `packing`, every forward in packed rows: reference, training and held-out passes.
    train_items = score_reference(engine, prepared.train_tokens, width, pad,
                                  needed=PREFERENCE_LOSSES.facts(cfg.method)["reference"], packed=cfg.packing)
    eval_items = score_reference(engine, prepared.held_tokens, width, pad,   # every method: the drift columns
                                 packed=cfg.packing)

    # 4. The loss of a micro-batch, normalised by the global batch (pairs).
    def loss(part: list[ScoredPair], batch: list[ScoredPair]) -> tuple[torch.Tensor, list[float]]:
        value, stats = batch_loss(engine.forward, cfg, part, pad, cfg.packing)
        return value * len(part) / len(batch), [stats[key] * len(part) for key in COLUMNS.values()]

    return SupervisedTask(prepared.name, train_items, list(COLUMNS), loss, normaliser=len,
                          eval_columns=[*COLUMNS, *DRIFT],
                          evaluate=lambda: eval_pairs(engine.model, cfg, eval_items, pad, prepared.ctx, width,
                                                      cfg.packing),
                          # its two rows, chosen and rejected; packed, its two sequences
                          length=lambda item: (item.tokens.packed_width if cfg.packing
                                               else 2 * item.tokens.width),
                          forwards=token_batches.packed if cfg.packing else None)


METHOD = PairMethod(SPEC, task, final_metrics)


def run(params: Params, data_dir: Path, sft_dir: Path, out: Path, progress: bool = True) -> dict[str, Any]:
    """The stage (pair_method.run): train, measure, write the outputs."""
    return pair_method.run(METHOD, params, data_dir, sft_dir, out, progress)
