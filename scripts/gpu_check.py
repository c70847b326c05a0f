"""GPU check: PPO with DeepSpeed ZeRO-3 and bf16 on a ~1B-parameter model built from a config.

Random weights, the default task's prompts and tokenizer, no download. Prints, as soon as each is
measured:
- the memory plan of `python -m pipeline plan --stage ppo` for this very config (the params file it
  writes is read back by the CLI's loader first), then the GPU memory each placed model took and,
  after the iterations, the measured peak, each next to the plan's row;
- per iteration: rollout and update throughput, TFLOP/s and the model FLOPs utilisation (MFU), the
  peak GPU memory, and the sampler/trainer log-prob difference `val/logprob_diff_mean`/`_max` and
  the first minibatch's ratio (`val/first_ratio_max_dev` = max |ratio - 1| before any update);
  odd iterations recompute pi_old's log-probs by a training forward (recompute on), even ones reuse
  the sampler's (recompute off; the difference is then measured on `ppo.logprob_check_rows`
  rollouts), so one run shows what bf16 on a GPU does to each, even when it stops early.
A step that fails is reported and the numbers measured so far stay printed; `--out` writes them
all as JSON (also when it stops early).

    bash scripts/gpu_check.sh --install-wheels .whl   # the GPU machine (README: GPU check)
    bash scripts/gpu_check.sh --tiny                  # the same code path on CPU with a tiny model

MFU counts model FLOPs only (Kaplan et al. 2020: 2N per token forward, 6N forward+backward, N the
non-embedding parameters, attention ignored): the rollout 2N per prompt and generated token, the
scoring 2N per sequence token for each model run over the rollout (reference, critic, reward, and
the actor when it recomputes), the update 6N per sequence token for actor and critic per PPO epoch.
Peak is the GPU's dense bf16 rate (H100/H200 SXM: 989 TFLOP/s; set GPU_PEAK_TFLOPS for others).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

STARTED = time.perf_counter()   # --budget-s counts from here, the imports below included
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipeline.config import (  # noqa: E402
    DataConfig, DistributedConfig, ModelConfig, Params, PPOConfig, RewardConfig, SamplingConfig, load_params,
    to_dict,
)
from pipeline.data.io import atomic_write_json, atomic_write_text  # noqa: E402
from pipeline.data.records import load_prompts  # noqa: E402
from pipeline.data.tokenizer import encode_prompt  # noqa: E402
from pipeline.errors import ConfigError  # noqa: E402
from pipeline.models import reward_model as rm  # noqa: E402
from pipeline.models.checkpoints import init_policy, save_checkpoint  # noqa: E402
from pipeline.ppo.placement import place_models  # noqa: E402
from pipeline.ppo.trainer import PPOTrainer  # noqa: E402
from pipeline.stages.prepare import run as prepare  # noqa: E402
from pipeline.training import distributed  # noqa: E402

PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "H800": 989.0, "A100": 312.0, "A800": 312.0, "L40S": 362.0}
GIB = 2 ** 30

# ~1.03B parameters: 20 blocks of hidden 2048 (attention 4 x 2048^2, SwiGLU MLP 3 x 2048 x 5632).
BIG = ModelConfig(hidden_size=2048, num_layers=20, num_heads=16, intermediate_size=5632, max_position_embeddings=256)
TINY = ModelConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128)
# The default task's prompts are ~12 tokens: 32 bounds them without cutting, and keeps the plan's
# activation and KV-cache rows (sized for the longest allowed prompt) near what is really used.
MAX_PROMPT = 32


def say(*parts: object) -> None:
    print(*parts, flush=True)


def peak_tflops() -> float | None:
    if "GPU_PEAK_TFLOPS" in os.environ:
        return float(os.environ["GPU_PEAK_TFLOPS"])
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((v for k, v in PEAK_TFLOPS.items() if k in name), None)


def check_params(tiny: bool, iterations: int, cuda: bool) -> Params:
    """The check's whole config: ZeRO-3, bf16 on a GPU (fp32 on the CPU, where bf16 matmuls are
    emulated and slow), the big model or the tiny one."""
    model_cfg = TINY if tiny else BIG
    rollout, minibatch, micro, new_tokens = (8, 4, 2, 16) if tiny else (64, 32, 16, 64)
    dist = DistributedConfig(backend="deepspeed", zero_stage=3, precision="bf16" if cuda else "fp32")
    return Params(
        model=model_cfg, reward=RewardConfig(max_length=model_cfg.max_position_embeddings),
        ppo=PPOConfig(iterations=iterations, rollout_batch_size=rollout, minibatch_size=minibatch,
                      micro_batch_size=micro, ppo_epochs=1, save_every=10 ** 6, max_prompt_length=MAX_PROMPT,
                      sampling=SamplingConfig(max_new_tokens=new_tokens), distributed=dist))


def write_params(params: Params, path: Path) -> Params:
    """`params` as a params file (JSON is YAML 1.2), read back by the CLI's loader: the file that
    `python -m pipeline plan --params` would read, and proof that it holds this config."""
    atomic_write_text(path, json.dumps(to_dict(params), indent=1) + "\n")
    loaded = load_params(path)
    if loaded != params:
        raise RuntimeError(f"{path}: reading the written params back gave another config")
    return loaded


def memory_plan(params: Params, data_dir: Path) -> dict[str, Any] | None:
    """Print `python -m pipeline plan --stage ppo` for `params` (the CLI's own code, after its
    loader), and return its rows in GiB per rank; None when the plan module is not there."""
    try:
        from pipeline.training import memory_plan as mp
    except ImportError as err:   # the check still runs without it
        say(f"memory plan: not available ({err})")
        return None
    say(f"memory plan (python -m pipeline plan --params {data_dir.parent / 'params.yaml'} --data {data_dir} "
        "--stage ppo):")
    try:
        mp.main(params, data_dir, "ppo")
    except ConfigError as err:   # a plan that does not fit: measure anyway, that is what the check is for
        say(f"memory plan: REFUSES this config ({err}); measuring anyway")
    plan = mp.planned(params, data_dir, ("ppo",))[0]
    available, source = mp.device_memory(params.ppo.distributed)
    rows = {k: v / GIB for k, v in plan.device.items()}
    trained = rows["weights"] + rows["grads"] + rows["optimizer"]
    return {**rows, "trained": trained, "placed": trained + rows["frozen"], "total": plan.total / GIB,
            "device": available / GIB, "device_source": source}


def rss_gib() -> float:
    import psutil
    return psutil.Process().memory_info().rss / GIB


def max_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB   # Linux: KiB


def comparison(plan: dict[str, Any] | None, measured: dict[str, float], where: str) -> list[str]:
    """Measured memory next to the plan's rows (GiB per rank), with their ratio."""
    rows = [("trained models (actor + critic)", "trained", "placed_trained",
             "weights, grads, optimizer: ZeRO-3 makes AdamW's states as it is built"),
            ("frozen models (reference + reward)", "frozen", "placed_frozen", "weights"),
            ("all four models placed", "placed", "placed_all", "the two rows above"),
            ("peak over an iteration", "total", "peak", "everything, with max(activations, KV cache)")]
    lines = [f"memory, GiB per rank: plan (python -m pipeline plan) vs measured ({where})"]
    for label, plan_key, key, note in rows:
        p = plan.get(plan_key) if plan else None
        m = measured.get(key)
        ratio = f"  measured/plan {m / p:.2f}" if p and m is not None else ""
        lines.append(f"  {label:36s} plan {'n/a' if p is None else f'{p:9.3f}'}  measured "
                     f"{'n/a' if m is None else f'{m:9.3f}'}{ratio}   ({note})")
    return lines


