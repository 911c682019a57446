"""The behaviour record's store (issue 10): every sandbox's events, in order, in SQLite under the
server's state dir, kept for an operator-set time after the sandbox is gone.

Bounds, so that no sandbox can flood the server or starve a neighbour's record:

* a per-sandbox **rate** (token buckets) and a per-sandbox **cap** on stored events, each with a
  reserved share per class of event (processes, files, network, refusals, limits, the API's own
  events, the sandbox's self-reports, notes: events.KIND_CLASS) and the rest shared: a flood of one
  class takes its reserve and the shared part, never another class's reserve. What is over a bound is
  counted, not stored; one ``record.dropped`` {count, reason} note per second says how many went;
* **flags** (record/flags.py) are raised on every event handed to ``add``, stored or not, and kept
  with the record (the ``sandboxes`` row): a flood cannot hide what it was meant to hide from them,
  and a drop is itself flagged (``record-incomplete``);
* a **store-wide** cap on rows: past it, the records of the sandboxes that ended longest ago go
  first; if only live sandboxes' records are left, new events are dropped (and counted);
* the writer is one thread fed by a bounded queue; ``add`` never blocks the event loop.

Readers see an event as soon as ``add`` returns (unwritten ones are served from memory), so
``follow`` streams without waiting for the disk. ``audit_log`` receives every stored event as one
JSON line (``serve --audit-log``), for the operator's SIEM.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import os
import queue
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import orjson

from agentcell import durable
from agentcell.record import quiet
from agentcell.record.events import CLASSES, KIND_CLASS, KIND_SET, event
from agentcell.record.flags import FlagSet

log = logging.getLogger("agentcell.events")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS events (
    sandbox_id TEXT NOT NULL, seq INTEGER NOT NULL, time REAL NOT NULL, kind TEXT NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (sandbox_id, seq)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS sandboxes (
    sandbox_id TEXT PRIMARY KEY, started REAL NOT NULL, ended REAL, events INTEGER NOT NULL DEFAULT 0,
    dropped INTEGER NOT NULL DEFAULT 0, flags TEXT);
"""
# what a database made before a column existed gets when opened (each statement runs once)
_MIGRATIONS = {"flags": "ALTER TABLE sandboxes ADD COLUMN flags TEXT"}
_BEGIN = "INSERT INTO sandboxes (sandbox_id, started) VALUES (?, ?) ON CONFLICT(sandbox_id) DO UPDATE SET ended = NULL"
# the last event of a sandbox whose server stopped without ending it (a kill -9, a crash, a power cut)
LOST_WITH_SERVER = "its server stopped without ending it (killed, crashed or the host lost power): it ended with the server"
_READ_CHUNK = 1000  # rows per query while a reader pages through a record
WRITE_GATHER_S = 0.05  # the writer gathers events this long before a transaction
ROW_BYTES = 300  # about what an event takes in the database, index included (for --events-max-mb)
# Each class's reserved share of a sandbox's cap and rate; the rest (44 %) is shared, first come.
# Enough for a class's ordinary load (a build's writes, a session's API calls) within its reserve.
RESERVED_SHARES = {"processes": 0.10, "files": 0.10, "network": 0.08, "refusals": 0.06, "limits": 0.02,
                   "api": 0.12, "self": 0.04, "notes": 0.04}
SHARED = "shared"  # the bucket and the part of the cap that no class holds


@dataclass
class Limits:
    per_sandbox: int = 100_000  # events kept per sandbox
    rate: float = 2000.0  # events per second per sandbox, sustained ...
    burst: int = 20_000  # ... and at once
    max_rows: int = 4_000_000  # events kept store-wide (~1 GiB of SQLite)
    retention_s: float = 7 * 86400  # how long a record outlives its sandbox
    queue: int = 100_000  # events waiting for the writer, store-wide
    shares: dict[str, float] = field(default_factory=lambda: dict(RESERVED_SHARES))  # per class, of the above

    def __post_init__(self) -> None:
        if set(self.shares) != set(CLASSES) or not all(s >= 0 for s in self.shares.values()) \
                or sum(self.shares.values()) > 1:
            raise ValueError(f"shares: one non-negative fraction for each of {', '.join(CLASSES)}, at most 1 in all")


