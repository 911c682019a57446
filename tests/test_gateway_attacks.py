"""The gateway against hostile clients (issue 25, items 2 and 9): real cells, a real gateway, real attacks.

Two keyed cells (`--api-key CELL_KEY`, no uplink) behind a gateway with a key of its own
(`--api-key GATEWAY_KEY --cell-api-key CELL_KEY`), a short body deadline and a small body budget. One
neighbour sandbox per cell holds state the attacks must not touch. After every attack the neighbours
still answer with their state through the gateway, no sandbox appeared or vanished on any cell, and the
gateway still serves.

- Routing: a request the gateway reads as data plane (so: no key checked) must be data plane at the
  cell too, and the gateway must never put the cell key on a request it has not authenticated. The
  case trick of the report (a Host `1-{CELL ID IN CAPITALS}….localhost` and any X-API-KEY) and every
  other way two parsers could read the routing apart are tried on every control-plane call.
- Memory: id-less signed uploads and creates that stall get 408 (or 401/503) within the deadline, and
  the gateway's peak RSS stays far below what they send.
- A real signed upload (the official e2b SDK's upload_url()) larger than the old 16 MiB buffer streams
  through, and envd's refusals keep their messages.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

import httpx
import pytest

from agentcell import Sandbox
from agentcell.server.auth import signature
from tests.helpers import wait_until
from tests.servers import GatewayProcess, ServerProcess
from tests.test_http_hardening import mem_kib, request_head, reset_peak, status_of

CELL_KEY = "cell_" + "cd" * 20
GATEWAY_KEY = "e2b_" + "ef" * 20
CELL_IDS = ("attkaaaa", "attkbbbb")
BODY_TIMEOUT = 3.0  # the gateway's --body-timeout (the cells keep their default 30 s)
MIB = 1 << 20

pytestmark = pytest.mark.skipif(bool(os.environ.get("AGENTCELL_TEST_SERVER_URL")),
                                reason="these tests start and measure cells and a gateway of their own")


# --- fixtures ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cells(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    logs = tmp_path_factory.mktemp("attack-cells")
    procs = [ServerProcess(logs / f"{cid}.log", "--cell-id", cid, "--api-key", CELL_KEY, "--standbys", "1",
                           env={"AGENTCELL_EGRESS_UPLINK": "none"}) for cid in CELL_IDS]
    try:
        for p in procs:
            p.wait_ready(timeout=300)
        yield procs
    finally:
        for p in procs:
            p.stop()


@pytest.fixture(scope="module")
def gateway(cells: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    g = GatewayProcess(tmp_path_factory.mktemp("attack-gateway") / "gw.log", [c.url for c in cells],
                       "--api-key", GATEWAY_KEY, "--cell-api-key", CELL_KEY, "--body-timeout", str(BODY_TIMEOUT),
                       "--max-body-memory-mb", "8")
    try:
        g.wait_ready()
        wait_until("both cells up at the gateway", lambda: len(_cells_seen(g)) == 2, timeout=30)
        yield g
    finally:
        g.stop()


def _cells_seen(g: GatewayProcess) -> list[str]:
    r = httpx.get(g.url + "/v1/cells", headers={"X-API-KEY": GATEWAY_KEY}, timeout=5)
    return [c["cellId"] for c in r.json() if c["up"]] if r.status_code == 200 else []


@pytest.fixture(scope="module")
def neighbours(cells: list[ServerProcess], gateway: GatewayProcess) -> Iterator[dict[str, Sandbox]]:
    """One sandbox per cell (made on the cell itself), used through the gateway, with state set."""
    made = {}
    for cid, cell in zip(CELL_IDS, cells, strict=True):
        own = Sandbox.create(api_url=cell.url, api_key=CELL_KEY, timeout=1800)
        made[cid] = Sandbox.connect(own.sandbox_id, api_url=gateway.url, api_key=GATEWAY_KEY)
        made[cid].run_code(f"canary = 'alive on {cid}'")
    yield made
    for sbx in made.values():
        with contextlib.suppress(Exception):
            sbx.kill()


def _census(cells: list[ServerProcess]) -> list[str]:
    """Every sandbox on every cell, asked of the cells themselves."""
    ids = []
    for cell in cells:
        r = httpx.get(cell.url + "/sandboxes", headers={"X-API-KEY": CELL_KEY}, timeout=30)
        assert r.status_code == 200, r.text
        ids += [x["sandboxID"] for x in r.json()]
    return sorted(ids)


@pytest.fixture
def unharmed(cells: list[ServerProcess], gateway: GatewayProcess, neighbours: dict[str, Sandbox]) -> Iterator[None]:
    """After the attack: no sandbox made or gone, the neighbours keep their state, the gateway serves."""
    before = _census(cells)
    yield
    assert _census(cells) == before, "a sandbox was made or killed by the attack"
    for cid, sbx in neighbours.items():
        assert sbx.run_code("canary").text == f"alive on {cid}"
    assert httpx.get(gateway.url + "/health", timeout=10).status_code == 200
    listed = httpx.get(gateway.url + "/v2/sandboxes", headers={"X-API-KEY": GATEWAY_KEY}, timeout=30)
    assert listed.status_code == 200 and {x["sandboxID"] for x in listed.json()} >= {
        s.sandbox_id for s in neighbours.values()}


# --- routing: one reading, and no key on what was not authenticated -----------------------------------------


def _control_calls(neighbours: dict[str, Sandbox]) -> list[tuple[str, str, dict[str, Any] | None]]:
    """Control-plane calls an attacker wants: list, create, kill or expire another tenant's sandbox,
    snapshot it, list and delete snapshots, the cells' own endpoints."""
    a, b = (neighbours[c].sandbox_id for c in CELL_IDS)
    return [
        ("GET", "/sandboxes", None),
        ("GET", "/v2/sandboxes", None),
        ("POST", "/v2/sandboxes", {"templateID": "base", "timeout": 60}),
        ("POST", "/sandboxes", {"templateID": "base", "timeout": 60}),
        ("GET", f"/sandboxes/{a}", None),
        ("DELETE", f"/sandboxes/{b}", None),
        ("POST", f"/sandboxes/{a}/timeout", {"timeout": 1}),
        ("POST", f"/sandboxes/{a}/pause", None),
        ("POST", f"/sandboxes/{a}/snapshots", {}),
        ("GET", "/snapshots", None),
        ("DELETE", f"/templates/{CELL_IDS[0]}{'x' * 20}", None),
        ("GET", "/v1/cell", None),
        ("GET", "/v1/cell/file-signer/read?signature=v1_x", None),
    ]


