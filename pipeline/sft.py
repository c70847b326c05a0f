"""The `sft` stage: supervised fine-tuning on demonstrations (InstructGPT step 1).

Causal-LM cross-entropy on response tokens only (prompt tokens are context, not targets), AdamW,
linear warmup then cosine decay, gradient clipping, held-out loss every `eval_every` steps. After
training, greedy and sampled responses to the evaluation prompts are judged by the task's gold
annotator next to the held-out demonstrations, so the metrics say how good imitation got.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import distributed, inputs, lora

from .config import Params, to_dict
from .data import IGNORE, Example, collate_sft, tokenize_demonstrations
from .generation import generate_texts
from .io import atomic_dir, atomic_write_json, stale_extras
from .models import init_policy, save_checkpoint
from .tasks import reviews
from .mlflow_tracking import stage_tracking
from .tracking import NO_TRACKER, StepLog, Tracker, write_metrics
from .distributed import SINGLE, Context, to_device
from .engines import supervised_engine, write_deepspeed_config
from .errors import check_finite
from .resume import SupervisedState, fingerprint, input_paths
from .training import BatchSampler, total_steps


def response_token_count(e: Example) -> int:
    """Response tokens an example is trained on (the targets after the prompt)."""
    return len(e.input_ids) - e.n_prompt


def ce_sum(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the response tokens of `batch`, and their count."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits   # (B, T, V)
    labels = batch["labels"][:, 1:]                                                                 # (B, T-1)
    loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                           reduction="sum")
    return loss, int((labels != IGNORE).sum())


@torch.no_grad()
def eval_loss(model, examples: list[Example], pad_id: int, batch_size: int, ctx: Context = SINGLE,
              device: torch.device | None = None) -> float:
    """Cross-entropy per response token over all held-out examples (token-weighted), every rank
    scoring its share; every rank runs the same number of forwards (ZeRO-3 gathers per forward)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64)
    for part in ctx.eval_parts(examples, batch_size):
        batch = to_device(collate_sft(part or examples[:1], pad_id), device)
        loss, n = ce_sum(model, batch)
        if part:
            total += torch.tensor([float(loss), n], dtype=torch.float64)
    model.train()
    total = ctx.sum(total)
    return float(total[0] / total[1])


def judge_responses(prompts: list[str], responses: list[str], ended: list[bool], judge, tag: str) -> dict:
    """Gold score, well-formedness and eos rate of responses, named `eval/<metric>_<tag>`."""
    n = len(responses)
    out = {f"eval/eos_rate_{tag}": sum(ended) / n}
    if judge is not None:
        out[f"eval/gold_{tag}"] = sum(judge(p, r) for p, r in zip(prompts, responses)) / n
        out[f"eval/well_formed_{tag}"] = sum(map(reviews.is_well_formed, responses)) / n
    return out


