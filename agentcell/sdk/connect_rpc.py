"""A small Connect-protocol JSON client: unary calls and server streams (sync on fast_http, async on
fast_async_http).

Unary: POST application/json, bare JSON message; errors are `{"code": "<name>", "message"}`.
Server stream: POST application/connect+json with one envelope (flags u8, big-endian u32 length, JSON);
the response is envelopes, the last with flags 0x02 holding `{}` or `{"error": {...}}`.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator, Iterator
from typing import Any

from urllib3.exceptions import HTTPError

from agentcell.errors import SandboxException
from agentcell.sdk import fast_async_http as fah
from agentcell.sdk.fast_async_http import AsyncFastHTTP
from agentcell.sdk.fast_http import FastHTTP, chunks, cut_off_error, finish, transport_error
from agentcell.sdk.transport import error_from_connect, error_from_http

_END_STREAM = 0x02
_HEADER = struct.Struct(">BI")
_UNARY_HEADERS = {"Content-Type": "application/json", "Connect-Protocol-Version": "1", "Accept-Encoding": "identity"}
_STREAM_HEADERS = {
    "Content-Type": "application/connect+json",
    "Connect-Protocol-Version": "1",
    "Connect-Accept-Encoding": "identity",
}


def _dumps(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def envelope(message: dict[str, Any]) -> bytes:
    data = _dumps(message)
    return _HEADER.pack(0, len(data)) + data


def _headers(base: dict[str, str], extra: dict[str, str], timeout_ms: int | None) -> dict[str, str]:
    h = {**base, **extra}
    if timeout_ms:
        h["Connect-Timeout-Ms"] = str(timeout_ms)
    return h


class _Decoder:
    """Splits a byte stream into envelopes; raises on the end-stream error."""

    def __init__(self, sandbox_id: str | None) -> None:
        self.buf = bytearray()
        self.sandbox_id = sandbox_id
        self.ended = False

    def feed(self, chunk: bytes) -> list[dict[str, Any]]:
        self.buf += chunk
        out: list[dict[str, Any]] = []
        while len(self.buf) >= 5:
            flags, size = _HEADER.unpack_from(self.buf)
            if len(self.buf) < 5 + size:
                break
            msg = json.loads(bytes(self.buf[5 : 5 + size])) if size else {}
            del self.buf[: 5 + size]
            if flags & _END_STREAM:
                self.ended = True
                err = msg.get("error") if isinstance(msg, dict) else None
                if err:
                    raise error_from_connect(str(err.get("code", "unknown")), str(err.get("message", "")), self.sandbox_id)
                return out
            out.append(msg)
        return out

    def finish(self, what: str) -> None:
        if not self.ended:
            raise SandboxException(f"{what}: the stream ended before its end-of-stream message (server or sandbox died?)")


def unary(
    client: FastHTTP, path: str, message: dict[str, Any], headers: dict[str, str],
    timeout: tuple[float | None, float | None], sandbox_id: str | None = None, timeout_ms: int | None = None,
) -> dict[str, Any]:
    """`timeout`: (connect, read) seconds, None = no bound."""
    try:
        r = client.request("POST", path, body=_dumps(message), headers=_headers(_UNARY_HEADERS, headers, timeout_ms),
                           connect=timeout[0], read=timeout[1])
    except HTTPError as e:
        raise transport_error(e, path) from None
    if r.status != 200:
        raise error_from_http(r.status, r.data, sandbox_id, path)
    return json.loads(r.data) if r.data else {}


def stream(
    client: FastHTTP, path: str, message: dict[str, Any], headers: dict[str, str],
    timeout: tuple[float | None, float | None], sandbox_id: str | None = None, timeout_ms: int | None = None,
) -> Iterator[dict[str, Any]]:
    """A generator of the stream's messages; the request is sent on the first next(). close() drops it."""
    try:
        r = client.request("POST", path, body=envelope(message), headers=_headers(_STREAM_HEADERS, headers, timeout_ms),
                           connect=timeout[0], read=timeout[1], stream=True)
    except HTTPError as e:
        raise transport_error(e, path) from None
    complete = False
    try:
        if r.status != 200:
            raise error_from_http(r.status, r.read(), sandbox_id, path)
        dec = _Decoder(sandbox_id)
        try:
            for chunk in chunks(r):
                if not dec.ended:  # after the end-stream message only the end of the HTTP body can come
                    yield from dec.feed(chunk)
        except HTTPError as e:
            raise cut_off_error(client, e, path, sandbox_id) from None
        complete = True
        dec.finish(path)
    finally:
        finish(r, complete)


async def aunary(
    client: AsyncFastHTTP, path: str, message: dict[str, Any], headers: dict[str, str],
    timeout: tuple[float | None, float | None], sandbox_id: str | None = None, timeout_ms: int | None = None,
) -> dict[str, Any]:
    """`timeout`: (connect, read) seconds, None = no bound."""
    try:
        r = await client.request("POST", path, body=_dumps(message), headers=_headers(_UNARY_HEADERS, headers, timeout_ms),
                                 connect=timeout[0], read=timeout[1])
    except fah.HTTPError as e:
        raise fah.transport_error(e, path) from None
    if r.status != 200:
        raise error_from_http(r.status, r.content, sandbox_id, path)
    return json.loads(r.content) if r.content else {}


async def astream(
    client: AsyncFastHTTP, path: str, message: dict[str, Any], headers: dict[str, str],
    timeout: tuple[float | None, float | None], sandbox_id: str | None = None, timeout_ms: int | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """An async generator of the stream's messages; the request is sent on the first anext(). aclose()
    drops it."""
    try:
        r = await client.request("POST", path, body=envelope(message),
                                 headers=_headers(_STREAM_HEADERS, headers, timeout_ms),
                                 connect=timeout[0], read=timeout[1], stream=True)
    except fah.HTTPError as e:
        raise fah.transport_error(e, path) from None
    try:
        if r.status != 200:
            try:
                content = await r.read()
            except fah.HTTPError as e:
                raise fah.transport_error(e, path) from None
            raise error_from_http(r.status, content, sandbox_id, path)
        dec = _Decoder(sandbox_id)
        try:
            async for chunk in r.aiter_raw():
                if not dec.ended:  # after the end-stream message only the end of the HTTP body can come
                    for msg in dec.feed(chunk):
                        yield msg
        except fah.HTTPError as e:
            raise await fah.cut_off_error(client, e, path, sandbox_id) from None
        dec.finish(path)
    finally:
        await r.aclose()
