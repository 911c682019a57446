"""Ports served out (E2B's `get_host(port)`): HTTP, and any Upgrade (WebSocket), to a server that
listens inside a sandbox.

A request routed to a sandbox port other than 49983 (envd) and 49999 (code interpreter) goes through
that sandbox's agent: one ``net.connect`` call (docs/internal-protocol.md) per request, which connects
to 127.0.0.1:port inside the sandbox. The server never joins the sandbox's network namespace.

- The request head is rebuilt from the ASGI scope: hop-by-hop headers and agentcell's and E2B's own
  credentials are dropped (the sandbox's code never sees them), `Connection: close` is forced (one
  tunnel per request), and the body is streamed as it arrives.
- The sandbox's response is parsed (httptools) and streamed back: status, headers without hop-by-hop
  ones, body in pieces (Content-Length, chunked or close-delimited; uvicorn frames it for the client).
  The head must come within HEAD_TIMEOUT; a body may stream for as long as the client stays.
- An Upgrade request keeps `Connection: upgrade`; if the sandbox answers 101, the client's connection
  becomes a byte relay for the rest of its life (see http_protocol.RawConnection for why bytes).
- Errors are E2B's: a closed port is 502 "port is not open", a gone sandbox 502 "was not found".
Memory per request is bounded by the protocol's windows (CALL_WINDOW down, UP_WINDOW up) plus
uvicorn's write buffer: a client or a sandbox that stops reading stops the other side.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator
from typing import Any

import httptools
from starlette.responses import JSONResponse

from agentcell.errors import SandboxError
from agentcell.runtime.protocol import CHUNK, Duplex, Frame
from agentcell.runtime.tunnel import NOT_OPEN
from agentcell.server.asgi import has_body, header, named_by_connection
from agentcell.server.errors import json_error, sandbox_not_found
from agentcell.server.http_protocol import UPGRADE_EXTENSION  # set on requests that ask to upgrade
from agentcell.server.ingress import masked_host
from agentcell.server.registry import SandboxRecord

HEAD_TIMEOUT = 60.0  # seconds the sandbox's server has to send a response head
HOP_BY_HOP = frozenset({b"connection", b"keep-alive", b"proxy-connection", b"te", b"trailer",
                        b"transfer-encoding", b"upgrade", b"expect", b"proxy-authenticate",
                        b"proxy-authorization"})  # fmt: skip
# What opens a sandbox (or the server): the sandbox's own code must never see it.
CREDENTIALS = frozenset({b"x-access-token", b"e2b-traffic-access-token", b"x-api-key"})
# What uvicorn refuses to write (it would answer 500 instead): such a response is the sandbox's fault.
_BAD_NAME = re.compile(rb'[\x00-\x1f\x7f()<>@,;:\[\]={} \t\\"]')
_BAD_VALUE = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")


def port_not_open(sandbox_id: str, port: int) -> JSONResponse:
    # E2B's body; the SDK looks for "port is not open" and raises its "sandbox unreachable" error.
    body = {"sandboxId": sandbox_id, "message": "The sandbox is running but port is not open", "port": port,
            "code": 502}
    return JSONResponse(body, status_code=502)


def request_head(scope: dict[str, Any], upgrade: bytes | None, chunked: bool, host: bytes | None = None) -> bytes:
    """The request line and headers sent to the sandbox's server; `host`, if given, in place of the
    client's Host (E2B's maskRequestHost)."""
    target = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    named = named_by_connection(headers)
    lines = [scope["method"].encode() + b" " + target + b" HTTP/1.1"]
    has_host = False
    for name, value in headers:
        lower = name.lower()
        if lower in HOP_BY_HOP or lower in CREDENTIALS or lower in named:
            continue
        if lower == b"host":
            if has_host:
                continue
            has_host = True
            value = host if host is not None else value
        lines.append(name + b": " + value)
    if not has_host:  # an HTTP/1.0 client routed by the E2B headers
        lines.append(b"host: " + (host if host is not None else b"localhost"))
    if upgrade is not None:
        lines += [b"connection: upgrade", b"upgrade: " + upgrade]
    else:
        lines.append(b"connection: close")
    if chunked:
        lines.append(b"transfer-encoding: chunked")
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _upgrade_token(scope: dict[str, Any]) -> bytes | None:
    """The Upgrade header's value when the request asks to upgrade (Connection: upgrade), else None."""
    upgrade = header(scope, b"upgrade")
    if upgrade is None or b"upgrade" not in named_by_connection(scope["headers"]):
        return None
    return upgrade.encode("latin-1")


