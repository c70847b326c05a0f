"""Processes: launching a stage on N processes, who this process is, and cross-process reductions.

One stage command serves every scale. `python -m pipeline sft` with `distributed.num_processes: 1`
and `backend: none` trains in this process with plain PyTorch. With more processes it re-executes
itself under the launcher named in params (`torchrun` or `deepspeed`); the launched copies see
`LOCAL_RANK` in their environment and do not launch again.

Data parallelism is by sharding the *global* batch: every rank draws the same global batch from an
identically seeded sampler and keeps its own slice, so the maths of one optimizer step is the maths
of one process with that global batch (losses are sums over the global batch divided by its size;
see engines.py for how DeepSpeed's gradient averaging is undone).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import datetime
import logging
import os
import shutil
import socket
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from .. import devices
from ..config import DistributedConfig
from ..context import Context
from ..errors import ConfigError

LAUNCHED_ENV = "LOCAL_RANK"  # set by torchrun and by the deepspeed launcher in each process
# True once this process has joined a group that a launcher started (`end_process` reads it).
_joined_launched_group = False


def launch_command(cfg: DistributedConfig, argv: Sequence[str]) -> list[str]:
    """The command that runs `python -m pipeline <argv>` on this node's processes."""
    if cfg.launcher == "torchrun":
        cmd = [_tool("torchrun"), f"--nproc_per_node={cfg.num_processes}", f"--nnodes={cfg.num_nodes}",
               f"--node_rank={cfg.node_rank}", f"--master_addr={cfg.master_addr}",
               f"--master_port={cfg.master_port}"]
        return cmd + ["-m", "pipeline", *argv]
    cmd = [_tool("deepspeed"), "--no_local_rank", f"--master_port={cfg.master_port}",
           f"--master_addr={cfg.master_addr}"]
    if cfg.hostfile is not None:
        cmd += [f"--hostfile={cfg.hostfile}", f"--num_nodes={cfg.num_nodes}", f"--num_gpus={cfg.num_processes}"]
    else:  # one node: no hostfile, no ssh
        cmd += [f"--num_gpus={cfg.num_processes}"]
    return cmd + ["--module", "pipeline", *argv]


def _tool(name: str) -> str:
    # The launcher of this interpreter's environment, so a venv's torchrun runs the venv's python.
    here = os.path.join(os.path.dirname(sys.executable), name)
    found = here if os.path.exists(here) else shutil.which(name)
    if found is None:
        raise ConfigError(f"distributed.launcher: {name!r} is not installed in this environment")
    return found


def with_node(params: Any, stage: str, node_rank: int | None, master_addr: str | None) -> Any:
    """`params` with this node's rank and rank 0's address set for `stage` (command-line values
    win over the shared params file; the file stays what DVC tracks)."""
    changes = {k: v for k, v in (("node_rank", node_rank), ("master_addr", master_addr)) if v is not None}
    if not changes:
        return params
    section = getattr(params, stage)
    try:
        dist = dataclasses.replace(section.distributed, **changes)
    except ConfigError as err:
        raise ConfigError(f"--node-rank/--master-addr: {err}") from None
    return dataclasses.replace(params, **{stage: dataclasses.replace(section, distributed=dist)})


def needs_launch(cfg: DistributedConfig) -> bool:
    """True when this process should start the launcher instead of training itself."""
    return cfg.world_size > 1 and LAUNCHED_ENV not in os.environ


log = logging.getLogger(__name__)


def unusable_gpu(devices: Path = Path("/dev")) -> str | None:
    """Why torch cannot use the NVIDIA GPU this machine has (its device files are in `devices`), or
    None: no such GPU, or torch uses it."""
    found = sorted(p.name for p in devices.glob("nvidia[0-9]*"))
    if not found or torch.cuda.is_available():
        return None
    if torch.version.cuda is None:
        return f"this machine has a GPU (/dev/{found[0]}) but torch {torch.__version__} is a CPU build"
    return (f"this machine has a GPU (/dev/{found[0]}) but torch {torch.__version__} (CUDA {torch.version.cuda}) "
            "cannot use it (a driver older than that CUDA, or CUDA_VISIBLE_DEVICES hiding it)")


