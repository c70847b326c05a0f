"""Batched sampling with a KV cache from left-padded prompts.

Our own loop instead of `model.generate` because PPO needs, from the same pass, the log-probability
of every sampled token under the temperature-scaled distribution, and a response mask that stops
at the first eos. Shapes: B batch, P prompt length (after left padding), R response length.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

import torch

from ..config import SamplingConfig
from ..errors import CheckpointError, ConfigError
from ..data.padding import left_pad, positions
from ..data.tokenizer import end_ids
from .logprobs import hf_model, keeps_logits

if TYPE_CHECKING:   # imported where used (pipeline/models/checkpoints.py says why)
    from transformers import Cache, PreTrainedModel


@dataclass
class Sampled:
    """The result of one batched sampling call."""
    prompt_ids: torch.Tensor       # (B, P) left-padded prompt token ids
    prompt_mask: torch.Tensor      # (B, P) bool, True on real prompt tokens
    response_ids: torch.Tensor     # (B, R) sampled ids; pad after the first eos
    response_mask: torch.Tensor    # (B, R) bool, True on real response tokens (eos included)
    logprobs: torch.Tensor         # (B, R) log pi(a_t|s_t) of the sampled token, temperature-scaled
    ended: torch.Tensor            # (B,) bool, True when the response emitted eos (or the stop token)

    def rows(self, idx: torch.Tensor) -> "Sampled":
        """The rows `idx` (B',) in that order, every column kept."""
        return Sampled(self.prompt_ids[idx], self.prompt_mask[idx], self.response_ids[idx],
                       self.response_mask[idx], self.logprobs[idx], self.ended[idx])


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


# On an accelerator the loop asks whether every row has ended only every this many tokens (each
# ask is a device-to-host sync); the columns sampled past the end are cut off afterwards. Nothing
# else in the loop reads from the device there: the draw is `race`, the KV cache `kv_cache`'s.
SYNC_EVERY = 16


@torch.no_grad()   # not inference_mode: see pipeline/ppo/scoring.py
def sample(model: PreTrainedModel, prompts: list[list[int]], pad_id: int, stop_ids: Sequence[int],
           cfg: SamplingConfig, generator: torch.Generator | None = None, greedy: bool = False,
           row_generators: Sequence[torch.Generator] | None = None, drop_finished: bool = False) -> Sampled:
    """Sample (or greedily decode) up to `cfg.max_new_tokens` per prompt; a response ends at the
    first of `stop_ids` (kept as its last token: eos ids, and the stop token when one is set).

    Random streams: `generator` draws every row's token from one stream (PPO's rollouts: on the
    CPU by torch.multinomial, as the committed runs did; on an accelerator by `race` from
    `device_stream(generator)`, the same algorithm with no host read), or
    `row_generators` gives each row its own (the measurement: a prompt's response depends on its
    own seed only, not on which prompts share its batch or its process). A row's stream gives all
    its uniforms up front, one per token, and each token is drawn by inverting its CDF, for every
    row at once (one call per row per batch, not one per row per token).

    `drop_finished`: a row that has ended leaves the batch (its KV cache rows too), so the forwards
    shrink as responses end. The same responses with `row_generators` or `greedy` (each row's
    numbers are its own); with one `generator` the stream is drawn for fewer rows, so they differ.
    Off by default: the committed runs' bits are those of the full batch.

    On an accelerator the loop reads from the device only every SYNC_EVERY tokens: the draw is
    `race`, the KV cache preallocated where the model allows (`kv_cache`)."""
    device = next(model.parameters()).device
    on_cpu = device.type == "cpu"
    prompt_ids, prompt_mask = (t.to(device) for t in left_pad(prompts, pad_id))
    B, P = prompt_ids.shape
    attn = prompt_mask.long()                                   # (B, P + t), (B, P + R) for a static cache
    pos = positions(attn)                                        # (B, P) positions ignore left pads
    cache = kv_cache(model, device, P + cfg.max_new_tokens)
    from transformers import StaticCache
    static = isinstance(cache, StaticCache)   # it attends over all its positions: the mask is that wide
    if static:
        attn = torch.cat([attn, attn.new_zeros((B, cfg.max_new_tokens))], dim=-1)
    given = {cache_keyword(): cache}
    # Only the last position's logits are needed; on the CPU all of them are still computed, which
    # keeps the committed CPU runs' bits (a one-row product rounds differently from a P-row one).
    keep = {"logits_to_keep": 1} if device.type != "cpu" and keeps_logits(model) else {}
    out = model(input_ids=prompt_ids, attention_mask=attn, position_ids=pos, use_cache=True, **given, **keep)
    check_cache(model, cache, P)
    next_pos = pos[:, -1:] + 1                            # (B, 1)
    done = torch.zeros(B, dtype=torch.bool, device=device)
    stops = torch.tensor(list(stop_ids), device=device)
    sync_every = 1 if device.type == "cpu" else SYNC_EVERY
    uniforms = None if row_generators is None or greedy else torch.stack(   # (B, max_new_tokens)
        [torch.rand(cfg.max_new_tokens, generator=g, device=g.device) for g in row_generators]).to(device)
    racing = not (on_cpu or greedy or uniforms is not None)
    stream = device_stream(generator, device) if racing else generator
    invalid = torch.zeros((), dtype=torch.bool, device=device) if racing else None   # () any row's probs invalid
    live = torch.arange(B, device=device)                        # (b,) the rows still in the batch
    tokens, logps, masks = [], [], []
    for t in range(cfg.max_new_tokens):
        logits = out.logits[:, -1, :].float() / cfg.temperature  # (b, V)
        logprobs_all = torch.log_softmax(logits, dim=-1)
        if greedy:
            token = logits.argmax(-1)
        else:
            probs = torch.softmax(filter_logits(logits, cfg.top_k, cfg.top_p), dim=-1)
            if uniforms is not None:
                token = inverse_cdf(probs, uniforms[live, t])
            elif on_cpu:
                token = draw(probs, generator)
            else:   # multinomial's checks of its input, on the device, read once at the end
                token = race(probs, stream)
                invalid = invalid | ~(probs >= 0).all()
        logp = logprobs_all.gather(-1, token[:, None]).squeeze(-1)               # (b,)
        if drop_finished:   # back to every row: the ended ones were dropped, they get padding
            token = torch.full((B,), pad_id, dtype=token.dtype, device=device).index_copy(0, live, token)
            logp = torch.zeros(B, dtype=logp.dtype, device=device).index_copy(0, live, logp)
        token = torch.where(done, torch.full_like(token, pad_id), token)   # (B,)
        masks.append(~done)
        tokens.append(token)
        logps.append(logp.masked_fill(done, 0.0))
        done = done | torch.isin(token, stops)
        if (t + 1) % sync_every == 0 and bool(done.all()):
            break
        if not on_cpu and t + 1 == cfg.max_new_tokens:
            break   # that forward would feed no draw (and a static cache has no room for it)
        step = token
        if drop_finished and (t + 1) % sync_every == 0 and bool(done[live].any()):
            keep = (~done[live]).nonzero().squeeze(-1)          # (b',) positions in the live batch
            select_rows(cache, keep)
            attn, next_pos, live = attn[keep], next_pos[keep], live[keep]
        if drop_finished:
            step = token[live]
        if static:
            attn[:, P + t] = 1                                   # the column `step` is written to
        else:
            attn = torch.cat([attn, torch.ones((attn.size(0), 1), dtype=attn.dtype, device=device)], dim=-1)
        out = model(input_ids=step[:, None], attention_mask=attn, position_ids=next_pos, use_cache=True, **given)
        next_pos = next_pos + 1
    response_mask = torch.stack(masks, dim=1)
    width = response_width(response_mask, invalid)
    return Sampled(prompt_ids=prompt_ids, prompt_mask=prompt_mask,
                   response_ids=torch.stack(tokens, dim=1)[:, :width], response_mask=response_mask[:, :width],
                   logprobs=torch.stack(logps, dim=1)[:, :width], ended=done)


def response_width(response_mask: torch.Tensor, invalid: torch.Tensor | None) -> int:
    """The columns of (B, R') `response_mask` up to the last one holding a real token: those after
    every row ended (sampled between two checks) hold only padding, and cutting them gives the
    result a check per token gives. `invalid` (): whether `race` met invalid probabilities (None
    where nothing raced), read with the width, and an error when true (torch.multinomial's)."""
    last = response_mask.any(0).long().cumsum(0).argmax()   # ()
    if invalid is not None:   # one read from the device for both
        last, bad = torch.stack([last, invalid.long()]).tolist()
        if bad:
            raise RuntimeError("sampling: the next-token probabilities held nan, inf or a negative value "
                               "(non-finite logits from the model)")
    return int(last) + 1


def concat(parts: Sequence[Sampled], pad_id: int) -> Sampled:
    """Results of consecutive sub-batches as one, rows in order: prompts left-padded to the widest
    prompt, responses right-padded to the longest response (padding, mask False, log-prob 0)."""
    if len(parts) == 1:
        return parts[0]
    P = max(p.prompt_ids.size(1) for p in parts)
    R = max(p.response_ids.size(1) for p in parts)

    def widen(x: torch.Tensor, width: int, fill, left: bool) -> torch.Tensor:   # (b, w) -> (b, width)
        extra = x.new_full((x.size(0), width - x.size(1)), fill)
        return torch.cat([extra, x] if left else [x, extra], dim=1)

    return Sampled(prompt_ids=torch.cat([widen(p.prompt_ids, P, pad_id, True) for p in parts]),
                   prompt_mask=torch.cat([widen(p.prompt_mask, P, False, True) for p in parts]),
                   response_ids=torch.cat([widen(p.response_ids, R, pad_id, False) for p in parts]),
                   response_mask=torch.cat([widen(p.response_mask, R, False, False) for p in parts]),
                   logprobs=torch.cat([widen(p.logprobs, R, 0.0, False) for p in parts]),
                   ended=torch.cat([p.ended for p in parts]))


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(B,) token ids from (B, V) `probs` and (B,) uniforms in [0, 1): the first token whose
    cumulative probability exceeds u times the row's total (the total absorbs the sum's rounding;
    `right` never picks a token of probability 0, a filtered one included)."""
    cdf = probs.cumsum(-1)                                                     # (B, V)
    target = (u.to(cdf.dtype) * cdf[:, -1])[:, None]                           # (B, 1)
    return torch.searchsorted(cdf, target, right=True).squeeze(-1).clamp(max=probs.size(-1) - 1)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(B,) token ids drawn from (B, V) `probs` by one stream, on the device of that stream (the
    CPU's draw; an accelerator's is `race`)."""
    where = generator.device if generator is not None else probs.device
    return torch.multinomial(probs.to(where), 1, generator=generator).squeeze(-1).to(probs.device)


