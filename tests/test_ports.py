"""Ports served out of a sandbox (E2B's get_host(port)): real servers inside real sandboxes, reached
through the server's one port by Host `{port}-{id}.localhost:{server port}` or E2B's routing headers."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from agentcell import Sandbox
from tests.conftest import ServerProcess
from tests.helpers import create_sandbox, sh

SERVER_SCRIPT = (Path(__file__).parent / "port_server.py").read_text()
PATTERN = bytes(range(256)) * 256


def _wait_port(url: str, host: str, path: str = "/echo", timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.get(url + path, headers={"Host": host})
        if r.status_code != 502:
            return
        assert time.monotonic() < deadline, f"the sandbox's server did not come up: {r.text}"
        time.sleep(0.1)


def _serve(sbx: Sandbox, url: str, port: int, bind: str = "127.0.0.1") -> str:
    """Start tests/port_server.py on `port` in the sandbox; its host name for the server."""
    sbx.files.write("/tmp/port_server.py", SERVER_SCRIPT)
    sbx.commands.run(f"python /tmp/port_server.py {port} {bind}", background=True)
    host = sbx.get_host(port)
    _wait_port(url, host)
    return host


@pytest.fixture(scope="module")
def box(server_url: str) -> Iterator[tuple[Sandbox, str]]:
    """A sandbox serving port_server.py on 8000; yields it and its host name."""
    sbx = Sandbox.create(api_url=server_url, timeout=900)
    try:
        yield sbx, _serve(sbx, server_url, 8000)
    finally:
        sbx.kill()


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


# --- routing, host names -------------------------------------------------------------------------------


def test_get_host_names_route_here(server_url: str, box: tuple[Sandbox, str], e2b_env: str) -> None:
    import e2b

    sbx, host = box
    port = urlsplit(server_url).port
    assert host == f"8000-{sbx.sandbox_id}.localhost:{port}"
    # The official SDK builds the same name from the create response's domain.
    official = e2b.Sandbox.connect(sbx.sandbox_id)
    assert official.get_host(8000) == host
    r = httpx.get(server_url + "/echo?x=1", headers={"Host": host})
    assert r.status_code == 200 and r.json()["path"] == "/echo?x=1"
    r = httpx.get(server_url + "/echo", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"})
    assert r.status_code == 200 and r.json()["method"] == "GET"


def test_static_files_from_python_http_server(server_url: str) -> None:
    with Sandbox.create(api_url=server_url) as sbx:
        sbx.files.write("/tmp/site/index.html", "<h1>hello from the sandbox</h1>")
        sbx.commands.run("cd /tmp/site && python -m http.server 8080 --bind 127.0.0.1", background=True)
        host = sbx.get_host(8080)
        _wait_port(server_url, host, "/")
        r = httpx.get(server_url + "/index.html", headers={"Host": host})
        assert r.status_code == 200 and r.text == "<h1>hello from the sandbox</h1>"
        assert r.headers["server"].startswith("SimpleHTTP")  # the sandbox's own response headers
        head = httpx.head(server_url + "/index.html", headers={"Host": host})
        assert head.status_code == 200 and head.headers["content-length"] == str(len(r.content))
        missing = httpx.get(server_url + "/nope", headers={"Host": host})
        assert missing.status_code == 404


def test_server_bound_to_ipv6_loopback_only(server_url: str, box: tuple[Sandbox, str]) -> None:
    sbx, _ = box
    code, _, err = sh(sbx, "python -c \"import socket; s = socket.socket(socket.AF_INET6); s.bind(('::1', 0))\"")
    if code != 0:
        pytest.skip(f"no IPv6 loopback in the sandbox: {err}")
    sbx.commands.run("python /tmp/port_server.py 8006 ::1", background=True)
    host = sbx.get_host(8006)
    _wait_port(server_url, host)
    assert httpx.get(server_url + "/echo", headers={"Host": host}).status_code == 200


# --- request and response bodies ------------------------------------------------------------------


def test_post_bodies_reach_the_sandbox_and_credentials_do_not(server_url: str, box: tuple[Sandbox, str]) -> None:
    sbx, host = box
    secrets = {"X-Access-Token": "envd-token-canary", "E2B-Traffic-Access-Token": "traffic-canary",
               "X-API-KEY": "api-key-canary"}
    body = os.urandom(300_000)
    r = httpx.post(server_url + "/echo", content=body, headers={"Host": host, "X-Custom": "kept", **secrets,
                                                                "Connection": "keep-alive, X-Drop-Me",
                                                                "X-Drop-Me": "hop-by-hop"})
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["method"] == "POST" and got["body"].encode("latin-1") == body
    headers = dict(got["headers"])
    assert headers["x-custom"] == "kept" and headers["host"] == host
    assert headers["connection"] == "close"  # one tunnel per request
    for name in [*(k.lower() for k in secrets), "x-drop-me", "keep-alive"]:
        assert name not in headers, f"{name} reached the sandbox"
    assert not any("canary" in v for _, v in got["headers"])

    def pieces() -> Iterator[bytes]:  # no length: httpx sends it chunked
        for i in range(10):
            yield bytes([i]) * 10_000

    r = httpx.post(server_url + "/echo", content=pieces(), headers={"Host": host})
    assert r.status_code == 200 and r.json()["body"].encode("latin-1") == b"".join(pieces())


def test_chunked_and_close_delimited_responses(server_url: str, box: tuple[Sandbox, str]) -> None:
    _, host = box
    r = httpx.get(server_url + "/chunked?n=1000000", headers={"Host": host})
    assert r.status_code == 200 and r.content == (PATTERN * 16)[:1_000_000]
    r = httpx.get(server_url + "/close", headers={"Host": host})
    assert r.status_code == 200 and r.text == "until the end"


def test_large_download_streams_with_bounded_server_memory(server_url: str, server: ServerProcess | None,
                                                            box: tuple[Sandbox, str]) -> None:
    if server is None:
        pytest.skip("needs the server's pid")
    _, host = box
    size = 50 << 20
    base = _rss_kib(server.pid)
    peak = [base]
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], _rss_kib(server.pid))
            time.sleep(0.01)

    sampler = threading.Thread(target=sample)
    sampler.start()
    digest = hashlib.sha256()
    received = 0
    try:
        start = time.monotonic()
        with httpx.stream("GET", server_url + f"/big?n={size}", headers={"Host": host}, timeout=120) as r:
            assert r.status_code == 200 and r.headers["content-length"] == str(size)
            for i, chunk in enumerate(r.iter_raw()):
                digest.update(chunk)
                received += len(chunk)
                if i == 10:
                    time.sleep(2)  # a reader that pauses: the sandbox waits, the server does not buffer
        elapsed = time.monotonic() - start - 2
    finally:
        done.set()
        sampler.join()
    assert received == size
    assert digest.hexdigest() == hashlib.sha256(PATTERN * (size // len(PATTERN))).hexdigest()
    grew = (peak[0] - base) / 1024
    print(f"\n50 MiB through the tunnel: {size / elapsed / 1e6:.0f} MB/s; server RSS +{grew:.1f} MiB")
    assert grew < 24, f"the server grew {grew:.1f} MiB for one download"


def test_big_upload_waits_for_a_slow_sandbox_server(server_url: str, server: ServerProcess | None,
                                                    box: tuple[Sandbox, str]) -> None:
    """The sandbox's server reads nothing for 3 s: the upload waits (tunnel window), the server holds little."""
    if server is None:
        pytest.skip("needs the server's pid")
    _, host = box
    size = 64 << 20
    data = os.urandom(1 << 20) * 64
    base = _rss_kib(server.pid)
    r = httpx.post(server_url + "/sink?delay=3", content=data, headers={"Host": host}, timeout=120)
    grew = (_rss_kib(server.pid) - base) / 1024
    assert r.status_code == 200, r.text
    assert r.json() == {"size": size, "sha256": hashlib.sha256(data).hexdigest()}
    assert grew < 24, f"the server grew {grew:.1f} MiB for one upload"