def model_flops(n: float, prompt_tokens: float, gen_tokens: float, models_scored: int, epochs: int) -> dict[str, float]:
    """Model FLOPs of one iteration's phases (see the module doc); token counts over the batch."""
    seq = prompt_tokens + gen_tokens
    return {"rollout": 2 * n * seq, "scoring": 2 * n * seq * models_scored, "update": 2 * 6 * n * seq * epochs}


def iteration_line(it: int, mode: str, stats: dict[str, float], flops: dict[str, float],
                   peak: float | None) -> str:
    seconds = stats["time/rollout"] + stats["time/scoring"] + stats["time/update"]
    total = sum(flops.values()) / seconds
    line = (f"iteration {it}: recompute {mode}, rollout {stats['tokens_per_second/rollout']:,.0f} tok/s, "
            f"update {stats['tokens_per_second/update']:,.0f} tok/s, {seconds:.1f}s "
            f"(rollout {stats['time/rollout']:.1f}, scoring {stats['time/scoring']:.1f}, update "
            f"{stats['time/update']:.1f}), {total / 1e12:.1f} TFLOP/s")
    if peak:
        line += (f", MFU {100 * total / (peak * 1e12):.1f}% (update alone "
                 f"{100 * flops['update'] / stats['time/update'] / (peak * 1e12):.1f}%)")
    if "memory/peak_gib" in stats:
        line += f", peak GPU memory {stats['memory/peak_gib']:.2f} GiB"
    line += (f"; logprob_diff mean {stats['val/logprob_diff_mean']:.2e} max {stats['val/logprob_diff_max']:.2e}, "
             f"first minibatch |ratio - 1| mean {stats['val/first_ratio_mean_dev']:.2e} "
             f"max {stats['val/first_ratio_max_dev']:.2e}")
    return line


