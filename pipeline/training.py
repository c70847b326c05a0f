"""Pieces every training stage shares: optimizer and schedule, shuffled batches, one update step."""

from __future__ import annotations

import math
from typing import Iterable

import torch
from transformers import get_cosine_schedule_with_warmup


def total_steps(n_examples: int, batch_size: int, epochs: float) -> int:
    return max(1, round(math.ceil(n_examples / batch_size) * epochs))


def adamw_with_schedule(parameters: Iterable[torch.nn.Parameter], lr: float, weight_decay: float,
                        warmup_ratio: float, steps: int):
    """AdamW with linear warmup then cosine decay to 0 over `steps` optimizer steps."""
    opt = torch.optim.AdamW(list(parameters), lr=lr, weight_decay=weight_decay)
    return opt, get_cosine_schedule_with_warmup(opt, round(warmup_ratio * steps), steps)


class BatchSampler:
    """Endless index batches: each epoch a fresh seeded permutation; a batch may span two epochs.

    Its whole state (generator and the rest of the current permutation) is a `state_dict`, so a
    resumed run draws exactly the batches the uninterrupted run would have drawn.
    """

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size = n, batch_size
        self.gen = torch.Generator().manual_seed(seed)
        self.order: list[int] = []

    def __iter__(self) -> "BatchSampler":
        return self

    def __next__(self) -> list[int]:
        while len(self.order) < self.batch_size:
            self.order += torch.randperm(self.n, generator=self.gen).tolist()
        batch, self.order = self.order[:self.batch_size], self.order[self.batch_size:]
        return batch

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "order": list(self.order), "n": self.n}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n:
            raise ValueError(f"sampler state is for {state['n']} examples, this data has {self.n}")
        self.gen.set_state(state["gen"])
        self.order = list(state["order"])


def update(model: torch.nn.Module, loss: torch.Tensor, opt, sched, max_grad_norm: float) -> tuple[float, float]:
    """Backward, clip, step; returns (learning rate used, gradient norm before clipping)."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm))
    lr = sched.get_last_lr()[0]
    opt.step()
    sched.step()
    return lr, grad_norm
