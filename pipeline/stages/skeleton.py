"""The one skeleton every stage runs in: session, output folder, tracking, fingerprint, and the
atomic writing of what it produces.

    with stage_run(SPEC, params, out, inputs) as run:
        ...  run.params (declared keys only), run.ctx, run.tracker, run.fingerprint ...
        run.finish(metrics, model, tok)

- A training stage (`SPEC.training`) runs in a distributed session of its own section's
  `distributed` settings (a plain single process by default).
- One run at a time per folder: rank 0 holds the folder's lock for the whole run, and a second run
  on it (a second DVC, Snakemake beside DVC, a hand-run command) is refused in one line.
- The stage's folder (`run.folder`, what --out names) keeps what outlives a run: the resumable
  checkpoint (`run.checkpoint`) and any intermediate file a re-run reuses. Everything this run
  outputs (step logs, model, plots, config.json, metrics.json...) is written under `run.out`, a
  pending folder inside it, and moved into the folder by `finish` once the last of them is
  written. A run that fails, runs out of disk or is stopped leaves the folder's earlier outputs
  byte for byte as they were and its pending folder removed (pipeline/files.py `commit`).
- A training stage checks its memory plan (pipeline/training/memory_plan.py) before it builds a
  model: a plan larger than the device is a ConfigError naming the params to change.
- Tracking: the stage's MLflow run (or none), with the resolved config as its params.
- The resume fingerprint hashes the resolved config, every local input (folders and the user's
  dataset files) and every project file the stage's code imports (the closure dvc.yaml's deps
  cover), so a checkpoint of another config, other inputs or other code is never resumed: DVC
  re-runs a stage after a code change, and resuming a finished run's checkpoint then would hand back
  the old code's model. A re-run of unchanged code (a kill before DVC recorded the stage,
  `dvc repro -f`) resumes, at the final step if training had finished.
- `finish` (rank 0): `model/` (safetensors and tokenizer) swapped in atomically, config.json
  (the resolved params, keys sorted, and `runtime`: the device type, process and thread counts it
  ran on and, for a training stage, the dtypes of its weights, optimizer states and compute),
  metrics.json, then the files to the tracker. metrics.json gains where it ran (`resources/gpus`,
  0 on the CPU, the process count on any other device) and the stage's cost:
  `resources/wall_seconds` (this process, from the skeleton's start to finish: a resumed stage's
  last process only) and `resources/peak_rss_gib` (its peak resident memory; on a GPU also
  `resources/peak_device_gib`, the peak memory torch allocated on this rank's device, where its
  torch module counts it: pipeline/devices.py), so methods
  can be compared on what they cost (the compare stage's table). With PIPELINE_COUNT_CPU_MATMULS set
  on a device that is not the CPU (what scripts/gpu_check.py does), the stage body runs under a
  counter of matrix products on CPU tensors, `resources/cpu_matmul_gflop` (devices.py says why).
  A stage that measures on held-out prompts or pairs states how evenly its ranks shared that work:
  `resources/measure_imbalance` (pipeline/measurement/balance.py).
"""

from __future__ import annotations

import contextlib
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

from .. import devices
from ..config import Params, check_process_shape
from ..measurement import balance
from ..files import PENDING, atomic_dir, atomic_write_json, atomic_write_text, commit, discard, exclusive, pending
from ..models.checkpoints import save_checkpoint
from ..tracking.mlflow_sink import StageFacts, stage_tracking
from ..tracking import model_card
from ..tracking.metric_names import METRICS_JSON, Metric
from ..tracking.sinks import Tracker, write_metrics
from ..training import distributed, memory_plan, stopping
from ..context import SINGLE, Context
from ..training.resume import fingerprint, input_paths
from ..workflow import code_deps
from . import registry
from .spec import StageSpec, declared, declared_of_type, resolve

