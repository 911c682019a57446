"""Volumes (e2b's `Volume` and `AsyncVolume`): named, persistent directory trees with a size quota,
mounted into sandboxes at create (`Sandbox.create(volume_mounts={"/mnt/data": vol})`) and read and
written without one. The server's side: docs/volumes.md.

    vol = Volume.create("datasets")
    vol.write_file("/train.csv", data)
    with Sandbox.create(volume_mounts={"/mnt/data": vol}) as sbx:
        sbx.commands.run("wc -l /mnt/data/train.csv")
"""

from __future__ import annotations

import io
import urllib.parse
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any, Literal

import httpx

from agentcell.errors import NotFoundException, SandboxException
from agentcell.sdk import api, fast_async_http
from agentcell.sdk.config import ConnectionConfig, aresolve, resolve
from agentcell.sdk.methods import hybrid
from agentcell.sdk.transport import error_from_http, error_from_transport, sync_client, timeout

FILE_TIMEOUT = 3600.0  # a file's transfer (as e2b's FILE_TIMEOUT)


class VolumeException(SandboxException):
    """A volume operation failed (e2b's VolumeException)."""


class VolumeNotFoundException(VolumeException, NotFoundException):
    """No volume of that id (or another tenant's)."""


class VolumePathNotFoundException(VolumeException, NotFoundException):
    """No file or directory at that path in the volume."""


@dataclass(frozen=True)
class VolumeInfo:
    volume_id: str
    name: str


@dataclass(frozen=True)
class VolumeAndToken(VolumeInfo):
    token: str
    size_mb: int | None = None  # agentcell: the volume's quota


@dataclass(frozen=True)
class VolumeEntryStat:
    name: str
    type: Literal["file", "directory", "symlink", "unknown"]
    path: str
    size: int
    mode: int
    uid: int
    gid: int
    atime: datetime
    mtime: datetime
    ctime: datetime
    target: str | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> VolumeEntryStat:
        when = {k: datetime.fromisoformat(d[k].replace("Z", "+00:00")) for k in ("atime", "mtime", "ctime")}
        return cls(d["name"], d["type"], d["path"], d["size"], d["mode"], d["uid"], d["gid"], **when,
                   target=d.get("target"))


def mounts_body(volume_mounts: Mapping[str, Any] | None) -> list[dict[str, Any]]:
    """`volume_mounts` ({path: Volume | AsyncVolume | name | {"volume": ..., "read_only": bool}}) as the
    create's `volumeMounts` (readOnly: agentcell's extension)."""
    out: list[dict[str, Any]] = []
    for path, value in (volume_mounts or {}).items():
        read_only = False
        if isinstance(value, Mapping):
            read_only = bool(value.get("read_only", False))
            value = value.get("volume")
        name = value.name if isinstance(value, Volume | AsyncVolume) else value
        if not isinstance(name, str):
            raise VolumeException(f"volume_mounts[{path!r}] is a Volume or a volume's name, not {type(value).__name__}")
        out.append({"name": name, "path": path, **({"readOnly": True} if read_only else {})})
    return out


def _info(d: dict[str, Any]) -> VolumeAndToken:
    return VolumeAndToken(d["volumeID"], d["name"], d["token"], d.get("sizeMB"))


def _volume_error(status: int, content: bytes, what: str, path: str | None = None) -> SandboxException:
    if status == 404:
        return VolumePathNotFoundException(f"path {path} not found") if path is not None \
            else VolumeNotFoundException(f"{what}: volume not found")
    e = error_from_http(status, content, what=what)
    return e if status in (401, 429, 507) else VolumeException(str(e))


def _params(path: str, **extra: Any) -> dict[str, str]:
    out = {"path": path}
    for k, v in extra.items():
        if v is not None:
            out[k] = str(v).lower() if isinstance(v, bool) else str(v)
    return out


def _payload(data: str | bytes | IO[Any]) -> bytes | Iterator[bytes]:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, bytes | bytearray):
        return bytes(data)
    if isinstance(data, io.TextIOBase):
        return iter(lambda: data.read(1 << 20).encode(), b"")
    return iter(lambda: data.read(1 << 20), b"")


