"""The kernel-audit collector of the behaviour record (record/linux/audit_events.py), with real
sandboxes running the real agent: exec chains, exits, refused syscalls, writes and reads, a flood,
attempts to forge records, and the host's audit state left as it was found.

The collector is driven directly with a WatchTarget built from each LinuxSandbox (as the backend will
at claim); its events go to a list per sandbox.
"""

from __future__ import annotations

import asyncio
import os
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from agentcell.backends.base import SandboxSpec
from agentcell.backends.linux.backend import LinuxBackend, LinuxSandbox
from agentcell.record.linux import audit_netlink as an
from agentcell.record.linux.audit_events import AuditCollector
from agentcell.record.linux.target import WatchTarget
from agentcell.runtime.protocol import AgentChannel, line_dicts
from tests.helpers import started

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/proc/self/ns/user"),
                                reason="the linux backend needs root and user namespaces")

Events = dict[str, list[dict[str, Any]]]


def _audit_state(prefix: str = "agentcell:") -> tuple[Any, ...]:
    """The kernel's audit settings and the keys of the rules starting with `prefix`. (Other servers
    on this host may run a collector at the same time: compare only what is the test's.)"""
    sock = an.AuditSocket()
    try:
        st = sock.status()
        keys = sorted(k for k in map(an.rule_key, sock.rules()) if k.startswith(prefix))
    finally:
        sock.close()
    return st.enabled, st.pid, st.failure, st.backlog_limit, st.backlog_wait_time, st.rate_limit, keys


@pytest.fixture(scope="module")
def audit_before() -> Iterator[tuple[Any, ...]]:
    """The host's audit status before this module; checked again after its last collector."""
    before = _audit_state()
    yield before
    if before[1] == 0 and not before[6]:  # nobody else was using audit: all must be as it was
        assert _audit_state() == before, "the tests left the kernel's audit state changed"


@pytest.fixture(scope="module")
async def backend(audit_before: tuple[Any, ...]) -> AsyncIterator[LinuxBackend]:
    # ready_timeout: a busy host is slow
    async with started(LinuxBackend(max_sandboxes=20, standbys=1, preload=False, ready_timeout=60)) as be:
        yield be


class Recorder:
    """A started collector over the backend's uid range, and what it recorded per sandbox."""

    def __init__(self, be: LinuxBackend, **options: Any) -> None:
        self.be = be
        self.events: Events = {}
        self.collector = AuditCollector(self.sink, be.uid_base, be.uid_base + 2 * be._slot_count - 1, **options)

    def sink(self, sandbox_id: str, ev: dict[str, Any]) -> None:
        self.events.setdefault(sandbox_id, []).append(ev)

    def watch(self, sb: LinuxSandbox) -> None:
        n = self.be._slot_count  # the root ids follow the user ids (backend._prepare_with)
        self.collector.watch(WatchTarget(sb.sandbox_id, sb.host_pid, (self.be.uid_base + sb.slot,
                                                                      self.be.uid_base + n + sb.slot),
                                         sb.cgroups, sb.disk_fd))

    async def wait(self, sandbox_id: str, done: Callable[[list[dict[str, Any]]], bool],
                   timeout: float = 10) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout
        while not done(self.events.get(sandbox_id, [])) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.events.get(sandbox_id, [])


@pytest.fixture(scope="module", params=["bpf", "bpf-syscalls", "audit"])
async def recorder(backend: LinuxBackend, request: pytest.FixtureRequest) -> AsyncIterator[Recorder]:
    """Each test three times: the kernel tracer (the default where it loads) seeing refusals at their
    failed capability check, then at their syscall's exit, then audit's rules alone."""
    source, _, denials = request.param.partition("-")
    rec = Recorder(backend, trace_source=source, denials=denials or "failures")
    await rec.collector.start()
    try:
        yield rec
    finally:
        await rec.collector.close()


