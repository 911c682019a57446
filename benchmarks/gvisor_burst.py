"""A burst of gvisor creates beside busy sandboxes: how long each takes, and where a create from a
snapshot spends its time. Measured on the backend itself (no HTTP in between).

    PYTHONPATH=. .venv/bin/python benchmarks/gvisor_burst.py [--rounds 10] [--burst 8] [--busy 2]
        [--standbys 12]

Each round: `--busy` sandboxes run a CPU loop (as a soak's sessions keep the cores busy), then
`--burst` creates start at once, one of them from a disk archive of a sandbox's files (what a
filesystem snapshot's create does: a standby is claimed, then the files are untarred in it with
`runsc exec`). Every create is timed to its first run_code result. The pool is full before each
round, so the burst is served by standbys and their refill runs beside it, as in the soak's bursts.

Prints per kind of create p50 / p95 / max, and for the create from the archive its parts: the take
from the pool, the untar, the claim. Run as root with runsc.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import os
import shutil
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from typing import Any

from gvisor_lifecycle import first_result, kill, pool_full

from agentcell.backends.base import SandboxSpec
from agentcell.backends.gvisor import backend as gvisor_backend
from agentcell.backends.gvisor.backend import GvisorBackend, GvisorSandbox

BUSY_CODE = "import time\nt = time.time()\nwhile time.time() - t < {seconds}: pass\n'done'"


def summary(samples: list[float]) -> str:
    ms = sorted(s * 1000 for s in samples)
    p95 = ms[min(len(ms) - 1, round(0.95 * (len(ms) - 1)))]
    return f"p50 {statistics.median(ms):6.0f}  p95 {p95:6.0f}  max {ms[-1]:6.0f} ms  (n={len(ms)})"


class Parts:
    """The time the create from the archive spends in each of its parts, by wrapping them. Only that
    create counts: it runs in a task of its own (asyncio.gather), which alone sets `measured`."""

    measured: contextvars.ContextVar[bool] = contextvars.ContextVar("measured", default=False)

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = defaultdict(list)

    def timed(self, name: str, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return await fn(*args, **kwargs)
            finally:
                if self.measured.get():
                    self.seconds[name].append(time.perf_counter() - t)
        return wrapper


async def timed_create(be: GvisorBackend, spec: SandboxSpec, measured: bool) -> tuple[float, GvisorSandbox]:
    Parts.measured.set(measured)  # in this task's own context
    t = time.perf_counter()
    sb = await be.create(spec)
    assert await first_result(sb) == "42"
    return time.perf_counter() - t, sb


async def main(args: argparse.Namespace) -> None:
    be = GvisorBackend(max_sandboxes=args.burst + args.busy + args.standbys + 8, standbys=args.standbys)
    await be.start()
    tmp = tempfile.mkdtemp(dir="/run/agentcell")
    parts = Parts()
    assert be._pool is not None
    pool = be._pool
    pool.take = parts.timed("take from the pool", pool.take)  # type: ignore[method-assign]
    be._untar = parts.timed("untar (runsc exec)", be._untar)  # type: ignore[method-assign]
    gvisor_backend.standby.claim = parts.timed("claim", gvisor_backend.standby.claim)  # type: ignore[attr-defined]
    times: dict[str, list[float]] = defaultdict(list)
    try:
        # the archive: a sandbox's files, exported as a filesystem snapshot exports them
        src = await be.create(SandboxSpec())
        assert await first_result(src, "open('/home/user/snap.txt', 'w').write('from the snapshot') and 42") == "42"
        archive = os.path.join(tmp, "files.tar")
        size = await be.export_files(src, archive, 64 << 20)
        await kill(be, src)
        print(f"archive of a sandbox's files: {size} bytes; {args.rounds} rounds of {args.burst} creates "
              f"(1 from the archive) beside {args.busy} busy sandboxes, {args.standbys} standbys")
        for _ in range(args.rounds):
            await pool_full(be)
            busy = [await be.create(SandboxSpec()) for _ in range(args.busy)]
            loops = [asyncio.create_task(first_result(b, BUSY_CODE.format(seconds=args.busy_seconds)))
                     for b in busy]
            await asyncio.sleep(1.0)  # the loops are running
            results = await asyncio.gather(
                timed_create(be, SandboxSpec(files=archive), True),
                *(timed_create(be, SandboxSpec(), False) for _ in range(args.burst - 1)))
            times["from the archive"].append(results[0][0])
            if args.verbose:
                print(f"  round {len(times['from the archive'])}: from the archive {results[0][0] * 1000:.0f} ms "
                      f"(untar {parts.seconds['untar (runsc exec)'][-1] * 1000:.0f}), from the template "
                      f"{', '.join(f'{r[0] * 1000:.0f}' for r in results[1:])} ms", flush=True)
            times["from the template"] += [r[0] for r in results[1:]]
            for _, sb in results:
                await kill(be, sb)
            for task in loops:
                task.cancel()
            await asyncio.gather(*loops, return_exceptions=True)
            for b in busy:
                await kill(be, b)
        for kind, samples in times.items():
            print(f"  create -> first result, {kind:<18} {summary(samples)}")
        print("  the create from the archive, by part:")
        for name, samples in parts.seconds.items():
            print(f"    {name:<22} {summary(samples)}")
    finally:
        await be.close()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--burst", type=int, default=8)
    parser.add_argument("--busy", type=int, default=2, help="sandboxes running a CPU loop during each burst")
    parser.add_argument("--busy-seconds", type=float, default=8.0)
    parser.add_argument("--standbys", type=int, default=12)
    parser.add_argument("--verbose", action="store_true", help="a line per round")
    asyncio.run(main(parser.parse_args()))
