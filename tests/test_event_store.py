"""The behaviour record's store (record/store.py) on a real SQLite file: order, filters, the
bounds a flooding sandbox meets (rate, cap, store-wide rows), retention, restart, the audit log."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path

from agentcell.record.events import KIND_CLASS, event
from agentcell.record.store import LOST_WITH_SERVER, RESERVED_SHARES, EventStore, Limits

SHARED_PART = 1 - sum(RESERVED_SHARES.values())


async def _settle(store: EventStore) -> None:
    """Until the writer thread has committed what was added."""
    await store.flush()


def test_order_filters_and_follow(tmp_path: Path) -> None:
    async def main() -> None:
        store = EventStore(tmp_path / "e.db")
        await store.start()
        try:
            store.begin("a")
            store.begin("b")
            for i in range(5):
                store.add("a", event("process.exec", pid=i, path=f"/bin/{i}"))
                store.add("b", event("file.write", path=f"/tmp/{i}"))
            store.add("a", event("file.create", path="/tmp/x"))
            got = [e async for e in store.follow("a")]  # some still in memory, some on disk
            assert [e["seq"] for e in got] == list(range(1, 7))
            assert all(e["sandbox_id"] == "a" for e in got)
            assert [e["kind"] for e in got] == ["process.exec"] * 5 + ["file.create"]
            only_files = [e async for e in store.follow("a", kinds=["file."])]
            assert [e["path"] for e in only_files] == ["/tmp/x"]
            assert [e["seq"] async for e in store.follow("a", after=4)] == [5, 6]
            cut = got[2]["time"]
            since = [e async for e in store.follow("a", since=cut)]
            assert since and all(e["time"] >= cut for e in since) and len(since) <= 4

            # follow: what comes later arrives live, and the stream ends once the sandbox is gone
            seen: list[int] = []

            async def reader() -> None:
                async for e in store.follow("a", after=6, live=True):
                    seen.append(e["seq"])

            task = asyncio.create_task(reader())
            await asyncio.sleep(0.05)
            store.add("a", event("process.exit", pid=1, code=0))
            store.add("a", event("process.exit", pid=2, code=1))
            await asyncio.sleep(0.05)
            assert seen == [7, 8]
            store.end("a")
            await asyncio.wait_for(task, 5)
            store.add("a", event("file.write", path="/late"))  # after the end: not kept
            await _settle(store)
            assert [e["seq"] async for e in store.follow("a")][-1] == 8
        finally:
            await store.close()

    asyncio.run(main())


def test_a_flood_is_bounded_counted_and_does_not_starve_the_api_source(tmp_path: Path) -> None:
    async def main() -> None:
        store = EventStore(tmp_path / "e.db", Limits(per_sandbox=5000, rate=100.0, burst=200))
        await store.start()
        try:
            store.begin("flood")
            store.begin("calm")
            t0 = time.perf_counter()
            for i in range(100_000):
                store.add("flood", event("deny.syscall", syscall="mount", pid=i))
            elapsed = time.perf_counter() - t0
            store.add("flood", event("api.call", source="api", action="run_code"))  # its own budget
            store.add("calm", event("process.exec", pid=1, path="/bin/true"))
            store.end("flood")
            await _settle(store)
            got = [e async for e in store.follow("flood")]
            kept = [e for e in got if e["kind"] == "deny.syscall"]
            notes = [e for e in got if e["kind"] == "record.dropped"]
            # the refusals' reserved part of the burst and the shared part, and what their rates refilled meanwhile
            part = RESERVED_SHARES["refusals"] + SHARED_PART
            assert int(200 * part) <= len(kept) <= 200 * part + 100 * part * elapsed + 5
            assert any(e["kind"] == "api.call" for e in got)
            assert sum(n["count"] for n in notes) == 100_000 - len(kept)
            assert {n["reason"] for n in notes} == {"rate limit"}
            assert store.summary("flood")["dropped"] == 100_000 - len(kept)
            assert [e["kind"] async for e in store.follow("calm")] == ["process.exec"]
            assert elapsed < 5, f"adding 100,000 events took {elapsed:.1f} s: add() must stay cheap"
        finally:
            await store.close()

    asyncio.run(main())


def test_per_sandbox_cap(tmp_path: Path) -> None:
    async def main() -> None:
        store = EventStore(tmp_path / "e.db", Limits(per_sandbox=300, rate=1e9, burst=10**9))
        await store.start()
        try:
            store.begin("s")
            for i in range(1000):
                store.add("s", event("file.create", path=f"/tmp/{i}"))
            store.end("s")
            await _settle(store)
            got = [e async for e in store.follow("s")]
            # the files' reserve and the shared part; the other classes' reserves stay theirs
            others = sum(int(300 * share) for cls, share in RESERVED_SHARES.items() if cls != "files")
            files = len([e for e in got if e["kind"] == "file.create"])
            assert files == 300 - others
            note = [e for e in got if e["kind"] == "record.dropped"]
            assert note and note[0]["count"] == 1000 - files and note[0]["reason"] == "per-sandbox cap"
        finally:
            await store.close()

    asyncio.run(main())


def test_retention_rows_cap_and_restart(tmp_path: Path) -> None:
    async def main() -> None:
        path = tmp_path / "e.db"
        log = io.StringIO()
        store = EventStore(path, Limits(max_rows=280, retention_s=3600, rate=1e9, burst=10**9), audit_log=log)
        store.open()  # no janitor: this test evicts by hand
        try:
            for sid in ("old", "mid", "live"):
                store.begin(sid)
                for i in range(100):
                    store.add(sid, event("file.write", path=f"/tmp/{i}"))
            store.end("old")
            await asyncio.sleep(0.01)
            store.end("mid")
            await _settle(store)
            store._evict()  # 300 rows > 280: the record that ended first goes
            assert not store.known("old")
            assert store.known("mid") and store.known("live")
            store._evict(now=time.time() + 7200)  # past the retention: ended records go, live ones stay
            assert not store.known("mid") and store.known("live")
            lines = [json.loads(x) for x in log.getvalue().splitlines()]
            assert len(lines) == 300 and {x["sandbox_id"] for x in lines} == {"old", "mid", "live"}
        finally:
            await store.close()
        # a restart after a crash: a record left open whose sandbox is not kept is closed with a last event
        # saying it ended with its server; a kept (paused) sandbox's record stays open and goes on from
        # its last seq
        again = EventStore(path)
        await again.start()
        try:
            again.begin("kept")
            await again.flush()
            await again.close()
            again = EventStore(path)
            await again.start()
            again.close_lost(["kept"])
            await again.flush()
            assert again.summary("live")["ended"] is not None
            assert again.summary("kept")["ended"] is None
            last = [e async for e in again.follow("live")][-1]
            assert last["kind"] == "sandbox.killed" and last["reason"] == LOST_WITH_SERVER and last["seq"] == 101
            again.begin("kept")
            again.add("kept", event("sandbox.resumed", source="api"))
            last = [e async for e in again.follow("kept")][-1]
            assert last["kind"] == "sandbox.resumed" and last["seq"] == 1
        finally:
            await again.close()

    asyncio.run(main())


# --- issue 25 #7: the record cannot be drowned ----------------------------------------------------------

ONE_OF_EACH_CLASS = (
    event("process.exec", pid=7, ppid=1, path="/bin/sh", argv=["sh"]),
    event("file.write", path="/home/user/notes.txt"),
    event("net.deny", dst="203.0.113.9", dport=25, rule="policy"),
    event("deny.syscall", syscall="getrandom", nr=318),
    event("limit.pids", detail="fork refused"),
    event("api.call", source="api", action="run_code", key_id="token:0123456789ab", status=200),
    event("sandbox.paused", source="api"),
    event("self.report", source="self", what="step"),
    event("record.dropped", count=3, reason="a collector's queue overflowed"),
)


def _kinds_of(got: list[dict]) -> set[str]:
    return {e["kind"] for e in got}


def test_a_flood_of_one_class_leaves_every_other_class_its_reserve(tmp_path: Path) -> None:
    """Both bounds: the cap (nothing refills it) and the rate (a flood far over it)."""
    async def main() -> None:
        by_cap = EventStore(tmp_path / "cap.db", Limits(per_sandbox=1000, rate=1e9, burst=10**9))
        by_rate = EventStore(tmp_path / "rate.db", Limits(per_sandbox=10**6, rate=10.0, burst=1000))
        for store, flood in ((by_cap, "self.report"), (by_rate, "file.create")):
            await store.start()
            try:
                store.begin("s")
                for i in range(20_000):
                    store.add("s", event(flood, source="self" if flood == "self.report" else "host", what="noise",
                                         path=f"/tmp/{i}"))
                for e in ONE_OF_EACH_CLASS:
                    store.add("s", dict(e))
                store.add("s", event(flood, source="self", what="still refused", path="/tmp/late"))
                store.end("s")
                await _settle(store)
                got = [e async for e in store.follow("s")]
                wanted = {e["kind"] for e in ONE_OF_EACH_CLASS if KIND_CLASS[e["kind"]] != KIND_CLASS[flood]}
                assert len(wanted) == len(ONE_OF_EACH_CLASS) - 1 and wanted <= _kinds_of(got), (flood, wanted - _kinds_of(got))
                assert not any(e.get("what") == "still refused" or e.get("path") == "/tmp/late" for e in got)
                notes = [e for e in got if e["kind"] == "record.dropped" and "dropped_total" in e]
                assert notes and sum(n["count"] for n in notes) >= 20_000 - 1000
            finally:
                await store.close()

    asyncio.run(main())


HOSTILE = [
    event("process.exec", pid=66, ppid=1, path="/tmp/xmrig", argv=["./xmrig", "-o", "stratum+tcp://pool:3333"]),
    event("file.write", path="/home/user/.bashrc", size=20),
    event("net.deny", dst="169.254.169.254", dport=80, rule="never4"),
    event("net.connect", dst="10.0.0.1", dport=22, state="open"),
    event("deny.syscall", syscall="unshare", nr=272),
    event("deny.access", path="/root/.ssh/id_rsa", errno=13),
    event("limit.cpu", throttled_s=8.0),
    event("process.exec", pid=77, ppid=1, path="/bin/sleep", argv=["sleep", "1000"], at=time.time() - 120),
    *(event("net.deny", dst="203.0.113.50", dport=port, rule="policy") for port in range(1000, 1025)),
]
EXPECTED = {"crypto-mining", "persistence", "cloud-metadata", "host-or-lan", "privilege-syscalls", "sensitive-paths",
            "cpu-bound", "left-running", "scanning", "record-incomplete"}


def test_flags_are_raised_on_dropped_events_and_kept_across_a_restart(tmp_path: Path) -> None:
    """A record filled to its cap by noise of every class; then every flag's events, all dropped: the
    flags are there all the same (each saying how many of its events are not stored), the record is
    flagged incomplete, and all of it survives a restart of the store."""
    from agentcell.record import report

    async def main() -> None:
        path = tmp_path / "e.db"
        store = EventStore(path, Limits(per_sandbox=500, rate=1e9, burst=10**9))
        await store.start()
        try:
            store.begin("victim")
            for i in range(600):  # noise of every class, more than the whole cap
                for e in ONE_OF_EACH_CLASS:
                    store.add("victim", {**e, "pid": 1000 + i if e.get("pid") else None})
            stored_before = store.summary("victim")["events"]
            for e in HOSTILE:
                store.add("victim", dict(e))
            assert store.summary("victim")["events"] == stored_before  # none of them was stored
            live = report.build(store.iterate("victim"), store.summary("victim"))
            flags = {f["flag"]: f for f in live["flags"]}
            assert EXPECTED <= set(flags), EXPECTED - set(flags)
            for name in EXPECTED - {"record-incomplete"}:
                assert flags[name]["not_stored"] >= 1, flags[name]
            store.end("victim")
            await _settle(store)
            ended = report.build(store.iterate("victim"), store.summary("victim"))
            assert EXPECTED <= {f["flag"] for f in ended["flags"]}
            assert "record-incomplete" in report.render(ended)
        finally:
            await store.close()
        again = EventStore(path, Limits(per_sandbox=500, rate=1e9, burst=10**9))
        await again.start()
        try:
            rep = report.build(again.iterate("victim"), again.summary("victim"))
            flags = {f["flag"]: f for f in rep["flags"]}
            assert EXPECTED <= set(flags), EXPECTED - set(flags)
            assert flags["crypto-mining"]["not_stored"] == 1 and flags["scanning"]["not_stored"] >= 20
            assert flags["record-incomplete"]["count"] >= len(HOSTILE)
            # the sandbox resumed (a paused one, after the restart): its record goes on, full as it was,
            # and its flags with it
            seq = again.summary("victim")["events"]
            again.begin("victim")
            again.add("victim", event("process.exec", pid=5, ppid=1, argv=["cpuminer"]))
            assert again.summary("victim")["events"] == seq  # its class's reserve and the shared part: still full
            seen = {f["flag"]: f for f in again.summary("victim")["flags_seen"]}
            assert EXPECTED - {"left-running"} <= set(seen)
            assert seen["crypto-mining"]["count"] == 2 and seen["crypto-mining"]["not_stored"] == 2
        finally:
            await again.close()

    asyncio.run(main())


def test_a_database_from_before_the_flags_is_migrated(tmp_path: Path) -> None:
    import sqlite3

    from agentcell.record import report

    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE events (sandbox_id TEXT NOT NULL, seq INTEGER NOT NULL, time REAL NOT NULL, kind TEXT NOT NULL,
            body TEXT NOT NULL, PRIMARY KEY (sandbox_id, seq)) WITHOUT ROWID;
        CREATE TABLE sandboxes (sandbox_id TEXT PRIMARY KEY, started REAL NOT NULL, ended REAL,
            events INTEGER NOT NULL DEFAULT 0, dropped INTEGER NOT NULL DEFAULT 0);""")
    old = {"time": 1000.0, "kind": "file.write", "source": "host", "pid": None, "ppid": None,
           "path": "/home/user/.profile", "sandbox_id": "old", "seq": 1}
    db.execute("INSERT INTO events VALUES ('old', 1, 1000.0, 'file.write', ?)", (json.dumps(old),))
    db.execute("INSERT INTO sandboxes VALUES ('old', 999.0, 1001.0, 1, 0)")
    db.commit()
    db.close()

    async def main() -> None:
        store = EventStore(path)
        await store.start()
        try:
            rep = report.build(store.iterate("old"), store.summary("old"))
            assert [(f["flag"], f["events"]) for f in rep["flags"]] == [("persistence", [1])]
            store.begin("new")
            store.add("new", event("deny.syscall", syscall="bpf", nr=321))
            store.end("new")
            await _settle(store)
        finally:
            await store.close()
        again = EventStore(path)
        await again.start()
        try:
            assert [f["flag"] for f in again.summary("new")["flags_seen"]] == ["privilege-syscalls"]
        finally:
            await again.close()

    asyncio.run(main())


def test_an_event_orjson_cannot_hold_is_stored_and_read_back(tmp_path: Path) -> None:
    """A self-report with an integer past 64 bits: written by json, read back exactly (orjson would read it as a float)."""
    async def main() -> None:
        store = EventStore(tmp_path / "e.db")
        await store.start()
        try:
            store.begin("a")
            store.add("a", event("self.report", what="big", data={"n": (1 << 70) + 1}))
            store.add("a", event("process.exec", pid=1, path="/bin/true"))
            await _settle(store)
            got = list(store.iterate("a"))
            assert [e["kind"] for e in got] == ["self.report", "process.exec"]
            assert got[0]["data"]["n"] == (1 << 70) + 1  # exactly: orjson would read it as a float
        finally:
            await store.close()

    asyncio.run(main())
