"""Tiny local checkpoints shaped like the chat models users bring: Llama-3.1-Instruct and
Qwen2.5-Instruct. The weights are random and the vocabularies small, but the parts the pipeline's
tokenizer code meets are the real ones' shape: a byte-level BPE with the special tokens appended
after it, no pad token, eos the end-of-turn token, a chat template rendering the same layout, and a
generation_config.json listing several end ids. The chat templates are written here (same rendered
layout, not the models' own text). Nothing is downloaded."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2ForCausalLM, Qwen2Tokenizer)

from pipeline.tasks import reviews

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

QWEN25_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                   "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                   "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<|fim_prefix|>",
                   "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>"]

QWEN25_DEFAULT_SYSTEM = "You are a careful assistant who writes short film reviews."

# ChatML: <|im_start|>role\ncontent<|im_end|>\n per message, a default system message when none is
# given, "<|im_start|>assistant\n" as the generation prompt.
QWEN25_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + QWEN25_DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def _corpus() -> list[str]:
    """Text the small BPE is trained on: the default task's prompts and reviews, and the words of
    the templates' own text, so typical prompts encode in few tokens."""
    rng = random.Random(0)
    lines = [QWEN25_DEFAULT_SYSTEM, "Answer in one sentence."] + ["system user assistant Today is 1 March 2025."] * 20
    for i, title in enumerate(reviews.TITLES):
        prompt = reviews.make_prompt(title, reviews.ASPECTS[i % len(reviews.ASPECTS)], i % 3)
        lines += [prompt, reviews.sample_review(rng, prompt)]
    return lines


def _bpe(specials: list[str], bos: str | None) -> Tokenizer:
    """A byte-level BPE (any text encodes, no unk token) with `specials` appended after the learned
    vocabulary, as in both real tokenizers; with `bos`, the post-processor prepends it like
    Llama-3's does when special tokens are asked for."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=1000, min_frequency=1, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


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
    """A Qwen2.5-Instruct-shaped checkpoint in `folder`: no bos, eos <|im_end|>, no pad, generation
    config ending on <|im_end|> or <|endoftext|>, a default system message in the template. The
    tokenizer is transformers' own Qwen2Tokenizer (its pre-tokenizer, its class in the saved
    config); pad and unk are saved as null, since that class fills both with <|endoftext|> when a
    config leaves them out."""
    learned = json.loads(_bpe([], bos=None).to_str())["model"]
    tok = Qwen2Tokenizer(vocab=learned["vocab"], merges=[tuple(m) for m in learned["merges"]], unk_token=None,
                         bos_token=None, eos_token=None, pad_token=None, model_max_length=131072)
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN25_SPECIALS], special_tokens=True)
    tok.eos_token = "<|im_end|>"
    tok.chat_template = QWEN25_TEMPLATE
    im_end, endoftext = tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=True,
        bos_token_id=endoftext, eos_token_id=im_end))
    return _save(folder, tok, model, GenerationConfig(bos_token_id=endoftext, eos_token_id=[im_end, endoftext],
                                                      do_sample=True, temperature=0.7, top_p=0.8, top_k=20,
                                                      repetition_penalty=1.05), dtype)
