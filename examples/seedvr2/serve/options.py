"""``serve``'s command line, and the per-job options a client may set, both checked by ``restore``'s own parser.

The server's own flags (address, ranks, limits, state) are parsed here; every other flag is one of ``restore``'s
model, weight, memory and SP options and is checked by ``restore``'s parser (same messages), then passed to every
job. A job's options become ``restore`` flags after those, so they win, exactly as on one ``restore`` command line.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import ipaddress
import os
import re
from typing import Optional, Sequence

__all__ = ["build_serve_parser", "ServeConfig", "parse_serve", "check_restore_flags", "job_flags", "restore_args",
           "UsageError", "JOB_OPTIONS", "is_loopback"]

PROG = "python -m examples.seedvr2 serve"
#: restore flags that make no sense for a server (it names the files itself; `serve --ranks` starts the ranks)
SERVER_OWNED = ("-o", "--output", "--overwrite", "--ranks", "--quiet")
#: the per-job options: form field -> restore flag
JOB_OPTIONS = {"resolution": "--resolution", "scale": "--scale", "color_fix": "--color-fix", "seed": "--seed",
               "batch_frames": "--batch-frames", "crf": "--crf"}
MIB = 2**20


class UsageError(ValueError):
    """A serve command line or job option that is wrong: one line."""


class _Parser(argparse.ArgumentParser):
    """argparse whose usage errors are :class:`UsageError` (one line, like every other error)."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(message)


def build_serve_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Keep N ranks warm (weights loaded once, plan caches warm) and restore jobs over HTTP: a job API "
                    "under /v1/restorations (OpenAPI schema at /openapi.json), a web page at /, /v1/health and "
                    "/metrics. See docs/serving.md.",
        epilog="Every other flag is one of restore's model, weight, memory and SP options (--model, "
               "--dit-checkpoint, --vae-checkpoint, --demo, --text-embeds, --weights, --dtype, --vae-parallel, "
               "--vae-tile, --shard-weights, --batch-frames, --overlap, --sp-size, --color-fix, --seed, --crf, "
               "--allow-partial-input; see restore --help); they apply to every job, whose own options win.")
    p.add_argument("--ranks", type=int, default=1, metavar="N",
                   help="ranks started on this machine (one per GPU; gloo on the CPU) (default 1)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 picks a free one)")
    p.add_argument("--state-dir", metavar="DIR",
                   help="keep jobs, uploads and results here: a server started again on it keeps the finished "
                        "results and queues again the jobs that had not finished (default: a temporary folder "
                        "removed at exit)")
    p.add_argument("--allow-paths", metavar="DIR",
                   help="let jobs name a file on the server under DIR instead of uploading it (default: uploads only)")
    p.add_argument("--allowed-host", action="append", metavar="NAME",
                   help="a name clients (or a reverse proxy) reach this server by, answered in the Host header besides "
                        "the loopback names (repeatable; default: the loopback names when bound to loopback, any "
                        "name otherwise)")
    p.add_argument("--token-file", metavar="PATH",
                   help="a file holding a bearer token every request but /v1/health must carry (Authorization: "
                        "Bearer TOKEN) (default: no token)")
    p.add_argument("--client-tokens", metavar="PATH",
                   help="a file of one 'NAME TOKEN' line per client, instead of --token-file: each client sends its "
                        "own token and sees, cancels and deletes only its own jobs (default: none)")
    p.add_argument("--max-upload-mb", type=float, default=1024.0, metavar="MB",
                   help="largest upload accepted, in MiB (default 1024)")
    p.add_argument("--max-queue", type=int, default=16, metavar="N",
                   help="jobs waiting at most; more are refused with HTTP 429 (default 16)")
    p.add_argument("--max-results", type=int, default=100, metavar="N",
                   help="finished jobs kept; the oldest are evicted beyond (default 100)")
    p.add_argument("--max-results-mb", type=float, default=10240.0, metavar="MB",
                   help="disk the finished jobs' files may take, in MiB; the oldest are evicted beyond (default 10240)")
    p.add_argument("--max-frames", type=int, default=100_000, metavar="N",
                   help="frames a job's input may have (default 100000)")
    p.add_argument("--max-pixels", type=int, default=7680 * 4320, metavar="N",
                   help="pixels of a job's output frame at most (default 7680x4320)")
    p.add_argument("--drain-timeout", type=float, default=60.0, metavar="S",
                   help="on SIGTERM, seconds the running job may take to finish before it is cancelled (it is "
                        "queued again for a server started on the same --state-dir) (default 60)")
    return p


class ServeConfig(argparse.Namespace):
    """The parsed serve command line plus ``restore_flags``: the restore options every job gets."""

    restore_flags: list
    token: Optional[str]
    clients: dict


