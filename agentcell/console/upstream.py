"""How the console acts on the server it is part of: the app's own router, called in process.

`agentcell serve` passes its `_route` (the credential check, the behaviour record's API-call events,
the control plane and every sandbox's data plane); `agentcell gateway` passes its `route` (which
sends each call to the cell that holds the sandbox). A call is an ASGI call with a scope rewritten
from the browser's request: the path the console means, the server's API key as `X-API-KEY` for the
control plane, or a sandbox's routing headers and access token for its data plane. Nothing goes over
a socket in `serve` (no loopback, TLS or Host policy to get past), responses stream, and the record
attributes each call to the key it was made with, as for any client.

A streamed answer is read one ASGI message at a time: the app's `send` waits until the console has
taken the previous one, so a slow reader holds the producer back instead of growing a buffer.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from agentcell.server.auth import ENVD_PORT, INTERPRETER_PORT
from agentcell.server.http_protocol import DROP_EXTENSION, UPGRADE_EXTENSION

ASGIApp = Callable[[dict[str, Any], Any, Any], Awaitable[None]]
# headers of the browser's request never passed on: its credentials here, and anything that would
# route the call somewhere other than where the console sends it
_DROPPED = frozenset({b"cookie", b"x-csrf-token", b"x-api-key", b"authorization", b"x-access-token",
                      b"e2b-traffic-access-token", b"e2b-sandbox-id", b"e2b-sandbox-port", b"origin",
                      b"upgrade", b"connection", b"host", b"sec-websocket-key", b"sec-websocket-version",
                      b"sec-websocket-extensions", b"sec-websocket-protocol", b"proxy-authorization"})
_KEPT_FOR_CALLS = frozenset({b"host", b"user-agent"})
CLOSE_GRACE = 2.0  # seconds a call has to end once the console closes it
BUFFER_LIMIT = 8 << 20  # bytes of one buffered answer (a JSON listing, a sandbox's details)


class UpstreamError(Exception):
    """The server answered a console call with an error; `status` and `message` are its."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Reply:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body) if self.body else None

    def raise_for_status(self) -> None:
        if self.status >= 400:
            raise UpstreamError(self.status, error_message(self.body, self.status))


def error_message(body: bytes, status: int) -> str:
    try:
        parsed = json.loads(body)
        if isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
            return parsed["message"]
    except ValueError:
        pass
    return body.decode(errors="replace")[:500] or f"the server answered {status}"


def forwarded_headers(outer: dict[str, Any]) -> list[tuple[bytes, bytes]]:
    """The browser's headers a pass-through keeps (content type, length, accept, ...)."""
    return [(k, v) for k, v in outer.get("headers", []) if k.lower() not in _DROPPED]


def _extensions(outer: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in (outer.get("extensions") or {}).items() if k != UPGRADE_EXTENSION}


