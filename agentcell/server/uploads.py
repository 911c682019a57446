"""Request bodies of file uploads as streams: multipart parts, gzip, a byte cap.

Nothing here holds a whole body: each piece of a part's data is handed on (to the sandbox) before the
next piece of the request is read, so the server's memory per upload is one network chunk.
"""

from __future__ import annotations

import collections
import zlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.multipart import MultipartParser, parse_options_header

from agentcell.server.errors import HTTPError

_PIECE = 256 << 10  # most bytes of decompressed data produced per step


def too_large(limit: int) -> HTTPError:
    return HTTPError(413, f"the upload is larger than the server's limit of {limit >> 20} MiB")


async def capped(body: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """`body`, failing with 413 once more than `limit` bytes came through."""
    total = 0
    async for chunk in body:
        total += len(chunk)
        if total > limit:
            raise too_large(limit)
        if chunk:
            yield chunk


async def gunzipped(body: AsyncIterator[bytes], limit: int) -> AsyncIterator[bytes]:
    """The gzip (or zlib) stream `body` decompressed, at most `limit` bytes of output (a gzip bomb
    is cut off as it inflates, not after)."""
    d = zlib.decompressobj(47)
    total = 0
    try:
        async for chunk in body:
            data = chunk
            while data:
                out = d.decompress(data, _PIECE)
                data = d.unconsumed_tail
                total += len(out)
                if total > limit:
                    raise HTTPError(413, f"the decompressed upload is larger than the server's limit of {limit >> 20} MiB")
                if out:
                    yield out
        rest = d.flush()
        if len(rest) + total > limit:
            raise HTTPError(413, f"the decompressed upload is larger than the server's limit of {limit >> 20} MiB")
        if rest:
            yield rest
    except zlib.error as e:
        raise HTTPError(400, f"the body is not valid gzip: {e}") from None


@dataclass
class Part:
    """One part of a multipart body; read its data (once) with `data()`."""

    name: str | None
    filename: str | None
    _stream: MultipartStream
    _done: bool = False

    async def data(self) -> AsyncIterator[bytes]:
        while not self._done:
            kind, value = await self._stream.next_event()
            if kind == "data":
                yield value
            elif kind in ("end", "done"):
                self._done = True

    async def skip(self) -> None:
        async for _ in self.data():
            pass


@dataclass
class MultipartStream:
    """A multipart/form-data body parsed as it arrives (python-multipart's push parser)."""

    body: AsyncIterator[bytes]
    boundary: bytes
    _events: collections.deque[tuple[str, bytes]] = field(default_factory=collections.deque)
    _parser: MultipartParser | None = None
    _headers: dict[bytes, bytes] = field(default_factory=dict)
    _field: bytes = b""
    _value: bytes = b""
    _finished: bool = False

    def __post_init__(self) -> None:
        def header_field(data: bytes, start: int, end: int) -> None:
            self._field += data[start:end]

        def header_value(data: bytes, start: int, end: int) -> None:
            self._value += data[start:end]

        def header_end() -> None:
            self._headers[self._field.lower()] = self._value
            self._field = self._value = b""

        def headers_finished() -> None:
            self._events.append(("part", self._headers.get(b"content-disposition", b"")))
            self._headers = {}

        def part_data(data: bytes, start: int, end: int) -> None:
            if end > start:
                self._events.append(("data", bytes(data[start:end])))

        self._parser = MultipartParser(self.boundary, {
            "on_header_field": header_field, "on_header_value": header_value, "on_header_end": header_end,
            "on_headers_finished": headers_finished, "on_part_data": part_data,
            "on_part_end": lambda: self._events.append(("end", b"")),
            "on_end": lambda: self._events.append(("done", b"")),
        })  # fmt: skip

    async def next_event(self) -> tuple[str, bytes]:
        assert self._parser is not None
        while not self._events:
            if self._finished:
                return "done", b""
            chunk = await anext(self.body, None)
            if chunk is None:
                self._finished = True
                self._parser.finalize()
                continue
            try:
                self._parser.write(chunk)
            except Exception as e:  # python-multipart's parse errors
                raise HTTPError(400, f"invalid multipart body: {e}") from None
        return self._events.popleft()

    async def parts(self) -> AsyncIterator[Part]:
        while True:
            kind, value = await self.next_event()
            if kind == "done":
                return
            if kind != "part":
                continue
            _, options = parse_options_header(value)
            name, filename = options.get(b"name"), options.get(b"filename")
            part = Part(name.decode("utf-8", "replace") if name is not None else None,
                        filename.decode("utf-8", "replace") if filename is not None else None, self)
            yield part
            await part.skip()  # whatever the consumer left of it


def boundary_of(content_type: str) -> bytes:
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise HTTPError(400, "invalid multipart body: the Content-Type has no boundary")
    return boundary