# Headers that one parser might read as a sandbox's data plane while another reads them as the control
# plane: case (the report's trick), dots, ports, userinfo, lengths, a bare label, header forms, mixes,
# and a routing header that a hop would drop.
# Each builds its headers from (the neighbour's id on the first cell, that cell's id, the gateway's port).
DISGUISES: dict[str, Any] = {
    "report: Host 1-{CELL ID IN CAPITALS}xyz": lambda a, c, p: {"Host": f"1-{c.upper()}xyz.localhost"},
    "Host with the neighbour's id in capitals": lambda a, c, p: {"Host": f"49983-{a.upper()}.localhost"},
    "Host mixed case, interpreter port": lambda a, c, p: {"Host": f"49999-{a[:5].upper()}{a[5:]}.localhost"},
    "Host in capitals with its port": lambda a, c, p: {"Host": f"1-{c.upper()}xyz.LOCALHOST:{p}"},
    "Host with a trailing dot": lambda a, c, p: {"Host": f"1-{c.upper()}xyz.localhost."},
    "Host port with a leading zero": lambda a, c, p: {"Host": f"049983-{a}.localhost"},
    "Host port out of range": lambda a, c, p: {"Host": f"99999-{a}.localhost"},
    "Host port zero": lambda a, c, p: {"Host": f"0-{a}.localhost"},
    "Host with userinfo": lambda a, c, p: {"Host": f"1-{c}xyz.localhost@localhost"},
    "Host id longer than an id": lambda a, c, p: {"Host": f"1-{c}{'x' * 70}.localhost"},
    "Host label alone": lambda a, c, p: {"Host": f"1-{c.upper()}xyz"},
    "header id in capitals": lambda a, c, p: {"E2b-Sandbox-Id": a.upper()},
    "header id padded": lambda a, c, p: {"E2b-Sandbox-Id": f"  {a}  "},
    "header id with a space inside": lambda a, c, p: {"E2b-Sandbox-Id": f"{a[:8]} {a[8:]}"},
    "header id empty": lambda a, c, p: {"E2b-Sandbox-Id": ""},
    "header port alone": lambda a, c, p: {"E2b-Sandbox-Port": "49983"},
    "header port not a number": lambda a, c, p: {"E2b-Sandbox-Id": a, "E2b-Sandbox-Port": "envd"},
    "header port with a leading zero": lambda a, c, p: {"E2b-Sandbox-Id": a, "E2b-Sandbox-Port": "049983"},
    "header and Host name different sandboxes": lambda a, c, p: {"E2b-Sandbox-Id": a,
                                                                 "Host": f"49983-{c}{'q' * 20}.localhost"},
    "header and Host in capitals": lambda a, c, p: {"E2b-Sandbox-Id": a, "Host": f"1-{c.upper()}xyz.localhost"},
    # a proxy drops the headers Connection names: the routing header would reach the cell no more
    "routing header named hop-by-hop": lambda a, c, p: {"E2b-Sandbox-Id": a, "Connection": "e2b-sandbox-id"},
}


