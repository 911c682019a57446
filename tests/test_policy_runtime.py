"""The policy parts the sandbox's runtime enforces (issue 28), for real: the strict seccomp filter the
agent loads into itself, hold_exec (fork + exec instead of posix_spawn), and processes.max (the
sandbox's cgroup pids.max at run time).

Sandboxes of the real agent on a LinuxBackend; the policy is set through the server's helper
(server/agent_policy.py) on the agent's channel, as the server does. Run as root.
"""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import struct
import textwrap
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentcell.backends.base import Limits, SandboxSpec
from agentcell.backends.linux.backend import LinuxBackend, LinuxSandbox
from agentcell.backends.linux.cgroups import CgroupError
from agentcell.backends.linux.no_cgroups import NoCgroups
from agentcell.errors import InvalidArgumentError, NotFoundError, PermissionDeniedError
from agentcell.runtime.protocol import AgentChannel
from agentcell.server.agent_policy import AgentPolicy, set_agent_policy, syscalls_change_allowed

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/proc/self/ns/user"),
                                reason="the linux backend needs root and user namespaces")

# What each attempt prints: "<name> ok" or "<name> err <ERRNO name>"
PROBE = textwrap.dedent(r'''
    import ctypes, errno, os, socket, sys
    libc = ctypes.CDLL(None, use_errno=True)
    def t(name, f):
        try:
            f()
            print(name, "ok")
        except OSError as e:
            print(name, "err", errno.errorcode.get(e.errno, e.errno))
    def c(name, r):
        print(name, "ok" if r >= 0 else "err " + errno.errorcode.get(ctypes.get_errno(), "?"))
    tmp = "/tmp/probe-%d" % os.getpid()
    t("raw", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP).close())
    t("packet_type", lambda: socket.socket(socket.AF_INET, 10, 0).close())  # SOCK_PACKET
    t("ping", lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP).close())
    t("ping6", lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM, socket.IPPROTO_ICMPV6).close())
    t("unix_raw", lambda: socket.socket(socket.AF_UNIX, socket.SOCK_RAW).close())
    t("tcp", lambda: socket.socket(socket.AF_INET, socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC).close())
    t("udp6", lambda: socket.socket(socket.AF_INET6, socket.SOCK_DGRAM, socket.IPPROTO_UDP).close())
    t("seqpacket", lambda: [s.close() for s in socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)])
    c("shmget", libc.shmget(0, 4096, 0o1600))
    c("semget", libc.semget(0, 1, 0o1600))
    c("msgget", libc.msgget(0, 0o1600))
    c("personality32", libc.personality(8))
    c("vmsplice", libc.vmsplice(0, None, 0, 0))
    t("whiteout", lambda: os.mknod(tmp + "-wo", 0o600 | 0o020000, 0))  # char 0:0: anyone may make one
    t("fifo", lambda: os.mkfifo(tmp + "-fifo"))
    c("ptrace", libc.ptrace(16, 1, 0, 0))  # PTRACE_ATTACH to the agent
    status = open("/proc/self/status").read()  # (gVisor's has no Seccomp_filters line)
    print("filters", status.split("Seccomp_filters:")[1].split()[0] if "Seccomp_filters:" in status else "?")
''')
# refused by strict and not by the default filter (the kernel's own answer differs, or there is none)
STRICT_ONLY = ("ping", "ping6", "unix_raw", "shmget", "semget", "msgget", "personality32", "vmsplice", "whiteout")
# refused either way (no CAP_NET_RAW; ptrace is the default filter's): strict's errno is EPERM too
ALWAYS_REFUSED = ("raw", "packet_type", "ptrace")
STILL_ALLOWED = ("tcp", "udp6", "seqpacket", "fifo")


def parse(out: str) -> dict[str, str]:
    rows = [line.split(None, 1) for line in out.splitlines() if line.strip()]
    return {r[0]: r[1] if len(r) > 1 else "" for r in rows}


