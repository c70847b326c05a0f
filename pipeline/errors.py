"""User errors: problems in the user's params, data or checkpoints, reported in one line.

The CLI prints these without a traceback and exits non-zero; anything else is a bug and keeps its
traceback.
"""


import contextlib
import re
from typing import Iterator

# The longest message (the CLI's line `error: <message>` is then at most 500 characters), and the
# longest value quoted inside one: a 10 MB string in a params file or a data line must not become a
# 10 MB message.
MAX_MESSAGE = 500 - len("error: ")
MAX_QUOTED = 80


def shown(value: object, limit: int = MAX_QUOTED, keep_end: bool = False) -> str:
    """`value` for quoting in a message: repr of a non-string, one line, cut to `limit` characters
    with the full length said; `keep_end`: cut in the middle instead, for what says most at its end
    (a command line, whose arguments and pid follow a long executable path)."""
    try:
        text = value if isinstance(value, str) else repr(value)
    except ValueError:   # an integer beyond Python's int-to-string limit
        text = f"an integer of about {int(value.bit_length() * 0.30103)} digits" if isinstance(value, int) else "?"
    text = re.sub(r"\s+", " ", text)
    if len(text) <= limit:
        return text
    return _middle_cut(text, limit) if keep_end else f"{text[:limit]}... ({len(text)} characters)"


def _middle_cut(text: str, limit: int) -> str:
    """`text` in `limit` characters: its start and its end, "..." for what is left out."""
    head = (limit - 3) // 2
    return f"{text[:head]}...{text[len(text) - (limit - 3 - head):]}"


def one_line(message: str, limit: int = MAX_MESSAGE) -> str:
    """A message as one line of at most `limit` characters. A longer one loses its middle, not its
    end: it starts with the file and ends with what to do (a long checkout path must not cut off
    the advice)."""
    text = re.sub(r"\s*\n\s*", " ", message.strip())
    return text if len(text) <= limit else _middle_cut(text, limit)


class UserError(Exception):
    """Base of errors a user can act on; the message names the file and the line or key. Shown as
    one line of at most MAX_MESSAGE characters, whatever the message was built from."""

    def __str__(self) -> str:
        return one_line(super().__str__())


class ConfigError(UserError, ValueError):
    """A bad params file: the message names the file and the dotted key."""


class DataError(UserError, ValueError):
    """A bad input file: the message starts with `file:line:` (or `file:` for whole-file faults)."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that is missing, pickled, or of another model than expected."""


class StorageError(UserError):
    """An output or checkpoint could not be written (a full disk, a quota, a read-only file system):
    the message names the path and the cause; the temporary files are gone and what was complete
    before is unchanged (pipeline/files.py `writing`)."""


class BusyError(UserError):
    """Another run holds the stage's output folder (pipeline/files.py `exclusive`)."""


class NumericalError(UserError):
    """A loss, gradient, reward or advantage became NaN or infinite; the message names which and when."""


class Stopped(Exception):
    """A stage stopped at a step boundary on a signal (a time limit, a preemption) after saving its
    checkpoint (pipeline/training/stopping.py); not a user's mistake: the command exits with 75."""

    def __str__(self) -> str:
        return one_line(super().__str__())


@contextlib.contextmanager
def loading(path: object, what: str, hint: str = "") -> Iterator[None]:
    """The one guard around reading a checkpoint (a model or tokenizer folder, resumable state):
    whatever the loader raises (safetensors, tokenizers, pickle, JSON, OS errors...) becomes one
    CheckpointError naming the path and what was being loaded, plus `hint` (e.g. what to delete).
    Errors that already are user errors pass unchanged; interrupts are never caught."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:   # noqa: BLE001 - the boundary: any loader failure is a bad checkpoint
        first = next((line for line in str(err).splitlines() if line.strip()), "")
        # The path once, the hint whole: the loader's words get what a long path leaves of the line.
        frame = f"{path}: cannot load {what} ({type(err).__name__}: ){hint}"
        cause = shown(first, max(40, min(200, MAX_MESSAGE - len(frame) - 30)))
        raise CheckpointError(f"{path}: cannot load {what} ({type(err).__name__}: {cause}){hint}") from None


def check_finite(where: str, name: str, value) -> None:
    """Stop at the step a quantity stops being finite. `where` names the step ("sft step 7")."""
    import torch   # here: errors.py is imported by the light CLI paths too

    if not bool(torch.isfinite(torch.as_tensor(value)).all()):
        raise NumericalError(f"{where}: {name} is NaN or infinite; stopped, the last checkpoint is kept")
