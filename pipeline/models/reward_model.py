"""The reward model: a causal-LM backbone with a scalar head, read at the last real token.

`AutoModelForSequenceClassification` with `num_labels=1` gives the architecture and a checkpoint
format anyone can load. We do not use its own pooling: it finds the last token by comparing ids with
`pad_token_id`, which breaks when pad == eos (GPT-2 style tokenizers) and the response ends with eos.
Instead the score is read at the last position where `attention_mask` is 1, so left- and
right-padded batches give the same scores.

Normalisation (Huang et al. 2024, "The N+ implementation details of RLHF with PPO", §reward
normalisation): after training, the mean raw score of reference responses is stored in the model's
config as `reward_offset`; `score` subtracts it, so every consumer (PPO, evaluation) applies it alike.
The standard deviation of the same scores is stored beside it as `reward_scale`, for the RL stages
that divide by it (`ppo.normalize_reward`, as OpenRLHF's `--normalize_reward` reads the mean and
std its reward model stored); the scores themselves stay in the offset's units.
"""

from __future__ import annotations

import itertools
import json
import math
from typing import TYPE_CHECKING, Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from ..data.padding import pack, positions, right_pad
from ..errors import CheckpointError
from .lora import unwrap
from .checkpoints import fit_embeddings, from_checkpoint, modifying
from ..data.tokenizer import cut_prompt, encode_prompt, encode_response, load_tokenizer

if TYPE_CHECKING:   # imported where a model is loaded (pipeline/models/checkpoints.py says why)
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

OFFSET_KEY = "reward_offset"
SCALE_KEY = "reward_scale"


def head(model: torch.nn.Module) -> torch.nn.Module:
    """The scalar head of a sequence-classification model (`score` in Llama, GPT-2, Mistral...).
    Under LoRA it is PEFT's trainable copy of that Linear (a ModulesToSaveWrapper)."""
    layer = getattr(unwrap(model), "score", None)
    linear = getattr(layer, "original_module", layer)
    if not isinstance(linear, torch.nn.Linear) or linear.out_features != 1:
        raise CheckpointError(f"{type(model).__name__}: expected a `score` Linear(hidden, 1) head")
    return layer


def init_reward_model(path: str | Path, seed: int, head_std: float | None, trust_remote_code: bool = False,
                      load_kwargs: dict | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Backbone from a causal-LM checkpoint (the SFT model by default, or any `name_or_path`) plus
    a fresh scalar head; a tokenizer without pad gets one (embeddings resized). `load_kwargs`:
    dtype / attention implementation (models.load_kwargs).

    Head init N(0, 1/sqrt(hidden + 1)), bias 0, as in Stiennon et al. 2020 / lm-human-preferences.
    """
    from transformers import AutoModelForSequenceClassification

    tok = load_tokenizer(path, trust_remote_code, add_pad=True)
    kwargs = {"trust_remote_code": trust_remote_code, **(load_kwargs or {})}
    # A fresh head is expected; an unexpected weight is the causal LM's own head (an untied lm_head).
    model = from_checkpoint(AutoModelForSequenceClassification, path, strict=False, expected_missing=("score.",),
                            num_labels=1, pad_token_id=tok.pad_token_id, **kwargs)
    model = fit_embeddings(model, tok)
    layer = head(model)
    assert isinstance(layer, torch.nn.Linear)
    std = head_std if head_std is not None else 1.0 / math.sqrt(layer.in_features + 1)
    gen = torch.Generator().manual_seed(seed)
    with modifying([p for p in (layer.weight, layer.bias) if p is not None]), torch.no_grad():
        layer.weight.copy_(torch.randn(layer.weight.shape, generator=gen, device="cpu") * std)
        if layer.bias is not None:
            layer.bias.zero_()
    setattr(model.config, OFFSET_KEY, 0.0)
    return model, tok


def load_reward_model(path: str | Path, trust_remote_code: bool = False,
                      dtype: torch.dtype | None = None) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a trained reward model (safetensors only; in `dtype`, or as saved) and check it has one
    scalar output."""
    from transformers import AutoModelForSequenceClassification

    path = Path(path)
    if not list(path.glob("*.safetensors")):
        raise CheckpointError(f"{path}: no safetensors weights; this pipeline does not load pickled checkpoints")
    model = from_checkpoint(AutoModelForSequenceClassification, path, strict=True,
                            trust_remote_code=trust_remote_code, use_safetensors=True,
                            **({"dtype": dtype} if dtype is not None else {}))
    if model.config.num_labels != 1:
        raise CheckpointError(f"{path}: a reward model has num_labels=1, this one has {model.config.num_labels}")
    head(model)
    return model, load_tokenizer(path, trust_remote_code)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) index of the rightmost real token of each row of a (B, T) mask, any padding side."""
    T = attention_mask.size(1)
    return T - 1 - attention_mask.flip(-1).long().argmax(-1)


def hidden_states(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                  position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T, H) last hidden states of the backbone. attention_mask: (B, T) padding mask, positions
    counted from each row's first real token; or a (B, 1, T, T) additive mask with its position_ids;
    or None for a packed row (data.padding.pack), its position ids restarting per sequence."""
    if position_ids is None:
        position_ids = positions(attention_mask)
    out = unwrap(model).base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                   use_cache=False)
    return out.last_hidden_state


