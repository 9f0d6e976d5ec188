"""The HTTP API of ``serve`` (FastAPI; its OpenAPI schema at ``/openapi.json``, browsable at ``/docs``).

``POST /v1/restorations`` takes an upload (multipart field ``file``) or, with ``--allow-paths DIR``, a ``path`` under
DIR, plus the per-job options of ``restore``; ``GET /v1/restorations/{id}`` says how the job stands, ``.../result``
is the restored file, ``.../input`` the file restored, ``DELETE`` cancels (or removes a finished job). ``/v1/health``
and ``/metrics`` (Prometheus text) tell how the server stands; ``/`` is a small web page, ``/docs`` the API's
reference (served from the package: it works offline). A bearer token, when the server has one, guards everything
but ``/v1/health`` and the two pages (they hold no data and ask for it).

Before any body is read (:class:`Guard`): the Host header must name this server (on loopback, a loopback name: no DNS
rebinding), a state-changing request from a browser must come from this server's own page (Origin, Sec-Fetch-Site),
the token, the queue's room (429) and the declared size; while the body arrives, the bytes received are counted
against ``--max-upload-mb`` (chunked or not) and each piece must come within :data:`BODY_TIMEOUT_S`. Every answer
carries a Content-Security-Policy, ``nosniff`` and ``frame-ancestors 'none'``; every error is one JSON line.
"""

from __future__ import annotations

import asyncio
import errno
import hmac
import mimetypes
import os
import shutil
from typing import Annotated, Literal, Optional

from fastapi import FastAPI, File, Form, HTTPException, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..media import untrusted as untrusted_media
from .jobs import FINISHED, STATES
from .server import Refused, Server, log

__all__ = ["create_app", "Guard", "SECURITY_HEADERS", "BODY_TIMEOUT_S"]

#: room for the multipart framing and the option fields around the uploaded file
FORM_SLACK = 64 * 1024
HERE = os.path.dirname(os.path.abspath(__file__))
PAGE = os.path.join(HERE, "page.html")
DOCS_PAGE = os.path.join(HERE, "docs.html")
OPEN_PATHS = ("/", "/docs", "/v1/health")
#: seconds the server waits for the next piece of a request body
BODY_TIMEOUT_S = 30.0
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
SECURITY_HEADERS = [
    (b"content-security-policy", b"default-src 'self'; script-src 'self' 'unsafe-inline'; style-src 'self' "
                                 b"'unsafe-inline'; img-src 'self' blob: data:; media-src 'self' blob:; connect-src "
                                 b"'self'; object-src 'none'; base-uri 'none'; form-action 'self'; "
                                 b"frame-ancestors 'none'"),
    (b"x-content-type-options", b"nosniff"), (b"x-frame-options", b"DENY"), (b"referrer-policy", b"no-referrer")]
ColorFix = Literal["wavelet", "adain", "lab", "none"]


