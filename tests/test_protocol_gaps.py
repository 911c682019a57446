"""E2B protocol gaps the official suites found (issue 30, section 1), through the official e2b SDK and
raw clients, against real sandboxes:

- set_timeout(0) ends a sandbox at once (or pauses it, under on_timeout "pause");
- network.maskRequestHost is the Host a sandbox's served port sees (${PORT} substituted);
- a private sandbox's port without the traffic token is E2B's 403 and body;
- an early refusal (an answer before the request body was read) is readable by a client that is still
  sending its body, and the server reads only a bounded part of that body;
- fork on the linux backend: a filesystem fork (the disk copied, processes started afresh).
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from e2b import Sandbox as E2BSandbox
from e2b import SandboxNetworkOpts, SandboxState
from e2b.exceptions import NotFoundException

from tests.conftest import GVISOR
from tests.helpers import create_sandbox, wait_until
from tests.servers import ServerProcess
from tests.test_ports import SERVER_SCRIPT, _wait_port

# --- set_timeout(0): expire now ----------------------------------------------------------------------


def test_set_timeout_zero_ends_the_sandbox_now(e2b_env: str) -> None:
    sbx = E2BSandbox.create(timeout=300)
    assert sbx.is_running()
    sbx.set_timeout(0)
    assert not sbx.is_running()  # at once: the call returns once the sandbox reached its end of life
    with pytest.raises(NotFoundException):
        E2BSandbox.get_info(sbx.sandbox_id)


def test_set_timeout_zero_pauses_under_on_timeout_pause(e2b_env: str) -> None:
    sbx = E2BSandbox.create(timeout=300, lifecycle={"on_timeout": "pause"})
    try:
        sbx.files.write("/home/user/kept.txt", "kept across the pause")
        sbx.set_timeout(0)
        wait_until("the pause at the timeout", lambda: sbx.get_info().state == SandboxState.PAUSED, timeout=60)
        resumed = sbx.connect()
        assert resumed.files.read("/home/user/kept.txt") == "kept across the pause"
    finally:
        sbx.kill()


def test_negative_timeout_is_still_refused(server_url: str) -> None:
    with httpx.Client(base_url=server_url) as http:
        sbx = create_sandbox(http)
        try:
            r = http.post(f"/sandboxes/{sbx['sandboxID']}/timeout", json={"timeout": -1})
            assert r.status_code == 400 and "between 0 and" in r.json()["message"]
            assert http.get(f"/sandboxes/{sbx['sandboxID']}").status_code == 200
        finally:
            http.delete(f"/sandboxes/{sbx['sandboxID']}")


# --- network.maskRequestHost ------------------------------------------------------------------------


def test_mask_request_host_is_the_host_the_sandbox_sees(e2b_env: str, server_url: str) -> None:
    sbx = E2BSandbox.create(network=SandboxNetworkOpts(mask_request_host="custom-host.example.com:${PORT}"))
    try:
        assert sbx.get_info().network["mask_request_host"] == "custom-host.example.com:${PORT}"
        sbx.files.write("/tmp/port_server.py", SERVER_SCRIPT)
        sbx.commands.run("python /tmp/port_server.py 8000", background=True)
        host = sbx.get_host(8000)
        _wait_port(server_url, host)
        r = httpx.get(server_url + "/echo", headers={"Host": host, "X-Probe": "1"})
        headers = dict(r.json()["headers"])
        assert headers["host"] == "custom-host.example.com:8000"
        assert headers["x-probe"] == "1"  # the rest of the request is as it was sent
        # E2B's routing headers, with no Host of the sandbox's: masked too
        port = urlsplit(server_url).port
        r = httpx.get(server_url + "/echo", headers={"Host": f"localhost:{port}", "E2b-Sandbox-Id": sbx.sandbox_id,
                                                     "E2b-Sandbox-Port": "8000"})
        assert dict(r.json()["headers"])["host"] == "custom-host.example.com:8000"
    finally:
        sbx.kill()


def test_unmasked_sandbox_sees_the_clients_host(e2b_env: str, server_url: str) -> None:
    sbx = E2BSandbox.create()
    try:
        assert "mask_request_host" not in (sbx.get_info().network or {})
        sbx.files.write("/tmp/port_server.py", SERVER_SCRIPT)
        sbx.commands.run("python /tmp/port_server.py 8000", background=True)
        host = sbx.get_host(8000)
        _wait_port(server_url, host)
        assert dict(httpx.get(server_url + "/echo", headers={"Host": host}).json()["headers"])["host"] == host
    finally:
        sbx.kill()


@pytest.mark.parametrize("mask", ["bad host", "evil\r\nx-injected: 1", 42, "a" * 256])
def test_a_mask_that_is_no_host_is_refused(server_url: str, mask: object) -> None:
    r = httpx.post(server_url + "/v2/sandboxes", json={"templateID": "base", "network": {"maskRequestHost": mask}})
    assert r.status_code == 400 and "maskRequestHost" in r.json()["message"]


# --- allowPublicTraffic false: E2B's 403 -------------------------------------------------------------


def test_private_port_without_the_traffic_token_is_403(e2b_env: str, server_url: str) -> None:
    sbx = E2BSandbox.create(network=SandboxNetworkOpts(allow_public_traffic=False))
    try:
        sbx.files.write("/tmp/port_server.py", SERVER_SCRIPT)
        sbx.commands.run("python /tmp/port_server.py 8000", background=True)
        host = sbx.get_host(8000)
        token = {"e2b-traffic-access-token": sbx.traffic_access_token}
        wait_until("the port", lambda: httpx.get(server_url + "/echo", headers={"Host": host, **token}).status_code == 200,
                   timeout=20)
        r = httpx.get(server_url + "/echo", headers={"Host": host})
        assert r.status_code == 403
        body = r.json()
        assert body == {"sandboxId": sbx.sandbox_id, "code": 403, "message": body["message"]}
        assert "e2b-traffic-access-token" in body["message"] and "missing" in body["message"]
        r = httpx.get(server_url + "/echo", headers={"Host": host, "e2b-traffic-access-token": "wrong"})
        assert r.status_code == 403 and "invalid" in r.json()["message"]
    finally:
        sbx.kill()


# --- early refusals readable by a client still sending its body --------------------------------------

BIG = 24 << 20  # well above the socket buffers: the refusal comes while the client still writes


def _post_raw(server_url: str, path: str, headers: dict[str, str], body_size: int,
              first: bytes = b"", last: bytes = b"") -> tuple[bytes, int, OSError | None]:
    """POST `first` + zeros + `last` (body_size bytes in all) the way a plain client does: the whole body
    written before anything is read. What came back (all of it), the bytes written, the write error."""
    port = urlsplit(server_url).port
    sock = socket.create_connection(("127.0.0.1", port))
    head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: {body_size}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    sock.sendall(head.encode())
    sent, error = 0, None
    chunk = bytes(64 << 10)
    try:
        sock.sendall(first)
        sent = len(first)
        while sent < body_size - len(last):
            sent += sock.send(chunk[: body_size - len(last) - sent])
        sock.sendall(last)
        sent += len(last)
    except OSError as e:
        error = e
    answer = b""
    sock.settimeout(30)
    try:
        while data := sock.recv(1 << 16):
            answer += data
    except OSError as e:  # a reset after the answer (past the bound): what came before counts
        error = error or e
    sock.close()
    return answer, sent, error


def _status(answer: bytes) -> int:
    assert answer.startswith(b"HTTP/1.1 "), f"no answer could be read: {answer[:80]!r}"
    return int(answer[9:12])


def test_refused_control_plane_body_is_answered_readably(server_url: str) -> None:
    # a JSON body over the control plane's limit: 413 from its declared length, before any byte is read
    for _ in range(5):
        answer, sent, error = _post_raw(server_url, "/v2/sandboxes", {"Content-Type": "application/json"}, BIG)
        assert _status(answer) == 413, answer[:200]
        assert sent == BIG and error is None  # the whole body was taken: no EPIPE, no reset


def _multipart(parts: list[tuple[str, bytes]], boundary: str) -> tuple[bytes, bytes]:
    """A multipart body's bytes before and after the last part's content."""
    out = b""
    for name, content in parts[:-1]:
        out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{name}\"\r\n"
                f"Content-Type: application/octet-stream\r\n\r\n").encode() + content + b"\r\n"
    out += (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"{parts[-1][0]}\"\r\n"
            f"Content-Type: application/octet-stream\r\n\r\n").encode()
    return out, f"\r\n--{boundary}--\r\n".encode()


def test_refused_uploads_are_answered_readably(server_url: str) -> None:
    with httpx.Client(base_url=server_url) as http:
        sbx = create_sandbox(http)
    try:
        plane = {"E2b-Sandbox-Id": sbx["sandboxID"], "E2b-Sandbox-Port": "49983"}
        boundary = uuid.uuid4().hex
        # a multi-file upload whose first file the user may not write (403), then a big one
        first, last = _multipart([("/root/not-yours.txt", b"x"), ("/home/user/big.bin", b"")], boundary)
        multipart = {**plane, "X-Access-Token": sbx["envdAccessToken"],
                     "Content-Type": f"multipart/form-data; boundary={boundary}"}
        for _ in range(5):
            answer, sent, error = _post_raw(server_url, "/files?username=user", multipart, BIG, first, last)
            assert _status(answer) == 403, answer[:300]
            assert sent == BIG and error is None
        # a single-file upload without the access token (401, before any byte of the body is read)
        single = {**plane, "Content-Type": "application/octet-stream"}
        for _ in range(5):
            answer, sent, error = _post_raw(server_url, "/files?path=/home/user/a.bin", single, BIG)
            assert _status(answer) == 401, answer[:300]
            assert sent == BIG and error is None
        # and through httpx, which also sends the whole body before it reads
        r = httpx.post(server_url + "/files", params={"path": "/home/user/a.bin"}, content=os.urandom(BIG),
                       headers=single)
        assert r.status_code == 401
    finally:
        httpx.delete(f"{server_url}/sandboxes/{sbx['sandboxID']}")


def test_the_server_reads_only_a_bounded_part_of_a_refused_body(server_url: str) -> None:
    from agentcell.server.linger import LINGER_BYTES

    huge = 4 * LINGER_BYTES
    answer, sent, error = _post_raw(server_url, "/v2/sandboxes", {"Content-Type": "application/json"}, huge)
    assert _status(answer) == 413  # the answer still came first
    assert error is not None and sent < 2 * LINGER_BYTES  # then the server stopped reading, and closed


# --- fork on the linux backend: a filesystem fork -----------------------------------------------------


@pytest.mark.skipif(GVISOR, reason="gvisor forks carry memory and processes (test_snapshots.py)")
def test_linux_fork_copies_the_disk_and_restarts_processes(e2b_env: str, server_url: str) -> None:
    sbx = E2BSandbox.create(envs={"FORK_ENV": "inherited"}, metadata={"purpose": "fork-test"},
                            network=SandboxNetworkOpts(allow_public_traffic=False))
    forks: list[E2BSandbox] = []
    try:
        sbx.files.write("/home/user/state.txt", "state before fork")
        sbx.files.write("/tmp/scratch.txt", "in /tmp too")
        sbx.commands.run("sleep 4242", background=True)
        assert sbx.commands.run("pgrep -x sleep").exit_code == 0
        forks = [f for f in sbx.fork(count=2, timeout=120) if isinstance(f, E2BSandbox)]
        assert len(forks) == 2 and len({f.sandbox_id for f in forks} | {sbx.sandbox_id}) == 3
        for fork in forks:
            assert fork.is_running()
            assert fork.files.read("/home/user/state.txt") == "state before fork"
            assert fork.files.read("/tmp/scratch.txt") == "in /tmp too"
            assert fork.commands.run("echo $FORK_ENV").stdout.strip() == "inherited"
            # processes are started afresh, not carried
            check = fork.commands.run("pgrep -x sleep || echo none")
            assert check.stdout.strip() == "none"
            info = httpx.get(f"{server_url}/sandboxes/{fork.sandbox_id}").json()
            assert info["forkMode"] == "filesystem"
            assert info["metadata"] == {"purpose": "fork-test"}
            assert info["network"]["allowPublicTraffic"] is False  # as private as the original
        # independent copies: a write in one fork reaches neither the original nor the other fork
        forks[0].files.write("/home/user/state.txt", "modified in fork")
        assert sbx.files.read("/home/user/state.txt") == "state before fork"
        assert forks[1].files.read("/home/user/state.txt") == "state before fork"
        assert sbx.commands.run("pgrep -x sleep").exit_code == 0  # the original runs on
    finally:
        for s in (*forks, sbx):
            s.kill()


def test_fork_response_says_which_fork(server_url: str) -> None:
    with httpx.Client(base_url=server_url, timeout=60) as http:
        sbx = create_sandbox(http)
        try:
            r = http.post(f"/sandboxes/{sbx['sandboxID']}/fork", json={"count": 1})
            assert r.status_code == 201, r.text
            [answer] = r.json()
            assert answer["sandbox"]["forkMode"] == ("memory" if GVISOR else "filesystem")
            http.delete(f"/sandboxes/{answer['sandbox']['sandboxID']}")
        finally:
            http.delete(f"/sandboxes/{sbx['sandboxID']}")
        r = http.post(f"/sandboxes/{sbx['sandboxID']}/fork", json={})
        assert r.status_code == 404  # a killed sandbox: E2B's SandboxNotFound



def test_connections_dropping_refused_bodies_do_not_lock_out_clients(tmp_path: Path) -> None:
    """Each of `cap` connections gets an early 413, then stalls its body: the server lingers on all of
    them, yet a newcomer takes the longest-lingering one's place instead of a 503, and a stop is prompt."""
    cap = 20
    srv = ServerProcess(tmp_path / "linger.log", "--max-connections", str(cap))
    socks: list[socket.socket] = []
    try:
        srv.wait_ready()
        time.sleep(0.5)  # the readiness probe's connection is gone
        head = (f"POST /v2/sandboxes HTTP/1.1\r\nHost: 127.0.0.1:{srv.port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {4 << 20}\r\n\r\n").encode()
        for _ in range(cap):
            s = socket.create_connection(("127.0.0.1", srv.port))
            s.sendall(head + b'{"templateID": "')
            socks.append(s)
        for s in socks:  # each one's answer came (and the server lingers: the body is not all in)
            s.settimeout(10)
            assert s.recv(1 << 16).startswith(b"HTTP/1.1 413 ")
        time.sleep(0.3)  # (http_protocol.EVICT_AFTER: only a connection that waited that long gives way)
        assert httpx.get(f"{srv.url}/health", timeout=5).status_code == 200
        # and a stopping server does not wait for them (uvicorn's graceful shutdown would wait 5 s)
        started = time.monotonic()
        srv.stop()
        assert time.monotonic() - started < 4
    finally:
        for s in socks:
            s.close()
        srv.stop()
