"""The `sft` stage: supervised fine-tuning on demonstrations (InstructGPT step 1).

Causal-LM cross-entropy on response tokens only (prompt tokens are context, not targets), AdamW,
linear warmup then cosine decay, gradient clipping, held-out loss every `eval_every` steps. After
training, greedy and sampled responses to the evaluation prompts are judged by the task's gold
annotator next to the held-out demonstrations, so the metrics say how good imitation got.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from .config import Params, to_dict
from .data import collate_sft, load_demonstrations, load_prompts, tokenize_demonstrations
from .generation import generate_texts
from .io import atomic_dir, atomic_write_json
from .models import init_policy, save_checkpoint
from .tasks import get_judge, reviews
from .mlflow_tracking import stage_tracking
from .tracking import NO_TRACKER, StepLog, Tracker, write_metrics
from .training import BatchSampler, adamw_with_schedule, total_steps, update


@torch.no_grad()
def eval_loss(model, examples, pad_id: int, batch_size: int) -> float:
    """Cross-entropy per response token over all held-out examples (token-weighted)."""
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(examples), batch_size):
        batch = collate_sft(examples[start:start + batch_size], pad_id)
        n = int((batch["labels"][:, 1:] != -100).sum())
        total += float(model(**batch).loss) * n
        count += n
    model.train()
    return total / count


def judge_responses(prompts: list[str], responses: list[str], ended: list[bool], judge, tag: str) -> dict:
    """Gold score, well-formedness and eos rate of responses, named `eval/<metric>_<tag>`."""
    n = len(responses)
    out = {f"eval/eos_rate_{tag}": sum(ended) / n}
    if judge is not None:
        out[f"eval/gold_{tag}"] = sum(judge(p, r) for p, r in zip(prompts, responses)) / n
        out[f"eval/well_formed_{tag}"] = sum(map(reviews.is_well_formed, responses)) / n
    return out


def train(params: Params, data_dir: Path, log_dir: Path, progress: bool = True,
          tracker: Tracker = NO_TRACKER) -> tuple[Any, Any, dict]:
    """Train and return (model, tokenizer, metrics); per-step TSVs are written into `log_dir`."""
    cfg = params.sft
    train_rows = load_demonstrations(data_dir / "sft_train.jsonl")
    eval_rows = load_demonstrations(data_dir / "sft_eval.jsonl")
    model, tok = init_policy(params.model, data_dir / "tokenizer", cfg.seed)
    train_ex, n_trunc = tokenize_demonstrations(train_rows, tok, cfg.max_length, data_dir / "sft_train.jsonl")
    eval_ex, _ = tokenize_demonstrations(eval_rows, tok, cfg.max_length, data_dir / "sft_eval.jsonl")

    torch.manual_seed(cfg.seed)
    steps = total_steps(len(train_ex), cfg.batch_size, cfg.epochs)
    opt, sched = adamw_with_schedule(model.parameters(), cfg.lr, cfg.weight_decay, cfg.warmup_ratio, steps)
    train_log = StepLog(log_dir / "train.tsv", ["loss", "lr", "grad_norm"], tracker, series="train")
    eval_log = StepLog(log_dir / "eval.tsv", ["loss"], tracker, series="eval")

    model.train()
    batches = BatchSampler(len(train_ex), cfg.batch_size, cfg.seed)
    t0 = time.perf_counter()
    for step in tqdm(range(1, steps + 1), desc="sft", disable=not progress, mininterval=1.0):
        loss = model(**collate_sft([train_ex[i] for i in next(batches)], tok.pad_token_id)).loss
        lr, grad_norm = update(model, loss, opt, sched, cfg.max_grad_norm)
        train_log.log(step, {"loss": loss.item(), "lr": lr, "grad_norm": grad_norm})
        if step % cfg.eval_every == 0 or step == steps:
            eval_log.log(step, {"loss": eval_loss(model, eval_ex, tok.pad_token_id, 2 * cfg.batch_size)})
            train_log.flush()
            eval_log.flush()
    train_time = time.perf_counter() - t0

    metrics: dict[str, Any] = {
        "train/loss": train_log.rows[-1]["loss"], "eval/loss": eval_log.rows[-1]["loss"],
        "train/steps": steps, "train/seconds": train_time, "data/truncated": n_trunc,
    }
    metrics.update(evaluate_policy(model, tok, params, data_dir))
    return model, tok, metrics


def evaluate_policy(model, tok, params: Params, data_dir: Path) -> dict[str, Any]:
    """Greedy and sampled responses to evaluation prompts, judged next to the demonstrations."""
    cfg, judge = params.sft, get_judge(params.data.task)
    prompts = load_prompts(data_dir / "eval_prompts.jsonl")[:cfg.n_eval_generations]
    out: dict[str, Any] = {}
    for tag, greedy in (("greedy", True), ("sampled", False)):
        texts, ended = generate_texts(model, tok, prompts, cfg.sampling, cfg.seed, greedy)
        out.update(judge_responses(prompts, texts, ended, judge, tag))
    if judge is not None:
        demos = load_demonstrations(data_dir / "sft_eval.jsonl")
        out["eval/gold_demonstrations"] = sum(judge(r["prompt"], r["response"]) for r in demos) / len(demos)
    return out


def run(params: Params, data_dir: Path, out: Path, progress: bool = True) -> dict[str, Any]:
    """The stage: train, then write model/, metrics.json, config.json and the step logs atomically."""
    resolved = {"data": {"task": params.data.task}, "model": to_dict(params.model), "sft": to_dict(params.sft)}
    out.mkdir(parents=True, exist_ok=True)
    with stage_tracking("sft", resolved, [data_dir]) as tracker:
        model, tok, metrics = train(params, data_dir, out, progress, tracker)
        with atomic_dir(out / "model") as tmp:
            save_checkpoint(model, tok, tmp)
        atomic_write_json(out / "config.json", resolved)
        write_metrics(out / "metrics.json", metrics, tracker)
        tracker.log_outputs(out)
    return metrics
