"""``python -m examples.seedvr2 serve``: the process. It starts the ranks (:mod:`.ranks`, or :mod:`.world` under
torchrun), makes every input open as untrusted media (:mod:`..media.untrusted`), builds the server (:mod:`.server`)
and its HTTP API (:mod:`.app`) and runs uvicorn on them. SIGTERM drains: no new jobs, the running one finishes or is
cancelled after ``--drain-timeout`` (and queued again in the state folder), then the process exits 0.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
from typing import Optional, Sequence

from ..media import untrusted as untrusted_media
from .options import UsageError, check_restore_flags, is_loopback, parse_serve
from .ranks import RankPool, StartError, remove_stale_workdirs
from .server import Server, log

__all__ = ["main", "PROG", "url_of", "is_loopback", "exposure_warning"]

PROG = "python -m examples.seedvr2 serve"
#: seconds a connection may take to send its request headers, and the longest wait for the next piece of a body
HEADER_TIMEOUT_S = 10.0


def exposure_warning(host: str, token: Optional[str]) -> Optional[str]:
    """The start-up's warning for a server reachable beyond this machine without a token (None when there is none
    to give)."""
    if is_loopback(host) or token is not None:
        return None
    return (f"WARNING: listening on {host}, beyond this machine, without --token-file: anyone who reaches it can "
            f"submit, read and delete jobs (see docs/serving.md, Exposing serve)")


def url_of(host: str, port: int) -> str:
    """``http://HOST:PORT`` with an IPv6 address in brackets."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _import_the_checks() -> None:
    """Import what accepting a job runs (restore's checks and memory estimate) now, not on the first upload."""
    from ..cli import restore  # noqa: F401
    from ..media import reading  # noqa: F401
    from ..memory import fit, limits  # noqa: F401
    from ..restore import pipeline  # noqa: F401


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(False)
    return sock


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``serve``; returns the exit code (0 after a drain, 2 for a mistake or ranks that fail)."""
    argv = list(sys.argv[2:] if argv is None else argv)
    from ..cli.launcher import LAUNCHED_ENV, LaunchError, check_ranks, gpu_count

    world = int(os.environ.get("WORLD_SIZE") or 1)
    torchrun = world > 1 and not os.environ.get(LAUNCHED_ENV)
    rank = int(os.environ.get("RANK") or 0) if torchrun else 0
    try:
        import uvicorn

        from .app import create_app
    except ImportError as exc:
        print(f"{PROG}: error: serve needs the serve extra ({exc.name} is missing): pip install -e \".[serve]\"",
              file=sys.stderr)
        return 2
    try:
        config = parse_serve(argv, check_restore=False)  # restore's own flags: while the ranks start (torch)
        if torchrun:
            if config.ranks not in (1, world):
                raise UsageError(f"--ranks {config.ranks} under torchrun's {world} ranks: leave --ranks out")
            config.ranks = world
            if rank != 0:
                from .world import follow

                return follow(config.restore_flags, config.drain_timeout)
        else:
            check_ranks(str(config.ranks), gpu_count(), os.cpu_count() or 1)
        sock = _bind(config.host, config.port)
    except (UsageError, LaunchError) as exc:
        if rank == 0:
            print(f"{PROG}: error: {exc} (see {PROG} --help)", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{PROG}: error: cannot listen on {config.host}:{config.port}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    untrusted_media.install(config.max_pixels)
    remove_stale_workdirs(log)
    temporary = config.state_dir is None
    state_dir = tempfile.mkdtemp(prefix="seedvr2-serve-") if temporary else config.state_dir
    os.makedirs(state_dir, exist_ok=True)
    if torchrun:
        from .world import WorldPool

        pool = WorldPool(config.restore_flags, log)
    else:
        pool = RankPool(config.ranks, config.restore_flags, log=log)
    try:
        pool.launch()
        try:
            check_restore_flags(config.restore_flags)
            _import_the_checks()
        except UsageError as exc:
            pool.stop()
            print(f"{PROG}: error: {exc} (see {PROG} --help)", file=sys.stderr)
            return 2
        log(f"started {config.ranks} rank(s); loading the weights")
        try:
            pool.wait_ready()
        except StartError as exc:
            print(f"{PROG}: error: {exc}", file=sys.stderr)
            return 2
        server = Server(config, state_dir, pool)
        http = _http_server(uvicorn.Config(create_app(server), log_level="warning", timeout_graceful_shutdown=5,
                                           timeout_keep_alive=5, http=_header_timeout_protocol()), server)
        server.start()
        host, port = sock.getsockname()[:2]
        log(f"listening on {url_of(host, port)} ({config.ranks} rank(s) ready, state in {state_dir})")
        warning = exposure_warning(config.host, config.token or ("clients" if config.clients else None))
        if warning is not None:
            log(warning)
        http.run(sockets=[sock])
        if not server.draining:  # uvicorn stopped for another reason: stop the ranks all the same
            server.draining = True
            pool.stop()
        log("stopped")
        return 0
    finally:
        if pool.alive():  # only on the way out of an unexpected error: no rank outlives the server
            pool._end(grace=0.0)
        if isinstance(pool, RankPool):
            pool.cleanup()
        sock.close()
        if temporary:
            shutil.rmtree(state_dir, ignore_errors=True)


def _header_timeout_protocol():
    """uvicorn's h11 protocol that closes a connection whose request headers have not all come within
    :data:`HEADER_TIMEOUT_S` of its opening or of its previous response (a slow client holding a connection open)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeout(H11Protocol):
        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def _arm(self) -> None:
            self._headers_due = self.loop.call_later(HEADER_TIMEOUT_S, self._headers_late)

        def _headers_late(self) -> None:
            cycle = getattr(self, "cycle", None)
            if (cycle is None or cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._headers_due.cancel()
            self._arm()

        def connection_lost(self, exc) -> None:
            self._headers_due.cancel()
            super().connection_lost(exc)

    return HeaderTimeout


def _http_server(config, server: Server):
    """uvicorn's server, whose first SIGTERM / SIGINT drains (see :meth:`Server.drain`) instead of stopping at once;
    a second SIGINT stops at once."""
    import uvicorn

    class Draining(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if server.draining:
                if sig == signal.SIGINT:
                    self.force_exit = self.should_exit = True
                return
            threading.Thread(target=server.drain, args=(self._drained,), daemon=True).start()

        def _drained(self) -> None:
            self.should_exit = True

    return Draining(config)
