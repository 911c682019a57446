"""`sbx.approvals`: what a sandbox's "ask" policy holds, waiting for a decision (issue 28).

    sbx = Sandbox.create(policy={"exec": {"default": "ask", "allow": ["python3"]}})
    for req in sbx.approvals.list():          # {"id", "kind": "exec", "path", "argv", "tree", ...}
        sbx.approvals.allow(req["id"], remember=True)
    sbx.approvals.on_approval(lambda req: req["path"] == "/usr/bin/git")   # True allow, False deny, None leave

A request not answered within the policy's ask_timeout_s is denied by the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import httpx

from agentcell.sdk import api, fast_async_http
from agentcell.sdk.config import SandboxConnection
from agentcell.sdk.transport import error_from_http, error_from_transport, sync_client, timeout

Request = dict[str, Any]
Decider = Callable[[Request], "bool | None"]
AsyncDecider = Callable[[Request], "Awaitable[bool | None] | bool | None"]


class Approvals:
    def __init__(self, conn: SandboxConnection) -> None:
        self._conn = conn
        self._watchers: list[_Watcher] = []

    @property
    def _path(self) -> str:
        return f"/sandboxes/{self._conn.sandbox_id}/approvals"

    def list(self, include_decided: bool = False) -> list[Request]:
        """The requests waiting now (with `include_decided`, also the last ones answered)."""
        r = api.call(self._conn.config, "GET", self._path, params={"all": "true"} if include_decided else None,
                     sandbox_id=self._conn.sandbox_id)
        return list(r.json()["approvals"])

    def decide(self, approval_id: str, allow: bool, remember: bool = False) -> Request:
        r = api.call(self._conn.config, "POST", f"{self._path}/{approval_id}",
                     json={"allow": bool(allow), "remember": bool(remember)}, sandbox_id=self._conn.sandbox_id)
        return dict(r.json())

    def allow(self, approval_id: str, remember: bool = False) -> Request:
        """Let the held operation go on; `remember`: the same file (or host) is not asked about again."""
        return self.decide(approval_id, True, remember)

    def deny(self, approval_id: str, remember: bool = False) -> Request:
        """Refuse it (EACCES for an exec, a refused connection); `remember`: refused from now on without asking."""
        return self.decide(approval_id, False, remember)

    def stream(self) -> Iterator[Request]:
        """Each request as it is made (those waiting first) and each decision (`"event": "decision"`),
        until the sandbox is gone."""
        config = self._conn.config
        t = timeout(config.request_timeout)
        t = httpx.Timeout(t.connect, read=None, write=t.write, pool=t.pool)
        try:
            with sync_client(config.endpoint).stream("GET", f"{self._path}/stream", headers=config.control_headers(),
                                                     timeout=t) as r:
                if r.status_code != 200:
                    raise error_from_http(r.status_code, r.read(), self._conn.sandbox_id, "approvals")
                for line in r.iter_lines():
                    if line.strip():
                        yield json.loads(line)
        except httpx.HTTPError as e:
            raise error_from_transport(e, "approvals") from None

    def on_approval(self, decide: Decider, remember: bool = False) -> _Watcher:
        """Call `decide(request)` for every request, in a background thread: True allows, False denies,
        None leaves it to someone else (or to the timeout). `.stop()` on the result ends it."""
        watcher = _Watcher(self, decide, remember)
        self._watchers.append(watcher)
        watcher.start()
        return watcher


class _Watcher:
    def __init__(self, approvals: Approvals, decide: Decider, remember: bool) -> None:
        self._approvals, self._decide, self._remember = approvals, decide, remember
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="agentcell-approvals", daemon=True)
        self.error: BaseException | None = None

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        try:
            for item in self._approvals.stream():
                if self._stopped.is_set():
                    return
                if item.get("event") != "request" or item.get("state") != "pending":
                    continue
                verdict = self._decide(item)
                if verdict is not None:
                    with contextlib.suppress(Exception):  # decided by someone else meanwhile: 409
                        self._approvals.decide(item["id"], bool(verdict), self._remember)
        except BaseException as e:  # noqa: BLE001 - kept for the caller to see; the thread just ends
            self.error = e


class AsyncApprovals:
    def __init__(self, conn: SandboxConnection) -> None:
        self._conn = conn
        self._tasks: set[asyncio.Task[None]] = set()

    @property
    def _path(self) -> str:
        return f"/sandboxes/{self._conn.sandbox_id}/approvals"

    async def list(self, include_decided: bool = False) -> list[Request]:
        r = await api.acall(self._conn.config, "GET", self._path, params={"all": "true"} if include_decided else None,
                            sandbox_id=self._conn.sandbox_id)
        return list(r.json()["approvals"])

    async def decide(self, approval_id: str, allow: bool, remember: bool = False) -> Request:
        r = await api.acall(self._conn.config, "POST", f"{self._path}/{approval_id}",
                            json={"allow": bool(allow), "remember": bool(remember)}, sandbox_id=self._conn.sandbox_id)
        return dict(r.json())

    async def allow(self, approval_id: str, remember: bool = False) -> Request:
        return await self.decide(approval_id, True, remember)

    async def deny(self, approval_id: str, remember: bool = False) -> Request:
        return await self.decide(approval_id, False, remember)

    async def stream(self) -> AsyncIterator[Request]:
        conf = self._conn.config
        rt = conf.request_timeout or None
        try:
            r = await fast_async_http.client(conf.endpoint).request(
                "GET", f"{self._path}/stream", headers=conf.control_headers(), connect=rt, read=None, stream=True)
        except fast_async_http.HTTPError as e:
            raise fast_async_http.transport_error(e, "approvals") from None
        try:
            if r.status_code != 200:
                raise error_from_http(r.status_code, await r.read(), self._conn.sandbox_id, "approvals")
            async for line in r.aiter_lines():
                if line.strip():
                    yield json.loads(line)
        finally:
            await r.aclose()

    def on_approval(self, decide: AsyncDecider, remember: bool = False) -> asyncio.Task[None]:
        """As Approvals.on_approval, in a task of the running loop (cancel it to stop); `decide` may be async."""
        async def run() -> None:
            async for item in self.stream():
                if item.get("event") != "request" or item.get("state") != "pending":
                    continue
                verdict = decide(item)
                if asyncio.iscoroutine(verdict) or isinstance(verdict, asyncio.Future):
                    verdict = await verdict
                if verdict is not None:
                    with contextlib.suppress(Exception):
                        await self.decide(item["id"], bool(verdict), remember)

        task = asyncio.get_running_loop().create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task
