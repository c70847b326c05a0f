"""Training and inference engines: where a model's weights live and how one optimizer step happens.

Every training loop (SFT, RM, PPO's actor and critic) talks to a `TrainEngine`:

    loss = <sum over this micro-batch> / <size of the global batch>
    engine.backward(loss)          # once per micro-batch: gradients only, never an update
    result = engine.step()         # once per global batch: the update; StepResult(lr, grad_norm, skipped)

so the *same* loop runs as plain PyTorch in one process (`TorchEngine`) or through
`deepspeed.initialize` in N processes (`DeepSpeedEngine`). The two are siblings of `TrainEngine`,
which holds what both share (the model, the forward, the mode, the schedule's learning rate) and
names what each implements (backward, step, gathered, full_model, save, load), with one meaning
per method; callers use `forward` for training forwards, `model` where they need the Hugging Face
model's structure (its trunk and head), `train()`/`eval()` for the mode, and never the optimizer
or the schedule. Ranks come from the distributed `Context` the engine was built with; what PEFT
adapters need lives in lora.py. Why DeepSpeed directly rather than
through accelerate: PPO holds four models with different roles (two trained engines, two frozen
ones that ZeRO-3 must partition too) and must switch ZeRO-3's parameter hooks off for generation;
accelerate's DeepSpeed plugin is built around one model per config and hides the engine we need.

Loss scaling: DeepSpeed averages gradients over the data-parallel ranks and (by default) divides
each micro-batch loss by its accumulation steps. Our losses are already normalised by the global
batch, so `DeepSpeedEngine.backward` multiplies by the world size and turns the division off: the
summed gradient is then exactly the gradient one process computes on the whole global batch.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Optional

import torch

from ..models import lora
from ..config import DistributedConfig
from ..context import Context
from . import compilation
from .distributed import import_deepspeed
from ..errors import ConfigError

# Optimizer types DeepSpeed builds itself (needed for optimizer offload: its CPU Adam runs the step).
DS_ADAMW = "AdamW"


def deepspeed_config(dist: DistributedConfig, *, world_size: int, micro_batch_size: int,
                     accumulation_steps: int, max_grad_norm: float | None,
                     lr: float | None = None, weight_decay: float = 0.0, train: bool = True) -> dict[str, Any]:
    """The DeepSpeed JSON config for one engine, generated from the `distributed` params.

    `micro_batch_size` x `accumulation_steps` x `world_size` is the global batch of one optimizer
    step. With optimizer offload the optimizer is declared here (DeepSpeed's CPU Adam); otherwise
    our own torch AdamW is handed to `deepspeed.initialize`.
    """
    zero: dict[str, Any] = {"stage": dist.zero_stage}
    if dist.zero_stage == 3:
        # Small models: gather whole layers at once; partition only what is worth it.
        zero.update({"stage3_param_persistence_threshold": 1e4, "stage3_prefetch_bucket_size": 5e7,
                     "stage3_gather_16bit_weights_on_model_save": True})
    if train and dist.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    if dist.offload_param or (not train and dist.offload_frozen and dist.zero_stage == 3):
        zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": accumulation_steps,
        "train_batch_size": micro_batch_size * accumulation_steps * world_size,
        "zero_optimization": zero,
        "bf16": {"enabled": dist.precision == "bf16"},
        "fp16": {"enabled": dist.precision == "fp16", "initial_scale_power": 16},
        "steps_per_print": 10 ** 9,          # we log ourselves
        "wall_clock_breakdown": False,
    }
    if train and max_grad_norm is not None:
        cfg["gradient_clipping"] = max_grad_norm
    if train and dist.offload_optimizer:
        assert lr is not None
        cfg["optimizer"] = {"type": DS_ADAMW, "params": {"lr": lr, "weight_decay": weight_decay,
                                                         "betas": [0.9, 0.999], "eps": 1e-8}}
    return cfg


def validate_deepspeed_config(cfg: dict[str, Any], world_size: int) -> None:
    """Check a generated config before any engine is built: the batch arithmetic for `world_size`
    ranks here, then DeepSpeed's own parser and its pydantic ZeRO model (which reject unknown or
    ill-typed values). Raises ConfigError naming what is wrong."""
    import_deepspeed()
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    def invalid(why: object) -> ConfigError:
        return ConfigError(f"distributed: the generated DeepSpeed config is invalid: {why}")

    micro, acc = cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"]
    if cfg["train_batch_size"] != micro * acc * world_size:
        raise invalid(f"train_batch_size {cfg['train_batch_size']} != micro batch {micro} x accumulation {acc} "
                      f"x {world_size} processes")
    if cfg["bf16"]["enabled"] and cfg["fp16"]["enabled"]:
        raise invalid("bf16 and fp16 together")
    # DeepSpeed's parser reads the world size from the process group; without one it assumes 1,
    # so it is then shown the per-process view of the same config.
    import torch.distributed as tdist
    local = json.loads(json.dumps(cfg))
    if not (tdist.is_available() and tdist.is_initialized()):
        local["train_batch_size"] = micro * acc
    try:
        DeepSpeedZeroConfig(**cfg["zero_optimization"])
        DeepSpeedConfig(local)
    except (AssertionError, ValueError, KeyError, TypeError) as err:
        raise invalid(err) from None


class StepResult(NamedTuple):
    """What one `TrainEngine.step` did."""
    lr: float          # the learning rate the update used (before the schedule advanced)
    grad_norm: float   # global gradient norm before clipping
    skipped: bool      # no update was applied (a non-finite gradient; fp16: a loss-scale overflow)


class TrainEngine:
    """What every training loop calls (module doc). `model`: the Hugging Face model (its structure,
    its weights on this rank); `forward`: what training forwards call; `params`: the trained
    parameters. Built by its two implementations, `TorchEngine` and `DeepSpeedEngine`."""

    def __init__(self, model: torch.nn.Module, forward: Callable[..., Any], params: list[torch.nn.Parameter],
                 optimizer: Any, scheduler: Any):
        self.model, self.forward, self.params = model, forward, params
        self._optimizer, self._scheduler = optimizer, scheduler

    def autocast(self) -> contextlib.AbstractContextManager:
        """The forward's precision context (none unless an implementation says otherwise)."""
        return contextlib.nullcontext()

    def train(self) -> None:
        self.model.train()

    def eval(self) -> None:
        """Dropout off; gradients still flow (PPO trains in eval mode so the first ratio is 1)."""
        self.model.eval()

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """Training forwards made in eval mode (PPO's update) with gradient checkpointing on: the
        checkpointed layers alone are flagged as training, which is what Hugging Face's checkpointing
        looks at, while every dropout stays off (their modules keep eval mode)."""
        layers = [m for m in self.model.modules() if getattr(m, "gradient_checkpointing", False)]
        flagged = [m for m in layers if not m.training]
        for m in flagged:
            m.training = True
        try:
            yield
        finally:
            for m in flagged:
                m.training = False

    @property
    def lr(self) -> float:
        """The learning rate the next `step` will use."""
        return self._scheduler.get_last_lr()[0]

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def backward(self, loss: torch.Tensor, boundary: bool | None = None) -> None:
        """Add this micro-batch's gradients; no update. `boundary`: whether it is the global batch's
        last micro-batch, where their number varies from step to step (a token budget); None: a
        fixed number (DeepSpeed's gradient_accumulation_steps)."""
        raise NotImplementedError

    def step(self) -> StepResult:
        """Clip, update, advance the schedule, clear the gradients (once per global batch)."""
        raise NotImplementedError

    @contextlib.contextmanager
    def gathered(self) -> Iterator[torch.nn.Module]:
        """The whole model for generation."""
        raise NotImplementedError
        yield

    def full_model(self) -> torch.nn.Module | None:
        """Collective: the whole model on rank 0 (None on the others), in the dtype it trained in."""
        raise NotImplementedError

    def save(self, folder: Path, name: str) -> None:
        """Write the resumable state (weights, optimizer, schedule) under `folder` as `name`."""
        raise NotImplementedError

    def load(self, folder: Path, name: str) -> None:
        raise NotImplementedError


