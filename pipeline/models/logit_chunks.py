"""How large a piece of the LM head's logits is made at once: the one number the log-prob code
(pipeline/models/logprobs.py) chunks by and the memory plan (pipeline/training/memory_terms.py)
counts by. Torch-free, so the plan reads it without loading torch."""

from __future__ import annotations

# fp32 logits of at most this many bytes are made at once (1,765 positions of a 152k vocabulary,
# 32,768 of a 32k one); larger ones chunk by chunk.
LOGITS_CHUNK_BYTES = 1 << 30

# Model types whose logits are exactly `lm_head(last hidden state)`: only these are chunked. Others
# may scale or soft-cap the logits after the head (Gemma 2's final_logit_softcapping, Cohere's
# logit_scale, Granite's logits_scaling), which the chunked head would skip, so they keep the whole
# logits.
PLAIN_HEAD_TYPES = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe",
                              "phi3", "olmo", "olmo2", "smollm3", "gpt_neox", "gpt2"})


def chunk_positions(vocab: int, budget: int | None = None) -> int:
    """Positions per chunk of a `vocab`-wide head: as many fp32 logit rows as fit the budget
    (LOGITS_CHUNK_BYTES by default), at least one."""
    return max(1, (LOGITS_CHUNK_BYTES if budget is None else budget) // (vocab * 4))
