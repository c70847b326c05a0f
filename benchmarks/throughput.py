"""Training throughput at a real model's shape: tokens per second and MFU of the SFT, reward-model,
DPO and PPO-update forward + backward, fixed-row micro-batches against micro-batches by a token
budget, in one run with the ratio printed; and our sampler's tokens per second beside them.

    .venv/bin/python benchmarks/throughput.py                                # this machine's CPU
    .venv/bin/python benchmarks/throughput.py --out docs/data/throughput-cpu.json
    .venv/bin/python benchmarks/throughput.py --hidden 2048 --layers 16 --vocab 128256 --device cuda

The model is a randomly initialised Llama of the given shape (the CPU default is small enough for
a laptop; on a GPU, a 1B shape); the data are token ids of random content with lengths drawn as
chat and preference data have them (HH- or TL;DR-shaped: prompts 50-500 tokens, log-normal;
responses 20-300), so what is measured is the padding the lengths cause, not what the tokens say.
Each global batch runs the stages' own code (`demonstrations.ce_sum`, `reward_model.branch_scores`
with the Bradley-Terry loss, `preference.logprobs.pair_logprobs` with the DPO loss; for PPO's
update the trainer's micro-batches of a rollout, `ppo.scoring.update_chunks` and
`Rollout.select(trim=True)`, the actor's `policy_logprobs` under the clipped `policy_loss` and the
critic's `critic_values` under `value_loss`) in micro-batches of `--rows` rows, or of at most
`--budget` padded tokens (training/token_batches.py), the two alternating step by step so a
drifting machine drifts for both. No optimizer step (its cost does not depend on the batching).
The sampler (`models.generation.sample`, PPO's rollouts) answers one global batch's prompts with
up to `--new-tokens` tokens each, in one call; its tokens are the ones it generated.

MFU = 6 N tokens/s / peak (Kaplan et al. 2020: 6 FLOPs per parameter per trained token, N the
non-embedding parameters plus the LM head; attention's FLOPs are not counted), the tokens being the
real ones (padding is work, not throughput). PPO's update trains two models on each token, the
actor and the critic (the same trunk with a scalar head): 6 (N + N_critic). Peak: on a CUDA
device the bf16 dense peak of its datasheet where known; on a CPU the rate of a 2048 x 2048 fp32
matmul measured here (so a CPU MFU says how close to its own matmul speed the step runs, not to a
datasheet).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from demo_seeds import machine  # noqa: E402
from pipeline.config import SamplingConfig  # noqa: E402
from pipeline.data.padding import left_pad, right_pad  # noqa: E402
from pipeline.data.records import IGNORE  # noqa: E402
from pipeline.models.generation import sample  # noqa: E402
from pipeline.ppo.losses import policy_loss, value_loss  # noqa: E402
from pipeline.ppo.rollout import Rollout  # noqa: E402
from pipeline.ppo.scoring import critic_values, policy_logprobs, update_chunks  # noqa: E402
from pipeline.files import atomic_write_text  # noqa: E402
from pipeline.models import reward_model as rm  # noqa: E402
from pipeline.preference.logprobs import TokenPair, pair_logprobs  # noqa: E402
from pipeline.training.demonstrations import ce_sum  # noqa: E402
from pipeline.data.padding import micro_batches  # noqa: E402
from pipeline.training.token_batches import padded_tokens  # noqa: E402

# bf16 dense peaks (datasheets, FLOP/s) of the GPUs a user trains on
GPU_PEAKS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "A10": 125e12}


def lengths(n: int, gen: torch.Generator) -> list[tuple[int, int, int]]:
    """(prompt, response, second response) token counts of `n` examples: prompts log-normal around
    ~150 tokens clipped to 50-500, responses uniform 20-300."""
    prompt = torch.exp(torch.randn(n, generator=gen) * 0.6 + math.log(150)).clamp(50, 500).long()
    responses = torch.randint(20, 301, (n, 2), generator=gen)
    return [(int(p), int(a), int(b)) for p, (a, b) in zip(prompt, responses.tolist())]


def ids(n: int, vocab: int, gen: torch.Generator) -> list[int]:
    return torch.randint(3, vocab, (n,), generator=gen).tolist()


def peak_flops(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, peak in GPU_PEAKS.items():
            if key in name:
                return peak, f"{name} bf16 datasheet"
    a = torch.randn(2048, 2048, device=device)
    for _ in range(2):
        a @ a
    start, n = time.perf_counter(), 10
    for _ in range(n):
        a @ a
    if device.type == "cuda":
        torch.cuda.synchronize()
    return n * 2 * 2048 ** 3 / (time.perf_counter() - start), "measured 2048^3 fp32 matmul"


class Stage:
    """One stage's global batches, its micro-batch loss and its items' padded lengths; `run`, where
    given, times a global batch itself (PPO's update cuts its micro-batches as its trainer does)."""

    def __init__(self, name: str, items: list, length, loss, run=None):
        self.name, self.items, self.length, self.loss, self.run = name, items, length, loss, run


def stages(model, rm_model, vocab: int, n: int, gen: torch.Generator) -> list[Stage]:
    pad = 0
    sft_items, pair_items = [], []
    for p, a, b in lengths(n, gen):
        prompt = ids(p, vocab, gen)
        sft_items.append((prompt, ids(a, vocab, gen)))
        pair_items.append(TokenPair(prompt, ids(a, vocab, gen), ids(b, vocab, gen)))

    def sft_loss(part):
        width = max(len(p) + len(r) for p, r in part)
        batch = torch.full((len(part), width), pad)
        labels = torch.full((len(part), width), IGNORE)
        mask = torch.zeros((len(part), width), dtype=torch.long)
        for i, (p, r) in enumerate(part):
            row = torch.tensor(p + r)
            batch[i, :len(row)], mask[i, :len(row)] = row, 1
            labels[i, len(p):len(row)] = torch.tensor(r)
        device = next(model.parameters()).device
        loss, n_tok = ce_sum(model, {"input_ids": batch.to(device), "attention_mask": mask.to(device),
                                     "labels": labels.to(device)})
        return loss / n_tok

    def rm_loss(part):
        rows = [(t.prompt, [t.chosen, t.rejected]) for t in part]
        scores = rm.branch_scores(rm_model, rows, pad)                    # (2N,) chosen, rejected per row
        return -torch.nn.functional.logsigmoid(scores[0::2] - scores[1::2]).mean()

    def dpo_loss(part):
        chosen, rejected = pair_logprobs(model, part, pad)
        return -torch.nn.functional.logsigmoid(0.1 * (chosen - rejected)).mean()

    return [Stage("sft", sft_items, lambda x: len(x[0]) + len(x[1]), sft_loss),
            Stage("reward", pair_items, lambda t: len(t.prompt) + len(t.chosen) + len(t.rejected), rm_loss),
            Stage("dpo", pair_items, lambda t: 2 * t.width, dpo_loss),
            Stage("ppo", sft_items, lambda x: len(x[0]) + len(x[1]), None,
                  run=lambda batch, rows, budget: ppo_update(model, rm_model, batch, rows, budget, pad))]


def rollout_of(batch: list[tuple[list[int], list[int]]], pad: int) -> Rollout:
    """A rollout of (prompt, response) ids as the sampler returns one: prompts left-padded to the
    longest, responses right-padded, every response ended."""
    prompt_ids, prompt_mask = left_pad([p for p, _ in batch], pad)        # (B, P)
    response_ids, response_mask = right_pad([r for _, r in batch], pad)   # (B, R)
    return Rollout([""] * len(batch), [""] * len(batch), torch.cat([prompt_ids, response_ids], 1),
                   torch.cat([prompt_mask, response_mask], 1).long(), response_mask.bool(),
                   torch.ones(len(batch), dtype=torch.bool), prompt_ids.size(1))


def ppo_update(actor, critic, batch: list, rows: int, budget, pad: int) -> tuple[float, int, int]:
    """Seconds of the forward + backward of PPO's actor and critic over one rollout batch, in the
    trainer's micro-batches (`rows` rows, longest responses first, or a token `budget`), each
    trimmed of its all-padding columns; and its (real, computed) tokens. The old log-probs and
    values are the current ones (ratio 1, no clipping: the cost is the same), the advantages and
    returns fixed."""
    device = next(actor.parameters()).device
    ro = rollout_of(batch, pad)
    prompt_lengths = ro.attention_mask[:, :ro.n_prompt].sum(1)                  # (B,)
    parts = update_chunks(ro.response_mask, torch.arange(len(batch)), rows, prompt_lengths, budget)
    real = computed = 0
    for m in (actor, critic):
        m.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for part in parts:
        sub = ro.select(part, trim=True)
        sub = Rollout(sub.prompts, sub.responses, sub.input_ids.to(device), sub.attention_mask.to(device),
                      sub.response_mask.to(device), sub.ended.to(device), sub.n_prompt)
        mask = sub.response_mask                                          # (b, R')
        logprobs, _ = policy_logprobs(actor, sub, 1.0)                    # (b, R')
        advantages = torch.where(mask, 1.0, 0.0)                          # (b, R')
        loss, _ = policy_loss(logprobs, logprobs.detach(), advantages, mask, 0.2)
        values = critic_values(critic, sub)                               # (b, R')
        v_loss, _ = value_loss(values, values.detach(), torch.zeros_like(values), mask, 0.2)
        (loss + v_loss).backward()
        real += int(sub.attention_mask.sum())
        computed += sub.input_ids.numel()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, real, computed


def sampler_speed(model, prompts: list[list[int]], new_tokens: int, repeats: int, pad: int) -> dict:
    """Our sampler on `prompts` (one call, up to `new_tokens` each), after one warm-up call: the
    median seconds of `repeats` calls and the tokens it generated per second."""
    device = next(model.parameters()).device
    cfg = SamplingConfig(max_new_tokens=new_tokens)
    times, generated = [], 0
    model.eval()
    with torch.no_grad():
        for k in range(repeats + 1):
            gen = torch.Generator(device).manual_seed(k)
            start = time.perf_counter()
            out = sample(model, prompts, pad, (2,), cfg, generator=gen)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if k:
                times.append(time.perf_counter() - start)
                generated += int(out.response_mask.sum())
    model.train()
    seconds = statistics.median(times)
    return {"prompts": len(prompts), "new_tokens": new_tokens, "seconds_per_call": seconds,
            "tokens_per_second": generated / repeats / seconds}


def step(stage: Stage, batch: list, rows: int, budget, models) -> tuple[float, int, int]:
    """Seconds of forward + backward of one global batch, and its (real, computed) tokens."""
    sizes = [stage.length(x) for x in batch]
    parts = micro_batches(sizes, rows, budget)
    for m in models:
        m.zero_grad(set_to_none=True)
    start = time.perf_counter()
    for part in parts:
        stage.loss([batch[i] for i in part]).backward()
    if next(models[0].parameters()).device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start, *padded_tokens(sizes, parts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=16, help="examples per global batch")
    ap.add_argument("--rows", type=int, default=4, help="rows per fixed micro-batch")
    ap.add_argument("--budget", type=int, default=None,
                    help="padded tokens per micro-batch (default: --rows x the mean example length)")
    ap.add_argument("--steps", type=int, default=6, help="timed global batches per stage and mode")
    ap.add_argument("--new-tokens", type=int, default=128, help="the sampler's response budget")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    args = ap.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    device = torch.device(args.device)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=int(args.hidden * 8 / 3) // 64 * 64 or 64,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=2048, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).to(device).train()
    rm_cfg = {k: v for k, v in cfg.to_dict().items() if k not in ("id2label", "label2id")}
    rm_model = LlamaForSequenceClassification(LlamaConfig(**rm_cfg, num_labels=1)).to(device).train()
    embedding = model.get_input_embeddings().weight.numel()
    n_params = sum(p.numel() for p in model.parameters()) - embedding         # non-embedding, the head included
    n_critic = sum(p.numel() for p in rm_model.parameters()) - rm_model.get_input_embeddings().weight.numel()
    gen = torch.Generator().manual_seed(0)
    n_items = args.batch * (args.steps + 1) * 2
    work = stages(model, rm_model, args.vocab, n_items, gen)
    peak, peak_source = peak_flops(device)
    rows = []
    for stage in work:
        mean = statistics.mean(stage.length(x) for x in stage.items)
        budget = args.budget if args.budget is not None else int(args.rows * mean)
        models = [rm_model] if stage.name == "reward" else [model]
        flops_per_token = 6 * (n_params + n_critic) if stage.name == "ppo" else 6 * n_params
        times = {"rows": [], "tokens": []}
        tokens = {"rows": [0, 0], "tokens": [0, 0]}
        for k in range(args.steps + 1):                 # the first global batch warms up
            batch = stage.items[k * args.batch:(k + 1) * args.batch]
            for mode in (("rows", "tokens") if k % 2 else ("tokens", "rows")):
                cut = budget if mode == "tokens" else None
                seconds, real, computed = (stage.run(batch, args.rows, cut) if stage.run is not None
                                           else step(stage, batch, args.rows, cut, models))
                if k:
                    times[mode].append(seconds)
                    tokens[mode] = [tokens[mode][0] + real, tokens[mode][1] + computed]
        row = {"stage": stage.name, "budget": budget, "micro_rows": args.rows, "flops_per_token": flops_per_token}
        for mode in ("rows", "tokens"):
            seconds = statistics.median(times[mode])
            real, computed = tokens[mode]
            per_second = real / args.steps / seconds
            row[mode] = {"seconds_per_batch": seconds, "tokens_per_second": per_second,
                         "pad_share": 1 - real / computed, "mfu": flops_per_token * per_second / peak}
        row["speedup"] = row["rows"]["seconds_per_batch"] / row["tokens"]["seconds_per_batch"]
        rows.append(row)
        print(f"{stage.name:7s} fixed {args.rows} rows: {row['rows']['tokens_per_second']:8.0f} tok/s, pad "
              f"{row['rows']['pad_share']:.0%}, MFU {row['rows']['mfu']:.1%} | budget {budget} tokens: "
              f"{row['tokens']['tokens_per_second']:8.0f} tok/s, pad {row['tokens']['pad_share']:.0%}, MFU "
              f"{row['tokens']['mfu']:.1%} | speedup x{row['speedup']:.2f}", flush=True)
    prompts = [p for p, _ in work[0].items[:args.batch]]
    sampler = sampler_speed(model, prompts, args.new_tokens, max(args.steps // 2, 1), 0)
    print(f"sampler {sampler['prompts']} prompts, up to {args.new_tokens} new tokens: "
          f"{sampler['tokens_per_second']:8.0f} new tok/s ({sampler['seconds_per_call']:.2f} s a call)", flush=True)
    result = {"machine": machine() if device.type == "cpu" else torch.cuda.get_device_name(device),
              "threads": torch.get_num_threads(), "torch": torch.__version__,
              "model": {"hidden": args.hidden, "layers": args.layers, "heads": args.heads, "vocab": args.vocab,
                        "non_embedding_params": n_params},
              "batch": args.batch, "steps": args.steps, "peak_flops": peak, "peak_source": peak_source,
              "lengths": "prompts 50-500 (log-normal around 150), responses 20-300 (uniform)",
              "stages": rows, "sampler": sampler}
    if args.out:
        atomic_write_text(Path(args.out), json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    raise SystemExit(main())
