"""Where PPO's sequence scores come from: one interface, `score(prompts, responses) -> (B,)`.

- `RewardModelSource`: the trained reward model, applied to the response *text* and re-tokenized
  with the reward model's own tokenizer, so any policy can be paired with any reward model. Its
  stored normalisation offset is applied by `reward_model.score_texts`.
- `FunctionSource`: a Python function named in params as `module:function`, taking
  `(prompts, responses)` and returning one float per pair: a rule-based verifier, or the default
  task's gold annotator (`pipeline.tasks.reviews:gold_scores`) for an oracle run.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence

import torch

from . import reward_model as rm
from ..config import reward_function
from ..errors import CheckpointError, ConfigError, shown


class RewardSource(Protocol):
    def score(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        """(B,) float32 score of each (prompt, response), on the source's device (a function's: the CPU)."""
        ...


class RewardModelSource:
    """A frozen reward model (inference mode, no gradients, dropout off)."""

    def __init__(self, path: Path | None, max_length: int, trust_remote_code: bool = False,
                 place: Callable[[torch.nn.Module], Any] | None = None, *, device: torch.device | None = None,
                 dtype: torch.dtype | None = None, loaded: tuple[torch.nn.Module, Any] | None = None,
                 unit_variance: str | None = None, packed: bool = False):
        """The reward model at `path` (or `loaded`: a model and tokenizer in memory). `place` puts it
        where PPO's placement wants it (a FrozenModel: e.g. partitioned by ZeRO-3); else it goes to
        `device` in `dtype` (this rank's device, for a measurement). A `loaded` model is used as it
        is (score_texts scores in eval mode and restores its mode). `unit_variance`: the params key that
        asked for scores divided by the model's stored scale (reward_model.SCALE_KEY), for its error
        when the model stores none; None: scores in the offset's units. `packed`: each batch of
        texts scored in one packed row (reward_model.score_texts), the same scores up to rounding."""
        if loaded is not None:
            model, self.tok = loaded
        else:
            model, self.tok = rm.load_reward_model(path, trust_remote_code, dtype)
            model.eval().requires_grad_(False)
        self.placed = place(model) if place is not None else None
        self.model = self.placed.model if self.placed is not None else model.to(device) if device else model
        self.max_length = max_length
        self.packed = packed
        self.scale = 1.0
        if unit_variance is not None:
            stored = rm.scale(model)
            if stored is None or not stored > 0:
                raise CheckpointError(f"{unit_variance}: the reward model {path or 'in memory'} stores no "
                                      f"{rm.SCALE_KEY} (trained without reward.normalize, or by an earlier version); "
                                      f"retrain it, or set {unit_variance}: false")
            self.scale = stored

    def score(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        scores = rm.score_texts(self.model, self.tok, prompts, responses, self.max_length, packed=self.packed)
        return scores / self.scale if self.scale != 1.0 else scores

    @contextlib.contextmanager
    def gathered(self) -> Iterator["RewardModelSource"]:
        """This source with its model whole on this rank (ZeRO-3: gathered; see FrozenModel)."""
        if self.placed is None:
            yield self
            return
        with self.placed.gathered():
            yield self


class FunctionSource:
    """Scores from `module:function(prompts, responses) -> sequence of floats`."""

    def __init__(self, spec: str, probe: tuple[str, str] | None = None, key: str = "ppo.reward_source",
                 timeout: float = 600.0):
        """`key`: the params key that named the function (`<section>.reward_source`), for errors;
        `timeout`: seconds one call may take (`<section>.reward_timeout`)."""
        self.fn: Callable[[list[str], list[str]], Sequence[float]] = reward_function(spec, key)
        self.spec, self.key, self.timeout = spec, key, timeout
        if probe is not None:   # one call before any training: a wrong contract fails in seconds
            self.score([probe[0]], [probe[1]], "a probe pair")

    def score(self, prompts: list[str], responses: list[str], what: str = "") -> torch.Tensor:
        with user_code(self.key, self.spec, self.timeout, what or f"{len(prompts)} pair(s)"):
            out = self.fn(prompts, responses)
        try:
            values = [float(v) for v in out]
        except (TypeError, ValueError):
            raise ConfigError(f"{self.key}: {shown(self.spec)!r} returned {shown(out)}, not a sequence of "
                              "numbers") from None
        if len(values) != len(prompts) or not all(math.isfinite(v) for v in values):
            raise ConfigError(f"{self.key}: {shown(self.spec)!r} must return {len(prompts)} finite "
                              f"score(s) for {len(prompts)} pair(s), got {shown(values)}")
        return torch.tensor(values, dtype=torch.float32, device="cpu")


class _OutOfTime(Exception):
    pass


@contextlib.contextmanager
def user_code(key: str, spec: str, timeout: float, what: str) -> Iterator[None]:
    """The one guard around a call of the user's function: whatever it raises, an attempt to exit
    the interpreter (sys.exit, os._exit) and a call longer than `timeout` seconds become one
    ConfigError naming `key`. The time bound is a SIGALRM timer, so it holds in the main thread of
    the process (where stages run) and for code that returns to Python now and then; elsewhere
    the call runs unbounded."""
    def out_of_time(signum, frame):
        raise _OutOfTime

    def no_exit(code=0):
        raise SystemExit(code)

    timed = threading.current_thread() is threading.main_thread()
    if timed:
        previous = signal.signal(signal.SIGALRM, out_of_time)
        signal.setitimer(signal.ITIMER_REAL, timeout)
    real_exit, os._exit = os._exit, no_exit   # an os._exit would end the process as if it had finished
    try:
        yield
    except _OutOfTime:
        raise ConfigError(f"{key}: {shown(spec)!r} did not return within {timeout:g} s on {what} "
                          f"(raise the bound with the section's reward_timeout)") from None
    except SystemExit as err:
        raise ConfigError(f"{key}: {shown(spec)!r} tried to exit the interpreter (exit code {shown(err.code)}) "
                          f"on {what}; a reward function must return its scores") from None
    except ConfigError:
        raise
    except Exception as err:   # noqa: BLE001 - the user's function failed: one line, not a traceback
        raise ConfigError(f"{key}: {shown(spec)!r} failed on {what} "
                          f"({type(err).__name__}: {shown(str(err), 120)})") from None
    finally:
        os._exit = real_exit
        if timed:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def make_reward_source(spec: str, reward_dir: Path, max_length: int, trust_remote_code: bool,
                       place: Callable[[torch.nn.Module], Any] | None = None,
                       dtype: torch.dtype | None = None, key: str = "ppo.reward_source",
                       timeout: float = 600.0, unit_variance: str | None = None,
                       packed: bool = False) -> RewardSource:
    """The source `spec` names; `unit_variance` and `packed` as RewardModelSource's (reward models
    only, config.py)."""
    if spec == "reward_model":
        return RewardModelSource(reward_dir, max_length, trust_remote_code, place, dtype=dtype,
                                 unit_variance=unit_variance, packed=packed)
    return FunctionSource(spec, key=key, timeout=timeout)
