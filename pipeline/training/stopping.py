"""A graceful stop on a signal, so a time limit or a preemption loses nothing.

SIGTERM (SLURM at a time limit or a preemption, `kill`, `scancel`) and a warning signal (SIGUSR1,
or the one PIPELINE_STOP_SIGNAL names, e.g. USR2) ask a training stage to stop at the next step
boundary: a supervised stage finishes the optimizer step in progress, PPO and GRPO the iteration in
progress (the next rollout batch is not sampled; nothing of a rollout is saved, the iteration is
whole or not started). Every rank learns of the request at the same step (the flag is all-reduced
each step), writes its share of the resumable checkpoint, flushes its logs, and the stage exits
with EXIT_STOPPED (75, EX_TEMPFAIL). Running the stage again resumes from that checkpoint, as after
a kill, and ends with the models an uninterrupted run gives.

A second signal, or PIPELINE_STOP_GRACE seconds (default 600) after the first without reaching a
step boundary, exits at once (status 128 + the signal) and the last checkpoint is what remains.
The same signal again within REPEAT_SECONDS is the same request, not a second one: at a time limit
SLURM sends SIGTERM to every process of a job step, and srun forwards its own copy to the step's
tasks, so a stage gets it twice within milliseconds.
The grace ends with the stage: a process that goes on after it (a notebook, a test) is not exited.

Before a stage takes over its signals, and after it hands them back, the command (`python -m
pipeline`) exits at once on SIGTERM with EXIT_STOPPED too (`while_starting`): installed before the
libraries are imported, which takes seconds (torch alone several, more on a busy node), so a time
limit that lands while a job is starting gives the same status as one that lands mid-training.

Multi-process stages: the command the user runs re-runs itself under torchrun (or the DeepSpeed
launcher). That parent forwards both signals to the stage's processes (not to the launcher, which
would tear the processes down after its own 30 s), and the launcher itself ignores the warning
signal, so a signal sent to every process of a job (SLURM without `B:`) stops the ranks gracefully
too. The parent then exits with EXIT_STOPPED.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING, Iterator, Sequence

from ..errors import ConfigError, Stopped

if TYPE_CHECKING:   # no torch at import: `while_starting` runs before the heavy imports
    from ..context import Context

log = logging.getLogger(__name__)

EXIT_STOPPED = 75      # EX_TEMPFAIL: "try again later": a re-run resumes
SIGNAL_ENV = "PIPELINE_STOP_SIGNAL"
GRACE_ENV = "PIPELINE_STOP_GRACE"
DEFAULT_GRACE = 600.0
REPEAT_SECONDS = 5.0   # the same signal again this soon: one request delivered twice

_requested: int = 0    # the signal that asked for a stop; 0: none
_requested_at: float = 0.0   # when (time.monotonic)
_grace: threading.Timer | None = None   # exits the process if the stop takes longer than the grace


def warning_signal() -> signal.Signals:
    """The warning signal: SIGUSR1 unless PIPELINE_STOP_SIGNAL names another (USR2, SIGUSR2, 12)."""
    name = os.environ.get(SIGNAL_ENV, "USR1").strip().upper()
    try:
        return signal.Signals(int(name)) if name.isdigit() else signal.Signals[name if name.startswith("SIG") else f"SIG{name}"]
    except (KeyError, ValueError):
        raise ConfigError(f"{SIGNAL_ENV}: {name!r} is not a signal name (e.g. USR1, USR2, SIGUSR1)") from None


def stop_signals() -> tuple[signal.Signals, ...]:
    return (signal.SIGTERM, warning_signal())


def grace_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get(GRACE_ENV, DEFAULT_GRACE)))
    except ValueError:
        raise ConfigError(f"{GRACE_ENV}: expected seconds, got {os.environ[GRACE_ENV]!r}") from None


def while_starting() -> None:
    """The command's signals outside a training stage's steps: SIGTERM exits at once with
    EXIT_STOPPED (nothing computed is lost: a training stage's checkpoints are whole, every output
    is written atomically, and a re-run starts or resumes it), the warning signal is ignored."""
    signal.signal(signal.SIGTERM, _exit_stopped)
    with contextlib.suppress(ConfigError):   # a bad PIPELINE_STOP_SIGNAL is reported by the stage
        signal.signal(warning_signal(), signal.SIG_IGN)


def _exit_stopped(signum: int, frame) -> None:
    os.write(2, f"received {signal.Signals(signum).name} outside a training step: exiting at once with "
                f"status {EXIT_STOPPED}; run the command again\n".encode())
    os._exit(EXIT_STOPPED)


def _handler(signum: int, frame) -> None:
    global _requested, _requested_at, _grace
    if _requested:
        if signum == _requested and time.monotonic() - _requested_at < REPEAT_SECONDS:
            return   # the same request delivered twice (see the module doc)
        os._exit(128 + signum)   # a second signal: no more grace
    _requested, _requested_at = signum, time.monotonic()
    name = signal.Signals(signum).name
    grace = grace_seconds()
    print(f"received {name}: stopping after the current step, then saving the checkpoint "
          f"(a second signal, or {grace:.0f} s, exits at once)", file=sys.stderr, flush=True)
    _grace = threading.Timer(grace, os._exit, args=(128 + signum,))
    _grace.daemon = True
    _grace.start()


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """Handle the stop signals in this process while a training stage runs (every rank), the
    previous handlers back afterwards. Only the main thread can install handlers; elsewhere (a
    stage run from a test's thread) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    reset()
    previous = {sig: signal.signal(sig, _handler) for sig in stop_signals()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        reset()


def reset() -> None:
    """Forget a request and end its grace: the stage it was for is over (or not yet begun)."""
    global _requested, _grace
    if _grace is not None:
        _grace.cancel()
    _requested, _grace = 0, None


def requested(ctx: Context) -> int:
    """Collective: the signal that asked this run to stop (0: none), the same on every rank, which
    all stop at this step boundary when any one was asked."""
    mine = _requested
    if ctx.world_size == 1:
        return mine
    import torch
    flags = ctx.sum(torch.tensor([float(mine > 0), float(mine)], dtype=torch.float64, device=ctx.device))
    return int(flags[1] / flags[0]) if flags[0] > 0 else 0


def stop(stage: str, signum: int, where: str) -> Stopped:
    """The exception a stage raises once its checkpoint is written."""
    return Stopped(f"{stage}: stopped by {signal.Signals(signum).name} {where}; its checkpoint is saved: run the "
                   f"stage again to resume (exit status {EXIT_STOPPED})")


def launch(cmd: Sequence[str]) -> int:
    """Run a multi-process stage's launcher command, forwarding the stop signals to the stage's
    processes (the launcher's descendants that have LOCAL_RANK set), the launcher ignoring the
    warning signal. Returns its exit status, EXIT_STOPPED when a stop signal came and it failed."""
    import psutil

    warning = warning_signal()
    got: list[int] = []
    child = subprocess.Popen(list(cmd), preexec_fn=lambda: signal.signal(warning, signal.SIG_IGN))

    def forward(signum: int, frame) -> None:
        got.append(signum)
        for proc in _ranks(psutil.Process(child.pid)):
            try:
                proc.send_signal(signum)
            except psutil.Error:
                pass

    previous = {sig: signal.signal(sig, forward) for sig in stop_signals()}
    try:
        status = child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return EXIT_STOPPED if got and status != 0 else status


def _ranks(launcher) -> list:
    import psutil
    out = []
    try:
        children = launcher.children(recursive=True)
    except psutil.Error:
        return out
    for proc in children:
        try:
            if "LOCAL_RANK" in proc.environ():
                out.append(proc)
        except psutil.Error:
            continue
    return out