def _raw(port: int, method: str, path: str, headers: list[tuple[str, str]], body: bytes = b"",
         timeout: float = 30) -> tuple[int, bytes]:
    """One request exactly as given (duplicate headers, any Host), over a fresh connection: (status, body)."""
    lines = [f"{method} {path} HTTP/1.1", *(f"{k}: {v}" for k, v in headers),
             f"Content-Length: {len(body)}", "Connection: close", "", ""]
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall("\r\n".join(lines).encode("latin-1") + body)
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head.lower():
        out, rest_ = b"", rest
        while rest_:
            size_line, _, rest_ = rest_.partition(b"\r\n")
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                break
            out, rest_ = out + rest_[:size], rest_[size + 2:]
        rest = out
    return status_of(data), rest


REFUSED = {400, 401, 403, 404, 502}  # malformed, no key, no sandbox token, no such sandbox


@pytest.mark.parametrize("key", [None, "junk"], ids=["keyless", "wrong-key"])
@pytest.mark.parametrize("disguise", list(DISGUISES))
def test_no_disguise_opens_the_control_plane(gateway: GatewayProcess, neighbours: dict[str, Sandbox],
                                             unharmed: None, disguise: str, key: str | None) -> None:
    """A keyless or wrong-key client dressed as a data-plane request: every control-plane call is
    refused and nothing happens. On 256c5b0 the report's case trick listed, created and killed."""
    name = disguise
    extra = DISGUISES[disguise](neighbours[CELL_IDS[0]].sandbox_id, CELL_IDS[0], gateway.port)
    headers = [("Host", f"localhost:{gateway.port}"), *extra.items()] if "Host" not in extra else [*extra.items()]
    if key is not None:
        headers.append(("X-API-KEY", key))
    served = []
    for method, path, body in _control_calls(neighbours):
        raw = json.dumps(body).encode() if body is not None else b""
        with_type = [*headers, ("Content-Type", "application/json")] if body is not None else headers
        status, answer = _raw(gateway.port, method, path, with_type, raw)
        if status not in REFUSED or answer.lstrip().startswith(b"["):
            served.append(f"{method} {path} -> {status} {answer[:120]!r}")
    assert not served, f"{name}: the control plane served a client without the key:\n" + "\n".join(served)


