"""The server's wire protocol, endpoint by endpoint, with raw HTTP (httpx) against the real server."""

from __future__ import annotations

import base64
import gzip
import json
import struct
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote, urlencode

import httpx
import pytest
from helpers import create_sandbox as create

HEADERS = {"X-API-KEY": "test-key"}


@pytest.fixture(scope="module")
def http(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, headers=HEADERS, timeout=60) as c:
        yield c



@pytest.fixture(scope="module")
def sbx(http: httpx.Client) -> Iterator[dict[str, Any]]:
    s = create(http, metadata={"suite": "api", "odd key": "a&b=c"}, envVars={"FOO": "bar"})
    yield s
    http.delete(f"/sandboxes/{s['sandboxID']}")


def envd(sbx: dict[str, Any], port: int = 49983, token: bool = True) -> dict[str, str]:
    h = {"E2b-Sandbox-Id": sbx["sandboxID"], "E2b-Sandbox-Port": str(port)}
    if token:
        h["X-Access-Token"] = sbx["envdAccessToken"]
    return h


def assert_error(r: httpx.Response, status: int, fragment: str = "") -> dict[str, Any]:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["code"] == status and isinstance(body["message"], str), body
    assert fragment in body["message"], body
    return body


# --- control plane ----------------------------------------------------------------------------------


def test_create_response_shape(sbx: dict[str, Any]) -> None:
    assert set(sbx) >= {"templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken", "domain"}
    assert len(sbx["sandboxID"]) == 20 and sbx["sandboxID"].isalnum() and sbx["sandboxID"].islower()
    assert sbx["envdVersion"] == "0.6.13" and sbx["templateID"] == "base" and sbx["domain"]


def test_create_v1_and_templates(http: httpx.Client) -> None:
    r = http.post("/sandboxes", json={"templateID": "code-interpreter-v1", "timeout": 15})
    assert r.status_code == 201, r.text
    assert r.json()["templateID"] == "code-interpreter-v1"
    assert http.delete(f"/sandboxes/{r.json()['sandboxID']}").status_code == 204
    body = assert_error(http.post("/v2/sandboxes", json={"templateID": "nope"}), 404)
    assert body["message"].startswith("template 'nope' not found; available: base, code-interpreter-v1")


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"templateID": 5}, "templateID"),
        ({"templateID": "base", "timeout": "10"}, "timeout"),
        ({"templateID": "base", "timeout": 0}, "timeout"),
        ({"templateID": "base", "timeout": 10**9}, "timeout"),
        ({"templateID": "base", "metadata": {"a": 1}}, "metadata"),
        ({"templateID": "base", "envVars": []}, "envVars"),
        ({"templateID": "base", "limits": {"memoryMB": 1}}, "memoryMB"),
        ({"templateID": "base", "limits": {"bogus": 1}}, "bogus"),
        ({"templateID": "base", "limits": {"pids": "many"}}, "pids"),
        # the tests' server runs with --egress-uplink none (conftest): no internet to give
        ({"templateID": "base", "network": {"allowOut": ["1.1.1.1"]}}, "--egress-uplink none"),
        ({"templateID": "base", "network": {"allowOut": ["exa mple.com"]}}, "not a CIDR"),
        ({"templateID": "base", "network": {"denyOut": "1.1.1.1"}}, "must be a list"),
        ({"templateID": "base", "allow_internet_access": "yes"}, "must be a boolean"),
    ],
)
def test_create_validation(http: httpx.Client, body: dict[str, Any], fragment: str) -> None:
    assert_error(http.post("/v2/sandboxes", json=body), 400, fragment)


def test_internet_asked_of_a_server_without_uplink(http: httpx.Client) -> None:
    """E2B's JS SDK sends allow_internet_access: true in every create: a server without an uplink
    (the tests' one) gives such a sandbox no internet, and says so, rather than refusing it."""
    r = http.post("/v2/sandboxes", json={"templateID": "base", "allow_internet_access": True})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    try:
        assert http.get(f"/sandboxes/{sid}").json()["allowInternetAccess"] is False
    finally:
        http.delete(f"/sandboxes/{sid}")


