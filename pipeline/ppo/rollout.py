"""Step 1 of a PPO iteration: sample responses and lay them out as one (B, T) batch.

The layout every later step uses: prompts left-padded to P columns, responses right-padded to R
columns, T = P + R. Position ids count from each row's first real token, so padding never shifts a
token's position; the logits at column P - 1 + t predict response token t.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from ..config import SamplingConfig
from ..generation import sample, stop_token_id
from ..tokenizer import decode_response, encode_prompt


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

    @property
    def position_ids(self) -> torch.Tensor:  # (B, T)
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    def select(self, idx: torch.Tensor) -> "Rollout":
        """The rows `idx` (a micro-batch); columns are kept so shapes stay aligned."""
        rows = idx.tolist()
        return Rollout([self.prompts[i] for i in rows], [self.responses[i] for i in rows],
                       self.input_ids[idx], self.attention_mask[idx], self.response_mask[idx],
                       self.ended[idx], self.n_prompt)


@torch.inference_mode()
def rollout(actor: PreTrainedModel, tok: PreTrainedTokenizerBase, prompts: list[str], cfg: SamplingConfig,
            generator: torch.Generator) -> Rollout:
    """Sample one response per prompt with the KV cache (generation.sample), stopping at eos or at
    `cfg.stop_token` (TRL's stop-token truncation: nothing after it is part of the response)."""
    out = sample(actor, [encode_prompt(tok, p) for p in prompts], tok.pad_token_id, tok.eos_token_id, cfg, generator,
                 stop_id=stop_token_id(tok, cfg))
    responses = [decode_response(tok, row.tolist()) for row in out.response_ids]
    input_ids = torch.cat([out.prompt_ids, out.response_ids], dim=1)
    attention_mask = torch.cat([out.prompt_mask, out.response_mask], dim=1).long()
    return Rollout(prompts, responses, input_ids, attention_mask, out.response_mask, out.ended,
                   out.prompt_ids.size(1))
