"""The `reward` stage: a Bradley-Terry reward model on preference pairs (InstructGPT step 2).

Initialised from the SFT checkpoint by default. Trained with -log sigmoid(r_chosen - r_rejected),
each optimizer step scoring chosen and rejected of a batch in one forward pass. Afterwards the
scores are normalised on the held-out demonstrations and the model is measured against the task's
gold annotator: pairwise accuracy next to the noise ceiling, Spearman correlation with gold on
held-out responses and on responses of the SFT policy (the distribution PPO starts from), score
statistics of chosen vs rejected, and calibration. A run whose accuracy on validation pairs of
training titles is below `reward.restart.min_accuracy` at its check starts again from the next
attempt's seed (training/restart.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from ..config import Params
from ..files import read_json_object
from ..errors import DataError, shown
from ..data.preferences import Pair, check_distinct
from ..measurement import balance
from ..measurement.plots import calibration_plot, close_figure
from ..tracking.sinks import NO_TRACKER, StepLog, Tracker
from ..context import SINGLE, Context
from ..tracking.metric_names import METRICS_JSON, Metric
from ..tracking.model_card import ModelFacts
from .spec import StageSpec

if TYPE_CHECKING:   # annotations only: importing these loads torch, and listing the stages must not
    import torch
    from ..measurement.policy import Measured
    from ..models import reward_model as rm
    from ..training import memory_plan
    from .skeleton import StageRun

# docs/metrics.md: the note under each file the stage writes
METRIC_FILES = {
    "train.tsv": "one row per optimizer step",
    "eval.tsv": "held-out pairs during training",
    "calibration.tsv": "one row per bin of predicted preference probability; `calibration.png` plots "
                       "it",
    "restart.tsv": "the restart check's validation evaluations (`reward.restart`), every attempt's; only the "
                   "header when the run is not checked",
    "metrics.json": "after training and normalisation; RM scores are normalised (held-out "
                    "demonstrations average 0) unless `no_normalize`",
}

def declared_metrics() -> list[Metric]:
    from ..training import supervised
    def m(file: str, name: str, meaning: str, condition: Optional[str] = None) -> Metric:
        return Metric("reward", file, name, meaning, condition)

    return supervised.declared_metrics("reward", "pairs", "Bradley-Terry loss -log sigmoid(r_chosen - r_rejected - margin) of "
                       "the step's global batch", "Bradley-Terry loss on the held-out pairs",
                       "adapters and the score head") + [
        m("train.tsv", "accuracy", "fraction of the batch's pairs with r(chosen) > r(rejected)"),
        m("eval.tsv", "accuracy", "pairwise accuracy on the held-out pairs"),
        m("restart.tsv", "step", "the attempt's optimizer step the validation evaluation followed"),
        m("restart.tsv", "attempt", "the attempt evaluated: 0 the first, k the k-th restart (seed `reward.seed` + 1000 k)"),
        m("restart.tsv", "accuracy", "pairwise accuracy on the validation pairs of training titles (prepare's "
                                     "pairs_val.jsonl, or `reward.restart.holdout` of your training prompts)"),
        m(METRICS_JSON, "train/restarts", "restarts the check made (0: the first draw was kept, or no check)"),
        m(METRICS_JSON, "train/seed", "the seed the kept run trained with (`reward.seed` + 1000 x restarts)"),
        m(METRICS_JSON, "train/validation_accuracy", "the kept run's mean validation accuracy over the check's "
                                                     "window", "restart_checked"),
        m("calibration.tsv", "step", "bin of predicted probability, 0 .. `reward.calibration_bins` - 1 (empty "
                                     "bins have no row)"),
        m("calibration.tsv", "predicted", "mean predicted preference probability sigmoid(r_a - r_b) in the bin; "
                                          "every held-out pair counts in both orders"),
        m("calibration.tsv", "observed", "rate at which the first response of the bin's ordered pairs is the "
                                         "labelled winner"),
        m("calibration.tsv", "count", "ordered pairs in the bin"),
        m(METRICS_JSON, "eval/offset", "the normalisation offset stored in the model: mean raw score of the "
                                       "held-out demonstrations", "!no_normalize"),
        m(METRICS_JSON, "eval/scale", "standard deviation of the same demonstrations' scores, stored in the model "
                                      "for `ppo.normalize_reward` (not stored when 0)", "!no_normalize"),
        m(METRICS_JSON, "eval/accuracy", "held-out pairwise accuracy: r(chosen) > r(rejected)"),
        m(METRICS_JSON, "eval/chosen_mean", "mean normalised RM score of the held-out chosen responses"),
        m(METRICS_JSON, "eval/chosen_std", "their standard deviation"),
        m(METRICS_JSON, "eval/rejected_mean", "mean normalised RM score of the held-out rejected responses"),
        m(METRICS_JSON, "eval/rejected_std", "their standard deviation"),
        m(METRICS_JSON, "eval/pairs_imbalance", "held-out pairs the busiest rank scored minus the idlest's (each rank "
                                                "scores its share on its device; 0 in one process)"),
        m(METRICS_JSON, "eval/calibration_error", "expected calibration error of sigmoid(r_a - r_b) (count-weighted "
                                                  "\\|predicted - observed\\| over the bins of `calibration.tsv`; "
                                                  "`calibration.png` shows them)"),
        m(METRICS_JSON, "eval/noise_ceiling", "accuracy of the noiseless gold ordering on the same (noisy) labels: "
                                              "the best any model can do (from the prepare stage's `stats.json`)",
          "!custom_pairs"),
        m(METRICS_JSON, "eval/accuracy_of_ceiling", "`accuracy / noise_ceiling`", "!custom_pairs"),
        m(METRICS_JSON, "eval/spearman_gold_heldout", "Spearman correlation of RM score and gold score over all "
                                                      "held-out responses (chosen and rejected)", "!no_judge"),
        m(METRICS_JSON, "eval/gold_order_agreement", "fraction of held-out pairs the RM orders as the gold annotator "
                                                     "does (a tie on either side counts 1/2); free of the label "
                                                     "draw's noise, ceiling 1", "!no_judge"),
        m(METRICS_JSON, "eval/spearman_gold_sft_samples", "Spearman correlation of RM score and gold score over "
                                                          "`reward.n_sft_samples` responses sampled from the SFT "
                                                          "policy (where PPO starts)", "!no_judge"),
        m(METRICS_JSON, "eval/sft_samples_score_mean", "mean normalised RM score of those SFT samples", "!no_judge"),
    ]


SPEC = StageSpec(
    "reward", help="reward model on preference pairs", inputs=("data", "sft"), training=True, shape="load",
    headline=("eval/accuracy", "eval/accuracy_of_ceiling", "eval/spearman_gold_sft_samples"),
    parent_params=("reward.seed", "reward.lr", "reward.epochs"),
    model=ModelFacts("the reward model", "the SFT policy (its trunk, a new scalar head), on preference pairs",
                     "rlhf-reward-model", "The reward model of the RLHF pipeline: pyfunc, DataFrame[prompt, response] "
                     "-> scores normalised so held-out demonstrations average 0.", kind="reward"),
    check_inputs=lambda params, data_dir: held_out(params, data_dir, pair_sources(params, data_dir)[1]),
    metrics=declared_metrics, files=METRIC_FILES,
    plan=lambda params, shapes: memory_plan_of(params, shapes), reads=(
    "data.task", "model.trust_remote_code", "model.attn_implementation",
    "sft.sampling",              # how the SFT policy samples for the RM-vs-gold correlation
    "sft.dataset",               # held-out demonstrations: the normalisation reference
    "prompts.dataset",           # held-out prompts for the SFT-samples correlation
    "prompts.gold_judge",
    "reward", "distributed",
))


def pair_sources(params: Params, data_dir: Path) -> tuple[list[Pair], list[Pair]]:
    """Training and held-out pairs (`reward.dataset`: the prepared pairs by default)."""
    from ..data import inputs
    return inputs.preference_pairs(params.reward.dataset, data_dir, "reward")


def fit_pairs(pairs: list[Pair], encoded: rm.EncodedPairs, overlong: str) -> tuple[list[Pair], int, int]:
    """Pairs whose prompt + longer answer exceed `encoded.max_length` tokens: scored with the
    prompt's left end cut (`truncate`, see reward_model.encode_pair_text) or left out (`drop`).
    Returns the pairs and how many were truncated and dropped. The ids are tokenised into
    `encoded`, which training then reuses."""
    from ..data import inputs
    for p in pairs:
        check_distinct(p.where, encoded.response_ids(p.chosen), encoded.response_ids(p.rejected))
    return inputs.fit_lengths(pairs, lambda p: encoded.length((p.prompt, p.chosen, p.rejected)), encoded.max_length,
                              overlong, "reward.max_length", where=lambda p: p.where)


def batch_scores(model, tok, pairs: list[Pair], max_length: int, device: torch.device | None = None,
                 shared_prompt: bool = True, encoded: rm.EncodedPairs | None = None,
                 packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw (B,) scores of chosen and rejected (`reward_model.pair_scores`; `packed`: in one row)."""
    from ..models import reward_model as rm
    return rm.pair_scores(model, tok, [(p.prompt, p.chosen, p.rejected) for p in pairs], max_length, device,
                          shared_prompt, encoded, packed)


