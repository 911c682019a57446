"""Pause and resume, lifecycle (on_timeout pause, auto_resume), retention: real sandboxes on the linux
backend, through agentcell's SDK, the official e2b SDK and raw HTTP."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest

from agentcell import Sandbox
from agentcell.errors import SandboxException
from tests.conftest import ServerProcess

TICKER = "while :; do date +%s.%N >> /tmp/ticks; sleep 0.05; done"


def _wait_state(sbx: Sandbox, state: str, within: float = 10) -> None:
    deadline = time.monotonic() + within
    while sbx.get_info().state != state:
        assert time.monotonic() < deadline, f"sandbox never became {state}"
        time.sleep(0.1)


def _largest_gap(ticks: str) -> float:
    times = [float(t) for t in ticks.split()]
    return max(b - a for a, b in zip(times, times[1:], strict=False))


def test_pause_freezes_everything_and_resume_keeps_memory(server_url: str, neighbour: Sandbox) -> None:
    sbx = Sandbox.create(api_url=server_url, timeout=120)
    try:
        sbx.run_code("x = 41")
        sbx.commands.run(TICKER, background=True)
        time.sleep(0.3)
        assert sbx.pause() is True
        assert sbx.pause() is False  # already paused: E2B's 409
        assert not sbx.is_running()
        info = sbx.get_info()
        assert info.state == "paused" and info.pause_mode == "full"
        with pytest.raises(SandboxException):
            sbx.run_code("x")  # the data plane answers E2B's 502 "not found" while paused
        paused = [s.sandbox_id for s in Sandbox.list(query=_query(["paused"]), api_url=server_url)]
        running = [s.sandbox_id for s in Sandbox.list(query=_query(["running"]), api_url=server_url)]
        assert sbx.sandbox_id in paused and sbx.sandbox_id not in running
        time.sleep(1.5)  # the ticker must not tick: its processes are frozen
        sbx.connect()
        assert sbx.get_info().state == "running"
        assert sbx.run_code("x + 1").text == "42"
        time.sleep(0.3)
        assert _largest_gap(sbx.files.read("/tmp/ticks")) >= 1.4
        assert neighbour.run_code("canary").text == "alive"
    finally:
        sbx.kill()


def _query(states: list[str]):  # type: ignore[no-untyped-def]
    from agentcell.sdk.models import SandboxQuery

    return SandboxQuery(state=states)


def test_paused_sandbox_outlives_its_timeout_and_resume_restarts_the_clock(server_url: str) -> None:
    sbx = Sandbox.create(api_url=server_url, timeout=2)
    try:
        sbx.run_code("kept = 'yes'")
        sbx.pause()
        time.sleep(3)  # past its timeout: a paused sandbox is not reaped
        assert sbx.get_info().state == "paused"
        resumed = Sandbox.connect(sbx.sandbox_id, timeout=30, api_url=server_url)
        assert resumed.run_code("kept").text == "yes"
        left = (resumed.get_info().end_at.timestamp() - time.time())
        assert 20 < left <= 31
    finally:
        sbx.kill()


def test_kill_of_a_paused_sandbox(server_url: str, neighbour: Sandbox) -> None:
    sbx = Sandbox.create(api_url=server_url, timeout=60)
    sbx.commands.run("sleep 1000", background=True)
    sbx.pause()
    t0 = time.monotonic()
    assert sbx.kill() is True
    assert time.monotonic() - t0 < 5
    with pytest.raises(SandboxException):
        sbx.get_info()
    assert neighbour.run_code("canary").text == "alive"


def test_on_timeout_pause_then_explicit_resume(server_url: str) -> None:
    sbx = Sandbox.create(api_url=server_url, timeout=4, lifecycle={"on_timeout": "pause"})
    try:
        sbx.run_code("n = 7")
        info = sbx.get_info()
        assert info.lifecycle == {"onTimeout": "pause", "autoResume": False}
        _wait_state(sbx, "paused")
        assert not sbx.is_running()  # no auto_resume: traffic does not wake it
        assert sbx.get_info().state == "paused"
        sbx.connect(timeout=60)
        assert sbx.run_code("n * 6").text == "42"
    finally:
        sbx.kill()


def test_auto_resume_on_traffic_but_not_for_strangers(server_url: str) -> None:
    sbx = Sandbox.create(api_url=server_url, timeout=2, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sbx.run_code("state = [1, 2, 3]")
        _wait_state(sbx, "paused")
        # a request without the sandbox's access token is refused and wakes nothing
        r = httpx.post(f"{server_url}/process.Process/List", json={},
                       headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983",
                                "Content-Type": "application/json", "Connect-Protocol-Version": "1"})
        assert r.status_code == 401
        assert sbx.get_info().state == "paused"
        # the tenant's own request resumes it transparently, with its memory
        assert sbx.run_code("sum(state)").text == "6"
        assert sbx.get_info().state == "running"
    finally:
        sbx.kill()


def test_lifecycle_validation(server_url: str) -> None:
    from agentcell.errors import InvalidArgumentException

    with pytest.raises(InvalidArgumentException):
        Sandbox.create(api_url=server_url, lifecycle={"on_timeout": "kill", "auto_resume": True})
    # the server checks as well (a client that skips the SDK's checks)
    for body in ({"autoResume": {"enabled": True}}, {"autoPause": True, "autoPauseMemory": False,
                                                     "autoResume": {"enabled": True}},
                 {"autoPause": "yes"}, {"autoResume": True}):
        r = httpx.post(f"{server_url}/v2/sandboxes", json={"templateID": "base", **body})
        assert r.status_code == 400, body
        assert r.json()["code"] == 400


def test_pause_of_unknown_sandbox_is_404(server_url: str) -> None:
    for path in ("pause", "snapshots", "fork", "connect", "resume"):
        r = httpx.post(f"{server_url}/sandboxes/nosuchsandbox0000000/{path}", json={})
        assert r.status_code == 404, path


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A server that keeps one paused sandbox, for 3 seconds."""
    log = tmp_path_factory.mktemp("tight") / "server.log"
    srv = ServerProcess(log, "--standbys", "1", "--max-paused", "1", "--paused-ttl", "3")
    srv.wait_ready()
    yield srv
    srv.stop()