def race(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """(B,) token ids drawn from (B, V) `probs` on their device, with no read from it: the
    exponential race argmax_v p_v / E_v, E_v ~ Exp(1) independent, picks v with probability
    p_v / sum(p) (the Gumbel-max trick: -log E_v is a Gumbel variable). It is torch.multinomial's own
    one-sample algorithm (aten/src/ATen/native/Distributions.cpp) without the validity checks that
    multinomial reads on the host at every call, so from the same stream on the same device it draws
    the same ids; the caller checks `probs` once per call instead."""
    exponentials = torch.empty_like(probs).exponential_(generator=generator)   # (B, V)
    return (probs / exponentials).argmax(-1)


def device_stream(generator: torch.Generator | None, device: torch.device) -> torch.Generator | None:
    """The stream an accelerator's draws come from: `generator` itself when it is on `device` (None:
    the device's default stream). A stream elsewhere (a CPU one, while the model is on a GPU) seeds,
    once per call, a stream on `device` with its next 63 bits, so no draw copies probabilities to
    its device: the draws then are not the ones the CPU run made from that stream, but the stream
    still decides them all (the same seed, the same draws on the same device). A backend that
    cannot make a stream (one registered from Python, whose kernels are CPU kernels, as
    devices.generator says) draws from the CPU stream itself."""
    if generator is None or generator.device == device:
        return generator
    try:
        own = torch.Generator(device=device)
    except NotImplementedError:
        return generator
    seed = torch.randint(2 ** 63 - 1, (), generator=generator, device=generator.device)
    return own.manual_seed(int(seed))


def kv_cache(model: PreTrainedModel, device: torch.device, length: int) -> Cache:
    """A call's KV cache. On an accelerator, where the model's class runs with a preallocated cache
    (transformers' `_can_compile_fullgraph`, the flag of the classes its static cache is compiled
    with) and every layer attends to every position, a StaticCache of `length` = P + R positions:
    each forward writes its keys and values in place instead of growing each layer's by a
    concatenation, and transformers' mask code reads no padding flag from the device for a
    one-token query on it (masking_utils.create_causal_mask; with a dynamic cache, one host read
    per forward). A dynamic cache on the CPU, whose committed runs it computed."""
    from transformers import DynamicCache, StaticCache
    from transformers.cache_utils import StaticLayer
    hf = hf_model(model)
    if device.type != "cpu" and getattr(type(hf), "_can_compile_fullgraph", False):
        cache = StaticCache(config=hf.config, max_cache_len=length)
        if all(type(layer) is StaticLayer for layer in cache.layers):   # not sliding-window ones
            return cache
    return DynamicCache()


def select_rows(cache: Cache, rows: torch.Tensor) -> None:
    """Keep the batch rows `rows` (b',) of every layer of `cache`. transformers selects a dynamic
    cache's (batch_select_indices); a static layer's keys and values, batch first like a dynamic
    one's, are selected the same way (its count of positions is one for every row)."""
    from transformers import StaticCache
    if not isinstance(cache, StaticCache):
        cache.batch_select_indices(rows)
        return
    for layer in cache.layers:
        if layer.is_initialized:
            layer.keys, layer.values = layer.keys[rows], layer.values[rows]


@functools.cache
def cache_keyword() -> str:
    """The keyword a transformers model's forward takes its KV cache by, in the installed release:
    `cache` (transformers 5.24, requirements.lock's; the old name still accepted, deprecated) or
    `past_key_values` (5.20, the vllm extra's). The library renamed it in every model at once, so
    its Llama tells."""
    from transformers.models.llama.modeling_llama import LlamaModel
    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


def check_cache(model: PreTrainedModel, cache: Cache, prompt_length: int) -> None:
    """The prefill must have filled the KV cache with the whole prompt: a model class that ignores
    the cache keyword would otherwise sample every token without seeing its prompt."""
    held = cache.get_seq_length()
    # A static cache, once written, counts its positions on the device: that it was written tells
    # (reading the count would wait for the device); one never written says 0.
    if not isinstance(held, torch.Tensor) and held != prompt_length:
        raise CheckpointError(f"{type(model).__name__}: its forward ignored the KV cache (it holds {held} "
                              f"positions after a prompt of {prompt_length}); the sampler needs a model whose "
                              f"forward takes transformers' `{cache_keyword()}` keyword")


def stop_ids(tok, model: PreTrainedModel, cfg: SamplingConfig) -> list[int]:
    """Every id that ends a response: the tokenizer's and the model's generation_config eos ids,
    and `cfg.stop_token`'s when set."""
    stop = stop_token_id(tok, cfg)
    return end_ids(tok, model) + ([stop] if stop is not None else [])


def stop_token_id(tok, cfg: SamplingConfig, key: str = "sampling") -> int | None:
    """The id of `cfg.stop_token`, which must be a single token of `tok`; None when unset. `key`:
    the section's place in params (`rs.sampling`), for the error."""
    if cfg.stop_token is None:
        return None
    ids = tok(cfg.stop_token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1 or ids[0] == tok.unk_token_id:
        raise ConfigError(f"{key}.stop_token: {cfg.stop_token!r} is not a single token of the tokenizer")
    return ids[0]


def check_stop_tokens(tok, sections: Mapping[str, SamplingConfig]) -> None:
    """Every sampling section's stop_token against `tok`, each error naming its section by key
    (`sections`: key -> section, e.g. {"rs.sampling": ...})."""
    for key, cfg in sections.items():
        stop_token_id(tok, cfg, key)