def train(params: Params, data_dir: Path, log_dir: Path, progress: bool = True,
          tracker: Tracker = NO_TRACKER, ctx: Context = SINGLE,
          resume_fingerprint: str = "") -> tuple[Any, Any, dict]:
    """Train and return (model, tokenizer, metrics); per-step TSVs are written into `log_dir`.

    In a multi-process run every rank trains and the returned model is whole on rank 0 only
    (None elsewhere); evaluation after training is rank 0's. The loop saves its state into
    `log_dir/checkpoint` every `save_every` steps and resumes from it when the saved state carries
    `resume_fingerprint` (see resume.py)."""
    cfg = params.sft
    train_rows = inputs.demonstrations(params, data_dir, "train")
    eval_rows = inputs.demonstrations(params, data_dir, "eval")
    source = cfg.dataset.path or data_dir / "sft_train.jsonl"
    model, tok = init_policy(params.model, data_dir / "tokenizer", cfg.seed)
    model = lora.wrap(model, cfg.lora, "CAUSAL_LM")
    train_ex, n_trunc, n_drop = tokenize_demonstrations(train_rows, tok, cfg.max_length, source, cfg.overlong)
    eval_ex, _, _ = tokenize_demonstrations(eval_rows, tok, cfg.max_length, source, cfg.overlong)

    torch.manual_seed(cfg.seed)
    steps = total_steps(len(train_ex), cfg.batch_size, cfg.epochs)
    engine, micro = supervised_engine(model, cfg, steps, ctx)
    write_deepspeed_config(log_dir / "deepspeed_config.json", sft=engine) if ctx.is_main else None
    train_log = StepLog(log_dir / "train.tsv", ["loss", "lr", "grad_norm"], tracker, series="train", write=ctx.is_main)
    eval_log = StepLog(log_dir / "eval.tsv", ["loss"], tracker, series="eval", write=ctx.is_main)

    engine.train()
    batches = BatchSampler(len(train_ex), cfg.batch_size, cfg.seed)   # the same global batches on every rank
    state = SupervisedState("sft", log_dir / "checkpoint", resume_fingerprint, engine, batches,
                            {"train": train_log, "eval": eval_log}, ctx)
    start = state.load()
    for step in tqdm(range(start + 1, steps + 1), desc="sft", initial=start, total=steps,
                     disable=not (progress and ctx.is_main), mininterval=1.0):
        examples = [train_ex[i] for i in next(batches)]
        n_tokens = sum(map(response_token_count, examples))      # of the global batch
        loss_sum = 0.0
        mine = ctx.shard(examples)
        for first in range(0, len(mine), micro):
            loss, _ = ce_sum(engine.forward, to_device(collate_sft(mine[first:first + micro], tok.pad_token_id),
                                                       engine.device))
            loss = loss / n_tokens
            check_finite(f"sft step {step}", "loss", loss.detach())
            engine.backward(loss)
            loss_sum += loss.item()
        lr, grad_norm, _ = engine.step()
        check_finite(f"sft step {step}", "gradient norm", grad_norm)
        train_log.log(step, {"loss": float(ctx.sum(torch.tensor(loss_sum, dtype=torch.float64))),
                             "lr": lr, "grad_norm": grad_norm})
        if step % cfg.eval_every == 0 or step == steps:
            eval_log.log(step, {"loss": eval_loss(engine.forward, eval_ex, tok.pad_token_id, 2 * cfg.batch_size,
                                                  ctx, engine.device)})
            train_log.flush()
            eval_log.flush()
        if step % cfg.save_every == 0 or step == steps:
            state.save(step)
    train_time = state.elapsed()   # the interrupted runs' time too

    full = engine.full_model()   # collective under ZeRO-3
    if full is None:
        return None, tok, {}
    metrics: dict[str, Any] = {
        "train/loss": train_log.rows[-1]["loss"], "eval/loss": eval_log.rows[-1]["loss"],
        "train/steps": steps, "train/seconds": train_time, "data/truncated": n_trunc, "data/dropped": n_drop,
    }
    model, counts = lora.finish(full, cfg.lora, log_dir)
    metrics.update(counts)
    metrics.update(evaluate_policy(model, tok, params, data_dir))
    return model, tok, metrics


def evaluate_policy(model, tok, params: Params, data_dir: Path) -> dict[str, Any]:
    """Greedy and sampled responses to evaluation prompts, judged next to the demonstrations."""
    cfg, judge = params.sft, inputs.judge(params)
    prompts = inputs.prompts(params, data_dir, "eval")[:cfg.n_eval_generations]
    out: dict[str, Any] = {}
    for tag, greedy in (("greedy", True), ("sampled", False)):
        texts, ended = generate_texts(model, tok, prompts, cfg.sampling, cfg.seed, greedy)
        out.update(judge_responses(prompts, texts, ended, judge, tag))
    if judge is not None:
        demos = inputs.demonstrations(params, data_dir, "eval")
        out["eval/gold_demonstrations"] = sum(judge(r["prompt"], r["response"]) for r in demos) / len(demos)
    return out


def run(params: Params, data_dir: Path, out: Path, progress: bool = True) -> dict[str, Any]:
    """The stage: train, then write model/, metrics.json, config.json and the step logs atomically
    (rank 0 writes; other ranks of a multi-process run return empty metrics)."""
    resolved = {"data": {"task": params.data.task}, "model": to_dict(params.model), "sft": to_dict(params.sft)}
    with distributed.session(params.sft.distributed) as ctx:
        if ctx.is_main:
            out.mkdir(parents=True, exist_ok=True)
            stale_extras(out, params.sft.lora.enabled, ctx.world_size > 1 or params.sft.distributed.backend != "none")
        return _run(params, data_dir, out, progress, resolved, ctx)


def _run(params: Params, data_dir: Path, out: Path, progress: bool, resolved: dict, ctx: Context) -> dict[str, Any]:
    with stage_tracking("sft", resolved, [data_dir], enabled=ctx.is_main) as tracker:
        fp = fingerprint(resolved, input_paths(data_dir, params.sft.dataset.path))
        model, tok, metrics = train(params, data_dir, out, progress, tracker, ctx, fp)
        if model is None:
            return metrics
        with atomic_dir(out / "model") as tmp:
            save_checkpoint(model, tok, tmp)
        atomic_write_json(out / "config.json", resolved)
        write_metrics(out / "metrics.json", metrics, tracker)
        tracker.log_outputs(out)
    return metrics