def test_invalid_json_is_400(http: httpx.Client, sbx: dict[str, Any]) -> None:
    as_json = {"Content-Type": "application/json"}
    for path in ("/v2/sandboxes", "/sandboxes", f"/sandboxes/{sbx['sandboxID']}/timeout"):
        assert_error(http.post(path, content=b"{not json", headers=as_json), 400, "JSON")
        assert_error(http.post(path, content=b"[1,2]", headers=as_json), 400)


def test_limits_are_reported(http: httpx.Client) -> None:
    s = create(http, limits={"memoryMB": 256, "pids": 64, "cpuCount": 0.5, "diskMB": 64, "openFiles": 256})
    try:
        info = http.get(f"/sandboxes/{s['sandboxID']}").json()
        assert info["memoryMB"] == 256 and info["diskSizeMB"] == 64
        assert info["limits"] == {"memoryMB": 256, "pids": 64, "cpuCount": 0.5, "diskMB": 64, "openFiles": 256}
    finally:
        http.delete(f"/sandboxes/{s['sandboxID']}")


def test_get_detail(http: httpx.Client, sbx: dict[str, Any]) -> None:
    r = http.get(f"/sandboxes/{sbx['sandboxID']}")
    assert r.status_code == 200
    d = r.json()
    for key in ("templateID", "sandboxID", "clientID", "startedAt", "endAt", "cpuCount", "memoryMB",
                "diskSizeMB", "state", "envdVersion", "envdAccessToken", "domain", "lifecycle"):
        assert key in d, key
    assert d["state"] == "running" and d["metadata"]["suite"] == "api"
    assert d["lifecycle"] == {"autoResume": False, "onTimeout": "kill"}
    assert d["startedAt"].endswith("Z") and d["endAt"] > d["startedAt"]
    assert_error(http.get("/sandboxes/doesnotexist"), 404)


def test_list_v1_and_metadata_filter(http: httpx.Client, sbx: dict[str, Any]) -> None:
    ids = [s["sandboxID"] for s in http.get("/sandboxes").json()]
    assert sbx["sandboxID"] in ids
    # The SDK double-encodes: urlencode({quote(k): quote(v)}).
    meta = urlencode({quote("odd key"): quote("a&b=c")})
    hit = http.get("/v2/sandboxes", params={"metadata": meta}).json()
    assert [s["sandboxID"] for s in hit] == [sbx["sandboxID"]]
    miss = http.get("/v2/sandboxes", params={"metadata": urlencode({"suite": "other"})}).json()
    assert miss == []
    assert http.get("/v2/sandboxes", params={"state": "paused", "metadata": meta}).json() == []
    assert_error(http.get("/v2/sandboxes", params={"state": "sleeping"}), 400)
    assert_error(http.get("/v2/sandboxes", params={"limit": "x"}), 400)


def test_list_v2_pagination(http: httpx.Client) -> None:
    made = [create(http, metadata={"page": "yes"})["sandboxID"] for _ in range(3)]
    try:
        seen: list[str] = []
        token = None
        pages = 0
        while True:
            params = {"limit": "2", "metadata": "page=yes"}
            if token:
                params["nextToken"] = token
            r = http.get("/v2/sandboxes", params=params)
            assert r.status_code == 200
            seen += [s["sandboxID"] for s in r.json()]
            pages += 1
            token = r.headers.get("x-next-token")
            if not token:
                break
        assert pages == 2 and sorted(seen) == sorted(made)
        assert seen == list(reversed(made))  # newest first by default
    finally:
        for sid in made:
            http.delete(f"/sandboxes/{sid}")