class _Response:
    """httptools callbacks: the sandbox's response head, then its body in pieces."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.body: list[bytes] = []
        self._interim = False

    def on_message_begin(self) -> None:
        self.headers = []

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        self._interim = 100 <= status < 200 and status != 101  # 100 Continue, 103 Early Hints: skipped
        if not self._interim:
            self.status = status
            self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
        else:
            self.complete = True

    def take_body(self) -> list[bytes]:
        body, self.body = self.body, []
        return body

    def delimited(self) -> bool:
        """Whether the body's end is marked (Content-Length, chunked) rather than the connection's close."""
        return any(n == b"content-length" or (n == b"transfer-encoding" and b"chunked" in v.lower())
                   for n, v in self.headers)

    def client_headers(self) -> list[tuple[bytes, bytes]]:
        named = named_by_connection(self.headers)
        # uvicorn adds its own Date, and frames the body itself (chunked when there is no Content-Length).
        return [(n, v) for n, v in self.headers if n not in HOP_BY_HOP and n not in named and n != b"date"]


async def _chunks(batches: AsyncIterator[list[Frame]]) -> AsyncIterator[bytes]:
    """The sandbox side's bytes in pieces; b"" once, where it stopped writing (EOF)."""
    async for batch in batches:
        for frame in batch:
            event = frame.header.get("event")
            if event == "data" and frame.payload:
                yield frame.payload
            elif event == "eof":
                yield b""


class _Refused(Exception):
    """The exchange ends with this error response (nothing was sent to the client yet)."""

    def __init__(self, response: JSONResponse) -> None:
        self.response = response


