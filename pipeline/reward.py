"""The `reward` stage: a Bradley-Terry reward model on preference pairs (InstructGPT step 2).

Initialised from the SFT checkpoint by default. Trained with -log sigmoid(r_chosen - r_rejected),
each optimizer step scoring chosen and rejected of a batch in one forward pass. Afterwards the
scores are normalised on the held-out demonstrations and the model is measured against the task's
gold annotator: pairwise accuracy next to the noise ceiling, Spearman correlation with gold on
held-out responses and on responses of the SFT policy (the distribution PPO starts from), score
statistics of chosen vs rejected, and calibration.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from scipy.stats import spearmanr
from tqdm import tqdm

from . import distributed, inputs, lora
from . import reward_model as rm
from .config import Params, to_dict
from .generation import generate_texts
from .io import atomic_dir, atomic_write_text, stale_extras
from .models import load_kwargs, load_policy
from .plots import calibration_plot
from .preferences import Pair, load_pairs
from .tokenizer import encode_prompt, encode_response
from .mlflow_tracking import stage_tracking
from .tracking import NO_TRACKER, StepLog, Tracker, write_metrics
from .distributed import SINGLE, Context
from .engines import supervised_engine, write_deepspeed_config
from .errors import check_finite
from .resume import SupervisedState, fingerprint, input_paths
from .training import BatchSampler, total_steps


PREPARED_PAIR_FIELDS = ("prompt", "chosen", "rejected", "id")


def pair_sources(params: Params, data_dir: Path) -> tuple[list[Pair], list[Pair]]:
    """Training and held-out pairs; a held-out pair that is also a training pair is leakage
    (`reward.dataset.leakage`)."""
    ds = params.reward.dataset
    if ds.path is None:
        fields = PREPARED_PAIR_FIELDS + ((ds.margin_column,) if ds.margin_column else ())
        train = load_pairs(data_dir / "pairs_train.jsonl", layout=ds.layout, margin_column=ds.margin_column,
                           allowed=fields)
        held = load_pairs(data_dir / "pairs_eval.jsonl", layout=ds.layout, margin_column=ds.margin_column,
                          allowed=fields)
    else:
        train = load_pairs(ds.path, ds.train_split, ds.revision, ds.layout, ds.margin_column)
        held = load_pairs(ds.path, ds.eval_split, ds.revision, ds.layout, ds.margin_column)
    key = lambda p: (inputs.prompt_key(p.prompt), p.chosen, p.rejected)   # noqa: E731
    held = inputs.held_out([(p.where, key(p)) for p in train], held, [(p.where, key(p)) for p in held],
                           ds.leakage, "reward.dataset.leakage", "pair")
    return train, held


def fit_pairs(pairs: list[Pair], tok, max_length: int, overlong: str) -> tuple[list[Pair], int, int]:
    """Pairs whose prompt + longer answer exceed `max_length` tokens: scored with the prompt's left
    end cut (`truncate`, see reward_model.encode_pair_text) or left out (`drop`). Returns the pairs
    and how many were truncated and dropped."""
    def length(p: Pair) -> int:
        return len(encode_prompt(tok, p.prompt)) + max(len(encode_response(tok, p.chosen)),
                                                       len(encode_response(tok, p.rejected)))
    return inputs.fit_lengths(pairs, length, max_length, overlong, "reward.max_length", where=lambda p: p.where)


def batch_scores(model, tok, pairs: list[Pair], max_length: int,
                 device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw (B,) scores of chosen and rejected, from length-sorted forwards over the 2B sequences."""
    seqs = [rm.encode_pair_text(tok, p.prompt, p.chosen, max_length) for p in pairs]
    seqs += [rm.encode_pair_text(tok, p.prompt, p.rejected, max_length) for p in pairs]
    scores = rm.length_sorted_scores(model, seqs, tok.pad_token_id, device)
    return scores[:len(pairs)], scores[len(pairs):]


