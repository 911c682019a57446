"""What the kernel-audit collector of the behaviour record (record/linux/audit_events.py) costs.

    .venv/bin/python benchmarks/audit_overhead.py [--rounds 5] [--trues 30]

The linux backend is driven directly (real agent, real sandboxes); each round measures every row
with the collector off and on (in alternating order), and the table gives medians and the change:

* create -> first result: backend.create, the agent's channel, `code.run("1+1")` (with the collector
  on, the sandbox is watched as the server would at claim);
* commands.run("true"): one /bin/true started by the agent (p50 of --trues);
* build-like: 2,000 file writes (one `echo > file` each, by bash) and 200 execs of /bin/true;
* syscall loop in the sandbox: `dd bs=1` over 300,000 bytes (600,000 read/write syscalls);
* syscall loop on the host: the same dd outside any sandbox (what audit costs the host's own tasks).

Needs root. Nothing leaves the machine. The kernel's audit status and rules are as before at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

from agentcell.backends.base import SandboxSpec
from agentcell.backends.linux.backend import LinuxBackend, LinuxSandbox
from agentcell.record.linux.audit_events import AuditCollector
from agentcell.record.linux.target import WatchTarget
from agentcell.runtime.protocol import AgentChannel, line_dicts

BUILD = "for i in $(seq 2000); do echo $i > /tmp/f$i; done; for i in $(seq 200); do /bin/true; done"
DD = ["dd", "if=/dev/zero", "of=/dev/null", "bs=1", "count=300000", "status=none"]


def watch_target(be: LinuxBackend, sb: LinuxSandbox) -> WatchTarget:
    n = be._slot_count  # noqa: SLF001  (the root ids follow the user ids: backend._prepare_with)
    return WatchTarget(sb.sandbox_id, sb.host_pid, (be.uid_base + sb.slot, be.uid_base + n + sb.slot), sb.cgroups,
                       sb.disk_fd)


async def run(ch: AgentChannel, cmd: str, *args: str) -> None:
    req = {"cmd": cmd, "args": list(args), "envs": {}, "cwd": None, "tag": None, "stdin": False, "pty": None,
           "timeout_ms": 120_000, "user": None}
    async for f in ch.stream("proc.start", **req):
        f.raise_for_error()


async def first_result(ch: AgentChannel) -> None:
    async for d in line_dicts(ch.stream("code.run", b"1+1")):
        if d.get("type") == "result":
            return
    raise RuntimeError("no result")


def _kauditd_pid() -> int | None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "kauditd":
                    return int(pid)
        except OSError:
            continue
    return None


KAUDITD = _kauditd_pid()
TICK = os.sysconf("SC_CLK_TCK")


def cpu_now(sb: LinuxSandbox | None) -> float:
    """CPU seconds so far of the sandbox's cgroup, this process (server + collector) and its waited-for
    children (the host's dd), and kauditd."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    total = time.process_time() + children.ru_utime + children.ru_stime
    if sb is not None:
        total += sb.cgroups.stats().cpu_seconds
    if KAUDITD is not None:
        with open(f"/proc/{KAUDITD}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICK
    return total


async def timed(fn: Callable[[], Awaitable[Any]], sb: LinuxSandbox | None = None) -> tuple[float, float]:
    """(wall, CPU) seconds of `fn`; CPU as cpu_now counts it (what a busy host cannot inflate much)."""
    c, t = cpu_now(sb), time.perf_counter()
    await fn()
    return time.perf_counter() - t, cpu_now(sb) - c


async def one_round(be: LinuxBackend, collector: AuditCollector | None, trues: int) -> dict[str, tuple[float, float]]:
    out: dict[str, tuple[float, float]] = {}
    t0, c0 = time.perf_counter(), cpu_now(None)
    sb = await be.create(SandboxSpec())
    assert isinstance(sb, LinuxSandbox)
    if collector is not None:
        collector.watch(watch_target(be, sb))
    ch = await AgentChannel.open(sb.sock)
    await first_result(ch)
    out["create -> first result"] = time.perf_counter() - t0, cpu_now(None) - c0  # (its cgroup is new)
    try:
        samples = [await timed(lambda: run(ch, "/bin/true"), sb) for _ in range(trues)]
        out['commands.run("true")'] = (statistics.median(w for w, _ in samples),
                                       statistics.median(c for _, c in samples))
        out["build-like (2,000 writes + 200 execs)"] = await timed(lambda: run(ch, "/bin/bash", "-c", BUILD), sb)
        out["syscall loop in the sandbox (dd, 600k syscalls)"] = await timed(lambda: run(ch, DD[0], *DD[1:]), sb)
        out["syscall loop on the host (dd, 600k syscalls)"] = await timed(
            lambda: asyncio.to_thread(subprocess.run, DD, check=True))
    finally:
        if collector is not None:
            collector.unwatch(sb.sandbox_id)
        await ch.close()
        await be.kill(sb)
    return out


async def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--trues", type=int, default=30)
    ap.add_argument("--no-host-exemption", action="store_true",
                    help="audit every new task of the host, not only the sandboxes' (as next to an operator's auditd)")
    args = ap.parse_args()
    be = LinuxBackend(max_sandboxes=20, standbys=2, preload=True)
    await be.start()
    results: dict[str, dict[str, list[tuple[float, float]]]] = {"off": {}, "on": {}}
    events = 0

    def sink(_sid: str, _ev: dict[str, Any]) -> None:
        nonlocal events
        events += 1

    try:
        await one_round(be, None, 3)  # warm-up (page cache, zygote)
        for r in range(args.rounds):
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                collector = None
                if mode == "on":
                    collector = AuditCollector(sink, be.uid_base, be.uid_base + 2 * be._slot_count - 1,  # noqa: SLF001
                                               exempt_host=not args.no_host_exemption)
                    await collector.start()
                try:
                    for row, value in (await one_round(be, collector, args.trues)).items():
                        results[mode].setdefault(row, []).append(value)
                finally:
                    if collector is not None:
                        await collector.close()
    finally:
        await be.close()
    for i, what in ((0, "wall"), (1, "CPU: sandbox + server + kauditd")):
        print(f"\n{what}\n{'row':52} {'off (ms)':>10} {'on (ms)':>10} {'change':>8}")
        for row, offs in results["off"].items():
            off = statistics.median(x[i] for x in offs) * 1000
            on = statistics.median(x[i] for x in results["on"][row]) * 1000
            print(f"{row:52} {off:10.2f} {on:10.2f} {(on - off) / off * 100:+7.1f}%")
    print(f"(medians of {args.rounds} rounds; {events} events recorded with the collector on)")


if __name__ == "__main__":
    asyncio.run(main())