class Box:
    """A sandbox of the real agent, driven on its channel."""

    def __init__(self, backend: LinuxBackend, sandbox: LinuxSandbox, channel: AgentChannel) -> None:
        self.backend, self.sandbox, self.channel = backend, sandbox, channel

    @classmethod
    async def create(cls, backend: LinuxBackend, **limits: Any) -> Box:
        sb = await backend.create(SandboxSpec(limits=Limits(**limits)))
        assert isinstance(sb, LinuxSandbox)
        box = cls(backend, sb, await AgentChannel.open(sb.sock))
        await box.write("/tmp/probe.py", PROBE)
        return box

    async def policy(self, syscalls: str = "default", hold_exec: bool = False) -> AgentPolicy:
        return await set_agent_policy(self.channel, syscalls, hold_exec)

    async def start(self, cmd: str, *args: str, user: str | None = None, stdin: bool = False,
                    timeout_ms: int = 120_000) -> AsyncIterator[Any]:
        req = {"cmd": cmd, "args": list(args), "envs": {}, "cwd": None, "tag": None, "stdin": stdin,
               "pty": None, "timeout_ms": timeout_ms, "user": user}  # fmt: skip
        return self.channel.stream("proc.start", **req)

    async def run(self, cmd: str, *args: str, user: str | None = None) -> tuple[int, str, str]:
        out, err, end = b"", b"", {}
        async for f in await self.start(cmd, *args, user=user):
            f.raise_for_error()
            if f.header.get("event") == "stdout":
                out += f.payload
            elif f.header.get("event") == "stderr":
                err += f.payload
            elif f.header.get("event") == "end":
                end = f.header
        return int(end.get("exit_code", -1)), out.decode(errors="replace"), err.decode(errors="replace")

    async def sh(self, cmd: str, user: str | None = None) -> tuple[int, str, str]:
        return await self.run("/bin/bash", "-c", cmd, user=user)

    async def probe(self, user: str | None = None) -> dict[str, str]:
        code, out, err = await self.run("python3", "/tmp/probe.py", user=user)
        assert code == 0, err
        return parse(out)

    async def code(self, src: str, context_id: str | None = None) -> str:
        text = ""
        fields = {"context_id": context_id} if context_id else {}
        async for f in self.channel.stream("code.run", src.encode(), **fields):
            if f.payload:
                import json

                line = json.loads(f.payload)
                if line.get("type") in ("stdout", "stderr"):
                    text += line["text"]
                elif line.get("type") == "error":
                    text += f"{line['name']}: {line['value']}\n"
        return text

    async def write(self, path: str, text: str) -> None:
        await self.channel.call("fs.write", text.encode(), path=path)

    async def close(self) -> None:
        await self.channel.close()
        await self.backend.kill(self.sandbox)


@pytest.fixture(scope="module")
async def backend() -> AsyncIterator[LinuxBackend]:
    be = LinuxBackend(max_sandboxes=20, standbys=0, preload=False, ready_timeout=90)
    await be.start()
    try:
        yield be
    finally:
        await be.close()


@pytest.fixture
async def box(backend: LinuxBackend) -> AsyncIterator[Box]:
    b = await Box.create(backend)
    yield b
    await b.close()


def assert_strict(seen: dict[str, str]) -> None:
    for name in (*STRICT_ONLY, *ALWAYS_REFUSED):
        assert seen[name] == "err EPERM", (name, seen)
    for name in STILL_ALLOWED:
        assert seen[name] == "ok", (name, seen)


# -- syscalls: strict ---------------------------------------------------------------------------------
async def test_strict_refuses_for_everything_started_afterwards(box: Box) -> None:
    before = await box.probe()
    for name in (*STRICT_ONLY, *STILL_ALLOWED):  # what the default filter and the kernel allow
        assert before[name] == "ok" or name in ("ping", "ping6") and before[name] == "err EACCES", (name, before)
    assert before["filters"] == "2"
    applied = await box.policy("strict")
    assert applied == AgentPolicy("strict", False, ())
    after = await box.probe()
    assert_strict(after)
    assert after["filters"] == "3"
    assert_strict(await box.probe(user="root"))  # fork + become_root: the agent's filter, inherited
    code, out, err = await box.sh("sudo python3 /tmp/probe.py")  # the sudo service: also the agent's
    assert code == 0, err
    assert_strict(parse(out))
    # shell tools: the command's own error
    code, out, err = await box.sh("mknod /tmp/dev c 0 0; ipcmk -M 4096; echo done")
    assert "Operation not permitted" in err and out.strip().endswith("done"), (out, err)