def test_timeout_and_connect(http: httpx.Client) -> None:
    s = create(http, timeout=60)
    sid = s["sandboxID"]
    try:
        assert http.post(f"/sandboxes/{sid}/timeout", json={"timeout": 1000}).status_code == 204
        end = http.get(f"/sandboxes/{sid}").json()["endAt"]
        # connect never shortens a running sandbox's timeout
        for path in (f"/sandboxes/{sid}/connect", f"/v2/sandboxes/{sid}/connect"):
            r = http.post(path, json={"timeout": 10})
            assert r.status_code == 200 and r.json()["sandboxID"] == sid
            assert http.get(f"/sandboxes/{sid}").json()["endAt"] == end
        assert http.post(f"/v2/sandboxes/{sid}/connect", json={"timeout": 2000}).status_code == 200
        assert http.get(f"/sandboxes/{sid}").json()["endAt"] > end
        assert_error(http.post(f"/sandboxes/{sid}/timeout", json={"timeout": "x"}), 400)
        assert_error(http.post(f"/sandboxes/{sid}/timeout", json={}), 400)
        assert_error(http.post("/sandboxes/nope/timeout", json={"timeout": 5}), 404)
        assert_error(http.post("/v2/sandboxes/nope/connect", json={}), 404)
        # a short timeout: the reaper kills it
        assert http.post(f"/sandboxes/{sid}/timeout", json={"timeout": 1}).status_code == 204
        deadline = time.monotonic() + 10
        while http.get(f"/sandboxes/{sid}").status_code != 404:
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert_error(http.delete(f"/sandboxes/{sid}"), 404)
    finally:
        http.delete(f"/sandboxes/{sid}")


def test_lifecycle_status_codes(http: httpx.Client, sbx: dict[str, Any]) -> None:
    sid = sbx["sandboxID"]
    assert_error(http.post(f"/sandboxes/{sid}/resume", json={}), 409, "already running")
    # what the linux backend cannot do is a 400 naming the backend that can, never a silent copy (a
    # fork there is a filesystem fork, and says so: test_protocol_gaps.py)
    assert_error(http.post(f"/sandboxes/{sid}/snapshots", json={"memory": True}), 400, "gvisor")
    assert_error(http.post(f"/sandboxes/{sid}/fork", json={"count": 0}), 400, "count")
    assert_error(http.post(f"/sandboxes/{sid}/pause", json={"memory": "yes"}), 400, "memory")
    assert http.post(f"/sandboxes/{sid}/pause", json={}).status_code == 204
    assert_error(http.post(f"/sandboxes/{sid}/pause", json={}), 409, "already paused")
    assert http.get(f"/sandboxes/{sid}").json()["state"] == "paused"
    assert http.post(f"/sandboxes/{sid}/resume", json={}).status_code == 201
    assert http.post(f"/v2/sandboxes/{sid}/connect", json={}).status_code == 200
    assert_error(http.post("/sandboxes/nope/pause", json={}), 404)
    assert_error(http.get("/no/such/route"), 404)


def test_metrics(http: httpx.Client, sbx: dict[str, Any]) -> None:
    r = http.get(f"/sandboxes/{sbx['sandboxID']}/metrics")
    assert r.status_code == 200, r.text
    samples = r.json()  # its history: the manager samples every 5 s, the request adds a fresh one
    assert samples and [m["timestampUnix"] for m in samples] == sorted(m["timestampUnix"] for m in samples)
    for m in samples:
        assert set(m) == {"timestamp", "timestampUnix", "cpuCount", "cpuUsedPct", "memUsed", "memTotal",
                          "memCache", "diskUsed", "diskTotal"}
        assert m["memTotal"] > 0
    assert samples[-1]["timestampUnix"] >= time.time() - 5  # the fresh one


def test_kill(http: httpx.Client) -> None:
    s = create(http)
    assert http.delete(f"/sandboxes/{s['sandboxID']}").status_code == 204
    assert_error(http.delete(f"/sandboxes/{s['sandboxID']}"), 404)
    r = http.get("/health", headers=envd(s))
    assert r.status_code == 502 and r.json() == {
        "sandboxId": s["sandboxID"], "message": "The sandbox was not found", "code": 502
    }


# --- envd data plane ---------------------------------------------------------------------------------


