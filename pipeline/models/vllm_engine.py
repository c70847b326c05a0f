"""A colocated vLLM engine for PPO's and GRPO's rollouts (`rollout_engine: vllm`; experimental).

One engine per training process, in that process, each sampling its own rank's prompts (vLLM's
`external_launcher` backend with tensor parallelism 1 and no data-parallel group of vLLM's own, as
TRL's colocate mode and verl run it: vLLM runs in-process, so its model is reachable with
`LLM.apply_model`, and no rank waits on another's generation). The engine starts with placeholder weights and sleeps; each
`generate` wakes its weights, loads the trainer's current weights into them parameter by parameter
(by Hugging Face name, which vLLM's `load_weights` maps onto its fused layers), wakes its KV cache,
samples, and sleeps again (level 1: weights to host memory, KV cache freed), so the trainer has the
GPU back for scoring and the update.

Log-probs: the engine returns vLLM's `processed_logprobs`, the log-softmax of the logits after the
temperature, which is what our sampler returns and what the trainer recomputes, as long as nothing
else reshapes the distribution. vLLM's processed log-probs are taken after top-k and top-p too (ours
and the trainer's before), so top_k > 0 or top_p < 1 is refused with this engine (config.py's PPOConfig):
the PPO ratio and the logged mismatch would compare two different distributions. Recompute is forced
(pipeline/ppo/mismatch.py), so the engine's log-probs are measured against the trainer's
(`val/logprob_diff_*`) every iteration and never used as pi_old.

vLLM is an optional extra that needs CUDA; it is imported only when an engine is made. Every call
made to vLLM here is listed in tests/helpers/fake_vllm/vllm_api.json, read from the pinned wheel's source by
scripts/vllm_api.py; the tests run this module against a fake `vllm` that has exactly those calls.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterator

import torch

from ..data.padding import left_pad, right_pad
from ..errors import ConfigError
from .generation import Sampled
from .rollout_engine import Request

SLEEP_LEVEL = 1      # weights kept in host memory while asleep (level 2 frees them; nothing to gain, we reload them)
SEED_RANGE = 2 ** 31  # per-row seeds drawn from a rollout's stream


def memory_fraction(plan_gib: float, device_gib: float, margin: float = 0.05) -> float:
    """vLLM's `gpu_memory_utilization`: the share of the device its weights and KV pool may take
    while it is awake, i.e. what the memory plan leaves beside what the trainer holds during a
    rollout (`Plan.beside_engine`: its weights, optimizer state and the gathered actor; its
    activations are freed then). The plan itself counts the engine's weights and least KV pool."""
    free = 1.0 - plan_gib / device_gib - margin
    if free < 0.1:
        raise ConfigError(f"rollout_engine: vllm: the memory plan ({plan_gib:.1f} GiB) leaves {max(free, 0):.0%} of "
                          f"the device's {device_gib:.1f} GiB for vLLM (at least 10% needed); use rollout_engine: "
                          "torch, ZeRO-3 or offloading")
    return round(free, 3)