def test_duplicated_routing_headers_are_refused(gateway: GatewayProcess, neighbours: dict[str, Sandbox],
                                                cells: list[ServerProcess], unharmed: None) -> None:
    """Routing headers twice, or two Hosts: refused by the gateway and by a cell alike (400), so no hop
    can take the other one than the gateway did."""
    a = neighbours[CELL_IDS[0]].sandbox_id
    token = _token(gateway, a)
    cases = {
        "id twice": [("Host", "localhost"), ("E2b-Sandbox-Id", f"{CELL_IDS[1]}{'z' * 20}"), ("E2b-Sandbox-Id", a)],
        "port twice": [("Host", "localhost"), ("E2b-Sandbox-Id", a), ("E2b-Sandbox-Port", "49999"),
                       ("E2b-Sandbox-Port", "49983")],
        "two Hosts": [("Host", "localhost"), ("Host", f"49999-{a}.localhost")],
    }
    for name, headers in cases.items():
        for port in (gateway.port, cells[0].port):
            status, answer = _raw(port, "POST", "/execute", [*headers, ("X-Access-Token", token),
                                                              ("X-API-KEY", GATEWAY_KEY if port == gateway.port
                                                               else CELL_KEY), ("Content-Type", "application/json")],
                                  b'{"code": "canary = 1"}')
            assert status == 400, f"{name} at {'gateway' if port == gateway.port else 'cell'}: {status} {answer[:200]!r}"


