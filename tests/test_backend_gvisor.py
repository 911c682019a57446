"""The gvisor backend, for real: runsc sandboxes driven through the agent protocol.

What is the backend's own (the suites under AGENTCELL_TEST_BACKEND=gvisor cover the rest): the limits
land on the host cgroup and in the guest, a paused sandbox takes no CPU, a kill leaves no process,
cgroup or state behind, checkpoint/restore keeps state and gives a new sandbox its own name and
random state, and a server that dies takes its sandboxes along. Run as root with runsc installed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from agentcell.backends.base import Limits, SandboxSpec
from agentcell.backends.gvisor import spec as gvisor_spec
from agentcell.backends.gvisor.backend import GvisorBackend, GvisorSandbox
from agentcell.errors import InvalidArgumentError
from agentcell.runtime.protocol import AgentChannel, line_dicts
from tests.helpers import started

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runsc") is None,
                                reason="the gvisor backend needs root and runsc (scripts/setup installs it)")
REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
async def backend() -> AsyncIterator[GvisorBackend]:
    async with started(GvisorBackend(max_sandboxes=20, standbys=1)) as be:
        yield be


class Box:
    def __init__(self, sb: GvisorSandbox, channel: AgentChannel) -> None:
        self.sb = sb
        self.channel = channel

    @classmethod
    async def create(cls, be: GvisorBackend, spec: SandboxSpec | None = None) -> Box:
        sb = await be.create(spec or SandboxSpec())
        assert isinstance(sb, GvisorSandbox)
        return cls(sb, await AgentChannel.open(sb.sock))

    async def kill(self, be: GvisorBackend) -> None:
        """The channel first: its transport would otherwise keep the socket's fd number registered in
        the loop, and the next sandbox's socket may get that number."""
        await self.channel.close()
        await be.kill(self.sb)

    async def run(self, code: str) -> str:
        """The cell's result text, or its error as 'Name: value'."""
        out = []
        async for d in line_dicts(self.channel.stream("code.run", code.encode())):
            if d.get("type") == "result":
                out.append(d.get("text", ""))
            elif d.get("type") == "error":
                out.append(f"{d.get('name')}: {d.get('value')}")
        return "".join(out)


