"""``serve`` attacked as issue 49 attacked it: each numbered break is a case here, against a real server on loopback.

One server (1 rank, the demo weights, no token: the loopback default an attacker's web page could reach, a state
folder the test can look into, ``--allow-paths``) serves most cases; the state-folder, full-disk, leftover and
idle-rank cases start their own. Jobs are held running with the test-only gate (``serve/worker.py``,
``SEEDVR2_SERVE_TEST_GATE``): a job waits before each temporal batch while the gate file exists, whatever the
machine's speed. Traffic goes to 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import zlib

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("av")

from tests.test_cli import make_mp4  # noqa: E402
from tests.test_serve import REPO, Served, _serve_env  # noqa: E402

UPLOAD_MB = 2
#: serve/process.py's HEADER_TIMEOUT_S (not imported: the test must also run against a server without it)
HEADER_TIMEOUT_S = 10.0


def _gate_env(folder) -> tuple[dict, str]:
    gate = os.path.join(str(folder), "gate")
    return {"SEEDVR2_SERVE_TEST_GATE": gate}, gate


@pytest.fixture(scope="module")
def media(tmp_path_factory):
    folder = tmp_path_factory.mktemp("attack-media")
    allowed = folder / "allowed"
    allowed.mkdir()
    return {"short": make_mp4(allowed / "short.mp4", t=5, h=32, w=48),
            "long": make_mp4(allowed / "long.mp4", t=9, h=32, w=48),
            "allowed": str(allowed), "folder": str(folder)}


@pytest.fixture(scope="module")
def attacked(tmp_path_factory, media):
    tmp = tmp_path_factory.mktemp("attacked")
    env, gate = _gate_env(tmp)
    served = Served(str(tmp), "--state-dir", tmp / "state", "--max-queue", "3", "--max-upload-mb", UPLOAD_MB,
                    "--allow-paths", media["allowed"], token=False, env=env)
    served.gate, served.state = gate, tmp / "state"
    yield served
    served.stop()


class _Held:
    """A job held running by the gate until the block ends (then cancelled and waited for)."""

    def __init__(self, served, media) -> None:
        self.served = served
        open(served.gate, "w").close()
        answer = served.submit(media["long"], crf=0, batch_frames=5)
        assert answer.status_code == 202, answer.text
        self.id = answer.json()["id"]
        served.wait(self.id, states=("running",))

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.served.client.delete(f"/v1/restorations/{self.id}")
        os.unlink(self.served.gate)
        self.served.wait(self.id)


def _upload(served, name: str, content: bytes, timeout: float = 20.0) -> httpx.Response:
    return served.client.post("/v1/restorations", files={"file": (name, content)}, timeout=timeout)


def _no_new_job(served, before: set) -> None:
    assert {j["id"] for j in served.client.get("/v1/restorations").json()["jobs"]} <= before


def _job_ids(served) -> set:
    return {j["id"] for j in served.client.get("/v1/restorations").json()["jobs"]}


# ---- 1, 2, 12: uploads are data, never paths --------------------------------------------------------------------


def test_1_playlists_and_lists_that_name_server_files_are_refused_by_content(attacked, media):
    before = _job_ids(attacked)
    secret = media["short"]
    for name, content in (
            ("x.m3u8", f"#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:1,\n{secret}\n#EXT-X-ENDLIST\n"),
            ("y.m3u8", f"#EXTM3U\n#EXTINF:1,\nfile://{secret}\n#EXT-X-ENDLIST\n"),
            ("z.mp4", f"#EXTM3U\n#EXTINF:1,\n{secret}\n#EXT-X-ENDLIST\n"),  # a video's name does not help
            ("c.txt", f"ffconcat version 1.0\nfile '{secret}'\n"),
            ("i.png", "not an image at all")):
        answer = _upload(attacked, name, content.encode())
        assert answer.status_code == 415, (name, answer.status_code, answer.text)
        error = answer.json()["error"]
        assert "by its content it must be mp4, mov, mkv" in error and answer.json()["status"] == 415, error
        assert secret not in error
    _no_new_job(attacked, before)
    assert "hls" not in attacked.text().lower()
    with open(media["short"], "rb") as f:  # a video named like a web page: its content decides, and is served so
        named = attacked.client.post("/v1/restorations", files={"file": ("page.html", f.read())}, data={"crf": "0"})
    assert named.status_code == 202, named.text
    served = attacked.client.get(f"/v1/restorations/{named.json()['id']}/input")
    assert served.headers["content-type"] == "video/mp4", served.headers
    assert served.headers["content-disposition"].startswith("attachment")
    attacked.wait(named.json()["id"])


def test_2_a_playlist_that_repeats_an_input_a_thousand_times_is_refused_at_once(attacked, media):
    line = f"#EXTINF:1,\n{media['short']}\n"
    playlist = ("#EXTM3U\n#EXT-X-TARGETDURATION:1\n" + line * 1000 + "#EXT-X-ENDLIST\n").encode()
    started = time.monotonic()
    answer = _upload(attacked, "amplified.m3u8", playlist)
    assert answer.status_code == 415, answer.text
    assert time.monotonic() - started < 5.0


def test_12_a_fifo_named_by_a_playlist_or_a_path_never_holds_a_request(attacked, media):
    fifo = os.path.join(media["allowed"], "segment.ts")
    os.mkfifo(fifo)
    try:
        answer = _upload(attacked, "fifo.m3u8", f"#EXTM3U\n#EXTINF:1,\n{fifo}\n#EXT-X-ENDLIST\n".encode(), timeout=10)
        assert answer.status_code == 415, answer.text
        by_path = attacked.client.post("/v1/restorations", data={"path": "segment.ts"}, timeout=10)
        assert by_path.status_code == 422 and "not a regular file" in by_path.json()["error"], by_path.text
    finally:
        os.unlink(fifo)


# ---- 3: --allow-paths files are opened once and read from that handle -------------------------------------------


def test_3_an_allowed_file_swapped_after_submission_changes_nothing(attacked, media, tmp_path):
    spot = os.path.join(media["allowed"], "swapped.mp4")
    shutil.copyfile(media["short"], spot)
    original = open(spot, "rb").read()
    with _Held(attacked, media):
        accepted = attacked.client.post("/v1/restorations", data={"path": "swapped.mp4", "crf": "0"})
        assert accepted.status_code == 202, accepted.text
        job = accepted.json()["id"]
        os.unlink(spot)
        os.symlink("/etc/passwd", spot)  # the file replaced by a link to a secret ...
        served = attacked.client.get(f"/v1/restorations/{job}/input")
        assert served.status_code == 200 and served.content == original
        assert served.headers["content-type"] == "video/mp4"
        os.unlink(spot)
        make_mp4(spot, t=41, h=32, w=48)  # ... then by a longer clip than the one admitted
    done = attacked.wait(job)
    assert done["state"] == "done" and done["progress"]["frames"] == 5, done
    assert attacked.client.get(f"/v1/restorations/{job}/input").content == original
    os.unlink(spot)
    os.symlink("/etc/passwd", spot)  # a link at submission: refused (what the open reached is outside)
    try:
        answer = attacked.client.post("/v1/restorations", data={"path": "swapped.mp4"})
        assert answer.status_code == 403, answer.text
    finally:
        os.unlink(spot)


# ---- 4: the upload limit counts received bytes; 429 before the body ---------------------------------------------


def _raw(url: str, head: bytes, body: bytes = b"", wait: float = 10.0) -> bytes:
    """Send ``head`` and ``body`` on a fresh connection to the server at ``url`` (loopback); what comes back within
    ``wait`` seconds (the connection left open meanwhile, as a slow client would)."""
    host, port = re.match(r"http://([^:/]+):(\d+)", url).groups()
    with socket.create_connection((host, int(port)), timeout=wait) as sock:
        sock.sendall(head + body)
        sock.settimeout(wait)
        answer = b""
        try:
            while b"\r\n\r\n" not in answer:
                part = sock.recv(65536)
                if not part:
                    break
                answer += part
        except (socket.timeout, ConnectionResetError):
            pass
        return answer


def test_4_a_chunked_body_is_counted_and_refused_before_it_ends(attacked):
    head = (b"POST /v1/restorations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n"
            b"Transfer-Encoding: chunked\r\nContent-Type: multipart/form-data; boundary=x\r\n\r\n")
    part = (b'--x\r\nContent-Disposition: form-data; name="file"; filename="a.mp4"\r\n'
            b"Content-Type: video/mp4\r\n\r\n")
    chunks = [part] + [b"x" * 65536] * (UPLOAD_MB * 16 + 8)  # over the limit, and never terminated
    body = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for chunk in chunks)
    answer = _raw(attacked.url, head, body, wait=15)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:300]
    assert b'"status":413' in answer or b"413" in answer.split(b"\r\n")[0]


def test_4_a_full_queue_is_refused_before_the_body_is_read(attacked, media):
    with _Held(attacked, media):
        for _ in range(3):
            assert attacked.submit(media["short"], crf=0).status_code == 202
        head = (b"POST /v1/restorations HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000\r\n"
                b"Content-Type: multipart/form-data; boundary=x\r\n\r\n")
        answer = _raw(attacked.url, head, wait=10)  # no body at all: the answer must not wait for it
        assert answer.startswith(b"HTTP/1.1 429"), answer[:300]


def test_12_slow_headers_are_cut_off(attacked):
    """A slowloris: connections that never finish their headers are closed after the header timeout (they were held
    for 40 s and more), while the server goes on answering."""
    host, port = re.match(r"http://([^:/]+):(\d+)", attacked.url).groups()
    slow = [socket.create_connection((host, int(port)), timeout=5) for _ in range(20)]
    try:
        for sock in slow:
            sock.sendall(b"GET /v1/health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        started = time.monotonic()
        assert attacked.client.get("/v1/health").status_code == 200
        for sock in slow:
            sock.settimeout(HEADER_TIMEOUT_S + 15 - (time.monotonic() - started))
            assert sock.recv(1024) == b""  # closed by the server
        assert time.monotonic() - started < HEADER_TIMEOUT_S + 10
    finally:
        for sock in slow:
            sock.close()


# ---- 5: image headers checked before decoding ----------------------------------------------------------------------


def _png_bomb(side: int) -> bytes:
    """A ``side`` x ``side`` black 8-bit grey PNG: a few hundred KB that decode to ``side**2`` bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = zlib.compressobj(9)
    block = b"\0" * ((1 + side) * 400)
    data = b"".join(rows.compress(block) for _ in range(side // 400)) + rows.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def _peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def test_5_a_decompression_bomb_is_refused_from_its_header(attacked):
    bomb = _png_bomb(16000)
    assert len(bomb) < UPLOAD_MB * 2**20
    before = _peak_rss(attacked.proc.pid)
    answer = _upload(attacked, "bomb.png", bomb, timeout=60)
    assert answer.status_code == 413 and "16000x16000" in answer.json()["error"], answer.text
    assert _peak_rss(attacked.proc.pid) - before < 128 * 2**20  # it decoded to 256 MB before


# ---- 7: health tells the truth -------------------------------------------------------------------------------------


@pytest.mark.slow  # a killed rank restarted: tests/test_serve.py's killed-rank test in the default run
def test_7_a_rank_killed_while_idle_is_restarted_and_health_says_so(media, tmp_path):
    served = Served(str(tmp_path), token=False)
    try:
        (rank,) = served.ranks()
        os.kill(rank, signal.SIGKILL)
        seen, deadline = [], time.monotonic() + 120
        while time.monotonic() < deadline:
            answer = served.client.get("/v1/health")
            seen.append((answer.status_code, answer.json()))
            if answer.status_code == 200 and "the ranks are running again" in served.text():
                break
            assert answer.status_code == 503 or answer.json()["alive"], answer.json()  # never "ok" with a dead rank
            time.sleep(0.1)
        assert seen[-1][0] == 200 and seen[-1][1]["alive"], (seen[-5:], served.text())
        assert any(code == 503 and body["reason"] for code, body in seen) or len(seen) == 1, seen[:5]
        assert "a rank died while idle" in served.text() and not os.path.exists(f"/proc/{rank}/status")
        done = served.wait(served.submit(media["short"], crf=0).json()["id"])
        assert done["state"] == "done", (done, served.text())
    finally:
        served.stop()


def test_6_health_answers_503_with_the_reason_once_the_dispatcher_is_dead(tmp_path):
    kill = str(tmp_path / "kill-dispatcher")  # test-only (serve/server.py): the dispatcher dies once this exists
    served = Served(str(tmp_path), token=False, env={"SEEDVR2_SERVE_TEST_KILL_DISPATCHER": kill})
    try:
        alive = served.client.get("/v1/health")
        assert alive.status_code == 200 and alive.json()["status"] == "ok", alive.text
        open(kill, "w").close()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            answer = served.client.get("/v1/health")
            if answer.status_code != 200:
                break
            time.sleep(0.1)
        assert answer.status_code == 503, (answer.text, served.text())
        body = answer.json()
        assert body["status"] == "down" and "dispatcher stopped" in body["reason"], body
        assert "the dispatcher is killed" in served.text()
        assert served.client.get("/v1/health").status_code == 503  # and stays so: nothing restarts it
    finally:
        served.stop()


# ---- 9: every error is one JSON line with its status ---------------------------------------------------------------


def test_9_errors_are_json_with_their_status(attacked, media):
    huge = attacked.submit(media["short"], scale="1e308")
    assert huge.status_code == 400 and huge.json() == {"error": huge.json()["error"], "status": 400}, huge.text
    assert "--scale must be at most" in huge.json()["error"]
    nul = attacked.client.post("/v1/restorations", data={"path": "short\0.mp4"})
    assert nul.status_code == 400 and nul.json()["status"] == 400, nul.text
    missing = attacked.client.get("/no/such/route")
    assert missing.status_code == 404 and missing.json()["status"] == 404, missing.text
    for answer in (huge, nul, missing):
        assert answer.headers["content-type"] == "application/json" and "\n" not in answer.text
    done = subprocess.run([sys.executable, "-m", "examples.seedvr2", "restore", media["short"], "--scale", "1e308",
                           "--demo", "-o", os.path.join(media["folder"], "never.mp4")], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=_serve_env())
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "--scale must be at most 16384" in done.stderr and "Traceback" not in done.stderr


# ---- 10: cross-site requests ---------------------------------------------------------------------------------------


def test_10_foreign_hosts_and_origins_are_refused_and_answers_carry_security_headers(attacked, media):
    before = _job_ids(attacked)
    rebound = attacked.client.get("/v1/restorations", headers={"Host": "attacker.example"})
    assert rebound.status_code == 421, rebound.text
    with open(media["short"], "rb") as f:
        content = f.read()
    for headers in ({"Origin": "http://attacker.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"}):
        answer = attacked.client.post("/v1/restorations", files={"file": ("a.mp4", content)}, headers=headers)
        assert answer.status_code == 403, (headers, answer.text)
        gone = attacked.client.delete("/v1/restorations/" + "0" * 32, headers=headers)
        assert gone.status_code == 403, (headers, gone.text)
    _no_new_job(attacked, before)
    own = attacked.client.post("/v1/restorations", files={"file": ("a.mp4", content)}, data={"crf": "0"},
                               headers={"Origin": attacked.url, "Sec-Fetch-Site": "same-origin"})
    assert own.status_code == 202, own.text  # the server's own page
    attacked.wait(own.json()["id"])
    for said in ("queued: 'a.mp4'", "started", "done: 5 frame(s)"):  # one log line per event of the job
        assert f"serve: job {own.json()['id']} {said}" in attacked.text(), attacked.text()
    health = attacked.client.get("/v1/health").json()
    assert health["running"] is False and health["demo_weights"] is True, health  # never a job's id
    for path in ("/", "/v1/health", "/v1/restorations", "/nowhere"):
        headers = attacked.client.get(path).headers
        assert "frame-ancestors 'none'" in headers["content-security-policy"], path
        assert headers["x-content-type-options"] == "nosniff" and headers["x-frame-options"] == "DENY", path


def test_10_the_start_up_warns_beyond_loopback_without_a_token_and_brackets_ipv6():
    from examples.seedvr2.serve.process import exposure_warning, url_of

    assert url_of("::1", 8000) == "http://[::1]:8000" and url_of("127.0.0.1", 80) == "http://127.0.0.1:80"
    assert "without --token-file" in exposure_warning("0.0.0.0", None)
    assert "without --token-file" in exposure_warning("::", None)
    assert exposure_warning("0.0.0.0", "token") is None and exposure_warning("127.0.0.1", None) is None
    assert exposure_warning("::1", None) is None and exposure_warning("localhost", None) is None


# ---- 8, 11: the state folder is untrusted; no leftovers ----------------------------------------------------------


def _record(state, job_id: str) -> dict:
    with open(state / "jobs" / job_id / "job.json") as f:
        return json.load(f)


def _forge(root, template: dict, job_id: str, **fields) -> str:
    folder = root / "jobs" / job_id
    folder.mkdir()
    (folder / "input.mp4").write_bytes(b"forged")
    (folder / "job.json").write_text(json.dumps({**template, "id": job_id, **fields}))
    return job_id


def _one_done_job(served, media, **options) -> dict:
    done = served.wait(served.submit(media["short"], crf=0, **options).json()["id"])
    assert done["state"] == "done", (done, served.text())
    return done


def test_8_a_forged_state_folder_is_set_aside_and_never_followed(media, tmp_path):
    state = tmp_path / "state"
    first = Served(str(tmp_path), "--state-dir", state, token=False)
    try:
        kept, other = _one_done_job(first, media), _one_done_job(first, media, seed=5)
    finally:
        first.stop()
    template = _record(state, kept["id"])
    result_bytes = (state / "jobs" / kept["id"] / "result.mp4").read_bytes()
    (state / "jobs" / kept["id"] / "job.json").write_text(json.dumps(template)[:40])  # truncated: never deleted
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "precious").write_text("keep me")
    canary = tmp_path / "canary.mp4"
    canary.write_text("keep me too")
    forged = [
        _forge(state, template, "a" * 32, id="../../victim", state="done"),
        _forge(state, template, "b" * 32, input="/etc/passwd", output="/etc/hostname", state="done"),
        _forge(state, template, "c" * 32, output=str(canary), state="queued"),
        _forge(state, template, "d" * 32, sequence="x"),
        _forge(state, template, "e" * 32, finished="yesterday"),
        _forge(state, template, "f" * 32, flags=["--dit-checkpoint", "/etc/passwd"], state="queued",
               options={"seed": "1; rm"}),
    ]
    os.symlink(victim, state / "jobs" / ("9" * 32))  # a job folder that is a link outside
    second = Served(str(tmp_path), "--state-dir", state, "--max-results", "1", token=False)
    try:
        text = second.text()
        assert "Traceback" not in text, text
        set_aside = [line for line in text.splitlines() if "set aside jobs/" in line]
        assert len(set_aside) == len(forged) + 2, text  # each forged one, the link, the truncated record
        for job_id in [*forged, kept["id"], "9" * 32]:
            assert second.client.get(f"/v1/restorations/{job_id}").status_code == 404
        assert second.client.get(f"/v1/restorations/{'b' * 32}/result").status_code == 404
        assert second.status(other["id"])["state"] == "done"
        aside = state / "set-aside"
        moved = [n for n in os.listdir(aside) if n.endswith(kept["id"])]
        assert len(moved) == 1 and (aside / moved[0] / "result.mp4").read_bytes() == result_bytes
        _one_done_job(second, media)  # the dispatcher runs, and evicts the older job (--max-results 1)
        assert second.client.get(f"/v1/restorations/{other['id']}").status_code == 404
        assert (victim / "precious").read_text() == "keep me" and canary.read_text() == "keep me too"
    finally:
        second.stop()


def _rank_folders(pid: int) -> list:
    return [n for n in os.listdir(tempfile.gettempdir()) if n.startswith(f"seedvr2-serve-ranks-{pid}-")]


def test_11_no_leftovers_after_a_crash_or_a_clean_stop(media, tmp_path):
    state = tmp_path / "state"
    first = Served(str(tmp_path), "--state-dir", state, token=False)
    try:
        done = _one_done_job(first, media)
        pid = first.proc.pid
        assert _rank_folders(pid), "the ranks' folder is named after its server"
    finally:
        first.proc.send_signal(signal.SIGKILL)  # a crash: nothing of it can clean up
        first.proc.wait()
        first.stop()
    partial = state / "jobs" / done["id"] / ".result.1234.partial.mp4"  # what a killed rank leaves
    partial.write_bytes(b"half a video")
    second = Served(str(tmp_path), "--state-dir", state, token=False)
    try:
        assert not partial.exists() and second.status(done["id"])["state"] == "done"
        assert not _rank_folders(pid), "the crashed server's ranks' folder is removed by the next start"
        second_pid = second.proc.pid
        assert _rank_folders(second_pid)
    finally:
        second.stop()
    assert second.proc.returncode == 0
    assert not _rank_folders(second_pid), "a clean stop removes its ranks' folder"


# ---- 6: a full disk fails the job, not the queue -------------------------------------------------------------------


def _can_mount_tmpfs() -> bool:
    if shutil.which("unshare") is None:
        return False
    done = subprocess.run(["unshare", "-rm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /mnt"],
                          capture_output=True, timeout=30)
    return done.returncode == 0


@pytest.mark.skipif(not _can_mount_tmpfs(), reason="needs unshare -rm and tmpfs (user namespaces)")
def test_6_a_full_state_disk_fails_jobs_with_json_and_the_queue_goes_on(media, tmp_path):
    """The state folder is a 192 KiB tmpfs (a real ENOSPC, in a mount namespace of the server's own): uploads and
    jobs fail with one JSON line each while it is full, none stays running, health stays ok, and once finished jobs
    are deleted the next job is done."""
    state = tmp_path / "state"
    state.mkdir()
    log = tmp_path / "full.log"
    inner = (f"mount -t tmpfs -o size=192k tmpfs {state} && exec {sys.executable} -m examples.seedvr2 serve --port 0 "
             f"--demo --ranks 1 --state-dir {state} --max-results 100")
    served = Served.__new__(Served)
    served.log_path, served.token = str(log), False
    served.log = open(log, "w")
    served.proc = subprocess.Popen(["unshare", "-rm", "sh", "-c", inner], cwd=REPO, env=_serve_env(),
                                   stdout=served.log, stderr=subprocess.STDOUT)
    try:
        served.listen(1)
        clip = os.path.join(media["folder"], "fill.mp4")
        shutil.copyfile(media["short"], clip)
        answers, accepted = [], []
        for _ in range(14):
            answer = served.submit(clip, crf=0)
            assert answer.headers["content-type"] == "application/json", answer.text
            answers.append(answer.status_code)
            if answer.status_code == 202:
                accepted.append(answer.json()["id"])
            else:
                assert answer.json()["status"] == answer.status_code, answer.text
        assert 507 in answers or any(served.wait(j)["state"] == "failed" for j in accepted), (answers, served.text())
        finals = [served.wait(job_id, timeout=120) for job_id in accepted]
        print("answers", answers, "jobs", [(f["state"], f["error"]) for f in finals])
        assert all(f["state"] in ("done", "failed") for f in finals), finals
        assert all(f["error"] is None or f["error"].endswith("(No space left on device)") for f in finals), finals
        health = served.client.get("/v1/health")
        assert health.status_code == 200, health.text
        for job_id in accepted:
            served.client.delete(f"/v1/restorations/{job_id}")
        again = served.submit(media["short"], crf=0)
        assert again.status_code == 202, again.text
        assert served.wait(again.json()["id"])["state"] == "done", served.text()
        assert "Traceback" not in served.text(), served.text()
    finally:
        served.stop()


def test_1_restore_untrusted_input_refuses_a_playlist_in_one_line(media, tmp_path):
    """``restore --untrusted-input``: the command line's option for a file it did not create (serve's rules)."""
    playlist = tmp_path / "clip.mp4"  # named like a video
    playlist.write_text(f"#EXTM3U\n#EXTINF:1,\n{media['short']}\n#EXT-X-ENDLIST\n")
    done = subprocess.run([sys.executable, "-m", "examples.seedvr2", "restore", str(playlist), "--untrusted-input",
                           "--demo", "-o", str(tmp_path / "out.mp4")], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=_serve_env())
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "is a playlist or list of files: by its content it must be mp4" in done.stderr
    assert not (tmp_path / "out.mp4").exists()


def test_8_every_field_of_a_record_is_checked(tmp_path):
    """job_records.validate, field by field: a good record passes with its paths and flags rebuilt; each bad one is
    refused with the field's name (no server: the real-server case is test_8 above)."""
    from examples.seedvr2.serve.job_records import BadRecord, validate

    folder = str(tmp_path / ("a" * 32))
    good = {"id": "a" * 32, "state": "done", "created": 1.5, "input": "/anywhere/input.mp4",
            "output": "/elsewhere/result.mp4", "flags": ["--dit-checkpoint", "/etc/passwd"], "options": {"seed": 3},
            "name": "clip.mp4", "frames": 5, "frames_done": 5, "started": 2.0, "finished": 3.0, "sequence": 1}
    checked = validate(good, folder, "a" * 32)
    assert checked["input"] == os.path.join(folder, "input.mp4") and checked["output"] == os.path.join(folder,
                                                                                                      "result.mp4")
    assert checked["flags"] == ["--seed", "3"]  # rebuilt from the options, never read
    for change, word in (({"id": "b" * 32}, "id"), ({"state": "gone"}, "state"), ({"created": "x"}, "created"),
                         ({"created": float("nan")}, "created"), ({"finished": "yesterday"}, "finished"),
                         ({"sequence": "x"}, "sequence"), ({"frames": -1}, "frames"), ({"frames": True}, "frames"),
                         ({"cancel_requested": "yes"}, "cancel_requested"), ({"name": 7}, "name"),
                         ({"error": ["x"]}, "error"), ({"options": {"flag": "--x"}}, "options"),
                         ({"options": {"crf": 99}}, "options"), ({"options": {"scale": 1e308}}, "options"),
                         ({"input": "/etc/passwd"}, "input"), ({"output": "../result.mp4/.."}, "output"),
                         ({"output": 3}, "output"), ({"surprise": 1}, "surprise")):
        with pytest.raises(BadRecord, match=word):
            validate({**good, **change}, folder, "a" * 32)
    with pytest.raises(BadRecord):
        validate([good], folder, "a" * 32)


def test_5_at_most_two_checks_decode_at_once(tmp_path, monkeypatch):
    """The acceptance checks (each decodes its input once) run two at a time: five submitted at once never have more
    than two inside the check."""
    import threading

    from examples.seedvr2.serve.options import parse_serve
    from examples.seedvr2.serve.server import DECODES, Server

    server = Server(parse_serve(["--demo"]), str(tmp_path / "state"), None)
    inside, most, lock = [0], [0], threading.Lock()

    def check(*args):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        time.sleep(0.2)
        with lock:
            inside[0] -= 1

    monkeypatch.setattr(server, "_check", check)
    threads = [threading.Thread(target=server.check, args=(server.store.new_id(), "x", "x", {}, True))
               for _ in range(5)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert most[0] == DECODES == 2


def test_one_token_per_client_each_sees_only_its_own_jobs(media, tmp_path):
    tokens = tmp_path / "clients.txt"
    tokens.write_text("# name token\nalice al1ce-t0ken\nbob b0b-t0ken\n")
    served = Served(str(tmp_path), "--client-tokens", tokens, token=False)
    try:
        alice = httpx.Client(base_url=served.url, timeout=60, headers={"Authorization": "Bearer al1ce-t0ken"})
        bob = httpx.Client(base_url=served.url, timeout=60, headers={"Authorization": "Bearer b0b-t0ken"})
        with open(media["short"], "rb") as f:
            job = alice.post("/v1/restorations", files={"file": ("a.mp4", f.read())}, data={"crf": "0"})
        assert job.status_code == 202, job.text
        job_id = job.json()["id"]
        assert [j["id"] for j in alice.get("/v1/restorations").json()["jobs"]] == [job_id]
        assert bob.get("/v1/restorations").json()["jobs"] == []
        for method, path in (("GET", ""), ("GET", "/input"), ("GET", "/result"), ("DELETE", "")):
            assert bob.request(method, f"/v1/restorations/{job_id}{path}").status_code == 404, (method, path)
        assert httpx.get(served.url + "/v1/restorations", timeout=30).status_code == 401
        served.client = alice
        assert served.wait(job_id)["state"] == "done"
        assert alice.get(f"/v1/restorations/{job_id}/result").status_code == 200
    finally:
        served.stop()
