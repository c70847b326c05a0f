"""Learning from demonstrations: cross-entropy on the response tokens only (the prompt is context,
not a target), the loss of the sft stage and of the rs stage on its winners, as a supervised task,
and the recipe both stages train by.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from ..data.records import IGNORE, Example, collate_packed, collate_sft, tokenize_demonstrations
from ..models import logprobs, lora
from ..context import SINGLE, Context
from .distributed import to_device
from . import token_batches
from .supervised import Recipe, SupervisedTask


def response_token_count(e: Example) -> int:
    """Response tokens an example is trained on (the targets after the prompt)."""
    return len(e.input_ids) - e.n_prompt


def ce_sum(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, int]:
    """Summed cross-entropy over the response tokens of `batch` (collate_sft's padded rows, or
    collate_packed's one row with its position ids), and their count; above
    logit_chunks.LOGITS_CHUNK_BYTES of logits, the LM head chunk by chunk (pipeline/models/logprobs.py)."""
    labels = batch["labels"][:, 1:]                                                                 # (B, T-1)
    valid = labels != IGNORE                                                                        # (B, T-1)
    inputs: dict[str, Any] = {k: v for k, v in batch.items() if k != "labels"}   # with attention_mask or position_ids
    # No KV cache: a training forward never reads one, and transformers reads packed rows from the
    # position ids only when none is built (masking_utils; else they would attend across examples).
    inputs["use_cache"] = False
    head = logprobs.chunked_head(model, labels.numel())
    if head is None:
        logits = model(**inputs).logits                                                             # (B, T, V)
        loss = F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE,
                               reduction="sum")
        return loss, int(valid.sum())
    with logprobs.hidden_out(head):
        hidden = model(**inputs).logits[:, :-1]                                                     # (B, T-1, H)
    lp, _ = logprobs.chunked_stats(head, hidden.flatten(0, 1), labels.clamp(min=0).flatten(), 1.0)          # (B*(T-1),)
    return -torch.where(valid.flatten(), lp, torch.zeros_like(lp)).sum(), int(valid.sum())


@torch.no_grad()
def eval_loss(model, examples: list[Example], pad_id: int, batch_size: int, ctx: Context = SINGLE,
              device: torch.device | None = None) -> float:
    """Cross-entropy per response token over all held-out examples (token-weighted), every rank
    scoring its share; every rank runs the same number of forwards (ZeRO-3 gathers per forward)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device="cpu")
    for part in ctx.eval_parts(examples, batch_size):
        batch = to_device(collate_sft(part or examples[:1], pad_id), device)
        loss, n = ce_sum(model, batch)
        if part:
            total += torch.tensor([float(loss), n], dtype=torch.float64, device="cpu")
    model.train()
    total = ctx.sum(total)
    return float(total[0] / total[1])


def task(name: str, engine, tok, train_ex: list[Example], eval_ex: list[Example], cfg: Any,
         ctx: Context) -> SupervisedTask:
    """SFT's loss (cross-entropy per response token of the global batch) and held-out loss, on
    `engine` (the sft stage's, and the rs stage's on its winners); with `cfg.packing`, each
    micro-batch's examples in one packed row (collate_packed), none of its tokens padding."""
    def loss(part: list[Example], batch: list[Example]) -> tuple[torch.Tensor, list[float]]:
        n_tokens = sum(map(response_token_count, batch))      # of the global batch
        rows = collate_packed(part) if cfg.packing else collate_sft(part, tok.pad_token_id)
        total, _ = ce_sum(engine.forward, to_device(rows, engine.device))
        value = total / n_tokens
        return value, [value.item()]

    return SupervisedTask(name, train_ex, ["loss"], loss, normaliser=lambda batch: 1.0, eval_columns=["loss"],
                          evaluate=lambda: {"loss": eval_loss(engine.forward, eval_ex, tok.pad_token_id,
                                                              2 * cfg.batch_size, ctx, engine.device)},
                          length=lambda e: len(e.input_ids),
                          forwards=token_batches.packed if cfg.packing else None)


def recipe(stage: str, model, tok, train: tuple[list[dict], Path | str], held_out: tuple[list[dict], Path | str],
           cfg: Any, ctx: Context, measure: Callable[[Any], Any],
           report: Optional[Callable[..., dict[str, Any]]] = None, counts: Optional[dict[str, int]] = None) -> Recipe:
    """The supervised recipe of a stage that learns from demonstrations (sft on its data, rs on its
    winners): the `train` and `held_out` rows (each with the source its errors name) tokenized as
    the stage's section `cfg` says (`max_length`, `overlong`), `model` wrapped by `cfg.lora`, torch
    seeded with `cfg.seed`, the loss of `task`; `measure` and `report` as supervised.Recipe's, and
    the data/* counts: the rows truncated and dropped, then `counts`."""
    train_ex, n_trunc, n_drop = tokenize_demonstrations(train[0], tok, cfg.max_length, train[1], cfg.overlong, stage)
    eval_ex, _, _ = tokenize_demonstrations(held_out[0], tok, cfg.max_length, held_out[1], cfg.overlong, stage)
    model = lora.wrap(model, cfg.lora, "CAUSAL_LM", f"{stage}.lora")
    torch.manual_seed(cfg.seed)
    return Recipe(model, len(train_ex), lambda engine, micro: task(stage, engine, tok, train_ex, eval_ex, cfg, ctx),
                  measure=measure, **({"report": report} if report is not None else {}),
                  counts={"data/truncated": n_trunc, "data/dropped": n_drop, **(counts or {})})
