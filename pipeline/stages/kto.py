"""The `kto` stage: Kahneman-Tversky Optimisation of the SFT policy on unpaired feedback
(Ethayarajh et al. 2024): each example is one response to a prompt, marked desirable or not, and no
example has a partner to be compared with. It runs the offline-pair sequence of
pipeline/stages/pair_method.py (steps 1-5 there); what is its own:

1. Unpaired data is made from the pairs (data.unpaired): a seeded split into two disjoint halves,
   the chosen response of each pair of one half a desirable example, the rejected response of each
   pair of the other an undesirable one, so the contrast DPO learns from is not in the data.
2. Every example gets a mismatched response, another example's (a seeded derangement over the
   data): the policy's and the reference's log-probs of responses unrelated to the prompt estimate
   how far the policy has drifted from the reference, the KL reference point z_ref of the loss.
   Each example is tokenised with both responses (as a preference pair is), the longer one deciding
   `kto.overlong`.
3. The reference pass scores every example's own and mismatched response.
4. Per step z_ref is the policy's KL estimate over the whole global batch (every rank the same,
   without gradient, clamped at 0), so the step does not depend on how the batch is split into
   processes and micro-batches; per micro-batch one forward of its own responses and `kto_loss`
   (pipeline/preference/losses.py); `kto.packing` runs both forwards on packed rows. train.tsv and
   eval.tsv carry the loss, z_ref, the mean implicit reward (beta (log pi - log pi_ref)) of each
   kind, their margin and each kind's mean summed log-prob.
5. The last held-out row as `eval/*`, the last step's margin as `train/margin`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from ..config import KTOConfig, Params
from ..data.preferences import Pair
from ..data.unpaired import is_desirable, unpaired
from ..errors import check_finite
from ..tracking.metric_names import METRICS_JSON, Metric
from ..tracking.model_card import ModelFacts
from ..context import SINGLE, Context
from . import pair_method
from .pair_method import PairMethod, Prepared
from .spec import StageSpec

if TYPE_CHECKING:   # annotations only: importing these loads torch, and listing the stages must not
    import torch
    from ..preference.logprobs import TokenPair
    from ..training.engines import TrainEngine
    from ..training.supervised import SupervisedResult, SupervisedTask

# train.tsv / eval.tsv column -> kto_loss's stat of the same meaning
COLUMNS = {"loss": "loss", "kl": "kl", "desirable_reward": "rewards/desirable",
           "undesirable_reward": "rewards/undesirable", "margin": "rewards/margin",
           "desirable_logp": "logps/desirable", "undesirable_logp": "logps/undesirable"}


def metrics() -> list[Metric]:
    """The names this stage writes (docs/metrics.md): the offline-pair sequence's, its columns."""
    meanings = {
        "kl": "z_ref: the policy's KL estimate from the reference on mismatched prompt-response pairs (the "
              "step's global batch), clamped at 0",
        "desirable_reward": "mean implicit reward beta (log pi - log pi_ref) of the desirable responses",
        "undesirable_reward": "the same of the undesirable responses",
        "margin": "desirable minus undesirable mean implicit reward",
        "desirable_logp": "mean summed log-prob of the desirable responses under the policy",
        "undesirable_logp": "the same of the undesirable responses",
    }
    m = functools.partial(pair_method.metric, "kto")
    out = [m(file, c, meaning) for file in ("train.tsv", "eval.tsv") for c, meaning in meanings.items()]
    out += [m(METRICS_JSON, f"eval/{c}", f"`eval.tsv`'s last `{c}`") for c in meanings]
    out += [m(METRICS_JSON, "train/margin", "`train.tsv`'s last `margin`"),
            m(METRICS_JSON, "data/desirable", "desirable training examples (chosen responses of one half of the pairs)"),
            m(METRICS_JSON, "data/undesirable", "undesirable training examples (rejected responses of the other half)")]
    return pair_method.declared_metrics(
        "kto", "examples", "KTO loss: the mean over the step's examples of lambda_D (1 - sigmoid(beta (r - z_ref))) "
        "for a desirable one, lambda_U (1 - sigmoid(beta (z_ref - r))) for an undesirable one",
        "the KTO loss on the held-out examples (made from the held-out pairs as the training ones)", out)


# docs/metrics.md: the note under each file the stage writes
METRIC_FILES = {
    "train.tsv": "one row per optimizer step",
    "eval.tsv": "held-out examples (from the held-out pairs, split as the training pairs) during training",
    "metrics.json": "after training, then the trained policy sampled on the held-out prompts",
}

