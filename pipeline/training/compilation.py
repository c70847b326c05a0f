"""`distributed.compile`: each transformer block of a trained model compiled with `torch.compile`
(regional compilation), for the forwards that train and score, not for sampling.

Why blocks and not the whole model: the blocks of a model share one code object, so one compiled
graph serves every layer (PyTorch's regional-compilation recipe): compile time is one block's,
whatever the depth, and the embedding, the head and our chunked log-prob code stay eager. Why
dynamic shapes: every batch has its own length, and a graph per length would recompile without end.

Why not sampling: a decode step carries a KV cache whose length grows every token; compiled, each
new length or cache state is a new guard. A block call given a KV cache (a transformers `Cache`)
therefore runs eager; the training and scoring forwards pass
`use_cache=False` (models/logprobs.py, models/reward_model.py, training/demonstrations.py), so they
carry none and run compiled.

What it changes: compiled kernels fuse the element-wise work (norms, rotary, activations) and
round differently from eager ones, so a compiled run's bits differ from an eager run's (the test
holds losses and gradients within float tolerance), and the first batches pay the compile (seconds
to a minute on a CPU, cached on disk for later processes in torch's inductor cache). Inductor needs
a C++ compiler on a CPU; benchmarks/throughput.py measures what it gains.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer

from ..errors import ConfigError
from ..models import lora


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of `model` (a Hugging Face model, PEFT-wrapped or not, or a reward
    model with a score head): transformers' GradientCheckpointingLayer subclasses (the decoder
    layers of Llama, Qwen2, Mistral, GPT-2 and the rest)."""
    return [m for m in lora.unwrap(model).modules() if isinstance(m, GradientCheckpointingLayer)]


def _dispatch(eager: Callable[..., Any], compiled: Callable[..., Any]) -> Callable[..., Any]:
    def forward(*args: Any, **kwargs: Any) -> Any:
        # A KV cache by type, not by name: Llama passes it as `cache=`, GPT-2 by position.
        if any(isinstance(a, Cache) for a in (*args, *kwargs.values())):
            return eager(*args, **kwargs)                 # sampling with a KV cache: eager (module doc)
        return compiled(*args, **kwargs)
    return forward


def compile_blocks(model: torch.nn.Module) -> int:
    """Compile every transformer block of `model` in place (dynamic shapes); calls with a KV cache
    stay eager. Returns the number of blocks. A model with none is refused: there would be nothing
    to gain and the user asked for it."""
    found = blocks(model)
    if not found:
        name = type(lora.unwrap(model)).__name__
        raise ConfigError(f"distributed.compile: {name} has no transformer blocks that torch.compile "
                          "can take one at a time; set it to false")
    for block in found:
        eager = block.forward
        block.forward = _dispatch(eager, torch.compile(eager, dynamic=True))
    return len(found)
