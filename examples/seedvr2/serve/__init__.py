"""``python -m examples.seedvr2 serve``: SeedVR2 as an HTTP service on warm ranks (see docs/serving.md).

:mod:`.options` (the command line and the per-job options), :mod:`.worker` (one rank's loop), :mod:`.ranks` (the
pool of ranks the server drives), :mod:`.jobs` (jobs, queue, persistence, eviction), :mod:`.server` (the process:
acceptance, dispatch, drain), :mod:`.app` (the HTTP API and the page). Needs the ``serve`` extra (FastAPI, uvicorn,
python-multipart).
"""
