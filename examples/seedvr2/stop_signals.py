"""Stopping on SIGTERM / SIGINT: remove the partial output, say so in one line, exit 143 / 130, at once.

A batch scheduler or ``docker stop`` sends SIGTERM, a user presses Ctrl-C (SIGINT). Python runs its signal handlers
only on the main thread between bytecodes, which may be minutes away while that thread is inside one long torch
operation or blocked in a collective. So the handler here does nothing but let Python's C-level handler write the
signal number to a pipe (``signal.set_wakeup_fd``); a watcher thread blocked on that pipe wakes at once (torch
releases the GIL inside its operations), removes the temporary output files (:func:`.media.remove_partial_outputs`,
which also stops new ones), prints one line and ends the process with ``os._exit(128 + signal)``. No traceback, no
``.partial`` file left behind.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Callable, Optional

from .media import remove_partial_outputs

__all__ = ["StopOnSignals", "STOP_SIGNALS"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_QUIT = b"\0"  # written by the owner to end the watcher (no signal is numbered 0)


class StopOnSignals:
    """Context manager: while active, SIGTERM / SIGINT end the process as described in the module docstring.

    ``message(signum, removed)`` returns the line to print (None: print nothing, e.g. on ranks other than 0);
    ``removed`` lists the partial files deleted. Outside the main thread (where signals cannot be caught) it does
    nothing. On exit the previous handlers and wakeup fd are restored, so it can be used once per call of ``main``.
    """

    def __init__(self, message: Callable[[int, list], Optional[str]], stream=None) -> None:
        self.message = message
        self.stream = stream
        self._active = False

    def __enter__(self) -> "StopOnSignals":
        if threading.current_thread() is not threading.main_thread():
            return self
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self._previous = {s: signal.signal(s, _ignore) for s in STOP_SIGNALS}
        self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
        self._watcher = threading.Thread(target=self._watch, name="stop-on-signals", daemon=True)
        self._watcher.start()
        self._active = True
        return self

    def __exit__(self, *exc) -> None:
        if not self._active:
            return
        self._active = False
        signal.set_wakeup_fd(self._previous_fd)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        os.write(self._write, _QUIT)
        self._watcher.join(timeout=5)
        os.close(self._read)
        os.close(self._write)

    def _watch(self) -> None:
        while True:
            data = os.read(self._read, 1)
            if not data or data == _QUIT:
                return
            signum = data[0]
            if signum in STOP_SIGNALS:
                self._stop(signum)

    def _stop(self, signum: int) -> None:
        removed = remove_partial_outputs()
        try:
            line = self.message(signum, removed)
            if line:
                stream = self.stream if self.stream is not None else sys.stderr
                stream.write(f"\n{line}\n" if getattr(stream, "isatty", lambda: False)() else f"{line}\n")
                stream.flush()
        finally:
            os._exit(128 + signum)


def _ignore(signum, frame) -> None:
    """Python-level handler: the watcher thread does the work (this one may run late, or never)."""
