"""Files in the state dir that survive a crash or a power cut: each is its old or its new version.

`atomic_write` writes a temporary file beside the target, fsyncs it, renames it over the target and
fsyncs the directory: a crash before the rename leaves the old file (and a `.<name>.*.tmp` that
`remove_temps` clears), one after it the new. `fsync_tree` makes content durable before the record
that points at it is written. A file that is damaged anyway (a disk's fault, a hand edit, a file from
before this module) is a `TornFileError` when read; `move_aside` keeps it for the operator.

Only the standard library: the crash tests load this file alone in a bare interpreter.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

TEMP_SUFFIX = ".tmp"


class TornFileError(ValueError):
    """A state file that is not whole (empty, cut short, not what it should hold): refused, never guessed at."""

    def __init__(self, path: Path, what: str, reason: str, remedy: str) -> None:
        super().__init__(f"{path}: {what} is damaged ({reason}); {remedy}")
        self.path = path
        self.what = what
        self.reason = reason
        self.remedy = remedy


def fsync_dir(path: Path) -> None:
    """The directory's entries (a rename, a new or removed file) on disk."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_dirs(path: Path, mode: int = 0o700) -> Path:
    """`path` made with any missing parents (mode `mode`), each new directory's entry fsynced in its
    parent: a mkdir is a directory entry like a rename, lost in a power cut until its parent is synced,
    and with it everything later written and synced below it (found by chaos.py power-cut)."""
    missing = []
    here = path
    while not here.is_dir():
        missing.append(here)
        here = here.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=mode)
        except FileExistsError:
            if not d.is_dir():
                raise
        fsync_dir(d.parent)
    return path


def fsync_tree(path: Path) -> None:
    """A file's data, or every file and directory under a directory, on disk (symlinks not followed)."""
    if not path.is_dir() or path.is_symlink():
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return
    for top, _dirs, files in os.walk(path):
        for name in files:
            p = Path(top) / name
            if not p.is_symlink():
                fsync_tree(p)
        fsync_dir(Path(top))


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """`path` holds `data` afterwards, or (after a crash at any point) what it held before."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TEMP_SUFFIX)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)  # the data before the name: a rename of unsynced data can leave an empty file
        finally:
            os.close(fd)
        os.rename(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def write_json(path: Path, value: Any, mode: int = 0o600) -> None:
    atomic_write(path, json.dumps(value, separators=(",", ":")).encode(), mode)


def read_json(path: Path, what: str, remedy: str) -> Any:
    """The JSON `path` holds; TornFileError if it is empty or not whole JSON (OSError as open raises)."""
    data = path.read_bytes()
    if not data:
        raise TornFileError(path, what, "it is empty", remedy)
    try:
        return json.loads(data)
    except ValueError as e:  # (UnicodeDecodeError is one)
        raise TornFileError(path, what, f"not valid JSON: {e}", remedy) from None


def utc_stamp() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def move_aside(path: Path, into: Path) -> Path:
    """Move `path` (a file or a directory) into the directory `into` (made if needed), under its own
    name or, if that is taken, with the time after it; returns where it went."""
    into.mkdir(mode=0o700, parents=True, exist_ok=True)
    dest = into / path.name
    n = 0
    while dest.exists() or dest.is_symlink():
        n += 1
        dest = into / f"{path.name}.{utc_stamp()}{f'.{n}' if n > 1 else ''}"
    os.rename(path, dest)
    fsync_dir(into)
    fsync_dir(path.parent)
    return dest


def set_aside(path: Path, into: Path) -> str:
    """`move_aside`, said for the log: where `path` went, or why it is still where it was."""
    try:
        return str(move_aside(path, into))
    except OSError as e:
        return f"nowhere ({e}): left where it is"


def remove_temps(directory: Path) -> list[Path]:
    """Remove what a crash during atomic_write left in `directory` (never a file's only version)."""
    gone = []
    for p in directory.glob(f".*{TEMP_SUFFIX}"):
        if p.is_file():
            with contextlib.suppress(OSError):
                p.unlink()
                gone.append(p)
    return gone