def _cgroup_dirs(rel: str) -> list[str]:
    """`rel`'s directory in every cgroup hierarchy the host mounts (read here, not from the backend:
    runsc makes a sandbox's cgroup in hierarchies agentcell does not limit with, e.g. name=systemd)."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        if right.split(" ", 1)[0] in ("cgroup", "cgroup2"):
            path = os.path.join(left.split()[4], rel.lstrip("/"))
            if os.path.isdir(path):
                found.append(path)
    return found


def _runsc_processes(state: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if "runsc" in line and state in line]


async def test_limits_land_on_the_host_and_in_the_guest(backend: GvisorBackend) -> None:
    limits = Limits(memory_mb=384, cpu_count=0.5, pids=40, disk_mb=32, open_files=200)
    box = await Box.create(backend, SandboxSpec(limits=limits))
    try:
        cg = box.sb.cgroups
        mem = cg.dirs.get("unified") or cg.dirs["memory"]
        limit_file = "memory.max" if cg.v2 else "memory.limit_in_bytes"
        assert int(Path(mem, limit_file).read_text()) == gvisor_spec.host_memory_bytes(limits)
        if not cg.v2:
            assert Path(cg.dirs["cpu"], "cpu.cfs_quota_us").read_text().strip() == "50000"
        # the guest: RLIMIT_NPROC stands for pids, the disk is a tmpfs of disk_mb
        r = await box.run("import resource; (resource.getrlimit(resource.RLIMIT_NPROC), "
                          "resource.getrlimit(resource.RLIMIT_NOFILE))")
        assert r == "((40, 40), (200, 200))", r
        r = await box.run("import subprocess; subprocess.run('dd if=/dev/zero of=/home/user/big bs=1M count=64',"
                          " shell=True, capture_output=True, text=True).stderr")
        assert "No space left" in r, r
        stats = await backend.stats(box.sb)
        assert stats.memory_limit_bytes == gvisor_spec.host_memory_bytes(limits) and stats.pids > 0
    finally:
        await box.kill(backend)


async def test_network_and_secrets_are_refused(backend: GvisorBackend) -> None:
    from agentcell.network.policy import NetworkPolicy

    with pytest.raises(InvalidArgumentError, match="10704"):
        await backend.create(SandboxSpec(network=NetworkPolicy(internet=True)))
    box = await Box.create(backend)
    try:
        r = await box.run("import socket\ntry:\n    socket.create_connection(('192.0.2.1', 80), timeout=1); 'connected'\n"
                          "except OSError as e:\n    type(e).__name__")
        assert "connected" not in r
        r = await box.run("[line.split(':')[0].strip() for line in open('/proc/net/dev').readlines()[2:]]")
        assert r == "['lo']", r
    finally:
        await box.kill(backend)


async def test_pause_stops_cpu_and_resume_goes_on(backend: GvisorBackend) -> None:
    box = await Box.create(backend)
    try:
        await box.run("import threading, time\n"
                      "def spin():\n    while True: pass\n"
                      "threading.Thread(target=spin, daemon=True).start()")
        await asyncio.sleep(0.5)
        await backend.pause(box.sb)
        before = (await backend.stats(box.sb)).cpu_seconds
        await asyncio.sleep(1.0)
        after = (await backend.stats(box.sb)).cpu_seconds
        assert after - before < 0.02, after - before  # frozen: not even systrap's stubs spin
        await backend.resume(box.sb)
        assert await box.run("6 * 7") == "42"
        busy = (await backend.stats(box.sb)).cpu_seconds
        await asyncio.sleep(0.5)
        assert (await backend.stats(box.sb)).cpu_seconds - busy > 0.1  # the spinner runs on
    finally:
        await box.kill(backend)


async def test_kill_leaves_nothing_behind(backend: GvisorBackend) -> None:
    box = await Box.create(backend)
    sb = box.sb
    await backend.pause(sb)  # a frozen sandbox dies too
    pids = [int(p) for d in sb.cgroups.dirs.values() if os.path.isdir(d)
            for p in Path(d, "cgroup.procs").read_text().split()]
    assert pids
    rel = sb.cgroups.sandbox_id
    assert len(_cgroup_dirs(rel)) >= 3  # runsc made it in memory, pids, cpu and maybe more
    await box.kill(backend)
    assert not sb.alive()
    assert not sb.cgroups.exists()
    assert _cgroup_dirs(rel) == []  # in no hierarchy at all
    assert not os.path.exists(sb.dir)
    for pid in set(pids):
        assert not os.path.exists(f"/proc/{pid}"), pid  # gone and reaped, not zombies
    assert not _runsc_processes(sb.dir)


async def test_checkpoint_and_restore_fork_a_sandbox(backend: GvisorBackend, tmp_path: Path) -> None:
    box = await Box.create(backend)
    image = str(tmp_path / "image")
    try:
        await box.run("x = 41\nopen('/tmp/state', 'w').write('kept')")
        size = await backend.checkpoint(box.sb, image, leave_running=True)
        assert size > 1 << 20
        assert await box.run("x + 1") == "42"  # the source runs on
        kids = await asyncio.gather(*(backend.restore(image, SandboxSpec()) for _ in range(2)))
        seen = []
        try:
            for kid in kids:
                assert isinstance(kid, GvisorSandbox)
                k = Box(kid, await AgentChannel.open(kid.sock))
                r = eval(await k.run("import random, socket\n(x, open('/tmp/state').read(), socket.gethostname(), "
                                     "random.random())"))
                assert r[:3] == (41, "kept", kid.sandbox_id), r
                seen.append(r[3])
                await k.run("x = 0")  # a child's state is its own
                await k.channel.close()
            assert seen[0] != seen[1]
            assert await box.run("x") == "41"
        finally:
            for kid in kids:
                await backend.kill(kid)  # (their channels were closed above)
        # without leave_running: hibernation, the source is gone
        await backend.checkpoint(box.sb, image + "2", leave_running=False)
        await box.channel.close()  # after: the agent must not see its socket close before it is saved
        assert box.sb.killed and not box.sb.cgroups.exists()
        back = await backend.restore(image + "2", SandboxSpec())
        try:
            b = Box(back, await AgentChannel.open(back.sock))  # type: ignore[arg-type]
            assert await b.run("x") == "41"
            await b.channel.close()
        finally:
            await backend.kill(back)
    finally:
        await box.kill(backend)


async def test_standbys_have_their_own_name_and_random_state(backend: GvisorBackend) -> None:
    seen = []
    for _ in range(2):
        box = await Box.create(backend)
        try:
            r = eval(await box.run("import random, numpy, socket, os\n"
                                   "(socket.gethostname(), os.environ['HOSTNAME'], random.random(), "
                                   "numpy.random.rand())"))
            assert r[0] == r[1] == box.sb.sandbox_id, r
            seen.append(r[2:])
        finally:
            await box.kill(backend)
    assert seen[0][0] != seen[1][0] and seen[0][1] != seen[1][1], seen


def _cpu_weight(sb: GvisorSandbox) -> int:
    """Its cgroup's CPU weight, as v1's cpu.shares (v2's cpu.weight 1 and 100 are shares 2 and 1024)."""
    for d in _cgroup_dirs(sb.cgroups.sandbox_id):
        if os.path.exists(f"{d}/cpu.shares"):
            return int(Path(f"{d}/cpu.shares").read_text())
        if os.path.exists(f"{d}/cpu.weight"):
            return {1: 2, 100: 1024}.get(int(Path(f"{d}/cpu.weight").read_text()), -1)
    raise AssertionError(f"no CPU controller for {sb.sandbox_id}")


async def test_a_standby_is_restored_at_the_lowest_cpu_weight_until_its_claim(backend: GvisorBackend) -> None:
    """A standby's restore (0.3-0.6 s of CPU each) yields to the sandboxes that serve someone: the
    pool's refill after a burst would otherwise take the CPU from the burst's own creates. Its claim
    gives it the default weight."""
    assert backend._pool is not None
    async with asyncio.timeout(60):
        while not backend._pool.ready:
            await asyncio.sleep(0.1)
    standby = backend._pool._ready[0]
    assert _cpu_weight(standby) == 2
    box = await Box.create(backend)
    try:
        assert box.sb is standby  # the pool's one standby, claimed
        assert _cpu_weight(box.sb) == 1024
        assert await box.run("6 * 7") == "42"
    finally:
        await box.kill(backend)


_FRESH_KERNEL = ("ip = get_ipython(); hm = ip.history_manager; dh = ip.displayhook\n"
                 "(ip.execution_count, In, dict(Out), _i, _ii, (dh._, dh.__, dh.___), ip.events.callbacks['post_run_cell'], "
                 "sorted(k for k in globals() if k != '__builtins__'), len(__import__('linecache').cache), "
                 "__import__('os').environ.get('TENANT'))")


async def test_a_standby_keeps_nothing_of_its_warm_up(backend: GvisorBackend) -> None:
    """A standby ran a cell in its default context before it was frozen (standby.py): its tenant's
    first cell finds the kernel as in a sandbox booted for it (count 1, history, names, hooks), with
    the tenant's env vars."""
    seen = []
    for spec in (SandboxSpec(envs={"TENANT": "a"}), SandboxSpec(sandbox_id="bootedforthetest", envs={"TENANT": "a"})):
        box = await Box.create(backend, spec)
        try:
            lines = [d async for d in line_dicts(box.channel.stream("code.run", _FRESH_KERNEL.encode()))]
            assert lines[0] == {"type": "number_of_executions", "execution_count": 1}, lines
            seen.append(next(d["text"] for d in lines if d.get("type") == "result"))
        finally:
            await box.kill(backend)
    assert seen[0] == seen[1], seen
    assert "_agentcell_standby" not in seen[0] and "'a')" in seen[0], seen[0]


_DYING_SERVER = """
import asyncio, sys
from agentcell.backends.base import SandboxSpec
from agentcell.backends.gvisor.backend import GvisorBackend
from tests.helpers import started
async def main():
    be = GvisorBackend(max_sandboxes=2, standbys=0)
    await be.start()
    sb = await be.create(SandboxSpec())
    await be.pause(sb)  # a frozen sandbox never notices its closed socket: the watchdog must act
    print(be.cgroup_parent, be.state, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


async def test_sandboxes_die_with_their_server() -> None:
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", _DYING_SERVER, cwd=REPO,
                                                stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), 120)).decode().split()
    assert len(line) == 2, line
    rel, state = line
    proc.send_signal(signal.SIGKILL)
    await proc.wait()
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and (_runsc_processes(state) or os.path.exists(state)):
        await asyncio.sleep(0.2)
    assert not _runsc_processes(state)
    assert not os.path.exists(state)
    # the watchdog removed the tree from every hierarchy, runsc's extra ones (cpuset, name=systemd) too
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and _cgroup_dirs(rel):
        await asyncio.sleep(0.2)
    assert _cgroup_dirs(rel) == []


async def test_export_files_is_a_tar_of_home_and_tmp(backend: GvisorBackend, tmp_path: Path) -> None:
    import tarfile

    from agentcell.errors import ResourceExhaustedError

    box = await Box.create(backend)
    try:
        await box.run("open('/home/user/a.txt', 'w').write('home data')\nopen('/tmp/b.txt', 'w').write('tmp data')")
        await backend.pause(box.sb)
        size = await backend.export_files(box.sb, str(tmp_path / "disk.tar"), 64 << 20)
        assert size == (tmp_path / "disk.tar").stat().st_size
        with tarfile.open(tmp_path / "disk.tar") as tar:
            names = tar.getnames()
            assert "home/a.txt" in names and "tmp/b.txt" in names, names
            member = tar.extractfile("home/a.txt")
            assert member is not None and member.read() == b"home data"
            assert tar.getmember("home/a.txt").uid == 1000
        assert box.sb.cgroups.frozen()  # paused before, paused after
        with pytest.raises(ResourceExhaustedError):
            await backend.export_files(box.sb, str(tmp_path / "small.tar"), 1024)
        assert not (tmp_path / "small.tar").exists()
    finally:
        await box.kill(backend)