def test_retention_bounds_paused_sandboxes(tight_server: ServerProcess) -> None:
    url = tight_server.url
    a = Sandbox.create(api_url=url, timeout=60)
    b = Sandbox.create(api_url=url, timeout=60)
    try:
        a.pause()
        r = httpx.post(f"{url}/sandboxes/{b.sandbox_id}/pause", json={})
        assert r.status_code == 429 and "at most 1 paused" in r.json()["message"]
        assert b.run_code("1 + 1").text == "2"  # refused pause: it runs on
        time.sleep(4.5)  # past --paused-ttl: the paused one is removed
        r = httpx.get(f"{url}/sandboxes/{a.sandbox_id}")
        assert r.status_code == 404
        assert b.pause() is True  # room again
    finally:
        a.kill()
        b.kill()


def test_official_sdk_pause_and_resume(e2b_env: str) -> None:
    from e2b import SandboxQuery, SandboxState
    from e2b_code_interpreter import Sandbox as E2BSandbox

    sbx = E2BSandbox.create(timeout=60)
    try:
        sbx.run_code("x = 41")
        assert sbx.pause() is True
        assert not sbx.is_running()
        assert sbx.pause() is False
        assert sbx.get_info().state == SandboxState.PAUSED
        paused = E2BSandbox.list(query=SandboxQuery(state=[SandboxState.PAUSED])).next_items()
        assert sbx.sandbox_id in [s.sandbox_id for s in paused]
        resumed = E2BSandbox.connect(sbx.sandbox_id)
        assert resumed.sandbox_id == sbx.sandbox_id
        assert resumed.is_running()
        assert resumed.run_code("x + 1").text == "42"
        # connect of a running sandbox: 200, nothing changes
        assert E2BSandbox.connect(sbx.sandbox_id).run_code("x").text == "41"
    finally:
        sbx.kill()


def test_auto_resume_on_a_served_port(server_url: str) -> None:
    """E2B's test_auto_resume_wakes_on_http_request, through header routing instead of HTTPS hosts."""
    sbx = Sandbox.create(api_url=server_url, timeout=3, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        sbx.commands.run("python3 -m http.server 8000 --bind 127.0.0.1", background=True)
        _wait_state(sbx, "paused")
        r = httpx.get(f"{server_url}/", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"},
                      timeout=15)
        assert r.status_code == 200 and "Directory listing" in r.text
        assert sbx.get_info().state == "running"
    finally:
        sbx.kill()