class TorchEngine(TrainEngine):
    """Plain PyTorch: AdamW, a schedule, gradient clipping, gradient accumulation by summation.
    With `precision: bf16` the weights and AdamW stay fp32 and the forwards run under bf16 autocast
    (`autocast`), the usual mixed precision without DeepSpeed."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float,
                 schedule: Callable[[int], float], max_grad_norm: float, precision: str = "fp32"):
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        super().__init__(model, model, params, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule))
        self.max_grad_norm = max_grad_norm
        self.precision = precision

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast over fp32 weights when asked for; nothing in fp32."""
        if self.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, boundary: bool | None = None) -> None:
        """Add this micro-batch's gradients; no update (the step decides the boundary here)."""
        loss.backward()

    def step(self) -> StepResult:
        """Clip, update, advance the schedule, clear the gradients."""
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))
        lr = self.lr
        skipped = not math.isfinite(norm)   # a NaN/inf gradient never reaches the weights (the caller reports it)
        if not skipped:
            self._optimizer.step()
            self._scheduler.step()
        self._optimizer.zero_grad(set_to_none=True)
        return StepResult(lr, norm, skipped)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[torch.nn.Module]:
        """The whole model for generation (already whole in one process)."""
        yield self.model

    def full_model(self) -> torch.nn.Module | None:
        """The whole model, in the dtype it trained in."""
        return self.model

    # Resumable state: weights (safetensors), optimizer and schedule (tensors and numbers only).
    def save(self, folder: Path, name: str) -> None:
        from safetensors.torch import save_model
        save_model(self.model, str(folder / f"{name}.safetensors"))
        torch.save({"opt": self._optimizer.state_dict(), "sched": self._scheduler.state_dict()},
                   folder / f"{name}_optim.pt")

    def load(self, folder: Path, name: str) -> None:
        from safetensors.torch import load_model
        load_model(self.model, str(folder / f"{name}.safetensors"))
        state = torch.load(folder / f"{name}_optim.pt", weights_only=True)
        self._optimizer.load_state_dict(state["opt"])
        self._scheduler.load_state_dict(state["sched"])


