"""The reward model's training step with the pairs' token ids kept (`reward_model.EncodedPairs`)
against tokenising every batch afresh.

    .venv/bin/python benchmarks/rm_step.py [--steps 40] [--data data/prepared] [--sft outputs/sft/model]

Builds the reward model as the reward stage does (from the SFT checkpoint) and times training steps
(encode, forward, backward, clip; no update, so both ways score the same weights) on the same
batches of `reward.batch_size` training pairs, both ways, interleaved so that drift of a shared machine hits both alike. The kept ids are
encoded before timing, as they are after the first epoch of a run. Prints the median seconds per
step each way and their ratio, and asserts the two ways give the same scores bit for bit.

First it times what a run tokenises before and during its first epoch, for every training pair:
the length check against `reward.max_length` and the rows, once per pair (three texts for the
check, then prompt + response twice for the rows, as until 2026-12-02) against each distinct prompt
and response text once (`EncodedPairs.length`, then `EncodedPairs.rows`); the rows must be equal.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.rm_shared_prompt import reward_model_setup  # noqa: E402
from pipeline.data.tokenizer import encode_prompt, encode_response  # noqa: E402
from pipeline.models import reward_model as rm  # noqa: E402


def tokenising(tok, pairs, max_length: int) -> None:
    """Seconds to check every pair's length and build its rows, per pair against per distinct text."""
    triples = [(p.prompt, p.chosen, p.rejected) for p in pairs]
    start = time.perf_counter()
    lengths = [len(encode_prompt(tok, p)) + max(len(encode_response(tok, c)), len(encode_response(tok, r)))
               for p, c, r in triples]
    rows = [rm.shared_prefix_rows(tok, *t, max_length) for t in triples]
    per_pair = time.perf_counter() - start
    start = time.perf_counter()
    kept = rm.EncodedPairs(tok, max_length)
    kept_lengths = [kept.length(t) for t in triples]
    kept_rows = [kept.rows(t) for t in triples]
    per_text = time.perf_counter() - start
    assert kept_lengths == lengths and kept_rows == rows, "kept ids changed the lengths or rows"
    print(f"set-up, {len(triples)} pairs: tokenised per pair: {per_pair * 1000:.2f} ms; each distinct text once: "
          f"{per_text * 1000:.2f} ms ({per_pair / per_text:.2f}x); lengths and rows equal")


def main() -> None:
    args, cfg, pairs, model, tok = reward_model_setup(__doc__.splitlines()[0])
    tokenising(tok, pairs, cfg.max_length)
    gen = torch.Generator().manual_seed(0)
    batches = [[(p.prompt, p.chosen, p.rejected) for p in
                (pairs[i] for i in torch.randint(len(pairs), (cfg.batch_size,), generator=gen).tolist())]
               for _ in range(args.steps + 2)]
    kept = rm.EncodedPairs(tok, cfg.max_length)
    for triples in batches:
        for t in triples:
            kept.rows(t)

    def step(triples, encoded) -> tuple[float, torch.Tensor]:
        start = time.perf_counter()
        rc, rr = rm.pair_scores(model, tok, triples, cfg.max_length, shared_prompt=cfg.shared_prompt, encoded=encoded)
        rm.pairwise_loss_sum(rc, rr)[0].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start, torch.stack([rc, rr]).detach()

    times: dict[str, list[float]] = {"afresh": [], "kept": []}
    for n, triples in enumerate(batches):                # the first two steps warm up
        order = (("afresh", None), ("kept", kept)) if n % 2 else (("kept", kept), ("afresh", None))
        scores = {}
        for name, encoded in order:
            elapsed, scores[name] = step(triples, encoded)
            if n >= 2:
                times[name].append(elapsed)
        assert torch.equal(scores["afresh"], scores["kept"]), "kept ids changed the scores"
    afresh, kept_s = statistics.median(times["afresh"]), statistics.median(times["kept"])
    print(f"{args.steps} steps of {cfg.batch_size} pairs, threads {torch.get_num_threads()}; scores bit-identical")
    print(f"tokenised afresh: {afresh * 1000:6.1f} ms/step")
    print(f"ids kept:         {kept_s * 1000:6.1f} ms/step")
    print(f"ratio afresh / kept: {afresh / kept_s:.2f}x")


if __name__ == "__main__":
    main()
