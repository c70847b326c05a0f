"""Building and loading models and tokenizers (Hugging Face format throughout).

The default builds a tiny causal LM from a config (random weights, seeded), small enough that the
whole pipeline runs in minutes on two CPU cores. With `model.name_or_path` set, any checkpoint that
`AutoModelForCausalLM` loads is used instead. Checkpoints are written with `save_pretrained`
(safetensors), so `AutoModelForCausalLM` / `AutoTokenizer` load them unchanged.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import torch
# transformers' model and config classes take seconds to import, and the commands that build no model
# (the CLI's parser, check, plan's shapes, a launching command, Snakemake's validation) import the
# stage modules and so this one: they are imported in the functions that build or load a model.
if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..config import ModelConfig
from ..files import check_folder, read_json_object
from ..errors import CheckpointError, loading
from ..data.tokenizer import load_tokenizer


def tiny_config(cfg: ModelConfig, tok: PreTrainedTokenizerBase):
    """A transformers config for the tiny default model, sized by the `model` section."""
    from transformers import GPT2Config, LlamaConfig
    special = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    if cfg.arch == "llama":
        return LlamaConfig(vocab_size=len(tok), hidden_size=cfg.hidden_size,
                           intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_layers,
                           num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
                           max_position_embeddings=cfg.max_position_embeddings,
                           tie_word_embeddings=True, **special)
    # GPT-2 has dropout by default; RLHF stages need it off (PPO's ratio must be 1 before updates).
    return GPT2Config(vocab_size=len(tok), n_embd=cfg.hidden_size, n_layer=cfg.num_layers,
                      n_head=cfg.num_heads, n_inner=cfg.intermediate_size,
                      n_positions=cfg.max_position_embeddings, resid_pdrop=0.0, embd_pdrop=0.0,
                      attn_pdrop=0.0, **special)


def load_kwargs(cfg: ModelConfig, dtype: torch.dtype) -> dict:
    """`from_pretrained` arguments: the dtype the loading rule gives the model's role
    (pipeline/training/loading.py; never the checkpoint's own), the attention implementation and
    remote code from the `model` params."""
    kwargs: dict = {"trust_remote_code": cfg.trust_remote_code, "dtype": dtype}
    if cfg.attn_implementation is not None:
        kwargs["attn_implementation"] = cfg.attn_implementation
    return kwargs


def fit_embeddings(model: PreTrainedModel, tok: PreTrainedTokenizerBase) -> PreTrainedModel:
    """Grow the embeddings when the tokenizer gained tokens (a new pad token added on load; a
    reused one leaves them as they are), and record the pad id in the model's config."""
    # num_embeddings, not the weight's size: under ZeRO-3 a partitioned weight holds no rows here.
    if len(tok) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tok))
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tok.pad_token_id
    return model


def from_checkpoint(auto_cls: Any, path: str | Path, *, strict: bool, expected_missing: tuple[str, ...] = (),
                    **kwargs: Any) -> PreTrainedModel:
    """`auto_cls.from_pretrained(path)` that refuses weights of another model instead of silently
    initialising what is missing: a missing or shape-mismatched weight is an error (except
    `expected_missing` prefixes: a fresh head), and so is an unexpected one when `strict` (a
    checkpoint this pipeline wrote: a policy folder holding a reward model has an extra `score`
    weight). Load failures become one-line errors naming the folder."""
    from transformers.utils import logging as hf_logging

    check_folder(path)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()   # its load report would repeat, as a table, what is checked below
    try:
        with loading(path, f"as {auto_cls.__name__}"):
            model, info = auto_cls.from_pretrained(str(path), output_loading_info=True, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    missing = sorted(k for k in info["missing_keys"] if not k.startswith(expected_missing))
    unexpected = sorted(info["unexpected_keys"]) if strict else []
    mismatched = sorted(str(k[0] if isinstance(k, tuple) else k) for k in info["mismatched_keys"])
    if missing or unexpected or mismatched:
        parts = [f"{what} {', '.join(keys[:3])}{' ...' if len(keys) > 3 else ''}"
                 for what, keys in (("missing", missing), ("unexpected", unexpected), ("mismatched", mismatched)) if keys]
        raise CheckpointError(f"{path}: weights of another model than {type(model).__name__} ({'; '.join(parts)})")
    return model


def init_policy(cfg: ModelConfig, tokenizer_dir: Path, seed: int,
                dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """The SFT starting point: a tiny model from config (built in fp32), or `name_or_path` in
    `dtype` with its own tokenizer (one of its own tokens made pad if it has none, a new one only
    when it has no spare token; attention implementation from params)."""
    from transformers import AutoModelForCausalLM

    if cfg.name_or_path is None:
        tok = load_tokenizer(tokenizer_dir)
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(tiny_config(cfg, tok))
    else:
        tok = load_tokenizer(cfg.name_or_path, cfg.trust_remote_code, add_pad=True)
        model = from_checkpoint(AutoModelForCausalLM, cfg.name_or_path, strict=False, **load_kwargs(cfg, dtype))
        model = fit_embeddings(model, tok)
    return model, tok


def load_policy(path: Path, trust_remote_code: bool = False,
                dtype: torch.dtype | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a checkpoint this pipeline wrote (in `dtype`, or as saved), refusing anything but
    safetensors weights."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: not a Hugging Face checkpoint (no config.json)")
    if not list(path.glob("*.safetensors")):
        raise CheckpointError(f"{path}: no safetensors weights; this pipeline does not load pickled checkpoints")
    tok = load_tokenizer(path, trust_remote_code)
    model = from_checkpoint(AutoModelForCausalLM, path, strict=True, trust_remote_code=trust_remote_code,
                            use_safetensors=True, **({"dtype": dtype} if dtype is not None else {}))
    n_vocab = read_json_object(path / "config.json", "model config", CheckpointError).get("vocab_size")
    if not isinstance(n_vocab, int):
        raise CheckpointError(f"{path / 'config.json'}: no integer vocab_size")
    if len(tok) > n_vocab:
        raise CheckpointError(f"{path}: tokenizer has {len(tok)} tokens but the model's vocab_size is {n_vocab}")
    return model, tok


@contextlib.contextmanager
def modifying(params: list[torch.nn.Parameter]) -> Iterator[None]:
    """Change `params` in place (a fresh head's initialisation) whether or not ZeRO-3 partitioned
    them as they loaded: gathered whole meanwhile, changed on every rank alike, rank 0's kept."""
    if not any(hasattr(p, "ds_id") for p in params):
        yield
        return
    import deepspeed
    with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
        yield


@contextlib.contextmanager
def deepspeed_unimported_is_unavailable() -> Iterator[None]:
    """`save_pretrained` unwraps the model through accelerate, which imports deepspeed, where it is
    installed, only to ask whether the model is a `DeepSpeedEngine`: 1-2 s at every stage's end,
    most of it the mlflow that deepspeed imports in turn. A model cannot be an engine of a module
    never imported, so while deepspeed is not, accelerate is told it is unavailable; the unwrapping
    and the files written are the same."""
    other = None
    if "deepspeed" not in sys.modules:
        try:
            from accelerate.utils import other
        except ImportError:   # transformers unwraps without accelerate: nothing imports deepspeed
            pass
    probe = getattr(other, "is_deepspeed_available", None)
    if probe is None:
        yield
        return
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = probe


def save_checkpoint(model: PreTrainedModel, tok: PreTrainedTokenizerBase, out: Path) -> None:
    """An HF checkpoint (safetensors weights, config, tokenizer) in `out`."""
    with deepspeed_unimported_is_unavailable():
        model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))
