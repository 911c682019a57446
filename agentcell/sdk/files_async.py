"""`sbx.files` for AsyncSandbox: /files for content, filesystem.Filesystem RPC for the rest."""

from __future__ import annotations

import asyncio
import json
import urllib.parse
import zlib
from collections.abc import AsyncIterator, Callable
from typing import IO, Any, Literal

import httpx

from agentcell.errors import NotFoundException, SandboxException
from agentcell.sdk import fast_async_http as fah
from agentcell.sdk import files as f
from agentcell.sdk.config import SandboxConnection
from agentcell.sdk.connect_rpc import astream, aunary
from agentcell.sdk.methods import call_back
from agentcell.sdk.models import (
    EntryInfo,
    FilesystemEvent,
    WriteInfo,
    entry_from_json,
    event_from_json,
    write_info_from_json,
)
from agentcell.sdk.transport import ConnectCodeError, error_from_http


def _decoded(encoding: str | None, content: bytes) -> bytes:
    return zlib.decompress(content, 31) if encoding == "gzip" else content


def _url(path: str) -> str:
    return "/files?" + urllib.parse.urlencode({"path": path})


class AsyncWatchHandle:
    """A directory watch whose events are passed to `on_event` as they come, in a background task
    (e2b's AsyncWatchHandle). `on_exit` gets None when the watch ends by itself (its timeout), or the
    exception that ended it; `stop()` ends it."""

    def __init__(self, events: AsyncIterator[dict[str, Any]], on_event: Callable[[FilesystemEvent], Any],
                 on_exit: Callable[[Exception | None], Any] | None) -> None:
        self._events = events
        self._on_event = on_event
        self._on_exit = on_exit
        self._task = asyncio.create_task(self._consume())

    async def _consume(self) -> None:
        error: Exception | None = None
        try:
            async for msg in self._events:
                raw = msg.get("event", msg).get("filesystem")
                if raw and (event := event_from_json(raw)) is not None:
                    await call_back(self._on_event, event)
        except Exception as e:
            error = e
        finally:
            await self._events.aclose()  # type: ignore[attr-defined]
        await call_back(self._on_exit, error)

    async def stop(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass


class AsyncFilesystem:
    def __init__(self, conn: SandboxConnection) -> None:
        self._conn = conn

    def _bound(self, request_timeout: float | None) -> float | None:
        return request_timeout or self._conn.config.request_timeout or None

    async def _rpc(self, path: str, msg: dict[str, Any], request_timeout: float | None) -> dict[str, Any]:
        rt = self._bound(request_timeout)
        return await aunary(fah.client(self._conn.config.endpoint), path, msg, self._conn.envd_headers, (rt, rt),
                            self._conn.sandbox_id)

    async def _files(self, method: str, url: str, headers: dict[str, str], request_timeout: float | None,
                     what: str, body: bytes | None = None, stream: bool = False) -> fah.Response:
        rt = self._bound(request_timeout)
        try:
            return await fah.client(self._conn.config.endpoint).request(
                method, url, body=body, headers=headers, connect=rt, read=rt, stream=stream)
        except fah.HTTPError as e:
            raise fah.transport_error(e, what) from None

    async def read(
        self,
        path: str,
        format: Literal["text", "bytes", "stream"] = "text",
        user: str | None = None,
        request_timeout: float | None = None,
        gzip: bool = False,
        stream_idle_timeout: float | None = None,
    ) -> Any:
        """The file's content: str (text), bytearray (bytes) or an iterator of bytes chunks (stream).
        `gzip`: compressed on the wire (decoded here); `stream_idle_timeout`: seconds a stream may
        stay silent (default: the request timeout)."""
        headers = self._conn.envd_user_headers(user)
        if gzip:
            headers = {**headers, "Accept-Encoding": "gzip"}
        if format == "stream":
            return self._read_stream(path, headers, stream_idle_timeout or request_timeout)
        r = await self._files("GET", _url(path), headers, request_timeout, f"read {path}")
        if r.status != 200:
            raise self._error(r.status, r.content, path)
        content = _decoded(r.headers.get("content-encoding"), r.content)
        return content.decode("utf-8", "replace") if format == "text" else bytearray(content)

    async def _read_stream(self, path: str, headers: dict[str, str],
                           request_timeout: float | None) -> AsyncIterator[bytes]:
        r = await self._files("GET", _url(path), headers, request_timeout, f"read {path}", stream=True)
        try:
            try:
                if r.status != 200:
                    raise self._error(r.status, await r.read(), path)
                unzip = zlib.decompressobj(31) if r.headers.get("content-encoding") == "gzip" else None
                async for chunk in r.aiter_bytes():
                    yield unzip.decompress(chunk) if unzip else chunk
            except fah.HTTPError as e:
                raise fah.transport_error(e, f"read {path}") from None
        finally:
            await r.aclose()

    def _error(self, status: int, content: bytes, path: str) -> Exception:
        e = error_from_http(status, content, self._conn.sandbox_id, f"file {path}")
        return f.file_not_found(e, path) if isinstance(e, NotFoundException) else e

    async def write(
        self,
        path: str,
        data: str | bytes | IO[Any],
        user: str | None = None,
        request_timeout: float | None = None,
        gzip: bool = False,
        use_octet_stream: bool | None = None,
        metadata: dict[str, str] | None = None,
    ) -> WriteInfo:
        """Write (create or replace) one file; parent directories are created. `metadata` is kept
        with the file (EntryInfo.metadata); an overwrite without it clears it. `gzip` compresses the
        upload; agentcell always uploads one file as octet-stream (`use_octet_stream=False`: multipart)."""
        base = {**self._conn.envd_user_headers(user), "Content-Type": "application/octet-stream"}
        headers = f.upload_headers(base, metadata, gzip, use_octet_stream)
        if use_octet_stream is False:
            return (await self.write_files([{"path": path, "data": data}], user, request_timeout, metadata=metadata))[0]
        r = await self._files("POST", _url(path), headers, request_timeout, f"write {path}",
                              body=f.upload_body(data, gzip))
        if r.status != 200:
            raise self._error(r.status, r.content, path)
        return write_info_from_json(json.loads(r.content)[0])

    async def write_files(
        self, files: list[dict[str, Any]], user: str | None = None, request_timeout: float | None = None,
        gzip: bool = False, use_octet_stream: bool | None = None, metadata: dict[str, str] | None = None,
    ) -> list[WriteInfo]:
        """Write several files ([{"path", "data"}]) in one multipart request (with `gzip` or
        `use_octet_stream`, one compressed octet-stream upload each); `metadata` goes with every file."""
        if not files:
            return []
        if gzip or use_octet_stream:
            return [await self.write(x["path"], x["data"], user, request_timeout, gzip, True, metadata) for x in files]
        form = httpx.Request("POST", "http://localhost/files", files=f.multipart(files))  # httpx encodes the form
        base = {**self._conn.envd_user_headers(user), "Content-Type": form.headers["Content-Type"]}
        headers = f.upload_headers(base, metadata, False, None)
        r = await self._files("POST", "/files", headers, request_timeout, "write_files", body=form.read())
        if r.status != 200:
            raise self._error(r.status, r.content, ", ".join(x["path"] for x in files))
        return [write_info_from_json(x) for x in json.loads(r.content)]

    async def list(
        self, path: str, depth: int | None = 1, user: str | None = None, request_timeout: float | None = None
    ) -> list[EntryInfo]:
        try:
            res = await self._rpc(f.LIST_DIR, {"path": path, "depth": f.check_depth(depth)}, request_timeout)
        except NotFoundException as e:
            raise f.file_not_found(e, path) from None
        return [entry_from_json(e) for e in res.get("entries", [])]

    async def exists(self, path: str, user: str | None = None, request_timeout: float | None = None) -> bool:
        try:
            await self._rpc(f.STAT, {"path": path}, request_timeout)
        except NotFoundException:
            return False
        return True

    async def get_info(
        self, path: str, user: str | None = None, request_timeout: float | None = None
    ) -> EntryInfo:
        try:
            return entry_from_json((await self._rpc(f.STAT, {"path": path}, request_timeout))["entry"])
        except NotFoundException as e:
            raise f.file_not_found(e, path) from None

    async def remove(self, path: str, user: str | None = None, request_timeout: float | None = None) -> None:
        try:
            await self._rpc(f.REMOVE, {"path": path}, request_timeout)
        except NotFoundException as e:
            raise f.file_not_found(e, path) from None

    async def rename(
        self, old_path: str, new_path: str, user: str | None = None, request_timeout: float | None = None
    ) -> EntryInfo:
        try:
            res = await self._rpc(f.MOVE, {"source": old_path, "destination": new_path}, request_timeout)
        except NotFoundException as e:
            raise f.file_not_found(e, old_path) from None
        return entry_from_json(res["entry"])

    async def make_dir(
        self, path: str, user: str | None = None, request_timeout: float | None = None
    ) -> bool:
        """Create a directory (and parents); False if it already exists."""
        try:
            await self._rpc(f.MAKE_DIR, {"path": path}, request_timeout)
        except ConnectCodeError as e:
            if e.code == "already_exists":
                return False
            raise
        return True

    async def watch_dir(self, path: str, on_event: Callable[[FilesystemEvent], Any],
                        on_exit: Callable[[Exception | None], Any] | None = None, user: str | None = None,
                        request_timeout: float | None = None, timeout: float | None = 60,
                        recursive: bool = False, include_entry: bool = False,
                        allow_network_mounts: bool = False) -> AsyncWatchHandle:
        """Watch a directory (and, with `recursive`, everything below it): `on_event` gets each
        FilesystemEvent as it comes, for `timeout` seconds (None or 0: until stop()); as e2b's."""
        rt = self._bound(request_timeout)
        headers = {**self._conn.envd_user_headers(user), "Keepalive-Ping-Interval": "50"}
        events = astream(fah.client(self._conn.config.endpoint), f.WATCH_DIR,
                         f.watch_request(path, recursive, include_entry, allow_network_mounts), headers, (rt, None),
                         self._conn.sandbox_id, timeout_ms=int(timeout * 1000) if timeout else None)
        try:
            first = await asyncio.wait_for(anext(events), rt)
        except NotFoundException as e:
            await events.aclose()  # type: ignore[attr-defined]
            raise f.file_not_found(e, path) from None
        except BaseException:
            await events.aclose()  # type: ignore[attr-defined]
            raise
        if "start" not in first.get("event", first):
            await events.aclose()  # type: ignore[attr-defined]
            raise SandboxException(f"Failed to start watch: expected start event, got {first}")
        return AsyncWatchHandle(events, on_event, on_exit)
