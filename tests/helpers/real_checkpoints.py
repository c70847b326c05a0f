"""Tiny local checkpoints shaped like the chat models users bring: Llama-3.1-Instruct and
Qwen2.5-Instruct. The weights are random and the vocabularies small, but the parts the pipeline's
tokenizer code meets are the real ones' shape: a byte-level BPE with the special tokens appended
after it, no pad token, eos the end-of-turn token, a chat template rendering the same layout, and a
generation_config.json listing several end ids. The chat templates are written here (same rendered
layout, not the models' own text). Nothing is downloaded."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2ForCausalLM)

from pipeline.workflow import hub_rehearsal

QWEN25_DEFAULT_SYSTEM = hub_rehearsal.CHATML_DEFAULT_SYSTEM

# Ids as in Llama-3's tokenizer: <|finetune_right_pad_id|> sits among the reserved tokens.
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|reserved_special_token_0|>",
                   "<|reserved_special_token_1|>", "<|finetune_right_pad_id|>", "<|reserved_special_token_2|>",
                   "<|start_header_id|>", "<|end_header_id|>", "<|eom_id|>", "<|eot_id|>", "<|python_tag|>",
                   *(f"<|reserved_special_token_{i}|>" for i in range(3, 8))]

# A system block that is always there (today's date, then the given system message), one header
# block per message ending in <|eot_id|>, the assistant header as the generation prompt; contents
# are trimmed, as Llama-3.1's template does.
LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}{%- set system = messages[0]['content'] | trim %}"
    "{%- set messages = messages[1:] %}{%- else %}{%- set system = '' %}{%- endif %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}"
    "{{- 'Today is ' + (date_string | default('1 March 2025')) + '.\\n\\n' }}"
    "{{- system + '<|eot_id|>' }}"
    "{%- for message in messages %}"
    "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
    "{{- message['content'] | trim + '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}")


def _corpus() -> list[str]:
    """The default task's text, which both small BPEs are learned on."""
    return hub_rehearsal.task_corpus()


def _bpe(specials: list[str], bos: str | None) -> Tokenizer:
    return hub_rehearsal.byte_level_bpe(_corpus(), specials, bos)


def _save(folder: str | Path, tok, model, generation: GenerationConfig, dtype: torch.dtype) -> Path:
    """Saved as the hub saves them when `dtype` is bf16: the weights cast, config.json's dtype too."""
    folder = Path(folder)
    model.generation_config = generation
    model.to(dtype).save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    return folder


def llama3_like(folder: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """A Llama-3.1-Instruct-shaped checkpoint in `folder`: eos <|eot_id|>, no pad, generation
    config ending on <|end_of_text|>, <|eom_id|> or <|eot_id|>; weights saved in `dtype`."""
    bpe = _bpe(LLAMA3_SPECIALS, bos="<|begin_of_text|>")
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                  clean_up_tokenization_spaces=False, model_max_length=131072)
    tok.chat_template = LLAMA3_TEMPLATE
    ends = [bpe.token_to_id(t) for t in ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=ends))
    return _save(folder, tok, model, GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=ends,
                                                      do_sample=True, temperature=0.6, top_p=0.9), dtype)


def qwen25_like(folder: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """A Qwen2.5-Instruct-shaped checkpoint in `folder` (pipeline/workflow/hub_rehearsal.py's
    tokenizer and generation config): no bos, eos <|im_end|>, no pad, generation config ending on
    <|im_end|> or <|endoftext|>, a default system message in the template."""
    tok = hub_rehearsal.chatml_tokenizer(_corpus())
    im_end, endoftext = hub_rehearsal.end_ids(tok)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=endoftext, eos_token_id=im_end))
    return _save(folder, tok, model, hub_rehearsal.generation_config(tok), dtype)
