"""``restore ... --ranks N``: the CLI starts its N ranks on this machine itself, without torchrun.

The parent process never imports torch (``python -m examples.seedvr2`` comes here before the CLI module is
imported): it picks a free loopback port, starts N copies of the same command as subprocesses with the variables
torchrun would set (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR=127.0.0.1``,
``MASTER_PORT``), and then only waits and forwards signals. The ranks rendezvous through torch's TCP store on that
port (``init_process_group``'s ``env://``), gloo on the CPU and NCCL with one GPU a rank, exactly as under
``torchrun --nproc-per-node N``, so the results are the same.

Failures stay one line, by one rule (the table in docs/failures.md): a rank that catches its own failure says it
in one line (rank 0 alone for bad input, which every rank finds identically before any collective); the launcher
speaks for a rank that cannot: one killed without a word (the OOM killer's SIGKILL: ``rank 1 was killed by
SIGKILL``), one stopped by a signal sent to it alone (``rank 1 was stopped by SIGTERM``), and one that stopped
answering (a rank whose collective timed out names it in a note it leaves here instead of printing it, see
:func:`leave_note`). After the first failure the others get :data:`GRACE_S` to notice and stop on their own, then
SIGTERM (SIGKILL for a stopped one; they stop silently: the launcher has marked the run failed, see
:data:`FAILED_ENV`) and SIGKILL after :data:`KILL_S` more. A partial output a rank left behind (it was killed before
it could remove it) is removed by the launcher: every rank records its temporary files here (:func:`record_partial`).
The exit code is the failed rank's (2 for an error, 128 + N when stopped by signal N), or 2 when a rank was killed.
SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2 and SIGALRM sent to the launcher are forwarded to the ranks
(rank 0 prints the one line, or the launcher when rank 0 could not); if the launcher itself is killed, the kernel
sends its ranks SIGTERM (``PR_SET_PDEATHSIG``). A missing input, and missing or empty checkpoint and text-embedding
files named by flags, are refused before any rank starts (one line at once, instead of N ranks importing torch
first). Should rank 0 find the chosen port taken when it binds it (another program got there first), the ranks are
started again on another port. A rank knows it was started by this launcher from ``SEEDVR2_LAUNCHED``, which holds
the launcher's process id and so cannot be inherited from a shell. For several machines keep using torchrun.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Callable, Mapping, Optional, Sequence

from ..media.launch_record import LAUNCH_DIR_ENV, LAUNCHED_ENV, PARTIALS_FILE, launched_rank, record_partial
from ..media.launch_record import launch_file as _launch_file
from .terminal_text import printable

__all__ = ["LaunchError", "wants_launcher", "requested_ranks", "gpu_count", "rank_environment", "launch",
           "LAUNCHED_ENV", "FAILED_ENV", "LAUNCH_DIR_ENV", "launched_rank", "env_rank", "record_partial",
           "leave_note", "record_port_taken", "preflight", "restore_inputs", "PORT_TAKEN_EXIT", "speaks_for_stop"]

PROG = "python -m examples.seedvr2"
#: a path the launcher creates once a rank has failed: a rank stopped by SIGTERM after it prints nothing
FAILED_ENV = "SEEDVR2_LAUNCH_FAILED"
#: seconds the other ranks get to stop on their own after one failed, before SIGTERM; then until SIGKILL
GRACE_S, KILL_S = 2.0, 5.0
#: how often a stop signal is sent again to ranks that have not ended yet
RESEND_S = 0.5
#: the exit code of a rank 0 that found the rendezvous port taken (the launcher then starts again on another one)
PORT_TAKEN_EXIT = 75
#: how many ports are tried before the launcher gives up
PORT_ATTEMPTS = 3
FORWARDED = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2",
                                                     "SIGALRM") if hasattr(signal, name))
_STOP_CODES = {128 + int(s): s for s in FORWARDED}
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_PARTIALS, _PORT_TAKEN = PARTIALS_FILE, "port-taken"


class LaunchError(ValueError):
    """A --ranks request that cannot be started (reported as one line, exit code 2)."""


def speaks_for_stop(rank: Optional[int] = None) -> bool:
    """Whether this process prints the line of a stop signal: rank 0 (:func:`env_rank`) alone, and not when the
    launcher is stopping the ranks because another one failed (that one said why, or the launcher does)."""
    rank = env_rank() if rank is None else rank
    marker = os.environ.get(FAILED_ENV)
    return rank == 0 and not (launched_rank() and marker and os.path.exists(marker))


def env_rank(env: Optional[Mapping[str, str]] = None) -> int:
    """This process's rank as torchrun or the launcher describe it: ``RANK`` when ``WORLD_SIZE`` is above 1, else 0
    (a ``RANK`` left in the environment without a world is ignored, so a lone process always speaks)."""
    env = os.environ if env is None else env
    try:
        if int(env.get("WORLD_SIZE") or "1") <= 1:
            return 0
        return int(env.get("RANK") or "0")
    except ValueError:
        return 0


def _option_value(argv: Sequence[str], name: str) -> Optional[str]:
    """The text of ``NAME VALUE`` / ``NAME=VALUE`` in ``argv`` (the last one wins, as argparse does), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == "--":
            break
        if arg == name:
            value = argv[i + 1] if i + 1 < len(argv) else ""
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def requested_ranks(argv: Sequence[str]) -> Optional[str]:
    """The text of ``--ranks N`` / ``--ranks=N`` in ``argv`` (the last one wins, as argparse does), or None."""
    return _option_value(argv, "--ranks")