def raw_scores(model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """(B,) head output at the last real token, before normalisation (what training optimises)."""
    device = next(model.parameters()).device
    input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
    hidden = hidden_states(model, input_ids, attention_mask)                       # (B, T, H)
    last = hidden[torch.arange(hidden.size(0), device=hidden.device), last_token_index(attention_mask)]  # (B, H)
    return head(model)(last).squeeze(-1).float()


# Pairs per forward of a training or scoring batch: one row each with a shared prompt, two without
# (length_sorted_scores' 32 sequences); a larger batch is cut into length-sorted parts of this size.
PAIRS_PER_FORWARD = 16


def length_sorted_parts(lengths: list[int], max_rows: int) -> list[list[int]]:
    """Indices of rows with these lengths, sorted by length (stable) and cut into the fewest
    equal-sized parts of at most `max_rows`: each part is padded only to its own longest row."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n_parts = -(-len(lengths) // max_rows)
    bounds = [round(k * len(lengths) / n_parts) for k in range(n_parts + 1)]
    return [order[lo:hi] for lo, hi in zip(bounds, bounds[1:])]


def in_input_order(part_scores: list[torch.Tensor], parts: list[list[int]]) -> torch.Tensor:
    """(N,) the concatenated scores of `parts` (each (len(part),)) put back in the input order."""
    scores = torch.cat(part_scores)
    order = torch.tensor([i for part in parts for i in part], device=scores.device)
    return scores[torch.argsort(order)]


def packed_scores(model: PreTrainedModel, seqs: list[list[int]],
                  device: torch.device | None = None) -> torch.Tensor:
    """(N,) raw scores of `seqs` end to end in one row (data.padding.pack): each read at its own last
    token, as `raw_scores` of padded rows gives them up to floating-point rounding, with no token
    of the forward padding."""
    device = device if device is not None else next(model.parameters()).device
    ids, pos = pack(seqs)                                                                  # (1, N) each
    last = torch.tensor(list(itertools.accumulate(map(len, seqs))), device="cpu") - 1      # (S,)
    hidden = hidden_states(model, ids.to(device), None, pos.to(device))                    # (1, N, H)
    return head(model)(hidden[0, last.to(device)]).squeeze(-1).float()


def length_sorted_scores(model: PreTrainedModel, seqs: list[list[int]], pad_id: int,
                         device: torch.device | None = None, max_rows: int = 2 * PAIRS_PER_FORWARD) -> torch.Tensor:
    """(N,) raw scores of `seqs`, as `raw_scores` of the whole padded batch would give, computed in
    length-sorted parts of at most `max_rows` rows, each padded only to its own longest sequence.

    On the default task a random batch of 64 sequences carries 39% padding; two sorted halves carry
    19% (measured on the prepared pairs), so the forward and backward do that much less work. The
    scores are per row, so the split changes nothing but floating-point rounding; gradients flow
    through every part."""
    parts = length_sorted_parts([len(s) for s in seqs], max_rows)
    scores = []
    for part in parts:
        ids, mask = right_pad([seqs[i] for i in part], pad_id)
        mask = mask.long()
        if device is not None:
            ids, mask = ids.to(device), mask.to(device)
        scores.append(raw_scores(model, ids, mask))
    return in_input_order(scores, parts)


def offset(model: PreTrainedModel) -> float:
    return float(getattr(model.config, OFFSET_KEY, 0.0) or 0.0)


def scale(model: PreTrainedModel) -> float | None:
    """The stored standard deviation of the normalised scores of the reference responses (None when
    the model stores none: trained without `reward.normalize`, or by an earlier version)."""
    value = getattr(model.config, SCALE_KEY, None)
    return float(value) if value is not None else None


def fit_pair_parts(p: list[int], r: list[int], max_length: int,
                   cut: Callable[[int], list[int]] | None = None) -> tuple[list[int], list[int]]:
    """Prompt ids `p` and response ids `r` (eos included) cut to `max_length` together: the prompt is
    cut to the room the response leaves by `cut(room)` (tokenizer.cut_prompt: its template kept, the
    user text's left end dropped), or loses its left end without one. New lists, never `p` or `r`
    themselves (they may be kept ids)."""
    r = r[:max_length - 1] if len(r) >= max_length else list(r)  # keep one prompt token; an over-long response is scored on its start
    room = max_length - len(r)
    if len(p) <= room:
        return list(p), r
    return (cut(room) if cut is not None else p[len(p) - room:]), r


def encode_pair_parts(tok: PreTrainedTokenizerBase, prompt: str, response: str, max_length: int) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids + eos), the prompt cut to fit when the whole is too long."""
    p = encode_prompt(tok, prompt)
    return fit_pair_parts(p, encode_response(tok, response), max_length, lambda room: cut_prompt(tok, prompt, room, p))


def encode_pair_text(tok: PreTrainedTokenizerBase, prompt: str, response: str, max_length: int) -> list[int]:
    """prompt + response + eos, the prompt cut to fit when the whole is too long."""
    p, r = encode_pair_parts(tok, prompt, response, max_length)
    return p + r


Row = tuple[list[int], list[list[int]]]   # (prefix ids, branches: each scored at its own last token)


def shared_prefix_rows(tok: PreTrainedTokenizerBase, prompt: str, chosen: str, rejected: str,
                       max_length: int) -> list[Row]:
    """The sequences of one pair as rows for `branch_scores`: one row [prompt, chosen, rejected]
    when both keep the same prompt tokens (always, unless one of them cut the prompt to fit
    `max_length`), else one row per response."""
    return prefix_rows(*(encode_pair_parts(tok, prompt, x, max_length) for x in (chosen, rejected)))


def prefix_rows(chosen: tuple[list[int], list[int]], rejected: tuple[list[int], list[int]]) -> list[Row]:
    """Rows of a pair from its (prompt ids, response ids) parts: one shared-prefix row when both
    kept the same prompt tokens, else one row per response."""
    (pc, c), (pr, r) = chosen, rejected
    return [(pc, [c, r])] if pc == pr else [(pc, [c]), (pr, [r])]


class EncodedPairs:
    """Token ids of (prompt, chosen, rejected) triples, encoded on first use and kept. Training
    visits every pair once per epoch (and the held-out pairs at every evaluation); tokenising them
    again each time cost ~10% of a reward-model step on the default task (measured with
    benchmarks/rm_step.py). Each distinct prompt and response text is tokenised once, for the
    length check before training (`length`) and for the rows alike: the default's 32,000 pairs
    hold 13,362 distinct prompts, so seven tokenizer calls per pair became about 2.4. The ids are
    the same either way, so are the scores, bit for bit."""

    def __init__(self, tok: PreTrainedTokenizerBase, max_length: int):
        self.tok, self.max_length = tok, max_length
        self._prompts: dict[tuple, list[int]] = {}
        self._responses: dict[str, list[int]] = {}
        self._rows: dict[tuple, list[Row]] = {}
        self._seqs: dict[tuple, tuple[list[int], list[int]]] = {}

    @staticmethod
    def prompt_key(prompt) -> tuple:
        """A hashable key: a prompt may be a list of {role, content} messages (the `messages`
        layout), kept as its JSON, tagged so that no text prompt can equal it."""
        return ("text", prompt) if isinstance(prompt, str) else ("messages", json.dumps(prompt, sort_keys=True))

    @classmethod
    def key(cls, triple: tuple) -> tuple:
        """The triple's hashable key (`prompt_key` for its prompt)."""
        prompt, chosen, rejected = triple
        return cls.prompt_key(prompt), chosen, rejected

    def prompt_ids(self, prompt) -> list[int]:
        """`encode_prompt` of the prompt, whole (callers cut copies, never this list)."""
        key = self.prompt_key(prompt)
        if key not in self._prompts:
            self._prompts[key] = encode_prompt(self.tok, prompt)
        return self._prompts[key]

    def response_ids(self, response: str) -> list[int]:
        """`encode_response` of the response (eos included), whole."""
        if response not in self._responses:
            self._responses[response] = encode_response(self.tok, response)
        return self._responses[response]

    def length(self, triple: tuple) -> int:
        """Uncut prompt + longer response tokens: what `max_length` is checked against."""
        prompt, chosen, rejected = triple
        return len(self.prompt_ids(prompt)) + max(len(self.response_ids(chosen)), len(self.response_ids(rejected)))

    def parts(self, prompt, response: str) -> tuple[list[int], list[int]]:
        """`encode_pair_parts` from the kept ids."""
        p = self.prompt_ids(prompt)
        return fit_pair_parts(p, self.response_ids(response), self.max_length,
                              lambda room: cut_prompt(self.tok, prompt, room, p))

    def row_tokens(self, triple: tuple, shared_prompt: bool, packed: bool = False) -> int:
        """Tokens the pair occupies in a training forward: its one row of prompt and both
        responses (`shared_prompt`), its two sequences end to end (`packed`), else its two rows of
        prompt + response padded to the longer."""
        if packed:
            return sum(map(len, self.seqs(triple)))
        if shared_prompt:
            return sum(len(prefix) + sum(map(len, branches)) for prefix, branches in self.rows(triple))
        return 2 * max(map(len, self.seqs(triple)))

    def rows(self, triple: tuple) -> list[Row]:
        """`shared_prefix_rows` of the (prompt, chosen, rejected) triple."""
        key = self.key(triple)
        if key not in self._rows:
            prompt, chosen, rejected = triple
            self._rows[key] = prefix_rows(self.parts(prompt, chosen), self.parts(prompt, rejected))
        return self._rows[key]

    def seqs(self, triple: tuple) -> tuple[list[int], list[int]]:
        """prompt + chosen and prompt + rejected, each as `encode_pair_text`."""
        key = self.key(triple)
        if key not in self._seqs:
            p, c, r = triple
            self._seqs[key] = tuple(sum(self.parts(p, x), []) for x in (c, r))
        return self._seqs[key]


def branch_batch(rows: list[Row], pad_id: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Right-padded ids (R, T), an additive attention mask (R, 1, T, T), position ids (R, T) and the
    (row, column) of every branch's last token, (N,) each, in row-major branch order.

    A branch token sees the prefix and the earlier tokens of its own branch, never another branch,
    and its positions continue from the prefix: each branch's hidden states are those of
    prefix + branch run alone. The prefix is computed once for all its branches, which is the point:
    a preference pair's prompt is shared by chosen and rejected."""
    width = max(len(p) + sum(map(len, bs)) for p, bs in rows)
    # Built as Python lists and converted once: per-row tensor writes cost ~5% of a training step.
    ids, segment, pos = [], [], []                   # segment: 0 prefix, k>0 branch k, -1 pad
    last_row, last_col = [], []
    for i, (prefix, branches) in enumerate(rows):
        row_ids, row_seg, row_pos = list(prefix), [0] * len(prefix), list(range(len(prefix)))
        for k, branch in enumerate(branches, start=1):
            row_ids += branch
            row_seg += [k] * len(branch)
            row_pos += range(len(prefix), len(prefix) + len(branch))
            last_row.append(i)
            last_col.append(len(row_ids) - 1)
        pad = width - len(row_ids)
        ids.append(row_ids + [pad_id] * pad)
        segment.append(row_seg + [-1] * pad)
        pos.append(row_pos + [0] * pad)
    ids, segment, pos = (torch.tensor(x, dtype=torch.long, device="cpu") for x in (ids, segment, pos))   # (R, T) each
    causal = torch.ones(width, width, dtype=torch.bool, device="cpu").tril()                          # (T, T)
    key_seg, query_seg = segment[:, None, :], segment[:, :, None]                        # (R, 1, T), (R, T, 1)
    allowed = causal & ((key_seg == 0) | (key_seg == query_seg))                         # (R, T, T)
    mask = torch.zeros(allowed.shape, dtype=dtype, device="cpu").masked_fill(~allowed, torch.finfo(dtype).min)
    return ids, mask[:, None], pos, torch.tensor(last_row, device="cpu"), torch.tensor(last_col, device="cpu")


def branch_scores(model: PreTrainedModel, rows: list[Row], pad_id: int, device: torch.device | None = None,
                  max_rows: int = PAIRS_PER_FORWARD) -> torch.Tensor:
    """(N,) raw scores at the end of every branch of `rows`, in row-major order: for each branch the
    score `raw_scores` gives prefix + branch as one sequence (up to floating-point rounding).
    Computed in length-sorted parts of at most `max_rows` rows, as `length_sorted_scores`."""
    device = device if device is not None else next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    first = [0]                                       # flat index of each row's first branch
    for _, bs in rows:
        first.append(first[-1] + len(bs))
    parts = length_sorted_parts([len(p) + sum(map(len, bs)) for p, bs in rows], max_rows)
    scores = []
    for part in parts:
        ids, mask, pos, last_row, last_col = (t.to(device) for t in branch_batch([rows[i] for i in part], pad_id, dtype))
        hidden = hidden_states(model, ids, mask, pos)                      # (R, T, H)
        scores.append(head(model)(hidden[last_row, last_col]).squeeze(-1).float())
    # a part's scores run over its rows' branches; put them back in row-major branch order
    flat_parts = [[j for i in part for j in range(first[i], first[i + 1])] for part in parts]
    return in_input_order(scores, flat_parts)


def pair_scores(model: PreTrainedModel, tok: PreTrainedTokenizerBase, triples: list[tuple[str, str, str]],
                max_length: int, device: torch.device | None = None, shared_prompt: bool = True,
                encoded: EncodedPairs | None = None,
                packed: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw (B,) scores of chosen and rejected of (prompt, chosen, rejected) triples.

    shared_prompt: each pair is one row [prompt, chosen, rejected] (`branch_scores`), so the prompt
    is run once instead of twice; else 2B length-sorted sequences (`length_sorted_scores`). Both
    give the same scores up to floating-point rounding (tests/stages/test_reward.py). packed: the 2B
    sequences in one row, each pair's two side by side (`packed_scores`; not with shared_prompt, whose
    rejected branch sees the prompt but not the chosen response: position ids cannot say that).
    encoded: token ids kept from earlier calls (its max_length must be this one); None: encode afresh."""
    if encoded is None:
        encoded = EncodedPairs(tok, max_length)
    elif encoded.max_length != max_length:
        raise ValueError(f"pair_scores: encoded pairs of max_length {encoded.max_length}, asked {max_length}")
    if packed:
        if shared_prompt:
            raise ValueError("pair_scores: packed rows hold whole sequences; pass shared_prompt=False")
        scores = packed_scores(model, [s for t in triples for s in encoded.seqs(t)], device).view(-1, 2)
        return scores[:, 0], scores[:, 1]
    if not shared_prompt:
        both = [encoded.seqs(t) for t in triples]
        seqs = [c for c, _ in both] + [r for _, r in both]
        scores = length_sorted_scores(model, seqs, tok.pad_token_id, device)
        return scores[:len(triples)], scores[len(triples):]
    rows = [row for t in triples for row in encoded.rows(t)]
    scores = branch_scores(model, rows, tok.pad_token_id, device).view(-1, 2)   # (B, 2): chosen, rejected
    return scores[:, 0], scores[:, 1]


@torch.no_grad()   # not inference_mode: see pipeline/ppo/scoring.py
def score_texts(model: PreTrainedModel, tok: PreTrainedTokenizerBase, prompts: list[str], responses: list[str],
                max_length: int, batch_size: int = 64, packed: bool = False) -> torch.Tensor:
    """(N,) normalised scores of (prompt, response) texts: raw score minus the stored offset.
    `packed`: each batch's sequences in one packed row (`packed_scores`), no padding computed."""
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(prompts), batch_size):
        seqs = [encode_pair_text(tok, p, r, max_length)
                for p, r in zip(prompts[start:start + batch_size], responses[start:start + batch_size])]
        out.append(packed_scores(model, seqs) if packed else length_sorted_scores(model, seqs, tok.pad_token_id))
    model.train(was_training)
    return torch.cat(out) - offset(model)


def pairwise_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor,
                  margin: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """Bradley-Terry loss -log sigmoid(r_c - r_r - m), mean over pairs (Ouyang et al. 2022, eq. 1;
    the margin as in Llama 2, Touvron et al. 2023, eq. 2). r_chosen, r_rejected, margin: (B,)."""
    total, correct = pairwise_loss_sum(r_chosen, r_rejected, margin)
    loss = total / r_chosen.numel()
    return loss, {"loss": loss.item(), "accuracy": correct / r_chosen.numel()}


def pairwise_loss_sum(r_chosen: torch.Tensor, r_rejected: torch.Tensor,
                      margin: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
    """The loss of `pairwise_loss` summed over the pairs (for batches split across micro-batches and processes,
    divided by the global batch size by the caller), and the number ranked correctly."""
    diff = r_chosen - r_rejected
    if margin is not None:
        diff = diff - margin
    return -F.logsigmoid(diff).sum(), int((r_chosen > r_rejected).sum())