SPEC = StageSpec(
    "kto", help="KTO: the SFT policy trained on unpaired desirable/undesirable responses made from the pairs",
    inputs=("data", "sft"), training=True, shape="start", pipeline="compare", policy=True,
    headline=("eval/margin", "kto/gold", "kto/kl"),
    parent_params=("kto.seed", "kto.lr", "kto.beta"),
    model=ModelFacts("the KTO policy", "the SFT policy, on unpaired desirable and undesirable responses made from "
                     "the preference pairs", "rlhf-kto-policy", "The SFT policy tuned offline by KTO on unpaired "
                     "desirable and undesirable responses made from the preference pairs (transformers "
                     "text-generation)."),
    check_inputs=lambda params, data_dir: pair_method.read_inputs(METHOD, params, data_dir),
    metrics=metrics, files=METRIC_FILES,
    plan=lambda params, shapes: pair_method.memory_plan_of("kto", params, shapes), reads=(
    "data.task", "model.trust_remote_code",
    "kto", "distributed",
    "prompts",                   # held-out prompts, how they are sampled, the gold judge switch
))


@dataclass(frozen=True)
class Example:
    """An unpaired example: the prompt with its own response and the mismatched one (a TokenPair:
    chosen = its own, rejected = the mismatched), whether it is desirable, and the reference's
    summed log-probs of both responses."""
    tokens: TokenPair
    desirable: bool
    ref: float = 0.0
    kl_ref: float = 0.0


def score_reference(engine: TrainEngine, examples: list[tuple[Pair, TokenPair]], batch_size: int,
                    pad_id: int, packed: bool = False) -> list[Example]:
    """The reference log-probs of each example's own and mismatched response
    (pair_method.reference_logprobs_of: the SFT policy itself; `packed`: in packed rows)."""
    items = [tokens for _, tokens in examples]
    ref, kl_ref = pair_method.reference_logprobs_of(engine, items, batch_size, pad_id, packed)
    for name, t in (("the own responses", ref), ("the mismatched responses", kl_ref)):
        check_finite("kto reference pass", f"the SFT model's log-prob of {name}", t)
    return [Example(t, is_desirable(p), r, k) for (p, t), r, k in zip(examples, ref.tolist(), kl_ref.tolist())]