def wants_launcher(argv: Sequence[str], env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether this process is the launcher: ``--ranks`` given, not a rank already, and not asking for help."""
    return (requested_ranks(argv) is not None and not launched_rank(env)
            and not any(a in ("-h", "--help") for a in argv))


#: the ``restore`` options that take a value, and those that do not (tests/test_faults.py checks them against the
#: CLI's parser): what :func:`preflight` needs to tell the inputs from the options' values without importing torch
VALUE_OPTIONS = frozenset({"-o", "--output", "--resolution", "--scale", "--model", "--dit-checkpoint",
                           "--vae-checkpoint", "--text-embeds", "--weights", "--seed", "--dtype", "--vae-parallel",
                           "--vae-tile", "--batch-frames", "--overlap", "--sp-size", "--color-fix", "--crf",
                           "--ranks"})
FLAG_OPTIONS = frozenset({"-h", "--help", "--overwrite", "--allow-partial-input", "--allow-large-output", "--demo",
                          "--shard-weights", "--quiet", "--restart", "--no-resume-store", "--untrusted-input"})


def restore_inputs(argv: Sequence[str]) -> Optional[list[str]]:
    """The INPUT arguments of ``restore ...``, or None when that cannot be told without the parser (another command,
    an abbreviated or unknown option: the ranks' parser then decides)."""
    if not argv or argv[0] != "restore":
        return None
    inputs: list[str] = []
    i, after_inputs = 1, False
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return None if inputs else list(argv[i + 1:])
        if arg.startswith("-") and arg != "-":
            name = arg.split("=", 1)[0]
            if name in VALUE_OPTIONS:
                i += 1 if "=" in arg else 2
            elif name in FLAG_OPTIONS and "=" not in arg:
                i += 1
            else:
                return None
            after_inputs = bool(inputs)
            continue
        if after_inputs:
            return None  # a second run of inputs after options: the parser refuses it
        inputs.append(arg)
        i += 1
    return inputs


def preflight(argv: Sequence[str]) -> Optional[str]:
    """What is wrong with the files the command names, found without torch before any rank starts (None: nothing):
    a single input that does not exist, or a checkpoint or text-embedding file that is missing, a folder, or empty.
    The ranks check the rest (what the files hold) together, and rank 0 reports it. (Of several inputs a missing one
    is that file's failure, reported in its turn while the others run.)"""
    inputs = restore_inputs(argv)
    if inputs is not None and len(inputs) == 1 and not os.path.lexists(inputs[0]):
        return f"input file not found: {inputs[0]}"
    for flag in ("--dit-checkpoint", "--vae-checkpoint", "--text-embeds"):
        path = _option_value(argv, flag)
        if not path:
            continue
        if os.path.isdir(path):
            return f"{flag}: {path} is a directory, not a {'file' if flag == '--text-embeds' else 'checkpoint file'}"
        if not os.path.isfile(path):
            return f"{flag}: file not found: {path}"
        if os.path.getsize(path) == 0:
            return f"{flag}: {path} is empty (0 bytes)"
    return None


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
    env[LAUNCHED_ENV] = str(os.getpid())
    env[FAILED_ENV] = failed_marker
    env[LAUNCH_DIR_ENV] = os.path.dirname(failed_marker)
    env.setdefault("OMP_NUM_THREADS", str(max(1, cpus // ranks)))  # the cores shared, not each rank taking all
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = _REPO + (os.pathsep + path if path else "")
    return env


# ---- what the ranks tell the launcher (files in its folder; nothing when not launched) ------------------------------


def leave_note(rank: int, line: str) -> bool:
    """A rank that stops because of another (its collective failed) leaves its line here instead of printing it; the
    launcher prints it only when no rank said why (a rank that stopped answering). False when not launched."""
    note = _launch_file(f"note-{rank}")
    if note is None:
        return False
    with open(note, "w", encoding="utf-8", errors="backslashreplace") as f:
        f.write(line)
    return True


def record_port_taken() -> bool:
    """Rank 0 found the rendezvous port taken: the launcher starts the ranks again on another. False when not
    launched (the caller then reports it)."""
    marker = _launch_file(_PORT_TAKEN)
    if marker is None:
        return False
    open(marker, "w").close()
    return True


def _prepare_rank() -> None:
    """In the child before exec: SIGINT ignored until the CLI installs its handling (a Ctrl-C reaches the terminal's
    whole process group, and one that lands while the interpreter itself starts is a "Fatal Python error" traceback;
    the launcher repeats the stop until the rank takes it), and SIGTERM when the launcher dies (Linux), so no rank
    outlives it."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
    except Exception:  # noqa: BLE001 - not Linux: the launcher still forwards every catchable signal
        pass


# ---- the launcher -----------------------------------------------------------------------------------------------


def launch(argv: Sequence[str], stream=None, module: str = "examples.seedvr2",
           run_here: Optional[Callable[[list[str]], int]] = None) -> int:
    """Run the command ``argv`` (as given to ``python -m examples.seedvr2``) on ``--ranks`` ranks; returns the exit
    code (see the module docstring). ``module`` is what each rank runs with ``python -m`` (tests inject faults);
    ``run_here`` runs the command in this process when one rank is asked for (``__main__`` passes the restore
    command's ``main``: the launcher sits below the commands it starts)."""
    stream = sys.stderr if stream is None else stream

    def say(line: str) -> None:
        stream.write(f"{PROG}: {printable(line)}\n")
        stream.flush()

    if os.environ.get("WORLD_SIZE") and not launched_rank():
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
        if run_here is None:
            raise TypeError("launch(): --ranks 1 runs the command in this process; pass run_here (its main)")
        return run_here(list(argv))
    problem = preflight(argv)
    if problem is not None:
        say(f"error: {problem}")
        return 2
    workdir = tempfile.mkdtemp(prefix="seedvr2-launch-")
    failed_marker = os.path.join(workdir, "failed")
    stopping: list[int] = []
    procs: list[subprocess.Popen] = []

    def forward(signum, frame) -> None:
        stopping.append(signum)
        _signal_all(procs, signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        for _ in range(PORT_ATTEMPTS):
            port = free_port()
            procs[:] = []
            for rank in range(ranks):
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", module, *argv],
                    env=rank_environment(os.environ, rank, ranks, port, failed_marker, cpus),
                    stdin=None if rank == 0 else subprocess.DEVNULL, preexec_fn=_prepare_rank))
                if stopping:  # a signal while starting them: the ones started get it too
                    _signal_all(procs, stopping[0])
            code = _wait(procs, workdir, stopping, say)
            if code is not None:
                return code
            _clear(workdir)
        say(f"error: could not start the ranks: the rendezvous port was taken by another program {PORT_ATTEMPTS} "
            f"times in a row (rank 0 binds the port the launcher picked moments before); try again")
        return 2
    finally:
        for p in procs:  # only on the way out of an unexpected error: nothing may outlive the launcher
            if p.poll() is None:
                p.kill()
                p.wait()
        for s, handler in previous.items():
            signal.signal(s, handler)
        _clear(workdir)
        os.rmdir(workdir)


def _wait(procs: list, workdir: str, stopping: list, say) -> Optional[int]:
    """Wait for every rank; after the first failure stop the others; then say what the ranks could not (the rule in
    the module docstring). Returns the exit code, or None when rank 0 found the port taken (start again)."""
    failures: list[int] = []  # the ranks that failed by themselves, in the order seen: the first is the cause
    terminated: set[int] = set()  # the ranks the launcher stopped
    failed_at = terminated_at = None
    forwarded_at = time.monotonic()
    while True:
        codes = [p.poll() for p in procs]
        if codes[0] == PORT_TAKEN_EXIT and os.path.exists(os.path.join(workdir, _PORT_TAKEN)) and not stopping:
            _signal_all(procs, signal.SIGKILL)  # all of them still starting: nothing to clean up
            for p in procs:
                p.wait()
            return None
        seen = [r for r, c in enumerate(codes) if c not in (None, 0) and r not in failures and r not in terminated]
        # of ranks seen failing at once, a cause before a consequence (a rank that left a note failed because of one)
        failures += sorted(seen, key=lambda r: (os.path.exists(os.path.join(workdir, f"note-{r}")), r))
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if stopping and now - forwarded_at > RESEND_S:  # a rank still starting may not have taken it yet
            forwarded_at = now
            _signal_all(procs, stopping[0])
        if failures and failed_at is None:
            failed_at = now
            if not stopping:  # a stop the user asked for is reported by rank 0 itself
                open(os.path.join(workdir, "failed"), "w").close()
        if failed_at is not None and terminated_at is None and now - failed_at > GRACE_S:
            terminated_at = now
            terminated.update(r for r, c in enumerate(codes) if c is None)
            for p in procs:  # a stopped rank (SIGSTOP) is killed: continued, its timed-out calls would print a lot
                if p.poll() is None:
                    _signal_all([p], signal.SIGKILL if _is_stopped(p.pid) else signal.SIGTERM)
        if terminated_at is not None and now - terminated_at > KILL_S:
            _signal_all(procs, signal.SIGKILL)
        time.sleep(0.02)
    removed = _remove_partials(workdir)
    left = f" and its partial output {', '.join(removed)} removed" if removed else ""
    if stopping:
        signum = stopping[0]
        if procs[0].returncode not in _STOP_CODES:  # rank 0 could not say it (killed by the signal while starting)
            what = f"removed the partial output {', '.join(removed)}" if removed else "no partial output left"
            say(f"stopped by {signal.Signals(signum).name}: {what}")
        return 128 + int(signum)
    if not failures:
        return 0
    rank = failures[0]
    code = procs[rank].returncode
    stopped_by = _STOP_CODES.get(code) or (-code in _STOP_CODES.values() and signal.Signals(-code)) or None
    if stopped_by:  # by a stop signal sent to this rank alone (or dead of it before its handling was in place)
        if rank != 0 or code < 0 or removed:  # rank 0 said it itself, unless it could not
            say(f"stopped: rank {rank} was stopped by {stopped_by.name} (sent to it alone); the other ranks were "
                f"stopped{left}")
        return 128 + int(stopped_by)
    if code < 0:
        name = signal.Signals(-code).name
        hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" if -code == signal.SIGKILL else ""
        say(f"error: rank {rank} was killed by {name}{hint}; the other ranks were stopped{left}")
        return 2
    note = os.path.join(workdir, f"note-{rank}")
    if os.path.exists(note):  # it stopped because of a rank that never said why (stopped answering, say)
        with open(note, encoding="utf-8") as f:
            say(f.read().strip())
    elif removed:
        say(f"error: rank {rank} ended with exit code {code}; removed the partial output {', '.join(removed)}")
    return code


def _is_stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP; Linux ``/proc``, else False)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def _remove_partials(workdir: str) -> list[str]:
    """Remove the temporary output files the ranks recorded that are still there; returns their names."""
    try:
        with open(os.path.join(workdir, _PARTIALS), "rb") as f:
            recorded = [os.fsdecode(p) for p in f.read().split(b"\0") if p]
    except FileNotFoundError:
        return []
    removed = []
    for path in dict.fromkeys(recorded):
        name = os.path.basename(path)
        if not (name.startswith(".") and ".partial" in name):  # only ever a temporary file of ours
            continue
        try:
            os.remove(path)
        except OSError:
            continue
        removed.append(name)
    return removed


def _clear(workdir: str) -> None:
    for name in os.listdir(workdir):
        os.remove(os.path.join(workdir, name))


def _signal_all(procs: list, signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(signum)
            except OSError:
                pass
