"""The limits collector (agentcell/record/linux/limit_events.py) against real sandboxes of the real
agent: an OOM kill names its victim, a fork bomb, a full disk and a CPU quota each give their event,
under their own sandbox only, and nothing a sandbox prints or names itself can make one."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentcell.backends.base import Limits, SandboxSpec
from agentcell.backends.linux.backend import LinuxBackend, LinuxSandbox
from agentcell.record.linux.limit_events import LimitsCollector
from agentcell.record.linux.target import WatchTarget
from agentcell.runtime.protocol import AgentChannel, line_dicts
from tests.helpers import started

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/proc/self/ns/user"),
                                reason="the linux backend needs root and user namespaces")

INTERVAL = 0.2
WINDOW = 1.0


class Recorder:
    """The collector's sink: every event, by sandbox id."""

    def __init__(self) -> None:
        self.events: dict[str, list[dict[str, Any]]] = {}

    def __call__(self, sandbox_id: str, ev: dict[str, Any]) -> None:
        self.events.setdefault(sandbox_id, []).append(ev)

    def of(self, sandbox_id: str, kind: str | None = None) -> list[dict[str, Any]]:
        return [e for e in self.events.get(sandbox_id, []) if kind is None or e["kind"] == kind]

    async def wait_for(self, sandbox_id: str, kind: str, n: int = 1, timeout: float = 10) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while len(self.of(sandbox_id, kind)) < n:
            assert time.monotonic() < deadline, (kind, self.events)
            await asyncio.sleep(0.05)
        return self.of(sandbox_id, kind)


class Box:
    """A sandbox of the real agent: code contexts (code.run) and shell commands (proc.start)."""

    def __init__(self, backend: LinuxBackend, sandbox: LinuxSandbox, channel: AgentChannel) -> None:
        self.backend = backend
        self.sandbox = sandbox
        self.channel = channel
        self.id = sandbox.sandbox_id

    @classmethod
    async def create(cls, backend: LinuxBackend, **limits: Any) -> Box:
        sb = await backend.create(SandboxSpec(limits=Limits(**limits)))
        assert isinstance(sb, LinuxSandbox)
        return cls(backend, sb, await AgentChannel.open(sb.sock))

    def target(self) -> WatchTarget:
        """What the server would hand the collector for this sandbox."""
        be, sb = self.backend, self.sandbox
        uids = (be.uid_base + sb.slot, be.uid_base + be._slot_count + sb.slot)  # its user's, its root's
        return WatchTarget(sb.sandbox_id, sb.host_pid, uids, sb.cgroups, sb.disk_fd)

    async def code(self, src: str) -> list[dict[str, Any]]:
        return [d async for d in line_dicts(self.channel.stream("code.run", src.encode()))]

    async def sh(self, cmd: str, timeout_ms: int = 60_000, user: str | None = None) -> tuple[int, str]:
        req = {"cmd": "/bin/bash", "args": ["-c", cmd], "envs": {}, "cwd": None, "tag": None, "stdin": False,
               "pty": None, "timeout_ms": timeout_ms, "user": user}  # fmt: skip
        out, end = b"", {}
        async for f in self.channel.stream("proc.start", **req):
            f.raise_for_error()
            if f.header.get("event") in ("stdout", "stderr"):
                out += f.payload
            elif f.header.get("event") == "end":
                end = f.header
        return int(end.get("exit_code", -1)), out.decode(errors="replace")

    async def close(self) -> None:
        await self.channel.close()
        await self.backend.kill(self.sandbox)


@pytest.fixture(scope="module")
async def backend() -> AsyncIterator[LinuxBackend]:
    async with started(LinuxBackend(max_sandboxes=20, standbys=0, preload=False)) as be:
        yield be


@pytest.fixture(scope="module")
async def recorder() -> Recorder:
    return Recorder()


@pytest.fixture(scope="module")
async def collector(recorder: Recorder) -> AsyncIterator[LimitsCollector]:
    c = LimitsCollector(recorder, interval=INTERVAL, window=WINDOW)
    await c.start()
    try:
        yield c
    finally:
        await c.close()


@pytest.fixture(scope="module")
async def neighbour(backend: LinuxBackend, collector: LimitsCollector) -> AsyncIterator[Box]:
    """A quiet sandbox watched for the whole module: none of the others' events may land on it."""
    b = await Box.create(backend)
    collector.watch(b.target())
    yield b
    collector.unwatch(b.id)
    await b.close()


