"""The error class of mistakes a user fixes with a flag or a file.

`python -m megatron_dapo.train` prints a `UserError` as one line, `error: <message>`, on stderr and
exits with status 2 (argparse's status for bad usage); `--debug` shows the traceback instead. Every
message names what is wrong and the flag (or file and field) that fixes it.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input: a flag value, a data file, a model directory. A ValueError, so callers that catch those still do.

    `echo=False` marks the copy raised on ranks that only learned of rank 0's verdict: rank 0 prints it,
    the others exit quietly with the same status.
    """

    def __init__(self, message: str, *, echo: bool = True) -> None:
        super().__init__(message)
        self.echo = echo
