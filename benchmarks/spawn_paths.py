"""What a sandbox's policy hold_exec costs the agent: process starts with fork + exec instead of
posix_spawn (vfork), in the real agent holding NumPy, pandas and IPython (the zygote's preload). Needs root.

    .venv/bin/python benchmarks/spawn_paths.py [--starts 300]

For each path, `--starts` commands (/bin/true, started directly, no shell) one after the other through
the agent protocol: the round trip of proc.start to its end (p50 / p95), and the agent's own CPU time
per start (its utime + stime from /proc, which includes the protocol's work, the same for both paths:
the difference is what the fork costs). Also the agent's resident memory and page tables, which a
fork copies.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from agentcell.backends.base import SandboxSpec  # noqa: E402
from agentcell.backends.linux.backend import LinuxBackend, LinuxSandbox  # noqa: E402
from agentcell.runtime.protocol import AgentChannel  # noqa: E402
from agentcell.server.agent_policy import set_agent_policy  # noqa: E402

_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime


def status(pid: int, *keys: str) -> str:
    with open(f"/proc/{pid}/status") as f:
        rows = dict(line.split(":", 1) for line in f if ":" in line)
    return ", ".join(f"{k} {rows[k].strip()}" for k in keys if k in rows)


async def start_true(channel: AgentChannel) -> float:
    t0 = time.perf_counter()
    async for f in channel.stream("proc.start", cmd="/bin/true", args=[], envs={}, cwd=None, tag=None, stdin=False,
                                  pty=None, timeout_ms=10_000, user=None):  # fmt: skip
        f.raise_for_error()
    return time.perf_counter() - t0


async def measure(channel: AgentChannel, pid: int, hold_exec: bool, starts: int) -> tuple[list[float], float]:
    await set_agent_policy(channel, "default", hold_exec)
    for _ in range(20):  # warm
        await start_true(channel)
    cpu0 = cpu_seconds(pid)
    times = [await start_true(channel) for _ in range(starts)]
    return times, (cpu_seconds(pid) - cpu0) / starts


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--starts", type=int, default=300)
    args = parser.parse_args()
    be = LinuxBackend(max_sandboxes=2, standbys=0, preload=True, ready_timeout=120)
    await be.start()
    try:
        sb = await be.create(SandboxSpec())
        assert isinstance(sb, LinuxSandbox)
        channel = await AgentChannel.open(sb.sock)
        print(f"agent (pid {sb.host_pid}): {status(sb.host_pid, 'VmRSS', 'VmPTE')}")
        results = {}
        for name, hold in (("posix_spawn (vfork)", False), ("fork + exec (hold_exec)", True),
                           ("posix_spawn again", False)):  # fmt: skip
            times, cpu = await measure(channel, sb.host_pid, hold, args.starts)
            results[name] = (times, cpu)
            q = statistics.quantiles(times, n=20)
            print(f"{name:26s} round trip p50 {statistics.median(times) * 1e3:6.2f} ms  p95 {q[18] * 1e3:6.2f} ms"
                  f"  | agent CPU per start {cpu * 1e3:5.2f} ms")
        await channel.close()
    finally:
        await be.close()


if __name__ == "__main__":
    asyncio.run(main())
