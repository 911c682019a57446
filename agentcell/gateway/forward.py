"""Forward one client request to a cell, streaming both bodies unbuffered with flow control.

- HTTP: httpx sends the request body as the client's receive() yields it (uvicorn reads the client's
  socket only when asked: backpressure up), and the cell's response is sent on piece by piece as
  httpcore reads it (uvicorn's send() waits while the client's socket is full: backpressure down).
  NDJSON and Connect streams (run_code, commands) therefore pass through as they are produced.
- Upgrades (WebSocket to a port served out of a sandbox): the request head goes to the cell on a TCP
  connection of its own, and from then on the client's connection (http_protocol.RawConnection, as the
  server's ports.py uses it) and the cell's exchange raw bytes until both end.
Headers pass through except hop-by-hop ones; the Host stays the client's (the cell derives the
sandbox's `domain` from it). Credentials: the client's X-API-KEY never reaches a cell. The caller says
what goes in its place: the cell key for a control-plane request the gateway has authenticated, nothing
for the data plane (the cell checks the sandbox's own token there, and a key added to a request nobody
checked would open the control plane to whoever can make the cell read it as one). A data-plane request
also carries the gateway's routing decision as E2B's headers (routing.py), so that the cell, whatever
its version, serves the sandbox the gateway chose.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httpx

from agentcell.server.asgi import named_by_connection
from agentcell.server.http_protocol import UPGRADE_EXTENSION
from agentcell.server.routing import ID_HEADER, PORT_HEADER, SandboxTarget, routing_headers

HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                        b"transfer-encoding", b"upgrade", b"proxy-authenticate", b"proxy-authorization",
                        b"expect"})  # uvicorn answered the client's 100-continue; httpx sends the body as it comes
_RESPONSE_DROP = HOP_BY_HOP | {b"date", b"server"}  # uvicorn adds its own Date


class CellUnreachable(Exception):
    """The request never reached the cell (connect failed): safe to retry elsewhere."""


class CellFailed(Exception):
    """The cell's connection failed after the request was sent, before any answer: not retried (a
    create may have happened)."""


class ClientLeft(Exception):
    """The client went away (or missed the body deadline) before its request body was complete: the
    cell's request is aborted, never ended as if the body were whole."""


