"""One tenant against another, for real: no sandbox reads, starves or kills a neighbour's.

Each test attacks through the public API of a real server, then checks that a neighbour sandbox
(created before the attack) kept its state and that the server still creates sandboxes.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import GUEST_KERNEL, MICROVM, REPO, ServerProcess
from helpers import secret_scan_code

from agentcell import InvalidArgumentException, Sandbox, SandboxException, TimeoutException

pytestmark = pytest.mark.skipif(bool(os.environ.get("AGENTCELL_TEST_SERVER_URL")),
                                reason="these tests start, inspect and kill server processes of their own")


def assert_neighbour_and_server_fine(neighbour: Sandbox, server_url: str) -> None:
    assert neighbour.run_code("canary").text == "alive"
    assert neighbour.commands.run("echo ok").stdout == "ok\n"
    with Sandbox.create(api_url=server_url) as fresh:
        assert fresh.run_code("6 * 7").text == "42"


def server_children(pid: int, name: str) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=,args=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(line.split()[0]) for line in out.splitlines() if name in line]


# --- 1. nothing of one tenant's request in memory another sandbox inherits ---------------------------


def test_previous_tenants_env_vars_are_not_in_the_next_sandboxs_memory(server_url: str, neighbour: Sandbox) -> None:
    secret = ("sk-" + secrets.token_hex(16)).encode()
    a = Sandbox.create(api_url=server_url, envs={"OPENAI_API_KEY": secret.decode()}, metadata={"tenant": "a"})
    try:
        # The scan finds what is there: A's own context does hold its env var.
        assert a.run_code(secret_scan_code(secret, rb"sk-[0-9a-f]{32}")).text == "(True, True)"
        for _ in range(7):  # past the server's standbys (4), so the last ones were forked after A's claim
            with Sandbox.create(api_url=server_url) as b:
                assert b.run_code(secret_scan_code(secret, rb"sk-[0-9a-f]{32}")).text == "(False, True)"
    finally:
        a.kill()
    assert_neighbour_and_server_fine(neighbour, server_url)


# --- 2. no single request (nor a dying zygote) kills other sandboxes ----------------------------------


@pytest.mark.parametrize("envs", [
    {"BIG": "x" * 300_000},                                   # over the size cap
    {f"K{i}": "v" * 100 for i in range(5000)},                 # many small ones, same total
    {"A=B": "1"}, {"A\0B": "1"}, {"": "1"}, {"OK": "a\0b"},    # not an environment at all
])
def test_rejected_create_keeps_live_sandboxes(server_url: str, neighbour: Sandbox, envs: dict[str, str]) -> None:
    r = httpx.post(f"{server_url}/v2/sandboxes", json={"templateID": "base", "envVars": envs}, timeout=60)
    assert r.status_code == 400, r.text
    assert "envVars" in r.json()["message"]
    assert_neighbour_and_server_fine(neighbour, server_url)


@pytest.mark.skipif(GUEST_KERNEL, reason="the linux backend's zygote: gvisor and microvm sandboxes are restored "
                    "from a checkpoint or a template VM, no process of the server's forks them")
def test_sandboxes_survive_their_zygotes_death(server: ServerProcess, server_url: str, neighbour: Sandbox) -> None:
    own = Sandbox.create(api_url=server_url)
    own.run_code("mine = 17")
    zygotes = server_children(server.pid, "agentcell.backends.linux.zygote")
    assert zygotes, "no zygote found under the server"
    for z in zygotes:
        os.kill(z, 9)
    time.sleep(0.5)
    try:
        assert own.run_code("mine + 1").text == "18"
        assert own.commands.run("echo still").stdout == "still\n"
        assert_neighbour_and_server_fine(neighbour, server_url)  # a create starts a new zygote
        assert server_children(server.pid, "agentcell.backends.linux.zygote") != zygotes
        assert own.run_code("mine").text == "17"
    finally:
        own.kill()


# --- 4. two servers on one host never share host uids --------------------------------------------------


def host_uid(sbx: Sandbox) -> int:
    rows = [line.split() for line in sbx.commands.run("cat /proc/self/uid_map").stdout.splitlines()]
    user = [r for r in rows if r[0] == "1000"]
    assert len(user) == 1 and user[0][2] == "1"
    return int(user[0][1])


@pytest.mark.skipif(GUEST_KERNEL, reason="the linux backend's host uid ranges: a gvisor or microvm sandbox's ids "
                    "are its guest kernel's (runsc's processes, or a VMM's own uid: tests/test_microvm.py)")
def test_two_servers_get_disjoint_uid_ranges(server_url: str, tmp_path: Path) -> None:
    other = ServerProcess(tmp_path / "second.log", "--max-sandboxes", "50")
    try:
        other.wait_ready()
        with Sandbox.create(api_url=server_url) as a, Sandbox.create(api_url=other.url) as b:
            ua, ub = host_uid(a), host_uid(b)
            assert ua != ub and ua >= 1 << 20 and ub >= 1 << 20
            # The second server's whole range is disjoint from the first's: a third one asking for an
            # explicit base inside either range is refused, with a message that says why.
            for taken in (ua, ub):
                refusal = ServerProcess(tmp_path / f"clash-{taken}.log", "--uid-base", str(taken)).refused(60)
                assert "overlaps" in refusal and "another agentcell server" in refusal, refusal[-2000:]
    finally:
        other.stop()


def test_uid_range_refuses_real_users_and_subordinate_ranges(tmp_path: Path) -> None:
    # /etc/passwd holds root (0) and nobody (65534); a range over either is refused. The lock dir
    # is a temporary one, so this test does not touch the host's registry.
    script = (
        "import sys\nfrom agentcell.backends.linux import uids\n"
        f"lock = {str(tmp_path / 'locks')!r}\n"
        "for base in (60000, 500):\n"
        "    try:\n        uids.reserve(10000, base, lock_dir=lock)\n        print('reserved', base)\n"
        "    except uids.UidRangeError as e:\n        print('refused', base, e)\n"
        "r = uids.reserve(100, None, lock_dir=lock); print('auto', r.base)\n"
    )
    p = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)
    lines = p.stdout.splitlines()
    assert lines[0].startswith("refused 60000") and "/etc/passwd" in lines[0], p.stdout + p.stderr
    assert lines[1].startswith("refused 500") and "1000-" in lines[1], p.stdout
    assert int(lines[2].split()[1]) >= 1 << 20


# --- 6, 7. server memory stays bounded whatever a sandbox prints or a client sends ---------------------


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


class RssWatch:
    """The peak RSS of a process, sampled in a thread while the `with` block runs."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.base = rss_mib(pid)
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_mib(self.pid))

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    @property
    def growth(self) -> float:
        return self.peak - self.base


