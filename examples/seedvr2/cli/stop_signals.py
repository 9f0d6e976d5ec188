"""Stopping on a signal: remove the partial output, say so in one line, exit 128 + signal, at once.

A batch scheduler or ``docker stop`` sends SIGTERM, a user presses Ctrl-C (SIGINT), a closed terminal or SSH session
sends SIGHUP, ``kill -QUIT`` / ``-USR1`` / ``-USR2`` / ``-ALRM`` end a process by default too: every one of them ends
the run the same way (:data:`STOP_SIGNALS`). SIGPIPE is not among them: Python ignores it (a write to a closed pipe
fails with ``BrokenPipeError`` instead, a write error), and catching it would turn a peer's closed socket inside the
communication library into a stop.

Python runs its signal handlers only on the main thread between bytecodes, which may be minutes away while that
thread is inside one long torch operation or blocked in a collective. So the Python-level handler does nothing; the
interpreter's C-level handler writes the signal number to a pipe (``signal.set_wakeup_fd``) and a watcher thread
blocked on it wakes at once (torch releases the GIL inside its operations), removes the temporary output files
(:func:`~examples.seedvr2.media.writing.remove_partial_outputs`, which also stops new ones), prints one line and ends
the process with
``os._exit(128 + signal)``. No traceback, no ``.partial`` file left behind.

A thread needs the GIL, which a C loop that never releases it (or a cleanup that blocks: a full stderr pipe) can hold
for ever. So the pipe is read first by a watchdog: a small child process forked on entry, which holds no GIL of
ours. It forwards the signal number to the watcher thread, waits :data:`GRACE_S` seconds and, if this process is
still its parent then, ends it with SIGKILL (its partial file may then remain). On a normal exit the pipe closes and
the child exits with it. Where ``fork`` is unavailable, the watcher reads the pipe itself (no watchdog).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import warnings
from typing import Callable, Optional

from ..media.writing import remove_partial_outputs

__all__ = ["StopOnSignals", "STOP_SIGNALS", "GRACE_S"]

STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1",
                                                        "SIGUSR2", "SIGALRM") if hasattr(signal, name))
#: seconds the watchdog gives the process to stop by itself once a stop signal arrived
GRACE_S = 5.0


class StopOnSignals:
    """Context manager: while active, the :data:`STOP_SIGNALS` end the process as described in the module docstring.

    ``message(signum, removed)`` returns the line to print (None: print nothing, e.g. on ranks other than 0);
    ``removed`` lists the partial files deleted. Outside the main thread (where signals cannot be caught) it does
    nothing. On exit the previous handlers and wakeup fd are restored, so it can be used once per call of ``main``.
    """

    def __init__(self, message: Callable[[int, list], Optional[str]], stream=None, *, grace_s: float = GRACE_S,
                 watchdog: bool = True) -> None:
        self.message = message
        self.stream = stream
        self.grace_s = grace_s
        self.watchdog = watchdog
        self._active = False

    def __enter__(self) -> "StopOnSignals":
        if threading.current_thread() is not threading.main_thread():
            return self
        wake_read, wake_write = os.pipe()
        os.set_blocking(wake_write, False)
        # held back until the handlers are in place (then delivered), so that the child never sees one either
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            self._child = self._fork_watchdog(wake_read, wake_write) if self.watchdog else None
            # the parent keeps its read end of the wakeup pipe open (unread while the child reads), so that the
            # signal handler's write never meets a closed pipe, even if the child is gone
            self._wake_read = wake_read
            self._read = self._child[1] if self._child is not None else wake_read
            self._write = wake_write
            self._watching = True
            self._previous = {s: signal.signal(s, self._python_handler) for s in STOP_SIGNALS}
            self._previous_fd = signal.set_wakeup_fd(self._write, warn_on_full_buffer=False)
            self._watcher = threading.Thread(target=self._watch, name="stop-on-signals", daemon=True)
            self._watcher.start()
            self._active = True
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return self

    def __exit__(self, *exc) -> None:
        if not self._active:
            return
        self._active = False
        signal.set_wakeup_fd(self._previous_fd)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        if self._child is None:
            os.write(self._write, _QUIT)
        os.close(self._write)  # the watchdog child reads the end of the pipe and exits; its forward pipe closes
        if self._child is not None:
            os.waitpid(self._child[0], 0)
        self._watcher.join(timeout=5)
        os.close(self._read)
        if self._read != self._wake_read:
            os.close(self._wake_read)

    def _fork_watchdog(self, wake_read: int, wake_write: int) -> Optional[tuple[int, int]]:
        """Fork the watchdog child (see the module docstring): ``(pid, read end of its forward pipe)``, or None
        where ``fork`` is unavailable. Called with the stop signals blocked."""
        if not hasattr(os, "fork"):
            return None
        forward_read, forward_write = os.pipe()
        parent = os.getpid()
        try:
            with warnings.catch_warnings():  # 3.12+ warns about fork in a threaded process; the child runs no library
                warnings.simplefilter("ignore")
                pid = os.fork()
        except OSError:
            os.close(forward_read), os.close(forward_write)
            return None
        if pid == 0:  # the child: plain system calls only, and never back into the caller's code
            try:
                for s in STOP_SIGNALS:  # a Ctrl-C reaches the whole process group: the child outlives it
                    signal.signal(s, signal.SIG_IGN)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
                _keep_only(wake_read, forward_write)
                _watchdog(wake_read, forward_write, parent, self.grace_s)
            finally:
                os._exit(0)
        os.close(forward_write)
        return pid, forward_read

    def _watch(self) -> None:
        try:
            while True:
                data = os.read(self._read, 1)
                if not data or data == _QUIT:
                    return
                signum = data[0]
                if signum in STOP_SIGNALS:
                    self._stop(signum)
        finally:
            self._watching = False

    def _python_handler(self, signum, frame) -> None:
        """Python-level handler, run on the main thread whenever it gets to it: nothing to do while the watcher
        thread is there (it acts at once); if the watcher is gone (its watchdog child was killed, say), the stop
        happens here rather than never."""
        if not self._watching and self._active:
            self._stop(signum)

    def _stop(self, signum: int) -> None:
        try:
            removed = remove_partial_outputs()
            line = self.message(signum, removed)
            if line:
                stream = self.stream if self.stream is not None else sys.stderr
                stream.write(f"\n{line}\n" if getattr(stream, "isatty", lambda: False)() else f"{line}\n")
                stream.flush()
        finally:
            os._exit(128 + signum)


_QUIT = b"\0"  # written by the owner to end the watcher when there is no watchdog child (no signal is numbered 0)


def _keep_only(*fds: int) -> None:
    """Close every descriptor of the child but ``fds`` (stdin/out/err pointed at /dev/null), so that it holds no
    pipe, socket or file of the parent's open."""
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    top = max(fds)
    low = 3
    for fd in sorted(fds):
        os.closerange(low, fd)
        low = fd + 1
    try:
        limit = os.sysconf("SC_OPEN_MAX")
    except (ValueError, OSError):
        limit = 1 << 16
    os.closerange(top + 1, max(1 << 16, min(limit, 1 << 20)))


def _watchdog(wake_read: int, forward_write: int, parent: int, grace_s: float) -> None:
    """The watchdog child's loop: forward each signal number; after the first, give the parent ``grace_s``."""
    data = os.read(wake_read, 1)
    if not data:
        return  # the parent left the context normally (or died): nothing to watch
    os.write(forward_write, data)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if os.getppid() != parent:
            return  # the parent exited (we were re-parented): it stopped by itself
        time.sleep(0.05)
    if os.getppid() == parent:
        os.kill(parent, signal.SIGKILL)

