"""`sbx.files` for the sync Sandbox: /files for content, filesystem.Filesystem RPC for the rest."""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Iterator
from typing import IO, Any, Literal

import httpx
from urllib3.exceptions import HTTPError

from agentcell.errors import NotFoundException, SandboxException
from agentcell.sdk import fast_http
from agentcell.sdk import files as f
from agentcell.sdk.config import SandboxConnection
from agentcell.sdk.connect_rpc import unary
from agentcell.sdk.models import (
    EntryInfo,
    FilesystemEvent,
    WriteInfo,
    entry_from_json,
    event_from_json,
    write_info_from_json,
)
from agentcell.sdk.transport import (
    ConnectCodeError,
    error_from_http,
    error_from_transport,
    sync_client,
    timeout,
)


class WatchHandle:
    """A directory watcher that collects events in the sandbox until polled (e2b's WatchHandle):
    `get_new_events()` returns those since the last call, `stop()` ends it."""

    def __init__(self, fs: Filesystem, watcher_id: str) -> None:
        self._fs = fs
        self._watcher_id = watcher_id
        self._closed = False

    def get_new_events(self, request_timeout: float | None = None) -> list[FilesystemEvent]:
        if self._closed:
            raise SandboxException("The watcher is already stopped")
        res = self._fs._rpc(f.GET_WATCHER_EVENTS, {"watcherId": self._watcher_id}, request_timeout)
        return [ev for e in res.get("events", []) if (ev := event_from_json(e)) is not None]

    def stop(self, request_timeout: float | None = None) -> None:
        self._fs._rpc(f.REMOVE_WATCHER, {"watcherId": self._watcher_id}, request_timeout)
        self._closed = True