def summary_lines(results: dict[str, Any]) -> list[str]:
    """Per recompute mode: the largest log-prob difference and first-minibatch ratio deviation seen."""
    lines = []
    for mode in ("on", "off"):
        its = [r for r in results["iterations"] if r["recompute"] == mode]
        if not its:
            continue
        worst = {k: max(r[k] for r in its) for k in
                 ("val/logprob_diff_mean", "val/logprob_diff_max", "val/first_ratio_max_dev")}
        lines.append(f"recompute {mode:3s}: val/logprob_diff_mean {worst['val/logprob_diff_mean']:.2e}, "
                     f"val/logprob_diff_max {worst['val/logprob_diff_max']:.2e}, first minibatch max |ratio - 1| "
                     f"{worst['val/first_ratio_max_dev']:.2e} (worst of {len(its)} iterations)")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="tiny model on whatever device there is (smoke test)")
    ap.add_argument("--iterations", type=int, default=4, help="odd ones with recompute on, even ones off")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="skip an iteration that would end after this many seconds from the process's start")
    ap.add_argument("--out", type=Path, default=None, help="write every number measured as JSON here")
    args = ap.parse_args(argv)
    if args.iterations < 2:
        ap.error("--iterations: at least 2 (one with recompute on, one off)")
    start = STARTED
    cuda = torch.cuda.is_available()
    device = torch.cuda.get_device_name() if cuda else "cpu"
    import transformers
    say(f"gpu_check: {time.strftime('%Y-%m-%d %H:%M:%S')} device={device} torch={torch.__version__} "
        f"transformers={transformers.__version__}")
    params = check_params(args.tiny, args.iterations, cuda)
    results: dict[str, Any] = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
                               "tiny": args.tiny, "precision": params.ppo.distributed.precision, "iterations": []}

    def save() -> None:
        if args.out is not None:
            atomic_write_json(args.out, results)

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ctx = None
        try:
            t0 = time.perf_counter()
            prepare(DataConfig(n_sft=8, n_sft_eval=4, n_pairs=8, n_pairs_eval=4, n_ppo_prompts=512, n_eval_prompts=8),
                    root / "data")
            params = write_params(params, root / "params.yaml")
            policy, tok = init_policy(params.model, root / "data" / "tokenizer", seed=0)
            n_params = sum(p.numel() for p in policy.parameters())
            n = n_params - policy.get_input_embeddings().weight.numel()
            save_checkpoint(policy, tok, root / "sft")
            del policy
            reward, _ = rm.init_reward_model(root / "sft", seed=0, head_std=None)
            save_checkpoint(reward, tok, root / "rm")
            del reward
            results.update(params_total=n_params, params_non_embedding=n)
            say(f"model: {n_params / 1e9:.3f}B parameters ({n_params:,}; {n:,} non-embedding), built from config "
                f"in {time.perf_counter() - t0:.1f}s; precision {params.ppo.distributed.precision}, ZeRO-3")

            plan = memory_plan(params, root / "data")
            results["plan_gib"] = plan
            save()

            ctx = distributed.init(params.ppo.distributed)
            t0, rss0 = time.perf_counter(), rss_gib()
            models = place_models(params, root / "sft", root / "rm", ctx)
            say(f"placed actor, critic (training engines), reference, reward (ZeRO-3 inference engines) "
                f"in {time.perf_counter() - t0:.1f}s")
            measured: dict[str, float] = {}
            if models.memory:   # CUDA: memory_allocated deltas as each model was placed
                for name, gib in models.memory.items():
                    say(f"  GPU memory added by {name:9s}: {gib:7.3f} GiB")
                measured["placed_trained"] = models.memory.get("actor", 0.0) + models.memory.get("critic", 0.0)
                measured["placed_frozen"] = models.memory.get("reference", 0.0) + models.memory.get("reward", 0.0)
                measured["placed_all"] = sum(models.memory.values())
                torch.cuda.reset_peak_memory_stats()   # the iterations' peak, not the loading's
                where = "torch.cuda.memory_allocated"
            else:               # CPU: resident set growth, library and allocator overhead included
                measured["placed_all"] = rss_gib() - rss0
                say(f"  resident memory added by placing the four models: {measured['placed_all']:.3f} GiB")
                where = "CPU: RSS growth, per model n/a"
            results["measured_gib"] = measured

            prompts = [p for _, p in load_prompts(root / "data" / "ppo_prompts.jsonl")]
            prompt_tokens = sum(len(encode_prompt(models.tok, p, MAX_PROMPT)) for p in prompts) / len(prompts)
            peak = peak_tflops()
            trainers = {mode: PPOTrainer(dataclasses.replace(params.ppo, recompute_logprobs=mode == "on"), models,
                                         prompts) for mode in ("on", "off")}
            for mode, trainer in trainers.items():
                say(f"recompute {mode}: {trainer.recompute_reason}")
            last = 0.0
            for it in range(1, args.iterations + 1):
                if args.budget_s is not None and time.perf_counter() - start + 1.5 * last > args.budget_s:
                    say(f"gpu_check: stopping before iteration {it}: it would pass the {args.budget_s:.0f} s budget")
                    break
                mode = "on" if it % 2 else "off"
                t0 = time.perf_counter()
                stats = trainers[mode].step()
                last = time.perf_counter() - t0
                gen = stats["objective/response_length"] * params.ppo.rollout_batch_size
                flops = model_flops(n, prompt_tokens * params.ppo.rollout_batch_size, gen, 4 if mode == "on" else 3,
                                    params.ppo.ppo_epochs)
                say(iteration_line(it, mode, stats, flops, peak))
                results["iterations"].append({"iteration": it, "recompute": mode, "seconds": last, "flops": flops,
                                              **stats})
                if "memory/peak_gib" in stats:
                    measured["peak"] = max(measured.get("peak", 0.0), stats["memory/peak_gib"])
                save()
            if not cuda:
                measured["peak"] = max_rss_gib() - rss0   # growth of the process's peak RSS since placing
            for line in comparison(plan, measured, where):
                say(line)
            for line in summary_lines(results):
                say(line)
            results["seconds"] = time.perf_counter() - start
            save()
            done = len(results["iterations"])
            if done < args.iterations:
                modes = {r["recompute"] for r in results["iterations"]}
                say(f"gpu_check: stopped early: {done} of {args.iterations} iterations in {results['seconds']:.0f}s"
                    + ("" if modes == {"on", "off"} else "; recompute on and off were not both measured"))
                return 0 if modes == {"on", "off"} else 1
            say(f"gpu_check: {args.iterations} iterations, {results['seconds']:.0f}s in all")
            say("gpu_check: done")
            return 0
        except (Exception, KeyboardInterrupt):   # keep what was printed; say where it stopped
            say("gpu_check: FAILED or stopped at the step below; the numbers above stand")
            traceback.print_exc()
            results["error"] = traceback.format_exc(limit=3)
            save()
            return 1
        finally:
            if ctx is not None:
                distributed.shutdown(ctx)


if __name__ == "__main__":
    sys.exit(main())