def _restore_parse(argv: Sequence[str]) -> argparse.Namespace:
    """``restore``'s parser on ``argv``; its one-line error as :class:`UsageError`."""
    from ..cli import build_parser

    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            return build_parser().parse_args(["restore", *argv])
    except SystemExit:
        line = said.getvalue().strip().splitlines()
        text = line[-1] if line else "invalid option"
        prefix = "python -m examples.seedvr2: error: "
        text = text[len(prefix):] if text.startswith(prefix) else text
        raise UsageError(re.sub(r" \(see [^()]*--help\)$", "", text)) from None


def restore_args(input_path: str, output: str, flags: Sequence[str]) -> argparse.Namespace:
    """The parsed ``restore INPUT -o OUTPUT FLAGS --quiet`` a job runs (what every rank parses too)."""
    return _restore_parse([input_path, "-o", output, *flags, "--quiet"])


def check_restore_flags(flags: Sequence[str]) -> None:
    """The restore options given to serve, checked by restore's parser (imports torch: the server does it while its
    ranks start)."""
    checked = _restore_parse(["placeholder.mp4", *flags])
    extra = [p for p in checked.input if p != "placeholder.mp4"]
    if extra:
        raise UsageError(f"serve takes no input files (got {extra[0]!r}); send jobs to POST /v1/restorations")


def parse_serve(argv: Sequence[str], check_restore: bool = True) -> ServeConfig:
    """The serve command line; :class:`UsageError` for a mistake. ``check_restore=False`` leaves the restore options
    to :func:`check_restore_flags`."""
    config, rest = build_serve_parser().parse_known_args(list(argv), namespace=ServeConfig())
    for flag in rest:
        if flag.split("=", 1)[0] in SERVER_OWNED:
            raise UsageError(f"{flag.split('=', 1)[0]} is not a serve option (the server names the files and starts "
                             f"the ranks itself)")
    if check_restore:
        check_restore_flags(rest)
    if config.ranks < 1:
        raise UsageError(f"--ranks must be at least 1, got {config.ranks}")
    for name in ("max_queue", "max_results", "max_frames", "max_pixels"):
        if getattr(config, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(config, name)}")
    for name in ("max_upload_mb", "max_results_mb"):
        if not getattr(config, name) > 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive, got {getattr(config, name)}")
    if config.allow_paths is not None and not os.path.isdir(config.allow_paths):
        raise UsageError(f"--allow-paths {config.allow_paths} is not a folder")
    config.token = None
    if config.token_file is not None:
        try:
            with open(config.token_file) as f:
                config.token = f.read().strip()
        except OSError as exc:
            raise UsageError(f"--token-file {config.token_file}: {exc.strerror or exc}") from None
        if not config.token:
            raise UsageError(f"--token-file {config.token_file} is empty")
    config.clients = _client_tokens(config)
    config.restore_flags = list(rest)
    return config


def _client_tokens(config) -> dict:
    """``--client-tokens``: token -> client name (empty without the option)."""
    if config.client_tokens is None:
        return {}
    if config.token is not None:
        raise UsageError("give either --token-file (one token for everyone) or --client-tokens, not both")
    try:
        with open(config.client_tokens) as f:
            lines = [line.split() for line in f if line.strip() and not line.lstrip().startswith("#")]
    except OSError as exc:
        raise UsageError(f"--client-tokens {config.client_tokens}: {exc.strerror or exc}") from None
    clients: dict = {}
    for number, fields in enumerate(lines, 1):
        if len(fields) != 2 or fields[1] in clients or fields[0] in clients.values():
            raise UsageError(f"--client-tokens {config.client_tokens}: entry {number} must be 'NAME TOKEN', with "
                             f"names and tokens each used once")
        clients[fields[1]] = fields[0]
    if not clients:
        raise UsageError(f"--client-tokens {config.client_tokens} names no client")
    return clients


def job_flags(options: dict) -> list[str]:
    """A job's options (form fields, None when not given) as restore flags, in a fixed order."""
    flags: list[str] = []
    for field, flag in JOB_OPTIONS.items():
        value = options.get(field)
        if value is not None and value != "":
            flags += [flag, str(value)]
    crf = options.get("crf")
    if crf is not None and crf != "" and not 0 <= int(crf) <= 51:
        raise UsageError(f"--crf must be an integer from 0 (lossless) to 51, got {crf}")
    scale = options.get("scale")
    if scale is not None and scale != "":
        from ..media import MediaError, check_scale

        try:
            check_scale(float(scale))
        except MediaError as exc:
            raise UsageError(str(exc)) from None
    seed = options.get("seed")
    if seed is not None and seed != "" and not 0 <= int(seed) < 2**63:
        raise UsageError(f"--seed must be an integer from 0 to 2**63-1, got {seed}")
    batch = options.get("batch_frames")
    if batch is not None and batch != "" and not 1 <= int(batch) <= 100_000:
        raise UsageError(f"--batch-frames must be from 1 to 100000, got {batch}")
    return flags


def is_loopback(host: str) -> bool:
    """Whether ``host`` (an address to bind) reaches this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