class Box:
    def __init__(self, be: LinuxBackend, sb: LinuxSandbox, ch: AgentChannel) -> None:
        self.be, self.sb, self.ch = be, sb, ch
        self.id = sb.sandbox_id

    @classmethod
    async def create(cls, be: LinuxBackend, recorder: Recorder) -> Box:
        sb = await be.create(SandboxSpec())
        assert isinstance(sb, LinuxSandbox)
        recorder.watch(sb)
        return cls(be, sb, await AgentChannel.open(sb.sock))

    async def sh(self, cmd: str, user: str | None = None) -> tuple[int, str]:
        req = {"cmd": "/bin/bash", "args": ["-c", cmd], "envs": {}, "cwd": None, "tag": None, "stdin": False,
               "pty": None, "timeout_ms": 120_000, "user": user}  # fmt: skip
        out, code = b"", -1
        async for f in self.ch.stream("proc.start", **req):
            f.raise_for_error()
            if f.header.get("event") in ("stdout", "stderr"):
                out += f.payload
            elif f.header.get("event") == "end":
                code = f.header.get("exit_code", -1)
        return code, out.decode(errors="replace")

    async def run_code(self, code: str) -> list[dict[str, Any]]:
        return [d async for d in line_dicts(self.ch.stream("code.run", textwrap.dedent(code).encode()))]

    async def close(self) -> None:
        await self.ch.close()
        await self.be.kill(self.sb)


@pytest.fixture
async def box(backend: LinuxBackend, recorder: Recorder) -> AsyncIterator[Box]:
    b = await Box.create(backend, recorder)
    yield b
    recorder.collector.unwatch(b.id)
    await b.close()