def test_unknown_sandbox_is_502_on_every_data_plane_path(http: httpx.Client) -> None:
    fake = {"sandboxID": "zzzzzzzzzzzzzzzzzzzz", "envdAccessToken": "x"}
    for port, method, path in ((49983, "GET", "/health"), (49983, "POST", "/process.Process/List"),
                               (49983, "GET", "/files?path=a"), (49999, "POST", "/execute")):
        r = http.request(method, path, headers=envd(fake, port))
        assert r.status_code == 502 and "was not found" in r.json()["message"]
    # Host-based routing too
    r = http.get("/health", headers={"Host": "49983-zzzzzzzzzzzzzzzzzzzz.localhost"})
    assert r.status_code == 502


def test_health_and_host_routing(http: httpx.Client, sbx: dict[str, Any]) -> None:
    assert http.get("/health", headers=envd(sbx, token=False)).status_code == 204
    r = http.get("/health", headers={"Host": f"49983-{sbx['sandboxID']}.localhost"})
    assert r.status_code == 204
    r = http.get("/", headers=envd(sbx, port=8080))
    assert r.status_code == 502 and "port is not open" in r.json()["message"]


def rpc(http: httpx.Client, sbx: dict[str, Any], method: str, body: dict[str, Any], **kw: Any) -> httpx.Response:
    headers = {**envd(sbx, token=kw.pop("token", True)), "Content-Type": "application/json",
               "Connect-Protocol-Version": "1", **kw.pop("headers", {})}
    return http.post(f"/{method}", json=body, headers=headers)