class SkippingAdamW(torch.optim.AdamW):
    """AdamW that applies no update when a gradient is not finite and says so in `overflow`, the
    attribute DeepSpeed's engine reads after `optimizer.step()` to count a skipped step and hold the
    learning-rate schedule (as for its own fp16 and ZeRO optimizers). At DeepSpeed's update the
    gradients are already summed over ranks, so every rank skips alike."""

    overflow = False

    @torch.no_grad()
    def step(self, closure=None):
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        self.overflow = bool(grads) and not bool(torch.isfinite(torch.nn.utils.get_total_norm(grads)))
        if self.overflow:
            return None
        return super().step(closure)


class DeepSpeedEngine(TrainEngine):
    """A `deepspeed.initialize` engine behind the same three calls."""

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float,
                 schedule: Callable[[int], float], max_grad_norm: float, dist: DistributedConfig,
                 ctx: Context, micro_batch_size: int, accumulation_steps: int):
        deepspeed = import_deepspeed()

        self.ds_config = deepspeed_config(dist, world_size=ctx.world_size, micro_batch_size=micro_batch_size,
                                          accumulation_steps=accumulation_steps, max_grad_norm=max_grad_norm,
                                          lr=lr, weight_decay=weight_decay)
        validate_deepspeed_config(self.ds_config, ctx.world_size)
        self.ctx = ctx
        params = [p for p in model.parameters() if p.requires_grad]

        def scheduler(optimizer):   # DeepSpeed steps it at each accumulation boundary
            return torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)

        # With optimizer offload the optimizer comes from the config (DeepSpeed's CPU Adam);
        # otherwise it is our torch AdamW. ZeRO-1..3 and the bf16 optimizer skip an update whose
        # gradient norm is not finite; ZeRO-0 in fp32 hands the gradients to this optimizer as they
        # are, so it skips them itself (SkippingAdamW).
        plain = dist.zero_stage == 0 and dist.precision == "fp32"
        optimizer = (None if dist.offload_optimizer else
                     (SkippingAdamW if plain else torch.optim.AdamW)(params, lr=lr, weight_decay=weight_decay))
        self.engine, ds_optimizer, _, ds_scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, model_parameters=params if optimizer is None else None,
            lr_scheduler=scheduler, config=self.ds_config)
        super().__init__(self.engine.module, self.engine, params, ds_optimizer, ds_scheduler)
        self._complete = False   # the last backward completed a global batch

    def backward(self, loss: torch.Tensor, boundary: bool | None = None) -> None:
        """Add this micro-batch's gradients (reduced over ranks at the accumulation boundary); no update.
        DeepSpeed counts micro-batches in its own `step`, a no-op before the boundary: it is called
        here for every micro-batch but the last, whose `step` is ours. A `boundary` given overrides
        DeepSpeed's count (set_gradient_accumulation_boundary) for this micro-batch."""
        if boundary is not None:
            self.engine.set_gradient_accumulation_boundary(boundary)
        self.engine.backward(loss * self.ctx.world_size, scale_wrt_gas=False)
        self._complete = self.engine.is_gradient_accumulation_boundary()
        if not self._complete:
            self.engine.step()

    def step(self) -> StepResult:
        """Clip, update, advance the schedule (DeepSpeed's step at the accumulation boundary)."""
        if not self._complete:
            raise RuntimeError("TrainEngine.step() before the last micro-batch of the global batch")
        self._complete = False
        lr, skipped_before = self.lr, self.engine.skipped_steps
        # ZeRO-0 in fp32 clips with torch's clip_grad_norm_ and keeps no norm (get_global_grad_norm
        # stays None), so measure it here: the gradients are already all-reduced at the boundary,
        # the same on every rank, and this is the norm DeepSpeed clips with.
        own = self._unreported_norm()
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else own
        return StepResult(lr, norm, self.engine.skipped_steps > skipped_before or not math.isfinite(norm))

    def _unreported_norm(self) -> float:
        """The gradients' global L2 norm where DeepSpeed will not report it (ZeRO-0 without fp16/bf16
        optimizer wrappers); NaN elsewhere, where the engine's own norm is used."""
        if self.engine.zero_optimization_stage() != 0 or self.engine.fp16_enabled() or self.engine.bfloat16_enabled():
            return float("nan")
        grads = [p.grad for p in self.params if p.grad is not None]
        return float(torch.nn.utils.get_total_norm(grads)) if grads else float("nan")

    @property
    def zero3(self) -> bool:
        return self.engine.zero_optimization_stage() == 3

    @contextlib.contextmanager
    def gathered(self) -> Iterator[torch.nn.Module]:
        """ZeRO-3: gather the parameters once and switch the per-module hooks off for generation
        (otherwise every generated token would all-gather every layer again)."""
        with zero3_whole(self.engine if self.zero3 else None, self.model) as model:
            yield model

    def full_model(self) -> torch.nn.Module | None:
        """Collective: the whole model on rank 0 (None on the other ranks), in the dtype it trained
        in (DeepSpeed's 16-bit weights under bf16/fp16, as its own 16-bit checkpoints hold them).
        Below ZeRO-3 every rank holds all weights already; under ZeRO-3 they are gathered into a
        fresh copy on the CPU."""
        deepspeed = import_deepspeed()

        if not self.zero3:
            return self.model if self.ctx.is_main else None
        state = None
        dtype = next(self.model.parameters()).dtype
        with deepspeed.zero.GatheredParameters(list(self.model.parameters()), modifier_rank=None):
            if self.ctx.is_main:
                state = {k: v.detach().to("cpu").clone() for k, v in self.model.state_dict().items()}
        if not self.ctx.is_main:
            return None
        plain = lora.fresh_copy(self.model)
        plain.load_state_dict(state)
        return plain.to(dtype)

    def save(self, folder: Path, name: str) -> None:
        # Every rank writes its own shard of weights, optimizer and schedule state.
        self.engine.save_checkpoint(str(folder), tag=name)

    def load(self, folder: Path, name: str) -> None:
        path, _ = self.engine.load_checkpoint(str(folder), tag=name)
        if path is None:
            raise FileNotFoundError(f"{folder / name}: no DeepSpeed checkpoint")


