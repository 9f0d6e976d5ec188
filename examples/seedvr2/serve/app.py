"""The HTTP API of ``serve`` (FastAPI; its OpenAPI schema at ``/openapi.json``, browsable at ``/docs``).

``POST /v1/restorations`` takes an upload (multipart field ``file``) or, with ``--allow-paths DIR``, a ``path`` under
DIR, plus the per-job options of ``restore``; ``GET /v1/restorations/{id}`` says how the job stands, ``.../result``
is the restored file, ``.../input`` the file restored, ``DELETE`` cancels (or removes a finished job). ``/v1/health``
and ``/metrics`` (Prometheus text) tell how the server stands; ``/`` is a small web page. A bearer token, when the
server has one, guards everything but ``/v1/health`` and the page itself (which holds no data and asks for it).
"""

from __future__ import annotations

import hmac
import os
import re
import shutil
from typing import Annotated, Literal, Optional

from fastapi import FastAPI, File, Form, HTTPException, Request, UploadFile
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, PlainTextResponse

from .jobs import FINISHED, STATES
from .server import Refused, Server

__all__ = ["create_app"]

#: room for the multipart framing and the option fields around the uploaded file
FORM_SLACK = 64 * 1024
PAGE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "page.html")
OPEN_PATHS = ("/", "/v1/health")
ColorFix = Literal["wavelet", "adain", "lab", "none"]


def _error(status: int, message: str, headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status, headers=headers)


class Guard:
    """ASGI middleware run before any body is read: the bearer token, and the upload's declared size."""

    def __init__(self, app, token: Optional[str], max_upload: int) -> None:
        self.app, self.max_upload = app, max_upload
        self.token = None if token is None else f"Bearer {token}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            headers = dict(scope["headers"])
            refusal = None
            if self.token is not None and scope["path"] not in OPEN_PATHS:
                if not hmac.compare_digest(headers.get(b"authorization", b""), self.token):
                    refusal = _error(401, "a bearer token is required (Authorization: Bearer TOKEN)",
                                     {"WWW-Authenticate": "Bearer"})
            if refusal is None and scope["method"] == "POST" and scope["path"] == "/v1/restorations":
                length = headers.get(b"content-length")
                if length is None or not length.isdigit():
                    refusal = _error(411, "an upload must say its Content-Length")
                elif int(length) > self.max_upload + FORM_SLACK:
                    refusal = _error(413, f"the upload is {int(length)} bytes; this server takes at most "
                                          f"{self.max_upload} (--max-upload-mb)")
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _suffix(name: str) -> str:
    """The upload's extension, kept so the decoder sees the same file the CLI would (letters and digits only)."""
    ext = os.path.splitext(name)[1].lower()
    return ext if re.fullmatch(r"\.[a-z0-9]{1,8}", ext) else ""


