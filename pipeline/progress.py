"""Progress of a training loop: a tqdm bar on a terminal, plain lines in a log.

A tqdm bar redraws itself with carriage returns; written to a file (a stage's `logs/<stage>.log`
under Snakemake, `dvc repro` output piped to a file, a SLURM job log) every redraw becomes one more
frame in one very long line. When the stream is not a terminal this writes one ordinary line each
time the loop passes another `every` percent of its total (5: 20 lines a stage), for example

    ppo: 12/30 iterations (40%), 21s elapsed, ~32s left; score=0.52 kl=0.11 gold=0.40 detector=quiet

The postfix (`update(postfix=...)`) is shown by both: the bar's postfix, the line's tail.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Iterable, Iterator, Mapping, Optional, TypeVar

T = TypeVar("T")


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m"


class Progress:
    """Progress over `total` units (steps, iterations), starting at `initial` (a resumed run).
    `enabled=False` shows nothing (other ranks, `--no-progress`)."""

    def __init__(self, total: int, desc: str, *, unit: str = "steps", initial: int = 0, enabled: bool = True,
                 stream: Optional[IO[str]] = None, every: int = 5, mininterval: float = 1.0):
        if not 0 < every <= 100:
            raise ValueError(f"progress: every must be a percentage in 1..100, got {every}")
        self.total, self.desc, self.unit, self.n = total, desc, unit, initial
        self._start_n, self._every = initial, every
        self._stream = sys.stderr if stream is None else stream
        self._postfix: dict[str, str] = {}
        self._started = time.monotonic()
        self._bar = None
        self._enabled = enabled
        self._shown = self._bucket(initial)       # lines already "passed" by a resumed run
        if enabled and _is_terminal(self._stream):
            from tqdm import tqdm
            self._bar = tqdm(total=total, initial=initial, desc=desc, file=self._stream, mininterval=mininterval)

    def _bucket(self, n: int) -> int:
        """How many `every` percent of the total `n` has passed; the end is one more, so it always
        gets its line (integers: no rounding decides whether a line is written)."""
        if self.total <= 0 or n >= self.total:
            return 100 // self._every + 1
        return n * 100 // (self.total * self._every)

    def update(self, n: int = 1, postfix: Optional[Mapping[str, str]] = None) -> None:
        """`n` more units done; `postfix` (name -> shown value) replaces the previous one."""
        self.n += n
        if postfix is not None:
            self._postfix = {k: str(v) for k, v in postfix.items()}
        if not self._enabled:
            return
        if self._bar is not None:
            if postfix is not None:
                self._bar.set_postfix(self._postfix, refresh=False)
            self._bar.update(n)
            return
        bucket = self._bucket(self.n)
        if bucket > self._shown:
            self._shown = bucket
            self._stream.write(self.line() + "\n")
            self._stream.flush()

    def line(self) -> str:
        """The plain progress line for the current state."""
        pct = int(100 * self.n / self.total) if self.total > 0 else 100
        elapsed = time.monotonic() - self._started
        text = f"{self.desc}: {self.n}/{self.total} {self.unit} ({pct}%), {_duration(elapsed)} elapsed"
        done = self.n - self._start_n
        if 0 < done and self.n < self.total:
            text += f", ~{_duration(elapsed / done * (self.total - self.n))} left"
        if self._postfix:
            text += "; " + " ".join(f"{k}={v}" for k, v in self._postfix.items())
        return text

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):   # no isatty, or a closed stream
        return False


def track(iterable: Iterable[T], total: int, desc: str, *, unit: str = "steps", initial: int = 0,
          enabled: bool = True, stream: Optional[IO[str]] = None) -> Iterator[T]:
    """`iterable` (the loop's remaining units), reporting one unit after each item is processed."""
    with Progress(total, desc, unit=unit, initial=initial, enabled=enabled, stream=stream) as bar:
        for item in iterable:
            yield item
            bar.update(1)
