"""``python -m examples.seedvr2 serve``: SeedVR2 as an HTTP service on warm ranks (see docs/serving.md).

:mod:`.options` (the command line and the per-job options), :mod:`.worker` (one rank's loop), :mod:`.ranks` (the
pool of ranks the server drives), :mod:`.jobs` (jobs, queue, persistence, eviction) and :mod:`.job_records` (a
job's record read as untrusted input), :mod:`..media.untrusted` (inputs opened as data, never as paths),
:mod:`.server` (acceptance and dispatch), :mod:`.app` (the HTTP API and the pages), :mod:`.process` (the process:
ranks, uvicorn, drain). Needs the ``serve`` extra (FastAPI, uvicorn, python-multipart).
"""
