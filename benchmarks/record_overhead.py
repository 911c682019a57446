"""What the behaviour record (issue 10) costs: two real servers side by side, one with the record and
every collector on, one started with --no-record (the baseline), measured interleaved.

    .venv/bin/python benchmarks/record_overhead.py [--runs 20]

Rows (p50 / p95 over --runs, record on vs off, and the overhead of p50; the goal is <= 5 %):
* create -> first run_code result (a standby claimed, "1" evaluated);
* commands.run("true");
* a build-like workload in one command: 2,000 file writes and 200 execs (sh + cat), as a compiler
  or package install would do;
* events recorded per build (what the record took in).
`--collectors files` (or any subset of processes,files,limits) shows what each collector costs.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx

from agentcell import Sandbox

BUILD = ("mkdir -p /tmp/b && cd /tmp/b && i=0; while [ $i -lt 2000 ]; do echo line $i > f$((i % 400)).o; "
         "i=$((i+1)); done; j=0; while [ $j -lt 200 ]; do /bin/cat f1.o > /dev/null; j=$((j+1)); done; echo ok")


def start(record: bool, collectors: str) -> tuple[subprocess.Popen[bytes], str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = [sys.executable, "-m", "agentcell", "serve", "--port", str(port), "--egress-uplink", "none",
            "--standbys", "2", "--state-dir", tempfile.mkdtemp(prefix="agentcell-bench-")]
    args += ["--record-collectors", collectors] if record else ["--no-record"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            httpx.get(f"{url}/health", timeout=1)
            return proc, url
        except httpx.TransportError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("a server did not start")


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def row(name: str, on: list[float], off: list[float]) -> None:
    def stats(xs: list[float]) -> tuple[float, float]:
        ms = sorted(x * 1000 for x in xs)
        return statistics.median(ms), ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]

    (a50, a95), (b50, b95) = stats(on), stats(off)
    print(f"{name:<34} on  p50 {a50:8.2f} ms  p95 {a95:8.2f} ms | off p50 {b50:8.2f} ms  p95 {b95:8.2f} ms"
          f" | overhead {100 * (a50 - b50) / b50:+5.1f} %  (goal <= 5 %)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--collectors", default="processes,files,limits",
                    help="the record's collectors on the 'on' server (to see what each costs)")
    args = ap.parse_args()
    servers = {True: start(True, args.collectors), False: start(False, "")}
    try:
        urls = {k: v[1] for k, v in servers.items()}
        samples: dict[str, dict[bool, list[float]]] = {k: {True: [], False: []} for k in ("create", "true", "build")}
        events: list[int] = []
        sandboxes = {k: Sandbox.create(api_url=u, timeout=1800) for k, u in urls.items()}
        for s in sandboxes.values():  # warm both: first exec, first file
            s.commands.run(BUILD, timeout=120)
        for i in range(args.runs):
            for record in ((True, False) if i % 2 else (False, True)):  # interleaved, order alternating
                url = urls[record]

                t = time.perf_counter()
                fresh = Sandbox.create(api_url=url, timeout=60)
                fresh.run_code("1")
                samples["create"][record].append(time.perf_counter() - t)
                fresh.kill()
                s = sandboxes[record]
                samples["true"][record].append(timed(lambda s=s: s.commands.run("true")))
                samples["build"][record].append(timed(lambda s=s: s.commands.run(BUILD, timeout=120)))
        before = len(list(sandboxes[True].events()))
        sandboxes[True].commands.run(BUILD, timeout=120)
        events.append(len(list(sandboxes[True].events())) - before)
        for s in sandboxes.values():
            s.kill()
        print(f"record overhead ({args.collectors or 'no collectors'}), {args.runs} interleaved runs each")
        row("create -> first run_code result", samples["create"][True], samples["create"][False])
        row('commands.run("true")', samples["true"][True], samples["true"][False])
        row("build: 2,000 writes + 200 execs", samples["build"][True], samples["build"][False])
        print(f"events recorded for one build: {events[0]}")
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
