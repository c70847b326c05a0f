"""Pieces every training stage shares: optimizer and schedule, shuffled batches, one update step."""

from __future__ import annotations

import math
from typing import Iterable, Iterator

import torch
from transformers import get_cosine_schedule_with_warmup


def total_steps(n_examples: int, batch_size: int, epochs: float) -> int:
    return max(1, round(math.ceil(n_examples / batch_size) * epochs))


def adamw_with_schedule(parameters: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
                        warmup_ratio: float, steps: int):
    """AdamW with linear warmup then cosine decay to 0 over `steps` optimizer steps."""
    opt = torch.optim.AdamW(list(parameters), lr=lr, weight_decay=weight_decay)
    return opt, get_cosine_schedule_with_warmup(opt, round(warmup_ratio * steps), steps)


def shuffled_batches(n: int, batch_size: int, seed: int) -> Iterator[list[int]]:
    """Endless index batches: each epoch a fresh seeded permutation; a batch may span two epochs."""
    gen = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while True:
        while len(order) < batch_size:
            order += torch.randperm(n, generator=gen).tolist()
        yield order[:batch_size]
        order = order[batch_size:]


def update(model: torch.nn.Module, loss: torch.Tensor, opt, sched, max_grad_norm: float) -> tuple[float, float]:
    """Backward, clip, step; returns (learning rate used, gradient norm before clipping)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    lr = sched.get_last_lr()[0]
    opt.step()
    sched.step()
    return lr, grad_norm
