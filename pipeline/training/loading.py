"""How a stage loads the models it places: in which dtype, and, under ZeRO-3, already partitioned.

- dtype, whatever dtype the checkpoint was saved in (a hub model's is bf16 almost always): a trained
  model is loaded in the dtype its optimizer steps: fp32 for plain PyTorch (bf16 there is autocast
  over fp32 weights) and DeepSpeed fp32; the 16-bit dtype under DeepSpeed's bf16/fp16, whose engine
  keeps the fp32 master copy (and fp32 optimizer states) itself. A frozen model is loaded as the
  trained ones compute: in the 16-bit dtype under DeepSpeed's bf16/fp16; fp32 under plain PyTorch,
  where the same autocast that runs the actor runs the reference and reward models, so the
  reference is the actor's own function before the first update (KL and ratio exactly 0 and 1).
  So a bf16 checkpoint is never trained as bf16 weights by an fp32 optimizer (AdamW's updates at a
  hub learning rate fall below half a bf16 ulp and are lost), and a 16-bit run never holds an fp32
  copy it drops. Every stage loads through `load_dtype`; config.json records `dtypes(...)`.
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
from ..context import Context
from .distributed import import_deepspeed

SIXTEEN_BIT = {"bf16": torch.bfloat16, "fp16": torch.float16}


def load_dtype(dist: DistributedConfig, trained: bool) -> torch.dtype:
    """The dtype a model is loaded in under `dist` (see the module doc). `trained` is kept in the
    signature because the two roles are distinct decisions, even where they agree today."""
    half = SIXTEEN_BIT.get(dist.precision)
    if half is None or dist.backend == "none":
        return torch.float32
    return half


def dtypes(dist: DistributedConfig) -> dict[str, str]:
    """What a trained model's numbers are under `dist`: the weights the optimizer updates (its
    master copy), the optimizer's states and the forwards' compute dtype (config.json's `dtypes`)."""
    return {"weights": "float32", "optimizer_states": "float32",
            "compute": str(SIXTEEN_BIT.get(dist.precision, torch.float32)).removeprefix("torch.")}


def zero3(dist: DistributedConfig) -> bool:
    return dist.backend == "deepspeed" and dist.zero_stage == 3


@contextlib.contextmanager
def partitioned(dist: DistributedConfig, ctx: Context, trained: bool = True) -> Iterator[None]:
    """Models built or loaded inside are partitioned over the ranks as they are built (ZeRO-3;
    nothing changes otherwise). transformers reads the DeepSpeed config through a weak reference
    to the `HfDeepSpeedConfig` object: this context keeps it alive. Of that config only the ZeRO
    section and the precision matter here (the engines get their own full config). `trained`:
    the role of the models built inside, whose engine config they are built under: the partitions
    of frozen models stay on the CPU with `offload_frozen`, a trained model's only with
    `offload_param` (its engine's own setting)."""
    if not zero3(dist):
        yield
        return
    from transformers.integrations import HfDeepSpeedConfig

    from .engines import deepspeed_config
    import_deepspeed()
    # lr: only the optimizer section (with offload_optimizer) needs one, and zero.Init reads none of it.
    keep = HfDeepSpeedConfig(deepspeed_config(dist, world_size=ctx.world_size, micro_batch_size=1,
                                              accumulation_steps=1, max_grad_norm=None, lr=1.0, train=trained))
    try:
        yield
    finally:
        del keep


def is_partitioned(model: torch.nn.Module) -> bool:
    """Whether ZeRO-3 partitioned `model`'s parameters (each rank holds a slice)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


class Loaded:
    """A model as loaded, before an engine holds it, for code that asks its holder for the model
    whole (measurement/policy.py `whole`): loaded partitioned (ZeRO-3), it is gathered onto every
    rank meanwhile, so each rank may run forwards alone (its share of a measurement's prompts);
    otherwise it is the model itself."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @contextlib.contextmanager
    def gathered(self) -> Iterator[torch.nn.Module]:
        if not is_partitioned(self.model):
            yield self.model
            return
        deepspeed = import_deepspeed()
        with deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None):
            yield self.model