def _tensors(part: list[Example], device, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    import torch
    ref = torch.tensor([e.ref for e in part], dtype=dtype, device=device)        # (n,)
    kl_ref = torch.tensor([e.kl_ref for e in part], dtype=dtype, device=device)  # (n,)
    desirable = torch.tensor([e.desirable for e in part], device=device)         # (n,) bool
    return ref, kl_ref, desirable


def batch_kl(model, items: list[Example], chunk: int, pad_id: int, packed: bool = False) -> torch.Tensor:
    """z_ref of `items` (a global batch): the policy's log-probs of the mismatched responses, `chunk`
    at a time (in one row each when `packed`), against the reference's."""
    import torch
    from ..preference.logprobs import sequence_logprobs
    from ..preference.losses import reference_point
    with torch.no_grad():  # not inference_mode: see pipeline/ppo/scoring.py
        kl_logp = torch.cat([sequence_logprobs(model, [e.tokens.prompt for e in items[s:s + chunk]],
                                               [e.tokens.rejected for e in items[s:s + chunk]], pad_id,
                                               packed)[0].float().cpu()
                             for s in range(0, len(items), chunk)])   # (B,)
        return reference_point(kl_logp, torch.tensor([e.kl_ref for e in items], dtype=kl_logp.dtype, device=kl_logp.device))


def stats_sums(terms: torch.Tensor, rewards: torch.Tensor, logp: torch.Tensor, desirable: torch.Tensor,
               z_ref: torch.Tensor, counts: tuple[int, int, int]) -> list[float]:
    """The COLUMNS of a part as sums that, summed over the parts of a batch and divided by its size
    (the loop's normaliser), are the batch's means: the per-kind columns are scaled by the batch's
    size over the kind's count in it (`counts`: batch size, desirable, undesirable)."""
    n, n_d, n_u = counts
    d, u = desirable, ~desirable
    scale_d, scale_u = (n / n_d if n_d else 0.0), (n / n_u if n_u else 0.0)
    rd, ru = float(rewards[d].sum()) * scale_d, float(rewards[u].sum()) * scale_u
    return [float(terms.detach().sum()), float(z_ref) * len(terms), rd, ru, rd - ru,
            float(logp.detach()[d].sum()) * scale_d, float(logp.detach()[u].sum()) * scale_u]


def part_loss(forward, cfg, part: list[Example], z_ref: torch.Tensor, pad_id: int,
              counts: tuple[int, int, int], packed: bool = False) -> tuple[torch.Tensor, list[float]]:
    """A micro-batch's share of the batch's mean loss (its terms' sum over the batch size), and its
    column sums (`stats_sums`); its own responses in one row when `packed`."""
    from ..preference.logprobs import sequence_logprobs
    from ..preference.losses import kto_loss
    logp, _ = sequence_logprobs(forward, [e.tokens.prompt for e in part], [e.tokens.chosen for e in part],
                                pad_id, packed)
    ref, _, desirable = _tensors(part, logp.device, logp.dtype)
    terms, rewards = kto_loss(logp, ref, desirable, z_ref.to(logp.device, logp.dtype), cfg.beta,
                              cfg.lambda_desirable, cfg.lambda_undesirable)
    return terms.sum() / counts[0], stats_sums(terms, rewards, logp, desirable, z_ref, counts)


def kinds(items: Sequence[Example]) -> tuple[int, int, int]:
    n_d = sum(e.desirable for e in items)
    return len(items), n_d, len(items) - n_d


def eval_examples(model, cfg, items: list[Example], pad_id: int, ctx: Context = SINGLE,
                  batch_size: int = 64, packed: bool = False) -> dict[str, float]:
    """The COLUMNS over every held-out example (z_ref over all of them), every rank scoring its
    share; every rank runs the same number of forwards (ZeRO-3 gathers per forward; `packed`: each
    a packed row)."""
    import torch
    with torch.no_grad():
        model.eval()
        z_ref = batch_kl(model, items, batch_size, pad_id, packed)
        counts = kinds(items)
        sums = torch.zeros(len(COLUMNS), dtype=torch.float64, device="cpu")
        for part in ctx.eval_parts(items, batch_size):
            _, stats = part_loss(model, cfg, part or items[:1], z_ref, pad_id, counts, packed)
            if part:
                sums += torch.tensor(stats, dtype=torch.float64, device="cpu")
        model.train()
        sums = ctx.sum(sums) / counts[0]
        return {column: float(v) for column, v in zip(COLUMNS, sums)}


def final_metrics(result: SupervisedResult) -> dict[str, Any]:
    """The last held-out row as `eval/*` (its loss is already `eval/loss`) and the last step's margin."""
    last = result.eval_log.rows[-1]
    return {**{f"eval/{c}": last[c] for c in COLUMNS if c != "loss"},
            "train/margin": result.train_log.rows[-1]["margin"]}


def task(cfg: KTOConfig, engine: TrainEngine, micro: int, prepared: Prepared) -> SupervisedTask:
    """Steps 3-4: the reference log-probs, then z_ref per step and the loss of a micro-batch."""
    import torch
    from ..training import token_batches
    from ..training.supervised import SupervisedTask
    pad, width = prepared.pad, prepared.width
    # 3. The reference log-probs, once, before the first step (and before a resumed state is loaded).
    # With `packing`, every forward in packed rows: reference, training and held-out passes.
    train_items = score_reference(engine, prepared.train, width, pad, cfg.packing)
    eval_items = score_reference(engine, prepared.held, width, pad, cfg.packing)

    # 4. Per step z_ref over the global batch (the same on every rank), then each micro-batch's terms.
    step_z: dict[str, Any] = {"batch": None, "z": None}

    def loss(part: list[Example], batch: list[Example]) -> tuple[torch.Tensor, list[float]]:
        if step_z["batch"] is not batch:
            step_z["batch"], step_z["z"] = batch, batch_kl(engine.forward, batch, 2 * micro, pad, cfg.packing)
        return part_loss(engine.forward, cfg, part, step_z["z"], pad, kinds(batch), cfg.packing)

    return SupervisedTask("kto", train_items, list(COLUMNS), loss, normaliser=len, eval_columns=list(COLUMNS),
                          evaluate=lambda: eval_examples(engine.model, cfg, eval_items, pad, prepared.ctx, width,
                                                         cfg.packing),
                          length=lambda e: len(e.tokens.prompt) + len(e.tokens.chosen),   # its own response
                          forwards=token_batches.packed if cfg.packing else None)


def counts(kept: list[Pair]) -> dict[str, int]:
    """The desirable and undesirable training examples kept."""
    n_d = sum(is_desirable(p) for p in kept)
    return {"data/desirable": n_d, "data/undesirable": len(kept) - n_d}


METHOD = PairMethod(SPEC, task, final_metrics, examples=lambda cfg, pairs: unpaired(pairs, cfg.seed), distinct=False,
                    counts=counts)


def run(params: Params, data_dir: Path, sft_dir: Path, out: Path, progress: bool = True) -> dict[str, Any]:
    """The stage (pair_method.run): train, measure, write the outputs."""
    return pair_method.run(METHOD, params, data_dir, sft_dir, out, progress)
