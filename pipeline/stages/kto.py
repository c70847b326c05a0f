"""The `kto` stage: Kahneman-Tversky Optimisation of the SFT policy on unpaired feedback
(Ethayarajh et al. 2024): each example is one response to a prompt, marked desirable or not, and no
example has a partner to be compared with.

1. Read and validate every input before the first step: the preference pairs (`kto.dataset`, the
   RM's by default) and the held-out prompts of the final measurement. Unpaired data is made from
   the pairs (`unpaired`): a seeded split into two disjoint halves, the chosen response of each pair
   of one half a desirable example, the rejected response of each pair of the other an undesirable
   one, so the contrast DPO learns from is not in the data.
2. Every example gets a mismatched response, another example's (a seeded derangement over the
   data): the policy's and the reference's log-probs of responses unrelated to the prompt estimate
   how far the policy has drifted from the reference, the KL reference point z_ref of the loss.
   Each example is tokenised with both responses (as a preference pair is), the longer one deciding
   `kto.overlong`.
3. The reference model's log-probs of every example's own and mismatched response are computed
   once, by the policy's own engine before its first step (DPO's way: the same weights and device,
   no second model resident).
4. Training runs in the shared supervised loop. Per step z_ref is the policy's KL estimate over the
   whole global batch (every rank the same, without gradient, clamped at 0), so the step does not
   depend on how the batch is split into processes and micro-batches; per micro-batch one forward
   of its own responses and `kto_loss`. train.tsv and eval.tsv carry the loss, z_ref, the mean
   implicit reward (beta (log pi - log pi_ref)) of each kind, their margin and each kind's mean
   summed log-prob.
5. After training: the policy sampled on the held-out prompts as the other methods are
   (`prompts.sampling`): KL to the SFT policy, end-of-response rate, length, distinct-2 and, with the
   task's gold judge, the gold score, as `kto/*` (the names compare gives a policy).
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..config import Params
from ..data import inputs
from ..data.preferences import Pair
from ..errors import check_finite
from ..measurement.policy import sampled_declarations, sampled_metrics
from ..models import lora
from ..models.checkpoints import load_policy
from ..preference.logprobs import TokenPair, fit_pairs, reference_logprobs, sequence_logprobs
from ..tracking.metric_names import METRICS_JSON, Metric
from ..training import loading, memory_plan, supervised
from ..training.distributed import SINGLE, Context
from ..training.supervised import SupervisedTask
from .skeleton import StageRun, stage_run
from .spec import StageSpec

# train.tsv / eval.tsv column -> kto_loss's stat of the same meaning
COLUMNS = {"loss": "loss", "kl": "kl", "desirable_reward": "rewards/desirable",
           "undesirable_reward": "rewards/undesirable", "margin": "rewards/margin",
           "desirable_logp": "logps/desirable", "undesirable_logp": "logps/undesirable"}


def metrics() -> list[Metric]:
    """The names this stage writes (docs/metrics.md): the supervised loop's, its columns, the
    sampled measurement's."""
    meanings = {
        "kl": "z_ref: the policy's KL estimate from the reference on mismatched prompt-response pairs (the "
              "step's global batch), clamped at 0",
        "desirable_reward": "mean implicit reward beta (log pi - log pi_ref) of the desirable responses",
        "undesirable_reward": "the same of the undesirable responses",
        "margin": "desirable minus undesirable mean implicit reward",
        "desirable_logp": "mean summed log-prob of the desirable responses under the policy",
        "undesirable_logp": "the same of the undesirable responses",
    }

    def m(file: str, name: str, meaning: str) -> Metric:
        return Metric("kto", file, name, meaning, "compare")
    out = [Metric("kto", x.file, x.name, x.meaning, "compare" if x.condition is None else "method_lora")
           for x in supervised.declared_metrics(
               "kto", "examples", "KTO loss: the mean over the step's examples of lambda_D (1 - sigmoid(beta (r - "
               "z_ref))) for a desirable one, lambda_U (1 - sigmoid(beta (z_ref - r))) for an undesirable one",
               "the KTO loss on the held-out examples (made from the held-out pairs as the training ones)",
               "adapters")]
    for file in ("train.tsv", "eval.tsv"):
        out += [m(file, c, meaning) for c, meaning in meanings.items()]
    out += [m(METRICS_JSON, f"eval/{c}", f"`eval.tsv`'s last `{c}`") for c in meanings]
    out += [m(METRICS_JSON, "train/margin", "`train.tsv`'s last `margin`"),
            m(METRICS_JSON, "data/desirable", "desirable training examples (chosen responses of one half of the pairs)"),
            m(METRICS_JSON, "data/undesirable", "undesirable training examples (rejected responses of the other half)"),
            m(METRICS_JSON, "data/eval_truncated", "held-out examples kept with their prompt's left end cut"),
            m(METRICS_JSON, "data/eval_dropped", "held-out examples left out (`kto.overlong: drop`)")]
    return out + sampled_declarations("kto", ("gold", "kl"))


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
    metrics=metrics, files=METRIC_FILES,
    plan=lambda params, shapes: memory_plan_of(params, shapes), reads=(
    "data.task", "model.trust_remote_code",
    "kto", "distributed",
    "prompts",                   # held-out prompts, how they are sampled, the gold judge switch
))


