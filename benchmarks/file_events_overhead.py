"""The file collector's cost (agentcell/record/linux/file_events.py; needs root, like the server).

    .venv/bin/python benchmarks/file_events_overhead.py [--runs 7] [--writes 2000] [--flood-s 3] [--groups 100]

One sandbox of the linux backend (the probe agent: only the backend is measured). Printed, p50 (min-max)
over `--runs`, each run alternating the collector off (the sandbox not watched) and on:

* `writes`: `--writes` files of 4 KiB written in /home/user (open, write, close each), timed inside;
* `build`: the issue's build-like mix: `--writes` files as above and an exec of `true` every 10th;
* `tree`: a pip-like tree copy: a real package directory of the venv (IPython, ~ 500 files) copied
  into site-packages under a new name (through the copy-on-write overlay, as `pip install` writes),
  timed inside;
* the server's CPU time the collector spent per run (this process's CPU time, on minus off), and the
  events it put in the record.

Then what the collector sustains: a sandbox creating and removing files as fast as it can for
`--flood-s` seconds, no rate limit, a sink that throws events away: fanotify events read per second,
events recorded per second, kernel queue overflows. And what a group costs: `--groups` fanotify
groups, each with a filesystem mark (fds, kernel memory from /proc/meminfo's Slab, time).

Nothing leaves the machine: the sandbox has no network, the agent is reached over a unix socket.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agentcell.backends.base import Limits, SandboxSpec  # noqa: E402
from agentcell.backends.linux.backend import LinuxBackend, LinuxSandbox  # noqa: E402
from agentcell.record.linux import file_events  # noqa: E402
from agentcell.record.linux.target import WatchTarget  # noqa: E402
from agentcell.runtime.protocol import AgentChannel  # noqa: E402

PROBE = "agentcell.backends.linux.probe:serve"
WRITES = """
import os, time, shutil
d = "/home/user/w"
shutil.rmtree(d, ignore_errors=True)
os.mkdir(d)
data = b"x" * 4096
t, c = time.perf_counter(), time.process_time()
for i in range({n}):
    with open(f"{{d}}/f{{i}}", "wb") as f:
        f.write(data)
print((time.perf_counter() - t) * 1000, (time.process_time() - c) * 1000)
"""
BUILD = """
import os, time, shutil, subprocess
d = "/home/user/b"
shutil.rmtree(d, ignore_errors=True)
os.mkdir(d)
data = b"x" * 4096
def cpu():
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system
t, c = time.perf_counter(), cpu()
for i in range({n}):
    with open(f"{{d}}/f{{i}}", "wb") as f:
        f.write(data)
    if i % 10 == 0:
        subprocess.run(["true"])
print((time.perf_counter() - t) * 1000, (cpu() - c) * 1000)
"""
TREE = """
import os, shutil, sysconfig, time
sp = sysconfig.get_paths()["purelib"]
dst = os.path.join(sp, "IPython_copy")
shutil.rmtree(dst, ignore_errors=True)
t, c = time.perf_counter(), time.process_time()
shutil.copytree(os.path.join(sp, "IPython"), dst)
print((time.perf_counter() - t) * 1000, (time.process_time() - c) * 1000, sum(len(f) for _, _, f in os.walk(dst)))
"""
FLOOD = """
import os, time
os.makedirs("/tmp/fl", exist_ok=True)
end = time.monotonic() + {s}
n = 0
while time.monotonic() < end:
    for i in range(1000):
        p = f"/tmp/fl/{{i}}"
        os.close(os.open(p, os.O_CREAT | os.O_WRONLY, 0o644))
        os.unlink(p)
    n += 1000