def resolve_device(cfg: DistributedConfig, local_rank: int = 0) -> torch.device:
    """Where this process's models live (`distributed.device`): the GPU of its local rank when asked
    for or, with auto, when torch sees one; else the CPU, with one warning when the machine has a
    GPU that torch cannot use (a user who installed the CPU build would otherwise wait hours)."""
    if cfg.device == "cpu":
        return torch.device("cpu")
    if cfg.device == "auto" and not torch.cuda.is_available():
        why = unusable_gpu()
        if why is not None:
            log.warning("distributed.device: auto runs on the CPU: %s", why)
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("distributed.device: cuda, but torch sees no GPU (torch.cuda.is_available() is False: "
                          "a CPU build of torch, or no visible device); set device: auto or cpu")
    if local_rank >= torch.cuda.device_count():
        raise ConfigError(f"distributed.num_processes: local rank {local_rank} has no GPU of its own "
                          f"({torch.cuda.device_count()} visible); one process per GPU")
    return torch.device("cuda", local_rank)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# DeepSpeed logs this WARNING from its accelerator detection when it finds no GPU and settles on
# the CPU: once in every process of every stage, about the expected outcome on a CPU machine.
CPU_FALLBACK_NOTICE = "Setting accelerator to CPU."


class _NoCpuFallbackNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(CPU_FALLBACK_NOTICE)


def import_deepspeed() -> Any:
    """`import deepspeed` (heavy: only when DeepSpeed is asked for) without its CPU-fallback notice.

    The filter sits on DeepSpeed's own logger ("DeepSpeed") and drops only that record, which it
    logs only when it falls back to the CPU, so every other DeepSpeed warning still shows. A GPU that
    CUDA cannot reach is still reported: by torch, whose CUDA check warns on a failed initialisation."""
    silence_cpu_fallback_notice()
    import deepspeed
    return deepspeed


def silence_cpu_fallback_notice() -> None:
    """The filter of `import_deepspeed`, for the other ways DeepSpeed gets imported (transformers and
    MLflow's transformers flavour import it when it is installed): the CLI installs it at start."""
    logger = logging.getLogger("DeepSpeed")
    if not any(isinstance(f, _NoCpuFallbackNotice) for f in logger.filters):
        logger.addFilter(_NoCpuFallbackNotice())


# A build of DeepSpeed's CPU communication op takes about a minute; torch's build lock (its
# FileBaton: the file `lock` in the op's build folder, which every other process waits on until it
# is deleted) older than this was left by a build killed mid-way, and would hold every later
# DeepSpeed start forever, silently.
STALE_BUILD_LOCK_S = 600.0


def clear_stale_build_locks(root: Path | None = None, older_than: float = STALE_BUILD_LOCK_S) -> list[Path]:
    """Remove the build locks under torch's extensions folder (`root`: TORCH_EXTENSIONS_DIR, else
    torch's default) older than `older_than` seconds, each with a warning naming it; returns them.
    A build still running keeps its lock fresh enough: none takes ten minutes on these ops."""
    if root is None:
        env = os.environ.get("TORCH_EXTENSIONS_DIR")
        if env:
            root = Path(env)
        else:
            from torch.utils.cpp_extension import get_default_build_root
            root = Path(get_default_build_root())
    if not root.is_dir():
        return []
    removed = []
    for lock in [*root.glob("*/lock"), *root.glob("*/*/lock")]:
        try:
            age = time.time() - lock.stat().st_mtime
            if age > older_than:
                lock.unlink()
                removed.append(lock)
                log.warning("removed %s, a build lock %.0f minutes old: a build of that op was killed "
                            "mid-way, and every DeepSpeed start would have waited on it for ever", lock, age / 60)
        except FileNotFoundError:   # its build finished meanwhile
            continue
    return removed