class Volume:
    """A volume (sync); `create`/`connect` give one, its methods act on its files."""

    def __init__(self, volume_id: str, name: str, token: str, config: ConnectionConfig) -> None:
        self.volume_id, self.name, self.token = volume_id, name, token
        self._config = config

    def __repr__(self) -> str:
        return f"Volume(volume_id={self.volume_id!r}, name={self.name!r})"

    # --- the volumes ----------------------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, size_mb: int | None = None, api_key: str | None = None, api_url: str | None = None,
               request_timeout: float | None = None) -> Volume:
        """A new volume; `size_mb` (agentcell) its quota, default the server's (--volume-size-mb)."""
        config = resolve(api_url, api_key, request_timeout)
        body: dict[str, Any] = {"name": name, **({"sizeMB": size_mb} if size_mb is not None else {})}
        d = api.call(config, "POST", "/volumes", json=body, ok=(201, 200)).json()
        return cls(d["volumeID"], d["name"], d["token"], config)

    @classmethod
    def connect(cls, volume_id: str, api_key: str | None = None, api_url: str | None = None,
                request_timeout: float | None = None) -> Volume:
        config = resolve(api_url, api_key, request_timeout)
        info = cls._cls_get_info(volume_id, api_key=api_key, api_url=config.base_url, request_timeout=request_timeout)
        return cls(info.volume_id, info.name, info.token, config)

    @staticmethod
    def _cls_get_info(volume_id: str, api_key: str | None = None, api_url: str | None = None,
                      request_timeout: float | None = None) -> VolumeAndToken:
        try:
            r = api.call(resolve(api_url, api_key, request_timeout), "GET", f"/volumes/{urllib.parse.quote(volume_id, safe='')}")
        except NotFoundException:
            raise VolumeNotFoundException(f"volume {volume_id} not found") from None
        return _info(r.json())

    @staticmethod
    def _cls_list(api_key: str | None = None, api_url: str | None = None,
                  request_timeout: float | None = None) -> list[VolumeInfo]:
        r = api.call(resolve(api_url, api_key, request_timeout), "GET", "/volumes")
        return [VolumeInfo(d["volumeID"], d["name"]) for d in r.json()]

    @staticmethod
    def destroy(volume_id: str, api_key: str | None = None, api_url: str | None = None,
                request_timeout: float | None = None) -> bool:
        """Destroy a volume and its files; False if there is none of that id. Refused (409) while a
        sandbox mounts it."""
        r = api.call(resolve(api_url, api_key, request_timeout), "DELETE",
                     f"/volumes/{urllib.parse.quote(volume_id, safe='')}", ok=(204, 200, 404))
        return r.status_code != 404

    # --- its files -----------------------------------------------------------------------------------

    def _request(self, method: str, what: str, params: dict[str, str], path: str | None, *,
                 content: Any = None, json: Any = None, request_timeout: float | None = None) -> httpx.Response:
        url = f"/volumecontent/{self.volume_id}/{what}"
        try:
            r = sync_client(self._config.endpoint).request(
                method, url, params=params, content=content, json=json,
                headers={"Authorization": f"Bearer {self.token}",
                         **({"Content-Type": "application/octet-stream"} if content is not None else {})},
                timeout=timeout(request_timeout or (FILE_TIMEOUT if what == "file" else self._config.request_timeout)))
        except httpx.HTTPError as e:
            raise error_from_transport(e, f"{method} {url}") from None
        if r.status_code >= 300:
            raise _volume_error(r.status_code, r.content, f"{method} {url}", path)
        return r

    @hybrid("_cls_get_info")
    def get_info(self, path: str, request_timeout: float | None = None) -> VolumeEntryStat:
        """Volume.get_info(volume_id): the volume's info and token; vol.get_info(path): a file's stat."""
        return VolumeEntryStat.from_json(self._request("GET", "path", _params(path), path,
                                                       request_timeout=request_timeout).json())

    @hybrid("_cls_list")
    def list(self, path: str, depth: int | None = None, request_timeout: float | None = None) -> list[VolumeEntryStat]:
        """Volume.list(): the volumes; vol.list(path): a directory's entries."""
        r = self._request("GET", "dir", _params(path, depth=depth), path, request_timeout=request_timeout)
        return [VolumeEntryStat.from_json(d) for d in r.json()]

    def exists(self, path: str, request_timeout: float | None = None) -> bool:
        try:
            self.get_info(path, request_timeout=request_timeout)
            return True
        except NotFoundException:
            return False

    def make_dir(self, path: str, uid: int | None = None, gid: int | None = None, mode: int | None = None,
                 force: bool | None = None, request_timeout: float | None = None) -> VolumeEntryStat:
        r = self._request("POST", "dir", _params(path, uid=uid, gid=gid, mode=mode, force=force), path,
                          request_timeout=request_timeout)
        return VolumeEntryStat.from_json(r.json())

    def update_metadata(self, path: str, uid: int | None = None, gid: int | None = None, mode: int | None = None,
                        request_timeout: float | None = None) -> VolumeEntryStat:
        body = {k: v for k, v in (("uid", uid), ("gid", gid), ("mode", mode)) if v is not None}
        return VolumeEntryStat.from_json(self._request("PATCH", "path", _params(path), path, json=body,
                                                       request_timeout=request_timeout).json())

    def read_file(self, path: str, format: Literal["text", "bytes", "stream"] = "text",  # noqa: A002 - e2b's name
                  request_timeout: float | None = None) -> Any:
        """The file's content: str (text), bytes, or an iterator of bytes (stream)."""
        if format == "stream":
            return self._stream(path, request_timeout)
        r = self._request("GET", "file", _params(path), path, request_timeout=request_timeout)
        return r.content if format == "bytes" else r.text

    def _stream(self, path: str, request_timeout: float | None) -> Iterator[bytes]:
        url = f"/volumecontent/{self.volume_id}/file"
        with sync_client(self._config.endpoint).stream(
                "GET", url, params=_params(path), headers={"Authorization": f"Bearer {self.token}"},
                timeout=timeout(request_timeout or FILE_TIMEOUT)) as r:
            if r.status_code >= 300:
                raise _volume_error(r.status_code, r.read(), f"GET {url}", path)
            yield from r.iter_bytes()

    def write_file(self, path: str, data: str | bytes | IO[Any], uid: int | None = None, gid: int | None = None,
                   mode: int | None = None, force: bool | None = None,
                   request_timeout: float | None = None) -> VolumeEntryStat:
        """Write a file (created, or replaced with force=True; a file object is streamed)."""
        r = self._request("PUT", "file", _params(path, uid=uid, gid=gid, mode=mode, force=force), path,
                          content=_payload(data), request_timeout=request_timeout)
        return VolumeEntryStat.from_json(r.json())

    def remove(self, path: str, request_timeout: float | None = None) -> None:
        """Remove a file, or a directory with everything in it."""
        self._request("DELETE", "path", _params(path), path, request_timeout=request_timeout)


