"""What the sync and async filesystem APIs share: paths, upload bodies and RPC names."""

from __future__ import annotations

import io
from typing import IO, Any

from agentcell.errors import FileNotFoundException, InvalidArgumentException, NotFoundException

STAT = "/filesystem.Filesystem/Stat"
LIST_DIR = "/filesystem.Filesystem/ListDir"
MAKE_DIR = "/filesystem.Filesystem/MakeDir"
MOVE = "/filesystem.Filesystem/Move"
REMOVE = "/filesystem.Filesystem/Remove"


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
