"""Step 1 of a PPO iteration: sample responses and lay them out as one (B, T) batch.

The layout every later step uses: prompts left-padded to P columns, responses right-padded to R
columns, T = P + R. Position ids count from each row's first real token, so padding never shifts a
token's position; the logits at column P - 1 + t predict response token t.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..config import SamplingConfig
from ..models.generation import stop_ids
from ..models.rollout_engine import TORCH, Request, RolloutEngine
from ..data.padding import positions
from ..data.tokenizer import decode_response, encode_prompt, end_ids

if TYPE_CHECKING:   # annotations only (pipeline/models/checkpoints.py says why)
    from transformers import PreTrainedModel, PreTrainedTokenizerBase


@dataclass
class Rollout:
    """Sampled responses to a batch of prompts."""
    prompts: list[str]             # B prompt texts
    responses: list[str]           # B response texts, cut at eos
    input_ids: torch.Tensor        # (B, T) prompt (left-padded) then response (right-padded)
    attention_mask: torch.Tensor   # (B, T) long, 1 on real tokens
    response_mask: torch.Tensor    # (B, R) bool, True on real response tokens (eos included)
    ended: torch.Tensor            # (B,) bool, True when the response emitted eos
    n_prompt: int                  # P
    logprobs: torch.Tensor | None = None  # (B, R) log pi(a_t|s_t) computed while sampling (KV cache)

    @property
    def position_ids(self) -> torch.Tensor:  # (B, T)
        return positions(self.attention_mask)

    def select(self, idx: torch.Tensor, trim: bool = False) -> "Rollout":
        """The rows `idx` (a micro-batch). With `trim`, columns that are padding in every selected
        row are dropped (leading prompt pads, trailing response pads): less compute, same
        numbers (positions come from the mask, and masked columns take no part in attention).
        The response columns kept are the first `response_mask.size(1)` of the full rollout, so
        per-token tensors of the whole batch are sliced `[idx, :R']` to match."""
        rows = idx.tolist()
        ids, attn, resp = self.input_ids[idx], self.attention_mask[idx], self.response_mask[idx]
        logprobs = self.logprobs[idx] if self.logprobs is not None else None
        n_prompt = self.n_prompt
        if trim:
            real = attn.bool().any(0)                                      # (T,)
            start = int(real[:n_prompt].long().argmax()) if bool(real[:n_prompt].any()) else n_prompt - 1
            start = min(start, n_prompt - 1)                               # keep the last prompt column
            width = int(resp.any(0).long().cumsum(0).argmax()) + 1 if bool(resp.any()) else 1
            ids, attn = ids[:, start:n_prompt + width], attn[:, start:n_prompt + width]
            resp = resp[:, :width]
            logprobs = logprobs[:, :width] if logprobs is not None else None
            n_prompt -= start
        return Rollout([self.prompts[i] for i in rows], [self.responses[i] for i in rows],
                       ids, attn, resp, self.ended[idx], n_prompt, logprobs)


@torch.no_grad()   # not inference_mode: see pipeline/ppo/scoring.py
def rollout(actor: PreTrainedModel, tok: PreTrainedTokenizerBase, prompts: list, cfg: SamplingConfig,
            generator: torch.Generator, max_prompt_length: int | None = None,
            engine: RolloutEngine = TORCH, micro_batch: int = 0, drop_finished: bool = False,
            max_tokens: int | None = None) -> Rollout:
    """Sample one response per prompt from `actor` by `engine` (default: our KV-cache sampler),
    all rows from the stream `generator`, stopping at eos or at `cfg.stop_token` (TRL's stop-token
    truncation: nothing after it is part of the response). Prompts longer than `max_prompt_length`
    tokens keep their right end. `micro_batch`, `drop_finished`, `max_tokens`: our sampler's
    (rollout_engine.Request); the rows come back in the order of `prompts` whatever the calls."""
    ids = [encode_prompt(tok, p, max_prompt_length) for p in prompts]
    out = engine.generate(actor, Request(ids, tok.pad_token_id, tuple(stop_ids(tok, actor, cfg)), cfg,
                                         stream=generator, micro_batch=micro_batch, max_tokens=max_tokens,
                                         drop_finished=drop_finished))
    ends = end_ids(tok, actor)
    responses = [decode_response(tok, row.tolist(), ends) for row in out.response_ids]
    input_ids = torch.cat([out.prompt_ids, out.response_ids], dim=1)
    attention_mask = torch.cat([out.prompt_mask, out.response_mask], dim=1).long()
    return Rollout(prompts, responses, input_ids, attention_mask, out.response_mask, out.ended,
                   out.prompt_ids.size(1), out.logprobs.masked_fill(~out.response_mask, 0.0))