def score_pairs(model, tok, pairs: list[Pair], max_length: int, ctx: Context = SINGLE,
                device: torch.device | None = None, batch_size: int = 64,
                shared_prompt: bool = True, packed: bool = False) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Collective. Raw (N,) scores of every pair's chosen and rejected response, in the pairs' order
    on every rank (on the CPU): each rank scores its share on `device` (`Context.eval_parts`, the
    same number of forwards per rank), and the shares are gathered. Also returns the imbalance:
    the most pairs one rank scored minus the fewest."""
    import torch
    with torch.no_grad():  # not inference_mode: see pipeline/ppo/scoring.py
        model.eval()
        mine: list[list[tuple[float, float]]] = []
        for part in ctx.eval_parts(pairs, batch_size):
            rc, rr = batch_scores(model, tok, part or pairs[:1], max_length, device, shared_prompt, packed=packed)
            mine.append(list(zip(rc.tolist(), rr.tolist()))[:len(part)])
        model.train()
        ranks = ctx.gather(mine)   # ranks[r][k]: rank r's share of the k-th span of pairs
        ordered = [s for k in range(len(mine)) for r in ranks for s in r[k]]
        counts = [sum(map(len, r)) for r in ranks]
        balance.record([len(r) for r in ranks])   # forwards per rank: equal by eval_parts' construction
        chosen, rejected = (torch.tensor(col, dtype=torch.float32, device="cpu") for col in zip(*ordered))
        return chosen, rejected, max(counts) - min(counts)


def calibration(diff: torch.Tensor, bins: int) -> tuple[list[dict], float]:
    """Predicted vs observed preference rate. Each pair counts in both orders (p for the labelled
    winner with outcome 1, 1 - p for the loser with outcome 0), so a calibrated model lies on the
    diagonal. Returns the bins and the expected calibration error (count-weighted |pred - obs|)."""
    import torch
    p = torch.sigmoid(diff.double())
    pred, obs = torch.cat([p, 1 - p]), torch.cat([torch.ones_like(p), torch.zeros_like(p)])
    idx = (pred * bins).long().clamp(max=bins - 1)
    rows, ece = [], 0.0
    for b in range(bins):
        sel = idx == b
        n = int(sel.sum())
        if n:
            rows.append({"bin": b, "predicted": float(pred[sel].mean()), "observed": float(obs[sel].mean()), "count": n})
            ece += n * abs(rows[-1]["predicted"] - rows[-1]["observed"])
    return rows, ece / len(pred)


def _spearman(x: list[float], y: list[float]) -> float:
    from scipy.stats import spearmanr   # here: the command line imports every stage's module
    return float(spearmanr(x, y).statistic)


def gold_order_agreement(rc: torch.Tensor, rr: torch.Tensor, gold: torch.Tensor) -> float:
    """Fraction of pairs the model orders as the gold annotator does; a tie on either side counts 1/2.

    rc, rr: (N,) model scores of chosen and rejected; gold: (2, N) their gold scores. Unlike the
    accuracy on the sampled labels, this does not depend on the one draw of label noise, so it
    separates two reward models more reliably on 1000 pairs (its ceiling is 1)."""
    import torch
    model_sign = torch.sign(rc - rr)            # (N,)
    gold_sign = torch.sign(gold[0] - gold[1]).to(model_sign.dtype)  # (N,)
    per_pair = torch.where((model_sign == 0) | (gold_sign == 0), 0.5, (model_sign == gold_sign).to(rc.dtype))
    return float(per_pair.mean())


@dataclass
class HeldOut:
    """Everything the reward stage reads after training, read and validated before its first step
    (a broken line there must not cost a whole run)."""
    pairs: list[Pair]                  # held-out preference pairs
    demonstrations: list[dict]         # the normalisation reference (empty without `normalize`)
    prompts: list                      # evaluation prompts for the SFT-sample correlation (empty without a judge)
    noise_ceiling: Optional[float]     # from the prepare stage's stats.json (None for the user's own pairs)


def held_out(params: Params, data_dir: Path, eval_pairs: list[Pair]) -> HeldOut:
    from ..data import inputs
    cfg = params.reward
    demos = inputs.demonstrations(params, data_dir, "eval") if cfg.normalize else []
    prompts = inputs.prompts(params, data_dir, "eval") if inputs.judge(params) is not None else []
    ceiling = None
    stats_path = data_dir / "stats.json"
    if cfg.dataset.path is None and (stats_path.exists() or stats_path.is_symlink()):
        stats = read_json_object(stats_path, "stats file")
        noise = stats.get("noise_ceiling")
        ceiling = noise.get("pairs_eval") if isinstance(noise, dict) else None
        if isinstance(ceiling, bool) or not isinstance(ceiling, (int, float)) or not 0 < ceiling <= 1:
            raise DataError(f"{stats_path}: noise_ceiling.pairs_eval must be a number in (0, 1], got {shown(ceiling)}")
    return HeldOut(eval_pairs, demos, prompts, ceiling)


@dataclass(frozen=True)
class Scored:
    """What the trained reward model measured, every rank on its device (`train`'s `measure`)."""
    chosen: torch.Tensor      # (N,) raw scores of the held-out pairs' chosen responses, in order
    rejected: torch.Tensor    # (N,) the same for the rejected ones
    offset: float             # the stored normalisation offset (0 without `reward.normalize`)
    imbalance: int            # most minus fewest held-out pairs one rank scored
    sft_samples: Optional[Measured]   # the SFT policy's responses scored before normalisation


def sft_samples(engine, tok, params: Params, sft_dir: Path, held: HeldOut, ctx: Context = SINGLE) -> Optional[Measured]:
    """Collective. Responses of the SFT policy (the distribution PPO starts from) to the held-out
    prompts, scored by the trained reward model (`engine`'s, whole on every rank) and the gold judge;
    None without a judge."""
    from ..data import inputs
    from ..measurement.policy import measure, whole
    from ..models.checkpoints import load_policy
    from ..models.generation import check_stop_tokens
    from ..models.reward_source import RewardModelSource
    judge, cfg = inputs.judge(params), params.reward
    if judge is None:
        return None
    policy, ptok = load_policy(sft_dir, dtype=next(engine.model.parameters()).dtype)
    check_stop_tokens(ptok, {"sft.sampling": params.sft.sampling})   # with the SFT policy's tokenizer
    prompts = (held.prompts * (cfg.n_sft_samples // len(held.prompts) + 1))[:cfg.n_sft_samples]
    with whole(engine) as model:
        source = RewardModelSource(None, cfg.max_length, loaded=(model, tok), packed=cfg.packing)
        return measure(policy.to(ctx.device), ptok, prompts, params.sft.sampling, cfg.seed, judge=judge,
                       reward=source, ctx=ctx)


def evaluate(params: Params, held: HeldOut, out_dir: Path, scored: Scored,
             tracker: Tracker = NO_TRACKER) -> dict[str, Any]:
    """Metrics of the trained (and normalised) reward model from its `scored` held-out pairs and
    SFT samples (`measure`, every rank on its device); writes calibration.tsv/png."""
    import torch
    from ..data import inputs
    cfg, judge, eval_pairs, sampled = params.reward, inputs.judge(params), held.pairs, scored.sft_samples
    rc, rr = scored.chosen - scored.offset, scored.rejected - scored.offset
    bins, ece = calibration(rc - rr, cfg.calibration_bins)
    m: dict[str, Any] = {
        "eval/pairs_imbalance": scored.imbalance,
        "eval/accuracy": float((rc > rr).float().mean()),
        "eval/chosen_mean": float(rc.mean()), "eval/chosen_std": float(rc.std()),
        "eval/rejected_mean": float(rr.mean()), "eval/rejected_std": float(rr.std()),
        "eval/calibration_error": ece,
    }
    cal_log = StepLog(out_dir / "calibration.tsv", ["predicted", "observed", "count"])
    for row in bins:
        cal_log.log(row["bin"], {k: row[k] for k in ("predicted", "observed", "count")})
    cal_log.flush()
    figure = calibration_plot(bins, out_dir / "calibration.png")
    tracker.log_figure(figure, "calibration.png")
    close_figure(figure)
    if held.noise_ceiling is not None:
        m["eval/noise_ceiling"] = held.noise_ceiling
        m["eval/accuracy_of_ceiling"] = m["eval/accuracy"] / held.noise_ceiling
    if judge is not None:
        prompts = [p.prompt for p in eval_pairs] * 2
        responses = [p.chosen for p in eval_pairs] + [p.rejected for p in eval_pairs]
        gold = [judge(p, r) for p, r in zip(prompts, responses)]
        m["eval/spearman_gold_heldout"] = _spearman(torch.cat([rc, rr]).tolist(), gold)
        m["eval/gold_order_agreement"] = gold_order_agreement(rc, rr, torch.tensor(gold, device=rc.device).view(2, -1))
    if sampled is not None:
        m["eval/spearman_gold_sft_samples"] = _spearman(sampled.values["rm"], sampled.values["gold"])
        m["eval/sft_samples_score_mean"] = float(torch.tensor(sampled.values["rm"], device="cpu").mean())
    return m


def normalise(model, tok, params: Params, demos: list[dict], packed: bool = False) -> tuple[float, float]:
    """Store the mean raw score of held-out demonstrations as the offset and their standard deviation
    as the scale (what `ppo.normalize_reward` divides by); returns (mean, std). `packed`: scored in
    packed rows."""
    from ..models import reward_model as rm
    setattr(model.config, rm.OFFSET_KEY, 0.0)
    raw = rm.score_texts(model, tok, [d["prompt"] for d in demos], [d["response"] for d in demos],
                         params.reward.max_length, packed=packed)                       # (N,)
    mean, std = float(raw.mean()), float(raw.std()) if len(demos) > 1 else 0.0
    setattr(model.config, rm.OFFSET_KEY, mean)
    # One demonstration, or all scored alike: no spread to divide by, so no scale is stored (and
    # ppo.normalize_reward refuses this model) rather than failing a trained model here.
    setattr(model.config, rm.SCALE_KEY, std if std > 0 else None)
    return mean, std


def train(run: StageRun, data_dir: Path, sft_dir: Path, progress: bool = True):
    """Train, normalise and measure; in a multi-process run rank 0 returns the whole model, the
    other ranks (None, tokenizer, {}). With `reward.restart`, a run that falls short at its check
    starts again with the next attempt's seed (training/restart.py)."""
    import gc
    import logging
    from ..data import inputs
    from ..training import restart, resume
    from ..training.batches import total_steps
    cfg = run.params.reward
    train_pairs, eval_pairs = pair_sources(run.params, data_dir)
    held = held_out(run.params, data_dir, eval_pairs)
    val_pairs: list[Pair] = []
    if restart.active(cfg.restart, total_steps(len(train_pairs), cfg.batch_size, cfg.epochs)):   # validation pairs of training titles, read (and a holdout taken out) before any step
        train_pairs, val_pairs = inputs.validation_pairs(cfg.dataset, data_dir, train_pairs, cfg.restart.holdout,
                                                         "reward.restart")
    restart_log = StepLog(run.out / "restart.tsv", restart.COLUMNS, run.tracker, series="restart",
                          write=run.ctx.is_main)
    attempt = resume.attempt(run.checkpoint, run.fingerprint)   # a killed run resumes the attempt it was in
    pairs = Split(train_pairs, eval_pairs, val_pairs)
    while True:
        restart_log.tracked = lambda row, now=attempt: row["attempt"] == now   # earlier attempts: their own runs
        try:
            model, tok, metrics, checked = train_attempt(run, attempt, sft_dir, pairs, held, restart_log, progress)
            break
        except restart.Restarted as short:
            why = (f"restarted: validation accuracy {short.accuracy:.4f} < reward.restart.min_accuracy {short.bar} "
                   f"at step {cfg.restart.at_step}; seed {restart.seed_of(cfg.seed, attempt + 1)} trains again "
                   f"(restart {attempt + 1} of at most {cfg.restart.max_restarts})")
            logging.getLogger(__name__).warning("reward: %s", why)
            run.tracker.restart(why)
            attempt += 1
        gc.collect()   # the abandoned attempt's engine, held in cycles through its traceback's frames, before the next
    restart_log.flush()
    if model is not None:
        metrics.update(restart.summary(attempt, restart.seed_of(cfg.seed, attempt), checked))
    return model, tok, metrics


@dataclass(frozen=True)
class Split:
    """The reward stage's pairs: training, held-out, and validation (the restart check's; maybe none)."""
    train: list[Pair]
    eval: list[Pair]
    val: list[Pair]


def train_attempt(run: StageRun, attempt: int, sft_dir: Path, pairs: Split, held: HeldOut, restart_log: StepLog,
                  progress: bool) -> tuple[Any, Any, dict[str, Any], Optional[float]]:
    """One attempt of the stage, seeded `restart.seed_of(reward.seed, attempt)`: train's returns and the
    attempt's mean validation accuracy over the check's window (None unchecked). Raises
    restart.Restarted at a check that falls short while restarts are left."""
    import dataclasses
    import torch
    from ..measurement.policy import whole
    from ..models import lora, reward_model as rm
    from ..models.checkpoints import load_kwargs
    from ..training import loading, restart, supervised, token_batches
    from ..training.batches import total_steps
    from ..training.supervised import SupervisedTask
    params, ctx, out_dir = run.params, run.ctx, run.out
    cfg = params.reward
    init = cfg.name_or_path if cfg.name_or_path is not None else sft_dir
    seed = restart.seed_of(cfg.seed, attempt)
    with loading.partitioned(cfg.distributed, ctx):   # ZeRO-3: each rank loads its partition only
        model, tok = rm.init_reward_model(init, seed, cfg.head_init_std, params.model.trust_remote_code,
                                          load_kwargs(params.model, loading.load_dtype(cfg.distributed, trained=True)))
    model = lora.wrap(model, cfg.lora, "SEQ_CLS", "reward.lora")
    encoded = rm.EncodedPairs(tok, cfg.max_length)      # every prompt and response tokenised once, not once per epoch
    fitted, n_trunc, n_drop = fit_pairs(pairs.train, encoded, cfg.overlong)
    val_pairs = fit_pairs(pairs.val, encoded, cfg.overlong)[0] if pairs.val else []
    torch.manual_seed(seed)
    gates: list[Optional[restart.Gate]] = []   # the task's (None: unchecked)

    def task(engine, micro: int) -> SupervisedTask:
        # With `packing`, a micro-batch's pairs in one row, and so every held-out and final scoring pass.
        def loss(part: list[Pair], batch: list[Pair]) -> tuple[torch.Tensor, list[float]]:
            rc, rr = batch_scores(engine.model, tok, part, cfg.max_length, engine.device, cfg.shared_prompt,
                                  encoded, cfg.packing)
            total, correct = rm.pairwise_loss_sum(rc, rr, torch.tensor([p.margin for p in part], device=rc.device))
            return total / cfg.batch_size, [total.item(), correct]

        def scored(pairs_: list[Pair]) -> dict[str, float]:
            return eval_pairs_loss(engine.model, tok, pairs_, cfg.max_length, ctx, engine.device,
                                   shared_prompt=cfg.shared_prompt, encoded=encoded, packed=cfg.packing)

        gates.append(restart.gate(cfg.restart, total_steps(len(fitted), cfg.batch_size, cfg.epochs), cfg.eval_every,
                                  attempt, lambda: scored(val_pairs)["accuracy"], restart_log))
        return SupervisedTask("reward", fitted, ["loss", "accuracy"], loss,
                              normaliser=lambda batch: cfg.batch_size, eval_columns=["loss", "accuracy"],
                              evaluate=lambda: scored(pairs.eval),
                              length=lambda p: encoded.row_tokens((p.prompt, p.chosen, p.rejected),
                                                                  cfg.shared_prompt, cfg.packing),
                              forwards=token_batches.packed if cfg.packing else
                              lambda lengths: rm.length_sorted_parts(lengths, rm.PAIRS_PER_FORWARD),
                              gate=gates[-1])

    def measure(engine) -> tuple[Optional[float], Scored]:
        # Every rank, with the trained model whole on its device: the offset (the same on every rank),
        # the held-out pairs and the SFT policy's samples scored by it, each rank its share.
        offset = None
        with whole(engine) as trained:
            if cfg.normalize:
                offset = normalise(trained, tok, params, held.demonstrations, cfg.packing)   # (mean, std)
            rc, rr, imbalance = score_pairs(trained, tok, pairs.eval, cfg.max_length, ctx, engine.device,
                                            shared_prompt=cfg.shared_prompt, packed=cfg.packing)
            stored = rm.offset(trained)
        return offset, Scored(rc, rr, stored, imbalance, sft_samples(engine, tok, params, sft_dir, held, ctx))

    def report(model, result, measured) -> dict[str, Any]:
        offset, scored_ = measured
        return {**({"eval/offset": offset[0], "eval/scale": offset[1]} if offset is not None else {}),
                **evaluate(params, held, out_dir, scored_, run.tracker)}

    recipe = supervised.Recipe(model, len(fitted), task, measure, report,
                               counts={"data/truncated": n_trunc, "data/dropped": n_drop})
    model, metrics = supervised.run("reward", dataclasses.replace(cfg, seed=seed), recipe, out_dir,
                                    run.checkpoint, run.tracker, ctx, run.fingerprint, progress)
    gate = gates[-1] if gates else None
    return model, tok, metrics, gate.accuracy() if gate is not None else None


def eval_pairs_loss(model, tok, pairs: list[Pair], max_length: int, ctx: Context = SINGLE,
                    device: torch.device | None = None, batch_size: int = 64,
                    shared_prompt: bool = True, encoded: rm.EncodedPairs | None = None,
                    packed: bool = False) -> dict[str, float]:
    """Held-out loss and accuracy, every rank scoring its share (same number of forwards per rank;
    `packed`: each share's pairs in one packed row)."""
    import torch
    from ..models import reward_model as rm
    with torch.no_grad():  # not inference_mode: see pipeline/ppo/scoring.py
        model.eval()
        sums = torch.zeros(3, dtype=torch.float64, device="cpu")                          # loss, correct, count
        for part in ctx.eval_parts(pairs, batch_size):
            rc, rr = batch_scores(model, tok, part or pairs[:1], max_length, device, shared_prompt, encoded, packed)
            if part:
                loss, correct = rm.pairwise_loss_sum(rc, rr, torch.tensor([p.margin for p in part], device=rc.device))
                sums += torch.tensor([float(loss), correct, len(part)], dtype=torch.float64, device="cpu")
        model.train()
        sums = ctx.sum(sums)
        return {"loss": float(sums[0] / sums[2]), "accuracy": float(sums[1] / sums[2])}


def memory_plan_of(params: Params, shapes: memory_plan.Shapes) -> Optional[memory_plan.Planner]:
    """One trained scalar-head model: reward.name_or_path's checkpoint, or the SFT policy's trunk;
    its measurement loads the SFT policy beside it (the SFT samples it scores)."""
    from ..training import memory_plan
    from ..training.memory_terms import checkpoint_shape, with_attention
    name, attn = params.reward.name_or_path, params.model.attn_implementation
    if shapes.predicted:   # before any checkpoint: the policy with a scalar head, reading the SFT checkpoint
        sft = shapes.model("sft")
        return memory_plan.supervised_planner("reward", params, shapes.reward_start or shapes.scalar,
                                              (shapes.reward_start or sft,), rows=2, beside=(sft,))
    if name is None and not shapes.ready("sft"):
        return None
    rm = with_attention(checkpoint_shape(name, True, params.model.trust_remote_code) if name is not None
                        else shapes.model("sft", True), attn)
    beside = (shapes.model("sft"),) if shapes.ready("sft") else ()
    return memory_plan.supervised_planner("reward", params, rm, (rm,), rows=2, beside=beside)   # a pair: two sequences


def run(params: Params, data_dir: Path, sft_dir: Path, out: Path, progress: bool = True) -> dict[str, Any]:
    """The stage: train, normalise, measure, then write model/, metrics.json, config.json and the
    step logs atomically (rank 0 writes; other ranks of a multi-process run return empty metrics)."""
    from .skeleton import stage_run
    cfg = params.reward
    with stage_run(SPEC, params, out, [data_dir, sft_dir, cfg.dataset.path, cfg.name_or_path]) as run:
        model, tok, metrics = train(run, data_dir, sft_dir, progress)
        run.finish(metrics, model, tok)
    return metrics
