"""What the command line writes: text with its control characters escaped, and library errors as one line on
stderr with the exit status the one table (``EXIT_STATUSES``) gives them."""

from __future__ import annotations

import re
from typing import Any

import click

from pipeline.errors import BulkClassifyError, EmptySourceError, GateFailed, ParityFailed

EMPTY_SOURCE_EXIT = 4  # `run` on a source with nothing to classify: a warning and this status, DEST untouched
NIGHTLY_ERROR_EXIT = 2  # `nightly`: a bad option, storage, model or an empty source (1 is a crash)
GATE_EXIT = 3  # `model quantize` and `model import`: the gate or the parity check refused the model
ERROR_EXIT = 1
# The one table of how a library error leaves the command line: (command, exception class, exit status); the first
# row whose command ("*": any) and class match wins. The message goes to stderr in one line, "Error: " first
# ("warning: " for the empty source), its control characters escaped; an exception no row matches is a crash
# (a traceback, exit status 1). Click's own usage errors exit 2, and `report --against` exits DRIFT_EXIT_CODE on
# drift and `model check` 1 on a failed engine: results, not errors (docs/operations.md lists every status).
EXIT_STATUSES: tuple[tuple[str, type[BaseException], int], ...] = (
    ("run", EmptySourceError, EMPTY_SOURCE_EXIT),
    ("nightly", BulkClassifyError, NIGHTLY_ERROR_EXIT),
    ("model quantize", GateFailed, GATE_EXIT),
    ("model import", ParityFailed, GATE_EXIT),
    ("repo prepare", Exception, ERROR_EXIT),  # anything, named by its type, in one line for the pod log
    ("*", BulkClassifyError, ERROR_EXIT),
)
# What reaches the terminal from names, labels and errors: C0 controls but tab and newline, DEL, C1 controls and the
# bidirectional overrides, shown escaped so that a hostile label cannot retitle, recolour or reorder the terminal.
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def escape_controls(text: str) -> str:
    """``text`` with control characters written as Python escapes (``\\x1b``, ``\\u202e``)."""
    return _CONTROLS.sub(lambda m: repr(m.group())[1:-1], text)


def echo(text: str = "", **kwargs: Any) -> None:
    """``click.echo`` of ``text`` with its control characters escaped: every line the commands write goes here."""
    click.echo(escape_controls(text), **kwargs)


class Failure(click.ClickException):
    """A library error in one line on stderr, with its control characters escaped, and its exit status."""

    def __init__(self, message: str, exit_code: int = ERROR_EXIT, prefix: str = "Error: "):
        super().__init__(message)
        self.exit_code, self.prefix = exit_code, prefix

    def format_message(self) -> str:
        return escape_controls(self.message)

    def show(self, file: Any = None) -> None:
        echo(f"{self.prefix}{self.format_message()}", err=True)


def failure(command: str, err: BaseException) -> Failure | None:
    """``err`` raised under ``command`` ("model quantize") as EXIT_STATUSES maps it; None: a crash, left to raise."""
    for name, kind, status in EXIT_STATUSES:
        if name in ("*", command) and isinstance(err, kind):
            message = str(err) if issubclass(kind, BulkClassifyError) else f"{type(err).__name__}: {err}"
            return Failure(message, status, prefix="warning: " if status == EMPTY_SOURCE_EXIT else "Error: ")
    return None