@dataclass(frozen=True, slots=True)
class _Share:
    """One class's (or the shared part's) slice of a sandbox's bounds."""

    cap: int  # events stored
    rate: float  # events a second, sustained
    burst: float  # and at once


def _slices(limits: Limits) -> dict[str, _Share]:
    out = {c: _Share(int(limits.per_sandbox * s), limits.rate * s, limits.burst * s) for c, s in limits.shares.items()}
    out[SHARED] = _Share(limits.per_sandbox - sum(x.cap for x in out.values()),
                         limits.rate - sum(x.rate for x in out.values()),
                         limits.burst - sum(x.burst for x in out.values()))
    return out


class _Bucket:
    """A token bucket, full when made."""

    __slots__ = ("tokens", "at")

    def __init__(self, tokens: float, at: float) -> None:
        self.tokens = tokens
        self.at = at

    def take(self, now: float, share: _Share) -> bool:
        tokens = self.tokens + (now - self.at) * share.rate
        self.tokens = share.burst if tokens > share.burst else tokens
        self.at = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True


class _Inbox:
    """The writer's queue: a deque (an append takes no lock) and an event that wakes the writer, set
    only when it is not already (queue.Queue takes a lock and notifies on every put)."""

    def __init__(self) -> None:
        self._items: collections.deque[tuple[str, Any]] = collections.deque()
        self._ready = threading.Event()

    def put(self, item: tuple[str, Any]) -> None:
        self._items.append(item)
        if not self._ready.is_set():
            self._ready.set()

    def get(self) -> tuple[str, Any]:
        while True:
            try:
                return self._items.popleft()
            except IndexError:
                pass
            self._ready.clear()
            if not self._items:  # (one appended between the popleft and the clear is seen here)
                self._ready.wait()

    def get_nowait(self) -> tuple[str, Any]:
        try:
            return self._items.popleft()
        except IndexError:
            raise queue.Empty from None


@dataclass
class _Record:
    """What the loop knows of one sandbox's record."""

    seq: int = 0  # the last seq handed out
    stored: int = 0
    ended: bool = False
    ended_at: float | None = None
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> not yet noted
    dropped_total: int = 0
    held: dict[str, int] = field(default_factory=dict)  # class -> events stored within its reserve ...
    shared_held: int = 0  # ... and past it, in the shared part
    buckets: dict[str, _Bucket] = field(default_factory=dict)  # class or SHARED -> its rate's bucket (made full)
    flags: FlagSet = field(default_factory=FlagSet)  # raised on every event seen, stored or not
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    redactions: list[tuple[str, str]] = field(default_factory=list)  # (secret value, placeholder)