async def test_strict_keeps_ordinary_tools_working(box: Box) -> None:
    await box.policy("strict")
    script = textwrap.dedent("""
        set -e
        python3 -c 'import json, sqlite3, ssl, multiprocessing as m; print(m.Pool(2).map(abs, [-1, -2]))'
        python3 -m pip --version
        python3 -m pip list --disable-pip-version-check --no-index >/dev/null
        cd /tmp && rm -rf repo && mkdir repo && cd repo
        git init -q . && git -c user.email=a@b -c user.name=a commit -q --allow-empty -m first
        echo x > f && git add f && git -c user.email=a@b -c user.name=a commit -q -m second
        git log --oneline | wc -l
        printf '#include <stdio.h>\\nint main(void){puts("compiled");return 0;}\\n' > /tmp/c.c
        gcc -O1 -o /tmp/c /tmp/c.c && /tmp/c
        node -e 'const net=require("net"); const s=net.createServer().listen(0,()=>{console.log("node ok");s.close()})'
        python3 -c 'import socket; s=socket.create_server(("127.0.0.1",0)); c=socket.create_connection(s.getsockname()); print("tcp ok")'
    """)
    code, out, err = await box.sh(script)
    assert code == 0, (out, err)
    lines = out.split()
    assert "[1," in out and "pip" in out and "compiled" in lines and "node" in out and "tcp" in lines, out
    assert "2" in lines  # two commits
    assert "python" in await box.code("import numpy, subprocess\nprint(subprocess.run(['python3', '-c', 'print(\"python\")'], capture_output=True, text=True).stdout)")


async def test_contexts_under_strict(box: Box) -> None:
    """The default context (warmed before the claim, never ran code) takes the filter; a context that
    ran code keeps the old one and is named in the answer; contexts made afterwards are strict."""
    shm = "import ctypes; print('shmget', ctypes.CDLL(None).shmget(0, 4096, 0o1600) >= 0)"
    ran = (await box.channel.call("code.context_create", language="python")).header["context"]["id"]
    assert "shmget True" in await box.code(shm, ran)
    applied = await box.policy("strict")
    assert applied.contexts_kept == (ran,)
    assert "shmget False" in await box.code(shm)  # the default context
    assert "shmget True" in await box.code(shm, ran)  # kept its filter (documented)
    new = (await box.channel.call("code.context_create", language="python")).header["context"]["id"]
    assert "shmget False" in await box.code(shm, new)
    if shutil.which("node"):
        js = (await box.channel.call("code.context_create", language="javascript")).header["context"]["id"]
        out = await box.code("console.log(require('fs').readFileSync('/proc/self/status','utf8').match(/Seccomp_filters:\\s+(\\d+)/)[1])", js)
        assert out.strip() == "3", out
    await box.channel.call("code.context_restart", context_id=ran)
    assert "shmget False" in await box.code(shm, ran)  # restarted: a fork of the agent's


async def test_process_started_before_keeps_its_filter(box: Box) -> None:
    waiter = "import sys, ctypes; sys.stdin.readline(); print('shmget', ctypes.CDLL(None).shmget(0, 4096, 0o1600) >= 0, flush=True)"
    stream = await box.start("python3", "-c", waiter, stdin=True)
    first = await anext(stream)
    pid = first.header["pid"]
    await box.policy("strict")
    await box.channel.call("proc.input", b"go\n", pid=pid)
    out = b""
    async for f in stream:
        out += f.payload if f.header.get("event") == "stdout" else b""
    assert b"shmget True" in out  # started before: the old filter
    assert_strict(await box.probe())


async def test_strict_cannot_be_lifted(box: Box) -> None:
    assert syscalls_change_allowed("default", "strict") and syscalls_change_allowed("strict", "strict")
    assert not syscalls_change_allowed("strict", "default")
    await box.policy("strict")
    with pytest.raises(InvalidArgumentError, match="cannot go back"):
        await box.policy("default")
    with pytest.raises(InvalidArgumentError):
        await set_agent_policy(box.channel, "lenient", False)
    assert (await box.policy("strict", hold_exec=True)) == AgentPolicy("strict", True, ())  # idempotent
    seen = await box.probe()
    assert seen["filters"] == "3"  # loaded once
    assert_strict(seen)