class AsyncVolume:
    """A volume (async): Volume's methods as coroutines."""

    def __init__(self, volume_id: str, name: str, token: str, config: ConnectionConfig) -> None:
        self.volume_id, self.name, self.token = volume_id, name, token
        self._config = config

    def __repr__(self) -> str:
        return f"AsyncVolume(volume_id={self.volume_id!r}, name={self.name!r})"

    @classmethod
    async def create(cls, name: str, size_mb: int | None = None, api_key: str | None = None,
                     api_url: str | None = None, request_timeout: float | None = None) -> AsyncVolume:
        config = await aresolve(api_url, api_key, request_timeout)
        body: dict[str, Any] = {"name": name, **({"sizeMB": size_mb} if size_mb is not None else {})}
        d = (await api.acall(config, "POST", "/volumes", json=body, ok=(201, 200))).json()
        return cls(d["volumeID"], d["name"], d["token"], config)

    @classmethod
    async def connect(cls, volume_id: str, api_key: str | None = None, api_url: str | None = None,
                      request_timeout: float | None = None) -> AsyncVolume:
        config = await aresolve(api_url, api_key, request_timeout)
        info = await cls._cls_get_info(volume_id, api_key=api_key, api_url=config.base_url,
                                       request_timeout=request_timeout)
        return cls(info.volume_id, info.name, info.token, config)

    @staticmethod
    async def _cls_get_info(volume_id: str, api_key: str | None = None, api_url: str | None = None,
                            request_timeout: float | None = None) -> VolumeAndToken:
        try:
            r = await api.acall(await aresolve(api_url, api_key, request_timeout), "GET",
                                f"/volumes/{urllib.parse.quote(volume_id, safe='')}")
        except NotFoundException:
            raise VolumeNotFoundException(f"volume {volume_id} not found") from None
        return _info(r.json())

    @staticmethod
    async def _cls_list(api_key: str | None = None, api_url: str | None = None,
                        request_timeout: float | None = None) -> list[VolumeInfo]:
        r = await api.acall(await aresolve(api_url, api_key, request_timeout), "GET", "/volumes")
        return [VolumeInfo(d["volumeID"], d["name"]) for d in r.json()]

    @staticmethod
    async def destroy(volume_id: str, api_key: str | None = None, api_url: str | None = None,
                      request_timeout: float | None = None) -> bool:
        r = await api.acall(await aresolve(api_url, api_key, request_timeout), "DELETE",
                            f"/volumes/{urllib.parse.quote(volume_id, safe='')}", ok=(204, 200, 404))
        return r.status_code != 404

    async def _request(self, method: str, what: str, params: dict[str, str], path: str | None, *,
                       body: Any = None, json_body: bool = False, stream: bool = False,
                       request_timeout: float | None = None) -> fast_async_http.Response:
        url = fast_async_http.with_query(f"/volumecontent/{self.volume_id}/{what}", params)
        headers = {"Authorization": f"Bearer {self.token}"}
        if body is not None:
            headers["Content-Type"] = "application/json" if json_body else "application/octet-stream"
        rt = request_timeout or (FILE_TIMEOUT if what == "file" else self._config.request_timeout)
        try:
            r = await fast_async_http.client(self._config.endpoint).request(
                method, url, body=body, headers=headers, connect=rt, read=rt, stream=stream)
        except fast_async_http.HTTPError as e:
            raise fast_async_http.transport_error(e, f"{method} {url}") from None
        if r.status_code >= 300:
            content = await r.read() if stream else r.content
            raise _volume_error(r.status_code, content, f"{method} {url}", path)
        return r

    @hybrid("_cls_get_info")
    async def get_info(self, path: str, request_timeout: float | None = None) -> VolumeEntryStat:
        r = await self._request("GET", "path", _params(path), path, request_timeout=request_timeout)
        return VolumeEntryStat.from_json(r.json())

    @hybrid("_cls_list")
    async def list(self, path: str, depth: int | None = None,
                   request_timeout: float | None = None) -> list[VolumeEntryStat]:
        r = await self._request("GET", "dir", _params(path, depth=depth), path, request_timeout=request_timeout)
        return [VolumeEntryStat.from_json(d) for d in r.json()]

    async def exists(self, path: str, request_timeout: float | None = None) -> bool:
        try:
            await self.get_info(path, request_timeout=request_timeout)
            return True
        except NotFoundException:
            return False

    async def make_dir(self, path: str, uid: int | None = None, gid: int | None = None, mode: int | None = None,
                       force: bool | None = None, request_timeout: float | None = None) -> VolumeEntryStat:
        r = await self._request("POST", "dir", _params(path, uid=uid, gid=gid, mode=mode, force=force), path,
                                request_timeout=request_timeout)
        return VolumeEntryStat.from_json(r.json())

    async def update_metadata(self, path: str, uid: int | None = None, gid: int | None = None,
                              mode: int | None = None, request_timeout: float | None = None) -> VolumeEntryStat:
        body = {k: v for k, v in (("uid", uid), ("gid", gid), ("mode", mode)) if v is not None}
        r = await self._request("PATCH", "path", _params(path), path, body=fast_async_http.json_body(body),
                                json_body=True, request_timeout=request_timeout)
        return VolumeEntryStat.from_json(r.json())

    async def read_file(self, path: str, format: Literal["text", "bytes", "stream"] = "text",  # noqa: A002
                        request_timeout: float | None = None) -> Any:
        if format == "stream":
            r = await self._request("GET", "file", _params(path), path, stream=True, request_timeout=request_timeout)
            return r.aiter_bytes()
        r = await self._request("GET", "file", _params(path), path, request_timeout=request_timeout)
        return r.content if format == "bytes" else r.content.decode()

    async def write_file(self, path: str, data: str | bytes | IO[Any] | AsyncIterator[bytes], uid: int | None = None,
                         gid: int | None = None, mode: int | None = None, force: bool | None = None,
                         request_timeout: float | None = None) -> VolumeEntryStat:
        body: Any = data if hasattr(data, "__aiter__") else _payload(data)  # type: ignore[arg-type]
        if not isinstance(body, bytes) and not hasattr(body, "__aiter__"):
            body = b"".join(body)  # a sync file object: read here (stream an async iterator for big files)
        r = await self._request("PUT", "file", _params(path, uid=uid, gid=gid, mode=mode, force=force), path,
                                body=body, request_timeout=request_timeout)
        return VolumeEntryStat.from_json(r.json())

    async def remove(self, path: str, request_timeout: float | None = None) -> None:
        await self._request("DELETE", "path", _params(path), path, request_timeout=request_timeout)
