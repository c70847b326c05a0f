"""LoRA adapters through PEFT: wrap a model for training, save the adapter, export a merged model.

With `lora.r > 0` a stage trains low-rank adapters (Hu et al. 2021) on the chosen linear layers and
keeps the base weights frozen. Outputs stay plain HF checkpoints: the adapter is saved with PEFT
in `adapter/` and merged into the base for `model/`, so later stages and users load `model/` with
`from_pretrained` and never need PEFT.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from ..config import LoraConfig
from ..errors import ConfigError, shown
from ..files import atomic_dir


def targets(cfg: LoraConfig) -> str | list[str]:
    if cfg.target_modules == "all-linear":
        return "all-linear"
    return [m.strip() for m in cfg.target_modules.split(",") if m.strip()]


def wrap(model: torch.nn.Module, cfg: LoraConfig, task_type: str, key: str) -> torch.nn.Module:
    """`model` with fresh adapters (B = 0, so its outputs are unchanged); identity when r = 0.

    task_type "SEQ_CLS" also trains the scalar `score` head in full (PEFT's modules_to_save):
    a reward model or critic head is new and small. `key` names the section's LoRA settings
    (`sft.lora`) for the error when `target_modules` names no layer of the model."""
    if not cfg.enabled:
        return model
    from peft import LoraConfig as PeftLora, get_peft_model

    wanted = targets(cfg)
    if wanted != "all-linear":
        # PEFT matches a target against the last part of a module's name; the layers with a weight
        # matrix (Linear, GPT-2's Conv1D, embeddings) are what a user may mean.
        names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
        layers = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                         if getattr(getattr(m, "weight", None), "ndim", 0) == 2})
        if not set(wanted) & names:
            raise ConfigError(f"{key}.target_modules: {shown(cfg.target_modules)} names no layer of this model "
                              f"(its layers with weights: {', '.join(layers)}; or all-linear)")
    peft_cfg = PeftLora(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, target_modules=wanted,
                        task_type=task_type, modules_to_save=["score"] if task_type == "SEQ_CLS" else None)
    try:
        return get_peft_model(model, peft_cfg)
    except ValueError as err:   # e.g. a target that is a layer PEFT cannot adapt (an activation, a norm)
        raise ConfigError(f"{key}.target_modules: {shown(cfg.target_modules)}: "
                          f"{shown(str(err).splitlines()[0] if str(err) else type(err).__name__, 200)}") from None


def is_peft(model: torch.nn.Module) -> bool:
    """Whether `model` is a PEFT wrapper (the one place this is asked)."""
    return hasattr(model, "peft_config")


def export(model: torch.nn.Module, adapter_dir: Path | None) -> torch.nn.Module:
    """Save the adapter (when `adapter_dir` is given) and return the merged plain model."""
    if not is_peft(model):
        return model
    if adapter_dir is not None:
        with atomic_dir(adapter_dir) as tmp:
            model.save_pretrained(str(tmp))
    return model.merge_and_unload()


def finish(model: torch.nn.Module, cfg: LoraConfig, out_dir: Path) -> tuple[torch.nn.Module, dict[str, int]]:
    """The end of a trained stage: under LoRA the parameter counts, the adapter saved in
    `out_dir/adapter` and the merged model; the plain model on the CPU in eval mode either way."""
    metrics: dict[str, int] = {}
    if cfg.enabled:
        metrics["train/trainable_params"], metrics["train/total_params"] = count_trainable(model)
    return export(model, out_dir / "adapter" if cfg.enabled else None).cpu().eval(), metrics


def count_trainable(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face model inside a PEFT wrapper (its LoRA layers stay active), else the model itself."""
    return model.get_base_model() if is_peft(model) else model


def fresh_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A fresh, unpartitioned model of the same architecture (and the same adapters, untrained):
    the container ZeRO-3's gathered weights are loaded into. It keeps the model's generation
    config, which a model built from its config alone would lose (a hub model's several eos ids)."""
    hf = unwrap(model)
    config = getattr(hf, "config", None)
    if config is None:
        raise TypeError(f"cannot rebuild {type(model).__name__} without a config")
    plain = type(hf)(config)
    if getattr(hf, "generation_config", None) is not None:
        plain.generation_config = copy.deepcopy(hf.generation_config)
    if not is_peft(model):
        return plain
    from peft import get_peft_model
    return get_peft_model(plain, model.peft_config["default"])
