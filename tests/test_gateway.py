"""`agentcell gateway` in front of three real cells (docs/gateway.md), all on loopback.

Three `agentcell serve --cell-id` processes (own state dirs, automatic disjoint uid ranges, no uplink,
one standby; the third holds at most one sandbox) and two gateways with static discovery. Through a
gateway: agentcell's SDK and the official e2b / e2b-code-interpreter SDKs, streams, files, a port and a
WebSocket; placement and overflow; list merged; snapshots (a create from one lands on its cell, the
listing pages over every cell, a delete finds its cell) and fork; then the failures, the destructive ones last: a stopped
cell, a killed gateway, a draining cell, a killed cell. The Kubernetes adapter is tested against a
local fake API server that plays a recorded EndpointSlice list and watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from agentcell import Sandbox
from agentcell.gateway.cells import STATES
from agentcell.server.auth import signature
from agentcell.server.cell import CELL_ID_LEN, normalise_cell_id
from tests.helpers import e2b_pointed_at, wait_until
from tests.servers import GatewayProcess, ServerProcess, free_port

CELL_IDS = ("cellaaaa", "cellbbbb", "cellcccc")  # the third: --max-sandboxes 1
PORT_SERVER = (Path(__file__).parent / "port_server.py").read_text()


@pytest.fixture(scope="module")
def cells(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServerProcess]]:
    logs = tmp_path_factory.mktemp("cells")
    procs = [ServerProcess(logs / f"{cid}.log", "--cell-id", cid, "--standbys", "1", "--drain-grace", "60",
                           "--create-backends", "gvisor",  # a sandbox to fork (memory) where a create asks for it
                           *(("--max-sandboxes", "1") if cid == CELL_IDS[2] else ()),
                           env={"AGENTCELL_EGRESS_UPLINK": "none"}) for cid in CELL_IDS]
    try:
        for p in procs:
            p.wait_ready(timeout=300)  # they start together; a busy machine makes it slow (idle: seconds)
        yield procs
    finally:
        for p in procs:
            if p.proc.poll() is None:
                os.kill(p.pid, signal.SIGCONT)  # a test stopped it
                p.proc.send_signal(signal.SIGINT)  # no drain: stop now
            p.stop()


@pytest.fixture(scope="module")
def gateways(cells: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[GatewayProcess]]:
    logs = tmp_path_factory.mktemp("gateways")
    gws = [GatewayProcess(logs / f"gw{i}.log", [c.url for c in cells]) for i in range(2)]
    try:
        for g in gws:
            g.wait_ready()
        wait_until("every cell up at both gateways", lambda: all(len(g.cells()) == 3 and all(
            c["up"] for c in g.cells().values()) for g in gws))
        yield gws
    finally:
        for g in gws:
            g.stop()


@pytest.fixture(scope="module")
def gw(gateways: list[GatewayProcess]) -> str:
    return gateways[0].url


def _cell_of(sandbox_id: str) -> str:
    return sandbox_id[:CELL_ID_LEN]


def _gone(r: httpx.Response, sandbox_id: str) -> bool:
    """E2B's answer for a sandbox that is not there (the SDKs look for "was not found"); the gateway may
    say more after it (that the sandbox's cell does not answer now)."""
    body = r.json()
    return (r.status_code == 502 and body["sandboxId"] == sandbox_id and body["code"] == 502
            and body["message"].startswith("The sandbox was not found"))


# --- the cell's own additions -------------------------------------------------------------------------


def test_cell_ids_are_normalised() -> None:
    assert normalise_cell_id("CellAAAA") == "cellaaaa"
    uid = "3f2a9c1e-7b4d-4e2a-9f11-0c5d2e8b7a61"  # a pod UID from the downward API: hashed to 8
    got = normalise_cell_id(uid)
    assert got is not None and len(got) == CELL_ID_LEN and got.isalnum() and got == normalise_cell_id(uid.upper())
    assert normalise_cell_id(None) is None and normalise_cell_id("") is None
    with pytest.raises(ValueError, match="8 characters"):
        normalise_cell_id("abc")


def test_v1_cell_and_prefixed_ids(cells: list[ServerProcess]) -> None:
    info = httpx.get(cells[2].url + "/v1/cell").json()
    assert info["cellId"] == CELL_IDS[2] and info["draining"] is False
    assert info["capacity"]["slots"] == 1 and info["capacity"]["maxSandboxes"] == 1
    assert {"memoryLeft", "pidsLeft"} <= set(info["capacity"]) and 0 <= info["load"] <= 1
    r = httpx.post(cells[0].url + "/v2/sandboxes", json={"templateID": "base", "timeout": 60})
    sid = r.json()["sandboxID"]
    try:
        assert sid.startswith(CELL_IDS[0]) and len(sid) == CELL_ID_LEN + 20 and sid.isalnum() and sid.islower()
        assert httpx.get(cells[0].url + "/v1/cell").json()["sandboxes"] == 1
    finally:
        httpx.delete(f"{cells[0].url}/sandboxes/{sid}")


# --- through a gateway ----------------------------------------------------------------------------------


def test_agentcell_sdk_through_the_gateway(gw: str) -> None:
    with Sandbox.create(api_url=gw, timeout=120) as sbx:
        assert _cell_of(sbx.sandbox_id) in CELL_IDS
        seen: list[tuple[float, str]] = []
        t0 = time.monotonic()
        r = sbx.run_code("import time\nfor i in range(3):\n    print(i, flush=True); time.sleep(0.3)\n41 + 1",
                         on_stdout=lambda m: seen.append((time.monotonic() - t0, str(m.line if hasattr(m, "line") else m))))
        assert r.text == "42" and len(seen) == 3
        assert seen[-1][0] - seen[0][0] > 0.4, f"the output came in one piece, not streamed: {seen}"
        chunks: list[str] = []
        out = sbx.commands.run("for i in 1 2 3; do echo line$i; sleep 0.2; done", on_stdout=chunks.append)
        assert out.exit_code == 0 and out.stdout.split() == ["line1", "line2", "line3"] and len(chunks) >= 2
        handle = sbx.commands.run("sleep 0.5; echo late", background=True)
        again = sbx.commands.connect(handle.pid)
        assert again.wait().stdout.strip() == "late"
        blob = os.urandom(3 << 20)
        sbx.files.write("/home/user/blob.bin", blob)
        assert sbx.files.read("/home/user/blob.bin", format="bytes") == blob


def test_e2b_sdks_through_the_gateway(gw: str) -> None:
    from e2b import Sandbox as E2BSandbox
    from e2b_code_interpreter import Sandbox as CISandbox

    with e2b_pointed_at(gw):
        sbx = CISandbox.create(timeout=120)
        try:
            assert _cell_of(sbx.sandbox_id) in CELL_IDS
            lines: list[str] = []
            r = sbx.run_code("for i in range(3): print('out', i)\n6 * 7", on_stdout=lambda m: lines.append(m.line))
            assert r.text == "42" and "".join(lines).splitlines() == ["out 0", "out 1", "out 2"]
            streamed: list[str] = []
            assert sbx.commands.run("echo a; sleep 0.2; echo b", on_stdout=streamed.append).stdout == "a\nb\n"
            bg = sbx.commands.run("sleep 0.3; echo bg-done", background=True)
            assert sbx.commands.connect(bg.pid).wait().stdout.strip() == "bg-done"
            sbx.files.write("/home/user/hello.txt", "hi through the gateway")
            assert sbx.files.read("/home/user/hello.txt") == "hi through the gateway"
            # a port served out of the sandbox, by Host {port}-{id}.{domain} as the SDK builds it
            sbx.files.write("/tmp/port_server.py", PORT_SERVER)
            sbx.commands.run("python /tmp/port_server.py 8000", background=True)
            host = sbx.get_host(8000)
            assert host == f"8000-{sbx.sandbox_id}.localhost:{urlsplit(gw).port}"

            def echo() -> httpx.Response | None:
                got = httpx.post(gw + "/echo?x=1", headers={"Host": host}, content=b"payload")
                return got if got.status_code == 200 else None

            assert json.loads(wait_until("the port server", echo).text)["body"] == "payload"
            big = httpx.get(gw + "/chunked?n=3000000", headers={"Host": host})
            assert big.status_code == 200 and len(big.content) == 3000000
            from websockets.sync.client import connect as ws_connect

            sock = socket.create_connection(("127.0.0.1", urlsplit(gw).port))
            with ws_connect(f"ws://{host}/ws", sock=sock, compression=None, max_size=None) as ws:
                ws.send("hello")
                assert ws.recv(timeout=10) == "hello"
                blob = os.urandom(1 << 20)
                ws.send(blob)
                assert ws.recv(timeout=10) == blob
            # the base e2b SDK too: connect to the same sandbox by id, through the gateway
            plain = E2BSandbox.connect(sbx.sandbox_id)
            assert plain.commands.run("cat /home/user/hello.txt").stdout == "hi through the gateway"
        finally:
            sbx.kill()
        assert httpx.get(f"{gw}/sandboxes/{sbx.sandbox_id}").status_code == 404


def _create(gw: str, **body: Any) -> str:
    r = httpx.post(gw + "/v2/sandboxes", json={"templateID": "base", "timeout": 120, **body}, timeout=60)
    assert r.status_code == 201, r.text
    return r.json()["sandboxID"]


def _kill_all(gw: str, ids: list[str]) -> None:
    for sid in ids:
        httpx.delete(f"{gw}/sandboxes/{sid}")


def test_creates_spread_and_list_merges(gw: str, gateways: list[GatewayProcess]) -> None:
    ids = [_create(gw, metadata={"suite": "gateway-list"}) for _ in range(6)]
    try:
        assert len({_cell_of(s) for s in ids}) >= 2, f"all creates went to one cell: {ids}"
        assert sum(_cell_of(s) == CELL_IDS[2] for s in ids) <= 1  # the full cell holds one at most
        listed = httpx.get(gateways[1].url + "/sandboxes", params={"metadata": "suite=gateway-list"}).json()
        assert sorted(x["sandboxID"] for x in listed) == sorted(ids)
        for order in ("desc", "asc"):  # v2, two at a time: one cursor over three cells
            seen: list[dict[str, Any]] = []
            token = None
            for _ in range(10):
                params = {"limit": "2", "order": order, "metadata": "suite=gateway-list", "state": "running"}
                if token:
                    params["nextToken"] = token
                r = httpx.get(gateways[token is not None].url + "/v2/sandboxes", params=params)  # either gateway
                assert r.status_code == 200, r.text
                seen += r.json()
                token = r.headers.get("x-next-token")
                if not token:
                    break
            assert [x["sandboxID"] for x in seen] == [x["sandboxID"] for x in sorted(
                seen, key=lambda x: (x["startedAt"], x["sandboxID"]), reverse=order == "desc")]
            assert sorted(x["sandboxID"] for x in seen) == sorted(ids)
        assert httpx.get(gw + "/v2/sandboxes", params={"nextToken": "!!"}).status_code == 400
    finally:
        _kill_all(gw, ids)


def test_a_full_cell_overflows_to_another(cells: list[ServerProcess], tmp_path: Path) -> None:
    """A gateway whose figures are stale (it polls once a minute) still places every create: the full
    cell's 429 sends the create on to the other cell."""
    stale = GatewayProcess(tmp_path / "stale.log", [cells[2].url, cells[0].url], "--poll-interval", "60")
    filler = None
    ids: list[str] = []
    try:
        stale.wait_ready()
        filler = _create(cells[2].url)  # the full cell is full now; the gateway still believes it has a slot
        for _ in range(8):
            ids.append(_create(stale.url))
            if stale.cells()[CELL_IDS[2]]["refusals"]:
                break
        assert stale.cells()[CELL_IDS[2]]["refusals"] == 1, "the full cell was never tried"
        assert all(_cell_of(s) == CELL_IDS[0] for s in ids)
        figures = _samples(httpx.get(stale.url + "/metrics").text)  # no key: open, as its control plane
        assert _value(figures, "agentcell_gateway_errors_total", kind="create_refused") == 1
        assert _value(figures, "agentcell_gateway_forward_seconds_count", cell=CELL_IDS[2]) == 1  # the 429
        assert _value(figures, "agentcell_gateway_forward_seconds_count", cell=CELL_IDS[0]) == len(ids)
        assert _value(figures, "agentcell_gateway_http_responses_total", route="create", status_class="2xx") == len(ids)
    finally:
        _kill_all(cells[0].url, ids)
        if filler:
            httpx.delete(f"{cells[2].url}/sandboxes/{filler}")
        stale.stop()


def test_unknown_cell_is_not_found(gw: str) -> None:
    sid = "zzzzzzzz" + "a" * 20
    assert _gone(httpx.get(gw + "/health", headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49983"}), sid)
    assert _gone(httpx.get(f"{gw}/sandboxes/{sid}"), sid)
    assert httpx.get(f"{gw}/sandboxes/{sid}").json()["message"] == "The sandbox was not found"  # no cell to name
    assert httpx.get(gw + "/v2/sandboxes", headers={"X-API-KEY": "x"}).status_code == 200


def test_the_gateway_checks_the_api_key(cells: list[ServerProcess], tmp_path: Path) -> None:
    key = "e2b_" + "ab" * 20
    keyed = GatewayProcess(tmp_path / "keyed.log", [cells[0].url], "--api-key", key)
    try:
        keyed.wait_ready()
        assert httpx.get(keyed.url + "/v2/sandboxes").status_code == 401
        assert httpx.get(keyed.url + "/v2/sandboxes", headers={"X-API-KEY": "e2b_wrong"}).status_code == 401
        assert httpx.get(keyed.url + "/v2/sandboxes", headers={"X-API-KEY": key}).status_code == 200
        assert httpx.get(keyed.url + "/health").status_code == 200  # no key: a probe
    finally:
        keyed.stop()



# --- operations: /metrics, the access log, the banner (docs/operations.md) ---------------------------------

OPS_KEY = "ops-gw-" + os.urandom(12).hex()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, by (name, sorted labels), through prometheus_client's own parser."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def _value(found: dict[Any, float], name: str, **labels: str) -> float:
    return found.get((name, tuple(sorted(labels.items()))), 0.0)


@pytest.fixture(scope="module")
def ops_gateway(cells: list[ServerProcess], tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    """A keyed gateway with JSON logs in front of two cells and an address where nothing listens."""
    nowhere = f"http://127.0.0.1:{free_port()}"
    g = GatewayProcess(tmp_path_factory.mktemp("ops-gw") / "gw.log", [cells[0].url, cells[1].url, nowhere],
                       "--api-key", OPS_KEY, "--log-format", "json", "--poll-interval", "0.2")
    try:
        g.wait_ready()
        yield g
    finally:
        g.stop()


def _scrape(g: GatewayProcess) -> dict[Any, float]:
    r = httpx.get(g.url + "/metrics", headers={"Authorization": f"Bearer {OPS_KEY}"}, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain; version=")
    return _samples(r.text)


def test_gateway_metrics_need_its_key(ops_gateway: GatewayProcess) -> None:
    url = ops_gateway.url + "/metrics"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"X-API-KEY": "wrong"}).status_code == 401
    assert httpx.get(url, headers={"Authorization": "Bearer wrong"}).status_code == 401
    own = httpx.get(url, headers={"Authorization": f"Bearer {OPS_KEY}"})  # what Prometheus's `authorization:` sends
    assert own.status_code == 200 and "agentcell_gateway_cells" in own.text  # the gateway's figures, not a cell's
    assert httpx.get(url, headers={"X-API-KEY": OPS_KEY}).text.count("agentcell_gateway_cells{") == len(STATES)
    assert httpx.post(url, headers={"X-API-KEY": OPS_KEY}).status_code == 405
    assert httpx.get(url, headers={"X-API-KEY": OPS_KEY, "E2b-Sandbox-Id": "cellaaaa" + "a" * 20}).status_code == 502


def test_gateway_metrics_count_real_requests(ops_gateway: GatewayProcess) -> None:
    g, key = ops_gateway, {"X-API-KEY": OPS_KEY}
    before = _scrape(g)
    assert [v for (name, _), v in before.items() if name == "agentcell_build_info"] == [1]
    assert _value(before, "process_resident_memory_bytes") > 10 << 20
    assert _value(before, "agentcell_gateway_cells", state="ready") == 2
    assert _value(before, "agentcell_gateway_cells", state="down") == 1  # nothing listens there
    assert _value(before, "agentcell_gateway_errors_total", kind="cell_poll_failed") > 0
    r = httpx.post(g.url + "/v2/sandboxes", json={"templateID": "base", "timeout": 120}, headers=key, timeout=60)
    assert r.status_code == 201, r.text
    sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
    cell = _cell_of(sid)
    try:
        run = httpx.post(g.url + "/execute", json={"code": "6 * 7"}, timeout=60,
                         headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49999", "X-Access-Token": token})
        assert run.status_code == 200 and '"42"' in run.text
        assert httpx.get(f"{g.url}/sandboxes/{sid}", headers=key).status_code == 200
        assert httpx.get(g.url + "/sandboxes", headers=key).status_code == 200
        unknown = "zzzzzzzz" + "a" * 20
        assert _gone(httpx.get(f"{g.url}/sandboxes/{unknown}", headers=key), unknown)
        assert httpx.get(g.url + "/v2/sandboxes").status_code == 401
    finally:
        assert httpx.delete(f"{g.url}/sandboxes/{sid}", headers=key).status_code == 204
    after = _scrape(g)

    def moved(name: str, **labels: str) -> float:
        return _value(after, name, **labels) - _value(before, name, **labels)

    responses = "agentcell_gateway_http_responses_total"
    assert moved(responses, route="create", status_class="2xx") == 1
    assert moved(responses, route="interpreter", status_class="2xx") == 1
    assert moved(responses, route="sandbox", status_class="2xx") == 2  # the get and the kill
    assert moved(responses, route="sandbox", status_class="5xx") == 1  # the unknown cell's 502
    assert moved(responses, route="list", status_class="2xx") == 1
    assert moved(responses, route="list", status_class="4xx") == 1  # the 401: never reached a cell
    assert moved(responses, route="metrics", status_class="2xx") == 1  # the first scrape
    assert moved("agentcell_gateway_errors_total", kind="sandbox_cell_unknown") == 1
    # the create, the run, the get and the kill went to the sandbox's cell and were timed there
    assert moved("agentcell_gateway_forward_seconds_count", cell=cell) == 4
    assert moved("agentcell_gateway_forward_seconds_bucket", cell=cell, le="+Inf") == 4
    assert 0 < moved("agentcell_gateway_forward_seconds_sum", cell=cell) < 60
    assert _value(after, "agentcell_gateway_cells", state="ready") == 2


def test_gateway_json_log_lines_carry_sandbox_ids(ops_gateway: GatewayProcess, cells: list[ServerProcess]) -> None:
    g, key = ops_gateway, {"X-API-KEY": OPS_KEY}
    r = httpx.post(g.url + "/sandboxes", json={"templateID": "base", "timeout": 120}, headers=key, timeout=60)
    assert r.status_code == 201, r.text
    sid, token = r.json()["sandboxID"], r.json()["envdAccessToken"]
    try:
        got = httpx.get(g.url + "/files", params={"path": "/etc/hostname"}, timeout=30,
                        headers={"E2b-Sandbox-Id": sid, "X-Access-Token": token})
        assert got.status_code == 200, got.text
        signed = {"path": "/etc/hostname", "username": "user",
                  "signature": signature("/etc/hostname", "read", "user", token, None)}
        assert httpx.get(g.url + "/files", params=signed, timeout=30).status_code == 200  # names no sandbox
    finally:
        assert httpx.delete(f"{g.url}/sandboxes/{sid}", headers=key).status_code == 204
    time.sleep(0.3)
    lines = [json.loads(line) for line in g.log().splitlines() if line.strip()]  # every line is JSON
    for line in lines:
        assert {"time", "level", "logger", "message"} <= set(line), line
    access = [x for x in lines if x["logger"] == "agentcell.access"]
    assert not [x for x in lines if x["logger"] == "uvicorn.access"]  # the gateway's own access log only
    [create] = [x for x in access if x.get("route") == "create" and x.get("sandbox_id") == sid]
    assert create["status"] == 201 and create["cell"] == _cell_of(sid) and create["method"] == "POST"
    assert create["path"] == "/sandboxes" and create["duration_ms"] > 0 and create["bytes"] > 0
    [data] = [x for x in access if x.get("route") == "envd" and x.get("sandbox_id") == sid]
    assert data["port"] == 49983 and data["status"] == 200 and data["cell"] == _cell_of(sid)
    [by_signature] = [x for x in access if x.get("route") == "signed_files"]
    assert by_signature["sandbox_id"] == sid and by_signature["status"] == 200  # the signer, found by asking
    assert "signature" not in json.dumps(by_signature)  # never the query
    [kill] = [x for x in access if x.get("method") == "DELETE" and x.get("sandbox_id") == sid]
    assert kill["route"] == "sandbox" and kill["status"] == 204
    [banner] = [x for x in lines if x["logger"] == "agentcell.gateway" and "serving on" in x["message"]]
    assert banner["listen"] == g.url and banner["tls"] == "off" and banner["auth"].startswith("API key required")
    assert banner["discovery"] == "static" and banner["cell_auth"].startswith("the clients' key")
    states = {c.split()[1]: (c.split()[0], c.split()[2]) for c in banner["cells"]}
    assert states[cells[0].url] == (CELL_IDS[0], "ready") and states[cells[1].url] == (CELL_IDS[1], "ready")
    assert sorted(v[1] for v in states.values()) == ["down", "ready", "ready"]
    assert OPS_KEY not in g.log()


def test_gateway_text_log_has_its_banner_and_access_lines(gateways: list[GatewayProcess]) -> None:
    g = gateways[1]
    assert httpx.get(g.url + "/health").status_code == 200
    time.sleep(0.3)
    text = g.log()
    assert "agentcell.gateway: agentcell gateway" in text and "serving on " + g.url in text
    assert "\n  cells:" in text and "\n  auth:" in text  # the banner's block
    access = r'agentcell\.access: 127\.0\.0\.1:\d+ "GET /health HTTP/1\.1" 200 route=health duration_ms='
    assert re.search(access, text), text[-2000:]


# --- snapshots and fork through a gateway -----------------------------------------------------------------


def _snapshot_ids(url: str, **params: str) -> list[dict[str, Any]]:
    r = httpx.get(url + "/snapshots", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def _source(cell: ServerProcess, gw: str) -> Sandbox:
    """A sandbox made on `cell` itself (a create through the gateway may land anywhere), used through `gw`."""
    return Sandbox.connect(_create(cell.url, timeout=300), api_url=gw)


def test_a_create_from_a_snapshot_lands_on_its_cell(cells: list[ServerProcess],
                                                    gateways: list[GatewayProcess]) -> None:
    gw = gateways[0].url
    sources = [_source(c, gw) for c in cells]
    snaps: dict[str, str] = {}  # cell id -> snapshot id
    named = f"gw-{os.urandom(4).hex()}"
    try:
        for cid, src in zip(CELL_IDS, sources, strict=True):
            assert _cell_of(src.sandbox_id) == cid
            src.files.write("/home/user/origin.txt", f"taken on {cid}")
            snap = src.create_snapshot()  # through the gateway: routed by the sandbox's id
            assert snap.snapshot_id.endswith(":default") and _cell_of(snap.snapshot_id) == cid, snap
            snaps[cid] = snap.snapshot_id
        by_name = sources[1].create_snapshot(name=named)
        assert by_name.snapshot_id == f"{named}:default"  # a name says nothing of its cell: the gateway asks
        # the full cell (it holds one sandbox: the source) says no, and the create goes nowhere else
        before = {x["sandboxID"] for x in httpx.get(gw + "/sandboxes").json()}
        r = httpx.post(gw + "/v2/sandboxes", json={"templateID": snaps[CELL_IDS[2]], "timeout": 60}, timeout=60)
        assert r.status_code == 429 and f"lives on cell {CELL_IDS[2]}" in r.json()["message"], r.text
        assert {x["sandboxID"] for x in httpx.get(gw + "/sandboxes").json()} == before
        sources[2].kill()
        # every create from a snapshot, by each of its spellings, through either gateway, lands on its cell
        forms = [lambda s: s, lambda s: s.split(":")[0]]
        for round_ in range(3):
            for i, cid in enumerate(CELL_IDS):
                ref = forms[(round_ + i) % 2](snaps[cid])
                child = Sandbox.create(ref, api_url=gateways[(round_ + i) % 2].url, timeout=60)
                try:
                    assert _cell_of(child.sandbox_id) == cid, (ref, child.sandbox_id)
                    assert child.files.read("/home/user/origin.txt") == f"taken on {cid}"
                finally:
                    child.kill()  # the third cell holds one at a time
        for ref in (named, f"{named}:default", named, f"{named}:default"):
            child = Sandbox.create(ref, api_url=gw, timeout=60)
            try:
                assert _cell_of(child.sandbox_id) == CELL_IDS[1]
                assert child.files.read("/home/user/origin.txt") == f"taken on {CELL_IDS[1]}"
            finally:
                child.kill()
        missing = httpx.post(gw + "/sandboxes", json={"templateID": "no-such-snapshot"})
        assert missing.status_code == 404 and "not found" in missing.json()["message"]
        # the same name on two cells: ambiguous, never a guess
        twin = httpx.post(f"{gw}/sandboxes/{sources[0].sandbox_id}/snapshots", json={"name": named})
        assert twin.status_code == 201, twin.text
        r = httpx.post(gw + "/sandboxes", json={"templateID": named})
        assert r.status_code == 409 and CELL_IDS[0] in r.json()["message"] and CELL_IDS[1] in r.json()["message"]
        assert len(_snapshot_ids(gw, name=named)) == 2
        # a name's delete goes to every cell; an id's to its own
        assert Sandbox.delete_snapshot(named, api_url=gw) is True
        assert _snapshot_ids(gw, name=named) == []
        assert Sandbox.delete_snapshot(named, api_url=gw) is False
        assert Sandbox.delete_snapshot(snaps[CELL_IDS[2]], api_url=gateways[1].url) is True
        assert Sandbox.delete_snapshot(snaps[CELL_IDS[2]], api_url=gw) is False
        gone = httpx.post(gw + "/sandboxes", json={"templateID": snaps[CELL_IDS[2]]})
        assert gone.status_code == 404, gone.text
        assert httpx.delete(gw + "/templates/base").status_code == 400  # a built-in: a cell says no
    finally:
        for src in sources:
            with contextlib.suppress(Exception):
                src.kill()
        for ref in [*snaps.values(), named, named]:
            httpx.delete(f"{gw}/templates/{ref}")


def test_snapshots_list_merged_and_paged(cells: list[ServerProcess], gateways: list[GatewayProcess]) -> None:
    gw = gateways[0].url
    sources = [_source(c, gw) for c in cells[:2]]
    mine: list[str] = []
    try:
        for i in range(5):  # 3 on one cell, 2 on the other; some in the same second
            mine.append(sources[i % 2].create_snapshot().snapshot_id)
        every = [s for s in _snapshot_ids(gw) if s["snapshotID"] in mine]
        assert sorted(s["snapshotID"] for s in every) == sorted(mine)
        for limit in (1, 2, 3):  # pages over both cells, each page from either gateway, one cursor
            seen: list[dict[str, Any]] = []
            token = None
            for page in range(20):
                params = {"limit": str(limit), **({"nextToken": token} if token else {})}
                r = httpx.get(gateways[page % 2].url + "/snapshots", params=params)
                assert r.status_code == 200, r.text
                assert len(r.json()) <= limit
                seen += r.json()
                token = r.headers.get("x-next-token")
                if not token:
                    break
            ids = [s["snapshotID"] for s in seen]
            assert len(ids) == len(set(ids)), f"a snapshot twice: {ids}"
            assert [s["createdAt"] for s in seen] == sorted((s["createdAt"] for s in seen), reverse=True)
            assert set(mine) <= set(ids)
        # the sandbox filter asks its cell only; its pages are the gateway's too
        first = sources[0].list_snapshots(limit=2)
        got = [s.snapshot_id for s in first.next_items()]
        while first.has_next:
            got += [s.snapshot_id for s in first.next_items()]
        assert sorted(got) == sorted(mine[0::2])
        assert [s.snapshot_id for s in Sandbox.list_snapshots(api_url=gw, sandbox_id=sources[1].sandbox_id)
                .next_items()] == [s["snapshotID"] for s in every if s["sandboxID"] == sources[1].sandbox_id]
        assert httpx.get(gw + "/snapshots", params={"nextToken": "!!"}).status_code == 400
        assert httpx.get(gw + "/snapshots", params={"limit": "0"}).status_code == 400
    finally:
        for src in sources:
            src.kill()
        for ref in mine:
            httpx.delete(f"{gw}/templates/{ref}")


def test_e2b_sdk_snapshots_and_fork_through_the_gateway(cells: list[ServerProcess], gw: str) -> None:
    from e2b import Sandbox as E2BSandbox

    # a gvisor sandbox (memory snapshots, fork) on the first cell, then everything through the gateway
    r = httpx.post(cells[0].url + "/v2/sandboxes", json={"templateID": "base", "backend": "gvisor", "timeout": 300},
                   timeout=120)
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    with e2b_pointed_at(gw):
        src = E2BSandbox.connect(sid)
        snapshot = None
        try:
            src.files.write("/home/user/state.txt", "e2b through the gateway")
            src.commands.run("echo 41 > /tmp/n; sleep 3600", background=True)  # a process: the memory snapshot keeps it
            snapshot = src.create_snapshot()
            assert _cell_of(snapshot.snapshot_id) == CELL_IDS[0]
            for _ in range(3):
                child = E2BSandbox.create(snapshot.snapshot_id, timeout=60)
                try:
                    assert _cell_of(child.sandbox_id) == CELL_IDS[0]
                    assert child.files.read("/home/user/state.txt") == "e2b through the gateway"
                    assert "sleep 3600" in child.commands.run("ps -eo args").stdout  # its memory: the process runs on
                finally:
                    child.kill()
            listed = E2BSandbox.list_snapshots(sandbox_id=sid).next_items()
            assert [s.snapshot_id for s in listed] == [snapshot.snapshot_id]
            forks = Sandbox.connect(sid, api_url=gw).fork(count=2, timeout=60)  # agentcell's SDK: fork
            try:
                assert all(isinstance(f, Sandbox) for f in forks), forks
                for f in forks:
                    assert isinstance(f, Sandbox) and _cell_of(f.sandbox_id) == CELL_IDS[0]
                    assert f.files.read("/home/user/state.txt") == "e2b through the gateway"
                    f.files.write("/home/user/state.txt", f.sandbox_id)  # its own copy
                assert src.files.read("/home/user/state.txt") == "e2b through the gateway"
            finally:
                for f in forks:
                    if isinstance(f, Sandbox):
                        f.kill()
            assert E2BSandbox.delete_snapshot(snapshot.snapshot_id)
            assert not E2BSandbox.delete_snapshot(snapshot.snapshot_id)
            snapshot = None
        finally:
            if snapshot is not None:
                E2BSandbox.delete_snapshot(snapshot.snapshot_id)
            src.kill()


def test_a_snapshot_on_a_stopped_cell_is_not_placed_elsewhere(cells: list[ServerProcess],
                                                              gateways: list[GatewayProcess]) -> None:
    gw = gateways[0].url
    src = _source(cells[1], gw)
    snap = src.create_snapshot().snapshot_id
    src.kill()
    os.kill(cells[1].pid, signal.SIGSTOP)
    try:
        wait_until("the stopped cell marked down", lambda: not gateways[0].cells()[CELL_IDS[1]]["up"], timeout=10)
        r = httpx.post(gw + "/sandboxes", json={"templateID": snap}, timeout=30)
        assert r.status_code == 503 and f"lives on cell {CELL_IDS[1]}" in r.json()["message"], r.text
        d = httpx.delete(f"{gw}/templates/{snap}")
        assert d.status_code == 503 and CELL_IDS[1] in d.json()["message"], d.text
    finally:
        os.kill(cells[1].pid, signal.SIGCONT)
    wait_until("the cell back up", lambda: gateways[0].cells()[CELL_IDS[1]]["up"], timeout=10)
    assert Sandbox.delete_snapshot(snap, api_url=gw) is True


def test_health_is_503_without_a_routable_cell(tmp_path: Path) -> None:
    """A readiness probe takes a gateway with no cell out of its Service (liveness must not use it)."""
    nowhere = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    lone = GatewayProcess(tmp_path / "lone.log", [nowhere], "--poll-interval", "0.2")
    try:
        r = wait_until("the gateway up", lambda: _health(lone.url))
        assert r.status_code == 503 and r.json() == {"status": "no cells", "cells": 0, "ready": 0}
    finally:
        lone.stop()


def _health(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url + "/health", timeout=1)
    except httpx.TransportError:
        return None


# --- failures (destructive: the order matters) ----------------------------------------------------------


def test_a_stopped_cell_is_marked_down_then_back(cells: list[ServerProcess], gateways: list[GatewayProcess]) -> None:
    gw = gateways[0].url
    sid = _create(cells[1].url)
    token = httpx.get(f"{cells[1].url}/sandboxes/{sid}").json()["envdAccessToken"]
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49999", "X-Access-Token": token}
    os.kill(cells[1].pid, signal.SIGSTOP)
    try:
        t0 = time.monotonic()
        wait_until("the stopped cell marked down", lambda: not gateways[0].cells()[CELL_IDS[1]]["up"], timeout=10)
        noticed = time.monotonic() - t0
        assert _gone(httpx.post(gw + "/execute", json={"code": "1"}, headers=headers), sid)
        new = _create(gw)  # creates go elsewhere meanwhile
        assert _cell_of(new) != CELL_IDS[1]
        httpx.delete(f"{gw}/sandboxes/{new}")
    finally:
        os.kill(cells[1].pid, signal.SIGCONT)
    wait_until("the cell back up", lambda: gateways[0].cells()[CELL_IDS[1]]["up"], timeout=10)
    r = httpx.post(gw + "/execute", json={"code": "20 + 22"}, headers=headers)
    assert r.status_code == 200 and '"42"' in r.text
    httpx.delete(f"{gw}/sandboxes/{sid}")
    assert noticed < 5


def test_killing_one_gateway_leaves_the_other_serving(gateways: list[GatewayProcess]) -> None:
    first, second = gateways
    sid = _create(first.url)
    token = httpx.get(f"{first.url}/sandboxes/{sid}").json()["envdAccessToken"]
    first.proc.kill()
    first.proc.wait()
    r = httpx.post(second.url + "/execute", json={"code": "x = 5; x * 2"},
                   headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49999", "X-Access-Token": token})
    assert r.status_code == 200 and '"10"' in r.text
    assert httpx.delete(f"{second.url}/sandboxes/{sid}").status_code == 204


def test_a_terminated_cell_drains(cells: list[ServerProcess], gateways: list[GatewayProcess]) -> None:
    gw = gateways[1].url
    cell = cells[2]
    sid = _create(cell.url)
    token = httpx.get(f"{cell.url}/sandboxes/{sid}").json()["envdAccessToken"]
    headers = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49999", "X-Access-Token": token}
    cell.proc.send_signal(signal.SIGTERM)
    wait_until("health 503", lambda: httpx.get(cell.url + "/health").status_code == 503)
    refused = httpx.post(cell.url + "/v2/sandboxes", json={"templateID": "base"})
    assert refused.status_code == 429 and "draining" in refused.json()["message"]
    wait_until("the gateway sees it draining", lambda: gateways[1].cells()[CELL_IDS[2]]["draining"])
    figures = _samples(httpx.get(gw + "/metrics").text)
    assert _value(figures, "agentcell_gateway_cells", state="draining") == 1
    assert _value(figures, "agentcell_gateway_cells", state="ready") == 2
    r = httpx.post(gw + "/execute", json={"code": "'still here'"}, headers=headers)  # its sandbox still answers
    assert r.status_code == 200 and "still here" in r.text
    new = _create(gw)
    assert _cell_of(new) != CELL_IDS[2]
    httpx.delete(f"{gw}/sandboxes/{new}")
    assert cell.proc.poll() is None  # still up while its sandbox lives
    httpx.delete(f"{gw}/sandboxes/{sid}")  # the last sandbox ends: the cell stops
    assert cell.proc.wait(timeout=30) is not None


def test_a_killed_cell_answers_not_found(cells: list[ServerProcess], gateways: list[GatewayProcess]) -> None:
    gw = gateways[1].url
    sid = _create(cells[0].url)
    token = httpx.get(f"{cells[0].url}/sandboxes/{sid}").json()["envdAccessToken"]
    before = _samples(httpx.get(gw + "/metrics").text)
    cells[0].proc.kill()
    cells[0].proc.wait()
    r = httpx.post(gw + "/execute", json={"code": "1"},
                   headers={"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49999", "X-Access-Token": token})
    assert _gone(r, sid)
    assert f"its cell {_cell_of(sid)} does not answer now" in r.json()["message"]
    assert _gone(httpx.get(f"{gw}/sandboxes/{sid}"), sid)
    after = _samples(httpx.get(gw + "/metrics").text)
    errors = "agentcell_gateway_errors_total"
    # each request found the cell's port closed, or its cell already marked down (by that or by a poll)
    assert sum(_value(after, errors, kind=k) - _value(before, errors, kind=k)
               for k in ("cell_unreachable", "cell_failed", "sandbox_cell_down")) == 2
    wait_until("this cell and the drained one down", lambda: _value(
        _samples(httpx.get(gw + "/metrics").text), "agentcell_gateway_cells", state="down") == 2, timeout=5)
    new = _create(gw)  # the one cell left takes it
    assert _cell_of(new) == CELL_IDS[1]
    httpx.delete(f"{gw}/sandboxes/{new}")


# --- Kubernetes discovery, against a fake API server on loopback ----------------------------------------


def _slice(name: str, version: str, endpoints: list[tuple[str, bool, bool, bool]]) -> dict[str, Any]:
    """An EndpointSlice as the API server sends it (recorded shape; (ip, ready, serving, terminating))."""
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": name, "namespace": "cells", "resourceVersion": version,
                     "labels": {"kubernetes.io/service-name": "agentcell-cells"}},
        "ports": [{"name": "http", "port": 49982, "protocol": "TCP"}],
        "endpoints": [{"addresses": [ip], "conditions": {"ready": r, "serving": s, "terminating": t},
                       "nodeName": f"node-{ip.rsplit('.', 1)[1]}",
                       "targetRef": {"kind": "Pod", "name": f"cell-{ip.rsplit('.', 1)[1]}", "namespace": "cells",
                                     "uid": f"00000000-0000-0000-0000-00000000000{ip.rsplit('.', 1)[1]}"}}
                      for ip, r, s, t in endpoints],
    }


async def test_kubernetes_discovery_follows_endpointslices() -> None:
    """List, then a watch stream: a cell is ready, terminating but serving (draining), then gone.
    The real kubernetes_asyncio client deserialises it all."""
    pytest.importorskip("kubernetes_asyncio")
    from aiohttp import web
    from kubernetes_asyncio import client

    from agentcell.gateway.kubernetes import KubernetesDiscovery

    both = [("192.0.2.1", True, True, False), ("192.0.2.2", True, True, False)]
    events = [
        {"type": "MODIFIED", "object": _slice("cells-abc", "11", [both[0], ("192.0.2.2", False, True, True)])},
        {"type": "MODIFIED", "object": _slice("cells-abc", "12", [both[0]])},
    ]
    requests: list[dict[str, str]] = []
    done = asyncio.Event()

    async def endpointslices(request: web.Request) -> web.StreamResponse:
        requests.append(dict(request.query))
        assert request.query["labelSelector"] == "kubernetes.io/service-name=agentcell-cells"
        if request.query.get("watch") not in ("true", "True", "1"):
            return web.json_response({"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                                      "metadata": {"resourceVersion": "10"},
                                      "items": [_slice("cells-abc", "10", both)]})
        assert request.query["resourceVersion"] == "10"
        resp = web.StreamResponse()
        await resp.prepare(request)
        for e in events:
            await asyncio.sleep(0.2)
            await resp.write(json.dumps(e).encode() + b"\n")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), 30)  # the watch stays open until the test ends
        return resp

    app = web.Application()
    app.router.add_get("/apis/discovery.k8s.io/v1/namespaces/cells/endpointslices", endpointslices)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    conf = client.Configuration(host=f"http://127.0.0.1:{port}")
    api = client.ApiClient(conf)
    seen: list[dict[str, tuple[bool, bool]]] = []
    discovery = KubernetesDiscovery("agentcell-cells", "cells", "http", api_client=api)
    try:
        await discovery.start(lambda eps: seen.append({e.url: (e.ready, e.serving) for e in eps}))
        deadline = time.monotonic() + 10
        while len(seen) < 3 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        a, b = "http://192.0.2.1:49982", "http://192.0.2.2:49982"
        assert seen[:3] == [{a: (True, True), b: (True, True)},     # listed: both ready
                            {a: (True, True), b: (False, True)},    # b terminating: no placement, still routed
                            {a: (True, True)}]                      # b gone
    finally:
        done.set()
        await discovery.close()
        await api.close()
        await runner.cleanup()