print(n)
"""


def fmt(values: list[float], unit: str = "ms") -> str:
    return f"{statistics.median(values):8.1f} {unit}  ({min(values):.1f}-{max(values):.1f})"


async def run(channel: AgentChannel, *argv: str) -> str:
    h = (await channel.call("exec", argv=list(argv), timeout=300)).header
    if h["exit_code"] != 0:
        raise RuntimeError(f"{argv}: {h['stderr']}")
    return h["stdout"]


def target(sb: LinuxSandbox) -> WatchTarget:
    return WatchTarget(sb.sandbox_id, sb.host_pid, (sb.owners.uid,), sb.cgroups, sb.disk_fd)


async def settle(collector: file_events.FileCollector, sandbox_id: str) -> None:
    """Until the collector holds no pending write: its cost of the run is all spent."""
    deadline = time.monotonic() + 10
    while collector.stats(sandbox_id)["pending"] and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)


async def overhead(be: LinuxBackend, args: argparse.Namespace) -> None:
    recorded: list[int] = [0]

    def sink(_sid: str, _ev: dict[str, Any]) -> None:
        recorded[0] += 1

    collector = file_events.FileCollector(sink)
    await collector.start()
    sb = await be.create(SandboxSpec("fb" + uuid.uuid4().hex[:12], limits=Limits(disk_mb=512, memory_mb=1024)))
    assert isinstance(sb, LinuxSandbox)
    ch = await AgentChannel.open(sb.sock)
    times: dict[tuple[str, bool], list[float]] = {}
    sandbox_cpu: dict[tuple[str, bool], list[float]] = {}
    cpu: dict[tuple[str, bool], list[float]] = {}
    events: dict[str, list[int]] = {}
    files = 0
    try:
        for r in range(args.runs + 1):  # the first round warms up (page cache, the overlay's copy-ups)
            for on in ((False, True) if r % 2 else (True, False)):
                for name, code in (("writes", WRITES.format(n=args.writes)), ("tree", TREE),
                                   ("build", BUILD.format(n=args.writes))):
                    if on:
                        collector.watch(target(sb))
                    before, c0 = recorded[0], time.process_time()
                    out = (await run(ch, "python3", "-c", code)).split()
                    if on:
                        await settle(collector, sb.sandbox_id)
                        collector.unwatch(sb.sandbox_id)
                    c1 = time.process_time()
                    if name == "tree":
                        files = int(out[2])
                    if r == 0:
                        continue
                    times.setdefault((name, on), []).append(float(out[0]))
                    sandbox_cpu.setdefault((name, on), []).append(float(out[1]))
                    cpu.setdefault((name, on), []).append((c1 - c0) * 1000)
                    if on:
                        events.setdefault(name, []).append(recorded[0] - before)
        for name, what in (("writes", f"{args.writes} files of 4 KiB in /home/user"),
                           ("tree", f"a {files}-file package copied into site-packages (overlay)"),
                           ("build", f"build-like: {args.writes} files of 4 KiB and {args.writes // 10} execs")):
            off, on = times[(name, False)], times[(name, True)]
            ratio = statistics.median(on) / statistics.median(off) - 1
            extra_cpu = statistics.median(cpu[(name, True)]) - statistics.median(cpu[(name, False)])
            c_off, c_on = sandbox_cpu[(name, False)], sandbox_cpu[(name, True)]
            c_ratio = statistics.median(c_on) / statistics.median(c_off) - 1
            print(f"{name:7} {what}")
            print(f"        wall time off {fmt(off)}")
            print(f"        wall time on  {fmt(on)}   {ratio * 100:+.1f} %")
            print(f"        its CPU time off {fmt(c_off)}")
            print(f"        its CPU time on  {fmt(c_on)}   {c_ratio * 100:+.1f} %  (the kernel's part of the cost)")
            print(f"        min wall time off/on: {min(off):.1f} / {min(on):.1f} ms  {(min(on) / min(off) - 1) * 100:+.1f} %")
            n_events = statistics.median(events[name])
            print(f"        server CPU for the collector: {extra_cpu:.1f} ms per run; "
                  f"{n_events:.0f} events recorded per run ({extra_cpu * 1000 / max(1, n_events):.0f} µs each)")
    finally:
        await collector.close()
        await be.kill(sb)


async def throughput(be: LinuxBackend, args: argparse.Namespace) -> None:
    recorded: list[int] = [0]

    def sink(_sid: str, _ev: dict[str, Any]) -> None:
        recorded[0] += 1

    collector = file_events.FileCollector(sink, rate=1e12, burst=1e12)
    await collector.start()
    sb = await be.create(SandboxSpec("fb" + uuid.uuid4().hex[:12]))
    assert isinstance(sb, LinuxSandbox)
    ch = await AgentChannel.open(sb.sock)
    try:
        collector.watch(target(sb))
        c0, t0 = time.process_time(), time.monotonic()
        n = int(await run(ch, "python3", "-c", FLOOD.format(s=args.flood_s)))
        elapsed = time.monotonic() - t0
        stats = collector.stats(sb.sandbox_id)
        cpu = time.process_time() - c0
        await be.kill(sb)
        collector.unwatch(sb.sandbox_id)
        dropped = {k: v for k, v in stats["dropped"].items()}
        print(f"flood   the sandbox made {n} files and removed them in {elapsed:.1f} s ({2 * n / elapsed:,.0f} changes/s)")
        print(f"        collector: {stats['events'] / elapsed:,.0f} fanotify events/s read, "
              f"{recorded[0] / elapsed:,.0f} events/s recorded, {cpu / elapsed * 100:.0f} % of a core; "
              f"dropped while running: {dropped or 'none'}")
    finally:
        await collector.close()
        await be.kill(sb)


def groups(n: int) -> None:
    """What `n` groups with a filesystem mark each cost (on one tmpfs of our own)."""
    def slab_kib() -> int:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Slab:"))

    with tempfile.TemporaryDirectory() as d:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        made: list[int] = []
        try:
            s0, t0 = slab_kib(), time.perf_counter()
            try:
                for _ in range(n):
                    g = file_events.fanotify_init()
                    made.append(g)
                    file_events.mark_filesystem(g, fd)
            except OSError as e:
                print(f"groups  stopped at {len(made)}: {e} (fs.fanotify.max_user_groups)")
            ms = (time.perf_counter() - t0) * 1000
            s1 = slab_kib()
            k = max(1, len(made))
            print(f"groups  {len(made)} groups with a filesystem mark: {ms / k * 1000:.0f} µs and "
                  f"{(s1 - s0) / k:.1f} KiB of slab each (noisy), 1 fd each")
        finally:
            for g in made:
                os.close(g)
            os.close(fd)


async def main(args: argparse.Namespace) -> None:
    print(f"load average before: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (wall times are only as steady as that)")
    be = LinuxBackend(entry_point=PROBE, max_sandboxes=10, standbys=0, ready_timeout=60)
    await be.start()
    try:
        await overhead(be, args)
        await throughput(be, args)
    finally:
        await be.close()
    groups(args.groups)
    print(f"load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--writes", type=int, default=2000)
    p.add_argument("--flood-s", type=float, default=3.0)
    p.add_argument("--groups", type=int, default=100)
    asyncio.run(main(p.parse_args()))
