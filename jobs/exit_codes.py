"""The `ditfleet` command's exit codes (what each means: jobs/cli.py's docstring) and UsageError."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class UsageError(ValueError):
    """A bad command line (other than what argparse catches)."""


@contextlib.contextmanager
def usage_errors(*errors: type[Exception]) -> Iterator[None]:
    """One of `errors` raised in the block is a bad command line: a UsageError with its message."""
    try:
        yield
    except errors as e:
        raise UsageError(str(e)) from e