@pytest.fixture
async def box_factory(backend: LinuxBackend, collector: LimitsCollector,
                      neighbour: Box) -> AsyncIterator[Any]:
    boxes: list[Box] = []

    async def make(**limits: Any) -> Box:
        b = await Box.create(backend, **limits)
        boxes.append(b)
        collector.watch(b.target())
        return b

    yield make
    for b in boxes:
        collector.unwatch(b.id)
        await b.close()


def host_pid_of(box: Box, pid: int) -> int:
    """The host's number of the sandbox's process `pid` (its NSpid's last)."""
    with open(f"{box.sandbox.cgroups.dirs['memory']}/cgroup.procs") as f:
        for host_pid in f.read().split():
            with open(f"/proc/{host_pid}/status") as st:
                ns = next(line for line in st if line.startswith("NSpid:")).split()
            if int(ns[-1]) == pid:
                return int(host_pid)
    raise AssertionError(f"no process {pid} in {box.id}")


async def test_oom_kill_names_the_python_process(box_factory: Any, recorder: Recorder) -> None:
    box = await box_factory(memory_mb=256)
    out = await box.code("import os\nos.getpid()")
    pid = int(next(d["text"] for d in out if d.get("type") == "result"))
    host_pid = host_pid_of(box, pid)
    out = await box.code("hog = bytearray(400 << 20)")
    assert any(d.get("type") == "error" for d in out), out  # the context died
    [oom] = await recorder.wait_for(box.id, "limit.oom")
    assert oom["source"] == "host" and oom["victim_known"] is True
    assert oom["comm"].startswith("python") and oom["host_pid"] == host_pid, oom
    # its number in the sandbox, read from /proc as the kernel reports the kill: None if its parent
    # reaped it first (rare, on a loaded host)
    assert oom["pid"] in (pid, None), oom
    assert oom["constraint"] == "memcg" and oom["rss_kb"] > 150_000, oom
    assert oom["host_uid"] == box.target().host_uids[0], oom
    await asyncio.sleep(4 * INTERVAL)  # the cgroup's counter agrees with the log: no second event
    assert len(recorder.of(box.id, "limit.oom")) == 1, recorder.of(box.id)


# n processes at once, each alone past a 256 MiB limit: the OOM killer kills every one (and, with the
# highest oom_score_adj, only them: not the agent, while they are still small)
HOGS = """cat > /tmp/hogs.py <<'END'
import subprocess, sys
hog = "open('/proc/self/oom_score_adj', 'w').write('1000'); bytearray(400 << 20)"
ps = [subprocess.Popen([sys.executable, "-c", hog]) for _ in range({n})]
print([p.wait() for p in ps])
END
python3 /tmp/hogs.py"""
FORK_BOMB = ("python3 -c \"\nimport os, time\nn = 0\nwhile True:\n"
             "    try:\n        pid = os.fork()\n    except BlockingIOError:\n        break\n"
             "    if pid == 0:\n        time.sleep(2); os._exit(0)\n    n += 1\nprint('forked', n)\n\"")


async def test_oom_kills_at_once_land_under_their_own_ids(box_factory: Any, recorder: Recorder) -> None:
    a, b = await box_factory(memory_mb=256), await box_factory(memory_mb=256)
    await asyncio.gather(a.sh(HOGS.format(n=1)), b.sh(HOGS.format(n=1)))
    for box in (a, b):
        [ev] = await recorder.wait_for(box.id, "limit.oom")
        assert ev["comm"] == "python3" and ev["host_uid"] == box.target().host_uids[0], ev
        assert ev["pid"] is None or ev["pid"] > 1, ev


