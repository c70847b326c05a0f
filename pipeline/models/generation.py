"""Batched sampling with a KV cache from left-padded prompts.

Our own loop instead of `model.generate` because PPO needs, from the same pass, the log-probability
of every sampled token under the temperature-scaled distribution, and a response mask that stops
at the first eos. Shapes: B batch, P prompt length (after left padding), R response length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache, PreTrainedModel

from ..config import SamplingConfig
from ..errors import ConfigError
from ..data.padding import left_pad, positions
from ..data.tokenizer import decode_response, encode_prompt


@dataclass
class Sampled:
    """The result of one batched sampling call."""
    prompt_ids: torch.Tensor       # (B, P) left-padded prompt token ids
    prompt_mask: torch.Tensor      # (B, P) bool, True on real prompt tokens
    response_ids: torch.Tensor     # (B, R) sampled ids; pad after the first eos
    response_mask: torch.Tensor    # (B, R) bool, True on real response tokens (eos included)
    logprobs: torch.Tensor         # (B, R) log pi(a_t|s_t) of the sampled token, temperature-scaled
    ended: torch.Tensor            # (B,) bool, True when the response emitted eos (or the stop token)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k then nucleus (top-p) filtering of (B, V) logits; removed entries become -inf."""
    if top_k > 0 and top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop_sorted = (cum - torch.softmax(sorted_logits, dim=-1)) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.inference_mode()
def sample(model: PreTrainedModel, prompts: list[list[int]], pad_id: int, eos_id: int,
           cfg: SamplingConfig, generator: torch.Generator | None = None, greedy: bool = False,
           stop_id: int | None = None) -> Sampled:
    """Sample (or greedily decode) up to `cfg.max_new_tokens` per prompt, stopping at eos, or at
    `stop_id` too when given (the stop token is kept as the response's last token)."""
    device = next(model.parameters()).device
    prompt_ids, prompt_mask = (t.to(device) for t in left_pad(prompts, pad_id))
    B = prompt_ids.size(0)
    attn = prompt_mask.long()                                   # (B, P + t)
    pos = positions(attn)                                        # (B, P) positions ignore left pads
    cache = DynamicCache()
    out = model(input_ids=prompt_ids, attention_mask=attn, position_ids=pos,
                cache=cache, use_cache=True)
    next_pos = pos[:, -1:] + 1                            # (B, 1)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stop_ids = torch.tensor([eos_id] if stop_id is None else [eos_id, stop_id], device=device)
    tokens, logps, masks = [], [], []
    for _ in range(cfg.max_new_tokens):
        logits = out.logits[:, -1, :].float() / cfg.temperature  # (B, V)
        logprobs_all = torch.log_softmax(logits, dim=-1)
        if greedy:
            token = logits.argmax(-1)
        else:
            probs = torch.softmax(filter_logits(logits, cfg.top_k, cfg.top_p), dim=-1)
            # The seeded generator lives on the CPU: sample there, so a GPU run draws the same tokens.
            token = torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(device)
        token = torch.where(done, torch.full_like(token, pad_id), token)   # (B,)
        masks.append(~done)
        tokens.append(token)
        logps.append(logprobs_all.gather(-1, token[:, None]).squeeze(-1).masked_fill(done, 0.0))
        done = done | torch.isin(token, stop_ids)
        if bool(done.all()):
            break
        attn = torch.cat([attn, torch.ones((B, 1), dtype=attn.dtype, device=device)], dim=-1)
        out = model(input_ids=token[:, None], attention_mask=attn, position_ids=next_pos,
                    cache=cache, use_cache=True)
        next_pos = next_pos + 1
    return Sampled(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                   response_ids=torch.stack(tokens, dim=1), response_mask=torch.stack(masks, dim=1),
                   logprobs=torch.stack(logps, dim=1), ended=done)


def stop_token_id(tok, cfg: SamplingConfig) -> int | None:
    """The id of `cfg.stop_token`, which must be a single token of `tok`; None when unset."""
    if cfg.stop_token is None:
        return None
    ids = tok(cfg.stop_token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1 or ids[0] == tok.unk_token_id:
        raise ConfigError(f"sampling.stop_token: {cfg.stop_token!r} is not a single token of the tokenizer")
    return ids[0]


def generate_texts(model: PreTrainedModel, tok, prompts: list, cfg: SamplingConfig, seed: int,
                   greedy: bool, batch_size: int = 64, max_prompt_length: int | None = None) -> tuple[list[str], list[bool]]:
    """Responses (text cut at eos) to `prompts` and whether each emitted eos; prompts longer than
    `max_prompt_length` tokens keep their right end."""
    gen = torch.Generator().manual_seed(seed)
    texts, ended = [], []
    was_training = model.training
    model.eval()
    for start in range(0, len(prompts), batch_size):
        chunk = [encode_prompt(tok, p, max_prompt_length) for p in prompts[start:start + batch_size]]
        out = sample(model, chunk, tok.pad_token_id, tok.eos_token_id, cfg, gen, greedy=greedy,
                     stop_id=stop_token_id(tok, cfg))
        texts += [decode_response(tok, row.tolist()) for row in out.response_ids]
        ended += out.ended.tolist()
    model.train(was_training)
    return texts, ended
