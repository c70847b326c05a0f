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