def stream_rpc(http: httpx.Client, sbx: dict[str, Any], method: str, body: dict[str, Any],
               headers: dict[str, str] | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    raw = json.dumps(body).encode()
    h = {**envd(sbx), "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1", **(headers or {})}
    r = http.post(f"/{method}", content=b"\x00" + struct.pack(">I", len(raw)) + raw, headers=h)
    assert r.status_code == 200, r.text
    data, msgs, end = r.content, [], {}
    while data:
        flags, n = data[0], struct.unpack(">I", data[1:5])[0]
        msg = json.loads(data[5 : 5 + n])
        data = data[5 + n :]
        if flags & 0x02:
            end = msg
        else:
            msgs.append(msg)
    return msgs, end


def test_rpc_requires_access_token(http: httpx.Client, sbx: dict[str, Any]) -> None:
    r = rpc(http, sbx, "process.Process/List", {}, token=False)
    assert r.status_code == 401 and r.json()["code"] == "unauthenticated"
    r = rpc(http, sbx, "process.Process/List", {}, headers={"X-Access-Token": "wrong"})
    assert r.status_code == 401
    assert rpc(http, sbx, "process.Process/List", {}).status_code == 200


def test_process_start_stream(http: httpx.Client, sbx: dict[str, Any]) -> None:
    msgs, end = stream_rpc(http, sbx, "process.Process/Start", {
        "process": {"cmd": "/bin/bash", "args": ["-l", "-c", "echo $FOO; echo oops >&2; exit 3"], "envs": {}},
        "stdin": False,
    })
    assert end == {}
    assert "start" in msgs[0]["event"] and msgs[0]["event"]["start"]["pid"] > 0
    out = b"".join(base64.b64decode(m["event"]["data"].get("stdout", "")) for m in msgs if "data" in m["event"])
    err = b"".join(base64.b64decode(m["event"]["data"].get("stderr", "")) for m in msgs if "data" in m["event"])
    assert out == b"bar\n" and err == b"oops\n"
    assert msgs[-1]["event"]["end"]["exitCode"] == 3 and msgs[-1]["event"]["end"]["status"] == "exit status 3"


def test_process_keepalive_and_timeout(http: httpx.Client, sbx: dict[str, Any]) -> None:
    msgs, _ = stream_rpc(http, sbx, "process.Process/Start",
                         {"process": {"cmd": "/bin/sleep", "args": ["2.5"]}, "stdin": False},
                         headers={"Keepalive-Ping-Interval": "1"})
    assert sum(1 for m in msgs if "keepalive" in m["event"]) >= 1
    assert msgs[-1]["event"]["end"].get("exitCode", 0) == 0
    # Connect-Timeout-Ms bounds the process: it is killed at the deadline.
    t = time.monotonic()
    msgs, end = stream_rpc(http, sbx, "process.Process/Start",
                           {"process": {"cmd": "/bin/sleep", "args": ["30"]}, "stdin": False},
                           headers={"Connect-Timeout-Ms": "1000"})
    assert time.monotonic() - t < 10
    ends = [m["event"]["end"] for m in msgs if "end" in m["event"]]
    assert (ends and "killed" in ends[0]["status"]) or end.get("error", {}).get("code") == "deadline_exceeded"


def test_process_errors(http: httpx.Client, sbx: dict[str, Any]) -> None:
    r = rpc(http, sbx, "process.Process/SendSignal", {"process": {"pid": 999999}, "signal": "SIGNAL_SIGKILL"})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    root = {"Authorization": "Basic " + base64.b64encode(b"root:").decode()}
    assert rpc(http, sbx, "process.Process/List", {}, headers=root).status_code == 200  # the sandbox's root
    stranger = {"Authorization": "Basic " + base64.b64encode(b"mallory:").decode()}
    r = rpc(http, sbx, "process.Process/List", {}, headers=stranger)
    assert r.status_code in (400, 403) and "mallory" in r.json()["message"], r.text
    r = rpc(http, sbx, "process.Process/List", {}, headers={"Content-Type": "application/json"}, )
    assert r.status_code == 200
    r = http.post("/process.Process/List", content=b"{bad", headers={**envd(sbx), "Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["code"] == "invalid_argument"


def test_filesystem_rpcs(http: httpx.Client, sbx: dict[str, Any]) -> None:
    r = rpc(http, sbx, "filesystem.Filesystem/MakeDir", {"path": "/home/user/rpcdir/sub"})
    assert r.status_code == 200 and r.json()["entry"]["type"] == "FILE_TYPE_DIRECTORY"
    r = rpc(http, sbx, "filesystem.Filesystem/MakeDir", {"path": "/home/user/rpcdir/sub"})
    assert r.status_code == 409 and r.json()["code"] == "already_exists"
    r = rpc(http, sbx, "filesystem.Filesystem/ListDir", {"path": "/home/user/rpcdir", "depth": 1})
    assert [e["name"] for e in r.json()["entries"]] == ["sub"]
    r = rpc(http, sbx, "filesystem.Filesystem/Stat", {"path": "/home/user/missing"})
    assert r.status_code == 404 and r.json()["code"] == "not_found"
    r = rpc(http, sbx, "filesystem.Filesystem/Move",
            {"source": "/home/user/rpcdir/sub", "destination": "/home/user/rpcdir/moved"})
    assert r.status_code == 200 and r.json()["entry"]["path"] == "/home/user/rpcdir/moved"
    assert rpc(http, sbx, "filesystem.Filesystem/Remove", {"path": "/home/user/rpcdir"}).status_code == 200
    r = rpc(http, sbx, "filesystem.Filesystem/Stat", {"path": ""})
    assert r.status_code == 400


def test_files_upload_download(http: httpx.Client, sbx: dict[str, Any]) -> None:
    h = envd(sbx)
    r = http.post("/files", params={"path": "/home/user/up/one.txt"}, files=[("file", ("/home/user/up/one.txt", b"one"))],
                  headers={**h, "X-Metadata-Owner": "tests"})
    assert r.status_code == 200, r.text
    assert r.json()[0]["path"] == "/home/user/up/one.txt" and r.json()[0]["type"] == "file"
    r = http.post("/files", files=[("file", ("/home/user/up/a", b"A")), ("file", ("/home/user/up/b", b"B"))], headers=h)
    assert r.status_code == 200 and [e["name"] for e in r.json()] == ["a", "b"]
    r = http.post("/files", params={"path": "up/c.bin"}, content=gzip.compress(b"\x00\x01" * 1000),
                  headers={**h, "Content-Type": "application/octet-stream", "Content-Encoding": "gzip"})
    assert r.status_code == 200, r.text
    r = http.get("/files", params={"path": "up/c.bin"}, headers={**h, "Accept-Encoding": "identity"})
    assert r.status_code == 200 and r.content == b"\x00\x01" * 1000
    assert r.headers["content-type"] == "application/octet-stream"
    r = http.get("/files", params={"path": "/home/user/up/b"}, headers={**h, "Accept-Encoding": "gzip"})
    assert r.headers.get("content-encoding") == "gzip" and r.content == b"B"
    assert_error(http.get("/files", params={"path": "/home/user/up/zzz"}, headers=h), 404)
    assert_error(http.get("/files", params={"path": "/home/user/up"}, headers=h), 400)
    assert_error(http.get("/files", headers=h), 400)
    assert_error(http.post("/files", content=b"x", headers={**h, "Content-Type": "application/octet-stream"}), 400)


def test_files_auth(http: httpx.Client, sbx: dict[str, Any]) -> None:
    path = "/home/user/signed.txt"
    http.post("/files", params={"path": path}, content=b"s", headers={**envd(sbx), "Content-Type": "application/octet-stream"})
    no_token = envd(sbx, token=False)
    assert_error(http.get("/files", params={"path": path}, headers=no_token), 401)
    from e2b.sandbox.signature import get_signature

    sig = get_signature(path, "read", None, sbx["envdAccessToken"], 60)
    r = http.get("/files", params={"path": path, "signature": sig["signature"],
                                   "signature_expiration": sig["expiration"]}, headers=no_token)
    assert r.status_code == 200 and r.content == b"s"
    bad = get_signature(path, "write", None, sbx["envdAccessToken"])  # wrong operation
    assert_error(http.get("/files", params={"path": path, "signature": bad["signature"]}, headers=no_token), 401)
    assert http.get("/files", params={"path": path, "username": "root"}, headers=envd(sbx)).status_code == 200
    assert_error(http.get("/files", params={"path": path, "username": "mallory"}, headers=envd(sbx)), 401, "mallory")


# --- code interpreter ---------------------------------------------------------------------------------


def execute(http: httpx.Client, sbx: dict[str, Any], body: dict[str, Any]) -> tuple[int, list[dict[str, Any]]]:
    r = http.post("/execute", json=body, headers=envd(sbx, 49999))
    if r.status_code != 200:
        return r.status_code, [r.json()]
    return 200, [json.loads(line) for line in r.text.splitlines() if line.strip()]


def test_execute_stream(http: httpx.Client, sbx: dict[str, Any]) -> None:
    status, lines = execute(http, sbx, {"code": "print('hi')\n21*2"})
    assert status == 200
    types = [ln["type"] for ln in lines]
    assert types[-1] == "end_of_execution"
    assert any(ln["type"] == "stdout" and ln["text"] == "hi\n" for ln in lines)
    assert any(ln["type"] == "result" and ln["text"] == "42" and ln["is_main_result"] for ln in lines)
    status, lines = execute(http, sbx, {"code": "1/0"})
    err = next(ln for ln in lines if ln["type"] == "error")
    assert err["name"] == "ZeroDivisionError" and lines[-1]["type"] == "end_of_execution"


def test_execute_lines_reach_the_client_as_they_happen(http: httpx.Client, sbx: dict[str, Any]) -> None:
    # The server joins the writes of one turn of its loop into one send: never lines that come apart.
    code = "import time\nprint('first')\ntime.sleep(1)\nprint('second')\n'done'"
    start = time.monotonic()
    arrivals: list[tuple[str, float]] = []
    with http.stream("POST", "/execute", json={"code": code}, headers=envd(sbx, 49999)) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.strip():
                ln = json.loads(line)
                arrivals.append((ln.get("text") or ln["type"], time.monotonic() - start))
    names = [a[0] for a in arrivals if a[0] != "keepalive"]
    assert names[0] == "number_of_executions" or names[0] == "first\n"
    assert names[-3:] == ["second\n", "done", "end_of_execution"]
    first = next(t for name, t in arrivals if name == "first\n")
    assert first < 0.8 <= arrivals[-1][1]


def test_execute_errors(http: httpx.Client, sbx: dict[str, Any]) -> None:
    r = http.post("/execute", json={"code": "1"}, headers=envd(sbx, 49999, token=False))
    assert r.status_code == 401
    assert execute(http, sbx, {"code": "1", "context_id": "x", "language": "python"})[0] == 400
    assert execute(http, sbx, {"code": "1", "context_id": "nope"})[0] == 404
    assert execute(http, sbx, {"code": 5})[0] == 400
    r = http.post("/execute", content=b"nope", headers={**envd(sbx, 49999), "Content-Type": "application/json"})
    assert r.status_code == 400


def test_execute_keepalive_and_disconnect(http: httpx.Client, sbx: dict[str, Any]) -> None:
    status, lines = execute(http, sbx, {"code": "import time; time.sleep(6); 'done'"})
    assert status == 200 and any(ln["type"] == "keepalive" for ln in lines)
    assert lines[-1]["type"] == "end_of_execution"
    # A client that goes away interrupts the run; the context stays usable.
    with pytest.raises(httpx.ReadTimeout):
        http.post("/execute", json={"code": "import time; time.sleep(60)"}, headers=envd(sbx, 49999), timeout=1.5)
    t = time.monotonic()
    status, lines = execute(http, sbx, {"code": "'after'"})
    assert time.monotonic() - t < 20
    assert any(ln.get("text") == "after" for ln in lines)


def test_contexts(http: httpx.Client, sbx: dict[str, Any]) -> None:
    # The official SDK sends the traffic token, not the access token, on /contexts.
    h = {**envd(sbx, 49999, token=False), "E2B-Traffic-Access-Token": sbx["trafficAccessToken"]}
    r = http.post("/contexts", json={"language": "python", "cwd": "/tmp"}, headers=h)
    assert r.status_code == 200, r.text
    ctx = r.json()
    assert ctx["language"] == "python" and ctx["cwd"] == "/tmp" and ctx["id"]
    assert execute(http, sbx, {"code": "y = 5", "context_id": ctx["id"]})[0] == 200
    _, lines = execute(http, sbx, {"code": "y", "context_id": ctx["id"]})
    assert any(ln.get("text") == "5" for ln in lines)
    assert ctx["id"] in [c["id"] for c in http.get("/contexts", headers=h).json()]
    assert http.post(f"/contexts/{ctx['id']}/restart", headers=h).status_code == 204
    _, lines = execute(http, sbx, {"code": "y", "context_id": ctx["id"]})
    assert any(ln["type"] == "error" and ln["name"] == "NameError" for ln in lines)
    assert http.delete(f"/contexts/{ctx['id']}", headers=h).status_code == 204
    assert http.delete(f"/contexts/{ctx['id']}", headers=h).status_code == 404
    assert http.post("/contexts", json={"language": "cobol"}, headers=h).status_code == 400


# --- robustness ----------------------------------------------------------------------------------------


def test_api_key_not_required_by_default(server_url: str) -> None:
    assert httpx.get(f"{server_url}/v2/sandboxes").status_code == 200


def test_kill_does_not_disturb_neighbours(http: httpx.Client, sbx: dict[str, Any]) -> None:
    others = [create(http) for _ in range(2)]
    assert http.delete(f"/sandboxes/{others[0]['sandboxID']}").status_code == 204
    msgs, _ = stream_rpc(http, others[1], "process.Process/Start",
                         {"process": {"cmd": "/bin/echo", "args": ["alive"]}, "stdin": False})
    assert any("data" in m["event"] for m in msgs)
    assert http.get("/health", headers=envd(sbx)).status_code == 204
    http.delete(f"/sandboxes/{others[1]['sandboxID']}")


def _host_pid_of_agent(marker: str) -> int:
    """The host pid of the sandbox init (agent) that is an ancestor of the process running `marker`."""
    import os

    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if marker.encode() not in f.read():
                    continue
        except OSError:
            continue
        pid = int(entry)
        while pid > 1:
            with open(f"/proc/{pid}/status") as f:
                status = dict(line.split(":", 1) for line in f if ":" in line)
            if status["NSpid"].split()[-1] == "1":
                return pid
            pid = int(status["PPid"])
    raise AssertionError(f"no process runs {marker}")


def test_dead_agent_removes_only_its_sandbox(http: httpx.Client, sbx: dict[str, Any]) -> None:
    import os
    import signal

    victim = create(http)
    marker = f"{time.time_ns() % 10**6}.123"
    rpc_headers = {**envd(victim), "Content-Type": "application/connect+json", "Connect-Protocol-Version": "1"}
    raw = json.dumps({"process": {"cmd": "/bin/sleep", "args": [marker]}, "stdin": False}).encode()
    with httpx.Client(base_url=str(http.base_url), timeout=30) as c, c.stream(
        "POST", "/process.Process/Start", content=b"\x00" + struct.pack(">I", len(raw)) + raw, headers=rpc_headers
    ) as r:
        assert r.status_code == 200
        deadline = time.monotonic() + 10
        while True:
            try:
                agent = _host_pid_of_agent(marker)
                break
            except AssertionError:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        os.kill(agent, signal.SIGKILL)
        with pytest.raises(httpx.RemoteProtocolError):  # cut off, as E2B's proxy cuts a dead sandbox's stream
            r.read()
    deadline = time.monotonic() + 10
    while http.get(f"/sandboxes/{victim['sandboxID']}").status_code != 404:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert http.get("/health", headers=envd(victim)).status_code == 502
    assert http.get("/health", headers=envd(sbx)).status_code == 204
    msgs, _ = stream_rpc(http, sbx, "process.Process/Start",
                         {"process": {"cmd": "/bin/echo", "args": ["ok"]}, "stdin": False})
    assert any("data" in m["event"] for m in msgs)


async def test_api_key_is_enforced_when_configured() -> None:
    from agentcell.server import ServerConfig, create_app

    app = create_app(ServerConfig(api_key="sekret"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost") as c:
        r = await c.get("/v2/sandboxes")
        assert r.status_code == 401 and r.json()["code"] == 401
        assert (await c.get("/v2/sandboxes", headers={"X-API-KEY": "wrong"})).status_code == 401
        assert (await c.get("/v2/sandboxes", headers={"X-API-KEY": "sekret"})).status_code == 200
        # the data plane does not take the API key: an unknown sandbox is still a 502
        r = await c.get("/health", headers={"E2b-Sandbox-Id": "abc", "E2b-Sandbox-Port": "49983"})
        assert r.status_code == 502


def test_started_after_and_before_are_inclusive(http: httpx.Client) -> None:
    r = http.post("/v2/sandboxes", json={"templateID": "base", "timeout": 60})
    assert r.status_code == 201, r.text
    sid = r.json()["sandboxID"]
    try:
        started = http.get(f"/sandboxes/{sid}").json()["startedAt"]
        ids = lambda q: [s["sandboxID"] for s in http.get("/v2/sandboxes", params=q).json()]  # noqa: E731
        assert sid in ids({"startedAfter": started})
        assert sid in ids({"startedBefore": started})
        assert sid not in ids({"startedBefore": "2000-01-01T00:00:00Z"})
        assert http.get("/v2/sandboxes", params={"startedBefore": "yesterday"}).status_code == 400
    finally:
        http.delete(f"/sandboxes/{sid}")


def test_e2b_paths_agentcell_does_not_serve_say_so(http: httpx.Client) -> None:
    # (template builds are served: tests/test_template_builds.py; the old v2 build API and updates are not;
    # secrets: tests/test_vault.py)
    for method, path in (("GET", "/sandboxes/metrics"), ("POST", "/v2/templates"), ("GET", "/default-templates"),
                         ("PATCH", "/templates/abc"),
                         ("GET", "/sandboxes/abc/logs"), ("GET", "/v2/sandboxes/abc/logs")):
        r = http.request(method, path, json={} if method == "POST" else None)
        assert r.status_code == 501 and "not supported" in r.json()["message"], (method, path, r.text)
    assert http.get("/templates/aliases/base").json() == {"templateID": "base", "public": True}
    assert http.get("/templates/aliases/code-interpreter-v1").status_code == 200
    assert http.get("/templates/aliases/nope").status_code == 404


def test_e2b_template_exists(e2b_env: str) -> None:
    from e2b import Template

    assert Template.exists("base") is True
    assert Template.exists("no-such-template") is False
