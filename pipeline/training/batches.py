"""Pieces every training stage shares: the number of steps and the shuffled global batches."""

from __future__ import annotations

import math
import torch


def total_steps(n_examples: int, batch_size: int, epochs: float) -> int:
    return max(1, round(math.ceil(n_examples / batch_size) * epochs))


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
            self.order += torch.randperm(self.n, generator=self.gen, device="cpu").tolist()
        batch, self.order = self.order[:self.batch_size], self.order[self.batch_size:]
        return batch

    def state_dict(self) -> dict:
        return {"gen": self.gen.get_state(), "order": list(self.order), "n": self.n}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n:
            raise ValueError(f"sampler state is for {state['n']} examples, this data has {self.n}")
        self.gen.set_state(state["gen"])
        self.order = list(state["order"])