@pytest.mark.skipif(MICROVM, reason="standbys prepared at the lowest CPU weight: linux's and gvisor's")
def test_busy_tenants_do_not_starve_other_tenants_creates(server_url: str, neighbour: Sandbox) -> None:
    """Tenants whose code keeps every core busy (one busy loop per core, each within its 1-CPU limit);
    then a burst of creates past the server's standbys. The standbys refilled behind the busy ones were
    prepared at the lowest CPU weight and starved: before the fix every create that waited for one failed
    after 10 s ("did not become ready"). A create that waits gets a preparation at the default weight."""
    busy = []
    try:
        for _ in range(os.cpu_count() or 1):
            sbx = Sandbox.create(api_url=server_url, timeout=120)
            busy.append(sbx)
            sbx.commands.run("sh -c 'while :; do :; done'", background=True)
        time.sleep(2)  # the refill after the busy tenants' creates is under way, starved or not
        took: list[float] = []
        errors: list[BaseException] = []

        def create() -> None:
            t0 = time.monotonic()
            try:
                with Sandbox.create(api_url=server_url, timeout=60) as sbx:
                    took.append(time.monotonic() - t0)
                    assert sbx.commands.run("echo up").stdout == "up\n"
            except BaseException as e:  # noqa: BLE001 - collected, asserted below
                errors.append(e)

        threads = [threading.Thread(target=create) for _ in range(8)]  # past the session server's 4 standbys
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, f"creates failed beside busy tenants: {errors[:2]}"
        assert max(took) < 8, f"a create beside busy tenants took {max(took):.1f} s: {sorted(took)}"
    finally:
        for sbx in busy:
            sbx.kill()
    assert_neighbour_and_server_fine(neighbour, server_url)


