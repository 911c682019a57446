"""The gvisor backend's lifecycle figures, measured on the backend itself (no HTTP in between).

    PYTHONPATH=. .venv/bin/python benchmarks/gvisor_lifecycle.py [--runs 20] [--idle 20] [--platform systrap]
        [--pool-only]

Prints one line per figure: pool create -> first run_code result and pool refill beside the target
(issue 9: create -> first result <= 50 ms p50), the memory a frozen standby holds, pause/resume,
checkpoint time and image size, restore -> first result, a fork of 8 (8 concurrent restores), PSS
per idle sandbox, and the CPU that N idle sandboxes take unfrozen and frozen. `--pool-only` stops
after the pool's figures (for repeated, interleaved runs on a shared machine). Each create is timed
with the pool full and no refill under way. Run as root with runsc.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import os
import shutil
import statistics
import tempfile
import time

from agentcell.backends.base import SandboxSpec
from agentcell.backends.gvisor.backend import GvisorBackend, GvisorSandbox
from agentcell.backends.linux import cgroups
from agentcell.runtime.protocol import AgentChannel, line_dicts

TARGET_MS = 50.0  # issue 9: create -> first run_code result, p50, from the pool


def pct(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return f"p50 {statistics.median(ms):.1f} ms, p95 {p95:.1f} ms (n={len(ms)})"


async def pool_full(be: GvisorBackend) -> None:
    """Until every standby is ready and none is being prepared (a quiet machine for a measurement)."""
    assert be._pool is not None
    while be._pool.ready < be._pool.size or be._pool._preparing:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.3)


_channels: dict[str, AgentChannel] = {}


async def kill(be: GvisorBackend, sb: GvisorSandbox) -> None:
    """The channel first (as the server does): its transport holds the socket's fd number."""
    channel = _channels.pop(sb.sandbox_id, None)
    if channel is not None:
        await channel.close()
    await be.kill(sb)


async def first_result(sb: GvisorSandbox, code: str = "6 * 7") -> str:
    channel = _channels.get(sb.sandbox_id)
    if channel is None:
        channel = _channels[sb.sandbox_id] = await AgentChannel.open(sb.sock)
    text = ""
    async for d in line_dicts(channel.stream("code.run", code.encode())):
        if d.get("type") == "result":
            text = d.get("text", "")
    return text


def pss_bytes(sb: GvisorSandbox) -> int:
    total = 0
    pids = {p for d in sb.cgroups.dirs.values() for p in open(f"{d}/cgroup.procs").read().split()}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        total += int(line.split()[1]) << 10
        except OSError:
            pass
    return total


def cpu_seconds(rel: str) -> float:
    return cgroups.Cgroups.at(rel).stats().cpu_seconds


async def main(args: argparse.Namespace) -> None:
    be = GvisorBackend(max_sandboxes=args.idle + 20, standbys=2, platform=args.platform)
    t0 = time.perf_counter()
    await be.start()
    print(f"start (template built and saved): {time.perf_counter() - t0:.1f} s, template image "
          f"{sum(os.path.getsize(p) for p in glob.glob(be.template + '/*')) >> 20} MiB")
    tmp = tempfile.mkdtemp(dir="/run/agentcell")
    try:
        assert be._pool is not None
        await pool_full(be)
        standby = be._pool._ready[0]
        print(f"memory of a frozen standby: {standby.cgroups.stats().memory_bytes / (1 << 20):.0f} MiB charged "
              f"to its cgroup, PSS {pss_bytes(standby) / (1 << 20):.0f} MiB (sentry + gofer + stubs)")
        # pool refill: a standby restored from the template, made ready for a claim and frozen
        refills = []
        for _ in range(max(5, args.runs // 3)):
            await pool_full(be)
            t = time.perf_counter()
            sb = await be._prepare_standby()
            refills.append(time.perf_counter() - t)
            await be.kill(sb)
        # create -> first result, refills interleaved: each create with the pool full, none under way
        creates = []
        for _ in range(args.runs):
            await pool_full(be)
            t = time.perf_counter()
            sb = await be.create(SandboxSpec())
            assert await first_result(sb) == "42"
            creates.append(time.perf_counter() - t)
            await kill(be, sb)
        p50 = statistics.median(creates) * 1000
        print(f"pool create -> first run_code result: {pct(creates)}; target <= {TARGET_MS:.0f} ms p50: "
              f"{'met' if p50 <= TARGET_MS else 'NOT met'}")
        print(f"pool refill (restore the template, ready it for a claim, freeze), per standby: {pct(refills)}")
        if args.pool_only:
            return

        sb = await be.create(SandboxSpec())
        await first_result(sb)
        pauses, resumes = [], []
        for _ in range(20):
            t = time.perf_counter()
            await be.pause(sb)
            pauses.append(time.perf_counter() - t)
            t = time.perf_counter()
            await be.resume(sb)
            resumes.append(time.perf_counter() - t)
        print(f"pause (freezer): {pct(pauses)}; resume: {pct(resumes)}")

        image = os.path.join(tmp, "image")
        t = time.perf_counter()
        size = await be.checkpoint(sb, image, leave_running=True)
        print(f"checkpoint --leave-running of an idle sandbox: {(time.perf_counter() - t) * 1000:.0f} ms, "
              f"image {size >> 20} MiB (no compression)")
        restores = []
        for _ in range(3):
            t = time.perf_counter()
            kid = await be.restore(image, SandboxSpec())
            assert await first_result(kid) == "42"
            restores.append(time.perf_counter() - t)
            await kill(be, kid)
        print(f"restore -> first run_code result: {pct(restores)}")
        t = time.perf_counter()
        kids = await asyncio.gather(*(be.restore(image, SandboxSpec()) for _ in range(8)))
        await asyncio.gather(*(first_result(k) for k in kids))
        print(f"fork of 8 (8 concurrent restores, each answering): {time.perf_counter() - t:.2f} s wall")
        print(f"PSS of a restored, idle sandbox (sentry + gofer + stubs): "
              f"{statistics.median(pss_bytes(k) for k in kids) / (1 << 20):.0f} MiB (median of 8)")
        for k in kids:
            await kill(be, k)
        await kill(be, sb)

        idle = []
        for _ in range(args.idle):
            s = await be.create(SandboxSpec())
            await first_result(s, "1")
            idle.append(s)
        print(f"PSS per idle sandbox (claimed, one run): "
              f"{statistics.median(pss_bytes(s) for s in idle) / (1 << 20):.0f} MiB (median of {len(idle)})")
        await asyncio.sleep(2)
        for frozen in (False, True):
            if frozen:
                for s in idle:
                    await be.pause(s)
            c0 = sum(cpu_seconds(s.cgroups.sandbox_id) for s in idle)
            await asyncio.sleep(5)
            c1 = sum(cpu_seconds(s.cgroups.sandbox_id) for s in idle)
            print(f"CPU of {len(idle)} idle sandboxes, {'frozen' if frozen else 'unfrozen'}: "
                  f"{(c1 - c0) / 5 * 100:.1f} % of one core")
        for s in idle:
            await kill(be, s)
    finally:
        await be.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--idle", type=int, default=20)
    parser.add_argument("--platform", default="systrap", choices=("systrap", "ptrace"))
    parser.add_argument("--pool-only", action="store_true", help="stop after the pool's figures")
    asyncio.run(main(parser.parse_args()))