# -- hold_exec ----------------------------------------------------------------------------------------
FAN_CLOEXEC, FAN_CLASS_CONTENT, FAN_MARK_ADD, FAN_OPEN_EXEC_PERM, FAN_ALLOW = 0x1, 0x4, 0x1, 0x40000, 0x1
AT_FDCWD = -100
_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_mark.argtypes = [ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p]


class ExecHold:
    """A host-side fanotify group holding every exec of one file (FAN_OPEN_EXEC_PERM), as the server's
    exec "ask" does, until release()."""

    def __init__(self, path: str) -> None:
        self.fd = _libc.fanotify_init(FAN_CLOEXEC | FAN_CLASS_CONTENT, os.O_RDONLY | os.O_CLOEXEC)
        assert self.fd >= 0, os.strerror(ctypes.get_errno())
        assert _libc.fanotify_mark(self.fd, FAN_MARK_ADD, FAN_OPEN_EXEC_PERM, AT_FDCWD, path.encode()) == 0, \
            os.strerror(ctypes.get_errno())

    async def held(self, timeout: float = 10) -> int:
        """Until an exec is held: the event's fd."""
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        loop.add_reader(self.fd, lambda: ready.done() or ready.set_result(None))
        try:
            await asyncio.wait_for(ready, timeout)
        finally:
            loop.remove_reader(self.fd)
        data = os.read(self.fd, 4096)
        _len, _vers, _res, _meta, mask, fd, _pid = struct.unpack_from("IBBHQii", data)
        assert mask & FAN_OPEN_EXEC_PERM
        return fd

    def release(self, fd: int) -> None:
        os.write(self.fd, struct.pack("iI", fd, FAN_ALLOW))
        os.close(fd)

    def close(self) -> None:
        os.close(self.fd)


async def _held_command(box: Box, hold_exec: bool) -> float:
    """Start a copy of /bin/echo directly (no shell) while its exec is held; the agent's answer time to
    a ping meanwhile. The command then runs once released."""
    await box.sh("cp /bin/echo /tmp/held-echo")
    hold = ExecHold(f"/proc/{box.sandbox.host_pid}/root/tmp/held-echo")
    try:
        stream = await box.start("/tmp/held-echo", "released")
        # the first frame (start) comes only once the agent's spawn call returns: read it concurrently
        first = asyncio.ensure_future(anext(stream))
        event_fd = await hold.held()
        t0 = time.monotonic()
        try:
            await asyncio.wait_for(box.channel.call("ping"), 3)
            answered = time.monotonic() - t0
        except TimeoutError:
            answered = float("inf")
        hold.release(event_fd)
        assert (await first).header.get("event") == "start"
        out = b"".join([f.payload async for f in stream if f.header.get("event") == "stdout"])
        assert out == b"released\n"
        return answered
    finally:
        hold.close()


async def test_hold_exec_keeps_the_agent_answering(box: Box) -> None:
    # without it, posix_spawn's vfork keeps the agent waiting for the held exec: no answer
    assert await _held_command(box, hold_exec=False) == float("inf")
    await box.policy(hold_exec=True)
    assert await _held_command(box, hold_exec=True) < 1.0
    # the fork path: the same process setup as posix_spawn's
    code, out, _ = await box.sh("echo $$ $(ps -o sid= -p $$) ; grep -E '^(CapPrm|CapEff|NoNewPrivs)' /proc/$$/status")
    pid, sid = out.split()[:2]
    assert pid == sid  # a session of its own
    assert out.count("0000000000000000") == 2 and "NoNewPrivs:\t1" in out
    code, out, _ = await box.sh("id -u", user="root")
    assert (code, out.strip()) == (0, "0")
    pty = b""  # a pty's slave, opened after setsid: the controlling terminal, as with posix_spawn
    async for f in box.channel.stream("proc.start", cmd="/bin/bash", args=["-c", "tty; ps -o tty= -p $$"], envs={},
                                      cwd=None, tag=None, stdin=False, pty={"cols": 80, "rows": 24}, timeout_ms=10_000,
                                      user=None):  # fmt: skip
        pty += f.payload if f.header.get("event") == "pty" else b""
    tty, ctty = pty.decode().split()
    assert tty.startswith("/dev/pts/") and tty.endswith(ctty), pty


