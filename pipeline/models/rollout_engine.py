"""One interface for everything that samples responses: PPO's and GRPO's rollouts and every
measurement (pipeline/measurement/policy.py). Token-id prompts go in; responses, the log-probs of
their tokens and their end flags come out (`generation.Sampled`).

An engine is asked with a `Request`: the prompts, the ids that end a response, the stage's
`SamplingConfig`, and where the random numbers come from, either one seed per row (a measurement:
a prompt's response depends on its own seed only) or one stream for every row (a rollout: each rank
its own stream). `TorchSampler`, our own KV-cache loop (generation.sample), is the default engine:
it samples the trainer's model itself, is bit-reproducible and is what the CPU runs use. A fast
engine with weights of its own (pipeline/models/vllm_engine.py) loads the trainer's weights when it
is asked to generate, so the caller's code is the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from ..config import SamplingConfig
from ..data.padding import micro_batches
from ..devices import generator
from .generation import Sampled, concat, sample


@dataclass(frozen=True)
class Request:
    """What a stage asks an engine for: one response per prompt."""
    prompts: list[list[int]]            # B prompts as token ids, unpadded
    pad_id: int
    stop_ids: tuple[int, ...]           # a response ends at the first of these (kept as its last token)
    sampling: SamplingConfig
    greedy: bool = False
    seeds: Sequence[int] | None = None  # B seeds: each row its own stream (measurement)
    stream: torch.Generator | None = None   # or one stream for every row (rollouts)
    # Our sampler's memory and speed (an engine with its own scheduler ignores them): at most this
    # many prompts per sampling call (0: all at once), so long responses' KV cache fits; or calls
    # cut by a token budget instead (`max_tokens`: `sampling_calls`); ended rows leave the batch. Each
    # changes the bits of a `stream` request (see generation.sample).
    micro_batch: int = 0
    max_tokens: int | None = None
    drop_finished: bool = False


class RolloutEngine(Protocol):
    """Samples `request` from `model`'s current weights (the trainer's whole model: gathered under
    ZeRO-3, its LoRA adapters active)."""
    name: str

    def generate(self, model: torch.nn.Module, request: Request) -> Sampled: ...


class TorchSampler:
    """Our own sampler (generation.sample) on the model itself: nothing to load or free."""
    name = "torch"

    def generate(self, model: torch.nn.Module, request: Request) -> Sampled:
        rows = None
        if request.seeds is not None and not request.greedy:
            device = next(model.parameters()).device
            rows = [generator(device, s) for s in request.seeds]
        calls = sampling_calls(request)
        parts = [sample(model, [request.prompts[i] for i in call], request.pad_id, request.stop_ids,
                        request.sampling, generator=request.stream, greedy=request.greedy,
                        row_generators=None if rows is None else [rows[i] for i in call],
                        drop_finished=request.drop_finished)
                 for call in calls]
        merged = concat(parts, request.pad_id)
        order = [i for call in calls for i in call]
        if order == sorted(order):
            return merged
        back = torch.empty(len(order), dtype=torch.long, device="cpu")
        back[torch.tensor(order, device="cpu")] = torch.arange(len(order), device="cpu")   # merged row of each prompt
        return merged.rows(back.to(merged.prompt_ids.device))


def sampling_calls(request: Request) -> list[list[int]]:
    """Indices of `request.prompts` of each sampling call, in the order they run. By a token budget
    (`max_tokens`): the prompts longest first, a call closed when one more would make its rows x
    (longest prompt + max_new_tokens) exceed the budget (a prompt longer than the budget alone): the
    cut of training's micro-batches by tokens (data/padding.py's `micro_batches`), so its KV cache
    and logits are bounded whatever the prompts' lengths. Else consecutive runs of `micro_batch` (0: one
    call)."""
    # Longest first (ties in input order), so a call's first prompt is its longest: one more row
    # costs that prompt's length + max_new_tokens.
    cost = [len(p) + request.sampling.max_new_tokens for p in request.prompts]
    return micro_batches(cost, request.micro_batch or max(len(cost), 1), request.max_tokens)


TORCH = TorchSampler()
