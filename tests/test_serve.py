"""``python -m examples.seedvr2 serve``: a real server on loopback (the tiny demo weights), driven with httpx.

One server (1 rank, a bearer token, small limits) serves most cases; the drain/restart, the 2-rank and the
out-of-memory cases start their own (the 2-rank and drain ones are ``slow``). The out-of-memory cases limit the
ranks' address space for real through the test-only ``SEEDVR2_SERVE_TEST_RANK_MEMORY_MIB`` (see
``serve/worker.py``). Outputs are compared byte for byte with ``restore`` run with the same flags (lossless H.264,
``--crf 0``). The web page is driven in a real headless Chromium (``browser``; skipped without it).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("av")

from examples.seedvr2 import cli  # noqa: E402
from tests.media_files import write_truncated_faststart  # noqa: E402
from tests.test_cli import _frames, make_mp4  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOKEN = "s3cret-token"
START_S = 240.0
JOB_S = 240.0


def _serve_env(extra=None) -> dict:
    """The environment a test's server starts in: this one without a rank's launch variables (the server is no rank
    of this process's world), one thread a rank, the checkout importable, and ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "SEEDVR2_LAUNCHED")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    env.update(extra or {})
    return env


class Served:
    """A ``serve`` process started by a test: its URL, its log, and a client that carries the token."""

    def __init__(self, tmp, *flags, ranks: int = 1, token: bool = True, torchrun: int = 0, restarts: int = 0,
                 env=None) -> None:
        self.log_path = os.path.join(tmp, f"serve-{time.time_ns()}.log")
        # the test-only gate (serve/worker.py): while this file exists, a running job waits before each batch
        self.gate = os.path.join(tmp, f"gate-{time.time_ns()}")
        env = {"SEEDVR2_SERVE_TEST_GATE": self.gate, **(env or {})}
        prefix = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}",
                   f"--max-restarts={restarts}"] if torchrun else [sys.executable])
        argv = [*prefix, "-m", "examples.seedvr2", "serve", "--port", "0", "--demo", *map(str, flags)]
        argv += [] if torchrun else ["--ranks", str(ranks)]
        if token:
            token_file = os.path.join(tmp, "token")
            with open(token_file, "w") as f:
                f.write(TOKEN + "\n")
            argv += ["--token-file", token_file]
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(argv, cwd=REPO, env=_serve_env(env), stdout=self.log, stderr=subprocess.STDOUT)
        self.token = token
        self.listen(1)

    def listen(self, times: int) -> None:
        """Wait until the log says ``listening`` for the ``times``-th time (torchrun starts the world again: a new
        port), and talk to that server."""
        deadline = time.monotonic() + START_S
        while True:
            text = self.text()
            found = re.findall(r"listening on (http://[0-9.]+:\d+)", text)
            if len(found) >= times:
                self.url = found[times - 1]
                break
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"serve did not start:\n{text}")
            time.sleep(0.2)
        self.client = httpx.Client(base_url=self.url, timeout=60.0,
                                   headers={"Authorization": f"Bearer {TOKEN}"} if self.token else {})

    def text(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    def hold(self) -> None:
        """Close the gate: from now on a running job waits before its next temporal batch (until :meth:`release`,
        or until it is cancelled), so that a test acts on a running job whatever the machine's speed."""
        open(self.gate, "w").close()

    def release(self) -> None:
        if os.path.exists(self.gate):
            os.unlink(self.gate)

    def state_dir(self) -> str:
        """The state folder the log names (a temporary one unless --state-dir)."""
        return re.findall(r"state in (\S+)\)", self.text())[-1]

    def submit(self, path, **options) -> httpx.Response:
        with open(path, "rb") as f:
            return self.client.post("/v1/restorations", files={"file": (os.path.basename(path), f)},
                                    data={k: str(v) for k, v in options.items()})

    def status(self, job_id: str) -> dict:
        return self.client.get(f"/v1/restorations/{job_id}").json()

    def wait(self, job_id: str, states=("done", "failed", "cancelled"), timeout: float = JOB_S) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            status = self.status(job_id)
            if status["state"] in states:
                return status
            assert time.monotonic() < deadline, f"job {job_id} still {status}:\n{self.text()}"
            time.sleep(0.1)

    def ranks(self) -> list[int]:
        """The rank processes' ids (the server's children)."""
        with open(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children") as f:
            return [int(p) for p in f.read().split()]

    def torchrun_rank(self, rank: int) -> int:
        """The process id of torchrun's rank ``rank``."""
        for pid in self.ranks():
            with open(f"/proc/{pid}/environ", "rb") as f:
                if f"RANK={rank}".encode() in f.read().split(b"\0"):
                    return pid
        raise AssertionError(f"no rank {rank} among {self.ranks()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _noise_mp4(path) -> str:
    """A clip of random pixels: H.264 cannot make it small (well over the test server's 0.02 MiB)."""
    import av
    import numpy as np

    frames = np.random.default_rng(0).integers(0, 256, (10, 96, 96, 3), dtype=np.uint8)
    with av.open(str(path), "w") as c:
        s = c.add_stream("libx264", rate=24)
        s.width, s.height, s.pix_fmt, s.options = 96, 96, "yuv420p", {"crf": "0"}
        for f in frames:
            c.mux(s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")))
        c.mux(s.encode(None))
    assert os.path.getsize(path) > 0.02 * 2**20 + 64 * 1024
    return str(path)


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("media")
    return {"short": make_mp4(folder / "short.mp4", t=5, h=32, w=48),
            # 10 batches of 5 at 96x64: about 8 s on one thread of a fast core, so that it is still running while
            # a test uploads others and cancels or kills it (at 48x32 it took 1.9 s: a test's uploads outlasted it)
            "long": make_mp4(folder / "long.mp4", t=41, h=64, w=96),
            "big": _noise_mp4(folder / "big.mp4"),
            "broken": write_truncated_faststart(str(folder / "broken.mp4"), _frames(9, 32, 48)),
            "folder": str(folder)}


@pytest.fixture(scope="module")
def server(tmp_path_factory, media):
    served = Served(str(tmp_path_factory.mktemp("serve")), "--max-queue", "3", "--max-upload-mb", "0.02",
                    "--drain-timeout", "5", "--allow-paths", media["folder"])
    yield served
    served.stop()


def _restore(src, out, *flags, ranks: int = 1) -> bytes:
    """What ``restore`` writes with ``flags`` (and the demo weights): in this process, or ``--ranks N`` in its own."""
    argv = ["restore", src, "-o", str(out), "--demo", "--quiet", *map(str, flags)]
    if ranks == 1:
        # on one thread, as the server's ranks run (``_serve_env``: OMP_NUM_THREADS=1): a float sum's order follows the
        # thread count, so a pixel near a rounding edge can differ by one between thread counts (it did, on AVX-512)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            assert cli.main(argv) == 0
        finally:
            torch.set_num_threads(threads)
    else:
        done = subprocess.run([sys.executable, "-m", "examples.seedvr2", *argv, "--ranks", str(ranks)], cwd=REPO,
                              env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
    with open(out, "rb") as f:
        return f.read()


def _cancel_then_restore(served, media, clip: str) -> bytes:
    """The long clip (10 batches of 5 frames) cancelled once it runs (it ends cancelled at a batch boundary), then
    ``clip`` restored on the same ranks (in 5-frame batches): its result."""
    served.hold()
    long_id = served.submit(media["long"], crf=0, batch_frames=5).json()["id"]
    served.wait(long_id, states=("running",))
    served.client.delete(f"/v1/restorations/{long_id}")
    assert served.wait(long_id)["state"] == "cancelled"
    served.release()
    good = served.submit(media[clip], crf=0, batch_frames=5).json()["id"]
    assert served.wait(good)["state"] == "done", served.text()
    return served.client.get(f"/v1/restorations/{good}/result").content


def test_the_token_guards_everything_but_health(server):
    bare = httpx.Client(base_url=server.url, timeout=30)
    assert bare.get("/v1/health").status_code == 200
    assert bare.get("/v1/health").json()["status"] == "ok"
    for method, path in (("GET", "/v1/restorations"), ("GET", "/metrics"), ("GET", "/openapi.json"),
                         ("DELETE", "/v1/restorations/x"), ("POST", "/v1/restorations")):
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}):
            answer = bare.request(method, path, headers=headers)
            assert answer.status_code == 401, (method, path, headers, answer.text)
            assert answer.headers["www-authenticate"] == "Bearer"
    assert server.client.get("/v1/restorations").status_code == 200
    schema = server.client.get("/openapi.json").json()
    assert {"/v1/restorations", "/v1/restorations/{job_id}", "/v1/restorations/{job_id}/result",
            "/v1/health", "/metrics"} <= set(schema["paths"])


def test_refusals_are_one_line_before_anything_runs(server, media, tmp_path):
    too_large = server.submit(media["big"])  # 0.02 MiB allowed
    assert too_large.status_code == 413 and "--max-upload-mb" in too_large.json()["error"]
    unsized = server.client.post("/v1/restorations", content=iter([b"--x\r\n"]),  # chunked: no Content-Length
                                 headers={"content-type": "multipart/form-data; boundary=x"})
    assert unsized.status_code == 411, unsized.text
    refused = server.submit(media["broken"])  # restore's checks: it decodes fewer frames than it declares
    assert refused.status_code == 422
    message = refused.json()["error"]
    assert "broken.mp4" in message and "jobs" not in message  # the client's name, not where the server keeps it
    bad_option = server.submit(media["short"], batch_frames=6)
    assert bad_option.status_code == 422 and "4n+1" in bad_option.json()["error"], bad_option.text
    assert server.submit(media["short"], crf=99).status_code == 400
    both = server.client.post("/v1/restorations", data={"resolution": "64x64"})
    assert both.status_code == 400
    outside = server.client.post("/v1/restorations", data={"path": "../../etc/passwd"})
    assert outside.status_code == 403
    assert server.client.get("/v1/restorations").json()["jobs"] == []  # nothing was kept


def test_a_job_whose_file_breaks_fails_alone_then_a_good_job_is_restore_byte_for_byte(server, media, tmp_path):
    """A job whose input passes the checks at submission but is garbage when its turn comes (its copy in the state
    folder spoiled: a server file under --allow-paths is copied at submission, so changing that file changes nothing):
    the job fails with restore's one line, and the next job is byte for byte what restore writes."""
    victim = os.path.join(media["folder"], "victim.mp4")
    with open(media["short"], "rb") as src, open(victim, "wb") as dst:
        dst.write(src.read())
    server.hold()
    ahead = server.submit(media["long"], crf=0, batch_frames=5).json()["id"]
    server.wait(ahead, states=("running",))
    broken = server.client.post("/v1/restorations", data={"path": "victim.mp4", "crf": "0"})
    assert broken.status_code == 202, broken.text
    good = server.client.post("/v1/restorations", data={"path": "short.mp4", "crf": "0", "seed": "7"})
    assert good.status_code == 202, good.text
    with open(os.path.join(server.state_dir(), "jobs", broken.json()["id"], "input.mp4"), "wb") as f:
        f.write(b"no longer a video" * 100)
    with open(victim, "wb") as f:  # the server file itself: its job has its own copy
        f.write(b"no longer a video" * 100)
    server.client.delete(f"/v1/restorations/{ahead}")  # only held the queue until the file was spoiled
    server.release()
    failed = server.wait(broken.json()["id"])
    assert failed["state"] == "failed", failed
    assert failed["error"].startswith("victim.mp4 is not a video or image this server reads"), failed
    done = server.wait(good.json()["id"])
    assert done["state"] == "done" and done["progress"]["frames_done"] == 5, done
    result = server.client.get(done["result"])
    assert result.status_code == 200
    assert result.content == _restore(media["short"], tmp_path / "ref.mp4", "--crf", 0, "--seed", 7)
    assert server.client.get(f"/v1/restorations/{broken.json()['id']}/result").status_code == 409
    assert server.wait(ahead)["state"] == "cancelled"


def test_two_uploads_at_once_a_full_queue_and_cancels(server, media, tmp_path):
    """The gate holds whichever of the two uploads runs first at its first batch (not a clip long enough on some
    machine), so exactly 3 jobs wait when the queue refuses."""
    answers: list = [None, None]

    def upload(i: int) -> None:
        answers[i] = server.submit(media["short"] if i else media["long"], crf=0, batch_frames=5)

    server.hold()
    threads = [threading.Thread(target=upload, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert [a.status_code for a in answers] == [202, 202], [a.text for a in answers]
    long_id, short_id = answers[0].json()["id"], answers[1].json()["id"]
    first = [j for j in (long_id, short_id) if server.wait(j, states=("running", "queued"))["state"] == "running"]
    deadline = time.monotonic() + JOB_S
    while not first and time.monotonic() < deadline:  # the dispatcher picks the first within a moment
        first = [j for j in (long_id, short_id) if server.status(j)["state"] == "running"]
        time.sleep(0.05)
    assert len(first) == 1, [server.status(j) for j in (long_id, short_id)]
    extra = []
    for _ in range(4):  # the queue holds 3 waiting jobs: the fourth upload is refused
        answer = server.submit(media["short"], crf=0)
        if answer.status_code == 429:
            break
        extra.append(answer.json()["id"])
    assert answer.status_code == 429 and "queue is full (3 jobs waiting" in answer.json()["error"], answer.text
    assert len(extra) == 2, extra  # the held one runs, the other upload and 2 extras wait
    waiting = [j for j in (long_id, short_id, *extra) if server.status(j)["state"] == "queued"]
    assert len(waiting) == 3, [server.status(j) for j in (long_id, short_id, *extra)]
    for job_id in extra:  # a queued job is cancelled at once
        assert server.client.delete(f"/v1/restorations/{job_id}").json()["state"] == "cancelled"
    # the long job is cancelled: at once while queued, or at its batch boundary while running (held there)
    status = server.status(long_id)
    cancelled = server.client.delete(f"/v1/restorations/{long_id}").json()
    assert cancelled["cancel_requested"] if status["state"] == "running" else cancelled["state"] == "cancelled"
    ended = server.wait(long_id)
    server.release()
    assert ended["state"] == "cancelled" and ended["progress"]["frames_done"] < 41, ended
    assert server.client.get(f"/v1/restorations/{long_id}/result").status_code == 409
    done = server.wait(short_id)  # the ranks went on
    assert done["state"] == "done", done
    reference = _restore(media["short"], tmp_path / "ref.mp4", "--crf", 0, "--batch-frames", 5)
    assert server.client.get(done["result"]).content == reference
    metrics = server.client.get("/metrics").text
    assert re.search(r'^seedvr2_jobs\{state="cancelled"\} [1-9]', metrics, re.M), metrics
    assert re.search(r'^seedvr2_rank_peak_memory_bytes\{rank="0"\} [1-9]', metrics, re.M), metrics
    assert "seedvr2_queue_length 0" in metrics and status["progress"]["frames"] == 41
    assert server.client.delete(f"/v1/restorations/{short_id}").json()["state"] == "deleted"  # finished: removed
    assert server.client.get(f"/v1/restorations/{short_id}").status_code == 404


def test_a_killed_rank_is_restarted_and_its_job_goes_on(server, media, tmp_path):
    """The rank dies before the job's first batch finished: the ranks come back and the job runs again from its first
    frame (``tests/test_serve_resume.py`` kills ranks after batches were kept)."""
    server.hold()
    victim = server.submit(media["short"], crf=0)
    assert victim.status_code == 202, victim.text
    server.wait(victim.json()["id"], states=("running",))
    (rank,) = server.ranks()
    os.kill(rank, signal.SIGKILL)
    deadline = time.monotonic() + JOB_S
    while f"job {victim.json()['id']}: rank 0 was killed by SIGKILL" not in server.text():
        assert time.monotonic() < deadline, server.text()
        time.sleep(0.1)
    server.release()
    done = server.wait(victim.json()["id"])
    assert done["state"] == "done" and done["progress"]["frames_reused"] == 0, (done, server.text())
    assert server.client.get(done["result"]).content == _restore(media["short"], tmp_path / "r.mp4", "--crf", 0)
    assert "seedvr2_rank_restarts_total 1" in server.client.get("/metrics").text


#: a rank's room once ready, under a real address-space limit (worker.TEST_MEMORY_ENV): the short clip restores in it;
#: the same clip at 1152x768 needs an allocation of several hundred MiB in its first batch (the server's own, real
#: estimate lets it through: about 3 GiB of the rank's free memory)
RANK_ROOM_MIB = 400
TOO_BIG = "1152x768"


def _out_of_memory_line(error: str, rank: str = "") -> None:
    """``error`` is the line the CLI prints when an allocation fails at run time (cli.out_of_memory_error): out of
    memory from the real allocator, the (blinded) estimate and the binding limit, what to try."""
    assert error.startswith(f"{rank}out of memory on cpu (can't allocate memory: you tried to allocate "), error
    assert "; the estimate was 0 MiB per rank (" in error and "address-space limit (ulimit -v)" in error, error
    assert error.endswith("; try " + ", ".join(cli._MEMORY_HELP)), error


def _no_result(served, state, job_id: str) -> None:
    """Nothing of a failed job's output is served or left in its folder (its input and record only)."""
    assert served.client.get(f"/v1/restorations/{job_id}/result").status_code == 409
    assert sorted(os.listdir(state / job_id)) == ["input.mp4", "job.json"]


def test_a_job_that_runs_out_of_memory_mid_run_fails_alone_and_the_next_job_is_restore_byte_for_byte(media,
                                                                                                     tmp_path):
    """The rank runs under a real ``RLIMIT_AS`` with restore's estimate blinded on it (the test-only
    ``SEEDVR2_SERVE_TEST_RANK_MEMORY_MIB``; the server's acceptance check stays real): a job too big for the limit
    fails in the real allocator mid-run, with the CLI's one line; the same rank (one rank: nothing to restart) then
    restores the next job from the queue."""
    state = tmp_path / "state"
    served = Served(str(tmp_path), "--state-dir", state, token=False,
                    env={"SEEDVR2_SERVE_TEST_RANK_MEMORY_MIB": str(RANK_ROOM_MIB)})
    try:
        ranks = served.ranks()
        big = served.submit(media["short"], crf=0, resolution=TOO_BIG)
        good = served.submit(media["short"], crf=0, seed=7)
        assert big.status_code == good.status_code == 202, (big.text, good.text)
        failed = served.wait(big.json()["id"])
        assert failed["state"] == "failed", (failed, served.text())
        _out_of_memory_line(failed["error"])
        assert failed["progress"]["frames_done"] == 0
        done = served.wait(good.json()["id"])
        assert done["state"] == "done", (done, served.text())
        _no_result(served, state / "jobs", big.json()["id"])
        assert served.client.get(done["result"]).content == _restore(media["short"], tmp_path / "ref.mp4", "--crf",
                                                                     0, "--seed", 7)
        assert served.ranks() == ranks and "seedvr2_rank_restarts_total 0" in served.client.get("/metrics").text
    finally:
        served.stop()


@pytest.mark.slow
@pytest.mark.multirank
def test_out_of_memory_on_one_of_two_ranks_fails_the_job_restarts_the_ranks_and_the_queue_goes_on(media, tmp_path):
    """Rank 1 alone is limited: its allocation fails mid-run and it leaves while rank 0 waits for it in a collective.
    Rank 0 must not hang: the job fails with rank 1's line (as ``restore --ranks 2`` prints it), the ranks are
    restarted, and the queued job runs."""
    from tests.test_cli_memory import run_limited

    state = tmp_path / "state"
    served = Served(str(tmp_path), "--state-dir", state, ranks=2, token=False,
                    env={"SEEDVR2_SERVE_TEST_RANK_MEMORY_MIB": f"{RANK_ROOM_MIB}:1"})
    try:
        ranks = served.ranks()
        big = served.submit(media["short"], crf=0, resolution=TOO_BIG).json()["id"]
        good = served.submit(media["short"], crf=0, seed=7).json()["id"]
        failed = served.wait(big)
        assert failed["state"] == "failed", (failed, served.text())
        _out_of_memory_line(failed["error"], rank="rank 1: ")
        assert served.wait(good)["state"] == "done", served.text()
        _no_result(served, state / "jobs", big)
        ours = served.client.get(f"/v1/restorations/{good}/result").content
        assert set(served.ranks()).isdisjoint(ranks) and "seedvr2_rank_restarts_total 1" in served.client.get(
            "/metrics").text
    finally:
        served.stop()
    cli_run = run_limited(tmp_path, RANK_ROOM_MIB, "restore", media["short"], "-o", tmp_path / "big.mp4", "--demo",
                          "--crf", 0, "--resolution", TOO_BIG, ranks="1", blind=True, nproc=2)
    (line,) = [line for line in cli_run.stderr.splitlines() if line.startswith("python -m examples.seedvr2: error:")]
    numbers = re.compile(r"\d+(\.\d+)?")  # the sizes differ: the CLI's rank maps less than a warm one
    assert numbers.sub("N", line.split("error: ", 1)[1]) == numbers.sub("N", failed["error"]), cli_run.stderr
    assert _restore(media["short"], tmp_path / "ranks2.mp4", "--crf", 0, "--seed", 7, ranks=2) == ours


@pytest.mark.slow
def test_under_torchrun_out_of_memory_on_rank0_fails_the_job_and_the_world_goes_down_for_a_restart(media, tmp_path):
    """Rank 0 (the HTTP process, a rank too) runs out of memory mid-run: the job fails with its line, the world goes
    down (no rank hangs in a collective: rank 1 stops, torchrun exits), and a server started again on the same state
    folder runs the job that was queued, byte for byte what restore writes on 2 ranks."""
    state = tmp_path / "state"
    first = Served(str(tmp_path), "--state-dir", state, torchrun=2, token=False,
                   env={"SEEDVR2_SERVE_TEST_RANK_MEMORY_MIB": f"{RANK_ROOM_MIB}:0"})
    try:
        big = first.submit(media["short"], crf=0, resolution=TOO_BIG).json()["id"]
        good = first.submit(media["short"], crf=0, seed=7).json()["id"]
        assert first.proc.wait(timeout=JOB_S) != 0, first.text()
        assert "exiting (exit code 1)" in first.text()  # for torchrun to start the world again
    finally:
        first.stop()
    second = Served(str(tmp_path), "--state-dir", state, torchrun=2, token=False)
    try:
        assert "1 unfinished job(s)" in second.text()
        failed = second.status(big)
        down = "; the world went down (torchrun restarts it)"
        assert failed["state"] == "failed" and failed["error"].endswith(down), failed
        _out_of_memory_line(failed["error"][:-len(down)], rank="rank 0: ")
        assert second.wait(good)["state"] == "done", second.text()
        _no_result(second, state / "jobs", big)
        ours = second.client.get(f"/v1/restorations/{good}/result").content
    finally:
        second.stop()
    assert _restore(media["short"], tmp_path / "ranks2.mp4", "--crf", 0, "--seed", 7, ranks=2) == ours


@pytest.mark.slow
def test_under_torchrun_a_killed_rank_fails_its_job_torchrun_starts_the_world_again_and_the_queue_goes_on(media,
                                                                                                         tmp_path):
    """Rank 1 is killed mid-job under ``torchrun --max-restarts 1``: rank 0 fails the job with one line and exits,
    torchrun starts the world again (it joins a process group of its own: winsp.comm.group), the new rank 0 serves on
    the same state folder and restores the job that was queued, byte for byte what restore writes on 2 ranks; a SIGTERM
    to torchrun then stops every rank promptly."""
    import socket

    with socket.socket() as free:  # a fixed port: the world started again listens on it again
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    state = tmp_path / "state"
    served = Served(str(tmp_path), "--state-dir", state, "--port", port, torchrun=2, restarts=1, token=False)
    try:
        served.hold()
        victim = served.submit(media["long"], crf=0, batch_frames=5).json()["id"]
        good = served.submit(media["short"], crf=0, seed=7).json()["id"]
        served.wait(victim, states=("running",))
        os.kill(served.torchrun_rank(1), signal.SIGKILL)
        served.release()
        served.listen(2)
        assert served.url == f"http://127.0.0.1:{port}"
        assert served.client.get("/v1/health").status_code == 200
        failed = served.status(victim)
        assert failed["state"] == "failed", (failed, served.text())
        assert failed["error"] == "a rank failed and the world went down (torchrun restarts it)", failed
        assert served.wait(good)["state"] == "done", served.text()
        ours = served.client.get(f"/v1/restorations/{good}/result").content
        started = time.monotonic()
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(timeout=60)
        assert time.monotonic() - started < 30, served.text()  # torchrun's own stop would SIGKILL after 30 s
        assert "Connection refused" not in served.text() and "SIGKILL" not in served.text(), served.text()
    finally:
        served.stop()
    assert _restore(media["short"], tmp_path / "ranks2.mp4", "--crf", 0, "--seed", 7, ranks=2) == ours


def test_under_torchrun_the_other_ranks_leave_at_once_when_torchrun_stops_a_world_that_failed(tmp_path):
    """Rank 0 cannot listen (the port is taken) and fails before it joins the world; torchrun stops the world with
    SIGTERM while rank 1 waits for rank 0 to join: rank 1 leaves at once (before its start-up was done, a stop signal
    ends it), not when torchrun's SIGKILL comes 30 s later."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                               "-m", "examples.seedvr2", "serve", "--demo", "--port", str(taken.getsockname()[1])],
                              cwd=REPO, env=_serve_env(), capture_output=True,
                              text=True, timeout=120)
    seconds = time.monotonic() - started
    assert done.returncode != 0 and "cannot listen on 127.0.0.1:" in done.stderr, done.stderr
    assert "serve: rank 1: stopped by SIGTERM (during start-up)" in done.stderr, done.stderr
    assert seconds < 25, (seconds, done.stderr)


def test_the_curl_examples_of_docs_serving_run(server, media, tmp_path):
    """docs/serving.md's curl blocks, in order, in one shell, against this server (its URL for 127.0.0.1:8000)."""
    text = open(os.path.join(REPO, "docs", "serving.md")).read()
    blocks = [b for b in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M) if "curl" in b]
    assert len(blocks) >= 3
    (tmp_path / "token.txt").write_text(TOKEN + "\n")
    (tmp_path / "clip.mp4").write_bytes(open(media["short"], "rb").read())
    script = "set -euo pipefail\n" + "\n".join(blocks).replace("http://127.0.0.1:8000", server.url)
    done = subprocess.run(["bash", "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=JOB_S)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith('{"status":"ok"')
    assert (tmp_path / "clip_restored.mp4").read_bytes() == _restore(media["short"], tmp_path / "ref.mp4", "--crf",
                                                                     0, "--seed", 42)
    assert '"cancel_requested":true' in done.stdout or '"state":"cancelled"' in done.stdout, done.stdout
    assert '"state":"deleted"' in done.stdout and 'seedvr2_jobs{state="done"}' in done.stdout, done.stdout


def _chromium():
    """Playwright, and Debian's Chromium: skipped without them, except in CI (``WINSP_REQUIRE_BROWSER``)."""
    required = bool(os.environ.get("WINSP_REQUIRE_BROWSER"))
    if not os.path.exists("/usr/bin/chromium"):
        assert not required, "WINSP_REQUIRE_BROWSER is set but /usr/bin/chromium is missing"
        pytest.skip("no /usr/bin/chromium (apt-get install chromium)")
    if required:
        import playwright.sync_api

        return playwright.sync_api
    return pytest.importorskip("playwright.sync_api")


@pytest.mark.browser
def test_the_page_uploads_shows_progress_compares_and_downloads(server, media, tmp_path):
    playwright = _chromium()
    flags = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run"]
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=flags)
        try:
            page = browser.new_page(accept_downloads=True, bypass_csp=True)  # wait_for_function evaluates a string
            page.goto(server.url + "/")
            page.fill("#token", TOKEN)
            page.set_input_files("#file", media["short"])
            page.fill("#crf", "0")
            page.click("#submit")
            page.wait_for_function("document.getElementById('state').textContent.includes('done')",
                                   timeout=JOB_S * 1000)
            assert page.eval_on_selector("#bar", "b => b.value") == 1
            page.wait_for_selector("#compare:not([hidden]) #after video", timeout=30_000)
            assert page.eval_on_selector("#before video", "v => v.src.startsWith('blob:')")
            with page.expect_download() as download:
                page.click("#download")
            saved = tmp_path / "downloaded.mp4"
            download.value.save_as(saved)
            assert download.value.suggested_filename == "short_restored.mp4"
        finally:
            browser.close()
    assert saved.read_bytes() == _restore(media["short"], tmp_path / "ref.mp4", "--crf", 0)


@pytest.mark.slow
def test_sigterm_drains_and_a_restart_on_the_state_dir_finishes_the_jobs(media, tmp_path):
    state = tmp_path / "state"
    first = Served(str(tmp_path), "--state-dir", state, "--drain-timeout", "1", token=False)
    try:
        quick = first.submit(media["short"], crf=0)
        kept = first.wait(quick.json()["id"])
        assert kept["state"] == "done"
        first.hold()  # the running job lasts until the drain cancels it
        running = first.submit(media["long"], crf=0, batch_frames=5).json()["id"]
        waiting = first.submit(media["short"], crf=0, seed=3).json()["id"]
        first.wait(running, states=("running",))
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(timeout=120) == 0, first.text()
        assert "SIGTERM: draining" in first.text() and "drain timeout: stopping job" in first.text()
    finally:
        first.stop()
    second = Served(str(tmp_path), "--state-dir", state, token=False)
    try:
        assert "2 unfinished job(s)" in second.text()
        assert second.status(quick.json()["id"])["state"] == "done"  # finished results are kept
        reference = _restore(media["short"], tmp_path / "ref.mp4", "--crf", 0)
        assert second.client.get(kept["result"]).content == reference
        for job_id in (running, waiting):
            assert second.wait(job_id)["state"] == "done"
        assert second.client.get(f"/v1/restorations/{waiting}/result").content == _restore(
            media["short"], tmp_path / "ref3.mp4", "--crf", 0, "--seed", 3)
    finally:
        second.stop()


@pytest.mark.slow
@pytest.mark.multirank
def test_two_ranks_cancel_at_a_batch_boundary_and_a_job_goes_on_after_a_killed_rank(media, tmp_path):
    served = Served(str(tmp_path), ranks=2, token=False)
    try:
        ours = _cancel_then_restore(served, media, "long")
        served.hold()
        victim = served.submit(media["long"], crf=0, batch_frames=5).json()["id"]
        served.wait(victim, states=("running",))
        os.kill(served.ranks()[1], signal.SIGKILL)
        deadline = time.monotonic() + JOB_S
        while f"job {victim}: rank 1 was killed by SIGKILL" not in served.text():  # the ranks came back, it goes on
            assert time.monotonic() < deadline, served.text()
            time.sleep(0.1)
        served.release()
        assert served.wait(victim)["state"] == "done"
        assert served.client.get(f"/v1/restorations/{victim}/result").content == ours
    finally:
        served.stop()
    assert _restore(media["long"], tmp_path / "ranks2.mp4", "--crf", 0, "--batch-frames", 5, ranks=2) == ours


class _Pool:
    """What the acceptance check reads of the ranks: their device and usable memory (no process started)."""

    def __init__(self, usable):
        self.usable, self.device = usable, "cpu"


def _server(tmp_path, usable, *flags):
    from examples.seedvr2.serve.options import parse_serve
    from examples.seedvr2.serve.server import Server

    return Server(parse_serve(["--demo", *flags]), str(tmp_path / "state"), _Pool(usable))


def test_a_job_is_checked_against_the_memory_estimate_and_the_limits_before_it_is_accepted(tmp_path):
    from examples.seedvr2.serve.server import Refused
    from tests.test_cli import make_png

    src = make_png(tmp_path / "in.png", h=128, w=128)
    tight = _server(tmp_path, 4 * 2**20)
    with pytest.raises(Refused) as refused:  # restore's own estimate: a 128x128 frame needs well over 4 MiB
        tight.check(tight.store.new_id(), src, "in.png", {}, True)
    assert refused.value.status == 422 and "4 MiB" in refused.value.message, refused.value.message
    roomy = _server(tmp_path, 2**40, "--max-pixels", str(200 * 200), "--max-frames", "5")
    job = roomy.check(roomy.store.new_id(), src, "in.png", {"seed": 3}, True)
    assert job.frames == 1 and job.flags == ["--seed", "3"] and job.output.endswith("result.png")
    with pytest.raises(Refused) as refused:
        roomy.check(roomy.store.new_id(), src, "in.png", {"scale": 2}, True)
    assert refused.value.status == 413 and "--max-pixels" in refused.value.message
    clip = make_mp4(tmp_path / "in.mp4", t=9, h=16, w=16)
    with pytest.raises(Refused) as refused:
        roomy.check(roomy.store.new_id(), clip, "in.mp4", {}, True)
    assert refused.value.status == 413 and "--max-frames" in refused.value.message
    with pytest.raises(Refused) as refused:
        roomy.check(roomy.store.new_id(), src, "in.png", {"resolution": "12x"}, True)
    assert refused.value.status == 422 and "12x" in refused.value.message


def test_the_serve_command_line_is_checked_by_restores_parser():
    from examples.seedvr2.serve.options import UsageError, parse_serve

    config = parse_serve(["--ranks", "2", "--demo", "--batch-frames", "9", "--port", "9000"])
    assert (config.ranks, config.port, config.host) == (2, 9000, "127.0.0.1")
    assert config.restore_flags == ["--demo", "--batch-frames", "9"]
    for argv, words in ((["--vae-parallel", "sideways"], "invalid choice"), (["-o", "x.mp4"], "not a serve option"),
                        (["clip.mp4"], "no input files"), (["--max-queue", "0"], "at least 1"),
                        (["--port", "http"], "invalid int value")):
        with pytest.raises(UsageError, match=words):
            parse_serve(argv)
    done = subprocess.run([sys.executable, "-m", "examples.seedvr2", "serve", "--demo", "--overwrite"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "error: --overwrite" in done.stderr


def test_the_job_store_evicts_the_oldest_finished_and_requeues_the_unfinished(tmp_path):
    from examples.seedvr2.serve.jobs import Job, JobStore

    def job(store, input_bytes=0):
        job_id = store.new_id()
        folder = store.folder(job_id)
        with open(os.path.join(folder, "input.mp4"), "wb") as f:
            f.write(b"x" * input_bytes)
        made = Job(id=job_id, state="queued", created=time.time(), input=os.path.join(folder, "input.mp4"),
                   output=os.path.join(folder, "result.mp4"), flags=[], options={}, name="a.mp4", frames=5)
        assert store.add(made)
        return made

    store = JobStore(str(tmp_path), max_queue=3, max_results=2, max_bytes=10_000)
    first, second, third = (job(store, 3000) for _ in range(3))
    assert store.queue_full() and not store.add(Job(**{**first.__dict__, "id": "x"}))  # 429 territory
    for made in (first, second, third):
        assert store.next(timeout=0) is made
        with open(made.output, "wb") as f:
            f.write(b"y" * 1000)
        store.finish(made, "done")
    assert first.id not in store.jobs and not os.path.exists(store.folder(first.id))  # over max_results
    assert set(store.jobs) == {second.id, third.id}
    big = job(store, 9000)
    assert store.next(timeout=0) is big
    store.finish(big, "failed", "boom")
    assert set(store.jobs) == {big.id}  # 13 kB of files: the older ones went, the newest stays
    was_running, was_queued = job(store), job(store)
    assert store.next(timeout=0) is was_running
    again = JobStore(str(tmp_path), max_queue=3, max_results=2, max_bytes=10_000)  # a restart on the same folder
    assert again.requeued == 2 and [j.id for j in again.queued()] == [was_running.id, was_queued.id]
    assert again.jobs[big.id].state == "failed" and again.jobs[big.id].error == "boom"


@pytest.mark.slow
def test_under_torchrun_rank0_serves_and_its_jobs_are_restore_byte_for_byte(media, tmp_path):
    served = Served(str(tmp_path), torchrun=2, token=False)
    try:
        ours = _cancel_then_restore(served, media, "short")
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(timeout=120)
        assert "SIGTERM: draining" in served.text() and "serve: stopped" in served.text()
    finally:
        served.stop()
    assert _restore(media["short"], tmp_path / "ranks2.mp4", "--crf", 0, "--batch-frames", 5, ranks=2) == ours


@pytest.mark.slow
def test_under_torchrun_sigterm_drains_with_every_rank(tmp_path):
    """torchrun's SIGTERM reaches every rank: rank 1 stays for rank 0's drain (rank 0 marks it in the store) longer
    than it waits for a world that is being stopped (world.RANK0_WAIT_S), so rank 0 cancels the running job at the
    drain timeout with rank 1 still there (queued again for the next server), and every rank stops cleanly."""
    import json

    from examples.seedvr2.serve.world import RANK0_WAIT_S

    clip = make_mp4(tmp_path / "clip.mp4", t=81, h=64, w=96)  # 20 batches of 5: well over the drain timeout here
    state = tmp_path / "state"
    served = Served(str(tmp_path), "--state-dir", state, "--drain-timeout", RANK0_WAIT_S + 3, torchrun=2, token=False)
    try:
        served.hold()  # the running job lasts until the drain cancels it
        running = served.submit(clip, crf=0, batch_frames=5).json()["id"]
        served.wait(running, states=("running",))
        served.proc.send_signal(signal.SIGTERM)
        served.proc.wait(timeout=120)
        text = served.text()
        assert "SIGTERM: draining" in text and "serve: stopped" in text, text
        assert "stopped by SIGTERM" not in text and "the world failed" not in text, text
        with open(state / "jobs" / running / "job.json") as f:
            job = json.load(f)
        assert job["state"] in ("done", "queued"), (job, text)  # queued: cancelled by the drain, for the next server
    finally:
        served.stop()

