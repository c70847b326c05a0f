"""A fake `vllm` for the CPU tests of pipeline/models/vllm_engine.py (the real one needs CUDA).

It takes exactly the calls tests/helpers/fake_vllm/vllm_api.json lists for the pinned vLLM (scripts/vllm_api.py
reads them from the wheel's source): a keyword, field or method that vLLM does not have is a
TypeError here, as it would be there. Behind the calls, a plain Hugging Face copy of the model:
`load_format: dummy` starts it at zero weights (as vLLM's placeholder weights would leave it useless),
`load_weights` takes weights by Hugging Face name into that copy, and `generate` samples with a full
forward per token (no KV cache: an implementation independent of ours) from each request's own seed,
returning the temperature-scaled log-prob of each sampled token (`logprobs_mode: processed_logprobs`,
with no top-k/top-p). Sleep and wake are tracked: loading weights or generating while asleep fails.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

API = json.loads((Path(__file__).resolve().parents[1] / "vllm_api.json").read_text())
CLASSES = API["classes"]
calls: list[tuple[str, dict]] = []     # every call made, in order (name, arguments), for the tests


def _check(cls: str, method: str, kwargs: dict) -> None:
    params = {p["name"]: p for p in CLASSES[cls]["methods"][method]}
    named = {n for n, p in params.items() if p["kind"] in ("positional", "keyword_only")}
    extra = set(kwargs) - named
    if cls == "LLM" and method == "__init__":
        extra -= set(CLASSES["EngineArgs"]["fields"])   # LLM(**kwargs) become EngineArgs
    if extra:
        raise TypeError(f"{cls}.{method}() got unexpected keyword arguments {sorted(extra)} (vllm {API['version']})")
    missing = [n for n, p in params.items() if p["kind"] in ("positional", "keyword_only") and not p["default"]
               and n not in kwargs]
    if missing:
        raise TypeError(f"{cls}.{method}() missing {missing}")


def _fields(cls: str, kwargs: dict) -> None:
    extra = set(kwargs) - set(CLASSES[cls]["fields"])
    if extra:
        raise TypeError(f"{cls} has no fields {sorted(extra)} (vllm {API['version']})")


class SamplingParams:
    def __init__(self, **kwargs: Any):
        _fields("SamplingParams", kwargs)
        self.n, self.temperature, self.top_p, self.top_k = 1, 1.0, 1.0, 0
        self.seed, self.max_tokens, self.stop_token_ids, self.logprobs, self.detokenize = None, 16, None, None, True
        self.__dict__.update(kwargs)


def TokensPrompt(**kwargs: Any) -> dict:   # a TypedDict in vLLM: a plain dict at run time
    _fields("TokensPrompt", kwargs)
    return dict(kwargs)


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: Any
    outputs: list[CompletionOutput]
    finished: bool
    extra: dict = field(default_factory=dict)


for _cls in (CompletionOutput, Logprob):
    _fields(_cls.__name__, {f: None for f in _cls.__dataclass_fields__})
_check("RequestOutput", "__init__", {f: None for f in RequestOutput.__dataclass_fields__ if f != "extra"})


class _Model:
    """What `apply_model` hands a function: the model, with vLLM's `load_weights`."""

    def __init__(self, hf: torch.nn.Module):
        self.hf = hf

    def load_weights(self, weights) -> set[str]:
        _check("LlamaForCausalLM", "load_weights", {"weights": weights})
        own = dict(self.hf.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in own or own[name].shape != tensor.shape:
                raise KeyError(f"load_weights: no parameter {name} of shape {tuple(tensor.shape)}")
            with torch.no_grad():
                own[name].copy_(tensor)
            loaded.add(name)
        return loaded


class LLM:
    def __init__(self, model: str, **kwargs: Any):
        _check("LLM", "__init__", {"model": model, **kwargs})
        if kwargs.get("logprobs_mode", "raw_logprobs") not in API["literals"]["LogprobsMode"]:
            raise ValueError(f"logprobs_mode {kwargs['logprobs_mode']!r}")
        from transformers import AutoModelForCausalLM
        calls.append(("LLM", {"model": model, **kwargs}))
        self.kwargs = kwargs
        hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        if kwargs.get("load_format") == "dummy":
            with torch.no_grad():
                for p in hf.parameters():
                    p.zero_()
        self.model = _Model(hf)
        self.asleep: set[str] = set()

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        _check("LLM", "sleep", {"level": level, "mode": mode})
        if not self.kwargs.get("enable_sleep_mode"):
            raise RuntimeError("sleep mode is not enabled")
        calls.append(("sleep", {"level": level}))
        self.asleep = {"weights", "kv_cache"}

    def wake_up(self, tags: list[str] | None = None) -> bool:
        _check("LLM", "wake_up", {"tags": tags})
        calls.append(("wake_up", {"tags": tags}))
        self.asleep -= set(tags or ("weights", "kv_cache"))
        return not self.asleep

    def apply_model(self, func) -> list:
        _check("LLM", "apply_model", {"func": func})
        if "weights" in self.asleep:
            raise RuntimeError("apply_model while the weights sleep")
        calls.append(("apply_model", {}))
        return [func(self.model)]

    @torch.no_grad()
    def generate(self, prompts, sampling_params=None, *, use_tqdm=True, **kwargs) -> list[RequestOutput]:
        _check("LLM", "generate", {"prompts": prompts, "sampling_params": sampling_params, "use_tqdm": use_tqdm, **kwargs})
        if self.asleep:
            raise RuntimeError(f"generate while asleep: {sorted(self.asleep)}")
        calls.append(("generate", {"n": len(prompts)}))
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        return [self._one(str(i), p["prompt_token_ids"], sp) for i, (p, sp) in enumerate(zip(prompts, params))]

    def _one(self, request_id: str, prompt: list[int], sp: SamplingParams) -> RequestOutput:
        if sp.top_k not in (0, -1) or sp.top_p != 1.0 or sp.logprobs != 0 or sp.detokenize:
            raise NotImplementedError("the fake samples without top-k/top-p, returns the sampled token's log-prob only")
        gen = torch.Generator().manual_seed(sp.seed)
        ids, out, logprobs, finish, stop = list(prompt), [], [], "length", None
        for _ in range(sp.max_tokens):
            logits = self.model.hf(torch.tensor([ids])).logits[0, -1].float()
            logp = torch.log_softmax(logits / (sp.temperature or 1.0), -1)
            token = int(logits.argmax()) if sp.temperature == 0 else int(torch.multinomial(logp.exp(), 1, generator=gen))
            out.append(token)
            logprobs.append({token: Logprob(float(logp[token]), rank=1)})
            ids.append(token)
            if token in (sp.stop_token_ids or []):
                finish, stop = "stop", token
                break
        return RequestOutput(request_id, None, list(prompt), None,
                             [CompletionOutput(0, "", out, sum(d[t].logprob for d, t in zip(logprobs, out)), logprobs,
                                               finish, stop)], True)