class EventStore:
    def __init__(self, path: Path | None, limits: Limits | None = None, audit_log: IO[str] | None = None) -> None:
        self.path = path  # None: an in-memory database (tests, embedded use without a state dir)
        self.limits = limits or Limits()
        self.audit_log = audit_log
        self._slices = _slices(self.limits)
        self._shared = self._slices[SHARED]
        self._records: dict[str, _Record] = {}
        self._from_before: set[str] = set()  # sandboxes with a record from before this server's start
        self._pending: dict[str, list[dict[str, Any]]] = {}  # added, not yet committed (served to readers)
        self._pending_lock = threading.Lock()
        self._queue = _Inbox()
        self._urgent = threading.Event()  # a flush or close waits: the writer stops gathering
        self._queued = 0
        self._rows = 0
        self._db: sqlite3.Connection | None = None
        self._begins: sqlite3.Connection | None = None  # a create's row, written at once (begin())
        self._writer: threading.Thread | None = None
        self._reader_lock = threading.Lock()
        self._janitor: asyncio.Task[None] | None = None
        self.stats = {"stored": 0, "dropped": 0, "evicted_sandboxes": 0}

    # -- life ------------------------------------------------------------------------------------

    def open(self) -> None:
        if self.path is not None:
            durable.make_dirs(self.path.parent)
        try:
            if self.path is not None and _emptied(self.path):
                raise _EmptiedError("it is empty (0 bytes) and has no WAL beside it")
            self._open_db()
        except sqlite3.DatabaseError as e:
            if self.path is None or not _damage(e):
                raise
            self._set_aside(e)
            self._open_db()
        self._writer = threading.Thread(target=self._write_loop, name="agentcell-events", daemon=True)
        self._writer.start()

    def _set_aside(self, error: sqlite3.DatabaseError) -> None:
        """A damaged database (and its -wal, -shm) renamed to <name>.damaged-<UTC time>, never deleted:
        the server starts on a new one rather than not at all (the records are history; the sandboxes
        are the service)."""
        assert self.path is not None
        for db in (self._db, self._begins):
            if db is not None:
                with contextlib.suppress(sqlite3.Error):
                    db.close()
        self._db = self._begins = None
        base = f"{self.path}.damaged-{durable.utc_stamp()}"
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.rename(f"{self.path}{suffix}", base + suffix)
        durable.fsync_dir(self.path.parent)
        log.error("the event store %s is damaged (%s): moved to %s (with its -wal and -shm, if any) and a new, "
                  "empty one started. The behaviour records of earlier sandboxes are in the moved file: "
                  "`sqlite3 %s .recover` may get some of them back; delete it once you no longer need it",
                  self.path, error, base, base)

    def _open_db(self) -> None:
        """Connect, make or migrate the schema, read what a restart needs (sqlite3.DatabaseError if the
        database is damaged: these reads go through every table)."""
        target = str(self.path) if self.path is not None else "file:agentcell-events?mode=memory&cache=shared"
        self._db = sqlite3.connect(target, check_same_thread=False, uri=self.path is None, isolation_level=None)
        if self.path is not None:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=NORMAL")
            self.path.chmod(0o600)
        self._db.executescript(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(sandboxes)")}
        for column, statement in _MIGRATIONS.items():
            if column not in columns:
                self._db.execute(statement)
        self._rows = self._db.execute("SELECT COUNT(*) FROM events").fetchone()[0]
        self._from_before = {r[0] for r in self._db.execute("SELECT sandbox_id FROM sandboxes")}
        if self.path is not None:  # see begin(); timeout 0: never waits for the writer's lock
            self._begins = sqlite3.connect(target, timeout=0, check_same_thread=False, isolation_level=None)

    def close_lost(self, kept: Iterable[str]) -> None:
        """At a start, once the kept paused sandboxes are known: every other record still open belongs to
        a sandbox a previous run never ended (it was killed or crashed, and the sandbox died with it).
        Each gets a last event saying so and is closed, so that a reader learns what happened to it
        instead of finding a record that simply stops."""
        self._queue.put(("close_lost", frozenset(kept)))
        self._urgent.set()

    def _close_lost_records(self, db: sqlite3.Connection, kept: frozenset[str]) -> None:
        now = time.time()
        lost = [row for row in db.execute(
            "SELECT s.sandbox_id, COALESCE(MAX(e.seq), 0), COALESCE(MAX(e.time), s.started) FROM sandboxes s "
            "LEFT JOIN events e ON e.sandbox_id = s.sandbox_id WHERE s.ended IS NULL GROUP BY s.sandbox_id")
            if row[0] not in kept and row[0] not in self._records]
        for sandbox_id, seq, last in lost:
            e = {**event("sandbox.killed", source="api", at=now, reason=LOST_WITH_SERVER, last_event_at=last),
                 "sandbox_id": sandbox_id, "seq": seq + 1}
            db.execute("INSERT OR IGNORE INTO events (sandbox_id, seq, time, kind, body) VALUES (?, ?, ?, ?, ?)",
                       (sandbox_id, seq + 1, now, e["kind"], _dumps(e)))
            db.execute("UPDATE sandboxes SET ended = ?, events = events + 1 WHERE sandbox_id = ?", (now, sandbox_id))
        self._rows += len(lost)
        if lost:
            log.warning("event store: %d sandbox(es) of a previous run ended with it (it did not stop cleanly); "
                        "their records say so", len(lost))

    async def start(self) -> None:
        self.open()
        self._janitor = asyncio.get_running_loop().create_task(self._janitor_loop())

    async def close(self) -> None:
        if self._janitor is not None:
            self._janitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._janitor
        self._note_drops()
        now = time.time()
        for sid, rec in self._records.items():  # live records' flags, as of now (their sandboxes stop with us)
            if not rec.ended:
                self._keep_flags(sid, rec, now)
        if self._writer is not None:
            self._queue.put(("stop", None))
            self._urgent.set()
            await asyncio.to_thread(self._writer.join, 10)
        for rec in self._records.values():
            rec.ended = True
            rec.changed.set()
        for db in (self._db, self._begins):
            if db is not None:
                db.close()
        self._db = self._begins = None

    # -- writing (the event loop) ----------------------------------------------------------------

    def begin(self, sandbox_id: str) -> None:
        """A sandbox's record starts (its create); idempotent."""
        rec = self._records.get(sandbox_id)
        if rec is None:  # new, or a record from before a restart (a paused sandbox resumed): go on from it
            # only the latter asks the database, whose lock the writer may hold for a while: a create
            # never waits for it
            rec = self._records[sandbox_id] = self._earlier(sandbox_id) if sandbox_id in self._from_before \
                else _Record()
        elif not rec.ended:
            return
        rec.ended = False
        rec.ended_at = None
        now = time.time()
        # The row at once (one WAL append, ~0.1 ms), not 50 ms later with the writer's next batch: a
        # server killed right after a create then still knows, at its next start, that the sandbox was
        # and that it ended with it. Skipped while the writer holds the lock: its batch has the row.
        if self._begins is not None:
            with contextlib.suppress(sqlite3.Error):
                self._begins.execute(_BEGIN, (sandbox_id, now))
        self._queue.put(("begin", (sandbox_id, now)))

    def end(self, sandbox_id: str) -> None:
        """The sandbox is gone: readers that follow it stop once they have read everything."""
        rec = self._records.get(sandbox_id)
        if rec is None or rec.ended:
            return
        self._note_drops(sandbox_id)
        rec.ended = True
        rec.ended_at = time.time()
        rec.changed.set()
        self._queue.put(("end", (sandbox_id, rec.ended_at)))
        self._keep_flags(sandbox_id, rec, rec.ended_at)  # with what was left running at the end

    def recording(self, sandbox_id: str) -> bool:
        """Whether events for this sandbox are taken (its record began and has not ended)."""
        rec = self._records.get(sandbox_id)
        return rec is not None and not rec.ended

    def add(self, sandbox_id: str, event: dict[str, Any]) -> None:
        """Store one event (an EventSink): never blocks, never raises; what is over a bound is counted.
        Its flags are raised either way."""
        rec = self._records.get(sandbox_id)
        if rec is None or rec.ended:
            return  # a standby's (no tenant's code ran) or a sandbox already gone: nothing to keep
        reason = self._refusal(rec, KIND_CLASS.get(event.get("kind"), "notes"))  # type: ignore[arg-type]
        if reason is not None:
            rec.dropped[reason] = rec.dropped.get(reason, 0) + 1
            rec.dropped_total += 1
            self.stats["dropped"] += 1
            rec.flags.lost(reason)
            rec.flags.see(event, None)
            return
        rec.flags.see(event, self._store(sandbox_id, rec, event))

    def _refusal(self, rec: _Record, cls: str) -> str | None:
        """Why an event of class `cls` is not stored, or None (then its share of the bounds is taken)."""
        lim = self.limits
        mine = self._slices[cls]
        held = rec.held.get(cls, 0)
        in_reserve = held < mine.cap
        if not in_reserve and rec.shared_held >= self._shared.cap:
            return "per-sandbox cap"
        if self._queued >= lim.queue:
            return "writer behind"
        if self._rows + self._queued >= lim.max_rows + lim.max_rows // 10:
            return "store full"  # only live sandboxes' records are left to keep (the janitor evicts ended ones)
        now = time.monotonic()
        buckets = rec.buckets
        if not buckets:  # the first event: every bucket full
            buckets.update((name, _Bucket(share.burst, now)) for name, share in self._slices.items())
        if not buckets[cls].take(now, mine) and not buckets[SHARED].take(now, self._shared):
            return "rate limit"
        if in_reserve:
            rec.held[cls] = held + 1
        else:
            rec.shared_held += 1
        return None

    def redact(self, sandbox_id: str, secrets: list[tuple[str, str]]) -> None:
        """From now on, each of these values (a secret's) is stored as its placeholder, wherever in an
        event it shows up: a command line a caller passed, the argv the kernel reported for it."""
        rec = self._records.get(sandbox_id)
        if rec is not None:
            rec.redactions = [(v, p) for v, p in secrets if v]

    def _store(self, sandbox_id: str, rec: _Record, event: dict[str, Any]) -> int:
        """Give the event its seq and queue it for the writer; its seq."""
        rec.seq += 1
        rec.stored += 1
        if rec.redactions:
            event = _redacted(event, rec.redactions)
        stored = {**event, "sandbox_id": sandbox_id, "seq": rec.seq}
        if stored.get("kind") not in KIND_SET:
            stored["kind"] = "record.dropped"  # never: collectors use events.KINDS; kept visible if it happens
        with self._pending_lock:
            self._pending.setdefault(sandbox_id, []).append(stored)
        self._queued += 1
        self._queue.put(("event", stored))
        self.stats["stored"] += 1
        rec.changed.set()
        return rec.seq

    def _note_drops(self, sandbox_id: str | None = None) -> None:
        """One record.dropped per reason for what was dropped since the last note."""
        ids = [sandbox_id] if sandbox_id is not None else list(self._records)
        for sid in ids:
            rec = self._records.get(sid)
            if rec is None or not rec.dropped:
                continue
            for reason, count in rec.dropped.items():
                note = {"time": time.time(), "kind": "record.dropped", "source": "host", "pid": None, "ppid": None,
                        "count": count, "reason": reason, "dropped_total": rec.dropped_total}
                rec.flags.cite_note(self._store(sid, rec, note))  # past every bound: a note per reason per second at most
            rec.dropped.clear()
            self._queue.put(("dropped", (sid, rec.dropped_total)))

    def _keep_flags(self, sandbox_id: str, rec: _Record, end: float | None) -> None:
        """Queue the record's flags for its sandboxes row (each second when they changed, and at its end)."""
        rec.flags.dirty = False
        self._queue.put(("flags", (sandbox_id, _dumps(rec.flags.to_json(end)))))

    def _earlier(self, sandbox_id: str) -> _Record:
        """A record from before a restart, going on: its last seq, what each class holds, its flags."""
        rec = _Record(seq=self._max_seq(sandbox_id))
        rec.stored = rec.seq
        rows = self._query_all("SELECT kind, COUNT(*) FROM events WHERE sandbox_id = ? GROUP BY kind", (sandbox_id,))
        for kind, n in rows:
            cls = KIND_CLASS.get(kind, "notes")
            reserve = self._slices[cls].cap
            within = min(n, reserve - rec.held.get(cls, 0))
            rec.held[cls] = rec.held.get(cls, 0) + within
            rec.shared_held += n - within
        row = self._query_one("SELECT flags, dropped FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,))
        if row is not None:
            rec.flags = FlagSet.restore(_loads(row[0]))
            rec.dropped_total = int(row[1] or 0)
        return rec

    async def flush(self) -> None:
        """Until everything added so far is committed (and in the audit log)."""
        done = threading.Event()
        self._queue.put(("flush", done))
        self._urgent.set()
        await asyncio.to_thread(done.wait, 30)

    # -- the writer thread -----------------------------------------------------------------------

    def _write_loop(self) -> None:
        assert self._db is not None
        db = self._db
        while True:
            items = [self._queue.get()]
            # Events come in bursts (a command's execs, a build's writes): gather for a moment and
            # write them in one transaction, 5-6 times cheaper per event than one each. Readers do not
            # wait for it (unwritten events are served from memory); a flush or close cuts it short.
            if items[0][0] not in ("flush", "stop"):
                self._urgent.wait(WRITE_GATHER_S)
                # and until the server is between requests (record/quiet.py): its event loop would
                # otherwise wait for this thread's hold of the GIL between sqlite's steps
                due = time.monotonic() - WRITE_GATHER_S
                while (wait := quiet.wait_s(due)) > 0 and not self._urgent.is_set():
                    self._urgent.wait(wait)
            with contextlib.suppress(queue.Empty):
                while len(items) < 5000:
                    items.append(self._queue.get_nowait())
            self._urgent.clear()
            stop = False
            events: list[dict[str, Any]] = []
            flushed: list[threading.Event] = []
            try:
                with self._reader_lock:
                    db.execute("BEGIN")
                    for op, arg in items:
                        if op == "event":
                            events.append(arg)
                        elif op == "begin":
                            db.execute(_BEGIN, arg)
                        elif op == "end":
                            db.execute("UPDATE sandboxes SET ended = ? WHERE sandbox_id = ?", (arg[1], arg[0]))
                        elif op == "dropped":
                            db.execute("UPDATE sandboxes SET dropped = ? WHERE sandbox_id = ?", (arg[1], arg[0]))
                        elif op == "flags":
                            db.execute("UPDATE sandboxes SET flags = ? WHERE sandbox_id = ?", (arg[1], arg[0]))
                        elif op == "close_lost":
                            self._close_lost_records(db, arg)
                        elif op == "flush":
                            flushed.append(arg)
                        elif op == "stop":
                            stop = True
                    # rows made one at a time as sqlite steps through them: each step lets go of the GIL,
                    # so the event loop never waits for a whole batch's encoding (up to the 5 ms switch
                    # interval: a create right after a build's records paid it)
                    db.executemany(
                        "INSERT OR IGNORE INTO events (sandbox_id, seq, time, kind, body) VALUES (?, ?, ?, ?, ?)",
                        ((e["sandbox_id"], e["seq"], e["time"], e["kind"], _dumps(e)) for e in events))
                    counts: dict[str, int] = {}
                    for e in events:
                        counts[e["sandbox_id"]] = counts.get(e["sandbox_id"], 0) + 1
                    db.executemany("UPDATE sandboxes SET events = events + ? WHERE sandbox_id = ?",
                                   [(n, sid) for sid, n in counts.items()])
                    db.execute("COMMIT")
            except sqlite3.Error:
                log.exception("event store: a write failed; %d events lost", len(events))
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            self._rows += len(events)
            self._forget_pending(events)
            self._queued -= len(events)
            if self.audit_log is not None and events:
                self._write_audit_log(events)
            for done in flushed:
                done.set()
            if stop:
                return

    def _forget_pending(self, events: list[dict[str, Any]]) -> None:
        with self._pending_lock:
            for e in events:
                pending = self._pending.get(e["sandbox_id"])
                if pending and pending[0] is e:
                    pending.pop(0)
                    if not pending:
                        del self._pending[e["sandbox_id"]]

    def _write_audit_log(self, events: list[dict[str, Any]]) -> None:
        assert self.audit_log is not None
        try:
            self.audit_log.write("".join(_dumps(e) + "\n" for e in events))
            self.audit_log.flush()
        except (OSError, ValueError):
            log.exception("audit log: write failed")

    # -- reading ---------------------------------------------------------------------------------

    def known(self, sandbox_id: str) -> bool:
        if sandbox_id in self._records:
            return True
        return self._query_one("SELECT 1 FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,)) is not None

    def summary(self, sandbox_id: str) -> dict[str, Any] | None:
        """What the store knows of a record besides its events: when it started and ended, how many
        events it has and how many were dropped, and the flags raised on every event seen
        (`flags_seen`, record/flags.py; None for a record from before they were kept)."""
        row = self._query_one("SELECT started, ended, events, dropped, flags FROM sandboxes WHERE sandbox_id = ?",
                              (sandbox_id,))
        rec = self._records.get(sandbox_id)
        if row is None and rec is None:
            return None
        started, ended, _, dropped, kept = row if row is not None else (None, None, 0, 0, None)
        if rec is not None:
            seen = rec.flags.snapshot(rec.ended_at if rec.ended else time.time())
        else:
            seen = (_loads(kept) or {}).get("flags")
        return {"sandbox_id": sandbox_id, "started": started, "ended": ended,
                "events": rec.seq if rec is not None else self._max_seq(sandbox_id),
                "dropped": rec.dropped_total if rec is not None else dropped, "flags_seen": seen}

    def _max_seq(self, sandbox_id: str) -> int:
        row = self._query_one("SELECT MAX(seq) FROM events WHERE sandbox_id = ?", (sandbox_id,))
        return int(row[0] or 0) if row else 0

    def _query_one(self, sql: str, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
        if self._db is None:
            return None
        with self._reader_lock:
            return self._db.execute(sql, args).fetchone()

    def _query_all(self, sql: str, args: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        if self._db is None:
            return []
        with self._reader_lock:
            return self._db.execute(sql, args).fetchall()

    def read(self, sandbox_id: str, after: int = 0, kinds: Iterable[str] | None = None,
             since: float | None = None, until: float | None = None, limit: int = _READ_CHUNK) -> list[dict[str, Any]]:
        """Up to `limit` events with seq > `after`, oldest first, filtered by kind (or kind prefix,
        "file.") and time."""
        wanted = tuple(kinds or ())
        out: list[dict[str, Any]] = []
        if self._db is not None:
            sql = "SELECT body FROM events WHERE sandbox_id = ? AND seq > ?"
            args: list[Any] = [sandbox_id, after]
            if since is not None:
                sql += " AND time >= ?"
                args.append(since)
            if until is not None:
                sql += " AND time <= ?"
                args.append(until)
            sql += " ORDER BY seq LIMIT ?"
            args.append(limit)
            with self._reader_lock:
                rows = self._db.execute(sql, args).fetchall()
                with self._pending_lock:
                    pending = list(self._pending.get(sandbox_id, ()))
            out = [json.loads(body) for (body,) in rows]
        else:
            pending = []
        last = out[-1]["seq"] if out else after
        if len(out) < limit:  # then the ones not yet written
            out += [e for e in pending if e["seq"] > last and (since is None or e["time"] >= since)
                    and (until is None or e["time"] <= until)][: limit - len(out)]
        return [e for e in out if _kind_matches(e["kind"], wanted)]

    async def follow(self, sandbox_id: str, after: int = 0, kinds: Iterable[str] | None = None,
                     since: float | None = None, until: float | None = None, live: bool = False,
                     ) -> AsyncIterator[dict[str, Any]]:
        """The record from `after`; with `live`, then each new event until the sandbox is gone."""
        wanted = tuple(kinds or ())
        while True:
            rec = self._records.get(sandbox_id)
            if rec is not None:
                rec.changed.clear()
            batch = await asyncio.to_thread(self._read_raw, sandbox_id, after, since, until)
            for e in batch:
                after = e["seq"]
                if _kind_matches(e["kind"], wanted):
                    yield e
            if len(batch) >= _READ_CHUNK:
                continue
            if not live or rec is None or rec.ended:
                return  # read() serves the events not yet written too: nothing is missed
            await rec.changed.wait()

    def iterate(self, sandbox_id: str) -> Iterator[dict[str, Any]]:
        """The whole record, page by page (a worker thread's reader: report building)."""
        after = 0
        while True:
            page = self.read(sandbox_id, after)
            yield from page
            if len(page) < _READ_CHUNK:
                return
            after = page[-1]["seq"]

    def _read_raw(self, sandbox_id: str, after: int, since: float | None, until: float | None) -> list[dict[str, Any]]:
        return self.read(sandbox_id, after, None, since, until)

    # -- retention -------------------------------------------------------------------------------

    async def _janitor_loop(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._note_drops()
            for sid, rec in self._records.items():
                if rec.flags.dirty and not rec.ended:
                    self._keep_flags(sid, rec, time.time())
            with self._pending_lock:  # ended records live on in the database only
                for sid in [s for s, r in self._records.items() if r.ended and s not in self._pending]:
                    del self._records[sid]
            try:
                await asyncio.to_thread(self._evict)
            except sqlite3.Error:
                log.exception("event store: eviction failed")

    def _evict(self, now: float | None = None) -> None:
        """Forget records past their retention, and the oldest ended ones while over max_rows."""
        if self._db is None:
            return
        now = time.time() if now is None else now
        with self._reader_lock:
            gone = [r[0] for r in self._db.execute(
                "SELECT sandbox_id FROM sandboxes WHERE ended IS NOT NULL AND ended < ?",
                (now - self.limits.retention_s,))]
            if self._rows > self.limits.max_rows:
                excess = self._rows - self.limits.max_rows
                for sid, n in self._db.execute(
                        "SELECT sandbox_id, events FROM sandboxes WHERE ended IS NOT NULL ORDER BY ended"):
                    if excess <= 0:
                        break
                    if sid not in gone:
                        gone.append(sid)
                        excess -= n
        for sid in gone:
            self._forget(sid)

    def _forget(self, sandbox_id: str) -> None:
        assert self._db is not None
        with self._reader_lock:
            n = self._db.execute("DELETE FROM events WHERE sandbox_id = ?", (sandbox_id,)).rowcount
            self._db.execute("DELETE FROM sandboxes WHERE sandbox_id = ?", (sandbox_id,))
        self._rows -= max(n, 0)
        self._from_before.discard(sandbox_id)
        self.stats["evicted_sandboxes"] += 1
        rec = self._records.get(sandbox_id)
        if rec is not None and rec.ended:
            del self._records[sandbox_id]

    @property
    def full(self) -> bool:
        return self._rows >= self.limits.max_rows


class _EmptiedError(sqlite3.DatabaseError):
    """The database file is 0 bytes with nothing to replay: whatever it held is gone."""


def _damage(error: sqlite3.DatabaseError) -> bool:
    """Whether the file is not a (whole) database: not a full disk, a lock, an I/O error."""
    code = getattr(error, "sqlite_errorcode", None)
    return isinstance(error, _EmptiedError) or (code is not None and code & 0xFF in (sqlite3.SQLITE_CORRUPT,
                                                                                       sqlite3.SQLITE_NOTADB))


def _emptied(path: Path) -> bool:
    """A database cut to 0 bytes with no WAL to replay: SQLite would take it for a new one, silently.
    (A WAL database is 0 bytes until its first checkpoint: then its -wal holds everything.)"""
    try:
        if path.stat().st_size:
            return False
    except FileNotFoundError:
        return False
    wal = Path(f"{path}-wal")
    return not (wal.exists() and wal.stat().st_size)


def _redacted(value: Any, secrets: list[tuple[str, str]]) -> Any:
    if isinstance(value, str):
        for secret, placeholder in secrets:
            if secret in value:
                value = value.replace(secret, placeholder)
        return value
    if isinstance(value, list):
        return [_redacted(v, secrets) for v in value]
    if isinstance(value, dict):
        return {k: _redacted(v, secrets) for k, v in value.items()}
    return value


def _kind_matches(kind: str, wanted: tuple[str, ...]) -> bool:
    return not wanted or any(kind == w or (w.endswith(".") and kind.startswith(w)) for w in wanted)


def _loads(text: str | None) -> Any:
    try:
        return json.loads(text) if text else None
    except ValueError:
        return None


def _dumps(event: dict[str, Any]) -> str:
    """Compact JSON; orjson (a third of json's time), else json for what orjson refuses (an integer
    past 64 bits in a sandbox's self-report ...)."""
    try:
        return orjson.dumps(event, default=str, option=orjson.OPT_NON_STR_KEYS).decode()
    except TypeError:  # orjson.JSONEncodeError
        return json.dumps(event, separators=(",", ":"), default=str)
