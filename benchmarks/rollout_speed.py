"""Our sampler's rollout options against its default, on a trained SFT policy's rollouts.

    .venv/bin/python benchmarks/rollout_speed.py [--sft outputs/sft/model] [--data data/prepared]
        [--params params.yaml] [--batch 64] [--max-new-tokens 128] [--repeats 3]

Samples `--batch` training prompts as PPO's rollout does (one random stream, `ppo.sampling` with
`--max-new-tokens`), four ways, interleaved `--repeats` times so that drift of a shared machine hits
all alike: the default (every row in one batch to the end), `rollout_drop_finished` (ended rows
leave the batch), `rollout_micro_batch_size` = batch / 4 (the KV cache of a quarter of the rows at a
time), and both. Prints the median seconds each, the tokens sampled, the ratio default / way, and
the KV cache each way holds at its longest (the memory the sub-batches exist to save). Before
timing it checks that dropping ended rows changes no response when each row has its own stream
(the sampler's equivalence; with one stream the samples differ, as the params say).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.config import load_params  # noqa: E402
from pipeline.data.inputs import prompt_records  # noqa: E402
from pipeline.data.tokenizer import encode_prompt, load_tokenizer  # noqa: E402
from pipeline.models.generation import stop_ids  # noqa: E402
from pipeline.models.rollout_engine import TORCH, Request  # noqa: E402
from pipeline.training import memory_terms as mt  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sft", default=str(ROOT / "outputs/sft/model"))
    ap.add_argument("--data", default=str(ROOT / "data/prepared"))
    ap.add_argument("--params", default=str(ROOT / "params.yaml"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    from transformers import AutoModelForCausalLM

    params = load_params(Path(args.params))
    cfg = params.ppo.sampling.__class__(**{**vars(params.ppo.sampling), "max_new_tokens": args.max_new_tokens})
    model = AutoModelForCausalLM.from_pretrained(args.sft).eval()
    tok = load_tokenizer(Path(args.sft))
    records = prompt_records(params, Path(args.data), "train")
    prompts = [encode_prompt(tok, p, params.ppo.max_prompt_length) for _, p in records[:args.batch]]
    stops = tuple(stop_ids(tok, model, cfg))
    quarter = max(1, len(prompts) // 4)
    ways = {"default": {}, "drop finished": {"drop_finished": True},
            f"micro-batch {quarter}": {"micro_batch": quarter},
            f"micro-batch {quarter} + drop": {"micro_batch": quarter, "drop_finished": True}}

    def request(**kw) -> Request:
        return Request(prompts, tok.pad_token_id, stops, cfg, **kw)

    seeds = list(range(len(prompts)))
    with torch.no_grad():
        full = TORCH.generate(model, request(seeds=seeds))
        dropped = TORCH.generate(model, request(seeds=seeds, drop_finished=True))
    same = torch.equal(full.response_ids, dropped.response_ids)
    assert same, "dropping ended rows changed a response sampled from its own stream"
    lengths = full.response_mask.sum(1).float()
    print(f"rollout sampling, CPU, torch threads={torch.get_num_threads()}: {len(prompts)} prompts, up to "
          f"{cfg.max_new_tokens} new tokens; response lengths min {lengths.min():.0f} median "
          f"{lengths.median():.0f} max {lengths.max():.0f}; drop-finished responses equal with row streams: {same}")

    times: dict[str, list[float]] = {w: [] for w in ways}
    tokens: dict[str, int] = {}
    for r in range(args.repeats):
        for way, kw in ways.items():
            gen = torch.Generator().manual_seed(r)
            t0 = time.perf_counter()
            out = TORCH.generate(model, request(stream=gen, **kw))
            times[way].append(time.perf_counter() - t0)
            tokens[way] = int(out.response_mask.sum())
    shape = mt.shape_of(model.config)
    P = max(map(len, prompts))
    base = statistics.median(times["default"])
    for way, kw in ways.items():
        t = statistics.median(times[way])
        rows = kw.get("micro_batch") or len(prompts)
        kv = mt.kv_cache_bytes(shape, rows, P + cfg.max_new_tokens, 4)
        print(f"  {way:28s} {t:7.2f} s  {tokens[way]:6d} tokens  {base / t:5.2f}x  KV cache at its longest "
              f"{kv / 2**20:7.2f} MiB")
    print(f"RATIO rollout default/drop-finished: {base / statistics.median(times['drop finished']):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
