"""PPO throughput: this pipeline's trainer against TRL's (`trl.experimental.ppo`, trl==1.12.0) on
identical work, on CPU.

Identical work: the same tiny policy, value and reward models (built once from one config, the
policy briefly SFT-trained, and saved; both load the same weights), the same prompts (token ids), batch of 64 prompts per update,
responses of at most 48 tokens sampled at temperature 1, 4 PPO epochs over one minibatch of 64 in
micro-batches of 16, KL coefficient 0.05, learning rate 1e-4 for policy and value, no reward
whitening, no missing-EOS penalty. Each repetition runs one trainer in a fresh process (so peak
memory is that trainer's), alternating ours and TRL's; the first update of each is warm-up and
not timed.

    make bench                     # all benchmarks (installs the optional `bench` group: trl)
    .venv/bin/python benchmarks/ppo_vs_trl.py --reps 3 --updates 4

Prints per trainer episodes/s (the ratio is taken on these), tokens/s (ours: response tokens up to
and including eos; TRL: every token it generates, always 48 per prompt, truncated after eos
afterwards), peak resident memory, and the ratio ours/TRL over the paired repetitions (mean,
min-max).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH, MICRO, EPOCHS, RESPONSE, KL, LR, SEED = 64, 16, 4, 48, 0.05, 1e-4, 0


def build(out: Path, sft_epochs: float = 1.0) -> None:
    """Data, tokenizer, and the shared initial weights: policy (= reference) and reward (= value).

    The policy is the default tiny model after a short SFT (one epoch on 2000 demonstrations), so
    responses end with eos at realistic lengths, as they do when PPO starts from an SFT model."""
    from pipeline.models import reward_model as rm
    from pipeline.stages import sft
    from pipeline.config import DataConfig, ModelConfig, Params, SFTConfig
    from pipeline.models.checkpoints import init_policy, load_policy, save_checkpoint
    from pipeline.stages.prepare import write as prepare

    prepare(DataConfig(n_sft=2000, n_sft_eval=16, n_pairs=8, n_pairs_eval=4, n_ppo_prompts=1024, n_eval_prompts=8),
            out / "data")
    if sft_epochs > 0:
        params = Params(sft=SFTConfig(epochs=sft_epochs, eval_every=10 ** 6, n_eval_generations=8, seed=SEED))
        # The stage itself (its model/ is the policy); MLflow off: a benchmark is not a tracked run.
        os.environ.setdefault("PIPELINE_TRACKING", "off")
        sft.run(params, out / "data", out / "sft", progress=False)
        policy, tok = load_policy(out / "sft" / "model")
    else:
        policy, tok = init_policy(ModelConfig(), out / "data" / "tokenizer", seed=SEED)
    save_checkpoint(policy, tok, out / "policy")
    reward, _ = rm.init_reward_model(out / "policy", seed=SEED, head_std=None)
    save_checkpoint(reward, tok, out / "reward")


def prompts(out: Path) -> list[str]:
    from pipeline.data.records import load_prompts
    return [p for _, p in load_prompts(out / "data" / "ppo_prompts.jsonl")]


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_ours(out: Path, updates: int) -> dict:
    import torch

    from pipeline.config import Params, PPOConfig, SamplingConfig
    from pipeline.ppo.placement import place_models
    from pipeline.ppo.trainer import PPOTrainer

    torch.manual_seed(SEED)
    cfg = PPOConfig(iterations=updates + 1, rollout_batch_size=BATCH, minibatch_size=BATCH, micro_batch_size=MICRO,
                    ppo_epochs=EPOCHS, lr=LR, critic_lr=LR, kl_coef=KL, missing_eos_score=None,
                    adaptive_kl=False, lr_schedule="linear",   # TRL's: a fixed coefficient, a linear decay
                    sampling=SamplingConfig(max_new_tokens=RESPONSE, temperature=1.0), seed=SEED)
    params = Params(ppo=cfg)
    models = place_models(params, out / "policy", out / "reward")
    trainer = PPOTrainer(cfg, models, prompts(out))
    trainer.step()                                   # warm-up
    t0, tokens = time.perf_counter(), 0.0
    for _ in range(updates):
        stats = trainer.step()
        tokens += stats["objective/response_length"] * BATCH
    seconds = time.perf_counter() - t0
    return {"episodes_per_s": updates * BATCH / seconds, "tokens_per_s": tokens / seconds, "seconds": seconds,
            "peak_rss_mb": peak_rss_mb()}


def run_trl(out: Path, updates: int) -> dict:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    from pipeline.data.tokenizer import encode_prompt, load_tokenizer

    torch.manual_seed(SEED)
    tok = load_tokenizer(out / "policy")
    tok.padding_side = "left"
    ids = [encode_prompt(tok, p) for p in prompts(out)]
    dataset = Dataset.from_dict({"input_ids": ids})
    policy = AutoModelForCausalLM.from_pretrained(out / "policy")
    ref = AutoModelForCausalLM.from_pretrained(out / "policy")
    reward = AutoModelForSequenceClassification.from_pretrained(out / "reward")
    value = AutoModelForSequenceClassification.from_pretrained(out / "reward")

    class Clock(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter())

    clock = Clock()
    with tempfile.TemporaryDirectory() as tmp:
        args = PPOConfig(output_dir=tmp, per_device_train_batch_size=MICRO, gradient_accumulation_steps=BATCH // MICRO,
                         num_mini_batches=1, num_ppo_epochs=EPOCHS, response_length=RESPONSE, temperature=1.0,
                         total_episodes=BATCH * (updates + 1), learning_rate=LR, kl_coef=KL, stop_token="eos",
                         missing_eos_penalty=None, local_rollout_forward_batch_size=BATCH, num_sample_generations=0,
                         report_to=[], save_strategy="no", logging_steps=10 ** 6, use_cpu=True, seed=SEED,
                         dataloader_num_workers=0, disable_tqdm=True)
        trainer = PPOTrainer(args=args, processing_class=tok, model=policy, ref_model=ref, reward_model=reward,
                             value_model=value, train_dataset=dataset, callbacks=[clock])
        start = time.perf_counter()
        trainer.train()
    times = [start, *clock.times]
    seconds = times[-1] - times[1]                   # the first update is warm-up
    # TRL generates RESPONSE tokens for every prompt and truncates after eos afterwards: its tokens/s
    # counts all it generated (more than ours, which stops each response at eos).
    return {"episodes_per_s": updates * BATCH / seconds, "tokens_per_s": updates * BATCH * RESPONSE / seconds,
            "seconds": seconds,
            "peak_rss_mb": peak_rss_mb()}


def worker(kind: str, out: Path, updates: int) -> None:
    result = (run_ours if kind == "ours" else run_trl)(out, updates)
    print("RESULT " + json.dumps(result), flush=True)


def spawn(kind: str, out: Path, updates: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, "--dir", str(out), "--updates", str(updates)],
                          capture_output=True, text=True, env={**os.environ, "PIPELINE_TRACKING": "off"})
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"{kind} worker failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def summary(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--updates", type=int, default=4, help="timed PPO updates per repetition (after one warm-up)")
    ap.add_argument("--random-policy", action="store_true",
                    help="untrained policy (responses rarely end: no early stop to gain from)")
    ap.add_argument("--worker", choices=("ours", "trl"))
    ap.add_argument("--dir", type=Path)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.dir, args.updates)
        return 0
    import torch
    print(f"PPO throughput, ours vs TRL 1.12.0 (trl.experimental.ppo), CPU, torch threads={torch.get_num_threads()}")
    print(f"policy: {'untrained (random weights)' if args.random_policy else 'default tiny model after 1 epoch of SFT'}")
    print(f"work: {BATCH} prompts/update, <= {RESPONSE} response tokens, {EPOCHS} epochs x 1 minibatch of {BATCH}, "
          f"micro-batch {MICRO}; {args.updates} timed updates x {args.reps} repetitions (alternating)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        build(out, sft_epochs=0.0 if args.random_policy else 1.0)
        runs: dict[str, list[dict]] = {"ours": [], "trl": []}
        for rep in range(args.reps):
            for kind in ("ours", "trl") if rep % 2 == 0 else ("trl", "ours"):
                runs[kind].append(spawn(kind, out, args.updates))
                r = runs[kind][-1]
                print(f"  rep {rep + 1} {kind:4s}: {r['episodes_per_s']:7.2f} episodes/s, "
                      f"{r['tokens_per_s']:8.0f} tokens/s, peak RSS {r['peak_rss_mb']:6.0f} MB", flush=True)
    ratios = [o["episodes_per_s"] / t["episodes_per_s"] for o, t in zip(runs["ours"], runs["trl"])]
    mem = [o["peak_rss_mb"] / t["peak_rss_mb"] for o, t in zip(runs["ours"], runs["trl"])]
    print(f"ours: {summary([r['episodes_per_s'] for r in runs['ours']])} episodes/s, "
          f"{summary([r['tokens_per_s'] for r in runs['ours']])} tokens/s, "
          f"peak RSS {summary([r['peak_rss_mb'] for r in runs['ours']])} MB")
    print(f"TRL:  {summary([r['episodes_per_s'] for r in runs['trl']])} episodes/s, "
          f"peak RSS {summary([r['peak_rss_mb'] for r in runs['trl']])} MB")
    print(f"RATIO ours/TRL episodes/s: {statistics.mean(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f}); "
          f"peak memory ours/TRL: {statistics.mean(mem):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
