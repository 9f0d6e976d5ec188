"""``restore ... --ranks N``: the CLI starts its N ranks on this machine itself, without torchrun.

The parent process never imports torch (``python -m examples.seedvr2`` comes here before the CLI module is
imported): it picks a free loopback port, starts N copies of the same command as subprocesses with the variables
torchrun would set (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``,
``MASTER_PORT``), and then only waits and forwards signals. The ranks rendezvous through torch's TCP store on that
port (``init_process_group``'s ``env://``), gloo on the CPU and NCCL with one GPU a rank, exactly as under
``torchrun --nproc-per-node N``, so the results are the same.

Failures stay one line: a rank that fails reports it (as it would alone) and exits; the launcher then gives the
others :data:`GRACE_S` to notice and stop on their own, sends them SIGTERM (they stop silently: the launcher has
marked the run failed, see :data:`FAILED_ENV`) and SIGKILL after :data:`KILL_S` more. A rank killed without a word
(the OOM killer's SIGKILL) is reported by the launcher in one line. The exit code is the failed rank's (2 for an
error, 130 / 143 when stopped), or 2 when a rank was killed. SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1 and SIGUSR2
sent to the launcher are forwarded to the ranks (rank 0 prints the one line); if the launcher itself is killed, the
kernel sends its ranks SIGTERM (``PR_SET_PDEATHSIG``). For several machines keep using torchrun.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Mapping, Optional, Sequence

__all__ = ["LaunchError", "wants_launcher", "requested_ranks", "gpu_count", "rank_environment", "launch",
           "LAUNCHED_ENV", "FAILED_ENV"]

PROG = "python -m examples.seedvr2"
#: set in every rank the launcher starts (the CLI then leaves the peer-failure line to the rank that failed)
LAUNCHED_ENV = "SEEDVR2_LAUNCHED"
#: a path the launcher creates once a rank has failed: a rank stopped by SIGTERM after it prints nothing
FAILED_ENV = "SEEDVR2_LAUNCH_FAILED"
#: seconds the other ranks get to stop on their own after one failed, before SIGTERM; then until SIGKILL
GRACE_S, KILL_S = 2.0, 5.0
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class LaunchError(ValueError):
    """A --ranks request that cannot be started (reported as one line, exit code 2)."""


def requested_ranks(argv: Sequence[str]) -> Optional[str]:
    """The text of ``--ranks N`` / ``--ranks=N`` in ``argv`` (the last one wins, as argparse does), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == "--ranks":
            value = argv[i + 1] if i + 1 < len(argv) else ""
        elif arg.startswith("--ranks="):
            value = arg.split("=", 1)[1]
    return value


