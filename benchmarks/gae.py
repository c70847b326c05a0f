"""GAE: our vectorised implementation (one loop over response positions, none over samples) against
the per-sample Python loop of seed 000 (section 16.2.4), at B=64, R=256 and B=512, R=1024.

    .venv/bin/python benchmarks/gae.py

Both compute the same advantages (checked before timing). The loop treats the state after a row's
last real token as terminal, as ours does; the seed's sketch bootstraps from the pad's value there
(see pipeline/ppo/advantages.gae), which costs the same. Prints seconds per call (best of
several) and the ratio loop / ours.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.ppo.advantages import gae  # noqa: E402


def per_sample_loop(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    gamma: float, lam: float) -> torch.Tensor:
    """The seed's formulation: for each sample, walk its response backwards in Python."""
    B, R = rewards.shape
    advantages = torch.zeros_like(rewards)
    for b in range(B):
        last = 0.0
        for t in reversed(range(R)):
            if mask[b, t] == 0:
                continue
            next_value = values[b, t + 1] if t + 1 < R and mask[b, t + 1] else 0.0
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            last = delta + gamma * lam * last
            advantages[b, t] = last
    return advantages


def best_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> int:
    torch.manual_seed(0)
    print(f"GAE, vectorised vs per-sample loop (seed 000), CPU, torch threads={torch.get_num_threads()}")
    ratios = []
    for B, R in ((64, 256), (512, 1024)):
        rewards, values = torch.randn(B, R), torch.randn(B, R)
        lengths = torch.randint(R // 4, R + 1, (B,))
        mask = torch.arange(R)[None, :] < lengths[:, None]                     # right-padded
        ours, _ = gae(rewards, values, mask, 1.0, 0.95)
        loop = per_sample_loop(rewards, values, mask, 1.0, 0.95)
        assert torch.allclose(ours, loop, atol=1e-4), "the two implementations disagree"
        t_ours = best_of(lambda: gae(rewards, values, mask, 1.0, 0.95), 5)
        t_loop = best_of(lambda: per_sample_loop(rewards, values, mask, 1.0, 0.95), 1 if B * R > 100_000 else 3)
        ratios.append(t_loop / t_ours)
        print(f"  B={B:4d} R={R:5d}: ours {1e3 * t_ours:8.2f} ms, loop {1e3 * t_loop:9.1f} ms, "
              f"RATIO loop/ours {t_loop / t_ours:7.1f}x")
    print(f"RATIO GAE loop/ours: min {min(ratios):.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