def hf_weights(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The trainer's weights by Hugging Face name, as `save_pretrained` would name them in a merged
    checkpoint: under LoRA each adapted layer's weight is its base weight plus the adapter's delta
    (a new tensor: the trainer's own weights are never touched, where PEFT's merge_adapter and
    unmerge_adapter would leave them off by rounding), the wrapper's prefixes dropped and the
    adapters' own tensors left out. `model` must be whole (gathered under ZeRO-3)."""
    peft = hasattr(model, "peft_config")
    base = model.get_base_model() if peft else model
    modules = dict(base.named_modules())
    for name, p in base.named_parameters():
        if "lora_" in name:
            continue
        if peft and name.endswith(".base_layer.weight"):
            layer = modules[name.removesuffix(".base_layer.weight")]
            delta = sum(layer.get_delta_weight(a) for a in layer.active_adapters if a in layer.lora_A)
            yield name.replace(".base_layer.", "."), (p.detach() + delta.to(p.dtype)).detach()
        else:
            yield name.replace(".base_layer.", "."), p.detach()


def to_sampled(outputs: list, request: Request, device: torch.device) -> Sampled:
    """vLLM's `RequestOutput`s (one completion each, in the prompts' order) as our sampler's
    result: prompts left-padded, responses right-padded, each token's log-prob, ended when the
    response stopped at a stop id (a length cut is not an end)."""
    stops = set(request.stop_ids)
    rows, logps, ended = [], [], []
    for out in outputs:
        done = out.outputs[0]
        ids = list(done.token_ids)
        if not ids:   # a response must hold a token (our sampler always draws one)
            raise RuntimeError(f"vLLM returned an empty response (finish_reason {done.finish_reason!r})")
        if done.finish_reason == "stop" and ids[-1] not in stops:
            raise RuntimeError(f"vLLM stopped on {done.stop_reason!r}, not on a stop id {sorted(stops)}")
        rows.append(ids)
        logps.append([done.logprobs[t][token].logprob for t, token in enumerate(ids)])
        ended.append(done.finish_reason == "stop")
    prompt_ids, prompt_mask = left_pad(request.prompts, request.pad_id)
    response_ids, response_mask = right_pad(rows, request.pad_id)
    logprobs = torch.zeros(response_ids.shape, dtype=torch.float32, device="cpu")                  # (B, R), 0 on padding
    for i, row in enumerate(logps):
        logprobs[i, :len(row)] = torch.tensor(row, dtype=torch.float32, device="cpu")
    return Sampled(prompt_ids=prompt_ids.to(device), prompt_mask=prompt_mask.to(device),
                   response_ids=response_ids.to(device), response_mask=response_mask.to(device),
                   logprobs=logprobs.to(device), ended=torch.tensor(ended, dtype=torch.bool, device=device))


class VllmEngine:
    """vLLM colocated with this training process (see the module's docstring)."""
    name = "vllm"

    def __init__(self, model_dir: Path, *, dtype: str, seed: int, memory_fraction: float, max_model_len: int):
        import vllm   # the optional extra; imported here only
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")   # in-process: apply_model reaches the model
        self.vllm = vllm
        self.llm = vllm.LLM(model=str(model_dir), skip_tokenizer_init=True, dtype=dtype, seed=seed,
                            gpu_memory_utilization=memory_fraction, max_model_len=max_model_len,
                            enable_sleep_mode=True, distributed_executor_backend="external_launcher",
                            tensor_parallel_size=1,
                            logprobs_mode="processed_logprobs", load_format="dummy", enable_prefix_caching=False)
        self.llm.sleep(level=SLEEP_LEVEL)

    def params(self, request: Request, seed: int):
        cfg = request.sampling
        return self.vllm.SamplingParams(n=1, temperature=0.0 if request.greedy else cfg.temperature, top_p=1.0,
                                        top_k=0, seed=seed, max_tokens=cfg.max_new_tokens,
                                        stop_token_ids=list(request.stop_ids), logprobs=0, detokenize=False)

    def seeds(self, request: Request) -> list[int]:
        if request.seeds is not None:
            return [int(s) % SEED_RANGE for s in request.seeds]
        stream = request.stream if request.stream is not None else torch.Generator().manual_seed(0)
        return torch.randint(SEED_RANGE, (len(request.prompts),), generator=stream, device=stream.device).tolist()

    def generate(self, model: torch.nn.Module, request: Request) -> Sampled:
        device = next(model.parameters()).device
        # The trainer's freed blocks go back to the driver before the engine maps its weights and KV
        # pool, and the engine's after it sleeps, before the trainer's next forward: PyTorch's caching
        # allocator keeps freed memory reserved otherwise, and the two would not both fit.
        _empty_cache()
        self.llm.wake_up(tags=["weights"])
        loaded = self.llm.apply_model(lambda m: sorted(m.load_weights(hf_weights(model))))
        self.llm.wake_up(tags=["kv_cache"])
        try:
            prompts = [self.vllm.TokensPrompt(prompt_token_ids=list(p)) for p in request.prompts]
            outputs = self.llm.generate(prompts, [self.params(request, s) for s in self.seeds(request)],
                                        use_tqdm=False)
        finally:
            self.llm.sleep(level=SLEEP_LEVEL)
            _empty_cache()
        if not loaded or not loaded[0]:
            raise RuntimeError("vLLM loaded none of the trainer's weights")
        return to_sampled(outputs, request, device)


def _empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def max_model_len(prompt_tokens: int, new_tokens: int) -> int:
    """The longest sequence the engine is asked for, rounded up to a multiple of 16 (vLLM's block)."""
    return 16 * math.ceil((prompt_tokens + new_tokens) / 16)
