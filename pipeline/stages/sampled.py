"""What the stages that train on the SFT policy's own samples share (rs: its best-of-n winners;
onpolicy_dpo: its best-against-worst pairs). Not a stage (no SPEC).

- Their training prompts: the train split of `prompts.dataset`, fitted to `prompts.max_length` as
  `prompts.overlong` says, the first `<stage>.n_prompts` of them (all when null).
- Their sampled file (`<stage folder>/<what>.jsonl`): a header line (the sampling fingerprint and
  the sampling statistics), then one row per kept sample, written by rank 0. A run whose sampling
  fingerprint matches reuses it and samples nothing: after a kill during training, or with only
  the training params changed. The fingerprint is the stage's resume fingerprint without the
  section's training keys: the sampling keys, every other declared section, the input folders and
  the stage's code. The file is the stage's, but a user may have edited, cut or replaced it: every
  field a stage uses is checked, and a file that fails a check is sampled again (with a warning).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

from ..config import Params
from ..errors import DataError, UserError
from ..files import parse_json, read_input, write_jsonl

if TYPE_CHECKING:   # annotations only: the skeleton imports torch, and listing the stages must not
    from .skeleton import StageRun

log = logging.getLogger(__name__)
Rows = tuple[list[dict], dict[str, float]]   # the kept rows (each with its "where": file:line), the statistics


def training_prompts(params: Params, records: list, tok, section: str) -> tuple[list, dict[str, int]]:
    """The prompts the stage samples of the train split's `records` (inputs.prompt_records, read
    with the stage's other inputs before its first model), and how many were truncated or dropped
    fitting them (`data/prompts_truncated`, `data/prompts_dropped`)."""
    from ..data import inputs
    n = getattr(params, section).n_prompts
    prompts, truncated, dropped = inputs.fit_prompts(records, tok, params.prompts.max_length, params.prompts.overlong,
                                                     "prompts.max_length")
    if n is not None and len(prompts) < n:
        raise DataError(f"{section}.n_prompts: {n} prompts asked for, the train split of prompts.dataset has "
                        f"{len(prompts)} (after prompts.overlong); lower it, or set it to null for all")
    return prompts[:n], {"data/prompts_truncated": truncated, "data/prompts_dropped": dropped}


def scored_draws(run: StageRun, sft_policy, tok, prompts: list, reward_dir: Path, n: int) -> list:
    """Collective. `n` samples of every prompt from the SFT policy, sampled as `<stage>.sampling`
    says: sample k is one draw over every prompt, seed `<stage>.seed + k` (the evaluate stage's
    best-of-n draws: measurement.policy.candidates), each scored by the reward model in
    `reward_dir` (`reward.max_length`) and the gold judge; every rank samples its share on its
    device. Partitioned (ZeRO-3), the policy is gathered whole for it; otherwise it samples where it
    will train. The reward model lives for the sampling only. One measurement.policy.Measured per
    sample, in order."""
    from ..data import inputs
    from ..measurement.policy import candidates, measure_policies
    from ..models.reward_source import RewardModelSource
    from ..training import loading
    params, ctx, cfg = run.params, run.ctx, getattr(run.params, run.spec.name)
    reward = RewardModelSource(reward_dir, params.reward.max_length, params.model.trust_remote_code,
                               device=ctx.device, dtype=next(sft_policy.parameters()).dtype, packed=cfg.packing)
    policy = loading.Loaded(sft_policy if loading.is_partitioned(sft_policy) else sft_policy.to(ctx.device))
    draws = candidates(policy, cfg.seed, n)
    measured = measure_policies(draws, tok, prompts, cfg.sampling, ctx=ctx, reward=reward, judge=inputs.judge(params),
                                max_prompt_length=params.prompts.max_length, packed=cfg.packing)
    return [measured[d.name] for d in draws]


def fingerprint(run: StageRun, keys: Sequence[str], local_inputs: list, what: str) -> str:
    """The sampled file's fingerprint (module doc): `keys` are the section's sampling keys."""
    from ..training.resume import fingerprint as resume_fingerprint, input_paths
    from ..workflow import code_deps
    from .skeleton import ROOT
    name = run.spec.name
    config = {k: v for k, v in run.resolved.items() if k != name}
    config[name] = {k: run.resolved[name][k] for k in keys}
    code = [ROOT / f for f in sorted(code_deps.closure(ROOT, name))]
    return resume_fingerprint({what: config}, [*input_paths(*local_inputs), *code])


def write(path: Path, fp: str, rows: list[dict], stats: dict[str, float]) -> None:
    write_jsonl(path, [{"fingerprint": fp, "stats": stats}, *rows])


def read(path: Path, fp: str, what: str, problem: Callable[[Any], Optional[str]]) -> Optional[Rows]:
    """(rows, stats) of the file at `path` written for fingerprint `fp`; None when there is none, or
    it was written for other params, inputs or code, or a check fails (it is then sampled again).
    `problem(row)`: what is wrong with a row (a sentence), or None."""
    if not path.exists():
        return None
    stage = path.parent.name
    try:
        # The guarded reader (a regular file, of bounded size), then every field checked.
        text = read_input(path, f"{what} file").decode("utf-8")
        header, *rows = [parse_json(line) for line in text.splitlines() if line.strip()]
        if header.get("fingerprint") != fp:
            log.warning("%s: %s was sampled with other params, inputs or code; sampling again", stage, path)
            return None
        if not rows:
            raise ValueError(f"no {what}")
        for i, row in enumerate(rows):
            wrong = problem(row) if isinstance(row, dict) else "not an object"
            if wrong is not None:
                raise ValueError(f"line {i + 2}: {wrong}")
        stats = header["stats"]
        if not isinstance(stats, dict) or not all(isinstance(v, (int, float)) for v in stats.values()):
            raise ValueError("line 1: stats must map names to numbers")
        return [{**r, "where": f"{path}:{i + 2}"} for i, r in enumerate(rows)], dict(stats)
    except (UserError, ValueError, AttributeError, KeyError, TypeError, UnicodeDecodeError) as err:
        log.warning("%s: %s cannot be reused (%s); sampling again", stage, path, err)
        return None


def reused_or_sampled(run: StageRun, path: Path, fp: str, what: str, problem: Callable[[Any], Optional[str]],
                      draw: Callable[[], Optional[Rows]]) -> Rows:
    """Collective. The file's rows and statistics, reused, or sampled now: `draw()` runs on every
    rank (each samples its share) and returns rank 0's (rows, stats), which rank 0 writes; then
    every rank reads the file."""
    if read(path, fp, what, problem) is None:   # every rank reads the same file: all sample, or none
        made = draw()
        if run.ctx.is_main:
            write(path, fp, *made)
    run.ctx.barrier()
    found = read(path, fp, what, problem)
    if found is None:
        raise RuntimeError(f"{path}: the {what} rank 0 wrote cannot be read here (is the output folder shared?)")
    return found