class FrozenModel:
    """Reference or reward model: inference only. Partitioned with ZeRO-3 when training is stage 3
    (every rank holds a slice; `offload_frozen` keeps the slices on the CPU, DeepSpeed fetching
    them per forward), otherwise replicated on this rank's device, in the dtype it was loaded in
    (pipeline/training/loading.py: 16-bit under DeepSpeed's mixed precision, fp32 under plain
    PyTorch's autocast)."""

    def __init__(self, model: torch.nn.Module, dist: DistributedConfig, ctx: Context, micro_batch_size: int):
        model.eval().requires_grad_(False)
        self.engine = None
        self.ds_config: dict[str, Any] | None = None
        if dist.backend == "deepspeed" and dist.zero_stage == 3:
            deepspeed = import_deepspeed()
            self.ds_config = deepspeed_config(dist, world_size=ctx.world_size, micro_batch_size=micro_batch_size,
                                              accumulation_steps=1, max_grad_norm=None, train=False)
            self.engine, *_ = deepspeed.initialize(model=model, config=self.ds_config)
            self.model = self.engine.module
        else:
            # Moved, never cast: it was loaded in the loading rule's dtype, and `Module.to(dtype)`
            # would also round fp32 buffers (RoPE's inverse frequencies) that the trained model
            # keeps, so the reference would no longer be the actor's function (KL 1e-3 at iteration 0).
            self.model = model.to(ctx.device)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[torch.nn.Module]:
        """The whole model on this rank (ZeRO-3: gathered once, its per-module hooks off), so that
        forwards made by one rank alone (a measurement's share of prompts) are no collectives."""
        with zero3_whole(self.engine, self.model) as model:   # an engine here is a ZeRO-3 one
            yield model