def slow_read(url: str, path: str, body: bytes, headers: dict[str, str], seconds: float) -> int:
    """POST `body` to `path` and read the response at ~40 KB/s for `seconds`; returns bytes read."""
    host, port = url.removeprefix("http://").split(":")
    head = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    with socket.create_connection((host, int(port))) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\n{head}Content-Length: {len(body)}\r\n\r\n".encode()
                  + body)
        got = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            got += len(s.recv(4096))
            time.sleep(0.1)
        return got


def test_slow_readers_do_not_grow_the_server(server: ServerProcess, server_url: str, neighbour: Sandbox) -> None:
    sbx = Sandbox.create(api_url=server_url, timeout=300)
    try:
        sbx.files.write("/home/user/big.bin", b"\0" * (1 << 20))
        sbx.commands.run("for i in $(seq 300); do cat /home/user/big.bin; done > /home/user/huge.bin")
        auth = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._conn.access_token}
        code = json.dumps({"code": "import os, sys\nn = 0\nwhile True:\n    sys.stdout.write('x' * 65535 + '\\n'); n += 1\n"
                                   "    open('/tmp/p', 'w').write(str(n)); os.replace('/tmp/p', '/tmp/printed')\n"}).encode()
        with RssWatch(server.pid) as watch:
            threads = [
                # a code run printing without end, a command printing without end, a 300 MB download
                threading.Thread(target=slow_read, args=(server_url, "/execute", code, {
                    **auth, "E2b-Sandbox-Port": "49999", "Content-Type": "application/json"}, 15)),
                threading.Thread(target=slow_read, args=(server_url, "/process.Process/Start", json.dumps(
                    {"process": {"cmd": "/bin/sh", "args": ["-c", "yes $(head -c 4000 /dev/zero | tr '\\0' x)"]}}
                ).encode(), {**auth, "E2b-Sandbox-Port": "49983", "Content-Type": "application/connect+json"}, 15)),
            ]
            for t in threads:
                t.start()
            with httpx.Client(base_url=server_url, timeout=60) as c, c.stream(
                    "GET", "/files", params={"path": "/home/user/huge.bin"}, headers=auth) as r:
                assert r.status_code == 200
                got = 0
                for chunk in r.iter_raw(4096):
                    got += len(chunk)
                    time.sleep(0.01)
                    if got > 4 << 20:
                        break
            for t in threads:
                t.join()
        # The code in the sandbox was slowed down to the reader's pace, not buffered in the server.
        printed = int(sbx.files.read("/tmp/printed")) * 64 << 10
        assert printed < 64 << 20, f"the sandbox printed {printed >> 20} MiB for a reader that took 600 KiB"
        assert watch.growth < 64, f"the server grew by {watch.growth:.0f} MiB"
        print(f"\nslow readers: server RSS {watch.base:.0f} -> peak {watch.peak:.0f} MiB; "
              f"the code printed {printed >> 20} MiB in 15 s")
        assert sbx.run_code("1 + 1").text == "2"  # the abandoned run was interrupted, the sandbox is fine
    finally:
        sbx.kill()
    assert_neighbour_and_server_fine(neighbour, server_url)