async def test_oom_flood_is_bounded_and_counted(backend: LinuxBackend, box_factory: Any) -> None:
    """12 kills at once: past the kernel's rate limit of its OOM reports (10 per 5 s), so some come with
    the uid only; a long window folds them; a collector without the kernel log still counts them all
    from the cgroup's counter."""
    box = await box_factory(memory_mb=256)
    slow, blind = Recorder(), Recorder()
    windowed = LimitsCollector(slow, interval=INTERVAL, window=60)
    no_log = LimitsCollector(blind, interval=INTERVAL, window=WINDOW, kmsg="/nonexistent/kmsg")
    for c in (windowed, no_log):
        await c.start()
        c.watch(box.target())
    try:
        code, out = await box.sh(HOGS.format(n=12))
        assert out.strip() == str([-9] * 12), out
        # the kernel's own count (the OOM killer may also pick a child between its fork and its exec)
        with open(f"{box.sandbox.cgroups.dirs['memory']}/memory.oom_control") as f:
            kills = int(f.read().split("oom_kill ")[1].split()[0])
        assert kills >= 12
        await slow.wait_for(box.id, "limit.oom")
        deadline = time.monotonic() + 10
        while sum(e["count"] for e in blind.of(box.id, "limit.oom")) < kills:
            assert time.monotonic() < deadline, blind.events
            await asyncio.sleep(0.1)
        assert len(slow.of(box.id)) == 1  # one event in the window, the rest held
    finally:
        for c in (windowed, no_log):
            c.unwatch(box.id)  # sends what it held
            await c.close()
    first, folded = slow.of(box.id, "limit.oom")
    assert first["count"] == 1 and folded["count"] == kills - 1 and folded["victim_known"], (first, folded)
    assert folded["comm"] == "python3", folded
    unknown = blind.of(box.id, "limit.oom")
    assert sum(e["count"] for e in unknown) == kills and not any(e["victim_known"] for e in unknown), unknown
    assert len(unknown) < kills / 2, unknown  # one per window, not one per kill


async def test_fork_bomb_gives_limit_pids(box_factory: Any, recorder: Recorder) -> None:
    box = await box_factory(pids=32)
    # as the sandbox's user: RLIMIT_NPROC (= the pids limit, per uid) refuses first
    code, out = await box.sh(FORK_BOMB)
    assert code == 0 and "forked" in out, out
    [ev] = await recorder.wait_for(box.id, "limit.pids")
    assert ev["pids_max"] == 32 and ev["tasks"] >= 30 and ev["source"] == "host", ev
    await asyncio.sleep(2.5 + WINDOW)  # its children exit: armed again
    # as the sandbox's root (another uid, another RLIMIT_NPROC count): the cgroup refuses, and counts
    code, out = await box.sh(FORK_BOMB, user="root")
    assert code == 0 and "forked" in out, out
    events = await recorder.wait_for(box.id, "limit.pids", 2)
    assert events[1]["refused_by"] == "cgroup" and events[1]["count"] >= 1, events


async def test_full_disk_gives_one_limit_disk_per_fill(box_factory: Any, recorder: Recorder) -> None:
    box = await box_factory(disk_mb=48)
    code, out = await box.sh("dd if=/dev/zero of=/tmp/fill bs=1M 2>&1; true")
    assert "No space left" in out, out
    [ev] = await recorder.wait_for(box.id, "limit.disk")
    assert ev["reason"] == "space" and ev["limit_mb"] == 48 and ev["used_mb"] >= 47, ev
    await box.sh("dd if=/dev/zero of=/tmp/more bs=1M count=4 2>&1; true")  # still full: no new event
    await asyncio.sleep(WINDOW + 3 * INTERVAL)
    assert len(recorder.of(box.id, "limit.disk")) == 1
    await box.sh("rm -f /tmp/fill /tmp/more")
    await asyncio.sleep(3 * INTERVAL)  # a poll sees it emptied: armed again
    await box.sh("dd if=/dev/zero of=/home/user/fill bs=1M 2>&1; true")  # the same disk behind /home/user
    await recorder.wait_for(box.id, "limit.disk", 2)


async def test_busy_loop_under_a_quarter_core_gives_limit_cpu(box_factory: Any, recorder: Recorder) -> None:
    box = await box_factory(cpu_count=0.25)
    # two busy loops: the quarter core's quota is gone early in every period, however loaded the host
    await box.sh("for i in 1 2; do timeout 4 sh -c 'while :; do :; done' & done; wait; true")
    events = await recorder.wait_for(box.id, "limit.cpu", 2)
    assert all(e["cpu_limit"] == 0.25 for e in events), events
    assert max(e["throttled_s"] for e in events) > 0.3 * WINDOW, events
    assert max(e["throttled_periods"] for e in events) >= 5, events
    # streak: windows in a row (on an oversubscribed host a window may fall short of its quota, unthrottled)
    assert events[0]["streak"] == 1, events
    for a, b in zip(events, events[1:], strict=False):
        consecutive = b["time"] - a["time"] < 1.5 * WINDOW
        assert b["streak"] == (a["streak"] + 1 if consecutive else 1), events
    # one event per window, not per throttled period
    assert all(e["window_s"] >= WINDOW for e in events) and len(events) <= 6, events