@contextlib.contextmanager
def zero3_whole(engine: Any, model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """`model`, a ZeRO-3 `engine`'s module, gathered whole and free of ZeRO-3's hooks meanwhile, so
    each rank may run forwards alone, as many as it needs (a rollout that ends early, a measurement's
    share of prompts); with no engine (None: no ZeRO-3), `model` as it is. DeepSpeed's
    `unwrap_model_for_generation` removes the per-module hooks but keeps the root's start-of-forward
    hook, whose step reset checks the trace against the other ranks (a collective): it is taken off
    here too and put back first in line."""
    if engine is None:
        yield model
        return
    from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    hooks, key = offload.module._forward_pre_hooks, offload.fwd_pre_hook.id
    start = hooks.pop(key, None)
    try:
        with unwrap_model_for_generation(engine):
            yield model
    finally:
        if start is not None:
            hooks[key] = start
            hooks.move_to_end(key, last=False)


def make_engine(model: torch.nn.Module, *, lr: float, weight_decay: float, schedule: Callable[[int], float],
                max_grad_norm: float, dist: DistributedConfig, ctx: Context, micro_batch_size: int,
                accumulation_steps: int) -> TrainEngine:
    if dist.gradient_checkpointing:
        enable_checkpointing(model)
    if dist.compile:
        compilation.compile_blocks(model)
    if dist.backend == "none":
        return TorchEngine(model.to(ctx.device), lr, weight_decay, schedule, max_grad_norm, dist.precision)
    return DeepSpeedEngine(model, lr, weight_decay, schedule, max_grad_norm, dist, ctx, micro_batch_size,
                           accumulation_steps)


def enable_checkpointing(model: torch.nn.Module) -> None:
    """Hugging Face's gradient checkpointing on every layer of `model` (a PEFT wrapper passes it to
    its base model). Non-reentrant: it needs no input that requires grad, so frozen embeddings
    under LoRA are fine, and it keeps the RNG state (PyTorch's recommended variant)."""
    hf = lora.unwrap(model)
    if not getattr(hf, "supports_gradient_checkpointing", False):
        raise ConfigError(f"distributed.gradient_checkpointing: {type(hf).__name__} does not support it; set it to false")
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def supervised_engine(model: torch.nn.Module, cfg: Any, steps: int, ctx: Context) -> tuple[TrainEngine, int]:
    """The engine of a supervised stage (SFT, RM) from its section (`lr`, `weight_decay`,
    `warmup_ratio`, `max_grad_norm`, `batch_size`, `distributed`): warmup then cosine over `steps`.
    Returns it with the micro-batch size per process (global batch / processes / accumulation)."""
    dist = cfg.distributed
    micro = cfg.batch_size // (ctx.world_size * dist.gradient_accumulation_steps)
    engine = make_engine(model, lr=cfg.lr, weight_decay=cfg.weight_decay,
                         schedule=warmup_cosine(round(cfg.warmup_ratio * steps), steps),
                         max_grad_norm=cfg.max_grad_norm, dist=dist, ctx=ctx, micro_batch_size=micro,
                         accumulation_steps=dist.gradient_accumulation_steps)
    return engine, micro


def warmup_cosine(warmup_steps: int, total: int) -> Callable[[int], float]:
    """Linear warmup then cosine decay to 0 (the multiplier of the peak learning rate)."""
    def f(step: int) -> float:
        if step < warmup_steps:
            return step / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total - warmup_steps)
        return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    return f


def write_deepspeed_config(path: Path, **engines: Any) -> Optional[dict]:
    """Save the generated DeepSpeed config(s) next to the outputs: the config itself for one engine,
    `{name: config}` for several (PPO). Nothing is written for plain PyTorch engines."""
    configs = {name: getattr(e, "ds_config", None) for name, e in engines.items()}
    if all(c is None for c in configs.values()):
        return None
    from ..files import atomic_write_json
    out = next(iter(configs.values())) if len(configs) == 1 else configs
    atomic_write_json(path, out)
    return out