async def serve_port(rec: SandboxRecord, port: int, scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Answer one request to `port` of the sandbox `rec` (auth and routing were checked by the router)."""
    if scope["method"] == "CONNECT":
        await json_error(405, "CONNECT is not supported on sandbox ports")(scope, receive, send)
        return
    upgrade = _upgrade_token(scope)
    extension = scope.get("extensions", {}).get(UPGRADE_EXTENSION)
    if upgrade is not None and (extension is None or has_body(scope)):
        reason = "an upgrade request with a body" if extension else "upgrades on this server's HTTP layer"
        await json_error(400, f"{reason} is not supported")(scope, receive, send)
        return
    chunked = header(scope, b"transfer-encoding") is not None
    loop = asyncio.get_running_loop()
    gone: asyncio.Future[None] = loop.create_future()  # the client went away
    duplex = rec.channel.duplex("net.connect", port=port)
    head = request_head(scope, upgrade, chunked, masked_host(rec.mask_request_host, port))
    try:
        # the head goes with the request when it fits in one frame (most do: 64 KiB of headers at most)
        batches = await duplex.open(gone, head if len(head) <= CHUNK else b"")
    except SandboxError:
        await sandbox_not_found(rec.sandbox_id)(scope, receive, send)
        return
    chunks = _chunks(batches)
    pump = loop.create_task(_pump_request(duplex, head if len(head) > CHUNK else b"", receive, chunked,
                                          gone, body=upgrade is None))
    try:
        try:
            await _respond(rec, port, scope, send, duplex, chunks, pump, gone, upgrade is not None)
        except _Refused as refused:
            await refused.response(scope, receive, send)
    finally:
        pump.cancel()
        with contextlib.suppress(BaseException):
            await pump
        await chunks.aclose()  # type: ignore[attr-defined]
        await duplex.aclose()


async def _pump_request(duplex: Duplex, head: bytes, receive: Any, chunked: bool, gone: asyncio.Future[None],
                        body: bool) -> None:
    """Send the request (head, body, EOF), then wait for the client to go away."""

    def client_left() -> None:
        if not gone.done():
            gone.set_result(None)

    try:
        sending = await duplex.write(head) if head else True
        while body:
            message = await receive()
            if message["type"] == "http.disconnect":
                client_left()
                return
            data = message.get("body", b"")
            if data and sending:
                sending = await duplex.write(b"%x\r\n%b\r\n" % (len(data), data) if chunked else data)
            if not message.get("more_body", False):
                if sending and chunked:
                    sending = await duplex.write(b"0\r\n\r\n")
                if sending:
                    await duplex.write_eof()
                break
            if not sending:  # the sandbox's side is done: leave the rest of the body unread
                return
        while (await receive())["type"] != "http.disconnect":
            pass
        client_left()
    except SandboxError:
        return  # the sandbox went away: the response side reports it


async def _respond(rec: SandboxRecord, port: int, scope: dict[str, Any], send: Any, duplex: Duplex,
                   chunks: AsyncIterator[bytes], pump: asyncio.Task[None], gone: asyncio.Future[None],
                   upgrading: bool) -> None:
    response = _Response()
    seen = bytearray()  # an upgrade's response (head and what follows), forwarded as it came after a 101
    try:
        async with asyncio.timeout(HEAD_TIMEOUT):
            while not response.head_done:
                data = await anext(chunks, b"")
                if not data:
                    if gone.done():
                        return
                    raise _Refused(json_error(502, f"the server on port {port} in the sandbox closed the "
                                                   "connection without sending a response"))
                if upgrading:
                    seen += data
                response.parser.feed_data(data)
    except httptools.HttpParserUpgrade:
        if not (upgrading and response.status == 101):
            raise _Refused(json_error(502, f"the server on port {port} in the sandbox switched protocols "
                                           "unasked")) from None
        await _relay_upgraded(scope, bytes(seen), duplex, chunks, pump, gone)
        return
    except httptools.HttpParserError as e:
        raise _Refused(json_error(502, f"the server on port {port} in the sandbox sent a malformed HTTP response "
                                       f"({e})")) from None
    except TimeoutError:
        raise _Refused(json_error(504, f"the server on port {port} in the sandbox did not answer within "
                                       f"{HEAD_TIMEOUT:g} s")) from None
    except SandboxError as e:
        if not rec.alive():
            raise _Refused(sandbox_not_found(rec.sandbox_id)) from None
        if NOT_OPEN in e.message:
            raise _Refused(port_not_open(rec.sandbox_id, port)) from None
        raise _Refused(json_error(502, f"the connection to port {port} in the sandbox failed: {e.message}")) from None
    if upgrading and response.status == 101:
        raise _Refused(json_error(502, f"the server on port {port} in the sandbox sent a 101 without an upgrade"))
    if not 200 <= response.status <= 599 or any(_BAD_NAME.search(n) or _BAD_VALUE.search(v)
                                                 for n, v in response.headers):
        raise _Refused(json_error(502, f"the server on port {port} in the sandbox sent a malformed HTTP response "
                                       "(its status or a header is invalid)"))
    await _stream_response(scope, send, response, chunks)


async def _stream_response(scope: dict[str, Any], send: Any, response: _Response, chunks: AsyncIterator[bytes]) -> None:
    await send({"type": "http.response.start", "status": response.status, "headers": response.client_headers()})
    if scope["method"] == "HEAD":
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    try:
        while True:
            for piece in response.take_body():
                await send({"type": "http.response.body", "body": piece, "more_body": True})
            if response.complete:
                break
            data = await anext(chunks, b"")
            if not data:
                if response.delimited():
                    return  # cut short (EOF, or the sandbox went away): uvicorn drops the connection
                break  # a close-delimited body ends here
            response.parser.feed_data(data)
    except (httptools.HttpParserError, SandboxError):
        return  # too late for an error response: the client sees the connection drop
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _relay_upgraded(scope: dict[str, Any], first: bytes, duplex: Duplex, chunks: AsyncIterator[bytes],
                          pump: asyncio.Task[None], gone: asyncio.Future[None]) -> None:
    """The sandbox said 101: the client's connection and the tunnel exchange bytes until both end."""
    pump.cancel()  # it reads the ASGI receive(), which ends once the connection is taken over
    with contextlib.suppress(BaseException):
        await pump
    if gone.done():
        return
    raw = scope["extensions"][UPGRADE_EXTENSION].take_over()
    raw.lost.add_done_callback(lambda _: gone.done() or gone.set_result(None))
    raw.write(first)

    async def upstream() -> None:
        while True:
            data = await raw.read()
            if not data:
                await duplex.write_eof()
                return
            if not await duplex.write(data):
                return

    up = asyncio.get_running_loop().create_task(upstream())
    try:
        async for data in chunks:
            if data:
                raw.write(data)
                await raw.drain()
            else:
                raw.write_eof()
    except SandboxError:
        pass
    finally:
        up.cancel()
        with contextlib.suppress(BaseException):
            await up
        raw.close()