class Stream:
    """One streamed answer: `status`, `headers`, then `chunks()`; `close()` ends the call (the app
    sees its client gone)."""

    def __init__(self, app: ASGIApp, scope: dict[str, Any], body: bytes | AsyncIterator[bytes]) -> None:
        self._messages: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue(maxsize=1)
        self._gone = asyncio.Event()
        self._body = body
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.cut = False  # the app dropped the call mid-answer (its sandbox died): the answer ends short
        scope["extensions"][DROP_EXTENSION] = self._cut  # not the browser's connection: this call's
        names = {k.lower() for k, _ in scope["headers"]}
        if isinstance(body, bytes):
            if body and b"content-length" not in names:
                scope["headers"].append((b"content-length", str(len(body)).encode()))
        elif b"content-length" not in names:
            scope["headers"].append((b"transfer-encoding", b"chunked"))
        self._task = asyncio.get_running_loop().create_task(self._run(app, scope))

    def _cut(self) -> None:
        self.cut = True
        self._gone.set()
        asyncio.get_running_loop().create_task(self._messages.put(None))

    async def _receive(self) -> dict[str, Any]:
        if isinstance(self._body, bytes):
            body, self._body = self._body, None  # type: ignore[assignment]
            if body is not None:
                return {"type": "http.request", "body": body, "more_body": False}
        elif self._body is not None:
            try:
                chunk = await anext(self._body)
                return {"type": "http.request", "body": chunk, "more_body": True}
            except StopAsyncIteration:
                self._body = None  # type: ignore[assignment]
                return {"type": "http.request", "body": b"", "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        if self._gone.is_set():
            raise OSError("the console's reader is gone")
        await self._messages.put(message)

    async def _run(self, app: ASGIApp, scope: dict[str, Any]) -> None:
        try:
            await app(scope, self._receive, self._send)
        finally:
            await self._messages.put(None)

    async def start(self) -> Stream:
        message = await self._messages.get()
        if message is None:
            await self._task  # raised: propagate its error
            raise UpstreamError(502, "the server gave no answer")
        self.status = int(message["status"])
        self.headers = list(message.get("headers", []))
        return self

    def header(self, name: bytes) -> str | None:
        for k, v in self.headers:
            if k.lower() == name:
                return v.decode("latin-1")
        return None

    async def chunks(self) -> AsyncIterator[bytes]:
        while not self.cut:
            message = await self._messages.get()
            if message is None or self.cut:
                return
            if message.get("body"):
                yield message["body"]
            if not message.get("more_body", False):
                return

    async def read(self, limit: int = BUFFER_LIMIT) -> bytes:
        out = bytearray()
        async for chunk in self.chunks():
            out += chunk
            if len(out) > limit:
                await self.close()
                raise UpstreamError(502, f"the server's answer is larger than {limit} bytes")
        return bytes(out)

    async def close(self) -> None:
        """End the call: the app's receive() says the client left, its sends are refused, and what it
        had queued is dropped until it returns (cancelled after CLOSE_GRACE seconds)."""
        self._gone.set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + CLOSE_GRACE
        while not self._task.done() and loop.time() < deadline:
            with contextlib.suppress(asyncio.QueueEmpty):
                while True:
                    self._messages.get_nowait()
            await asyncio.wait({self._task}, timeout=0.05)
        if not self._task.done():
            self._task.cancel()
        with contextlib.suppress(BaseException):
            await self._task


class Upstream:
    """The router the console calls, and the key it calls the control plane with."""

    def __init__(self, router: ASGIApp, api_key: str | None, kind: str) -> None:
        self.router = router
        self.api_key = api_key
        self.kind = kind  # "server" | "gateway"

    def scope(self, outer: dict[str, Any], method: str, path: str, query: bytes = b"",
              headers: Iterable[tuple[bytes, bytes]] = ()) -> dict[str, Any]:
        kept = [(k, v) for k, v in outer.get("headers", []) if k.lower() in _KEPT_FOR_CALLS]
        return {
            "type": "http", "asgi": outer.get("asgi", {"version": "3.0"}), "http_version": "1.1",
            "method": method, "scheme": outer.get("scheme", "http"), "path": path, "raw_path": path.encode(),
            "query_string": query, "root_path": "", "headers": [*kept, *headers],
            "client": outer.get("client"), "server": outer.get("server"), "state": {},
            "extensions": _extensions(outer),
        }

    def key_headers(self) -> list[tuple[bytes, bytes]]:
        return [(b"x-api-key", self.api_key.encode())] if self.api_key is not None else [(b"x-api-key", b"console")]

    def control_scope(self, outer: dict[str, Any], method: str, path: str, query: bytes = b"",
                      headers: Iterable[tuple[bytes, bytes]] = ()) -> dict[str, Any]:
        return self.scope(outer, method, path, query, [*headers, *self.key_headers()])

    @staticmethod
    def sandbox_headers(sandbox_id: str, port: int, token: str) -> list[tuple[bytes, bytes]]:
        return [(b"e2b-sandbox-id", sandbox_id.encode()), (b"e2b-sandbox-port", str(port).encode()),
                (b"x-access-token", token.encode())]

    async def stream(self, scope: dict[str, Any], body: bytes | AsyncIterator[bytes] = b"") -> Stream:
        return await Stream(self.router, scope, body).start()

    async def request(self, scope: dict[str, Any], body: bytes = b"", limit: int = BUFFER_LIMIT) -> Reply:
        s = await self.stream(scope, body)
        try:
            data = await s.read(limit)
        finally:
            await s.close()
        return Reply(s.status, s.headers, data)

    async def control(self, outer: dict[str, Any], method: str, path: str, query: bytes = b"",
                      body: Any = None) -> Reply:
        headers = [(b"content-type", b"application/json")] if body is not None else []
        data = json.dumps(body).encode() if body is not None else b""
        return await self.request(self.control_scope(outer, method, path, query, headers), data)

    async def access_token(self, outer: dict[str, Any], sandbox_id: str) -> str:
        """The sandbox's envd access token (UpstreamError 404 when there is no such sandbox)."""
        reply = await self.control(outer, "GET", f"/sandboxes/{sandbox_id}")
        reply.raise_for_status()
        token = (reply.json() or {}).get("envdAccessToken")
        if not isinstance(token, str):
            raise UpstreamError(502, f"the server gave no access token for sandbox {sandbox_id}")
        return token

    async def sandbox_scope(self, outer: dict[str, Any], sandbox_id: str, port: int, method: str, path: str,
                            query: bytes = b"", headers: Iterable[tuple[bytes, bytes]] = ()) -> dict[str, Any]:
        token = await self.access_token(outer, sandbox_id)
        return self.scope(outer, method, path, query, [*headers, *self.sandbox_headers(sandbox_id, port, token)])


ENVD, INTERPRETER = ENVD_PORT, INTERPRETER_PORT
