"""A part's files placed by two processes at once (runtime_store._build): the work is CPU-bound Python
(reading, hashing, rewriting .pyc files, linking), so threads do not help, and a venv's first build is
most of a first start.

The files are split by their source directory (a .pyc goes with its source's directory, since its
header is made from the placed source: runtime_store._pyc_header), the largest directories first to even
the shares. A forked worker places its share and sends back what the parent must know (the hash
cache's new entries, the objects it used, its counters); the parent places the rest meanwhile. The
worker only runs this module's loop and os/hashlib/re calls, then leaves with os._exit: nothing of the
parent's other threads (logging, asyncio) is touched in it.
"""

from __future__ import annotations

import contextlib
import marshal
import os
from collections.abc import Callable
from typing import Any

from agentcell.backends.linux.store_objects import Objects

WORKERS = 2
MIN_FILES = 4000  # fewer: one process (a fork costs more than it saves)
_TICK = 256  # a worker says it placed this many more files (the parent's progress line counts them)


def _share(files: list[tuple[str, os.stat_result]]) -> tuple[list[Any], list[Any]]:
    groups: dict[str, list[tuple[str, os.stat_result]]] = {}
    for rel, st in files:
        d = os.path.dirname(rel)
        if os.path.basename(d) == "__pycache__":
            d = os.path.dirname(d)
        groups.setdefault(d, []).append((rel, st))
    mine: list[Any] = []
    theirs: list[Any] = []
    cost = [0, 0]
    for items in sorted(groups.values(), key=lambda g: -sum(8192 + st.st_size for _, st in g)):
        i = 0 if cost[0] <= cost[1] else 1
        (mine if i == 0 else theirs).extend(items)
        cost[i] += sum(8192 + st.st_size for _, st in items)
    return mine, theirs


def place_all(files: list[tuple[str, os.stat_result]], place: Callable[[str, os.stat_result], None],
              objects: Objects, stats: Any, step: Any) -> None:
    """Place every file (in walk order within a directory), in two processes when there are many."""
    if len(files) < MIN_FILES or (os.cpu_count() or 1) < WORKERS:
        for rel, st in files:
            place(rel, st)
            if step is not None:
                step.advance()
        return
    mine, theirs = _share(files)
    results_r, results_w = os.pipe()
    ticks_r, ticks_w = os.pipe()
    journal_at = len(objects.hashes.journal)
    used_before = set(objects.used)
    counts_before = (stats.files, stats.rewritten, stats.dropped_pyc, objects.new_bytes, objects.written_bytes)
    pid = os.fork()
    if pid == 0:  # the worker
        code = 0
        try:
            os.close(results_r)
            os.close(ticks_r)
            for n, (rel, st) in enumerate(theirs, 1):
                place(rel, st)
                if n % _TICK == 0:
                    os.write(ticks_w, b".")
            out = {"journal": objects.hashes.journal[journal_at:], "used": sorted(objects.used - used_before),
                   "counts": [stats.files - counts_before[0], stats.rewritten - counts_before[1],
                              stats.dropped_pyc - counts_before[2], objects.new_bytes - counts_before[3],
                              objects.written_bytes - counts_before[4]], "error": None}
        except BaseException as e:  # noqa: BLE001 (said to the parent, which raises it)
            out = {"error": f"{type(e).__name__}: {e}"}
            code = 1
        try:
            data = marshal.dumps(out)
            view = memoryview(data)
            while view:
                view = view[os.write(results_w, view):]
        finally:
            os._exit(code)
    os.close(results_w)
    os.close(ticks_w)
    os.set_blocking(ticks_r, False)
    chunks: list[bytes] = []
    told = 0  # of the worker's files, those its ticks said
    try:
        for n, (rel, st) in enumerate(mine, 1):
            place(rel, st)
            if step is not None:
                step.advance()
                if n % _TICK == 0:
                    with contextlib.suppress(BlockingIOError):
                        ticks = _TICK * len(os.read(ticks_r, 4096))
                        told += ticks
                        step.advance(ticks)
        while chunk := os.read(results_r, 1 << 20):  # until the worker is done
            chunks.append(chunk)
    finally:
        os.close(results_r)
        os.close(ticks_r)
        _, status = os.waitpid(pid, 0)
    out = marshal.loads(b"".join(chunks)) if chunks else {"error": f"the worker died (wait status {status})"}
    if out["error"] is not None:
        raise OSError(f"placing files: {out['error']}")
    for key, digest in out["journal"]:
        objects.hashes.entries[key] = (digest, objects.hashes.today)
    objects.hashes.changed = True
    objects.used.update(out["used"])
    files_n, rewritten, dropped, new_bytes, written = out["counts"]
    stats.files += files_n
    stats.rewritten += rewritten
    stats.dropped_pyc += dropped
    objects.new_bytes += new_bytes
    objects.written_bytes += written
    if step is not None:
        step.advance(len(theirs) - told)