def test_clients_that_stop_reading_do_not_stall_the_sandbox(server_url: str, server: ServerProcess | None,
                                                            box: tuple[Sandbox, str]) -> None:
    """20 downloads nobody reads hold their own tunnel windows, not the sandbox's shared one: its
    commands and code still run, and the server holds a bounded amount per connection."""
    sbx, host = box
    base = _rss_kib(server.pid) if server else 0
    socks = []
    try:
        for _ in range(20):
            sock = socket.create_connection(("127.0.0.1", urlsplit(server_url).port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.sendall(f"GET /big?n={1 << 30} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            socks.append(sock)
        time.sleep(2)
        start = time.monotonic()
        assert sbx.run_code("6 * 7", timeout=10).text == "42"
        assert sh(sbx, "echo still here", timeout=10) == (0, "still here\n", "")
        assert time.monotonic() - start < 5
        if server:
            grew = (_rss_kib(server.pid) - base) / 1024
            assert grew < 40, f"the server grew {grew:.1f} MiB for 20 stalled downloads"
    finally:
        for sock in socks:
            sock.close()


def test_small_get_latency(server_url: str, box: tuple[Sandbox, str]) -> None:
    sbx, host = box
    with httpx.Client(base_url=server_url) as client:
        def median(headers: dict[str, str], path: str) -> float:
            times = []
            for _ in range(30):
                t = time.perf_counter()
                assert client.get(path, headers=headers).status_code in (200, 204)
                times.append(time.perf_counter() - t)
            return sorted(times)[len(times) // 2] * 1000

        envd = median({"E2b-Sandbox-Id": sbx.sandbox_id}, "/health")  # answered by the server itself
        port = median({"Host": host}, "/echo")
    print(f"\nsmall GET: through the tunnel {port:.2f} ms median, envd /health (no tunnel) {envd:.2f} ms")
    assert port < 50


# --- errors ----------------------------------------------------------------------------------------


def test_closed_port_is_e2bs_502(server_url: str, box: tuple[Sandbox, str]) -> None:
    from e2b import SandboxUnreachableException
    from e2b.envd.api import _health_status

    sbx, _ = box
    r = httpx.get(server_url + "/", headers={"Host": sbx.get_host(8999)})
    assert r.status_code == 502
    assert r.json() == {"sandboxId": sbx.sandbox_id, "message": "The sandbox is running but port is not open",
                        "port": 8999, "code": 502}
    with pytest.raises(SandboxUnreachableException):
        _health_status(r)  # how the official SDK reads a proxy's 502
    r = httpx.get(server_url + "/", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "70000"})
    assert r.status_code == 502 and "port is not open" in r.json()["message"]


def test_unknown_or_dead_sandbox_is_502_not_found(server_url: str) -> None:
    from e2b.envd.api import _health_status

    r = httpx.get(server_url + "/", headers={"Host": f"8000-nosuchsandbox.localhost:{urlsplit(server_url).port}"})
    assert r.status_code == 502 and "was not found" in r.json()["message"]
    assert _health_status(r) is False  # the SDK's is_running() -> False
    sbx = Sandbox.create(api_url=server_url)
    host = _serve(sbx, server_url, 8000)
    sbx.kill()
    r = httpx.get(server_url + "/echo", headers={"Host": host})
    assert r.status_code == 502 and "was not found" in r.json()["message"]


def test_malformed_response_is_502(server_url: str, box: tuple[Sandbox, str]) -> None:
    _, host = box
    r = httpx.get(server_url + "/malformed", headers={"Host": host})
    assert r.status_code == 502 and "malformed" in r.json()["message"]


def test_client_leaving_mid_response_closes_the_sandboxs_connection(server_url: str, box: tuple[Sandbox, str]) -> None:
    sbx, host = box
    sh(sbx, "rm -f /tmp/slow-closed")
    with httpx.stream("GET", server_url + "/slow", headers={"Host": host}) as r:
        assert r.status_code == 200
        next(r.iter_raw())
    deadline = time.monotonic() + 10
    while sh(sbx, "test -e /tmp/slow-closed")[0] != 0:
        assert time.monotonic() < deadline, "the sandbox's server never saw the connection close"
        time.sleep(0.1)


# --- auth ------------------------------------------------------------------------------------------


def test_private_ports_need_the_traffic_token(server_url: str, e2b_env: str) -> None:
    import e2b

    sbx = e2b.Sandbox.create(network={"allow_public_traffic": False})
    try:
        token = sbx.traffic_access_token
        assert token
        sbx.files.write("/tmp/port_server.py", SERVER_SCRIPT)
        sbx.commands.run("python /tmp/port_server.py 8000", background=True)
        host = sbx.get_host(8000)
        url = server_url + "/echo"
        deadline = time.monotonic() + 20
        while httpx.get(url, headers={"Host": host, "E2B-Traffic-Access-Token": token}).status_code == 502:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        r = httpx.get(url, headers={"Host": host})
        assert r.status_code == 403 and "traffic-access-token" in r.json()["message"]  # E2B's status and body
        # the envd token is not the traffic token (as on E2B)
        assert httpx.get(url, headers={"Host": host, "X-Access-Token": sbx._envd_access_token}).status_code == 403
        r = httpx.get(url, headers={"Host": host, "E2B-Traffic-Access-Token": token})
        assert r.status_code == 200
        assert "e2b-traffic-access-token" not in dict(r.json()["headers"])
        # a closed port stays hidden behind the token too
        assert httpx.get(server_url + "/", headers={"Host": sbx.get_host(8999)}).status_code == 403
    finally:
        sbx.kill()


def test_snake_case_network_field_and_public_default(server_url: str) -> None:
    with httpx.Client(base_url=server_url) as http:
        private = create_sandbox(http, network={"allow_public_traffic": False})
        public = create_sandbox(http)
        bad = http.post("/v2/sandboxes", json={"templateID": "base", "network": {"allowPublicTraffic": "no"}})
        try:
            assert bad.status_code == 400
            port = urlsplit(server_url).port
            for sbx, status in ((private, 403), (public, 502)):
                r = http.get("/", headers={"Host": f"8000-{sbx['sandboxID']}.localhost:{port}"})
                assert r.status_code == status, r.text
        finally:
            for sbx in (private, public):
                http.delete(f"/sandboxes/{sbx['sandboxID']}")


def test_one_sandbox_cannot_reach_anothers_port(server_url: str, e2b_env: str) -> None:
    import e2b

    owner = e2b.Sandbox.create(network={"allow_public_traffic": False})
    other = e2b.Sandbox.create(network={"allow_public_traffic": False})
    try:
        owner.files.write("/tmp/port_server.py", SERVER_SCRIPT)
        owner.commands.run("python /tmp/port_server.py 8000", background=True)
        host = owner.get_host(8000)
        own = {"Host": host, "E2B-Traffic-Access-Token": owner.traffic_access_token}
        deadline = time.monotonic() + 20
        while httpx.get(server_url + "/echo", headers=own).status_code == 502:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # another sandbox's token does not open it
        r = httpx.get(server_url + "/echo", headers={"Host": host, "E2B-Traffic-Access-Token": other.traffic_access_token})
        assert r.status_code == 403
        # and from inside the other sandbox there is no path: its loopback is its own, the server is not on it
        server_port = urlsplit(server_url).port
        other.files.write("/tmp/probe.py", f"import socket\nfor port in (8000, {server_port}):\n"
                          "    s = socket.socket()\n    s.settimeout(2)\n"
                          "    print(port, s.connect_ex(('127.0.0.1', port)))\n")
        out = other.commands.run("python /tmp/probe.py").stdout
        assert "8000 0" not in out and f"{server_port} 0" not in out, out
    finally:
        owner.kill()
        other.kill()


def test_a_page_from_a_sandbox_port_is_not_a_trusted_origin(server_url: str, box: tuple[Sandbox, str]) -> None:
    sbx, host = box
    origin = f"http://{host}"
    # the control plane refuses it (a page served by sandbox code must not drive the API)
    assert httpx.get(server_url + "/v2/sandboxes", headers={"Origin": origin}).status_code == 403
    # another sandbox's port refuses it
    other = f"8000-someothersandbox.localhost:{urlsplit(server_url).port}"
    assert httpx.get(server_url + "/echo", headers={"Host": other, "Origin": origin}).status_code == 403
    # the same sandbox (this port or another) accepts it
    assert httpx.get(server_url + "/echo", headers={"Host": host, "Origin": origin}).status_code == 200
    r = httpx.get(server_url + "/", headers={"Host": sbx.get_host(8999), "Origin": origin})
    assert r.status_code == 502


# --- WebSocket -------------------------------------------------------------------------------------


def _ws_frame(opcode: int, payload: bytes) -> bytes:
    mask = os.urandom(4)
    n = len(payload)
    head = bytes([0x80 | opcode]) + (bytes([0x80 | n]) if n < 126 else
                                     bytes([0x80 | 126]) + struct.pack(">H", n) if n < 1 << 16 else
                                     bytes([0x80 | 127]) + struct.pack(">Q", n))
    return head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(payload))


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        assert chunk, "the connection closed"
        data += chunk
    return data


def _ws_read(sock: socket.socket) -> tuple[int, bytes]:
    b0, b1 = _recv_exact(sock, 2)
    n = b1 & 0x7F
    if n == 126:
        n = struct.unpack(">H", _recv_exact(sock, 2))[0]
    elif n == 127:
        n = struct.unpack(">Q", _recv_exact(sock, 8))[0]
    return b0 & 0x0F, _recv_exact(sock, n)


def test_websocket_echo_raw_rfc6455(server_url: str, box: tuple[Sandbox, str]) -> None:
    """A WebSocket client written from RFC 6455 (no library): handshake, text, big binary, ping, close."""
    _, host = box
    key = base64.b64encode(os.urandom(16)).decode()
    with socket.create_connection(("127.0.0.1", urlsplit(server_url).port), timeout=10) as sock:
        sock.sendall((f"GET /ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                      f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode()
                     + _ws_frame(1, b"sent with the handshake"))
        head = b""
        while b"\r\n\r\n" not in head:
            head += sock.recv(1)
        assert head.startswith(b"HTTP/1.1 101"), head
        accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
        assert b"sec-websocket-accept: " + accept.lower() in head.lower()
        assert _ws_read(sock) == (1, b"sent with the handshake")
        for i in range(20):
            sock.sendall(_ws_frame(1, f"message {i}".encode()))
            assert _ws_read(sock) == (1, f"message {i}".encode())
        big = os.urandom(3 << 20)
        sock.sendall(_ws_frame(2, big))
        assert _ws_read(sock) == (2, big)
        sock.sendall(_ws_frame(9, b"ping"))
        assert _ws_read(sock) == (10, b"ping")
        sock.sendall(_ws_frame(8, struct.pack(">H", 1000)))
        assert _ws_read(sock)[0] == 8
        sock.shutdown(socket.SHUT_WR)
        assert sock.recv(1) == b""  # the sandbox's server closed: the relay ended the connection


def test_websocket_echo_with_the_websockets_library(server_url: str, box: tuple[Sandbox, str]) -> None:
    ws_client = pytest.importorskip("websockets.sync.client")
    _, host = box
    sock = socket.create_connection(("127.0.0.1", urlsplit(server_url).port))
    with ws_client.connect(f"ws://{host}/ws", sock=sock, compression=None, max_size=None) as ws:
        for message in ("hello", "world" * 1000):
            ws.send(message)
            assert ws.recv(timeout=10) == message
        blob = os.urandom(1 << 20)
        ws.send(blob)
        assert ws.recv(timeout=10) == blob


def test_websocket_needs_the_token_on_private_sandboxes(server_url: str) -> None:
    with httpx.Client(base_url=server_url) as http:
        sbx = create_sandbox(http, network={"allowPublicTraffic": False})
        try:
            host = f"8000-{sbx['sandboxID']}.localhost:{urlsplit(server_url).port}"
            r = http.get("/ws", headers={"Host": host, "Upgrade": "websocket", "Connection": "Upgrade",
                                         "Sec-WebSocket-Key": "x", "Sec-WebSocket-Version": "13"})
            assert r.status_code == 403 and r.headers.get("connection") == "close"
        finally:
            http.delete(f"/sandboxes/{sbx['sandboxID']}")


def test_upgrade_requests_elsewhere_get_a_plain_answer(server_url: str) -> None:
    """Upgrade headers on the control plane: an ordinary response, then the connection closes."""
    r = httpx.get(server_url + "/health", headers={"Upgrade": "websocket", "Connection": "Upgrade"})
    assert r.status_code == 200 and json.loads(r.text)["status"] == "ok"
    assert r.headers.get("connection") == "close"


async def test_async_sdk_get_host(server_url: str, box: tuple[Sandbox, str]) -> None:
    from agentcell import AsyncSandbox

    _, host = box
    sbx = await AsyncSandbox.create(api_url=server_url)
    try:
        assert sbx.get_host(8000) == f"8000-{sbx.sandbox_id}.localhost:{urlsplit(server_url).port}"
        assert sbx.traffic_access_token
        # the neighbour's port answers under its own name only
        assert httpx.get(server_url + "/echo", headers={"Host": host}).status_code == 200
        assert httpx.get(server_url + "/echo", headers={"Host": sbx.get_host(8000)}).status_code == 502
    finally:
        await sbx.kill()
