"""A sandbox's lifecycle state (server/sandbox_state.py) and the two races it closes, driven without
sleeps: a server runs in this process (its real backend, AGENTCELL_TEST_BACKEND picks it) and the
test holds the backend's pause, or its write to disk, at a point it waits for.

(a) a sandbox whose timeout passed and whose lifecycle pauses it is "pausing" from that moment, and
    a get_info or connect while that pause is under way (gvisor's is slow) finds it, paused;
(b) a server stopping while a frozen sandbox is written to disk (gvisor's checkpoint stops the
    sandbox: its agent channel closes before the registry knows it is on disk) keeps it for the next run.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentcell.server import ServerConfig, create_app
from agentcell.server.app import AgentcellApp
from agentcell.server.registry import SandboxRecord
from agentcell.server.sandbox_state import TRANSITIONS, InvalidTransitionError, SandboxLife, SandboxState

BACKEND = os.environ.get("AGENTCELL_TEST_BACKEND", "linux")
S = SandboxState


# the state machine ------------------------------------------------------------------------------------

def test_every_transition_not_in_the_table_is_refused() -> None:
    for old in S:
        for new in S:
            life = SandboxLife("sbx", old)
            if new in TRANSITIONS[old]:
                life.to(new)
                assert life.state is new
            else:
                with pytest.raises(InvalidTransitionError) as e:
                    life.to(new)
                assert e.value.old is old and e.value.new is new and life.state is old
                assert f"from {old} to {new}" in str(e.value)


def test_only_running_is_running_to_e2b_and_gone_is_final() -> None:
    assert [s for s in S if s.api_state == "running"] == [S.RUNNING]
    assert TRANSITIONS[S.GONE] == frozenset()
    assert all(S.KILLING in TRANSITIONS[s] for s in S if s not in (S.KILLING, S.GONE))


async def test_settled_waits_out_a_transition_under_way() -> None:
    life = SandboxLife("sbx")
    life.to(S.PAUSING)
    waiter = asyncio.ensure_future(life.settled())
    await asyncio.sleep(0)
    assert not waiter.done()
    life.to(S.PAUSED)
    assert await waiter is S.PAUSED


# an in-process server ------------------------------------------------------------------------------

@contextlib.asynccontextmanager
async def served(state_dir: Path) -> AsyncIterator[tuple[AgentcellApp, httpx.AsyncClient, Callable[[], Awaitable[None]]]]:
    """A real server app (lifespan and all) on this event loop, a client of it, and its shutdown."""
    config = ServerConfig(backend=BACKEND, state_dir=str(state_dir), standbys=0, egress_uplink="none",
                          record=False, hibernate_after=None)
    app = create_app(config)
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    life = asyncio.ensure_future(app({"type": "lifespan"}, inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    started = await outbox.get()
    assert started["type"] == "lifespan.startup.complete", started
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://localhost",
                                     timeout=120) as http:
            yield app, http, lambda: stop(inbox, outbox, life)
    finally:
        await stop(inbox, outbox, life)


async def stop(inbox: asyncio.Queue[dict[str, Any]], outbox: asyncio.Queue[dict[str, Any]],
               life: asyncio.Future[None]) -> None:
    if life.done():
        return
    await inbox.put({"type": "lifespan.shutdown"})
    assert (await outbox.get())["type"] == "lifespan.shutdown.complete"
    await life


def envd(sbx: dict[str, Any]) -> dict[str, str]:
    return {"E2b-Sandbox-Id": sbx["sandboxID"], "E2b-Sandbox-Port": "49983", "X-Access-Token": sbx["envdAccessToken"]}


async def create(http: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    r = await http.post("/sandboxes", json={"templateID": "base", **body})
    assert r.status_code == 201, r.text
    return r.json()


def hold_after(obj: Any, name: str, then: Callable[[], Awaitable[None]] | None = None
               ) -> tuple[asyncio.Event, asyncio.Event]:
    """Wrap the backend method `name`: it runs for real, then (`then`, and) holds until released.
    Returns (reached, release)."""
    real = getattr(obj, name)
    reached, release = asyncio.Event(), asyncio.Event()

    async def held(*args: Any, **kwargs: Any) -> Any:
        result = await real(*args, **kwargs)
        if then is not None:
            await then()
        reached.set()
        await release.wait()
        return result

    setattr(obj, name, held)
    return reached, release


def record_of(app: AgentcellApp, sandbox_id: str) -> SandboxRecord:
    rec = app.manager.find(sandbox_id)
    assert rec is not None
    return rec


# (a) a lookup while the timeout's pause is under way ----------------------------------------------------

async def test_a_sandbox_past_its_end_is_pausing_at_once_and_found_paused_during_the_pause(tmp_path: Path) -> None:
    async with served(tmp_path / "state") as (app, http, _):
        sbx = await create(http, timeout=120, autoPause=True)
        assert (await http.get("/health", headers=envd(sbx))).status_code == 204
        frozen, release = hold_after(app.manager.backend, "pause")  # frozen for real, the registry's pause held
        try:
            await _found_paused_during_the_pause(app, http, sbx, frozen, release)
        finally:
            release.set()  # a failed assertion must not leave the pause held (the server could not stop)


async def _found_paused_during_the_pause(app: AgentcellApp, http: httpx.AsyncClient, sbx: dict[str, Any],
                                         frozen: asyncio.Event, release: asyncio.Event) -> None:
    sid = sbx["sandboxID"]
    rec = record_of(app, sid)

    # the moment its end passes it is pausing: before the reaper, or anything else, runs
    app.manager.set_timeout(rec, 0)
    assert app.manager.find(sid) is rec and rec.state is S.PAUSING
    assert app.manager.get(sid) is None  # not running any more

    await frozen.wait()  # the backend's pause is done, the registry's is not
    assert rec.state is S.PAUSING
    for _ in range(3):  # get_info, as often as one likes: never 404, always paused
        r = await http.get(f"/sandboxes/{sid}")
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "paused"
    listed = (await http.get("/v2/sandboxes", params={"state": "paused"})).json()
    assert sid in [s["sandboxID"] for s in listed]
    running = (await http.get("/v2/sandboxes", params={"state": "running"})).json()
    assert sid not in [s["sandboxID"] for s in running]
    # the data plane answers as for a paused sandbox (no auto_resume): E2B's "not found"
    assert (await http.get("/health", headers=envd(sbx))).status_code == 502

    # a connect now waits for the pause, then resumes the sandbox
    order: list[str] = []
    connect = asyncio.ensure_future(http.post(f"/sandboxes/{sid}/connect", json={"timeout": 60}))
    connect.add_done_callback(lambda _: order.append("connect answered"))
    paused = asyncio.ensure_future(rec.life.reached(S.PAUSED))
    paused.add_done_callback(lambda _: order.append("paused"))
    await asyncio.sleep(0)
    assert not connect.done() and not paused.done()  # the pause is held: neither can end
    release.set()
    r = await connect
    assert r.status_code == 201, r.text  # resumed
    assert order == ["paused", "connect answered"]
    assert rec.state is S.RUNNING
    assert (await http.get(f"/sandboxes/{sid}")).json()["state"] == "running"
    assert (await http.get("/health", headers=envd(sbx))).status_code == 204  # thawed, its agent answers
    assert (await http.delete(f"/sandboxes/{sid}")).status_code == 204
    assert rec.state in (S.KILLING, S.GONE)


async def test_a_timeout_pause_that_fails_kills_the_sandbox(tmp_path: Path) -> None:
    async with served(tmp_path / "state") as (app, http, _):
        sid = (await create(http, timeout=120, autoPause=True))["sandboxID"]
        rec = record_of(app, sid)
        app.manager.retention = type(app.manager.retention)(max_paused=0)  # no room for a paused one
        app.manager.set_timeout(rec, 0)
        assert app.manager.find(sid) is rec and rec.state is S.PAUSING
        await rec.life.reached(S.GONE)
        assert (await http.get(f"/sandboxes/{sid}")).status_code == 404


# (b) a server stopping while a frozen sandbox is written to disk ------------------------------------------

async def test_a_frozen_sandbox_written_to_disk_at_shutdown_survives_its_channel_closing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with served(state) as (app, http, shutdown):
        sbx = await create(http, timeout=120, metadata={"k": "v"})
        sid = sbx["sandboxID"]
        r = await http.post("/files", params={"path": "/home/user/kept.txt"},
                            files=[("file", ("/home/user/kept.txt", b"kept across the restart"))], headers=envd(sbx))
        assert r.status_code == 200, r.text
        assert (await http.post(f"/sandboxes/{sid}/pause", json={})).status_code == 204
        rec = record_of(app, sid)
        assert rec.state is S.PAUSED and not rec.on_disk
        if app.manager.backend.files_while_frozen:  # its crash copy (an export of its own) is taken first
            for _ in range(200):
                if rec.crash_copy is not None:
                    break
                await asyncio.sleep(0.05)
            assert rec.crash_copy is not None and rec.crash_copy.exists()
        channel = rec.channel
        assert channel is not None
        watcher = next(t for t in app.manager._tasks
                       if t.get_coro().cr_frame is not None and t.get_coro().cr_frame.f_locals.get("channel") is channel)

        async def channel_closed() -> None:
            # gvisor's checkpoint stops the sandbox: its channel closes while the registry writes it to disk.
            # The linux backend's write (an export of its files) leaves it open: close it as the checkpoint would.
            if not app.manager.backend.memory_snapshots:
                await channel.close("the checkpoint stopped the sandbox")
            await channel.closed.wait()
            await watcher  # the channel watcher has seen it close, and done what it does about it

        write = "checkpoint" if app.manager.backend.memory_snapshots else "export_files"
        written, release = hold_after(app.manager.backend, write, channel_closed)
        stopping = asyncio.ensure_future(shutdown())  # the server stops: it writes its frozen sandboxes to disk
        try:
            await written.wait()
            assert rec.state is S.PERSISTING
            assert app.manager.find(sid) is rec  # not taken for a sandbox that died
        finally:
            release.set()
            await stopping
    assert (state / "paused" / f"{sid}.json").exists()
    assert not (state / "paused" / f"{sid}.crash.tar").exists()  # the shutdown's write replaced the crash copy

    async with served(state) as (app, http, _):
        r = await http.get(f"/sandboxes/{sid}")
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "paused" and r.json()["metadata"] == {"k": "v"}
        assert (await http.post(f"/sandboxes/{sid}/connect", json={"timeout": 60})).status_code == 201
        r = await http.get("/files", params={"path": "/home/user/kept.txt"}, headers=envd(sbx))
        assert r.status_code == 200 and r.content == b"kept across the restart"
        assert (await http.delete(f"/sandboxes/{sid}")).status_code == 204