def test_uploads_stream_through_the_server(server: ServerProcess, server_url: str, neighbour: Sandbox) -> None:
    sbx = Sandbox.create(api_url=server_url, timeout=300, limits={"memoryMB": 1536, "diskMB": 1024})
    auth = {"E2b-Sandbox-Id": sbx.sandbox_id, "X-Access-Token": sbx._conn.access_token}
    chunk = os.urandom(1 << 20)

    def body(mib: int) -> Iterator[bytes]:
        for _ in range(mib):
            yield chunk

    try:
        with RssWatch(server.pid) as watch, httpx.Client(base_url=server_url, headers=auth, timeout=120) as c:
            r = c.post("/files", params={"path": "/home/user/one.bin"}, content=body(400),
                       headers={"Content-Type": "application/octet-stream"})
            assert r.status_code == 200, r.text
            parallel = [threading.Thread(target=lambda i=i: c.post(
                "/files", params={"path": f"/home/user/p{i}.bin"}, content=body(100),
                headers={"Content-Type": "application/octet-stream"})) for i in range(4)]
            for t in parallel:
                t.start()
            for t in parallel:
                t.join()
            r = c.post("/files", files={"file": ("/home/user/multi.bin", _FileOf(body(100)))})
            assert r.status_code == 200, r.text
        sizes = sbx.commands.run("stat -c %s /home/user/one.bin /home/user/p*.bin /home/user/multi.bin").stdout.split()
        assert sizes == [str(400 << 20)] + [str(100 << 20)] * 4 + [str(100 << 20)]
        assert sbx.commands.run("head -c 1048576 /home/user/one.bin | md5sum").stdout.split()[0] == \
            hashlib.md5(chunk).hexdigest()
        assert watch.growth < 64, f"uploading 900 MiB grew the server by {watch.growth:.0f} MiB"
        print(f"\nuploads: server RSS {watch.base:.0f} -> peak {watch.peak:.0f} MiB for 900 MiB uploaded")
        # A failed upload (the disk fills up) leaves the old file as it was and nothing half-written.
        sbx.files.write("/home/user/keep.txt", "old")
        with httpx.Client(base_url=server_url, headers=auth, timeout=120) as c:
            r = c.post("/files", params={"path": "/home/user/keep.txt"}, content=body(600),
                       headers={"Content-Type": "application/octet-stream"})
        assert r.status_code == 507, r.text
        assert sbx.files.read("/home/user/keep.txt") == "old"
        assert "upload" not in sbx.commands.run("ls -a /home/user").stdout
    finally:
        sbx.kill()
    assert_neighbour_and_server_fine(neighbour, server_url)