class Filesystem:
    def __init__(self, conn: SandboxConnection) -> None:
        self._conn = conn
        self._client = sync_client(conn.config.endpoint)
        self._fast = fast_http.client(conn.config.endpoint)

    def _t(self, request_timeout: float | None) -> httpx.Timeout:
        return timeout(request_timeout or self._conn.config.request_timeout)

    def _bound(self, request_timeout: float | None) -> float | None:
        return request_timeout or self._conn.config.request_timeout or None

    def _rpc(self, path: str, msg: dict[str, Any], request_timeout: float | None) -> dict[str, Any]:
        rt = self._bound(request_timeout)
        return unary(self._fast, path, msg, self._conn.envd_headers, (rt, rt), self._conn.sandbox_id)

    def _files(self, method: str, path: str, headers: dict[str, str], request_timeout: float | None,
               body: bytes | IO[bytes] | None = None, stream: bool = False) -> fast_http.Response:
        rt = self._bound(request_timeout)
        url = "/files?" + urllib.parse.urlencode({"path": path})
        try:
            return self._fast.request(method, url, body=body, headers=headers, connect=rt, read=rt, stream=stream)
        except HTTPError as e:
            raise fast_http.transport_error(e, f"{'read' if method == 'GET' else 'write'} {path}") from None

    def read(
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
        r = self._files("GET", path, headers, request_timeout)
        if r.status != 200:
            raise self._error(r.status, r.data, path)
        return r.data.decode("utf-8", "replace") if format == "text" else bytearray(r.data)

    def _read_stream(self, path: str, headers: dict[str, str], request_timeout: float | None) -> Iterator[bytes]:
        r = self._files("GET", path, headers, request_timeout, stream=True)
        complete = False
        try:
            if r.status != 200:
                raise self._error(r.status, r.read(), path)
            try:
                yield from fast_http.chunks(r)
            except HTTPError as e:
                raise fast_http.transport_error(e, f"read {path}") from None
            complete = True
        finally:
            fast_http.finish(r, complete)

    def _error(self, status: int, content: bytes, path: str) -> Exception:
        e = error_from_http(status, content, self._conn.sandbox_id, f"file {path}")
        return f.file_not_found(e, path) if isinstance(e, NotFoundException) else e

    def write(
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
            return self.write_files([{"path": path, "data": data}], user, request_timeout, metadata=metadata)[0]
        if not gzip and f.is_binary_stream(data):  # streamed as it is read, never whole in memory
            body: Any = data
            headers = {**headers, **f.stream_length_header(data)}
        else:
            body = f.upload_body(data, gzip)
        r = self._files("POST", path, headers, request_timeout, body=body)
        if r.status != 200:
            raise self._error(r.status, r.data, path)
        return write_info_from_json(json.loads(r.data)[0])

    def write_files(
        self, files: list[dict[str, Any]], user: str | None = None, request_timeout: float | None = None,
        gzip: bool = False, use_octet_stream: bool | None = None, metadata: dict[str, str] | None = None,
    ) -> list[WriteInfo]:
        """Write several files ([{"path", "data"}]) in one multipart request (with `gzip` or
        `use_octet_stream`, one compressed octet-stream upload each); `metadata` goes with every file."""
        if not files:
            return []
        if gzip or use_octet_stream:
            return [self.write(x["path"], x["data"], user, request_timeout, gzip, True, metadata) for x in files]
        try:
            r = self._client.post(
                "/files",
                files=f.multipart(files),
                headers=f.upload_headers(self._conn.envd_user_headers(user), metadata, False, None),
                timeout=self._t(request_timeout),
            )
        except httpx.HTTPError as e:
            raise error_from_transport(e, "write_files") from None
        if r.status_code != 200:
            raise self._error(r.status_code, r.content, ", ".join(x["path"] for x in files))
        return [write_info_from_json(x) for x in r.json()]

    def list(
        self, path: str, depth: int | None = 1, user: str | None = None, request_timeout: float | None = None
    ) -> list[EntryInfo]:
        try:
            res = self._rpc(f.LIST_DIR, {"path": path, "depth": f.check_depth(depth)}, request_timeout)
        except NotFoundException as e:
            raise f.file_not_found(e, path) from None
        return [entry_from_json(e) for e in res.get("entries", [])]

    def exists(self, path: str, user: str | None = None, request_timeout: float | None = None) -> bool:
        try:
            self._rpc(f.STAT, {"path": path}, request_timeout)
        except NotFoundException:
            return False
        return True

    def get_info(self, path: str, user: str | None = None, request_timeout: float | None = None) -> EntryInfo:
        try:
            return entry_from_json(self._rpc(f.STAT, {"path": path}, request_timeout)["entry"])
        except NotFoundException as e:
            raise f.file_not_found(e, path) from None

    def remove(self, path: str, user: str | None = None, request_timeout: float | None = None) -> None:
        try:
            self._rpc(f.REMOVE, {"path": path}, request_timeout)
        except NotFoundException as e:
            raise f.file_not_found(e, path) from None

    def rename(
        self, old_path: str, new_path: str, user: str | None = None, request_timeout: float | None = None
    ) -> EntryInfo:
        try:
            res = self._rpc(f.MOVE, {"source": old_path, "destination": new_path}, request_timeout)
        except NotFoundException as e:
            raise f.file_not_found(e, old_path) from None
        return entry_from_json(res["entry"])

    def make_dir(self, path: str, user: str | None = None, request_timeout: float | None = None) -> bool:
        """Create a directory (and parents); False if it already exists."""
        try:
            self._rpc(f.MAKE_DIR, {"path": path}, request_timeout)
        except ConnectCodeError as e:
            if e.code == "already_exists":
                return False
            raise
        return True

    def watch_dir(self, path: str, user: str | None = None, request_timeout: float | None = None,
                  recursive: bool = False, include_entry: bool = False,
                  allow_network_mounts: bool = False) -> WatchHandle:
        """Watch a directory (and, with `recursive`, everything below it) for changes; poll the
        handle's get_new_events(). A sandbox has at most 32 watchers; stop() the ones you are done with."""
        try:
            res = self._rpc(f.CREATE_WATCHER, f.watch_request(path, recursive, include_entry, allow_network_mounts),
                            request_timeout)
        except NotFoundException as e:
            raise f.file_not_found(e, path) from None
        return WatchHandle(self, str(res.get("watcherId", "")))
