"""Host uid/gid ranges: each server instance reserves its own, disjoint from every other's.

A sandbox runs as host uid ``base + slot``. Kernel limits that count per host uid (RLIMIT_NPROC,
epoll watches, inotify instances, mqueue bytes, ...) are then per sandbox only if no two sandboxes
on the host ever share an id, including sandboxes of two servers. So a server reserves its range
before it creates anything:

* a lock file per reserved range in ``/run/agentcell/uids`` (``<first>-<last>``), held with
  ``flock`` for the server's life; the kernel drops the lock when the server dies, so a range of a
  dead server is free again without any clean-up;
* the range must not hold a uid or gid of ``/etc/passwd`` / ``/etc/group``, nor overlap a
  subordinate range of ``/etc/subuid`` / ``/etc/subgid`` (those belong to other users' containers).

``reserve(size)`` picks the lowest free range at or above ``AUTO_START``; ``reserve(size, base)``
takes exactly ``[base, base + size)`` or raises UidRangeError saying who holds it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
from dataclasses import dataclass

LOCK_DIR = "/run/agentcell/uids"
AUTO_START = 1 << 20  # 1,048,576: above the ids distributions hand out, below 2^31
_ALIGN = 1 << 16  # automatic ranges start on a 65,536 boundary, like /etc/subuid blocks
_MAX_ID = (1 << 31) - 1  # ids above 2^31 confuse too many tools


class UidRangeError(Exception):
    """The range cannot be reserved; the message says why and what to do."""


@dataclass
class UidRange:
    base: int
    size: int
    _fd: int = -1

    @property
    def last(self) -> int:
        return self.base + self.size - 1

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(_lock_path(self.base, self.last))
            os.close(self._fd)
            self._fd = -1


def _lock_path(first: int, last: int, lock_dir: str = LOCK_DIR) -> str:
    return os.path.join(lock_dir, f"{first}-{last}")


def _overlaps(a0: int, a1: int, b0: int, b1: int) -> bool:
    return a0 <= b1 and b0 <= a1


def _host_ids(paths: tuple[str, ...]) -> list[tuple[int, int, str]]:
    """(first, last, what) of every id and subordinate range the host's account files name."""
    found: list[tuple[int, int, str]] = []
    for path in paths:
        try:
            with open(path) as f:
                lines = f.read().splitlines()
        except OSError:
            continue
        sub = path.endswith(("subuid", "subgid"))
        for line in lines:
            fields = line.split(":")
            try:
                if sub and len(fields) >= 3:
                    first, count = int(fields[1]), int(fields[2])
                    found.append((first, first + count - 1, f"{path} ({fields[0]})"))
                elif not sub and len(fields) >= 3:
                    ident = int(fields[2])
                    found.append((ident, ident, f"{path} ({fields[0]})"))
            except ValueError:
                continue
    return found


_ACCOUNT_FILES = ("/etc/passwd", "/etc/group", "/etc/subuid", "/etc/subgid")


def _held_ranges(lock_dir: str) -> list[tuple[int, int, int]]:
    """(first, last, owner pid) of ranges whose lock is held by a live server; stale files go."""
    held = []
    for name in os.listdir(lock_dir):
        try:
            first, last = (int(x) for x in name.split("-"))
        except ValueError:
            continue
        path = os.path.join(lock_dir, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip()
            held.append((first, last, int(owner) if owner.isdigit() else 0))
        else:
            os.unlink(path)  # its server is gone (we got its lock): the range is free
        finally:
            os.close(fd)
    return held


def reserve(size: int, base: int | None = None, lock_dir: str = LOCK_DIR,
            account_files: tuple[str, ...] = _ACCOUNT_FILES, start: int = AUTO_START, end: int = _MAX_ID,
            align: int = _ALIGN) -> UidRange:
    """Reserve `size` host ids for this process's life (see the module docstring); `start` and `end`
    bound the ids, automatic ranges start on `align` boundaries (a rootless server's: within the 65,536
    ids its user namespace maps, so on smaller ones)."""
    if size < 1:
        raise ValueError("a uid range needs at least one id")
    os.makedirs(lock_dir, mode=0o700, exist_ok=True)
    os.chmod(lock_dir, 0o700)
    host = _host_ids(account_files)
    # One registry lock makes check-and-claim atomic between servers starting at the same time.
    reg = os.open(os.path.join(lock_dir, ".registry"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(reg, fcntl.LOCK_EX)
        held = _held_ranges(lock_dir)
        if base is not None:
            _check_explicit(base, size, held, host, end)
            chosen = base
        else:
            chosen = _first_free(size, held, host, start, end, align)
        path = _lock_path(chosen, chosen + size - 1, lock_dir)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(fd, f"{os.getpid()}\n".encode())
        return UidRange(chosen, size, fd)
    finally:
        os.close(reg)


def _check_explicit(base: int, size: int, held: list[tuple[int, int, int]],
                    host: list[tuple[int, int, str]], end: int = _MAX_ID) -> None:
    last = base + size - 1
    if base < 1000 or last > end:
        raise UidRangeError(f"uid range {base}-{last} must lie within 1000-{end}")
    for first, end, owner in held:
        if _overlaps(base, last, first, end):
            raise UidRangeError(
                f"uid range {base}-{last} overlaps {first}-{end}, which another agentcell server "
                f"(pid {owner or 'unknown'}) holds; pick a disjoint --uid-base or leave it out to get a free range")
    for first, end, what in host:
        if _overlaps(base, last, first, end):
            raise UidRangeError(
                f"uid range {base}-{last} overlaps ids {first}-{end} of {what}; sandboxes must never share a "
                "host id with a real user or a subordinate range: pick a disjoint --uid-base")


def _first_free(size: int, held: list[tuple[int, int, int]], host: list[tuple[int, int, str]],
                start: int = AUTO_START, end: int = _MAX_ID, align: int = _ALIGN) -> int:
    taken = sorted([(a, b) for a, b, _ in held] + [(a, b) for a, b, _ in host])
    candidate = start
    while candidate + size - 1 <= end:
        last = candidate + size - 1
        clash = next((b for a, b in taken if _overlaps(candidate, last, a, b)), None)
        if clash is None:
            return candidate
        candidate = (clash // align + 1) * align  # the next boundary past what is in the way
    raise UidRangeError(f"no free range of {size} host ids is left below {end}"
                        + (" (fewer sandboxes: --max-sandboxes)" if end < _MAX_ID else ""))


OVERFLOW_ID = 65534  # what a user namespace shows for unmapped ids: never a sandbox's


def mapped_ids_end(uid_map: str = "/proc/self/uid_map") -> int:
    """The last id this user namespace maps contiguously from 0, below the overflow id."""
    end = -1
    with open(uid_map) as f:
        ranges = sorted((int(a), int(c)) for a, _, c in (line.split() for line in f if line.strip()))
    for inside, count in ranges:
        if inside > end + 1:
            break
        end = max(end, inside + count - 1)
    return min(end, OVERFLOW_ID - 1)
