"""The reward model's training step with the prompt shared by chosen and rejected, against two rows.

    .venv/bin/python benchmarks/rm_shared_prompt.py [--steps 40] [--data data/prepared] [--sft outputs/sft/model]

Builds the reward model as the reward stage does (from the SFT checkpoint), then times forward +
backward of the Bradley-Terry loss on the same batches of `reward.batch_size` training pairs, both
ways, interleaved (so drift of a shared machine hits both alike): `reward.shared_prompt: true` (one
row [prompt, chosen, rejected] per pair under a block mask) and `false` (2B length-sorted rows).
Prints the tokens each way carries, including padding, the seconds per step (median) and the ratio.
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
from pipeline.data.preferences import load_pairs  # noqa: E402
from pipeline.models import reward_model as rm  # noqa: E402


def padded_tokens(lengths: list[int], max_rows: int) -> int:
    """Tokens a batch carries when its rows are length-sorted into parts of at most max_rows rows,
    each padded to its own longest row (as length_sorted_scores and branch_scores do)."""
    return sum(len(part) * max(lengths[i] for i in part) for part in rm.length_sorted_parts(lengths, max_rows))


def reward_model_setup(description: str):
    """The command line (--steps, --data, --sft) and, as the reward stage builds them, the default's
    reward config, the training pairs and the reward model from the SFT checkpoint in train mode.
    Shared by the reward-model step benchmarks."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--data", default=str(ROOT / "data/prepared"))
    ap.add_argument("--sft", default=str(ROOT / "outputs/sft/model"))
    args = ap.parse_args()
    cfg = load_params(ROOT / "params.yaml").reward
    pairs = load_pairs(Path(args.data) / "pairs_train.jsonl")
    model, tok = rm.init_reward_model(args.sft, cfg.seed, cfg.head_init_std)
    model.train()
    return args, cfg, pairs, model, tok


def main() -> None:
    args, cfg, pairs, model, tok = reward_model_setup(__doc__.splitlines()[0])
    gen = torch.Generator().manual_seed(0)
    times: dict[bool, list[float]] = {True: [], False: []}
    tokens = {True: 0, False: 0}
    for step in range(args.steps + 2):                       # the first two steps warm up
        batch = [pairs[i] for i in torch.randint(len(pairs), (cfg.batch_size,), generator=gen).tolist()]
        triples = [(p.prompt, p.chosen, p.rejected) for p in batch]
        for shared in ((True, False) if step % 2 else (False, True)):
            start = time.perf_counter()
            rc, rr = rm.pair_scores(model, tok, triples, cfg.max_length, shared_prompt=shared)
            rm.pairwise_loss_sum(rc, rr)[0].backward()
            elapsed = time.perf_counter() - start
            model.zero_grad(set_to_none=True)
            if step >= 2:
                times[shared].append(elapsed)
                if shared:
                    rows = [r for t in triples for r in rm.shared_prefix_rows(tok, *t, cfg.max_length)]
                    tokens[True] += padded_tokens([len(p) + sum(map(len, bs)) for p, bs in rows], 16)
                else:
                    seqs = [rm.encode_pair_text(tok, p, x, cfg.max_length) for p, c, r in triples for x in (c, r)]
                    tokens[False] += padded_tokens(list(map(len, seqs)), 32)
    two, one = statistics.median(times[False]), statistics.median(times[True])
    print(f"{args.steps} steps of {cfg.batch_size} pairs, threads {torch.get_num_threads()}")
    print(f"two rows per pair:  {tokens[False] / args.steps:7.0f} tokens/step (padding included), {two * 1000:6.1f} ms/step")
    print(f"shared prompt:      {tokens[True] / args.steps:7.0f} tokens/step (padding included), {one * 1000:6.1f} ms/step")
    print(f"ratio two rows / shared prompt: {two / one:.2f}x time, {tokens[False] / tokens[True]:.2f}x tokens")


if __name__ == "__main__":
    main()