ROOT = Path(__file__).resolve().parents[2]   # the folder holding the `pipeline` package
# What a training stage writes only in some configurations (LoRA; DeepSpeed or several processes):
# removed from its folder at the commit of a run that did not write them.
OPTIONAL = ("adapter", "deepspeed_config.json")


def package_version() -> str:
    import importlib.metadata
    try:
        return importlib.metadata.version("rlhf-pipeline")
    except importlib.metadata.PackageNotFoundError:   # run from a checkout that was never installed
        return "(not installed)"


@dataclass
class StageRun:
    spec: StageSpec
    params: Params              # the declared view: reading an undeclared key raises
    resolved: dict[str, Any]    # config.json, the MLflow params, the fingerprint's config
    folder: Path                # the stage's folder: its outputs once committed, its checkpoint
    out: Path                   # this run's outputs until `finish` commits them (see the module doc)
    ctx: Context
    tracker: Tracker
    fingerprint: str
    started: float = field(default_factory=time.perf_counter)
    cpu_matmuls: Any = None     # devices.counting_cpu_matmuls' counter, when the stage counts them
    measured: balance.Tally = field(default_factory=balance.Tally)   # the stage's sharded measurements

    @property
    def checkpoint(self) -> Path:
        """The stage's resumable state (pipeline/training/resume.py): outlives a failed run."""
        return self.folder / "checkpoint"

    def check_stop_tokens(self, tok: Any) -> None:
        """Each sampling section the stage reads (`rs.sampling`, `prompts.sampling`...) against the
        tokenizer it samples with, before the first step: a stop_token that is not one token is
        refused naming its key, not found at the first sample after training."""
        from ..config import SamplingConfig
        from ..models.generation import check_stop_tokens
        check_stop_tokens(tok, declared_of_type(self.params, self.spec, SamplingConfig))

    def finish(self, metrics: dict[str, Any], model: Any = None, tok: Any = None) -> None:
        """Write the stage's outputs (rank 0 only; other ranks return at once)."""
        if not self.ctx.is_main:
            return
        if model is not None:
            with atomic_dir(self.out / "model") as tmp:
                save_checkpoint(model, tok, tmp)
                if self.spec.model is None:
                    raise RuntimeError(f"the {self.spec.name} stage writes a model but its SPEC declares no `model`")
                atomic_write_text(tmp / "README.md", model_card.card(self.spec.name, self.spec.model, self.resolved,
                                                                     metrics, package_version()))
        atomic_write_json(self.out / "config.json", {**self.resolved, "runtime": self.runtime()})
        metrics.update(self.resources())   # in place: the stage returns what metrics.json holds
        write_metrics(self.out / "metrics.json", metrics)
        commit(self.folder, OPTIONAL if self.spec.training else ())
        self.tracker.log_final(metrics)
        self.tracker.log_outputs(self.folder)


    def runtime(self) -> dict[str, Any]:
        """Where the stage ran: config.json's `runtime` (not part of the params or the fingerprint)."""
        import torch   # the thread count changes floating-point sums, so a run's bits
        out = {"device": self.ctx.device_type, "processes": self.ctx.world_size, "threads": torch.get_num_threads()}
        if self.spec.training:   # what the trained weights, their optimizer states and the forwards were in
            from ..training.loading import dtypes
            out["dtypes"] = dtypes(getattr(self.params, self.spec.name).distributed)
        return out

    def resources(self) -> dict[str, float]:
        """What this process has cost so far (see the module doc)."""
        out = {"resources/wall_seconds": time.perf_counter() - self.started,
               "resources/gpus": self.ctx.world_size if devices.is_accelerator(self.ctx.device) else 0,
               # ru_maxrss is in KiB on Linux, bytes on macOS
               "resources/peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
               / (2 ** 30 if sys.platform == "darwin" else 2 ** 20)}
        peak = devices.peak_memory_gib(self.ctx.device)
        if peak is not None:
            out["resources/peak_device_gib"] = peak
        if self.cpu_matmuls is not None:
            out["resources/cpu_matmul_gflop"] = self.cpu_matmuls.flops / 1e9
        if self.measured.imbalance is not None:
            out["resources/measure_imbalance"] = self.measured.imbalance
        return out


