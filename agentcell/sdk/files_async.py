"""`sbx.files` for AsyncSandbox: /files for content, filesystem.Filesystem RPC for the rest."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import IO, Any, Literal

import httpx

from agentcell.errors import NotFoundException
from agentcell.sdk import files as f
from agentcell.sdk.config import SandboxConnection
from agentcell.sdk.connect_rpc import aunary
from agentcell.sdk.models import EntryInfo, WriteInfo, entry_from_json, write_info_from_json
from agentcell.sdk.transport import (
    ConnectCodeError,
    async_client,
    error_from_http,
    error_from_transport,
    timeout,
)


class AsyncFilesystem:
    def __init__(self, conn: SandboxConnection) -> None:
        self._conn = conn

    def _t(self, request_timeout: float | None) -> httpx.Timeout:
        return timeout(request_timeout or self._conn.config.request_timeout)

    async def _rpc(self, path: str, msg: dict[str, Any], request_timeout: float | None) -> dict[str, Any]:
        return await aunary(
            async_client(self._conn.config.endpoint),
            path,
            msg,
            self._conn.envd_headers,
            self._t(request_timeout),
            self._conn.sandbox_id,
        )

    async def read(
        self,
        path: str,
        format: Literal["text", "bytes", "stream"] = "text",
        user: str | None = None,
        request_timeout: float | None = None,
    ) -> Any:
        """The file's content: str (text), bytearray (bytes) or an iterator of bytes chunks (stream)."""
        headers = self._conn.envd_user_headers(user)
        params = {"path": path}
        if format == "stream":
            return self._read_stream(params, headers, request_timeout)
        try:
            r = await async_client(self._conn.config.endpoint).get(
                "/files", params=params, headers=headers, timeout=self._t(request_timeout)
            )
        except httpx.HTTPError as e:
            raise error_from_transport(e, f"read {path}") from None
        if r.status_code != 200:
            raise self._error(r.status_code, r.content, path)
        return r.text if format == "text" else bytearray(r.content)

    async def _read_stream(
        self, params: dict[str, str], headers: dict[str, str], request_timeout: float | None
    ) -> AsyncIterator[bytes]:
        client = async_client(self._conn.config.endpoint)
        req = client.build_request(
            "GET", "/files", params=params, headers=headers, timeout=self._t(request_timeout)
        )
        r = await client.send(req, stream=True)
        try:
            if r.status_code != 200:
                raise self._error(r.status_code, await r.aread(), params["path"])
            async for chunk in r.aiter_bytes():
                yield chunk
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
    ) -> WriteInfo:
        """Write (create or replace) one file; parent directories are created."""
        headers = {**self._conn.envd_user_headers(user), "Content-Type": "application/octet-stream"}
        try:
            r = await async_client(self._conn.config.endpoint).post(
                "/files",
                params={"path": path},
                content=f.to_bytes(data),
                headers=headers,
                timeout=self._t(request_timeout),
            )
        except httpx.HTTPError as e:
            raise error_from_transport(e, f"write {path}") from None
        if r.status_code != 200:
            raise self._error(r.status_code, r.content, path)
        return write_info_from_json(r.json()[0])

    async def write_files(
        self, files: list[dict[str, Any]], user: str | None = None, request_timeout: float | None = None
    ) -> list[WriteInfo]:
        """Write several files ([{"path", "data"}]) in one multipart request."""
        if not files:
            return []
        try:
            r = await async_client(self._conn.config.endpoint).post(
                "/files",
                files=f.multipart(files),
                headers=self._conn.envd_user_headers(user),
                timeout=self._t(request_timeout),
            )
        except httpx.HTTPError as e:
            raise error_from_transport(e, "write_files") from None
        if r.status_code != 200:
            raise self._error(r.status_code, r.content, ", ".join(x["path"] for x in files))
        return [write_info_from_json(x) for x in r.json()]

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