def create_app(server: Server) -> FastAPI:
    config, store = server.config, server.store
    max_upload = int(config.max_upload_mb * 2**20)
    app = FastAPI(title="SeedVR2 restoration server (winsp)", version="1",
                  description="Restore videos and images with SeedVR2 on warm ranks. See docs/serving.md.")

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())[1:]) or "request"
        return _error(400, f"{where}: {first.get('msg', 'invalid')}")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return _error(exc.status_code, str(exc.detail))

    def find(job_id: str):
        job = store.jobs.get(job_id)
        if job is None:
            raise HTTPException(404, f"no job {job_id} (never submitted, deleted, or evicted)")
        return job

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        with open(PAGE, encoding="utf-8") as f:
            return HTMLResponse(f.read())

    @app.post("/v1/restorations", status_code=202, summary="Submit a restoration job",
              responses={400: {"description": "a wrong option"}, 401: {"description": "no or a wrong token"},
                         403: {"description": "a path outside --allow-paths"},
                         413: {"description": "the upload, its frames or its pixels exceed the limits"},
                         422: {"description": "restore refuses the file, or it does not fit the memory"},
                         429: {"description": "the queue is full"}, 503: {"description": "shutting down"}})
    async def submit(
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
        job_id = store.new_id()
        try:
            if file is not None:
                name = os.path.basename(file.filename or "upload")
                target = os.path.join(store.folder(job_id), "input" + _suffix(name))
                size = await run_in_threadpool(_save_upload, file, target)
                if size > max_upload:
                    raise HTTPException(413, f"the upload is over {max_upload} bytes (--max-upload-mb)")
                job = await run_in_threadpool(server.check, job_id, target, name, options, True)
            else:
                assert path is not None
                target = _allowed_path(config.allow_paths, path)
                job = await run_in_threadpool(server.check, job_id, target, os.path.basename(target), options, False)
            server.submit(job)
        except Refused as exc:
            store.discard(job_id)
            raise HTTPException(exc.status, exc.message) from None
        except BaseException:
            store.discard(job_id)
            raise
        return job.status()

    @app.get("/v1/restorations", summary="List the jobs")
    async def list_jobs() -> dict:
        return {"jobs": [j.status() for j in sorted(store.jobs.values(), key=lambda j: j.sequence)]}

    @app.get("/v1/restorations/{job_id}", summary="A job's state and progress")
    async def status(job_id: str) -> dict:
        """``state`` (queued, running, done, failed, cancelled), ``progress`` (frames done, ETA in seconds) and, when
        it failed, ``error``: the one line ``restore`` prints."""
        return find(job_id).status()

    @app.get("/v1/restorations/{job_id}/result", summary="The restored file", response_class=FileResponse)
    async def result(job_id: str):
        job = find(job_id)
        if job.state != "done":
            raise HTTPException(409, f"job {job_id} is {job.state}; the result exists once it is done")
        stem = os.path.splitext(job.name)[0] or "restored"
        return FileResponse(job.output, filename=f"{stem}_restored{os.path.splitext(job.output)[1]}")

    @app.get("/v1/restorations/{job_id}/input", summary="The file the job restores", response_class=FileResponse)
    async def source(job_id: str):
        job = find(job_id)
        if not os.path.isfile(job.input):
            raise HTTPException(410, f"the input of job {job_id} is gone")
        return FileResponse(job.input, filename=job.name)

    @app.delete("/v1/restorations/{job_id}", summary="Cancel a job, or remove a finished one")
    async def cancel(job_id: str) -> dict:
        """A queued job is cancelled at once; a running one stops at its next temporal batch boundary (its state
        turns cancelled then; ``cancel_requested`` is true meanwhile); a finished one is removed with its files."""
        job = find(job_id)
        if job.state in FINISHED:
            store.delete(job)
            return {"id": job_id, "state": "deleted"}
        server.cancel(job)
        return job.status()

    @app.get("/v1/health", summary="Whether the server runs jobs (no token needed)")
    async def health() -> JSONResponse:
        state = "restarting" if server.pool.restarting else server.health
        body = {"status": "draining" if server.draining else state, "ranks": config.ranks,
                "alive": server.pool.alive(), "queue": len(store.queued()),
                "running": server.current.id if server.current is not None else None}
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse)
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(_metrics(server), media_type="text/plain; version=0.0.4")

    app.add_middleware(Guard, token=config.token, max_upload=max_upload)
    return app


def _save_upload(file: UploadFile, target: str) -> int:
    """Copy the upload to ``target``; returns its size."""
    file.file.seek(0)
    with open(target, "wb") as out:
        shutil.copyfileobj(file.file, out, 1 << 20)
        return out.tell()


def _allowed_path(root: Optional[str], path: str) -> str:
    """``path`` resolved, refused unless ``--allow-paths`` is given and it lies under that folder."""
    if root is None:
        raise Refused(403, "this server takes uploads only (start it with --allow-paths DIR to name server files)")
    base = os.path.realpath(root)
    full = os.path.realpath(os.path.join(base, path))
    if os.path.commonpath([base, full]) != base:
        raise Refused(403, f"{path} is outside the folder this server may read (--allow-paths)")
    if not os.path.isfile(full):
        raise Refused(422, f"input file not found: {path}")
    return full


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

