"""How a stage loads the models it places: in which dtype, and, under ZeRO-3, already partitioned.

- dtype: a trained model is loaded in the dtype its optimizer steps: fp32 for plain PyTorch (bf16
  there is autocast over fp32 weights) and DeepSpeed fp32; the 16-bit dtype under DeepSpeed's
  bf16/fp16, whose engine keeps the fp32 master copy itself. A frozen model is loaded in the dtype
  it computes in: 16-bit under bf16/fp16, fp32 otherwise. So a bf16 checkpoint is never silently
  trained in bf16 by a plain fp32 optimizer, and a 16-bit run never holds an fp32 copy it drops.
- ZeRO-3: `partitioned(...)` keeps transformers' DeepSpeed integration (`HfDeepSpeedConfig`) alive
  while models are built or loaded, so `from_pretrained` / `from_config` construct them under
  `deepspeed.zero.Init`: each rank holds its partition from the start, and a model larger than
  one GPU can be placed at all. Without it every rank would first build the whole model.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from ..config import DistributedConfig
from .distributed import Context, import_deepspeed

SIXTEEN_BIT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def load_dtype(dist: DistributedConfig, trained: bool) -> torch.dtype:
    """The dtype a model is loaded in under `dist` (see the module doc)."""
    half = SIXTEEN_BIT.get(dist.precision)
    if half is None or (trained and dist.backend == "none"):
        return torch.float32
    return half


def zero3(dist: DistributedConfig) -> bool:
    return dist.backend == "deepspeed" and dist.zero_stage == 3


@contextlib.contextmanager
def partitioned(dist: DistributedConfig, ctx: Context) -> Iterator[None]:
    """Models built or loaded inside are partitioned over the ranks as they are built (ZeRO-3;
    nothing changes otherwise). transformers reads the DeepSpeed config through a weak reference
    to the `HfDeepSpeedConfig` object: this context keeps it alive. Of that config only the ZeRO
    section and the precision matter here (the engines get their own full config)."""
    if not zero3(dist):
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    from .engines import deepspeed_config
    import_deepspeed()
    keep = HfDeepSpeedConfig(deepspeed_config(dist, world_size=ctx.world_size, micro_batch_size=1,
                                              accumulation_steps=1, max_grad_norm=None, train=False))
    try:
        yield
    finally:
        del keep


def is_partitioned(model: torch.nn.Module) -> bool:
    """Whether ZeRO-3 partitioned `model`'s parameters (each rank holds a slice)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())
