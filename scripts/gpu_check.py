"""GPU check: PPO with DeepSpeed ZeRO-3 and bf16 on a ~1B-parameter model built from a config.

Random weights, the default task's prompts and tokenizer, no download. Prints, as soon as each is
measured: the models' sizes, the GPU memory each model takes when placed, then per iteration the
rollout and update throughput, the peak GPU memory and the model FLOPs utilisation (MFU). A step
that fails is reported and the numbers measured so far stay printed.

    bash scripts/gpu_check.sh            # on a GPU machine (about 3-5 minutes on one H100/H200)
    bash scripts/gpu_check.sh --tiny     # the same code path on CPU with a tiny model (a smoke test)

MFU counts model FLOPs only (Kaplan et al. 2020: 2N per token forward, 6N forward+backward, N the
non-embedding parameters, attention ignored): rollout 2N per generated token, scoring 2N per token
for each of the four models, update 6N per token for actor and critic per PPO epoch. Peak is the
GPU's dense bf16 rate (H100/H200 SXM: 989 TFLOP/s; set GPU_PEAK_TFLOPS for other GPUs).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipeline.training import distributed  # noqa: E402
from pipeline.models import reward_model as rm  # noqa: E402
from pipeline.config import (
    DataConfig, DistributedConfig, ModelConfig, Params, PPOConfig, RewardConfig, SamplingConfig,
)
from pipeline.data.records import load_prompts  # noqa: E402
from pipeline.models.checkpoints import init_policy, save_checkpoint  # noqa: E402
from pipeline.ppo.placement import place_models  # noqa: E402
from pipeline.ppo.trainer import PPOTrainer  # noqa: E402
from pipeline.stages.prepare import run as prepare  # noqa: E402

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}

# ~1.03B parameters: 20 blocks of hidden 2048 (attention 4 x 2048^2, SwiGLU MLP 3 x 2048 x 5632).
BIG = ModelConfig(hidden_size=2048, num_layers=20, num_heads=16, intermediate_size=5632, max_position_embeddings=256)
TINY = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)


def say(*parts: object) -> None:
    print(*parts, flush=True)


def peak_tflops() -> float | None:
    if "GPU_PEAK_TFLOPS" in os.environ:
        return float(os.environ["GPU_PEAK_TFLOPS"])
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny model on whatever device there is (smoke test)")
    ap.add_argument("--iterations", type=int, default=4)
    args = ap.parse_args()
    cuda = torch.cuda.is_available()
    say(f"gpu_check: {time.strftime('%Y-%m-%d %H:%M:%S')} device="
        f"{torch.cuda.get_device_name() if cuda else 'cpu'} torch={torch.__version__}")
    model_cfg = TINY if args.tiny else BIG
    precision = "bf16" if cuda else "fp32"
    rollout, minibatch, micro, new_tokens = (64, 32, 16, 64) if not args.tiny else (8, 4, 2, 16)
    dist = DistributedConfig(backend="deepspeed", zero_stage=3, precision=precision)
    params = Params(
        model=model_cfg, reward=RewardConfig(max_length=model_cfg.max_position_embeddings),
        ppo=PPOConfig(iterations=args.iterations, rollout_batch_size=rollout, minibatch_size=minibatch,
                      micro_batch_size=micro, ppo_epochs=1, save_every=10 ** 6,
                      sampling=SamplingConfig(max_new_tokens=new_tokens), distributed=dist))
    results: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        prepare(DataConfig(n_sft=8, n_sft_eval=4, n_pairs=8, n_pairs_eval=4, n_ppo_prompts=512, n_eval_prompts=8),
                root / "data")
        policy, tok = init_policy(model_cfg, root / "data" / "tokenizer", seed=0)
        n_params = sum(p.numel() for p in policy.parameters())
        n_embed = policy.get_input_embeddings().weight.numel()
        save_checkpoint(policy, tok, root / "sft")
        del policy
        reward, _ = rm.init_reward_model(root / "sft", seed=0, head_std=None)
        save_checkpoint(reward, tok, root / "rm")
        del reward
        say(f"model: {n_params / 1e9:.3f}B parameters ({(n_params - n_embed) / 1e9:.3f}B non-embedding), "
            f"built from config in {time.perf_counter() - t0:.1f}s; precision {precision}, ZeRO-3")
        ctx = distributed.init(dist)
        try:
            t0 = time.perf_counter()
            models = place_models(params, root / "sft", root / "rm", ctx)
            say(f"placed actor, critic (training engines), reference, reward (ZeRO-3 inference engines) "
                f"in {time.perf_counter() - t0:.1f}s")
            for name, gib in (models.memory or {}).items():
                say(f"  GPU memory added by {name:9s}: {gib:7.2f} GiB (weights; the trained ones with fp32 master copies)")
            trainer = PPOTrainer(params.ppo, models, [p for _, p in load_prompts(root / "data" / "ppo_prompts.jsonl")])
            n = n_params - n_embed
            peak = peak_tflops()
            for it in range(1, args.iterations + 1):
                t0 = time.perf_counter()
                stats = trainer.step()
                seconds = time.perf_counter() - t0
                gen_tokens = stats["objective/response_length"] * rollout
                seq_tokens = gen_tokens + rollout * 12   # prompts are ~12 tokens
                flops = 2 * n * gen_tokens + 4 * 2 * n * seq_tokens + 2 * 6 * n * seq_tokens * params.ppo.ppo_epochs
                line = (f"iteration {it}: rollout {stats['tokens_per_second/rollout']:,.0f} tok/s, "
                        f"update {stats['tokens_per_second/update']:,.0f} tok/s, "
                        f"{seconds:.1f}s, {flops / seconds / 1e12:.1f} TFLOP/s")
                if peak:
                    line += f", MFU {100 * flops / seconds / (peak * 1e12):.1f}%"
                if "memory/peak_gib" in stats:
                    line += f", peak GPU memory {stats['memory/peak_gib']:.1f} GiB (all four models + Adam states)"
                say(line)
                results[f"iteration_{it}"] = stats
            say("gpu_check: done")
            return 0
        except Exception:   # keep what was printed; say where it stopped
            say("gpu_check: FAILED at the step below; the numbers above stand")
            traceback.print_exc()
            return 1
        finally:
            distributed.shutdown(ctx)


if __name__ == "__main__":
    sys.exit(main())