class _FileOf:
    """A binary file-like object over an iterator of chunks (httpx streams it in a multipart body)."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._buf = b""

    def read(self, n: int = -1) -> bytes:
        while n < 0 or len(self._buf) < n:
            piece = next(self._chunks, None)
            if piece is None:
                break
            self._buf += piece
        out, self._buf = (self._buf, b"") if n < 0 else (self._buf[:n], self._buf[n:])
        return out


# --- 10. big payloads are chunked; an oversized one fails only its own call ----------------------------


def test_big_results_code_and_listings(server_url: str, neighbour: Sandbox) -> None:
    with Sandbox.create(api_url=server_url, limits={"memoryMB": 1024, "diskMB": 512}) as sbx:
        sbx.run_code("state = 'kept'")
        assert len(sbx.run_code("'a' * 2_000_000").text) == 2_000_000  # a 2 MB result (quotes dropped, as E2B)
        png = sbx.run_code(
            "import numpy as np, matplotlib.pyplot as plt\n"
            "fig = plt.figure(figsize=(20, 20), dpi=100); plt.imshow(np.random.rand(2000, 2000)); plt.show()"
        ).results[0].png
        assert len(png) > 2_500_000  # a PNG over 2.5 MB, whole
        code = "x = '" + "y" * 1_100_000 + "'\nprint(len(x))"
        assert sbx.run_code(code).logs.stdout == ["1100000\n"]  # 1.1 MB of code
        sbx.commands.run("mkdir /home/user/many && cd /home/user/many && "
                         "for i in $(seq 6000); do : > file-with-a-long-name-to-make-it-big-$i; done")
        assert len(sbx.files.list("/home/user/many")) == 6000
        r = sbx.run_code("'z' * (40 << 20)")  # over the 32 MiB limit of one output
        assert r.error is not None and r.error.name == "OutputTooLarge", r
        assert sbx.run_code("state").text == "kept"  # the context lived through all of it
        assert sbx.commands.run("echo fine").stdout == "fine\n"
    assert_neighbour_and_server_fine(neighbour, server_url)


def test_junk_on_the_context_socket_restarts_only_that_context(server_url: str, neighbour: Sandbox) -> None:
    with Sandbox.create(api_url=server_url) as sbx:
        r = sbx.run_code("import os; os.write(3, b'\\xff' * 64)")  # user code can reach its context's socket
        assert r.error is not None and r.error.name == "UnexpectedEndOfExecution"
        assert sbx.run_code("1 + 2").text == "3"
    assert_neighbour_and_server_fine(neighbour, server_url)


# --- 11. the files API reads only regular files ---------------------------------------------------------


def test_files_api_refuses_fifos_devices_and_the_agents_proc(server_url: str, neighbour: Sandbox) -> None:
    with Sandbox.create(api_url=server_url) as sbx:
        sbx.commands.run("mkfifo /home/user/fifo; ln -s /dev/zero /home/user/zero; ln -s /dev/urandom /tmp/rnd")
        for path in ("/home/user/fifo", "/home/user/zero", "/tmp/rnd", "/dev/zero", "/dev/tty"):
            t = time.monotonic()
            with pytest.raises(InvalidArgumentException, match="regular file|No such device"):
                sbx.files.read(path)
            assert time.monotonic() - t < 5
        t = time.monotonic()
        with pytest.raises(InvalidArgumentException, match="regular file"):
            sbx.files.write("/home/user/fifo", "x")  # a FIFO without a reader would block a plain open
        assert time.monotonic() - t < 5
        for path in ("/proc/1/environ", "/proc/self/environ", "/proc/thread-self/environ", "/proc/1/cmdline"):
            with pytest.raises(SandboxException, match="agent's own /proc|Permission denied"):
                sbx.files.read(path)
        assert sbx.files.read("/proc/version").startswith("Linux")  # other /proc files read fine
        assert sbx.commands.run("echo alive").stdout == "alive\n"
    assert_neighbour_and_server_fine(neighbour, server_url)


# --- 12. a run's timeout is a total deadline, enforced in the sandbox -----------------------------------


def test_run_code_timeout_is_a_total_deadline(server_url: str, e2b_env: str, neighbour: Sandbox) -> None:
    from e2b_code_interpreter import Sandbox as E2BSandbox

    with Sandbox.create(api_url=server_url) as sbx:
        sbx.run_code("kept = 5")
        t = time.monotonic()
        with pytest.raises(TimeoutException):
            sbx.run_code("import time\nfor _ in range(600):\n    print('tick', flush=True); time.sleep(0.1)", timeout=6)
        assert 5.5 < time.monotonic() - t < 9
        t = time.monotonic()
        assert sbx.run_code("kept").text == "5" and time.monotonic() - t < 2  # interrupted, not restarted
        # The deadline holds in the sandbox too, for a client that never gives up itself.
        auth = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999", "X-Access-Token": sbx._conn.access_token}
        t = time.monotonic()
        r = httpx.post(f"{server_url}/execute", headers=auth, timeout=60,
                       json={"code": "import time\ntime.sleep(60)", "timeout": 3})
        assert 2.5 < time.monotonic() - t < 6
        assert '"KeyboardInterrupt"' in r.text and "timed out after 3" in r.text
    e2b = E2BSandbox.create()
    try:
        e2b.run_code("kept = 6")
        t = time.monotonic()
        with pytest.raises(Exception, match="(?i)time"):
            e2b.run_code("import time\nwhile True:\n    print('tick', flush=True); time.sleep(0.1)", timeout=6)
        # The official SDK keeps its deadline client-side (its transport allows up to twice the
        # timeout); when it gives up, the run in the sandbox is interrupted, not left running.
        assert 5.5 < time.monotonic() - t < 15
        t = time.monotonic()
        assert e2b.run_code("kept").text == "6" and time.monotonic() - t < 3
    finally:
        e2b.kill()
    assert_neighbour_and_server_fine(neighbour, server_url)


# --- 8. client-chosen limits have an operator's ceiling ------------------------------------------------


@pytest.mark.parametrize(("body", "fragment"), [
    ({"limits": {"memoryMB": 65536}}, "memoryMB must be between 32 and 8192"),
    ({"limits": {"pids": 32768}}, "pids must be between 8 and 1024"),
    ({"limits": {"cpuCount": 256}}, "cpuCount must be between 0.05 and"),
    ({"limits": {"diskMB": 1 << 20}}, "diskMB must be between 1 and"),
    ({"limits": {"openFiles": 1 << 20}}, "openFiles must be between 64 and 65536"),
    ({"timeout": 24 * 3600}, "between 1 and 3600 seconds"),
])
def test_limits_over_the_ceiling_are_refused(server_url: str, body: dict[str, object], fragment: str) -> None:
    before = len(httpx.get(f"{server_url}/sandboxes", timeout=30).json())
    r = httpx.post(f"{server_url}/v2/sandboxes", json={"templateID": "base", **body}, timeout=30)
    assert r.status_code == 400 and fragment in r.json()["message"], r.text
    assert len(httpx.get(f"{server_url}/sandboxes", timeout=30).json()) == before


def test_operator_sets_the_ceilings(tmp_path: Path) -> None:
    srv = ServerProcess(tmp_path / "small.log", "--max-memory-mb", "256", "--max-pids", "64", "--max-timeout", "60",
                        "--max-sandboxes", "20")
    try:
        srv.wait_ready()
        r = httpx.post(f"{srv.url}/v2/sandboxes", json={"templateID": "base", "limits": {"memoryMB": 512}}, timeout=30)
        assert r.status_code == 400 and "between 32 and 256" in r.json()["message"]
        r = httpx.post(f"{srv.url}/v2/sandboxes", json={"templateID": "base", "timeout": 61}, timeout=30)
        assert r.status_code == 400 and "between 1 and 60" in r.json()["message"]
        with Sandbox.create(api_url=srv.url, timeout=60) as sbx:  # the defaults came down to the ceilings
            info = httpx.get(f"{srv.url}/sandboxes/{sbx.sandbox_id}", timeout=30).json()
            assert info["limits"]["memoryMB"] == 256 and info["limits"]["pids"] == 64
            assert sbx.run_code("1 + 1").text == "2"
    finally:
        srv.stop()


# --- 8. admission control on what all sandboxes together promise and use ------------------------------


def host_mem_mib() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("MemTotal:"))


def small_server(tmp_path: Path, budget_mib: int, *args: str) -> ServerProcess:
    """A server whose sandboxes together may use about `budget_mib` of memory (its parent cgroup)."""
    srv = ServerProcess(tmp_path / "budget.log", "--memory-reserve-mb", str(host_mem_mib() - budget_mib),
                        "--max-sandboxes", "20", *args)
    srv.wait_ready()
    return srv


def test_admission_refuses_what_the_host_cannot_promise(tmp_path: Path, neighbour: Sandbox, server_url: str) -> None:
    srv = small_server(tmp_path, 2048, "--memory-overcommit", "1")
    try:
        a = Sandbox.create(api_url=srv.url, limits={"memoryMB": 1024})
        r = httpx.post(f"{srv.url}/v2/sandboxes", json={"templateID": "base", "limits": {"memoryMB": 1024}}, timeout=30)
        assert r.status_code == 429 and "ask for less memoryMB" in r.json()["message"], r.text
        a.kill()
        with Sandbox.create(api_url=srv.url, limits={"memoryMB": 1024}) as b:
            assert b.run_code("1").text == "1"
        # What the sandboxes use counts too: past 90 % of the budget, no new sandbox starts.
        with Sandbox.create(api_url=srv.url, limits={"memoryMB": 1700, "diskMB": 64}) as hog:
            hog.run_code("import numpy as np\nx = np.ones(1650 << 17)")  # 1650 MiB, touched
            r = httpx.post(f"{srv.url}/v2/sandboxes", json={"templateID": "base", "limits": {"memoryMB": 64}},
                           timeout=30)
            assert r.status_code == 429 and "no new sandbox" in r.json()["message"], r.text
            hog.run_code("del x")
            with Sandbox.create(api_url=srv.url, limits={"memoryMB": 64, "diskMB": 16}) as small:
                assert small.run_code("2").text == "2"
    finally:
        srv.stop()
    assert_neighbour_and_server_fine(neighbour, server_url)


def test_all_sandboxes_together_stay_inside_the_parent_cgroup(tmp_path: Path, neighbour: Sandbox,
                                                               server_url: str) -> None:
    srv = small_server(tmp_path, 1536, "--memory-overcommit", "4")
    try:
        a = Sandbox.create(api_url=srv.url, limits={"memoryMB": 1024})
        b = Sandbox.create(api_url=srv.url, limits={"memoryMB": 1024})
        a.run_code("mine = 'a'")
        b.run_code("mine = 'b'")
        a.run_code("import numpy as np\nx = np.ones(800 << 17)")  # 800 MiB: within a's limit
        r = b.run_code("import numpy as np\ny = np.ones(800 << 17)")  # within b's, not within both together
        a_holds = a.run_code("'x' in globals()").text == "True"
        # The kernel took memory back inside the server's budget: one of the two lost its array.
        assert not (r.error is None and a_holds), (r, a_holds)
        assert a.commands.run("echo a").stdout == "a\n" and b.commands.run("echo b").stdout == "b\n"
        a.kill()
        b.kill()
    finally:
        srv.stop()
    assert_neighbour_and_server_fine(neighbour, server_url)