def request_headers(scope: dict[str, Any], api_key: str | None,
                    sandbox: SandboxTarget | None = None) -> list[tuple[bytes, bytes]]:
    """The headers the cell gets (module doc): `api_key` as the only X-API-KEY (None: none); for a
    data-plane request, `sandbox` as the only routing headers."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    named = named_by_connection(headers)
    dropped = HOP_BY_HOP | named | {b"x-api-key"} | ({ID_HEADER, PORT_HEADER} if sandbox is not None else set())
    out = [(name.lower(), value) for name, value in headers if name.lower() not in dropped]
    if api_key is not None:
        out.append((b"x-api-key", api_key.encode()))
    if sandbox is not None:
        out += routing_headers(sandbox)
    client = scope.get("client")
    if client:
        out.append((b"x-forwarded-for", client[0].encode()))
    return out


def target(scope: dict[str, Any]) -> str:
    path = (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
    if scope.get("query_string"):
        path += "?" + scope["query_string"].decode("latin-1")
    return path


async def _body(receive: Any) -> AsyncIterator[bytes]:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientLeft  # httpx aborts the cell's request: a cut upload must not look complete
        data = message.get("body", b"")
        if data:
            yield data
        if not message.get("more_body", False):
            return


def _has_body(scope: dict[str, Any]) -> bool:
    return any(n.lower() == b"transfer-encoding" or (n.lower() == b"content-length" and v.strip(b"0 \t"))
               for n, v in scope["headers"])


async def forward(client: httpx.AsyncClient, base: str, scope: dict[str, Any], receive: Any, send: Any,
                  api_key: str | None, body: bytes | None = None, sandbox: SandboxTarget | None = None) -> int:
    """Send the request to the cell at `base` and stream its answer back; the status. `api_key`: the
    X-API-KEY the cell gets (only for a request the gateway authenticated); `sandbox`: a data-plane
    request's destination; `body`: the request body already read (a create, retried elsewhere).
    Raises CellUnreachable before anything was sent to the client, ClientLeft if the client's body
    stopped short."""
    headers = request_headers(scope, api_key, sandbox)
    content: Any = body if body is not None else (_body(receive) if _has_body(scope) else None)
    if body is not None:
        headers = [(n, v) for n, v in headers if n != b"content-length"]
    request = client.build_request(scope["method"], base + target(scope), headers=headers, content=content)
    try:
        response = await client.send(request, stream=True)
    except (httpx.ConnectError, httpx.ConnectTimeout) as e:
        raise CellUnreachable(str(e) or type(e).__name__) from None
    except httpx.HTTPError as e:
        raise CellFailed(str(e) or type(e).__name__) from None
    loop = asyncio.get_running_loop()
    # The request body is sent by now (HTTP/1.1: httpx sends it before reading the answer): receive()
    # next says when the client goes away, and then the cell's stream (a command that never ends) is
    # closed rather than read for nobody.
    left = loop.create_task(_client_left(receive)) if body is None else None
    pump = loop.create_task(_stream_response(scope, response, send))
    try:
        await asyncio.wait({pump, left} if left is not None else {pump}, return_when=asyncio.FIRST_COMPLETED)
        if not pump.done():
            pump.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump
        return response.status_code
    finally:
        if left is not None:
            left.cancel()
        if not pump.done():
            pump.cancel()
        await response.aclose()


async def _client_left(receive: Any) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _stream_response(scope: dict[str, Any], response: httpx.Response, send: Any) -> None:
    out_headers = [(n.lower(), v) for n, v in response.headers.raw if n.lower() not in _RESPONSE_DROP]
    await send({"type": "http.response.start", "status": response.status_code, "headers": out_headers})
    try:
        async for chunk in response.aiter_raw():
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
    except httpx.HTTPError:
        # the cell went away mid-stream: drop the client's connection as the cell's was (SDKs read a
        # cut stream as "the sandbox is gone"), rather than end the body cleanly
        drop = scope.get("extensions", {}).get("agentcell.drop")
        if drop is not None:
            drop()
        return
    await send({"type": "http.response.body", "body": b"", "more_body": False})


def upgrade_requested(scope: dict[str, Any]) -> bool:
    return UPGRADE_EXTENSION in scope.get("extensions", {})


async def relay_upgrade(base: str, scope: dict[str, Any], api_key: str | None,
                        sandbox: SandboxTarget | None = None) -> None:
    """An Upgrade request: its head to the cell, then raw bytes both ways (see the module doc);
    `api_key` and `sandbox` as for forward()."""
    parts = urlsplit(base)
    try:
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(parts.hostname, parts.port or 80), timeout=5)
    except (OSError, TimeoutError) as e:
        raise CellUnreachable(str(e) or type(e).__name__) from None
    raw = scope["extensions"][UPGRADE_EXTENSION].take_over()
    headers = request_headers(scope, api_key, sandbox)
    upgrade = next((v for n, v in scope["headers"] if n.lower() == b"upgrade"), b"websocket")
    lines = [scope["method"].encode() + b" " + target(scope).encode("latin-1") + b" HTTP/1.1"]
    lines += [n + b": " + v for n, v in headers]
    lines += [b"connection: upgrade", b"upgrade: " + upgrade]
    writer.write(b"\r\n".join(lines) + b"\r\n\r\n")

    async def up() -> None:
        while data := await raw.read():
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()

    task = asyncio.get_running_loop().create_task(up())
    try:
        while data := await reader.read(64 << 10):
            raw.write(data)
            await raw.drain()
        raw.write_eof()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(task), timeout=5)
    except (OSError, ConnectionError):
        pass
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        writer.close()
        raw.close()