def _error(status: int, message: str, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse({"error": message, "status": status}, status_code=status, headers=headers)


def _host_name(value: str) -> str:
    """The name in a Host (or Origin's authority) header, without its port, lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    """ASGI middleware: what is checked before any body is read, the body's bytes as they arrive, and the security
    headers of every answer (see the module)."""

    def __init__(self, app, server: Server, token: Optional[str], clients: dict, max_upload: int,
                 hosts: Optional[frozenset]) -> None:
        self.app, self.server, self.max_upload, self.hosts = app, server, max_upload, hosts
        #: "Bearer TOKEN" -> the client's name (None: the one shared token); empty: no token needed
        self.tokens = {f"Bearer {t}".encode(): name for t, name in clients.items()}
        if token is not None:
            self.tokens[f"Bearer {token}".encode()] = None

    def _client(self, headers: dict) -> tuple[bool, Optional[str]]:
        """Whether the request carries a token of this server, and whose (every token compared, in constant time)."""
        sent = headers.get(b"authorization", b"")
        found, who = False, None
        for token, name in self.tokens.items():
            if hmac.compare_digest(sent, token):
                found, who = True, name
        return found, who

    def _refusal(self, scope, headers: dict) -> Optional[JSONResponse]:
        host = headers.get(b"host", b"").decode("latin-1")
        if self.hosts is not None and _host_name(host) not in self.hosts:
            return _error(421, f"Host {host!r} is not a name of this server (start it with --allowed-host NAME to "
                               f"answer to it)")
        if scope["method"] not in ("GET", "HEAD", "OPTIONS"):
            origin = headers.get(b"origin", b"").decode("latin-1")
            site = headers.get(b"sec-fetch-site", b"").decode("latin-1")
            foreign = origin and _host_name(origin.split("://", 1)[-1]) != _host_name(host)  # a proxy may drop the port
            if foreign or site in ("cross-site", "same-site"):
                return _error(403, f"a {scope['method']} from another site ({origin or site}) is refused: send it "
                                   f"from this server's page or a client that sets no Origin")
        if self.tokens and scope["path"] not in OPEN_PATHS:
            found, who = self._client(headers)
            if not found:
                return _error(401, "a bearer token is required (Authorization: Bearer TOKEN)",
                              {"WWW-Authenticate": "Bearer"})
            scope.setdefault("state", {})["client"] = who
        if scope["method"] == "POST" and scope["path"] == "/v1/restorations":
            if self.server.draining:
                return _error(503, "the server is shutting down and takes no new jobs")
            if self.server.store.queue_full():
                return _error(429, f"the queue is full ({self.server.config.max_queue} jobs waiting, --max-queue); "
                                   f"try again later")
            length = headers.get(b"content-length")
            if length is None or not length.isdigit():
                return _error(411, "an upload must say its Content-Length")
            if int(length) > self.max_upload + FORM_SLACK:
                return _error(413, f"the upload is {int(length)} bytes; this server takes at most "
                                   f"{self.max_upload} (--max-upload-mb)")
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def secured(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), *SECURITY_HEADERS]}
            await send(message)

        refusal = self._refusal(scope, dict(scope["headers"]))
        if refusal is not None:
            await refusal(scope, receive, secured)
            return
        if scope["method"] == "POST":
            receive = self._counted(receive, self.max_upload + FORM_SLACK)
        await self.app(scope, receive, secured)

    def _counted(self, receive, limit: int):
        """``receive`` that counts the body's bytes (413 past ``limit``) and waits at most :data:`BODY_TIMEOUT_S`
        for each piece (408)."""
        received = 0

        async def counted():
            nonlocal received
            try:
                message = await asyncio.wait_for(receive(), BODY_TIMEOUT_S)
            except asyncio.TimeoutError:
                raise HTTPException(408, f"the request body stalled for {BODY_TIMEOUT_S:.0f}s") from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise HTTPException(413, f"the upload is over {self.max_upload} bytes (--max-upload-mb); "
                                             f"{received} received")
            return message
        return counted


def create_app(server: Server) -> FastAPI:
    config, store = server.config, server.store
    max_upload = int(config.max_upload_mb * 2**20)
    demo = "--demo" in config.restore_flags
    app = FastAPI(title="SeedVR2 restoration server (winsp)", version="1", docs_url=None, redoc_url=None,
                  description="Restore videos and images with SeedVR2 on warm ranks. See docs/serving.md.")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "request"
        return _error(400, f"{where}: {first.get('msg', 'invalid')}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log(f"error: {request.method} {request.url.path}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
        return _error(500, f"internal error ({type(exc).__name__}); the server log says more")

    def client_of(request: Request) -> Optional[str]:
        return getattr(request.state, "client", None)

    def find(job_id: str, request: Request):
        job = store.jobs.get(job_id)
        client = client_of(request)
        if job is None or (client is not None and job.client != client):  # another client's job: not there
            raise HTTPException(404, f"no job {job_id} (never submitted, deleted, or evicted)")
        return job

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        with open(PAGE, encoding="utf-8") as f:
            return HTMLResponse(f.read())

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    async def docs() -> HTMLResponse:
        with open(DOCS_PAGE, encoding="utf-8") as f:
            return HTMLResponse(f.read())

    @app.post("/v1/restorations", status_code=202, summary="Submit a restoration job",
              responses={400: {"description": "a wrong option"}, 401: {"description": "no or a wrong token"},
                         403: {"description": "a path outside --allow-paths"},
                         413: {"description": "the upload, its frames or its pixels exceed the limits"},
                         422: {"description": "restore refuses the file, or it does not fit the memory"},
                         429: {"description": "the queue is full"}, 503: {"description": "shutting down"}})
    async def submit(
            request: Request,
            file: Annotated[Optional[UploadFile], File(description="the video or image to restore")] = None,
            path: Annotated[Optional[str], Form(description="a file on the server, under --allow-paths")] = None,
            resolution: Annotated[Optional[str], Form(description="exact output size WxH")] = None,
            scale: Annotated[Optional[float], Form(description="output size = input size x S")] = None,
            color_fix: Annotated[Optional[ColorFix], Form(description="colour correction towards the input")] = None,
            seed: Annotated[Optional[int], Form(description="latent noise seed")] = None,
            batch_frames: Annotated[Optional[int], Form(description="frames per temporal batch, 4n+1")] = None,
            crf: Annotated[Optional[int], Form(description="H.264 quality, 0 (lossless) to 51")] = None) -> dict:
        """Queue a job; returns its status (``id``, ``state`` queued). The file and the options get ``restore``'s own
        checks, and the job its memory estimate, before it is accepted."""
        if server.draining:
            raise HTTPException(503, "the server is shutting down and takes no new jobs")
        if store.queue_full():
            raise HTTPException(429, f"the queue is full ({config.max_queue} jobs waiting, --max-queue); try again "
                                     f"later")
        if (file is None) == (path is None or path == ""):
            raise HTTPException(400, "give either a file (multipart field 'file') or a server path (field 'path')")
        options = {"resolution": resolution, "scale": scale, "color_fix": color_fix, "seed": seed,
                   "batch_frames": batch_frames, "crf": crf}
        try:
            job_id = store.new_id()
        except OSError as exc:
            raise HTTPException(507, f"the server cannot make the job's folder ({exc.strerror or exc})") from None
        try:
            if file is not None:
                name = os.path.basename(file.filename or "upload")
                target = await run_in_threadpool(_store_upload, file, store.folder(job_id), max_upload)
            else:
                assert path is not None
                name = os.path.basename(path)
                target = await run_in_threadpool(_store_allowed, config.allow_paths, path, store.folder(job_id))
            job = await run_in_threadpool(server.check, job_id, target, name, options, file is not None)
            job.client = client_of(request)
            server.submit(job)
        except Refused as exc:
            store.discard(job_id)
            raise HTTPException(exc.status, exc.message) from None
        except BaseException:
            store.discard(job_id)
            raise
        return job.status()

    @app.get("/v1/restorations", summary="List the jobs")
    async def list_jobs(request: Request) -> dict:
        client = client_of(request)
        mine = [j for j in store.jobs.values() if client is None or j.client == client]
        return {"jobs": [j.status() for j in sorted(mine, key=lambda j: j.sequence)]}

    @app.get("/v1/restorations/{job_id}", summary="A job's state and progress")
    async def status(job_id: str, request: Request) -> dict:
        """``state`` (queued, running, done, failed, cancelled), ``progress`` (frames done, ETA in seconds) and, when
        it failed, ``error``: the one line ``restore`` prints."""
        return find(job_id, request).status()

    @app.get("/v1/restorations/{job_id}/result", summary="The restored file", response_class=FileResponse)
    async def result(job_id: str, request: Request):
        job = find(job_id, request)
        if job.state != "done":
            raise HTTPException(409, f"job {job_id} is {job.state}; the result exists once it is done")
        stem = os.path.splitext(job.name)[0] or "restored"
        return FileResponse(job.output, filename=f"{stem}_restored{os.path.splitext(job.output)[1]}")

    @app.get("/v1/restorations/{job_id}/input", summary="The file the job restores", response_class=FileResponse)
    async def source(job_id: str, request: Request):
        job = find(job_id, request)
        if not os.path.isfile(job.input):
            raise HTTPException(410, f"the input of job {job_id} is gone")
        kind = mimetypes.guess_type(job.input)[0] or "application/octet-stream"  # the server's name, not the client's
        return FileResponse(job.input, filename=job.name, media_type=kind)

    @app.delete("/v1/restorations/{job_id}", summary="Cancel a job, or remove a finished one")
    async def cancel(job_id: str, request: Request) -> dict:
        """A queued job is cancelled at once; a running one stops at its next temporal batch boundary (its state
        turns cancelled then; ``cancel_requested`` is true meanwhile); a finished one is removed with its files."""
        job = find(job_id, request)
        if job.state in FINISHED:
            store.delete(job)
            return {"id": job_id, "state": "deleted"}
        server.cancel(job)
        return job.status()

    @app.get("/v1/health", summary="Whether the server runs jobs (no token needed)")
    async def health() -> JSONResponse:
        """200 with ``status`` ok while the ranks are up and the dispatcher runs; else 503 with ``reason``. Says
        whether a job runs, never which (no token is needed here)."""
        status, reason = "ok", None
        if server.draining:
            status, reason = "draining", "the server is shutting down"
        elif not server.dispatcher_alive():
            status, reason = "down", "the dispatcher stopped; restart the server"
        elif server.pool.restarting:
            status, reason = "restarting", "the ranks are being started again"
        elif server.health != "ok" or not server.pool.alive():
            status, reason = "down", "a rank is not running; the ranks are being started again"
        body = {"status": status, "reason": reason, "ranks": config.ranks, "alive": server.pool.alive(),
                "queue": len(store.queued()), "running": server.current is not None, "demo_weights": demo}
        return JSONResponse(body, status_code=200 if status == "ok" else 503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(_metrics(server), media_type="text/plain; version=0.0.4")

    app.add_middleware(Guard, server=server, token=config.token, clients=config.clients, max_upload=max_upload,
                       hosts=_hosts(config))
    return app


def _hosts(config) -> Optional[frozenset]:
    """The Host names answered: ``--allowed-host`` names and the loopback ones; any when bound beyond loopback
    without ``--allowed-host`` (the start-up says so)."""
    from .options import is_loopback

    named = frozenset(h.lower() for h in (config.allowed_host or []))
    if named:
        return named | LOOPBACK_NAMES
    return LOOPBACK_NAMES | {config.host.lower()} if is_loopback(config.host) else None


def _write_failed(exc: OSError) -> Refused:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return Refused(507, f"the server has no room for the upload ({exc.strerror or exc}); try again later")
    return Refused(500, f"the server could not store the upload ({exc.strerror or exc})")


def _store_input(folder: str, source, name: str) -> str:
    """Copy the file object ``source`` into ``folder`` as ``input.upload``, recognise its container by its bytes
    (:mod:`..media.untrusted`) and rename it ``input.<ext>`` after what it is; the path, or :class:`Refused`."""
    partial = os.path.join(folder, "input.upload")
    try:
        with open(partial, "xb") as out:
            shutil.copyfileobj(source, out, 1 << 20)
        kind = untrusted_media.check_file(partial, name)
        target = os.path.join(folder, "input" + kind.extension)
        os.replace(partial, target)
    except untrusted_media.UntrustedMedia as exc:
        raise Refused(exc.status, str(exc)) from None
    except OSError as exc:
        raise _write_failed(exc) from None
    return target


def _store_upload(file: UploadFile, folder: str, max_upload: int) -> str:
    """The upload stored in the job's folder (see :func:`_store_input`)."""
    file.file.seek(0, os.SEEK_END)
    if file.file.tell() > max_upload:
        raise Refused(413, f"the upload is over {max_upload} bytes (--max-upload-mb)")
    file.file.seek(0)
    return _store_input(folder, file.file, os.path.basename(file.filename or "upload"))


def _store_allowed(root: Optional[str], path: str, folder: str) -> str:
    """The server file ``path`` under ``--allow-paths``, opened once (symlinks resolved and checked by that open:
    :func:`..media.untrusted.open_allowed`) and copied from that handle into the job's folder, so that the job
    restores, and ``/input`` serves, exactly what was checked, whatever happens to the path afterwards."""
    if root is None:
        raise Refused(403, "this server takes uploads only (start it with --allow-paths DIR to name server files)")
    try:
        fd, _ = untrusted_media.open_allowed(root, path)
    except untrusted_media.UntrustedMedia as exc:
        raise Refused(exc.status, str(exc)) from None
    with os.fdopen(fd, "rb") as source:
        return _store_input(folder, source, os.path.basename(path))


def _metrics(server: Server) -> str:
    counts = server.store.counts()
    lines = ["# HELP seedvr2_queue_length Jobs waiting to run.", "# TYPE seedvr2_queue_length gauge",
             f"seedvr2_queue_length {counts['queued']}",
             "# HELP seedvr2_jobs Jobs the server holds, by state.", "# TYPE seedvr2_jobs gauge"]
    lines += [f'seedvr2_jobs{{state="{state}"}} {counts[state]}' for state in STATES]
    lines += ["# HELP seedvr2_frames_per_second Frames a second of the last job that finished (whole job).",
              "# TYPE seedvr2_frames_per_second gauge", f"seedvr2_frames_per_second {server.last_fps:.6g}",
              "# HELP seedvr2_frames_restored_total Frames of the jobs done since the server started.",
              "# TYPE seedvr2_frames_restored_total counter", f"seedvr2_frames_restored_total {server.frames_restored}",
              "# HELP seedvr2_frames_reused_total Frames that jobs took from their kept batches when they went on "
              "after a fault (a dead rank, a drain, a restart) instead of restoring them again, since the server "
              "started.", "# TYPE seedvr2_frames_reused_total counter",
              f"seedvr2_frames_reused_total {server.frames_reused}",
              "# HELP seedvr2_restore_seconds_total Seconds the ranks spent on jobs done since the server started.",
              "# TYPE seedvr2_restore_seconds_total counter",
              f"seedvr2_restore_seconds_total {server.restore_seconds:.6g}",
              "# HELP seedvr2_rank_peak_memory_bytes Each rank's peak memory (GPU memory allocated on CUDA, else "
              "resident set).", "# TYPE seedvr2_rank_peak_memory_bytes gauge"]
    lines += [f'seedvr2_rank_peak_memory_bytes{{rank="{rank}"}} {peak:.0f}'
              for rank, peak in sorted(server.pool.peaks.items())]
    lines += ["# HELP seedvr2_rank_restarts_total Times the ranks were started again after a rank died.",
              "# TYPE seedvr2_rank_restarts_total counter", f"seedvr2_rank_restarts_total {server.pool.restarts}",
              "# HELP seedvr2_up Whether the ranks are up (1) or being started again (0).", "# TYPE seedvr2_up gauge",
              f"seedvr2_up {1 if server.health == 'ok' and server.pool.alive() else 0}"]
    return "\n".join(lines) + "\n"