def of_kind(events: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [e for e in events if e["kind"] == kind]


def exec_of(events: list[dict[str, Any]], *argv: str) -> dict[str, Any] | None:
    return next((e for e in of_kind(events, "process.exec") if e["argv"] == list(argv)), None)


async def loop_lag(lags: list[float]) -> None:
    """How late the loop wakes a 10 ms sleep, into `lags`, until cancelled."""
    while True:
        t = time.monotonic()
        await asyncio.sleep(0.01)
        lags.append(time.monotonic() - t - 0.01)


# -- processes -----------------------------------------------------------------------------------


async def test_exec_chain_from_os_system_in_run_code(box: Box, recorder: Recorder) -> None:
    out = await box.run_code("""
        import os
        os.system("sh -c 'ls /tmp | wc -l'")
    """)
    assert not [d for d in out if d.get("type") == "error"], out

    def complete(evs: list[dict[str, Any]]) -> bool:
        return bool(exec_of(evs, "wc", "-l")) and len(of_kind(evs, "process.exit")) >= 3

    events = await recorder.wait(box.id, complete)
    inner = exec_of(events, "sh", "-c", "ls /tmp | wc -l")
    ls, wc = exec_of(events, "ls", "/tmp"), exec_of(events, "wc", "-l")
    outer = exec_of(events, "sh", "-c", "sh -c 'ls /tmp | wc -l'")  # os.system's own shell
    assert inner and ls and wc and outer, events
    assert ls["path"] == "/usr/bin/ls" and wc["path"] == "/usr/bin/wc"
    # the tree, in the host's pids (the sandbox's own are known while a process is still alive)
    assert ls["host_ppid"] == wc["host_ppid"] == inner["host_pid"]
    assert inner["host_ppid"] == outer["host_pid"]
    for e in (outer, inner, ls, wc):
        assert e["uid"] == 1000 and e["cwd"] == "/home/user" and e["source"] == "host"
    # a code context is the pid of the process that ran os.system, inside the sandbox
    assert outer["ppid"] is not None and outer["ppid"] > 1
    exits = {e["host_pid"]: e for e in of_kind(events, "process.exit")}
    for e, comm in ((ls, "ls"), (wc, "wc"), (inner, "sh")):
        ex = exits.get(e["host_pid"])
        assert ex is not None and ex["code"] == 0 and ex["comm"] == comm, (e, exits)
        assert 0 <= ex["duration_s"] < 5


async def test_fifty_short_processes_are_all_recorded(box: Box, recorder: Recorder) -> None:
    await box.sh("for i in $(seq 50); do /bin/true; done; /bin/sh -c 'exit 3'; /bin/sh -c 'kill -9 $$'")

    def complete(evs: list[dict[str, Any]]) -> bool:
        return len([e for e in of_kind(evs, "process.exit") if e["comm"] in ("true", "sh")]) >= 52

    events = await recorder.wait(box.id, complete)
    trues = [e for e in of_kind(events, "process.exec") if e["argv"] == ["/bin/true"]]
    assert len(trues) == 50
    exits = {e["host_pid"]: e for e in of_kind(events, "process.exit")}
    assert all(exits[e["host_pid"]]["code"] == 0 for e in trues)
    three = exec_of(events, "/bin/sh", "-c", "exit 3")
    killed = exec_of(events, "/bin/sh", "-c", "kill -9 $$")
    assert three and killed
    assert exits[three["host_pid"]]["code"] == 3
    assert exits[killed["host_pid"]]["signal"] == 9 and "code" not in exits[killed["host_pid"]]


async def test_arguments_as_given_spaces_quotes_and_long_ones(box: Box, recorder: Recorder) -> None:
    """The kernel hex-encodes arguments with spaces or quotes and splits long ones over several fields
    and records: argv comes back exactly."""
    long = "x" * 20_000
    await box.sh(f"/bin/echo 'two words' 'say \"hi\"' {long} 'naïve' > /dev/null")
    events = await recorder.wait(box.id, lambda evs: bool(of_kind(evs, "process.exec")))
    echo = exec_of(events, "/bin/echo", "two words", 'say "hi"', long, "naïve")
    assert echo is not None, [e["argv"][:2] for e in of_kind(events, "process.exec")]


# -- refused operations --------------------------------------------------------------------------


async def test_syscalls_refused_by_seccomp_are_named(box: Box, recorder: Recorder) -> None:
    code, out = await box.sh("python3 -c 'import ctypes; c = ctypes.CDLL(None); "
                             "print(c.unshare(0x10000000), c.mount(b\"none\", b\"/tmp\", b\"tmpfs\", 0, None))'")
    assert out.split() == ["-1", "-1"], out

    def complete(evs: list[dict[str, Any]]) -> bool:
        return {"mount", "unshare"} <= {e["syscall"] for e in of_kind(evs, "deny.syscall")}

    events = await recorder.wait(box.id, complete)
    denied = {e["syscall"]: e for e in of_kind(events, "deny.syscall")}
    assert denied["mount"]["nr"] == 165 and denied["unshare"]["nr"] == 272, denied
    assert denied["mount"]["action"] == "errno" and denied["mount"]["comm"] == "python3"
    assert "clone3" not in denied  # glibc's probe before clone: not worth a record


async def test_a_fallback_call_writes_no_record(box: Box, recorder: Recorder, monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc tries clone3 at every fork and falls back to clone on ENOSYS: that refusal comes from a
    filter without the audit flag, so the kernel writes no record of it (the refusal after it does)."""
    seen: list[int | None] = []
    handle = recorder.collector._seccomp

    def spy(rec: Any) -> None:
        seen.append(rec.int("syscall"))
        handle(rec)

    monkeypatch.setattr(recorder.collector, "_seccomp", spy)
    await box.sh("python3 -c 'import ctypes, subprocess; subprocess.run([\"/bin/true\"]); "
                 "print(ctypes.CDLL(None).unshare(0x10000000))'")
    events = await recorder.wait(box.id, lambda evs: 272 in seen and bool(exec_of(evs, "/bin/true")))
    assert exec_of(events, "/bin/true") and 272 in seen, seen  # the fork happened, the unshare was recorded
    assert 435 not in seen, seen  # clone3


async def test_refused_writes_name_the_path_and_the_wall(box: Box, recorder: Recorder) -> None:
    await box.sh("touch /usr/by-user")  # the overlay's files are the sandbox root's
    await box.sh("touch /newfile; mknod /opt/chardev c 1 3", user="root")  # read-only root; Landlock: no devices

    # a read-only mount's EROFS is seen at the syscall's exit only (not by the default capability program)
    every = recorder.collector.sees_failed_syscalls

    def complete(evs: list[dict[str, Any]]) -> bool:
        return len(of_kind(evs, "deny.write")) >= (3 if every else 2)

    writes = of_kind(await recorder.wait(box.id, complete), "deny.write")
    reasons = {(e["reason"], e["path"], e["comm"]) for e in writes}
    # audit names the directory when the refused call was to create an entry in it; the kernel tracer
    # names what the call named
    traced = recorder.collector.traced
    assert ("permission", "/usr/by-user" if traced else "/usr/", "touch") in reasons, writes
    if every:
        assert ("read-only", "/newfile" if traced else "/", "touch") in reasons, writes
    else:
        assert not [e for e in writes if e["reason"] == "read-only"], writes
    landlock = [e for e in writes if e["reason"] == "landlock"]
    assert len(landlock) == 1 and landlock[0]["blockers"] == "fs.make_char", writes  # one event, its wall named
    if traced and every:  # paired with the tracer's view of the call: as the call named it, and who
        assert landlock[0]["path"] == "/opt/chardev" and landlock[0]["comm"] == "mknod", writes
    elif traced:  # Landlock's record alone: its directory, no process
        assert landlock[0]["path"] == "/opt" and landlock[0]["comm"] is None, writes
    else:
        assert landlock[0]["path"] == "/opt/" and landlock[0]["comm"] == "mknod", writes


async def test_permission_errors_on_sensitive_paths(box: Box, recorder: Recorder) -> None:
    out = await box.run_code("""
        for p in ("/proc/1/environ", "/root/.bashrc"):
            try:
                open(p).read()
            except OSError as e:
                print(p, e.errno)
    """)
    assert "".join(d.get("text", "") for d in out if d.get("type") == "stdout").split() == \
        ["/proc/1/environ", "13", "/root/.bashrc", "13"]

    def complete(evs: list[dict[str, Any]]) -> bool:
        return len(of_kind(evs, "deny.access")) >= 2

    access = {e["path"]: e for e in of_kind(await recorder.wait(box.id, complete), "deny.access")}
    assert access["/proc/1/environ"]["errno"] == 13 and access["/proc/1/environ"]["syscall"] == "openat"
    assert access["/root/.bashrc"]["errno"] == 13
    assert access["/proc/1/environ"]["pid"] is not None  # the code context, still alive


# -- the record cannot be forged, suppressed or flooded ------------------------------------------


async def test_the_sandbox_cannot_forge_records(box: Box, recorder: Recorder, backend: LinuxBackend) -> None:
    uid = backend.uid_base + box.sb.slot
    # audit-like text on stdout, into /dev/kmsg, and an audit netlink socket (refused by seccomp)
    fake = (f"type=SECCOMP audit(1.1:1): uid={uid} pid=1 comm=\"x\" syscall=999 code=0x50000\n"
            f"type=SYSCALL audit(1.1:2): arch=c000003e syscall=59 success=yes uid={uid} pid=1 "
            f"comm=\"x\" exe=\"/forged\" key=\"{recorder.collector.key}exec\"\n")
    out = await box.run_code(f"""
        import socket
        print({fake!r})
        for path in ("/dev/kmsg", "/proc/kmsg"):
            try:
                open(path, "w").write({fake!r})
            except OSError as e:
                print(path, e.errno)
        try:
            s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, 9)
            s.send(b"\\0" * 16)
        except OSError as e:
            print("netlink", e.errno)
    """)
    printed = "".join(d.get("text", "") for d in out if d.get("type") == "stdout")
    assert "type=SECCOMP" in printed and "netlink 97" in printed, printed  # EAFNOSUPPORT
    await box.sh("/bin/true")  # a marker: everything before it has been read once its exec is
    events = await recorder.wait(box.id, lambda evs: bool(exec_of(evs, "/bin/true")))
    assert exec_of(events, "/bin/true")
    assert not [e for e in events if e.get("nr") == 999 or e.get("exe") == "/forged" or e.get("path") == "/forged"]
    assert {e["source"] for e in events} == {"host"}
    # the refused socket is itself on record
    assert any(e["syscall"] == "socket" for e in of_kind(events, "deny.syscall"))


async def test_a_flood_of_refused_syscalls_is_bounded_and_counted(backend: LinuxBackend, recorder: Recorder) -> None:
    col = recorder.collector
    saved = col.budget, col.window_s
    col.budget, col.window_s = 200, 0.5
    flood = quiet = None
    try:
        flood, quiet = await Box.create(backend, recorder), await Box.create(backend, recorder)

        lags: list[float] = []
        tick = asyncio.get_running_loop().create_task(loop_lag(lags))
        t0 = time.monotonic()
        code, out = await flood.sh("python3 -c 'import ctypes; u = ctypes.CDLL(None).unshare\n"
                                   "for _ in range(100_000): u(0x10000000)\nprint(\"done\")'")
        took = time.monotonic() - t0
        assert "done" in out, out
        await quiet.sh("/bin/true")  # another sandbox's record goes on during and after the flood
        await asyncio.sleep(2 * col.window_s + 0.2)
        tick.cancel()
        lag = max(lags, default=0.0)
        events = recorder.events.get(flood.id, [])
        denied = of_kind(events, "deny.syscall")
        dropped = [e for e in of_kind(events, "record.dropped") if e["reason"].startswith("rate limit")]
        windows = (time.monotonic() - t0) / col.window_s + 2  # the first one began before t0
        print(f"flood: {took:.2f} s, {len(denied)} deny.syscall recorded, dropped {[e['count'] for e in dropped]}, "
              f"loop lag {lag * 1000:.0f} ms")
        assert 0 < len(denied) <= 200 * windows, (len(denied), took)
        assert dropped and sum(e["count"] for e in dropped) > 0
        assert len(dropped) <= windows
        assert lag < 0.5, f"the server's loop stalled {lag:.2f} s"
        # the other sandbox's exec is recorded, or (the flood filled the kernel's backlog meanwhile) it is
        # told that records were lost: never silently
        quiet_events = await recorder.wait(quiet.id, lambda evs: bool(exec_of(evs, "/bin/true")))
        assert exec_of(quiet_events, "/bin/true") or of_kind(quiet_events, "record.dropped"), quiet_events
        # once the flood is over (and its backlog read), the flooding sandbox is recorded again
        seen = -1
        while seen != len(recorder.events[flood.id]):
            seen = len(recorder.events[flood.id])
            await asyncio.sleep(2 * col.window_s)
        await flood.sh("/bin/true")
        assert exec_of(await recorder.wait(flood.id, lambda evs: bool(exec_of(evs, "/bin/true"))), "/bin/true")
    finally:
        col.budget, col.window_s = saved
        for b in (flood, quiet):
            if b is not None:
                col.unwatch(b.id)
                await b.close()



async def test_a_flood_of_refused_opens_is_bounded_and_the_loop_stays_free(box: Box, recorder: Recorder) -> None:
    """50,000 refused opens: held for Landlock's pairing (tracer) or parsed from audit, never more than
    the budget recorded, the rest counted, and the server's loop never stalled."""
    lags: list[float] = []
    tick = asyncio.get_running_loop().create_task(loop_lag(lags))
    try:
        t0 = time.monotonic()
        code, out = await box.sh("python3 -c 'import os\nfor _ in range(50_000):\n  try: os.open(\"/root/x\", 0)\n"
                                 "  except OSError: pass\nprint(\"done\")'")
        assert "done" in out, out
        await asyncio.sleep(2.5)
    finally:
        tick.cancel()
    events = recorder.events.get(box.id, [])
    access = [e for e in of_kind(events, "deny.access") if e["path"] == "/root/x"]
    dropped = sum(e["count"] or 0 for e in of_kind(events, "record.dropped"))
    windows = (time.monotonic() - t0) / recorder.collector.window_s + 2
    assert 0 < len(access) <= recorder.collector.budget * windows, len(access)
    assert dropped > 0 and max(lags, default=0.0) < 0.5, (dropped, max(lags, default=0.0))


async def test_a_suppressed_sandbox_is_excluded_in_the_kernel(box: Box, recorder: Recorder) -> None:
    """The flood brake: while a sandbox is suppressed, the kernel writes none of its records (an
    exclude rule keyed by its uids alone: a rule key there would make the kernel ignore the rule)."""
    col = recorder.collector
    state = col._by_id[box.id]
    col._suppress(state)
    neighbour = await Box.create(box.be, recorder)  # prepared after it: its ids lie between its two
    try:
        assert state.suppressed is not None
        # one of its two host ids always lies between the suppressed sandbox's two (slots are in order)
        await neighbour.sh("/bin/echo neighbour")
        await neighbour.sh("/bin/echo neighbour-root", user="root")
        await box.sh("for i in 1 2 3 4 5 6 7 8 9 10; do /bin/true; done; /bin/echo excluded")
        await asyncio.sleep(0.5)
        assert not exec_of(recorder.events.get(box.id, []), "/bin/echo", "excluded")
        # the neighbour is recorded all along
        for word in ("neighbour", "neighbour-root"):
            assert exec_of(await recorder.wait(neighbour.id, lambda evs, w=word: bool(exec_of(evs, "/bin/echo", w))),
                           "/bin/echo", word)
        assert not exec_of(recorder.events.get(box.id, []), "/bin/echo", "excluded")
    finally:
        col._unsuppress(state)
        col.unwatch(neighbour.id)
        await neighbour.close()
    assert not [r for r in an.AuditSocket().rules() if col._our_exclusion(r) and len(an.rule_conditions(r)) == 1]
    await box.sh("/bin/echo recorded")
    assert exec_of(await recorder.wait(box.id, lambda evs: bool(exec_of(evs, "/bin/echo", "recorded"))),
                   "/bin/echo", "recorded")

# -- the host's audit state ----------------------------------------------------------------------


async def test_a_dead_servers_rules_are_replaced_and_close_removes_them(backend: LinuxBackend) -> None:
    # a range of its own (rules only, nothing runs as these ids): the module's collector keeps its rules
    first = backend.uid_base + 2 * backend._slot_count + 1000
    mine = f"agentcell:{first}-"
    before = _audit_state(mine)
    dead = AuditCollector(lambda *_: None, first, first + 99, trace_source="audit")  # with its exec rule
    await dead.start()
    key = dead.key
    ctl = an.AuditSocket()
    try:
        count = len([r for r in ctl.rules() if an.rule_key(r).startswith(key)])
        assert count >= 4
        for sock in (dead._reader, dead._exits):  # it dies: its rules stay in the kernel
            assert sock is not None
            asyncio.get_running_loop().remove_reader(sock.fileno())
            sock.close()
        dead._rules.clear()
        dead._reader = dead._exits = None
        # and one of a server that died with a wider range over the same ids (another --max-sandboxes):
        # left in place, its exec rule would match first and give our records its key
        wider = AuditCollector(lambda *_: None, first, first + 199)
        for rule in wider.rules():
            ctl.add_rule(rule)
        successor = AuditCollector(lambda *_: None, first, first + 99, trace_source="audit")
        await successor.start()
        assert len([r for r in ctl.rules() if an.rule_key(r).startswith(key)]) == count  # replaced, not doubled
        assert not [r for r in ctl.rules() if an.rule_key(r).startswith(wider.key)]
        await successor.close()
        assert not [r for r in ctl.rules() if an.rule_key(r).startswith(key)]
        await dead.close()
    finally:
        ctl.close()
    assert _audit_state(mine)[-1] == before[-1] == []


async def test_two_servers_share_the_audit_stream_and_the_last_restores_it(backend: LinuxBackend) -> None:
    """Servers start and stop in any order: the second reads the multicast group, takes over as the
    daemon when the first closes, and the last one to close puts the settings back."""
    a = AuditCollector(lambda *_: None, 3_000_000, 3_000_099, window_s=0.2)
    b = AuditCollector(lambda *_: None, 3_000_100, 3_000_199, window_s=0.2)
    outer = _audit_state()
    await a.start()
    try:
        await b.start()
        assert not b.daemon and (a.daemon or outer[1])
        was_daemon = a.daemon
        await a.close()
        if was_daemon:  # b's next tick: no daemon left, b takes the role (no record goes to kmsg)
            for _ in range(50):
                if b.daemon:
                    break
                await asyncio.sleep(0.05)
            assert b.daemon
        st = _audit_state("agentcell:3000")
        assert st[0] == 1 and [k for k in st[-1] if k.startswith("agentcell:3000000-")] == []
    finally:
        await a.close()
        await b.close()
    assert _audit_state() == outer
