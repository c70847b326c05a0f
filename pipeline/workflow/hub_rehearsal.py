"""A checkpoint packaged the way hub checkpoints are, built here: the hub path rehearsed offline.

The default model (a word-level tokenizer, fp32 weights, one eos id, a pad token) hides what a
user's checkpoint brings: weights saved in bf16, a byte-level BPE tokenizer with a chat template, no
pad token, an end-of-turn eos beside a second end id in generation_config.json, tied embeddings.
`recipes/hub-rehearsal.yaml` runs the default task from a checkpoint with every one of those
properties, shaped like Qwen2.5-Instruct (ChatML, `<|im_end|>` and `<|endoftext|>` as ends).

The base must already know the task's language, as an instruct model knows its own: at the
learning rates hub checkpoints are tuned with (<= 2e-5) a small model learns nothing from random
weights. So it is built in two steps: a random model packaged this way, trained by the pipeline's
own SFT stage at the default task's learning rate on the task's demonstrations, and that result
re-packaged (`as_hub`): the pad token the pipeline chose dropped again, both end ids written, the
weights cast to bf16 as hub checkpoints are saved.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from ..files import atomic_dir

if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerBase

# Qwen2.5's special tokens, in its order, appended after the learned vocabulary as there.
QWEN25_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                   "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                   "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<|fim_prefix|>",
                   "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>"]

CHATML_DEFAULT_SYSTEM = "You are a careful assistant who writes short film reviews."

# ChatML: <|im_start|>role\ncontent<|im_end|>\n per message, a default system message when none is
# given, "<|im_start|>assistant\n" as the generation prompt (the layout of Qwen2.5's template; the
# text is written here).
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' %}"
    "{{- '<|im_start|>system\\n" + CHATML_DEFAULT_SYSTEM + "<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}")


def task_corpus(seed: int = 0) -> list[str]:
    """Text a small BPE is trained on: the default task's prompts and reviews, and the templates'
    own words, so a typical prompt encodes in few tokens (as a real tokenizer's vocabulary was
    learned on text like its users')."""
    from ..tasks import reviews

    rng = random.Random(seed)
    lines = [CHATML_DEFAULT_SYSTEM, "Answer in one sentence."] + ["system user assistant Today is 1 March 2025."] * 20
    for i, title in enumerate(reviews.TITLES):
        prompt = reviews.make_prompt(title, reviews.ASPECTS[i % len(reviews.ASPECTS)], i % 3)
        lines += [prompt, reviews.sample_review(rng, prompt)]
    return lines


def byte_level_bpe(corpus: Iterable[str], specials: list[str], bos: str | None = None,
                   vocab_size: int = 1000) -> "Tokenizer":
    """A byte-level BPE learned on `corpus` (any text encodes, no unk token) with `specials`
    appended after the learned vocabulary, as in Llama-3's and Qwen2.5's tokenizers; with `bos`,
    the post-processor prepends it when special tokens are asked for, as Llama-3's does."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(list(corpus), trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tok.token_to_id(bos))])
    return tok


def chatml_tokenizer(corpus: Iterable[str]) -> "PreTrainedTokenizerBase":
    """A Qwen2.5-Instruct-shaped tokenizer: transformers' own Qwen2Tokenizer class (its
    pre-tokenizer, its class name in the saved config) over a BPE learned on `corpus`; no bos, eos
    <|im_end|>, no pad (pad and unk saved as null: that class fills both with <|endoftext|> when a
    config leaves them out), the ChatML template."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    learned = json.loads(byte_level_bpe(corpus, []).to_str())["model"]
    tok = Qwen2Tokenizer(vocab=learned["vocab"], merges=[tuple(m) for m in learned["merges"]], unk_token=None,
                         bos_token=None, eos_token=None, pad_token=None, model_max_length=131072)
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in QWEN25_SPECIALS], special_tokens=True)
    tok.eos_token = "<|im_end|>"
    tok.chat_template = CHATML_TEMPLATE
    return tok


def end_ids(tok: "PreTrainedTokenizerBase") -> list[int]:
    """The two ids a Qwen2.5-Instruct generation config ends on: end of turn, end of text."""
    return tok.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])


def generation_config(tok: "PreTrainedTokenizerBase") -> "object":
    """Qwen2.5-Instruct's kind of generation_config.json: both end ids, its sampling defaults."""
    from transformers import GenerationConfig

    im_end, endoftext = end_ids(tok)
    return GenerationConfig(bos_token_id=endoftext, eos_token_id=[im_end, endoftext], do_sample=True,
                            temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05)


def save(folder: str | Path, tok: "PreTrainedTokenizerBase", model: "torch.nn.Module",
         dtype: "torch.dtype") -> Path:
    """Saved as the hub saves them: the weights cast to `dtype` (config.json's dtype follows), the
    Qwen2.5-style generation config, the tokenizer as it is (no pad), in one atomic step."""
    folder = Path(folder)
    model.generation_config = generation_config(tok)
    with atomic_dir(folder) as tmp:
        model.to(dtype).save_pretrained(str(tmp))
        tok.save_pretrained(str(tmp))
    return folder


def random_base(folder: str | Path, hidden_size: int = 96, num_layers: int = 4, seed: int = 0) -> Path:
    """An untrained Qwen2.5-shaped checkpoint in fp32: the ChatML tokenizer learned on the task's
    text, grouped-query attention, tied embeddings, room for the template's prompts."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    tok = chatml_tokenizer(task_corpus())
    im_end, endoftext = end_ids(tok)
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        rms_norm_eps=1e-6, tie_word_embeddings=True, bos_token_id=endoftext, eos_token_id=im_end))
    return save(folder, tok, model, torch.float32)


def as_hub(trained: str | Path, out: str | Path) -> Path:
    """A checkpoint the pipeline wrote, packaged again as a hub release: weights in bf16, the pad
    token the pipeline chose dropped (hub chat tokenizers have none), both end ids."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(trained))
    tok.pad_token = None
    model = AutoModelForCausalLM.from_pretrained(str(trained), dtype=torch.float32)
    model.config.pad_token_id = None
    return save(out, tok, model, torch.bfloat16)


def upcast(src: str | Path, out: str | Path) -> Path:
    """The exact fp32 upcast of a bf16 checkpoint (every bf16 value is an fp32 value): the control
    that a bf16-saved checkpoint must train like."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(src))
    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    return save(out, tok, model, torch.float32)
