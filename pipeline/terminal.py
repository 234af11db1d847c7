"""The CLI's terminal: Ray's own notices kept off it unless ``-v`` asks for them.

Ray Data warns through Python's ``warnings`` (operator concurrency notices), and the driver's C++ core worker writes
its log lines straight to file descriptor 2, where no Python logger can reach them. Neither is about the user's
run, and a user reads a line starting with ``E`` or ``UserWarning`` as a failure, so without ``-v`` the first are
filtered and the second are dropped from the process's stderr; everything else passes through unchanged.
"""

from __future__ import annotations

import atexit
import os
import re
import sys
import threading
import warnings

# Ray's C++ log lines: "[2026-12-02 06:33:41,502 E 963 963] core_worker.cc:2465: Actor with class name: ...".
RAY_BACKEND_LINE = re.compile(rb"^\[\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [DIWE] \d+ \d+\] [a-z_]+\.cc:\d+: ")
# Ray's notices that say nothing about the run (each one line of its C++ log).
RAY_NOTICES = (b"has constructor arguments in the object store and max_restarts > 0",)


def quiet_ray() -> None:
    """Keep Ray's notices off the terminal for the rest of this process (call once, before Ray starts). Only where
    stderr is the process's own: a caller that captured ``sys.stderr`` (click's test runner) keeps what it has."""
    if sys.stderr is not sys.__stderr__:
        return
    warnings.filterwarnings("ignore", category=UserWarning, module=r"ray\.")
    _StderrFilter.install()


class _StderrFilter:
    """File descriptor 2 through a pipe; a thread copies it to the real stderr, without Ray's notice lines.

    Bytes that cannot start such a line pass at once (a progress bar redraws without newlines); a line that may be
    one is held until its newline.
    """

    _installed: "_StderrFilter | None" = None

    @classmethod
    def install(cls) -> None:
        if cls._installed is None:
            cls._installed = cls()

    def __init__(self) -> None:
        self.out = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)
        self.read = read
        self.thread = threading.Thread(target=self._copy, name="stderr-filter", daemon=True)
        self.thread.start()
        atexit.register(self.close)

    def _copy(self) -> None:
        pending = b""
        while True:
            chunk = os.read(self.read, 65536)
            if not chunk:
                break
            pending += chunk
            pending = self._forward(pending)
        if pending:
            self._write(pending)

    def _forward(self, data: bytes) -> bytes:
        """Writes what is decided, returns what waits for more bytes."""
        while data:
            if not data.startswith(b"["):
                cut = data.find(b"\n[")
                if cut < 0:
                    self._write(data)
                    return b""
                self._write(data[: cut + 1])
                data = data[cut + 1:]
                continue
            end = data.find(b"\n")
            if end < 0:
                # Long enough to tell: not a Ray log line, so it passes (a bracketed progress line, say).
                if len(data) > 64 and not RAY_BACKEND_LINE.match(data):
                    self._write(data)
                    return b""
                return data
            line, data = data[: end + 1], data[end + 1:]
            if not (RAY_BACKEND_LINE.match(line) and any(n in line for n in RAY_NOTICES)):
                self._write(line)
        return b""

    def _write(self, data: bytes) -> None:
        try:
            os.write(self.out, data)
        except OSError:
            pass

    def close(self) -> None:
        """Puts stderr back and writes what is left (at exit)."""
        try:
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        try:
            os.dup2(self.out, 2)  # the pipe's write end closes: the thread reads to its end
        except OSError:
            return
        self.thread.join(timeout=2)