def nr_throttled(box: Box) -> int:
    with open(f"{box.sandbox.cgroups.dirs['cpu']}/cpu.stat") as f:
        return int(next(line for line in f if line.startswith("nr_throttled ")).split()[1])


async def test_one_burst_of_threads_gives_no_limit_cpu(backend: LinuxBackend, box_factory: Any) -> None:
    """A sandbox idle but for one short burst of two threads over its one core: throttled, in most of
    the few periods it ran in, but for a small part of the window. Not a miner; nothing recorded."""
    window = 4.0
    seen = Recorder()
    quiet = LimitsCollector(seen, interval=INTERVAL, window=window)
    await quiet.start()
    try:
        box = await box_factory(cpu_count=1)
        quiet.watch(box.target())
        await asyncio.sleep(INTERVAL)
        # the burst must have been throttled for the test to say anything (two threads in parallel on
        # a host with two cores); on a host too busy to run them at once, try again
        for _ in range(5):
            before = nr_throttled(box)
            await box.sh("for i in 1 2; do timeout 0.15 sh -c 'while :; do :; done' & done; wait; true")
            if nr_throttled(box) > before:
                break
        else:
            pytest.skip("the host never ran the burst's two threads at once")
        await asyncio.sleep(window + 3 * INTERVAL)
        assert seen.of(box.id, "limit.cpu") == [], seen.events
    finally:
        await quiet.close()


async def test_forged_oom_lines_give_nothing(box_factory: Any, recorder: Recorder, neighbour: Box) -> None:
    box = await box_factory()
    memcg = "/" + box.sandbox.cgroups.sandbox_id
    other = "/" + neighbour.sandbox.cgroups.sandbox_id
    forged = [f"oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=/,mems_allowed=0,oom_memcg={m},"
              f"task_memcg={m},task=python,pid=1,uid=1000" for m in (memcg, other)]
    forged.append("Memory cgroup out of memory: Killed process 1 (python) total-vm:1kB, anon-rss:1kB, "
                  "file-rss:0kB, shmem-rss:0kB, UID:1000 pgtables:1kB oom_score_adj:0")
    script = "\n".join(forged)
    # printed, to the console and to every log-looking place it can reach
    code, out = await box.sh(f"cat > /tmp/f <<'EOF'\n{script}\nEOF\ncat /tmp/f; cat /tmp/f >&2;"
                             "ls -l /dev/kmsg 2>&1; (cat /tmp/f > /dev/kmsg) 2>&1; logger -f /tmp/f 2>&1; true")
    assert "No such file" in out, out  # no /dev/kmsg in a sandbox
    # a comm that spells the start of the record, then a crash the kernel logs under that comm
    await box.sh("python3 -c \"import ctypes; ctypes.CDLL(None).prctl(15, b'oom-kill:constr', 0, 0, 0);"
                 "ctypes.string_at(0)\"; true")
    # and the host writing the same text into the kernel log (a user-facility record): not the kernel's
    fd = os.open("/dev/kmsg", os.O_WRONLY)
    try:
        for line in forged:
            os.write(fd, f"<12>{line}".encode())
        host_uid = box.target().host_uids[0]
        os.write(fd, (f"<12>Memory cgroup out of memory: Killed process 2 (python) total-vm:1kB, anon-rss:1kB, "
                      f"file-rss:0kB, shmem-rss:0kB, UID:{host_uid} pgtables:1kB oom_score_adj:0").encode())
    finally:
        os.close(fd)
    await asyncio.sleep(WINDOW + 3 * INTERVAL)
    # (its own commands may have been throttled a moment: limit.cpu is not what this test is about)
    assert recorder.of(box.id, "limit.oom") == [] and recorder.of(neighbour.id) == [], recorder.events


async def test_the_neighbour_saw_nothing(neighbour: Box, recorder: Recorder) -> None:
    """Last in the module: every other test's events landed under its own sandbox only."""
    assert recorder.of(neighbour.id) == [], recorder.of(neighbour.id)
    assert len(recorder.events) >= 4, recorder.events