async def test_hold_exec_errors(box: Box) -> None:
    await box.policy(hold_exec=True)
    with pytest.raises(NotFoundError):
        await box.run("/tmp/no-such-program")
    await box.sh("echo 'not a program' > /tmp/bad && chmod 644 /tmp/bad && cp /tmp/bad /tmp/badx && chmod 755 /tmp/badx")
    with pytest.raises(PermissionDeniedError):
        await box.run("/tmp/bad")
    code, _, err = await box.run("/tmp/badx")  # the exec itself fails, after the fork: as a shell says it
    assert code == 126 and "cannot execute /tmp/badx: Exec format error" in err, (code, err)


# -- processes.max ------------------------------------------------------------------------------------
FORK_BOMB = textwrap.dedent("""
    import os, signal, time
    kids = []
    while len(kids) < 200:
        try:
            pid = os.fork()
        except BlockingIOError:
            break
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        kids.append(pid)
    print(len(kids))
    for k in kids:
        os.kill(k, signal.SIGKILL)
    for k in kids:
        os.waitpid(k, 0)
""")


async def test_processes_max(backend: LinuxBackend) -> None:
    box = await Box.create(backend, pids=64)
    try:
        await box.write("/tmp/bomb.py", FORK_BOMB)
        code, out, err = await box.run("python3", "/tmp/bomb.py")
        unlimited = int(out)
        assert 40 < unlimited < 64, (out, err)  # the sandbox's own limit, less what runs already
        await backend.set_pids_max(box.sandbox, 16)
        assert box.sandbox.cgroups.pids_max() == 16
        code, out, err = await box.run("python3", "/tmp/bomb.py")
        assert 0 < int(out) < 16, (out, err)
        await backend.set_pids_max(box.sandbox, 40)
        code, out, err = await box.run("python3", "/tmp/bomb.py")
        assert 16 < int(out) < 40, (out, err)
        for above in (65, 10_000):
            with pytest.raises(InvalidArgumentError, match="pids limit 64"):
                await backend.set_pids_max(box.sandbox, above)
        with pytest.raises(InvalidArgumentError):
            await backend.set_pids_max(box.sandbox, 2)
        assert box.sandbox.cgroups.pids_max() == 40  # a refused value changes nothing
        await backend.set_pids_max(box.sandbox, 64)  # back to the sandbox's own limit
        assert box.sandbox.cgroups.pids_max() == 64
    finally:
        await box.close()


@pytest.mark.skipif(shutil.which("runsc") is None, reason="the gvisor backend needs runsc")
async def test_gvisor() -> None:
    """The guest's seccomp (the sentry's) takes the strict filter, TSYNC and all; processes.max cannot
    be enforced there and says so."""
    from agentcell.backends.gvisor.backend import GvisorBackend

    be = GvisorBackend(max_sandboxes=2, standbys=0)
    await be.start()
    try:
        sb = await be.create(SandboxSpec())
        box = Box(be, sb, await AgentChannel.open(sb.sock))  # type: ignore[arg-type]
        await box.write("/tmp/probe.py", PROBE)
        before = await box.probe()
        assert before["ping"] == "ok" and before["shmget"] == "ok"  # gVisor lets anyone make ping sockets
        await box.policy("strict", hold_exec=True)
        for seen in (await box.probe(), await box.probe(user="root")):
            for name in ("ping", "ping6", "unix_raw", "shmget", "semget", "msgget", "personality32", "vmsplice",
                         "raw", "packet_type", "ptrace", "whiteout"):
                assert seen[name] == "err EPERM", (name, seen)
            for name in STILL_ALLOWED:
                assert seen[name] == "ok", (name, seen)
        code, out, err = await box.sh("python3 -m pip --version && git --version && echo fine")
        assert code == 0 and "fine" in out, (out, err)
        with pytest.raises(NotImplementedError, match="RLIMIT_NPROC"):
            await be.set_pids_max(sb, 16)
        await box.close()
    finally:
        await be.close()


async def test_processes_max_without_a_pids_cgroup_is_refused() -> None:
    """Rootless without cgroups: the RLIMIT_NPROC a sandbox started with cannot change; the backend
    says so (NotImplementedError, from its cgroups' EOPNOTSUPP) instead of doing less."""
    with pytest.raises(CgroupError, match="cannot change at run time"):
        NoCgroups.named("agentcell/x/y").set_pids_max(16)
