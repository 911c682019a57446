"""What `EventStore.add` costs the server's event loop per event (agentcell/record/store.py).

    .venv/bin/python benchmarks/record_add.py [--events 200000] [--rounds 7]

A real store on a SQLite file in a temporary directory, its writer thread running (it competes for
the GIL as in the server). Three workloads, each timed as the median over rounds of the wall time of
the `add` calls alone, per event:

* **mixed, kept**: a session's mix (execs with argv, exits, file writes, connections, DNS answers,
  refusals, API calls), under every bound: each event is stored;
* **flood, dropped**: one sandbox over its rate: every event is refused and counted;
* **flagged**: events that raise flags (a miner's exec, a `.bashrc` write, a metadata connection).

No root, no sandbox: it measures the store alone.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentcell.record.events import event  # noqa: E402
from agentcell.record.store import EventStore, Limits  # noqa: E402


def _mixed(n: int) -> list[dict[str, Any]]:
    shapes = [
        lambda i: event("process.exec", pid=100 + i % 500, ppid=1, path="/usr/bin/python3",
                        argv=["python3", "-c", f"print({i})"], cwd="/home/user", uid=1000),
        lambda i: event("process.exit", pid=100 + i % 500, code=0, duration_s=0.01, comm="python3"),
        lambda i: event("file.write", path=f"/home/user/build/obj{i % 400}.o", size=4096, count=1),
        lambda i: event("net.connect", proto="tcp", dst="151.101.0.223", dport=443, domain="pypi.org",
                        rule="policy", state="open"),
        lambda i: event("dns.query", domain="pypi.org", type="A", answers=["151.101.0.223"], rcode="NOERROR",
                        verdict="allowed"),
        lambda i: event("deny.syscall", syscall="getrandom", nr=318, action="errno"),
        lambda i: event("api.call", source="api", action="process.Start", key_id="token:0123456789ab",
                        status=200, cmd="ls -la"),
        lambda i: event("file.create", path=f"/tmp/t{i}", size=0),
    ]
    return [shapes[i % len(shapes)](i) for i in range(n)]


def _flagged(n: int) -> list[dict[str, Any]]:
    shapes = [
        lambda i: event("process.exec", pid=200 + i % 100, ppid=1, path="/tmp/xmrig",
                        argv=["./xmrig", "-o", "stratum+tcp://pool:3333"], cwd="/tmp", uid=1000),
        lambda i: event("file.write", path="/home/user/.bashrc", size=10, count=1),
        lambda i: event("net.deny", dst="169.254.169.254", dport=80, rule="never4"),
        lambda i: event("deny.syscall", syscall="unshare", nr=272, action="errno"),
    ]
    return [shapes[i % len(shapes)](i) for i in range(n)]


async def _time_adds(store: EventStore, events: list[dict[str, Any]], sandbox_id: str) -> float:
    store.begin(sandbox_id)
    t0 = time.perf_counter()
    add = store.add
    for e in events:
        add(sandbox_id, e)
    elapsed = time.perf_counter() - t0
    store.end(sandbox_id)
    await store.flush()
    return elapsed / len(events)


async def _round(workload: str, n: int, tmp: Path, k: int) -> float:
    if workload == "flood, dropped":
        limits = Limits(per_sandbox=10**9, rate=1.0, burst=1, max_rows=10**9, queue=10**9)
        events = _mixed(n)
    else:
        limits = Limits(per_sandbox=10**9, rate=1e12, burst=10**12, max_rows=10**9, queue=10**9)
        events = _mixed(n) if workload == "mixed, kept" else _flagged(n)
    store = EventStore(tmp / f"events-{k}.db", limits)
    await store.start()
    try:
        return await _time_adds(store, events, f"bench{k}")
    finally:
        await store.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    workloads = ("mixed, kept", "flood, dropped", "flagged")
    results: dict[str, list[float]] = {w: [] for w in workloads}
    with tempfile.TemporaryDirectory(prefix="agentcell-record-add-") as d:
        k = 0
        for _ in range(args.rounds):  # interleaved, so a noisy moment hits every workload alike
            for w in workloads:
                k += 1
                results[w].append(asyncio.run(_round(w, args.events, Path(d), k)))
    for w in workloads:
        per = results[w]
        print(f"{w:<16} add: median {statistics.median(per) * 1e6:.2f} us/event "
              f"(min {min(per) * 1e6:.2f}, max {max(per) * 1e6:.2f}; {args.rounds} x {args.events})")


if __name__ == "__main__":
    main()
