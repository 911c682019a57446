"""What the sync and async filesystem APIs share: paths, upload bodies and RPC names."""

from __future__ import annotations

import base64
import hashlib
import io
import time
import urllib.parse
import zlib
from typing import IO, Any

from agentcell.errors import FileNotFoundException, InvalidArgumentException, NotFoundException

STAT = "/filesystem.Filesystem/Stat"
LIST_DIR = "/filesystem.Filesystem/ListDir"
MAKE_DIR = "/filesystem.Filesystem/MakeDir"
MOVE = "/filesystem.Filesystem/Move"
REMOVE = "/filesystem.Filesystem/Remove"
WATCH_DIR = "/filesystem.Filesystem/WatchDir"
CREATE_WATCHER = "/filesystem.Filesystem/CreateWatcher"
GET_WATCHER_EVENTS = "/filesystem.Filesystem/GetWatcherEvents"
REMOVE_WATCHER = "/filesystem.Filesystem/RemoveWatcher"


def watch_request(path: str, recursive: bool, include_entry: bool, allow_network_mounts: bool) -> dict[str, Any]:
    return {"path": path, "recursive": recursive, "includeEntry": include_entry,
            "allowNetworkMounts": allow_network_mounts}


def signature(path: str, operation: str, user: str | None, token: str, expiration: int | None) -> str:
    """envd's v1 file URL signature, as e2b's get_signature makes it."""
    raw = f"{path}:{operation}:{user or ''}:{token}" + (f":{expiration}" if expiration is not None else "")
    return "v1_" + base64.b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode()


def file_url(base_url: str, token: str | None, path: str, operation: str, user: str | None,
             use_signature_expiration: int | None) -> str:
    """A /files URL that needs no header (e2b's download_url/upload_url): signed with the sandbox's
    access token, which the server also uses to tell which sandbox it is for."""
    if token is None and use_signature_expiration is not None:
        raise InvalidArgumentException("Signature expiration can be used only when sandbox is created as secured.")
    query: dict[str, str] = {"path": path} if path else {}
    if user:
        query["username"] = user
    if token is not None:
        expiration = int(time.time()) + use_signature_expiration if use_signature_expiration is not None else None
        query["signature"] = signature(path, operation, user, token, expiration)
        if expiration:
            query["signature_expiration"] = str(expiration)
    return f"{base_url.rstrip('/')}/files?" + urllib.parse.urlencode(query, quote_via=urllib.parse.quote)


def to_bytes(data: str | bytes | bytearray | IO[Any]) -> bytes:
    if isinstance(data, str):
        return data.encode()
    if isinstance(data, bytes | bytearray | memoryview):
        return bytes(data)
    if isinstance(data, io.TextIOBase):
        return data.read().encode()
    if hasattr(data, "read"):
        content = data.read()
        return content.encode() if isinstance(content, str) else bytes(content)
    raise InvalidArgumentException(f"cannot write {type(data).__name__}: pass str, bytes or a file-like object")


def is_binary_stream(data: object) -> bool:
    """A binary file object: files.write() streams it (a chunked upload when its size is not known)."""
    return isinstance(data, io.RawIOBase | io.BufferedIOBase)


def stream_length_header(data: IO[bytes]) -> dict[str, str]:
    """Content-Length for a regular file (what is left of it); none for a pipe or socket (chunked)."""
    import os
    import stat

    try:
        st = os.fstat(data.fileno())
        if stat.S_ISREG(st.st_mode):
            return {"Content-Length": str(max(0, st.st_size - data.tell()))}
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass
    return {}


def upload_headers(base: dict[str, str], metadata: dict[str, str] | None, gzip: bool,
                   use_octet_stream: bool | None) -> dict[str, str]:
    """e2b's write options as headers: metadata as X-Metadata-<key> (kept as the file's xattrs,
    keys lowercased), gzip as Content-Encoding (it implies the octet-stream upload)."""
    if gzip and use_octet_stream is False:
        raise InvalidArgumentException("gzip needs the octet-stream upload; leave use_octet_stream unset or True")
    headers = dict(base)
    for key, value in (metadata or {}).items():
        if not isinstance(key, str) or not isinstance(value, str) or not key:
            raise InvalidArgumentException("metadata must map non-empty str keys to str values")
        headers[f"X-Metadata-{key}"] = value
    if gzip:
        headers["Content-Encoding"] = "gzip"
    return headers


def upload_body(data: str | bytes | bytearray | IO[Any], gzip: bool) -> bytes:
    raw = to_bytes(data)
    return zlib_gzip(raw) if gzip else raw


def zlib_gzip(raw: bytes) -> bytes:
    c = zlib.compressobj(6, zlib.DEFLATED, 31)
    return c.compress(raw) + c.flush()


def multipart(files: list[dict[str, Any]]) -> list[tuple[str, tuple[str, bytes, str]]]:
    """One part named `file` per entry; the part's filename is the destination path (as e2b sends it)."""
    return [("file", (f["path"], to_bytes(f["data"]), "application/octet-stream")) for f in files]


def check_depth(depth: int | None) -> int:
    if depth is None:
        return 1
    if depth < 1:
        raise InvalidArgumentException("depth should be at least 1")
    return depth


def file_not_found(e: NotFoundException, path: str) -> FileNotFoundException:
    return FileNotFoundException(f"{path}: {e}")
