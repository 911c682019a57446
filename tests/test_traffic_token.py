"""What a port visitor may reach (issue 25 #13): the `E2B-Traffic-Access-Token` opens the sandbox's
ports and, on the code interpreter, only the context endpoints the official code-interpreter SDK
calls with it alone (list, create, restart, delete a context); never `/execute`, never envd
(commands, files, PTYs). A real server, real sandboxes; each refused call would have left a mark in
the sandbox had it run, and the owner checks that none is there.
"""

from __future__ import annotations

import json
import struct
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentcell import Sandbox
from tests.helpers import create_sandbox


def _plane(s: dict[str, Any], port: int, **headers: str) -> dict[str, str]:
    return {"E2b-Sandbox-Id": s["sandboxID"], "E2b-Sandbox-Port": str(port), **headers}


def _connect_envelope(message: dict[str, Any]) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack(">BI", 0, len(body)) + body


@pytest.fixture(params=[True, False], ids=["public", "private"])
def visited(request: pytest.FixtureRequest, server_url: str) -> Iterator[tuple[httpx.Client, dict[str, Any]]]:
    """A sandbox (ports public or not) and a client holding nothing but its traffic token."""
    with httpx.Client(base_url=server_url, timeout=60) as http:
        sbx = create_sandbox(http, network={"allowPublicTraffic": request.param})
        try:
            yield http, sbx
        finally:
            http.delete(f"/sandboxes/{sbx['sandboxID']}")


def _exists(http: httpx.Client, sbx: dict[str, Any], path: str) -> bool:
    """Asked by the owner (the access token): is `path` in the sandbox?"""
    r = http.get("/files", params={"path": path}, headers=_plane(sbx, 49983, **{"X-Access-Token": sbx["envdAccessToken"]}))
    assert r.status_code in (200, 404), r.text
    return r.status_code == 200


def test_the_traffic_token_runs_no_code_and_opens_no_envd(visited: tuple[httpx.Client, dict[str, Any]],
                                                          neighbour: Sandbox) -> None:
    http, sbx = visited
    traffic = {"E2B-Traffic-Access-Token": sbx["trafficAccessToken"]}
    marks = [f"/tmp/visitor-{uuid.uuid4().hex[:8]}" for _ in range(4)]
    # the code interpreter's /execute: with the token alone, and beside a made-up access token
    for extra in ({}, {"X-Access-Token": "made-up"}):
        r = http.post("/execute", json={"code": f"open({marks[0]!r}, 'w').write('ran')"},
                      headers=_plane(sbx, 49999, **traffic, **extra))
        assert r.status_code == 401, r.text
        assert "X-Access-Token" in r.json()["message"]
    # paths that only look like the context endpoints
    for method, path in (("POST", "/contexts/x/restart/"), ("POST", "/contexts/%2E%2E/execute"),
                         ("POST", "/execute/"), ("GET", "/contexts/x"), ("PUT", "/contexts")):
        r = http.request(method, path, json={"code": f"open({marks[0]!r}, 'w')"}, headers=_plane(sbx, 49999, **traffic))
        assert r.status_code == 401, (method, path, r.status_code)
    # envd: a command (Connect, streamed), a PTY, a directory listing, a file read and an upload
    envelope = _connect_envelope({"process": {"cmd": "/bin/sh", "args": ["-c", f"echo ran > {marks[1]}"]}})
    for message in (envelope, _connect_envelope({"process": {"cmd": "/bin/sh", "args": ["-c", f"touch {marks[2]}"]},
                                                 "pty": {"size": {"cols": 80, "rows": 24}}})):
        r = http.post("/process.Process/Start", content=message,
                      headers=_plane(sbx, 49983, **traffic, **{"Content-Type": "application/connect+json"}))
        assert r.status_code == 401 and r.json()["code"] == "unauthenticated", r.text
    r = http.post("/filesystem.Filesystem/ListDir", json={"path": "/home/user"}, headers=_plane(sbx, 49983, **traffic))
    assert r.status_code == 401
    assert http.get("/files", params={"path": "/etc/hostname"}, headers=_plane(sbx, 49983, **traffic)).status_code == 401
    r = http.post("/files", params={"path": marks[3]}, files={"file": ("x", b"uploaded")},
                  headers=_plane(sbx, 49983, **traffic))
    assert r.status_code == 401
    assert not any(_exists(http, sbx, m) for m in marks), "a call refused with 401 ran anyway"

    # what the token does open: the context endpoints the official SDK calls with it alone
    assert http.get("/contexts", headers=_plane(sbx, 49999, **traffic)).status_code == 200
    r = http.post("/contexts", json={"language": "python"}, headers=_plane(sbx, 49999, **traffic))
    assert r.status_code == 200, r.text
    ctx = r.json()["id"]
    assert http.post(f"/contexts/{ctx}/restart", headers=_plane(sbx, 49999, **traffic)).status_code == 204
    assert http.delete(f"/contexts/{ctx}", headers=_plane(sbx, 49999, **traffic)).status_code == 204
    # and the sandbox's ports (a closed one here: past the check, the server says it is not open)
    r = http.get("/", headers={"Host": f"8000-{sbx['sandboxID']}.localhost", **traffic})
    assert r.status_code != 401, r.text

    # the owner's access token still does everything; the neighbour and the server are as they were
    owner = _plane(sbx, 49999, **{"X-Access-Token": sbx["envdAccessToken"]})
    lines = [json.loads(x) for x in http.post("/execute", json={"code": "6 * 7"}, headers=owner).text.splitlines()]
    assert any(ln.get("text") == "42" for ln in lines)
    assert neighbour.run_code("canary").text == "alive"
    assert http.get("/health").status_code == 200


def test_the_official_code_interpreter_sdk_still_works(e2b_env: str, neighbour: Sandbox) -> None:
    """It sends the traffic token alone on the context endpoints and both tokens on /execute."""
    from e2b_code_interpreter import Sandbox as CodeSandbox

    for network in (None, {"allow_public_traffic": False}):
        sbx = CodeSandbox.create(network=network) if network else CodeSandbox.create()
        try:
            assert sbx.traffic_access_token
            assert sbx.run_code("x = 41; x + 1").text == "42"
            ctx = sbx.create_code_context(cwd="/tmp")
            sbx.run_code("v = 'in ctx'", context=ctx)
            assert sbx.run_code("v", context=ctx).text == "in ctx"
            assert ctx.id in [c.id for c in sbx.list_code_contexts()]
            sbx.restart_code_context(ctx)
            after = sbx.run_code("v", context=ctx)
            assert after.error is not None and after.error.name == "NameError"  # a restart loses its state
            sbx.remove_code_context(ctx)
            assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
            assert sbx.run_code("x").text == "41"  # the default context kept its own
        finally:
            sbx.kill()
    assert neighbour.run_code("canary").text == "alive"