@contextlib.contextmanager
def stage_run(spec: StageSpec, params: Params, out: Path, inputs: Sequence[str | Path | None]) -> Iterator[StageRun]:
    """The stage's prologue around its body (see the module doc). `inputs`: its input folders and
    the user's dataset paths (None and hub ids are left out of the fingerprint: their params are in
    the config)."""
    started = time.perf_counter()
    resolved = resolve(params, spec)
    local = input_paths(*inputs)
    section = getattr(params, spec.name)
    session = distributed.session(section.distributed) if spec.distributed else contextlib.nullcontext(SINGLE)
    # A training stage stops at a step boundary on SIGTERM or the warning signal (training/stopping.py).
    signals = stopping.handling() if spec.training else contextlib.nullcontext()
    with signals, session as ctx, (exclusive(out, spec.name) if ctx.is_main else contextlib.nullcontext()):
        if ctx.is_main:
            pending(out)
        ctx.barrier()
        try:
            if spec.shape == "start":   # a compare method's batch sizes against its processes (spec.py)
                check_process_shape(params, spec.name)
            if spec.training and spec.plan is not None:   # before any model is built: refuse a plan too big for the device
                memory_plan.check_stage(spec.name, spec.plan, declared(params, spec), dict(zip(spec.inputs, inputs)),
                                        ctx.is_main)
            code = [ROOT / f for f in sorted(code_deps.closure(ROOT, spec.name, Path(registry.module(spec.name).__file__)))]
            fp = fingerprint(resolved, [*local, *code])
            # The fingerprint tags the MLflow run too: a resumed run finds the killed run it continues by it.
            facts = StageFacts(spec.headline, spec.headline_prefixed, registry.parent_params(), spec.model,
                               evaluation=spec.measuring)
            with stage_tracking(spec.name, resolved, local, enabled=ctx.is_main, fingerprint=fp,
                                facts=facts) as tracker, devices.counting_cpu_matmuls(ctx.device) as counted, \
                    balance.tallying() as measured:
                yield StageRun(spec, declared(params, spec), resolved, out, out / PENDING, ctx, tracker, fp, started,
                               counted, measured)
        except BaseException:   # an error, a full disk, a stop signal: the checkpoint keeps the state
            if ctx.is_main:
                discard(out)
            raise
        if ctx.is_main:   # a body that returned without `finish` commits nothing
            discard(out)


def declared_metrics(stage: str, condition: Optional[str] = None) -> list[Metric]:
    """What the stage skeleton adds to every stage's metrics.json (`finish`): what its process cost."""
    def m(name: str, meaning: str, cond: Optional[str] = condition) -> Metric:
        return Metric(stage, METRICS_JSON, name, meaning, cond)

    gpu = "cuda" if condition is None else None
    out = [m("resources/wall_seconds", "seconds of the stage's process from its start to its outputs (a resumed "
                                       "stage: its last process only)"),
           m("resources/peak_rss_gib", "peak resident memory of the stage's process (rank 0), GiB"),
           m("resources/gpus", "GPUs the stage ran on (one per process; 0: the CPU); config.json's `runtime` "
                               "names the device")]
    if gpu is not None:
        out.append(m("resources/peak_device_gib", "peak GPU memory torch allocated in the stage's process (rank 0), "
                                                  "GiB", gpu))
    out.append(m("resources/cpu_matmul_gflop", "GFLOP of matrix products the stage's process (rank 0) ran on CPU "
                                               "tensors while its device was a GPU (model-sized work there is one "
                                               "rank computing what belongs on its device)", "cpu_matmuls"))
    out.append(m("resources/measure_imbalance", "most batches one process ran in the stage's sharded measurements "
                                                "on held-out prompts or pairs minus the fewest (the largest over "
                                                "them; 0 on one process, 1 where some ranks waited for one batch)"))
    return out