# ---- The math ------------------------------------------------------------------------------------


def _check_batch(**tensors: torch.Tensor) -> int:
    """All inputs (N,) with the same N >= 1; returns N (a per-token (N, R) tensor would broadcast)."""
    n = None
    for name, t in tensors.items():
        if t.dim() != 1:
            raise ValueError(f"{name} must be (N,) per-sequence values, got shape {tuple(t.shape)}")
        if n is None:
            n = t.shape[0]
        elif t.shape[0] != n:
            raise ValueError(f"{name} has {t.shape[0]} examples, expected {n} like the others")
    if not n:
        raise ValueError("a KTO batch needs at least one example")
    return n


def reference_point(kl_logp: torch.Tensor, kl_ref_logp: torch.Tensor) -> torch.Tensor:
    """z_ref: the mean of log pi(y'|x) - log pi_ref(y'|x) over mismatched pairs (N,), clamped at 0
    (a KL is >= 0; a batch's estimate can dip below) and detached: the paper's reference point is
    not trained through."""
    _check_batch(kl_logp=kl_logp, kl_ref_logp=kl_ref_logp)
    return (kl_logp - kl_ref_logp).detach().mean().clamp(min=0)


def kto_loss(logp: torch.Tensor, ref_logp: torch.Tensor, desirable: torch.Tensor, z_ref: torch.Tensor,
             beta: float, lambda_d: float = 1.0, lambda_u: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-example KTO terms (N,) and the implicit rewards beta r (N,), detached.

    logp (N,) the policy's summed response log-probs (with grad); ref_logp (N,) the reference's;
    desirable (N,) bool; z_ref () from `reference_point`. With r = logp - ref_logp:
    desirable   lambda_d (1 - sigmoid(beta (r - z_ref)))
    undesirable lambda_u (1 - sigmoid(beta (z_ref - r)))
    (the paper's L = E[lambda_y - v(x, y)]; TRL's kto_loss is the same). 1 - sigmoid(t) is computed as
    sigmoid(-t), which loses nothing when beta |r - z_ref| is large. The gradient pushes a desirable
    response's log-prob up and an undesirable one's down, saturating once |r - z_ref| >> 1 / beta."""
    _check_batch(logp=logp, ref_logp=ref_logp, desirable=desirable)
    if desirable.dtype != torch.bool:
        raise ValueError(f"desirable must be a bool tensor, got {desirable.dtype}")
    if z_ref.dim() != 0 or z_ref.requires_grad:
        raise ValueError("z_ref must be a detached scalar (reference_point)")
    reward = logp - ref_logp   # (N,)
    terms = torch.where(desirable, lambda_d * torch.sigmoid(beta * (z_ref - reward)),
                        lambda_u * torch.sigmoid(beta * (reward - z_ref)))   # (N,)
    return terms, beta * reward.detach()


def mismatched(n: int) -> list[int]:
    """out[i]: the example whose response prompt i is paired with for the KL estimate, i -> i + 1
    (mod n): a permutation with no fixed point, so every prompt gets another example's response and
    the mismatched responses are the data's own. n == 1 is refused: the only response is the
    example's own, and z_ref would be its own reward."""
    if n < 2:
        raise ValueError(f"the KL estimate needs at least 2 examples, got {n}")
    return [(i + 1) % n for i in range(n)]


@dataclass(frozen=True)
class Example:
    """An unpaired example: the prompt with its own response and the mismatched one (a TokenPair:
    chosen = its own, rejected = the mismatched), whether it is desirable, and the reference's
    summed log-probs of both responses."""
    tokens: TokenPair
    desirable: bool
    ref: float = 0.0
    kl_ref: float = 0.0


def unpaired(pairs: Sequence[Pair], seed: int) -> list[Pair]:
    """Unpaired examples from preference pairs, as Pairs whose `chosen` is the example's response
    and whose `rejected` is the mismatched response, with `margin` 1.0 for a desirable example and
    0.0 for an undesirable one. A seeded permutation splits the pairs into two disjoint halves: the
    chosen response of each pair of the first half is desirable, the rejected response of each pair
    of the second undesirable (the first half takes the extra pair of an odd count, so with
    lambda_d = lambda_u the ratio n_d / n_u stays in the paper's advised [1, 4/3] once counts are
    large); the examples are shuffled, then each takes the next one's response as its mismatched one."""
    if len(pairs) < 2:
        raise ValueError(f"KTO needs at least 2 preference pairs, got {len(pairs)}")
    rng = random.Random(seed)
    order = list(range(len(pairs)))
    rng.shuffle(order)
    half = (len(pairs) + 1) // 2
    own = [(pairs[i], pairs[i].chosen, True) for i in order[:half]] + \
          [(pairs[i], pairs[i].rejected, False) for i in order[half:]]
    rng.shuffle(own)
    other = mismatched(len(own))
    return [Pair(p.prompt, response, own[other[k]][1], 1.0 if good else 0.0, p.where)
            for k, (p, response, good) in enumerate(own)]


# ---- The stage -----------------------------------------------------------------------------------


def pair_sources(params: Params, data_dir: Path) -> tuple[list[Pair], list[Pair]]:
    """Training and held-out pairs (`kto.dataset`: the RM's prepared pairs by default)."""
    return inputs.preference_pairs(params.kto.dataset, data_dir, "kto")


def score_reference(engine, items: list[TokenPair], desirable: list[bool], batch_size: int, pad_id: int) -> list[Example]:
    """The reference log-probs of each example's own and mismatched response, from the engine's
    model before its first step with any adapter off (the SFT policy itself)."""
    model = engine.model
    with (model.disable_adapter() if lora.is_peft(model) else contextlib.nullcontext()):
        ref, kl_ref = reference_logprobs(model, items, batch_size, pad_id)
    for name, t in (("the own responses", ref), ("the mismatched responses", kl_ref)):
        check_finite("kto reference pass", f"the SFT model's log-prob of {name}", t)
    return [Example(t, d, r, k) for t, d, r, k in zip(items, desirable, ref.tolist(), kl_ref.tolist())]


def _tensors(part: list[Example], device, dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ref = torch.tensor([e.ref for e in part], dtype=dtype, device=device)        # (n,)
    kl_ref = torch.tensor([e.kl_ref for e in part], dtype=dtype, device=device)  # (n,)
    desirable = torch.tensor([e.desirable for e in part], device=device)         # (n,) bool
    return ref, kl_ref, desirable


@torch.no_grad()   # not inference_mode: see pipeline/ppo/scoring.py
def batch_kl(model, items: list[Example], chunk: int, pad_id: int) -> torch.Tensor:
    """z_ref of `items` (a global batch): the policy's log-probs of the mismatched responses, `chunk`
    at a time, against the reference's."""
    kl_logp = torch.cat([sequence_logprobs(model, [e.tokens.prompt for e in items[s:s + chunk]],
                                           [e.tokens.rejected for e in items[s:s + chunk]], pad_id)[0].float().cpu()
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
              counts: tuple[int, int, int]) -> tuple[torch.Tensor, list[float]]:
    """A micro-batch's share of the batch's mean loss (its terms' sum over the batch size), and its
    column sums (`stats_sums`)."""
    logp, _ = sequence_logprobs(forward, [e.tokens.prompt for e in part], [e.tokens.chosen for e in part], pad_id)
    ref, _, desirable = _tensors(part, logp.device, logp.dtype)
    terms, rewards = kto_loss(logp, ref, desirable, z_ref.to(logp.device, logp.dtype), cfg.beta,
                              cfg.lambda_desirable, cfg.lambda_undesirable)
    return terms.sum() / counts[0], stats_sums(terms, rewards, logp, desirable, z_ref, counts)


def kinds(items: Sequence[Example]) -> tuple[int, int, int]:
    n_d = sum(e.desirable for e in items)
    return len(items), n_d, len(items) - n_d


@torch.no_grad()
def eval_examples(model, cfg, items: list[Example], pad_id: int, ctx: Context = SINGLE,
                  batch_size: int = 64) -> dict[str, float]:
    """The COLUMNS over every held-out example (z_ref over all of them), every rank scoring its
    share; every rank runs the same number of forwards (ZeRO-3 gathers per forward)."""
    model.eval()
    z_ref = batch_kl(model, items, batch_size, pad_id)
    counts = kinds(items)
    sums = torch.zeros(len(COLUMNS), dtype=torch.float64, device="cpu")
    for part in ctx.eval_parts(items, batch_size):
        _, stats = part_loss(model, cfg, part or items[:1], z_ref, pad_id, counts)
        if part:
            sums += torch.tensor(stats, dtype=torch.float64, device="cpu")
    model.train()
    sums = ctx.sum(sums) / counts[0]
    return {column: float(v) for column, v in zip(COLUMNS, sums)}


def memory_plan_of(params: Params, shapes: memory_plan.Shapes) -> Optional[memory_plan.Planner]:
    """The SFT policy trained on its own responses (one row each with grad; the per-step KL forward
    runs without gradient, two micro-batches of rows at a time); its reference log-probs come from
    the same engine, so no second model."""
    if not shapes.ready("sft"):
        return None
    sft = shapes.model("sft")
    return memory_plan.supervised_planner("kto", params, sft, (sft,), rows=2,
                                          sampled=lambda cfg: params.prompts.sampling.max_new_tokens,
                                          beside=(sft,))   # the SFT policy, loaded for the KL


def train(run: StageRun, data_dir: Path, sft_dir: Path, progress: bool = True) -> tuple[Any, Any, dict]:
    """Steps 1-5 of the module doc; in a multi-process run rank 0 returns the whole model, the
    other ranks (None, tokenizer, {})."""
    params, ctx, out = run.params, run.ctx, run.out
    cfg = params.kto
    # 1. Every input, validated before the first step; the unpaired examples.
    train_pairs, held_pairs = pair_sources(params, data_dir)
    prompts = inputs.prompts(params, data_dir, "eval")[:cfg.n_eval_prompts]
    train_u, held_u = unpaired(train_pairs, cfg.seed), unpaired(held_pairs, cfg.seed)
    # 2. The policy and its examples (own and mismatched response as one pair of token ids).
    with loading.partitioned(cfg.distributed, ctx):   # ZeRO-3: each rank loads its partition only
        model, tok = load_policy(sft_dir, params.model.trust_remote_code, loading.load_dtype(cfg.distributed, True))
    train_fit, n_trunc, n_drop = fit_pairs(train_u, tok, cfg.max_length, cfg.overlong, "kto", distinct=False)
    eval_fit, e_trunc, e_drop = fit_pairs(held_u, tok, cfg.max_length, cfg.overlong, "kto", distinct=False)
    train_tok, train_good = [t for _, t in train_fit], [p.margin > 0 for p, _ in train_fit]
    eval_tok, eval_good = [t for _, t in eval_fit], [p.margin > 0 for p, _ in eval_fit]
    torch.manual_seed(cfg.seed)
    model = lora.wrap(model, cfg.lora, "CAUSAL_LM", "kto.lora")
    pad, width = tok.pad_token_id, 2 * cfg.batch_size

    def task(engine, micro: int) -> SupervisedTask:
        # 3. The reference log-probs, once, before the first step (and before a resumed state is loaded).
        train_items = score_reference(engine, train_tok, train_good, width, pad)
        eval_items = score_reference(engine, eval_tok, eval_good, width, pad)

        # 4. Per step z_ref over the global batch (the same on every rank), then each micro-batch's terms.
        step_z: dict[str, Any] = {"batch": None, "z": None}

        def loss(part: list[Example], batch: list[Example]) -> tuple[torch.Tensor, list[float]]:
            if step_z["batch"] is not batch:
                step_z["batch"], step_z["z"] = batch, batch_kl(engine.forward, batch, 2 * micro, pad)
            return part_loss(engine.forward, cfg, part, step_z["z"], pad, kinds(batch))

        return SupervisedTask("kto", train_items, list(COLUMNS), loss, normaliser=len, eval_columns=list(COLUMNS),
                              evaluate=lambda: eval_examples(engine.model, cfg, eval_items, pad, ctx, width))

    def measure(engine) -> dict[str, float]:   # every rank
        sft, _ = load_policy(sft_dir, params.model.trust_remote_code, next(engine.model.parameters()).dtype)
        return sampled_metrics("kto", engine, tok, prompts, params.prompts.sampling, cfg.seed, sft=sft.to(ctx.device),
                               judge=inputs.judge(params) if cfg.dataset.path is None else None,
                               max_prompt_length=params.prompts.max_length, ctx=ctx)

    def report(model, result, measured) -> dict[str, Any]:
        # 5. Final metrics and the sampled measurement.
        last = result.eval_log.rows[-1]
        return {**{f"eval/{c}": last[c] for c in COLUMNS if c != "loss"},
                "train/margin": result.train_log.rows[-1]["margin"], **measured}

    recipe = supervised.Recipe(model, len(train_tok), task, measure, report, counts={
        "data/desirable": sum(train_good), "data/undesirable": len(train_good) - sum(train_good),
        "data/truncated": n_trunc, "data/dropped": n_drop, "data/eval_truncated": e_trunc, "data/eval_dropped": e_drop})
    model, metrics = supervised.run("kto", cfg, recipe, out, run.checkpoint, run.tracker, ctx, run.fingerprint, progress)
    return model, tok, metrics


def run(params: Params, data_dir: Path, sft_dir: Path, out: Path, progress: bool = True) -> dict[str, Any]:
    """The stage: train, measure, then write model/, metrics.json, config.json and the step logs
    atomically (rank 0 writes; other ranks of a multi-process run return empty metrics)."""
    with stage_run(SPEC, params, out, [data_dir, sft_dir, params.kto.dataset.path]) as run:
        model, tok, metrics = train(run, data_dir, sft_dir, progress)
        run.finish(metrics, model, tok)
    return metrics