def test_every_control_plane_call_needs_the_gateways_own_key(gateway: GatewayProcess, neighbours: dict[str, Sandbox],
                                                             unharmed: None) -> None:
    """No key, a wrong one, and the cells' key (it is not the gateway's): 401 on every call, nothing done."""
    for key in (None, "junk", CELL_KEY, GATEWAY_KEY.upper()):
        for method, path, body in _control_calls(neighbours):
            headers = {"X-API-KEY": key} if key is not None else {}
            r = httpx.request(method, gateway.url + path, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, f"{method} {path} with key {key!r}: {r.status_code} {r.text[:200]}"
    # a keyless create that declares a big body is refused before any of it is read
    head = request_head("POST", "/v2/sandboxes", {"Host": "localhost", "Content-Type": "application/json",
                                                    "Content-Length": str(MIB)})
    status, _ = _raw_head(gateway.port, head)
    assert status == 401


def _raw_head(port: int, head: bytes) -> tuple[int, float]:
    start = time.monotonic()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(head)
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := s.recv(65536):
                data += chunk
    return status_of(data), time.monotonic() - start


class _RecordingCell(ThreadingHTTPServer):
    """A stand-in cell (cell id "rcrdaaaa") that records what the gateway sends it: it answers the
    gateway's polls like a cell and every other request with 200."""

    daemon_threads = True

    def __init__(self) -> None:
        self.polls: list[dict[str, str]] = []
        self.requests: list[tuple[str, str, list[tuple[str, str]]]] = []
        super().__init__(("127.0.0.1", 0), _Recorder)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"


class _Recorder(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _RecordingCell

    def log_message(self, *args: object) -> None:
        pass

    def _answer(self) -> None:
        headers = [(k.lower(), v) for k, v in self.headers.items()]
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        if self.path == "/v1/cell":
            self.server.polls.append(dict(headers))
            body = {"cellId": "rcrdaaaa", "draining": False, "sandboxes": 0, "paused": 0,
                    "capacity": {"slots": 10, "maxSandboxes": 10}, "load": 0.0}
        else:
            self.server.requests.append((self.command, self.path, headers))
            body = {"sandboxID": None, "refusal": "invalid signature"} if "/file-signer/" in self.path else {}
        raw = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    do_GET = do_POST = do_DELETE = _answer


@pytest.fixture
def recording_gateway(tmp_path: Path) -> Iterator[tuple[GatewayProcess, _RecordingCell]]:
    cell = _RecordingCell()
    threading.Thread(target=cell.serve_forever, daemon=True).start()
    g = GatewayProcess(tmp_path / "recording-gw.log", [cell.url], "--api-key", GATEWAY_KEY, "--cell-api-key", CELL_KEY)
    try:
        g.wait_ready()
        yield g, cell
    finally:
        g.stop()
        cell.shutdown()
        cell.server_close()


def test_the_cell_key_goes_only_with_authenticated_requests(
        recording_gateway: tuple[GatewayProcess, _RecordingCell]) -> None:
    """What reaches a cell, recorded there: a data-plane request carries no X-API-KEY at all (on
    256c5b0 any X-API-KEY a client sent was swapped for the cell key), and the routing the gateway
    decided; a control-plane request with a wrong key reaches nothing; with the gateway's key it
    carries the cell key and only it."""
    g, cell = recording_gateway
    sid = "rcrdaaaa" + "k" * 20
    data_plane = {
        "by header": {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49999"},
        "by Host": {"Host": f"49999-{sid}.localhost"},
        "by Host in capitals": {"Host": f"49999-{sid.upper()}.localhost"},
    }
    for name, headers in data_plane.items():
        for key in ("junk", GATEWAY_KEY, CELL_KEY):
            cell.requests.clear()
            r = httpx.get(g.url + "/sandboxes", headers={**headers, "X-API-KEY": key}, timeout=10)
            assert r.status_code == 200 and len(cell.requests) == 1, (name, r.status_code, r.text)
            got = cell.requests[0][2]
            assert [v for k, v in got if k == "x-api-key"] == [], f"{name}: the cell got an X-API-KEY: {got}"
            assert [(k, v) for k, v in got if k.startswith("e2b-sandbox-")] == [
                ("e2b-sandbox-id", sid), ("e2b-sandbox-port", "49999")], f"{name}: {got}"
    for key in (None, "junk", CELL_KEY):
        cell.requests.clear()
        for method, path in (("GET", "/v2/sandboxes"), ("POST", "/v2/sandboxes"), ("DELETE", f"/sandboxes/{sid}"),
                             ("GET", "/anything")):
            r = httpx.request(method, g.url + path, headers={"X-API-KEY": key} if key else {},
                              json={"templateID": "base"} if method == "POST" else None, timeout=10)
            assert r.status_code == 401, (method, path, key, r.status_code)
        assert cell.requests == [], f"an unauthenticated request reached the cell: {cell.requests}"
    cell.requests.clear()
    assert httpx.get(g.url + "/anything", headers={"X-API-KEY": GATEWAY_KEY}, timeout=10).status_code == 200
    assert [v for k, v in cell.requests[0][2] if k == "x-api-key"] == [CELL_KEY]
    # an id-less signed /files: the cells are asked with the cell key and only the URL's query; the
    # request itself goes nowhere when no cell's sandbox signed it
    cell.requests.clear()
    r = httpx.post(g.url + "/files?path=/tmp/x&signature=v1_forged", content=b"data",
                   headers={"X-API-KEY": "junk", "X-Access-Token": "stolen"}, timeout=10)
    assert r.status_code == 401 and r.json()["message"] == "invalid signature"
    assert [(m, urlsplit(p).path) for m, p, _ in cell.requests] == [("GET", "/v1/cell/file-signer/write")]
    asked = dict(cell.requests[0][2])
    assert asked.get("x-api-key") == CELL_KEY and "x-access-token" not in asked
    assert dict(parse_qsl(urlsplit(cell.requests[0][1]).query)) == {"path": "/tmp/x", "signature": "v1_forged"}


def test_routing_has_one_reading() -> None:
    """The parser the gateway, the cell and the Origin check share (imported here: new in issue 25)."""
    from agentcell.server.routing import RoutingError, SandboxTarget, target

    sid = "attkaaaa" + "a" * 20

    def scope(*headers: tuple[str, str]) -> dict[str, Any]:
        return {"headers": [(k.lower().encode(), v.encode("latin-1")) for k, v in headers]}

    same = {
        SandboxTarget(sid, 49983): [
            scope(("Host", f"49983-{sid}.localhost")), scope(("Host", f"49983-{sid.upper()}.LocalHost")),
            scope(("Host", f"49983-{sid}.localhost.")), scope(("Host", f"49983-{sid}.example.com:8080")),
            scope(("Host", "localhost"), ("E2b-Sandbox-Id", sid)), scope(("E2b-Sandbox-Id", f" {sid.upper()} ")),
            scope(("E2b-Sandbox-Id", sid), ("E2b-Sandbox-Port", "49983"), ("Host", f"49983-{sid}.localhost")),
        ],
        SandboxTarget(sid, 8000): [scope(("Host", f"8000-{sid}.localhost")),
                                   scope(("E2b-Sandbox-Id", sid), ("E2b-Sandbox-Port", "8000"))],
        # no TCP port, but a sandbox's: its cell answers E2B's 502 "port is not open"
        SandboxTarget(sid, 0): [scope(("Host", f"0-{sid}.localhost")),
                                scope(("E2b-Sandbox-Id", sid), ("E2b-Sandbox-Port", "0"))],
        SandboxTarget(sid, 70000): [scope(("Host", f"70000-{sid}.localhost")),
                                    scope(("E2b-Sandbox-Id", sid), ("E2b-Sandbox-Port", "70000"))],
        None: [scope(("Host", "localhost:49982")), scope(("Host", "127.0.0.1")), scope(("Host", "[::1]:80")),
               scope(("Host", f"1-{sid}")), scope(("Host", f"1-{sid}.")), scope(("Host", f"1-{sid}.x@localhost")),
               scope(("Host", f"1-{sid}.local host")), scope(("Host", f"1-{sid}_x.localhost")),
               scope(("Host", f"1-2-{sid}.localhost")), scope()],
    }
    for want, scopes in same.items():
        for s in scopes:
            assert target(s) == want, s
    refused = [
        scope(("Host", f"049983-{sid}.localhost")), scope(("Host", f"00-{sid}.localhost")),
        scope(("Host", f"{'9' * 11}-{sid}.localhost")), scope(("Host", f"1-{'a' * 65}.localhost")),
        scope(("E2b-Sandbox-Id", "")), scope(("E2b-Sandbox-Id", "a b")), scope(("E2b-Sandbox-Id", "a/../b")),
        scope(("E2b-Sandbox-Id", "a" * 65)), scope(("E2b-Sandbox-Port", "49983")),
        scope(("E2b-Sandbox-Id", sid), ("E2b-Sandbox-Port", "x")), scope(("E2b-Sandbox-Id", sid), ("E2b-Sandbox-Port", "-1")),
        scope(("E2b-Sandbox-Id", sid), ("E2b-Sandbox-Port", "+80")),
        scope(("E2b-Sandbox-Id", sid), ("E2b-Sandbox-Id", sid)), scope(("Host", "localhost"), ("Host", "localhost")),
        scope(("E2b-Sandbox-Id", sid), ("Host", f"49983-{'b' * 28}.localhost")),
        scope(("E2b-Sandbox-Id", sid), ("Host", f"8000-{sid}.localhost")),
    ]
    for s in refused:
        with pytest.raises(RoutingError):
            target(s)


# --- memory and deadlines -------------------------------------------------------------------------------


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    with contextlib.suppress(OSError):
        sock.sendall(data)


def _stall(port: int, payloads: list[bytes], wait: float) -> list[tuple[int, float | None]]:
    """Each payload sent on a connection of its own (a request whose body lacks its end), all at once;
    then every connection read until the server answers and closes, or `wait` seconds pass. For each:
    (its status, 0 if none; seconds from the start until its answer, None if none)."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in payloads]
    senders = [threading.Thread(target=_send_quietly, args=(s, p), daemon=True) for s, p in zip(socks, payloads, strict=True)]
    start = time.monotonic()
    for t in senders:
        t.start()
    got = {s.fileno(): b"" for s in socks}
    answered: dict[int, float] = {}
    poller = select.poll()
    by_fd = {s.fileno(): s for s in socks}
    for s in socks:
        poller.register(s, select.POLLIN)
    try:
        while by_fd and time.monotonic() - start < wait:
            for fd, _ in poller.poll(100):
                try:
                    chunk = by_fd[fd].recv(65536, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                except OSError:
                    chunk = b""
                if chunk:
                    got[fd] += chunk
                    answered.setdefault(fd, time.monotonic() - start)
                else:
                    poller.unregister(fd)
                    del by_fd[fd]
        return [(status_of(got[s.fileno()]), answered.get(s.fileno())) for s in socks]
    finally:
        for s in socks:
            s.close()
        for t in senders:
            t.join(10)


def _files_head(query: str, length: int) -> bytes:
    return request_head("POST", f"/files?{query}", {"Host": "localhost", "Content-Type": "application/octet-stream",
                                                     "Content-Length": str(length)})


def _token(gateway: GatewayProcess, sandbox_id: str) -> str:
    r = httpx.get(f"{gateway.url}/sandboxes/{sandbox_id}", headers={"X-API-KEY": GATEWAY_KEY}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["envdAccessToken"]


def _signed_write(token: str, path: str, expiration: int | None = None) -> str:
    """The query of a signed upload URL for `path`, as the SDKs make it."""
    query = {"path": path, "username": "user", "signature": signature(path, "write", "user", token, expiration)}
    if expiration is not None:
        query["signature_expiration"] = str(expiration)
    return urlencode(query)


@pytest.fixture(scope="module")
def attacker(cells: list[ServerProcess], gateway: GatewayProcess) -> Iterator[Sandbox]:
    """The attacker's own sandbox: its signed upload URLs are valid."""
    sbx = Sandbox.create(api_url=gateway.url, api_key=GATEWAY_KEY, timeout=1800)
    yield sbx
    with contextlib.suppress(Exception):
        sbx.kill()


def test_stalled_uploads_with_a_forged_signature_are_refused_unread(gateway: GatewayProcess, unharmed: None) -> None:
    """40 id-less uploads of 16 MiB with a signature nobody made, each stalled one byte short: the
    gateway answers 401 at once, having read none of it. On 256c5b0 it read and held every one (16 MiB
    each, no deadline, no budget: +600 MiB) and answered none."""
    pid = gateway.proc.pid
    reset_peak(pid)
    base = mem_kib(pid)
    head = _files_head("path=/home/user/x&signature=v1_forged&username=user", 16 * MIB)
    payload = head + b"\0" * (16 * MIB - 1)
    answers = _stall(gateway.port, [payload] * 40, wait=BODY_TIMEOUT + 30)
    grew_mib = (mem_kib(pid, "VmHWM") - base) / 1024
    print(f"\n40 stalled forged uploads of 16 MiB: gateway peak RSS {base / 1024:.0f} MiB +{grew_mib:.1f} MiB; "
          f"answers {sorted({a for a, _ in answers})} within {max((t or 99) for _, t in answers):.1f} s")
    assert [a for a, _ in answers] == [401] * 40, answers
    assert grew_mib < 48, f"the gateway's peak RSS grew by {grew_mib:.1f} MiB"


def test_stalled_signed_uploads_get_408_at_the_deadline(gateway: GatewayProcess, attacker: Sandbox,
                                                        unharmed: None) -> None:
    """10 id-less uploads of 16 MiB with the attacker's valid signature, each stalled one byte short:
    streamed to the cell, then 408 from the gateway once the body stops for --body-timeout. On 256c5b0
    the gateway held all of them (no deadline) and answered none."""
    pid = gateway.proc.pid
    token = _token(gateway, attacker.sandbox_id)
    payloads = [_files_head(_signed_write(token, f"/tmp/stalled-{i}"), 16 * MIB) + b"\0" * (16 * MIB - 1)
                for i in range(10)]
    reset_peak(pid)
    base = mem_kib(pid)
    # a cell takes 8 uploads to one sandbox at once (ServerConfig.max_uploads_per_sandbox): two rounds
    answers = _stall(gateway.port, payloads, wait=4 * BODY_TIMEOUT + 60)
    grew_mib = (mem_kib(pid, "VmHWM") - base) / 1024
    took = [t for _, t in answers]
    print(f"\n10 stalled signed uploads of 16 MiB: gateway peak RSS +{grew_mib:.1f} MiB; answers "
          f"{[a for a, _ in answers]} after {[round(t, 1) if t else None for t in took]} s")
    assert [a for a, _ in answers] == [408] * 10, (answers, gateway.log()[-3000:])
    assert grew_mib < 48, f"the gateway's peak RSS grew by {grew_mib:.1f} MiB"
    assert attacker.run_code("1 + 1").text == "2"  # the cells' upload slots came back


def test_stalled_creates_stay_within_the_budget_and_deadline(gateway: GatewayProcess, unharmed: None) -> None:
    """100 keyed creates of 1 MiB, each stalled one byte short: the gateway holds at most its budget
    (8 MiB here) and answers each 408 (reading, past the deadline) or 503 (waited for the budget past
    it). On 256c5b0 it read and held all of them with no deadline and answered none."""
    pid = gateway.proc.pid
    head = request_head("POST", "/v2/sandboxes", {"Host": "localhost", "Content-Type": "application/json",
                                                    "X-API-KEY": GATEWAY_KEY, "Content-Length": str(MIB)})
    payload = head + b'{"templateID": "base", "metadata": {"x": "' + b"a" * (MIB - 60)
    reset_peak(pid)
    base = mem_kib(pid)
    answers = _stall(gateway.port, [payload] * 100, wait=BODY_TIMEOUT * 3 + 30)
    grew_mib = (mem_kib(pid, "VmHWM") - base) / 1024
    slowest = max((t or 999) for _, t in answers)
    print(f"\n100 stalled 1 MiB creates: gateway peak RSS +{grew_mib:.1f} MiB; answers "
          f"{ {a: [x for x, _ in answers].count(a) for a in {x for x, _ in answers}} }, the last after {slowest:.1f} s")
    assert {a for a, _ in answers} <= {408, 503} and all(t is not None for _, t in answers), answers
    assert slowest < BODY_TIMEOUT * 3 + 15
    assert grew_mib < 40, f"the gateway's peak RSS grew by {grew_mib:.1f} MiB"


# --- id-less signed files still work, streamed ----------------------------------------------------------


def test_a_signed_upload_beyond_16_mib_streams_through(gateway: GatewayProcess, unharmed: None) -> None:
    """The official e2b SDK's upload_url()/download_url() under E2B_SANDBOX_URL name no sandbox; 24 MiB
    (above 256c5b0's 16 MiB buffer, refused 413 there) goes through, and the gateway does not hold it."""
    from e2b import Sandbox as E2BSandbox

    from tests.helpers import e2b_pointed_at

    blob = os.urandom(24 * MIB)
    with e2b_pointed_at(gateway.url):
        sbx = E2BSandbox.create(api_key=GATEWAY_KEY, timeout=300, secure=True)
        try:
            url = sbx.upload_url("/home/user/big.bin", use_signature_expiration=600)
            assert urlsplit(url).netloc == urlsplit(gateway.url).netloc  # names no sandbox
            pid = gateway.proc.pid
            reset_peak(pid)
            base = mem_kib(pid)
            r = httpx.post(url, files={"file": ("big.bin", blob)}, timeout=300)
            grew_mib = (mem_kib(pid, "VmHWM") - base) / 1024
            assert r.status_code == 200, r.text
            print(f"\na 24 MiB signed upload through the gateway: its peak RSS +{grew_mib:.1f} MiB")
            assert grew_mib < 12, f"the gateway's peak RSS grew by {grew_mib:.1f} MiB for a 24 MiB upload"
            assert sbx.files.read("/home/user/big.bin", format="bytes") == blob
            down = httpx.get(sbx.download_url("/home/user/big.bin"), timeout=300)
            assert down.status_code == 200 and down.content == blob
            # envd's refusals, as a lone server gives them
            bad = url.replace("signature=v1_", "signature=v1_A")
            assert _refusal(httpx.post(bad, content=b"x")) == (401, "invalid signature")
            no_sig = url.split("&signature=")[0]
            assert _refusal(httpx.post(no_sig, content=b"x")) == (401, "missing signature query parameter")
            token = _token(gateway, sbx.sandbox_id)
            expired = _signed_write(token, "/home/user/late.bin", int(time.time()) - 60)
            assert _refusal(httpx.post(f"{gateway.url}/files?{expired}", content=b"x")) == (
                401, "signature is already expired")
            malformed = url.replace("signature_expiration=", "signature_expiration=soon")
            assert httpx.post(malformed, content=b"x").status_code == 400
        finally:
            sbx.kill()


def _refusal(r: httpx.Response) -> tuple[int, str]:
    return r.status_code, r.json().get("message", "")
