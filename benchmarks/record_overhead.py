"""What the behaviour record (issue 10) costs: real servers, with the record and every collector on or
started with --no-record (the baseline), one at a time, in alternating blocks (on, off, off, on ...).

    .venv/bin/python benchmarks/record_overhead.py [--runs 20] [--blocks 4]

Rows (p50 / p95 over --runs, record on vs off, and the overhead; the goal is <= 5 %):
* create -> first run_code result (a standby claimed, "1" evaluated);
* commands.run("true");
* a build-like workload in one command: 2,000 file writes and 200 execs (sh + cat), as a compiler
  or package install would do;
* the server's CPU time per round (create + true + build), its record process's included, which the
  p50s do not show: the record's work done on the other core, or while the next request waits;
* the record process's CPU time per round (the collectors: reading the kernel, parsing, coalescing);
* events recorded per build (what the record took in).
`--collectors files` (or any subset of processes,files,limits) shows what each collector costs.

Two overheads are printed. "pooled": the p50 of all "on" rounds against the p50 of all "off" rounds.
"paired": each "on" block's median against the median of the "off" block next to it (on, off, off, on
...: each on block has an off neighbour run just before or after it), the median of those ratios.
This VM's speed drifts by 5-15 % over minutes (other tenants), which moves a pooled p50 by as much as
the thing measured; a block pair shares the drift, so the paired figure is the one judged.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import httpx

from agentcell import Sandbox
from agentcell.record.linux.process import processes_of

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


def row(name: str, on: list[list[float]], off: list[list[float]]) -> None:
    """`on`, `off`: the rounds of each block, blocks in the order they ran (on, off, off, on ...)."""
    def stats(blocks: list[list[float]]) -> tuple[float, float]:
        ms = sorted(x * 1000 for xs in blocks for x in xs)
        return statistics.median(ms), ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]

    (a50, a95), (b50, b95) = stats(on), stats(off)
    # on block i ran next to off block i (on, off | off, on | on, off ...): same drift
    paired = statistics.median(statistics.median(a) / statistics.median(b) - 1 for a, b in zip(on, off, strict=True))
    print(f"{name:<34} on  p50 {a50:8.2f} ms  p95 {a95:8.2f} ms | off p50 {b50:8.2f} ms  p95 {b95:8.2f} ms"
          f" | overhead pooled {100 * (a50 - b50) / b50:+5.1f} %, paired {100 * paired:+5.1f} %  (goal <= 5 %)")


def cpu_s(pid: int) -> float:
    """A process's CPU time so far (user + system, all its threads), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_pair(pid: int) -> tuple[float, float]:
    """CPU seconds so far of the server and of its record process (the collectors' child:
    record/linux/process.py; 0 without one)."""
    return cpu_s(pid), sum(cpu_s(p) for p in processes_of(pid))


def measure(url: str, pid: int, runs: int, samples: dict[str, list[list[float]]], record: bool,
            settle: float) -> int:
    """`runs` rounds against one server (process `pid`); the events one build put in the record (0
    without one)."""
    block: dict[str, list[float]] = {k: [] for k in samples}
    for k in samples:
        samples[k].append(block[k])
    s = Sandbox.create(api_url=url, timeout=1800)
    try:
        s.commands.run(BUILD, timeout=120)  # warm: first exec, first file
        time.sleep(1)  # its record read and written: the CPU counted below is the rounds'
        cpu = cpu_pair(pid)
        for _ in range(runs):
            time.sleep(settle)
            t = time.perf_counter()
            fresh = Sandbox.create(api_url=url, timeout=60)
            fresh.run_code("1")
            block["create"].append(time.perf_counter() - t)
            fresh.kill()
            block["true"].append(timed(lambda: s.commands.run("true")))
            block["build"].append(timed(lambda: s.commands.run(BUILD, timeout=120)))
        time.sleep(1)  # the last round's record read and written
        now = cpu_pair(pid)
        block["server_cpu"].append((now[0] - cpu[0]) / runs)
        block["child_cpu"].append((now[1] - cpu[1]) / runs)
        if not record:
            return 0
        time.sleep(2)  # the last build's coalesced file writes come out once the files are quiet
        before = len(list(s.events()))
        s.commands.run(BUILD, timeout=120)
        time.sleep(2)
        return len(list(s.events())) - before
    finally:
        s.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--blocks", type=int, default=4,
                    help="servers started one after the other, on and off alternating, --runs/blocks rounds each")
    ap.add_argument("--collectors", default="processes,files,limits",
                    help="the record's collectors on the 'on' server (to see what each costs)")
    ap.add_argument("--settle", type=float, default=0.0,
                    help="seconds between a build and the next create (the build's record read by then)")
    args = ap.parse_args()
    # One server at a time: a recording server's audit rules would otherwise reach the baseline's
    # sandboxes too (a task forked while audit rules exist gets an audit context: every syscall pays)
    samples: dict[bool, dict[str, list[list[float]]]] = {
        k: {"create": [], "true": [], "build": [], "server_cpu": [], "child_cpu": []} for k in (True, False)}
    events = 0
    per_block = max(1, args.runs // args.blocks)
    for block in range(args.blocks * 2):
        record = (block % 4) in (0, 3)  # on, off, off, on, on, off ...
        proc, url = start(record, args.collectors)
        try:
            got = measure(url, proc.pid, per_block, samples[record], record, args.settle)
            events = got if record else events
        finally:
            proc.terminate()
            proc.wait(30)
    print(f"record overhead ({args.collectors or 'no collectors'}), {per_block * args.blocks} rounds each, in "
          f"{args.blocks} blocks per server, one server at a time")
    row("create -> first run_code result", samples[True]["create"], samples[False]["create"])
    row('commands.run("true")', samples[True]["true"], samples[False]["true"])
    row("build: 2,000 writes + 200 execs", samples[True]["build"], samples[False]["build"])
    on_cpu = statistics.median(x for xs in samples[True]["server_cpu"] for x in xs) * 1000
    off_cpu = statistics.median(x for xs in samples[False]["server_cpu"] for x in xs) * 1000
    child_cpu = statistics.median(x for xs in samples[True]["child_cpu"] for x in xs) * 1000
    print(f"{'server CPU per round':<34} on  {on_cpu:8.1f} ms                   | off {off_cpu:8.1f} ms"
          f"                   | the record's: {on_cpu - off_cpu:+.1f} ms a round (median of the blocks)")
    print(f"{'record process CPU per round':<34} on  {child_cpu:8.1f} ms (its collectors, at nice 10)")
    print(f"events recorded for one build: {events}")


if __name__ == "__main__":
    main()
