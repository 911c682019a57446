"""The behaviour record's store (record/store.py) on a real SQLite file: order, filters, the
bounds a flooding sandbox meets (rate, cap, store-wide rows), retention, restart, the audit log."""

from __future__ import annotations

import asyncio
import io
import json
import time
from pathlib import Path

from agentcell.record.events import event
from agentcell.record.store import EventStore, Limits


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
            assert 200 <= len(kept) <= 200 + 100 * elapsed + 5  # the burst, and what the rate refilled meanwhile
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
            assert len([e for e in got if e["kind"] == "file.create"]) == 300
            note = [e for e in got if e["kind"] == "record.dropped"]
            assert note and note[0]["count"] == 700 and note[0]["reason"] == "per-sandbox cap"
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
        # a restart: the record is still there, closed; a resumed sandbox's record goes on from its last seq
        again = EventStore(path)
        await again.start()
        try:
            assert again.summary("live")["ended"] is not None
            again.begin("live")
            again.add("live", event("sandbox.resumed", source="api"))
            last = [e async for e in again.follow("live")][-1]
            assert last["kind"] == "sandbox.resumed" and last["seq"] == 101
        finally:
            await again.close()

    asyncio.run(main())
