"""User errors: problems in the user's params, data or checkpoints, reported in one line.

The CLI prints these without a traceback and exits non-zero; anything else is a bug and keeps its
traceback.
"""


class UserError(Exception):
    """Base of errors a user can act on; the message names the file and the line or key."""


class ConfigError(UserError, ValueError):
    """A bad params file: the message names the file and the dotted key."""


class DataError(UserError, ValueError):
    """A bad input file: the message starts with `file:line:` (or `file:` for whole-file faults)."""


class CheckpointError(UserError, ValueError):
    """A checkpoint that is missing, pickled, or of another model than expected."""


class NumericalError(UserError):
    """A loss, gradient, reward or advantage became NaN or infinite; the message names which and when."""


def check_finite(where: str, name: str, value) -> None:
    """Stop at the step a quantity stops being finite. `where` names the step ("sft step 7")."""
    import torch   # here: errors.py is imported by the light CLI paths too

    if not bool(torch.isfinite(torch.as_tensor(value)).all()):
        raise NumericalError(f"{where}: {name} is NaN or infinite; stopped, the last checkpoint is kept")
