"""Keeping the runtime store small: parts no server holds are removed when unused for a while (age) or,
oldest use first, while the store is over its size budget (LRU); then the objects no part names any more.

A part is held by every server using it (a shared flock on ``<part>.lock``, runtime_store._hold); the
collector takes an exclusive, non-blocking flock before removing one, so a held part is never removed.
The caller holds the store's build lock, so no part is being built (and no object linked) meanwhile.
Each part lists the objects it links in ``<part>.objects`` (written with the part), so finding the
objects nobody names reads those lists, not every part's tree.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field

from agentcell.backends.linux.store_objects import OBJECTS

MANIFEST = ".objects"
KEYS = "keys"  # runtime_store._stat_key -> the part it found (a file each, naming the part)
DEFAULT_MAX_BYTES = 10 << 30  # serve --runtime-store-max-gb
KEEP_UNUSED_S = 24 * 3600  # an unheld part unused for this long is removed whatever the budget


@dataclass
class Collected:
    removed_parts: list[str] = field(default_factory=list)
    removed_objects: int = 0
    freed_bytes: int = 0
    size_bytes: int = 0  # the objects' bytes after the collection (each counted once)
    over_budget: bool = False  # still over: what is left is held by running servers


def part_names(root: str) -> list[str]:
    """Every finished part in the store (`<name>-<key>` directories)."""
    return [n for n in os.listdir(root) if n not in (OBJECTS, KEYS) and not n.startswith(".") and not n.endswith(".tmp")
            and os.path.isdir(os.path.join(root, n))]


def _object_sizes(root: str) -> dict[str, int]:
    sizes: dict[str, int] = {}
    top = os.path.join(root, OBJECTS)
    with contextlib.suppress(FileNotFoundError):
        for sub in os.scandir(top):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for e in os.scandir(sub.path):
                if e.name.endswith(".tmp"):
                    with contextlib.suppress(OSError):
                        os.unlink(e.path)  # a build that died
                    continue
                sizes[e.name] = e.stat(follow_symlinks=False).st_blocks * 512
    return sizes


def _manifest(root: str, part: str) -> set[str] | None:
    try:
        with open(os.path.join(root, part + MANIFEST)) as f:
            return set(f.read().split())
    except FileNotFoundError:
        return None  # a part of the store's earlier format (no objects): names nothing


def _try_remove(root: str, part: str, older_than: float | None) -> bool:
    """Remove `part` if no server holds it (and, with `older_than`, if unused since then)."""
    lock = os.path.join(root, part + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a running server uses it
        if older_than is not None and os.fstat(fd).st_mtime > older_than:
            return False
        # out of sight first (one rename): a removal cut short (the server stopped meanwhile) must not
        # leave half a part that a start would take for whole; the leftover .tmp goes next time
        gone = os.path.join(root, f"{part}.{os.getpid()}.gone.tmp")
        os.rename(os.path.join(root, part), gone)
        for suffix in (MANIFEST, ".lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, part + suffix))
        shutil.rmtree(gone, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def _last_use(root: str, part: str) -> float:
    try:
        return os.stat(os.path.join(root, part + ".lock")).st_mtime
    except FileNotFoundError:
        return 0.0


def collect(root: str, keep: set[str], max_bytes: int = DEFAULT_MAX_BYTES,
            keep_unused_s: float = KEEP_UNUSED_S) -> Collected:
    """Remove unheld parts (not in `keep`) unused for `keep_unused_s`, then the least recently used
    unheld ones while the objects take more than `max_bytes`, then the objects no part names."""
    out = Collected()
    for name in os.listdir(root):
        if name.endswith(".tmp"):  # a build that died
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
    parts = [p for p in part_names(root) if p not in keep]
    cutoff = time.time() - keep_unused_s
    for part in parts:
        if _try_remove(root, part, older_than=cutoff):
            out.removed_parts.append(part)
    sizes = _object_sizes(root)
    named = _named(root)
    total = sum(sizes.values())
    if total > max_bytes:
        # the least recently used first; each removal frees the objects only it named
        for part in sorted((p for p in part_names(root) if p not in keep), key=lambda p: _last_use(root, p)):
            if total <= max_bytes:
                break
            if _try_remove(root, part, older_than=None):
                out.removed_parts.append(part)
                named = _named(root)
                total = sum(s for n, s in sizes.items() if n in named)
    for name, size in sizes.items():
        if name not in named:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(root, OBJECTS, name[:2], name))
            out.removed_objects += 1
            out.freed_bytes += size
    _drop_stale_keys(root)
    out.size_bytes = sum(s for n, s in sizes.items() if n in named)
    out.over_budget = out.size_bytes > max_bytes
    return out


APART_TIMEOUT_S = 3600  # a collection of a store on a slow disk; the build lock is held meanwhile


def collect_apart(root: str, keep: set[str], max_bytes: int = DEFAULT_MAX_BYTES,
                  keep_unused_s: float = KEEP_UNUSED_S, build_lock_fd: int | None = None) -> Collected:
    """collect(), in a process of its own. Its scan (every object's name and size, every part's list of
    names: hundreds of MB of Python objects on a store that many venvs used) then comes and goes with
    that process: in a server's heap it would stay as the allocators' high-water mark for the server's
    life (docs/reliability.md). `build_lock_fd`, the caller's locked build lock, is passed on: the lock
    is held until the collection ends, even if the caller dies first. Raises OSError if it failed."""
    spec = json.dumps({"root": root, "keep": sorted(keep), "max_bytes": max_bytes, "keep_unused_s": keep_unused_s})
    done = subprocess.run([sys.executable, "-m", __name__, spec], capture_output=True, text=True,
                          timeout=APART_TIMEOUT_S, check=False, stdin=subprocess.DEVNULL,
                          pass_fds=() if build_lock_fd is None else (build_lock_fd,))
    if done.returncode != 0:
        raise OSError(f"the collection ({sys.executable} -m {__name__}) exited with {done.returncode}: "
                      f"{done.stderr.strip()[-2000:]}")
    return Collected(**json.loads(done.stdout))


def _named(root: str) -> set[str]:
    named: set[str] = set()
    for part in part_names(root):
        names = _manifest(root, part)
        if names:
            named |= names
    return named


def _drop_stale_keys(root: str) -> None:
    """Quick keys naming a part that is gone."""
    parts = set(part_names(root))
    with contextlib.suppress(FileNotFoundError):
        for e in os.scandir(os.path.join(root, KEYS)):
            try:
                with open(e.path) as f:
                    gone = f.read().strip() not in parts
            except OSError:
                continue
            if gone:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)


def usage(root: str) -> tuple[int, int]:
    """(the objects' bytes, the number of parts)."""
    return sum(_object_sizes(root).values()), len(part_names(root))


if __name__ == "__main__":  # collect_apart()'s process: the collection's result as JSON on stdout
    _spec = json.loads(sys.argv[1])
    _out = collect(_spec["root"], set(_spec["keep"]), _spec["max_bytes"], _spec["keep_unused_s"])
    print(json.dumps(dataclasses.asdict(_out)))