@torch.inference_mode()
def score_pairs(model, tok, pairs: list[Pair], max_length: int, batch_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    model.eval()
    chosen, rejected = zip(*(batch_scores(model, tok, pairs[i:i + batch_size], max_length)
                             for i in range(0, len(pairs), batch_size)))
    model.train()
    return torch.cat(chosen), torch.cat(rejected)


def calibration(diff: torch.Tensor, bins: int) -> tuple[list[dict], float]:
    """Predicted vs observed preference rate. Each pair counts in both orders (p for the labelled
    winner with outcome 1, 1 - p for the loser with outcome 0), so a calibrated model lies on the
    diagonal. Returns the bins and the expected calibration error (count-weighted |pred - obs|)."""
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
    return float(spearmanr(x, y).statistic)


def gold_order_agreement(rc: torch.Tensor, rr: torch.Tensor, gold: torch.Tensor) -> float:
    """Fraction of pairs the model orders as the gold annotator does; a tie on either side counts 1/2.

    rc, rr: (N,) model scores of chosen and rejected; gold: (2, N) their gold scores. Unlike the
    accuracy on the sampled labels, this does not depend on the one draw of label noise, so it
    separates two reward models more reliably on 1000 pairs (its ceiling is 1)."""
    model_sign = torch.sign(rc - rr)            # (N,)
    gold_sign = torch.sign(gold[0] - gold[1]).to(model_sign.dtype)  # (N,)
    per_pair = torch.where((model_sign == 0) | (gold_sign == 0), 0.5, (model_sign == gold_sign).to(rc.dtype))
    return float(per_pair.mean())


def evaluate(model, tok, params: Params, data_dir: Path, sft_dir: Path, eval_pairs: list[Pair],
             out_dir: Path) -> dict[str, Any]:
    """Metrics of the trained (and normalised) reward model; writes calibration.tsv/png."""
    cfg, judge = params.reward, inputs.judge(params)
    rc, rr = score_pairs(model, tok, eval_pairs, cfg.max_length)
    rc, rr = rc - rm.offset(model), rr - rm.offset(model)
    bins, ece = calibration(rc - rr, cfg.calibration_bins)
    m: dict[str, Any] = {
        "eval/accuracy": float((rc > rr).float().mean()),
        "eval/chosen_mean": float(rc.mean()), "eval/chosen_std": float(rc.std()),
        "eval/rejected_mean": float(rr.mean()), "eval/rejected_std": float(rr.std()),
        "eval/calibration_error": ece,
    }
    cal_log = StepLog(out_dir / "calibration.tsv", ["predicted", "observed", "count"])
    for row in bins:
        cal_log.log(row["bin"], {k: row[k] for k in ("predicted", "observed", "count")})
    cal_log.flush()
    calibration_plot(bins, out_dir / "calibration.png")
    stats_path = data_dir / "stats.json"
    if params.reward.dataset.path is None and stats_path.is_file():
        ceiling = json.loads(stats_path.read_text())["noise_ceiling"]["pairs_eval"]
        m["eval/noise_ceiling"] = ceiling
        m["eval/accuracy_of_ceiling"] = m["eval/accuracy"] / ceiling
    if judge is not None:
        prompts = [p.prompt for p in eval_pairs] * 2
        responses = [p.chosen for p in eval_pairs] + [p.rejected for p in eval_pairs]
        gold = [judge(p, r) for p, r in zip(prompts, responses)]
        m["eval/spearman_gold_heldout"] = _spearman(torch.cat([rc, rr]).tolist(), gold)
        m["eval/gold_order_agreement"] = gold_order_agreement(rc, rr, torch.tensor(gold).view(2, -1))
        policy, ptok = load_policy(sft_dir)
        sft_prompts = inputs.prompts(params, data_dir, "eval")
        sft_prompts = (sft_prompts * (cfg.n_sft_samples // len(sft_prompts) + 1))[:cfg.n_sft_samples]
        texts, _ = generate_texts(policy, ptok, sft_prompts, params.sft.sampling, cfg.seed, greedy=False)
        scores = rm.score_texts(model, tok, sft_prompts, texts, cfg.max_length)
        m["eval/spearman_gold_sft_samples"] = _spearman(scores.tolist(), [judge(p, r) for p, r in zip(sft_prompts, texts)])
        m["eval/sft_samples_score_mean"] = float(scores.mean())
    return m


def normalise(model, tok, params: Params, data_dir: Path) -> float:
    """Store the mean raw score of held-out demonstrations as the offset; returns that mean."""
    demos = inputs.demonstrations(params, data_dir, "eval")
    setattr(model.config, rm.OFFSET_KEY, 0.0)
    mean = float(rm.score_texts(model, tok, [d["prompt"] for d in demos], [d["response"] for d in demos],
                                params.reward.max_length).mean())
    setattr(model.config, rm.OFFSET_KEY, mean)
    return mean


def train(params: Params, data_dir: Path, sft_dir: Path, out_dir: Path, progress: bool = True,
          tracker: Tracker = NO_TRACKER, ctx: Context = SINGLE, resume_fingerprint: str = ""):
    """Train, normalise and measure; in a multi-process run rank 0 returns the whole model, the
    other ranks (None, tokenizer, {}). The loop saves into `out_dir/checkpoint` every `save_every`
    steps and resumes from a save carrying `resume_fingerprint` (see resume.py)."""
    cfg = params.reward
    train_pairs, eval_pairs = pair_sources(params, data_dir)
    init = cfg.name_or_path if cfg.name_or_path is not None else sft_dir
    model, tok = rm.init_reward_model(init, cfg.seed, cfg.head_init_std, params.model.trust_remote_code,
                                      load_kwargs(params.model) if cfg.name_or_path is not None else None)
    model = lora.wrap(model, cfg.lora, "SEQ_CLS")
    train_pairs, n_trunc, n_drop = fit_pairs(train_pairs, tok, cfg.max_length, cfg.overlong)
    torch.manual_seed(cfg.seed)
    steps = total_steps(len(train_pairs), cfg.batch_size, cfg.epochs)
    engine, micro = supervised_engine(model, cfg, steps, ctx)
    write_deepspeed_config(out_dir / "deepspeed_config.json", reward=engine) if ctx.is_main else None
    train_log = StepLog(out_dir / "train.tsv", ["loss", "accuracy", "lr", "grad_norm"], tracker, series="train",
                        write=ctx.is_main)
    eval_log = StepLog(out_dir / "eval.tsv", ["loss", "accuracy"], tracker, series="eval", write=ctx.is_main)
    batches = BatchSampler(len(train_pairs), cfg.batch_size, cfg.seed)   # the same global batches on every rank
    state = SupervisedState("reward", out_dir / "checkpoint", resume_fingerprint, engine, batches,
                            {"train": train_log, "eval": eval_log}, ctx)
    start = state.load()
    engine.train()
    for step in tqdm(range(start + 1, steps + 1), desc="reward", initial=start, total=steps,
                     disable=not (progress and ctx.is_main), mininterval=1.0):
        mine = ctx.shard([train_pairs[i] for i in next(batches)])
        sums = torch.zeros(2, dtype=torch.float64)                       # loss, correct
        for first in range(0, len(mine), micro):
            part = mine[first:first + micro]
            rc, rr = batch_scores(engine.model, tok, part, cfg.max_length, engine.device)
            loss, correct = rm.pairwise_loss_sum(rc, rr, torch.tensor([p.margin for p in part], device=rc.device))
            check_finite(f"reward step {step}", "loss", loss.detach())
            engine.backward(loss / cfg.batch_size)
            sums += torch.tensor([loss.item(), correct], dtype=torch.float64)
        lr, grad_norm, _ = engine.step()
        check_finite(f"reward step {step}", "gradient norm", grad_norm)
        sums = ctx.sum(sums) / cfg.batch_size
        train_log.log(step, {"loss": float(sums[0]), "accuracy": float(sums[1]), "lr": lr, "grad_norm": grad_norm})
        if step % cfg.eval_every == 0 or step == steps:
            eval_log.log(step, eval_pairs_loss(engine.model, tok, eval_pairs, cfg.max_length, ctx, engine.device))
            train_log.flush()
            eval_log.flush()
        if step % cfg.save_every == 0 or step == steps:
            state.save(step)
    train_time = state.elapsed()   # the interrupted runs' time too
    full = engine.full_model()   # collective under ZeRO-3
    if full is None:
        return None, tok, {}
    metrics: dict[str, Any] = {"train/steps": steps, "train/seconds": train_time,
                               "data/truncated": n_trunc, "data/dropped": n_drop,
                               "train/loss": train_log.rows[-1]["loss"], "eval/loss": eval_log.rows[-1]["loss"]}
    model, counts = lora.finish(full, cfg.lora, out_dir)
    metrics.update(counts)
    if cfg.normalize:
        metrics["eval/offset"] = normalise(model, tok, params, data_dir)
    metrics.update(evaluate(model, tok, params, data_dir, sft_dir, eval_pairs, out_dir))
    return model, tok, metrics


@torch.inference_mode()
def eval_pairs_loss(model, tok, pairs: list[Pair], max_length: int, ctx: Context = SINGLE,
                    device: torch.device | None = None, batch_size: int = 64) -> dict[str, float]:
    """Held-out loss and accuracy, every rank scoring its share (same number of forwards per rank)."""
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64)                          # loss, correct, count
    for part in ctx.eval_parts(pairs, batch_size):
        rc, rr = batch_scores(model, tok, part or pairs[:1], max_length, device)
        if part:
            loss, correct = rm.pairwise_loss_sum(rc, rr, torch.tensor([p.margin for p in part], device=rc.device))
            sums += torch.tensor([float(loss), correct, len(part)], dtype=torch.float64)
    model.train()
    sums = ctx.sum(sums)
    return {"loss": float(sums[0] / sums[2]), "accuracy": float(sums[1] / sums[2])}


def run(params: Params, data_dir: Path, sft_dir: Path, out: Path, progress: bool = True) -> dict[str, Any]:
    resolved = {"data": {"task": params.data.task}, "model": {"trust_remote_code": params.model.trust_remote_code},
                "sft": {"sampling": to_dict(params.sft.sampling)}, "reward": to_dict(params.reward)}
    with distributed.session(params.reward.distributed) as ctx:
        if ctx.is_main:
            out.mkdir(parents=True, exist_ok=True)
            stale_extras(out, params.reward.lora.enabled, ctx.world_size > 1 or params.reward.distributed.backend != "none")
        return _run(params, data_dir, sft_dir, out, progress, resolved, ctx)


def _run(params: Params, data_dir: Path, sft_dir: Path, out: Path, progress: bool, resolved: dict,
         ctx: Context) -> dict[str, Any]:
    with stage_tracking("reward", resolved, [data_dir, sft_dir], enabled=ctx.is_main) as tracker:
        cfg = params.reward
        fp = fingerprint(resolved, input_paths(data_dir, sft_dir, cfg.dataset.path, cfg.name_or_path))
        model, tok, metrics = train(params, data_dir, sft_dir, out, progress, tracker, ctx, fp)
        if model is None:
            return metrics
        with atomic_dir(out / "model") as tmp:
            model.save_pretrained(str(tmp), safe_serialization=True)
            tok.save_pretrained(str(tmp))
        atomic_write_text(out / "config.json", json.dumps(resolved, indent=2) + "\n")
        write_metrics(out / "metrics.json", metrics, tracker)
        tracker.log_outputs(out)
    return metrics