def wants_launcher(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is the launcher: ``--ranks`` given, not a rank already, and not asking for help."""
    env = os.environ if env is None else env
    return (requested_ranks(argv) is not None and not env.get(LAUNCHED_ENV)
            and not any(a in ("-h", "--help") for a in argv))


def gpu_count(env: Optional[Mapping[str, str]] = None, proc: str = "/proc/driver/nvidia/gpus") -> int:
    """GPUs the ranks may use, without importing torch: ``CUDA_VISIBLE_DEVICES`` when set, else the NVIDIA driver's
    device list (0 without the driver: the ranks run on the CPU)."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    try:
        present = len(os.listdir(proc))
    except OSError:
        present = 0
    if visible is not None:
        listed = [v for v in visible.split(",") if v.strip() and not v.strip().startswith("-")]
        return min(len(listed), present) if present else 0
    return present


def check_ranks(text: str, gpus: int, cpus: int) -> int:
    """The number of ranks from ``--ranks``' text, checked against the machine."""
    try:
        ranks = int(text)
    except ValueError:
        raise LaunchError(f"--ranks must be a whole number of ranks, got {text!r}") from None
    if ranks < 1:
        raise LaunchError(f"--ranks must be at least 1, got {ranks}")
    if gpus and ranks > gpus:
        raise LaunchError(f"--ranks {ranks}: this machine has {gpus} GPU{'s' if gpus != 1 else ''} (one rank a GPU); "
                          f"use --ranks {gpus} or fewer, or torchrun across machines")
    if not gpus and ranks > 4 * cpus:
        raise LaunchError(f"--ranks {ranks}: more than 4 ranks per CPU core would only thrash; this machine has "
                          f"{cpus} core{'s' if cpus != 1 else ''}, so --ranks {4 * cpus} at most (--ranks {cpus}, one "
                          f"a core, is usually fastest)")
    return ranks


def free_port() -> int:
    """A TCP port free on the loopback interface now (rank 0's store binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_environment(base: Mapping[str, str], rank: int, ranks: int, port: int, failed_marker: str,
                     cpus: int) -> dict[str, str]:
    """What a rank runs with: torchrun's variables for one node, loopback rendezvous, and the launcher's markers."""
    env = dict(base)
    env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(ranks), LOCAL_WORLD_SIZE=str(ranks),
               GROUP_RANK="0", ROLE_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env[LAUNCHED_ENV] = "1"
    env[FAILED_ENV] = failed_marker
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // ranks)))  # the cores shared, not each rank taking all
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = _REPO + (os.pathsep + path if path else "")
    return env


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the launcher dies (Linux), so no rank outlives it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the launcher still forwards every catchable signal
        pass


def launch(argv: Sequence[str], stream=None, module: str = "examples.seedvr2") -> int:
    """Run the command ``argv`` (as given to ``python -m examples.seedvr2``) on ``--ranks`` ranks; returns the exit
    code (see the module docstring). ``module`` is what each rank runs with ``python -m`` (tests inject faults)."""
    stream = sys.stderr if stream is None else stream

    def say(line: str) -> None:
        stream.write(f"{PROG}: {line}\n")
        stream.flush()

    if os.environ.get("WORLD_SIZE") and not os.environ.get(LAUNCHED_ENV):
        say(f"error: --ranks starts the ranks itself, but this process is already one of "
            f"{os.environ['WORLD_SIZE']} (torchrun?); leave --ranks out under torchrun")
        return 2
    cpus = os.cpu_count() or 1
    try:
        ranks = check_ranks(requested_ranks(argv) or "", gpu_count(), cpus)
    except LaunchError as exc:
        say(f"error: {exc} (see {PROG} restore --help)")
        return 2
    if ranks == 1:
        from .cli import main

        return main(list(argv))
    workdir = tempfile.mkdtemp(prefix="seedvr2-launch-")
    failed_marker = os.path.join(workdir, "failed")
    port = free_port()
    stopping: list[int] = []
    procs: list[subprocess.Popen] = []

    def forward(signum, frame) -> None:
        stopping.append(signum)
        _signal_all(procs, signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        for rank in range(ranks):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", module, *argv],
                env=rank_environment(os.environ, rank, ranks, port, failed_marker, cpus),
                stdin=None if rank == 0 else subprocess.DEVNULL, preexec_fn=_die_with_parent))
        return _wait(procs, failed_marker, stopping, say)
    finally:
        for p in procs:  # only on the way out of an unexpected error: nothing may outlive the launcher
            if p.poll() is None:
                p.kill()
                p.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
        for name in os.listdir(workdir):
            os.remove(os.path.join(workdir, name))
        os.rmdir(workdir)


def _wait(procs: list, failed_marker: str, stopping: list, say) -> int:
    """Wait for every rank; after the first failure stop the others (see the module docstring)."""
    first: Optional[tuple[int, int]] = None
    failed_at = terminated_at = None
    while True:
        codes = [p.poll() for p in procs]
        if all(c is not None for c in codes):
            break
        if first is None:
            for rank, code in enumerate(codes):
                if code not in (None, 0):
                    first, failed_at = (rank, code), time.monotonic()
                    if not stopping:  # a stop the user asked for is reported by rank 0 itself
                        open(failed_marker, "w").close()
                    break
        now = time.monotonic()
        if failed_at is not None and terminated_at is None and now - failed_at > GRACE_S:
            terminated_at = now
            _signal_all(procs, signal.SIGTERM)
        if terminated_at is not None and now - terminated_at > KILL_S:
            _signal_all(procs, signal.SIGKILL)
        time.sleep(0.02)
    if first is None:
        failures = [(rank, p.returncode) for rank, p in enumerate(procs) if p.returncode != 0]
        first = failures[0] if failures else None
    if stopping:
        return 128 + int(stopping[0])
    if first is None:
        return 0
    rank, code = first
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if -code == signal.SIGKILL else ""
        say(f"error: rank {rank} was killed by {name}{hint}; the other ranks were stopped")
        return 2
    return code


def _signal_all(procs: list, signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signum)
            except OSError:
                pass
