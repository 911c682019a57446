"""The web console's server side (agentcell/console, docs/console.md) against real servers.

One `agentcell serve` with an API key and a console viewer key; a browser's part is played by httpx
(cookies, the CSRF header, Origin) and the `websockets` client (the terminal). Sign-in and the
cookie's flags, CSRF and Origin refusals, the viewer's 403s, the control-plane pass-through (list,
pause, resume, kill, attributed to the key in the record), the overview's sparklines, a detail with
its secret redacted, files up and down, code cells (stdout, a chart, state, history), the terminal
(echo, resize, exit, refusals), and a gateway serving the console across two cells.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from agentcell import Sandbox
from agentcell.backends.base import SandboxStats
from agentcell.console.sessions import SessionStore
from agentcell.server.metrics import MetricsHistory
from tests.helpers import wait_until
from tests.servers import GatewayProcess, ServerProcess
from tests.test_operations import _self_signed

KEY = "console-test-key-" + os.urandom(6).hex()
VIEWER_KEY = "console-viewer-key-" + os.urandom(6).hex()
SECRET_VALUE = "s3cret-" + os.urandom(8).hex()
RULE_VALUE = "rule-" + os.urandom(8).hex()
TRUSTED_APP = "http://app.example"  # an origin the server's API trusts (--allowed-origin); not the console's
NOWHERE = f"acconsole{os.getpid() % 100000}"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """The server; its egress uplink leads into an empty network namespace (no address, no route: nothing
    leaves the machine), so that sandboxes may have secrets (they need the egress proxy)."""
    if os.geteuid() != 0:
        pytest.skip("needs root (a network namespace)")
    log = tmp_path_factory.mktemp("console") / "server.log"
    subprocess.run(["ip", "netns", "add", NOWHERE], check=True)
    try:
        subprocess.run(["ip", "-n", NOWHERE, "link", "set", "lo", "up"], check=True)
        with ServerProcess(log, "--api-key", KEY, "--console-viewer-key", VIEWER_KEY, "--standbys", "1",
                           "--allowed-origin", TRUSTED_APP,
                           "--egress-uplink", f"netns:/run/netns/{NOWHERE}", "--egress-dns", "198.51.100.53") as srv:
            yield srv
    finally:
        subprocess.run(["ip", "netns", "del", NOWHERE], check=False)


@pytest.fixture(scope="module")
def url(server: ServerProcess) -> str:
    return server.url


def signed_in(url: str, key: str = KEY) -> tuple[httpx.Client, dict[str, Any]]:
    client = httpx.Client(base_url=url, timeout=60)
    r = client.post("/ui/api/session", json={"apiKey": key})
    assert r.status_code == 200, r.text
    return client, r.json()


@pytest.fixture(scope="module")
def admin(url: str) -> Iterator[httpx.Client]:
    client, body = signed_in(url)
    client.headers["X-CSRF-Token"] = body["csrf"]
    yield client
    client.close()


@pytest.fixture(scope="module")
def viewer(url: str) -> Iterator[httpx.Client]:
    client, body = signed_in(url, VIEWER_KEY)
    client.headers["X-CSRF-Token"] = body["csrf"]
    yield client
    client.close()


@pytest.fixture(scope="module")
def sbx(url: str) -> Iterator[Sandbox]:
    box = Sandbox.create(api_url=url, api_key=KEY, timeout=600)
    yield box
    box.kill()


def _cookie_header(client: httpx.Client) -> str:
    return "; ".join(f"{c.name}={c.value}" for c in client.cookies.jar)


def _ws_url(url: str, sandbox_id: str, query: str = "cols=80&rows=24") -> str:
    return f"ws://{urlsplit(url).netloc}/ui/api/sandboxes/{sandbox_id}/terminal?{query}"


# --- sign-in -------------------------------------------------------------------------------------


def test_sign_in_right_and_wrong_key_and_the_cookie(url: str) -> None:
    with httpx.Client(base_url=url) as c:
        r = c.get("/ui/api/session")
        assert r.status_code == 401 and r.json()["keyRequired"] is True
        r = c.post("/ui/api/session", json={"apiKey": "wrong"})
        assert r.status_code == 401 and "wrong key" in r.json()["message"]
        assert "set-cookie" not in r.headers
        r = c.post("/ui/api/session", json={"apiKey": KEY})
        assert r.status_code == 200
        body = r.json()
        assert body["role"] == "admin" and body["server"]["kind"] == "server" and body["csrf"]
        cookie = r.headers["set-cookie"]
        flags = [p.strip().lower() for p in cookie.split(";")]
        assert cookie.startswith("agentcell_console=") and "httponly" in flags and "samesite=strict" in flags
        assert "path=/ui" in flags and "secure" not in flags  # plain http here; https adds Secure
        assert KEY not in cookie and KEY not in r.text  # the page never holds the key
        assert "default-src 'self'" in r.headers["content-security-policy"]
        again = c.get("/ui/api/session")
        assert again.status_code == 200 and again.json()["csrf"] == body["csrf"]
        assert c.get("/ui/api/v/v2/sandboxes").status_code == 200
        assert c.delete("/ui/api/session", headers={"X-CSRF-Token": body["csrf"]}).status_code == 204
        assert c.get("/ui/api/session").status_code == 401
        assert c.get("/ui/api/v/v2/sandboxes").status_code == 401
    # a forged cookie is nobody
    r = httpx.get(url + "/ui/api/v/v2/sandboxes", headers={"Cookie": "agentcell_console=forged"})
    assert r.status_code == 401


def test_the_page_without_a_build_says_how_to_build_it(url: str) -> None:
    r = httpx.get(url + "/ui")
    assert r.status_code in (200, 503)
    assert "frame-ancestors 'none'" in r.headers["content-security-policy"]
    if r.status_code == 503:
        assert "scripts/build-console" in r.text
    assert httpx.get(url + "/ui/assets/..%2f..%2f..%2fetc%2fpasswd").status_code == 404
    assert httpx.get(url + "/ui/assets/none.js").status_code == 404


def test_unsafe_calls_need_the_csrf_token_and_our_origin(url: str, admin: httpx.Client, sbx: Sandbox) -> None:
    bare = {k: v for k, v in admin.headers.items() if k.lower() != "x-csrf-token"}
    r = admin.post(f"/ui/api/v/sandboxes/{sbx.sandbox_id}/timeout", json={"timeout": 600},
                   headers={"X-CSRF-Token": ""})
    assert r.status_code == 403 and "CSRF" in r.json()["message"]
    r = httpx.post(url + f"/ui/api/v/sandboxes/{sbx.sandbox_id}/timeout", json={"timeout": 600},
                   headers={k: v for k, v in bare.items() if k.lower() not in ("content-length", "host")},
                   cookies=admin.cookies)
    assert r.status_code == 403
    for origin in ("http://evil.example", TRUSTED_APP):  # refused by the Host/Origin rules; by the console
        r = admin.post(f"/ui/api/v/sandboxes/{sbx.sandbox_id}/timeout", json={"timeout": 600},
                       headers={"Origin": origin})
        assert r.status_code == 403, origin
    r = admin.post(f"/ui/api/v/sandboxes/{sbx.sandbox_id}/timeout", json={"timeout": 600},
                   headers={"Origin": url})
    assert r.status_code == 204, r.text
    # sign-in from another site's page: refused too
    for origin in ("http://evil.example", TRUSTED_APP):
        r = httpx.post(url + "/ui/api/session", json={"apiKey": KEY}, headers={"Origin": origin})
        assert r.status_code == 403 and "set-cookie" not in r.headers, origin


def test_a_viewer_reads_but_cannot_act(url: str, viewer: httpx.Client, sbx: Sandbox) -> None:
    assert viewer.get("/ui/api/session").json()["role"] == "viewer"
    ids = [s["sandboxID"] for s in viewer.get("/ui/api/v/v2/sandboxes").json()]
    assert sbx.sandbox_id in ids
    one = viewer.get(f"/ui/api/v/sandboxes/{sbx.sandbox_id}")
    assert one.status_code == 200 and "envdAccessToken" not in one.json() and "trafficAccessToken" not in one.json()
    assert viewer.get(f"/ui/api/sandboxes/{sbx.sandbox_id}/files").status_code == 200
    refused = [
        viewer.delete(f"/ui/api/v/sandboxes/{sbx.sandbox_id}"),
        viewer.post(f"/ui/api/v/sandboxes/{sbx.sandbox_id}/pause", json={}),
        viewer.post(f"/ui/api/sandboxes/{sbx.sandbox_id}/code", json={"code": "1"}),
        viewer.post(f"/ui/api/sandboxes/{sbx.sandbox_id}/file", params={"path": "/home/user/v"}, content=b"x"),
    ]
    for r in refused:
        assert r.status_code == 403 and r.json()["message"].startswith("read-only session"), r.text
    assert sbx.is_running()
    with pytest.raises(InvalidStatus) as refused_ws:
        asyncio.run(_open(url, sbx.sandbox_id, viewer))
    assert refused_ws.value.response.status_code == 403


def test_the_report_may_be_framed_by_the_console_only(admin: httpx.Client, sbx: Sandbox) -> None:
    for fmt in ({}, {"format": "html"}):
        r = admin.get(f"/ui/api/v/sandboxes/{sbx.sandbox_id}/report", params=fmt)
        assert r.status_code in (200, 400), r.text  # (400: a server without the HTML report yet)
        csp = r.headers["content-security-policy"]
        ancestors = [d.strip() for d in csp.split(";") if d.strip().startswith("frame-ancestors")]
        assert ancestors == ["frame-ancestors 'self'"], csp
        assert "x-frame-options" not in r.headers and r.headers["cache-control"] == "no-store"
    assert "frame-ancestors 'none'" in admin.get("/ui/api/overview").headers["content-security-policy"]


# --- the control plane ---------------------------------------------------------------------------


def test_pass_through_list_pause_resume_kill(url: str, admin: httpx.Client) -> None:
    box = Sandbox.create(api_url=url, api_key=KEY, timeout=300)
    sid = box.sandbox_id
    try:
        listed = admin.get("/ui/api/v/v2/sandboxes", params={"state": "running,paused"})
        assert listed.status_code == 200 and sid in [s["sandboxID"] for s in listed.json()]
        assert admin.post(f"/ui/api/v/sandboxes/{sid}/pause", json={}).status_code == 204
        paused = admin.get("/ui/api/v/v2/sandboxes", params={"state": "paused"}).json()
        assert sid in [s["sandboxID"] for s in paused]
        r = admin.post(f"/ui/api/v/sandboxes/{sid}/resume", json={})
        assert r.status_code in (200, 201), r.text
        assert "envdAccessToken" not in r.json()
        assert admin.delete(f"/ui/api/v/sandboxes/{sid}").status_code == 204
        assert sid not in [s["sandboxID"] for s in admin.get("/ui/api/v/v2/sandboxes").json()]
        # the record says which key acted, as for any client
        events = httpx.get(f"{url}/sandboxes/{sid}/events", headers={"X-API-KEY": KEY}).text.splitlines()
        calls = [json.loads(e) for e in events if '"api.call"' in e]
        pauses = [e for e in calls if e.get("action") == "sandbox.pause"]
        assert pauses and pauses[0]["key_id"].startswith("key:"), calls
    finally:
        box.kill()


def test_overview_has_sparklines_from_kept_samples(admin: httpx.Client, sbx: Sandbox) -> None:
    def mine() -> dict[str, Any] | None:
        r = admin.get("/ui/api/overview")
        assert r.status_code == 200
        return next((s for s in r.json()["sandboxes"] if s["sandboxID"] == sbx.sandbox_id), None)

    wait_until("two metrics samples of the sandbox", lambda: (m := mine()) is not None and len(m["cpu"]) >= 2,
               timeout=30)
    item = mine()
    assert item is not None and item["state"] == "running" and item["templateID"]
    assert len(item["cpu"]) == len(item["mem"]) <= 30 and all(m > 0 for m in item["mem"])
    assert admin.get("/ui/api/overview").json()["truncated"] is False


def test_the_sparklines_are_the_newest_kept_samples() -> None:
    """MetricsHistory.last (the overview's read of a sandbox's ring) against its full scan, before and
    after the ring wraps."""
    for total in (5, 30, 719, 720, 725, 1500):
        history = MetricsHistory(0.0)
        for i in range(total):
            history.add(float(i + 1), SandboxStats(memory_bytes=i, memory_limit_bytes=1, cpu_seconds=i / 2, pids=1), 1)
        every = history.between(0, math.inf)
        for n in (1, 30, 800):
            flat = history.last(n)
            assert [tuple(flat[j:j + 5]) for j in range(0, len(flat), 5)] == every[-n:], (total, n)


def test_detail_redacts_secrets(url: str, admin: httpx.Client) -> None:
    created = httpx.post(url + "/sandboxes", headers={"X-API-KEY": KEY}, timeout=60, json={
        "templateID": "base", "timeout": 120, "envVars": {"PLAIN": "visible-value"},
        "secrets": {"MY_TOKEN": {"value": SECRET_VALUE, "hosts": ["api.example.com"]}},
        "network": {"rules": {"rules.example.com": [{"transform": {"headers": {"X-Rule-Token": RULE_VALUE}}}]}}})
    assert created.status_code == 201, created.text
    sid = created.json()["sandboxID"]
    try:
        r = admin.get(f"/ui/api/sandboxes/{sid}/detail")
        assert r.status_code == 200, r.text
        d = r.json()
        assert d["envVars"]["PLAIN"] == "visible-value" and d["envVars"]["MY_TOKEN"] == "•••"
        assert d["network"]["secrets"] == {"MY_TOKEN": {"hosts": ["api.example.com"]}} or "MY_TOKEN" in d["network"]["secrets"]
        assert d["sandbox"]["sandboxID"] == sid and d["limits"]["memoryMB"] > 0
        assert "rules.example.com" in json.dumps(d["network"]["rules"]) and "X-Rule-Token" in r.text
        assert SECRET_VALUE not in r.text and RULE_VALUE not in r.text
        assert created.json()["envdAccessToken"] not in r.text
        assert admin.get("/ui/api/sandboxes/nosuchsandbox/detail").status_code == 404
    finally:
        httpx.delete(f"{url}/sandboxes/{sid}", headers={"X-API-KEY": KEY})


def test_health(admin: httpx.Client, sbx: Sandbox) -> None:
    h = admin.get("/ui/api/health").json()
    assert h["kind"] == "server" and h["sandboxes"]["running"] >= 1 and h["sandboxes"]["max"] >= 1
    assert "record" in h and h["record"]["events"] > 0 and h["version"]
    assert h["egress"]["uplink"].startswith("netns:"), h["egress"]
    before = h["egress"]["refused"]
    sbx.commands.run("python3 -c \"import socket; s = socket.socket(); s.settimeout(2); s.connect_ex(('169.254.169.254', 80))\"")
    deadline = time.monotonic() + 15
    while admin.get("/ui/api/health").json()["egress"]["refused"] <= before:  # the metadata address: refused
        assert time.monotonic() < deadline, "the refused connection never reached the health page"
        time.sleep(0.3)


# --- files and code ------------------------------------------------------------------------------


def test_files_upload_list_download(admin: httpx.Client, sbx: Sandbox) -> None:
    data = os.urandom(300_000)
    r = admin.post(f"/ui/api/sandboxes/{sbx.sandbox_id}/file", params={"path": "/home/user/up.bin"}, content=data)
    assert r.status_code == 200, r.text
    assert r.json() == {"path": "/home/user/up.bin", "size": len(data)}
    assert sbx.files.read("/home/user/up.bin", format="bytes") == data
    listing = admin.get(f"/ui/api/sandboxes/{sbx.sandbox_id}/files", params={"path": "/home/user"}).json()
    entry = next(e for e in listing["entries"] if e["name"] == "up.bin")
    assert entry["type"] == "file" and entry["size"] == len(data) and entry["path"] == "/home/user/up.bin"
    down = admin.get(f"/ui/api/sandboxes/{sbx.sandbox_id}/file", params={"path": "/home/user/up.bin"})
    assert down.status_code == 200 and down.content == data
    assert down.headers["content-disposition"].startswith("attachment")
    missing = admin.get(f"/ui/api/sandboxes/{sbx.sandbox_id}/file", params={"path": "/home/user/none"})
    assert missing.status_code == 404


def _cell(admin: httpx.Client, sandbox_id: str, code: str) -> list[dict[str, Any]]:
    r = admin.post(f"/ui/api/sandboxes/{sandbox_id}/code", json={"code": code, "language": "python"})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("application/x-ndjson")
    lines = [json.loads(line) for line in r.text.splitlines() if line]
    assert lines[-1]["type"] == "end"
    return lines


def test_code_cells_stream_keep_state_and_history(admin: httpx.Client, sbx: Sandbox) -> None:
    out = _cell(admin, sbx.sandbox_id, "print(1)")
    assert {"type": "stdout", "text": "1\n"} in out
    _cell(admin, sbx.sandbox_id, "x = 41")
    results = [o for o in _cell(admin, sbx.sandbox_id, "x + 1") if o["type"] == "result"]
    assert results and results[0]["text"] == "42" and results[0]["is_main_result"] is True
    chart = _cell(admin, sbx.sandbox_id, "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()")
    pngs = [o for o in chart if o["type"] == "result" and o.get("png")]
    assert pngs and pngs[0]["png"].startswith("iVBORw0KGgo")  # base64 of the PNG signature
    err = [o for o in _cell(admin, sbx.sandbox_id, "1/0") if o["type"] == "error"]
    assert err and err[0]["name"] == "ZeroDivisionError"
    history = admin.get(f"/ui/api/sandboxes/{sbx.sandbox_id}/code/history").json()["cells"]
    assert [c["code"] for c in history[-5:]] == ["print(1)", "x = 41", "x + 1", chart_code(), "1/0"]
    assert history[-3]["outputs"][0]["text"] == "42"


def chart_code() -> str:
    return "import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [3, 1, 2])\nplt.show()"


# --- the terminal --------------------------------------------------------------------------------


async def _open(url: str, sandbox_id: str, client: httpx.Client | None, origin: str | None = "same",
                query: str = "cols=80&rows=24") -> Any:
    headers = {"Cookie": _cookie_header(client)} if client is not None else {}
    return await connect(_ws_url(url, sandbox_id, query), additional_headers=headers,
                         origin=url if origin == "same" else origin, open_timeout=30)  # type: ignore[arg-type]


async def _read_until(ws: Any, needle: bytes, timeout: float = 20) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout
    while needle not in seen:
        chunk = await asyncio.wait_for(ws.recv(), max(0.1, deadline - time.monotonic()))
        seen += chunk if isinstance(chunk, bytes) else chunk.encode()
    return seen


async def _terminal_session(url: str, sandbox_id: str, admin: httpx.Client) -> int | None:
    ws = await _open(url, sandbox_id, admin, query="cols=90&rows=30")
    await ws.send("echo hello-$((6*7))\r")
    await _read_until(ws, b"hello-42")
    await ws.send("stty size\r")
    await _read_until(ws, b"30 90")
    await ws.send(json.dumps({"resize": [120, 40]}))
    await ws.send(b"stty size; pwd; whoami\r")
    seen = await _read_until(ws, b"40 120\r\n/home/user\r\nuser\r\n")
    assert b"40 120" in seen
    await ws.send("exit\r")
    try:
        while True:
            await asyncio.wait_for(ws.recv(), 20)
    except ConnectionClosed as e:
        return e.rcvd.code if e.rcvd else None


def test_terminal_echo_resize_and_exit(url: str, admin: httpx.Client, sbx: Sandbox) -> None:
    assert asyncio.run(_terminal_session(url, sbx.sandbox_id, admin)) == 1000


def test_terminal_refusals(url: str, admin: httpx.Client, sbx: Sandbox) -> None:
    for client, origin, status in ((admin, "http://evil.example", 403), (admin, TRUSTED_APP, 403), (admin, None, 403),
                                   (None, "same", 401)):
        with pytest.raises(InvalidStatus) as refused:
            asyncio.run(_open(url, sbx.sandbox_id, client, origin))
        assert refused.value.response.status_code == status
    with pytest.raises(InvalidStatus) as gone:
        asyncio.run(_open(url, "nosuchsandbox", admin))
    assert gone.value.response.status_code == 404


def test_terminal_closes_1011_when_the_sandbox_goes(url: str, admin: httpx.Client) -> None:
    box = Sandbox.create(api_url=url, api_key=KEY, timeout=300)

    async def run() -> int | None:
        ws = await _open(url, box.sandbox_id, admin)
        await ws.send("echo ready-$((1+1))\r")
        await _read_until(ws, b"ready-2")
        await asyncio.to_thread(box.kill)
        try:
            while True:
                await asyncio.wait_for(ws.recv(), 20)
        except ConnectionClosed as e:
            return e.rcvd.code if e.rcvd else None

    assert asyncio.run(run()) == 1011


def _rss_mib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) // 1024 for line in f if line.startswith("VmRSS:"))


def test_a_terminal_that_is_not_read_does_not_grow_the_server(server: ServerProcess, admin: httpx.Client,
                                                              sbx: Sandbox) -> None:
    """A shell printing as fast as it can (~10 MB/s read through the console here) to a client that
    reads nothing for 8 s: the server's memory stays put (the PTY's reading pauses), then the output
    flows again once the client reads."""

    async def run() -> tuple[int, int, int]:
        ws = await connect(_ws_url(server.url, sbx.sandbox_id), additional_headers={
            "Cookie": _cookie_header(admin)}, origin=server.url, max_queue=2, close_timeout=1)  # type: ignore[arg-type]
        await ws.send("cat /dev/urandom | base64\r")
        await asyncio.sleep(1)
        before = _rss_mib(server.pid)
        await asyncio.sleep(8)
        after = _rss_mib(server.pid)
        got, started = 0, time.monotonic()
        while time.monotonic() - started < 2:
            got += len(await asyncio.wait_for(ws.recv(), 10))
        await ws.send("\x03")
        await ws.close()
        return before, after, got

    before, after, got = asyncio.run(run())
    assert after - before < 40, (before, after)  # unbounded, it would have taken ~80 MB in 8 s
    assert got > 1_000_000  # and it was producing all along


def test_over_tls_the_cookie_is_secure(tmp_path: Path) -> None:
    cert, key = _self_signed(tmp_path)
    trust = ssl.create_default_context(cafile=str(cert))
    with ServerProcess(tmp_path / "server.log", "--api-key", KEY, "--standbys", "0", "--tls-cert", str(cert),
                       "--tls-key", str(key), tls=trust, env={"AGENTCELL_EGRESS_UPLINK": "none"}) as srv:
        r = httpx.post(srv.url + "/ui/api/session", json={"apiKey": KEY}, verify=trust)
        assert r.status_code == 200
        assert "secure" in [p.strip().lower() for p in r.headers["set-cookie"].split(";")]


def test_the_session_store_is_bounded_and_expires() -> None:
    store = SessionStore(max_sessions=3, idle_s=0.2)
    ids = [store.create("admin")[0] for _ in range(4)]
    assert len(store) == 3 and store.get(ids[0]) is None and store.get(ids[3]) is not None
    assert store.get(ids[1]) is not None  # used: now the most recent
    store.create("admin")
    assert store.get(ids[2]) is None and store.get(ids[1]) is not None  # the least recently used went
    viewers = [store.create("viewer")[0] for _ in range(5)]  # a viewer signing in again and again ...
    assert all(store.get(i) is not None for i in (ids[1], ids[3]))  # ... pushes out no admin
    assert len(store) == 6 and store.get(viewers[0]) is None and store.get(viewers[4]) is not None
    time.sleep(0.3)
    assert store.get(ids[1]) is None and len(store) <= 5  # idle past idle_s
    store.forget(ids[3])
    assert store.get(ids[3]) is None


def test_a_viewer_key_that_is_the_api_key_is_refused() -> None:
    for command in ("serve", "gateway"):
        extra = ("--cell", "http://127.0.0.1:9") if command == "gateway" else ()
        done = subprocess.run([sys.executable, "-m", "agentcell", command, *extra, "--api-key", "same-key-1",
                               "--console-viewer-key", "same-key-1"], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "a viewer key must differ from it" in done.stderr, done.stderr


def test_no_console_leaves_ui_to_the_api(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "server.log", "--api-key", KEY, "--no-console", "--standbys", "0",
                       env={"AGENTCELL_EGRESS_UPLINK": "none"}) as srv:
        r = httpx.post(srv.url + "/ui/api/session", json={"apiKey": KEY})
        assert r.status_code == 401 and "set-cookie" not in r.headers  # the control plane's key check
        assert httpx.get(srv.url + "/ui", headers={"X-API-KEY": KEY}).status_code == 404


# --- the gateway ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[GatewayProcess, list[ServerProcess]]]:
    logs: Path = tmp_path_factory.mktemp("console-gw")
    cells = [ServerProcess(logs / f"{cid}.log", "--cell-id", cid, "--api-key", KEY, "--standbys", "0",
                           env={"AGENTCELL_EGRESS_UPLINK": "none"}) for cid in ("cellcona", "cellconb")]
    try:
        for c in cells:
            c.wait_ready(timeout=300)
        with GatewayProcess(logs / "gw.log", [c.url for c in cells], "--api-key", KEY) as gw:
            wait_until("both cells up at the gateway", lambda: sum(c["up"] for c in httpx.get(
                gw.url + "/v1/cells", headers={"X-API-KEY": KEY}).json()) == 2, timeout=30)
            yield gw, cells
    finally:
        for c in cells:
            c.stop()


def test_the_gateway_serves_the_console_across_cells(gateway: tuple[GatewayProcess, list[ServerProcess]]) -> None:
    gw, cells = gateway
    boxes = [Sandbox.create(api_url=c.url, api_key=KEY, timeout=300) for c in cells]
    try:
        client, body = signed_in(gw.url)
        client.headers["X-CSRF-Token"] = body["csrf"]
        assert body["server"]["kind"] == "gateway"
        listed = [s["sandboxID"] for s in client.get("/ui/api/v/v2/sandboxes").json()]
        assert all(b.sandbox_id in listed for b in boxes), listed
        overview = [s["sandboxID"] for s in client.get("/ui/api/overview").json()["sandboxes"]]
        assert all(b.sandbox_id in overview for b in boxes), overview
        second = boxes[1].sandbox_id
        assert client.get(f"/ui/api/sandboxes/{second}/detail").json()["sandbox"]["sandboxID"] == second
        assert client.get("/ui/api/health").json()["sandboxes"]["running"] >= 2
        out = _cell(client, second, "print('on', 'b')")
        assert {"type": "stdout", "text": "on b\n"} in out

        async def term() -> bytes:
            ws = await _open(gw.url, second, client)
            await ws.send("echo cell-$((40+2))\r")
            seen = await _read_until(ws, b"cell-42")
            await ws.close()
            return seen

        assert b"cell-42" in asyncio.run(term())
        assert client.delete(f"/ui/api/v/sandboxes/{boxes[0].sandbox_id}").status_code == 204
        client.close()
    finally:
        for b in boxes:
            b.kill()


def test_wrong_keys_are_throttled_per_address(url: str, admin: httpx.Client) -> None:
    """Last in the module: it leaves 127.0.0.1 unable to sign in for a minute."""
    with httpx.Client(base_url=url) as c:
        answers = [c.post("/ui/api/session", json={"apiKey": "guess"}).status_code for _ in range(11)]
        assert 401 in answers and answers[-1] == 429, answers  # (earlier tests' wrong keys count too)
        assert answers.index(429) <= 10 and set(answers[answers.index(429):]) == {429}, answers
        r = c.post("/ui/api/session", json={"apiKey": KEY})  # even the right key, now
        assert r.status_code == 429 and "too many wrong keys" in r.json()["message"], r.text
        assert "set-cookie" not in r.headers
    assert admin.get("/ui/api/session").status_code == 200  # a session signed in before keeps working