def init(cfg: DistributedConfig) -> Context:
    """Join the process group (DeepSpeed backend) or stay a single plain process, on the device
    `distributed.device` resolves to: NCCL between GPUs, gloo between CPU processes."""
    if cfg.backend == "none":
        return Context(device=resolve_device(cfg))
    global _joined_launched_group
    launched = LAUNCHED_ENV in os.environ
    local = int(os.environ.get("LOCAL_RANK", 0))
    device = resolve_device(cfg, local)
    if device.type == "cpu":   # DeepSpeed would otherwise pick a GPU it finds for its own buffers
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    clear_stale_build_locks()   # before DeepSpeed builds or loads its ops
    deepspeed = import_deepspeed()

    # DeepSpeed 0.19 calls torch collectives that torch 2.13 marks deprecated, once per step.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed")

    if LAUNCHED_ENV not in os.environ:  # one process without a launcher: a group of one
        os.environ.update({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())})
    devices.set_current(device)   # NCCL and DeepSpeed's buffers use the current GPU: this rank's
    timeout = datetime.timedelta(minutes=cfg.timeout_minutes)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=devices.collective_backend(device), timeout=timeout)
    # The groups made later take torch's default for their backend (NCCL: 10 minutes), not the world
    # group's; DeepSpeed makes its own (a copy of the world group that ZeRO's collectives use, the
    # sequence-parallel ones) without a timeout, so the default is made ours for this process.
    c10d.default_pg_timeout = c10d.default_pg_nccl_timeout = timeout
    _joined_launched_group = launched
    world = dist.get_world_size()
    if world != cfg.world_size:
        raise ConfigError(f"distributed: params ask for {cfg.world_size} processes but {world} were started")
    return Context(rank=dist.get_rank(), world_size=world, local_rank=local, device=device)


@contextlib.contextmanager
def session(cfg: DistributedConfig) -> Iterator[Context]:
    """`init` ... `shutdown` around a stage's work."""
    ctx = init(cfg)
    try:
        yield ctx
    except BaseException:
        if ctx.active:  # no barrier: the other ranks may be gone; the launcher stops them
            dist.destroy_process_group()
        raise
    shutdown(ctx)


def to_device(batch: Mapping[str, Any], device: torch.device | None) -> dict[str, Any]:
    """A batch dict with its tensors on `device` (unchanged when None or already there)."""
    if device is None:
        return dict(batch)
    return {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def shutdown(ctx: Context) -> None:
    """Leave the process group cleanly (a process that exits inside it can abort at exit)."""
    if ctx.active:
        dist.barrier()
        dist.destroy_process_group()


def end_process(code: int) -> None:
    """Exit with `code` now, without finalizing the interpreter, if this process joined a group its
    launcher started; return otherwise. The exit handlers still run, and the streams are flushed.

    Why: gloo's worker threads outlive `destroy_process_group` while anything still holds the group
    (DeepSpeed keeps its own). A worker that then drops a finished collective releases tensors that
    Python owns, which takes the GIL; during finalization a thread taking the GIL is ended by
    pthread_exit, whose unwinding through that noexcept destructor calls std::terminate. The rank
    aborts ("terminate called without an active exception", SIGABRT) after a complete stage, and
    the launcher reports the stage failed. A core dump of one such rank:
    ProcessGroupGloo::runLoop -> ~AsyncBarrierWork -> ~AsyncAllgatherWork -> decref -> take_gil ->
    PyThread_exit_thread, while the main thread was in Py_FinalizeEx."""
    if not _joined_launched_group:
        return
    # What finalization does before it tears anything down, with the interpreter whole: wait for
    # the threads that are not daemons (an executor's pending work among them), then the exit
    # handlers (MLflow's, logging's, temporary folders').
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed pipe or stream: nothing more can reach it
            pass
    ctypes.CDLL(None).fflush(None)    # what C and C++ code buffered in stdio
    os._exit(code)
