"""The linux backend, for real: sandboxes forked by the zygote, driven through the probe agent.

Every assertion is about what the kernel lets code inside the sandbox do. Run as root on Linux.
"""

from __future__ import annotations

import os
import platform
import shutil
import socket
import textwrap
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from helpers import PROBE, ProbeBox, probe_backend

from agentcell.backends.base import SandboxSpec
from agentcell.backends.linux.backend import LinuxBackend
from agentcell.backends.linux.cgroups import Cgroups

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/proc/self/ns/user"),
                                reason="the linux backend needs root and user namespaces")

UID_BASE = 1 << 20  # the lowest host id any backend reserves (uids.AUTO_START); ranges are picked free


class Box(ProbeBox):
    async def py(self, code: str, timeout: float = 20) -> tuple[int, str, str]:
        return await self.run("python3", "-c", textwrap.dedent(code), timeout=timeout)


@pytest.fixture(scope="module")
async def backend() -> AsyncIterator[LinuxBackend]:
    async with probe_backend() as be:
        yield be


async def new_box(backend: LinuxBackend, **limits: int | float) -> Box:
    t0 = time.perf_counter()
    b = await Box.create(backend, **limits)
    print(f"create({b.sandbox.sandbox_id}) took {(time.perf_counter() - t0) * 1000:.1f} ms")
    return b


@pytest.fixture(scope="module")
async def box(backend: LinuxBackend) -> AsyncIterator[Box]:
    b = await new_box(backend)
    yield b
    await b.channel.close()
    await backend.kill(b.sandbox)


async def test_create_is_fast(backend: LinuxBackend) -> None:
    times = []
    boxes = []
    for _ in range(5):
        b = await new_box(backend)
        times.append(backend.last_create_ms)
        boxes.append(b)
    print("create() ms:", " ".join(f"{t:.1f}" for t in times))
    for b in boxes:
        assert (await b.run("true"))[0] == 0
        await backend.kill(b.sandbox)
    assert min(times) < 200


async def test_create_timing_with_agent_preload() -> None:
    """The zygote preloads the real agent's imports (numpy, pandas, IPython): forks get bigger."""
    be = LinuxBackend(entry_point=PROBE, max_sandboxes=1000, preload=True)
    t0 = time.perf_counter()
    await be.start()
    print(f"preloaded zygote ready in {(time.perf_counter() - t0) * 1000:.0f} ms")
    try:
        times = []
        for _ in range(4):
            sb = await be.create(SandboxSpec("p" + uuid.uuid4().hex[:12]))
            times.append(be.last_create_ms)
            with open(f"/proc/{sb.host_pid}/smaps_rollup") as f:
                private = next(line for line in f if line.startswith("Private_Dirty"))
        print("create() ms with preload:", " ".join(f"{t:.1f}" for t in times), "| pid 1", private.strip())
        assert min(times) < 500
    finally:
        await be.close()


async def test_identity(box: Box) -> None:
    assert (await box.run("id", "-u"))[1].strip() == "1000"
    assert (await box.run("id", "-un"))[1].strip() == "user"
    assert (await box.run("hostname"))[1].strip() == box.sandbox.sandbox_id
    # two ids mapped, each to a host id of the sandbox's own, never host root
    rows = [line.split() for line in (await box.run("cat", "/proc/self/uid_map"))[1].splitlines()]
    assert [(r[0], r[2]) for r in rows] == [("0", "1"), ("1000", "1")], rows
    assert rows[0][1] != rows[1][1] and min(int(rows[0][1]), int(rows[1][1])) >= UID_BASE
    code, out, _ = await box.run("sh", "-c", "echo $HOME; pwd")
    assert out.split() == ["/home/user", "/home/user"]


async def test_only_sandbox_pids_visible(box: Box) -> None:
    _, out, _ = await box.run("ls", "/proc")
    pids = sorted(int(p) for p in out.split() if p.isdigit())
    assert pids[0] == 1 and len(pids) <= 3, pids  # the probe, ls (and maybe a just-finished child)
    _, out, _ = await box.run("ps", "-e", "-o", "pid=")
    assert max(int(p) for p in out.split()) < 100
    status = (await box.run("cat", "/proc/self/status"))[1]
    fields = dict(line.split(":\t", 1) for line in status.splitlines() if ":\t" in line)
    assert fields["CapEff"].strip("0\t ") == "" and fields["CapPrm"].strip("0\t ") == ""
    from agentcell.backends.linux.sandbox_init import ROOT_CAPS_MASK

    assert int(fields["CapBnd"], 16) == ROOT_CAPS_MASK  # what the sandbox's root may hold, at most
    assert fields["NoNewPrivs"].strip() == "1" and fields["Seccomp"].strip() == "2"


async def test_host_files_hidden(box: Box) -> None:
    token = uuid.uuid4().hex
    dirs = [f"/agentcell-test-{token}", f"/root/agentcell-test-{token}"]
    try:
        for d in dirs:
            os.makedirs(d)
            with open(f"{d}/secret", "w") as f:
                f.write(token)
        for d in dirs:
            code, out, _ = await box.run("cat", f"{d}/secret")
            assert code != 0 and token not in out
        # /root is the sandbox's root's own, empty home (the runtime is at neutral paths, not under /root)
        assert (await box.run("ls", "-A", "/root"))[0] != 0  # 0700, and the default user is not root
        for secret in ("/etc/shadow", "/etc/gshadow", "/etc/sudoers", "/etc/ssh", "/sys/kernel"):
            assert (await box.run("test", "-e", secret))[0] != 0, secret
        code, out, _ = await box.run("cat", "/etc/passwd")
        assert "user:x:1000:1000:user:/home/user:/bin/bash" in out and out.count("\n") == 3
    finally:
        for d in dirs:
            shutil.rmtree(d, ignore_errors=True)


async def test_write_places(box: Box) -> None:
    for path in ("/usr/agentcell-x", "/etc/agentcell-x", "/agentcell-x", "/dev/agentcell-x", "/var/x"):
        code, _, err = await box.run("sh", "-c", f"echo hi > {path}")
        assert code != 0, path
    # Names no checkout is likely to have: a Python tree under /tmp (a CI clone, say) is bound back
    # into the sandbox's /tmp at its own path.
    for path in ("/home/user/agentcell-w", "/tmp/agentcell-w", "/dev/shm/agentcell-w"):
        code, out, err = await box.run("sh", "-c", f"echo hi > {path} && cat {path}")
        assert (code, out) == (0, "hi\n"), (path, err)
    config = (await box.channel.call("config")).header["config"]
    from agentcell.backends.linux import landlock

    assert config["landlock_abi"] == landlock.abi_version()


async def test_disk_cap(backend: LinuxBackend) -> None:
    b = await new_box(backend, disk_mb=8)
    try:
        for d in ("/tmp", "/home/user"):
            code, _, err = await b.run("dd", "if=/dev/zero", f"of={d}/big", "bs=1M", "count=20")
            assert code != 0 and "No space left" in err, err
        assert (await b.run("sh", "-c", "rm /tmp/big && echo ok > /tmp/small && cat /tmp/small"))[1] == "ok\n"
    finally:
        await backend.kill(b.sandbox)


async def test_memory_limit(backend: LinuxBackend) -> None:
    b = await new_box(backend, memory_mb=64)
    try:
        stats = await backend.stats(b.sandbox)
        assert stats.memory_limit_bytes == 64 << 20 and stats.pids >= 1
        code, out, _ = await b.py("b = bytearray(300 << 20); print('survived')")
        assert code == -9 and "survived" not in out  # the OOM killer took the hog ...
        assert (await b.run("echo", "alive"))[1] == "alive\n"  # ... not the agent
    finally:
        await backend.kill(b.sandbox)


async def test_fork_bomb_contained(backend: LinuxBackend) -> None:
    b = await new_box(backend, pids=32)
    try:
        code, out, err = await b.py("""
            import os, signal, time
            kids = []
            try:
                for _ in range(200):
                    pid = os.fork()
                    if pid == 0:
                        time.sleep(30); os._exit(0)
                    kids.append(pid)
            except OSError as e:
                print("stopped", len(kids), e.errno)
            for k in kids:
                os.kill(k, signal.SIGKILL); os.waitpid(k, 0)
        """)
        assert out.startswith("stopped"), (out, err)
        assert int(out.split()[1]) < 32
        assert (await b.run("echo", "alive"))[1] == "alive\n"
    finally:
        await backend.kill(b.sandbox)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="raw x86_64 syscall numbers")
async def test_privileged_operations_denied(box: Box) -> None:
    assert (await box.run("unshare", "-r", "true"))[0] != 0
    assert (await box.run("unshare", "-U", "true"))[0] != 0
    await box.run("mkdir", "-p", "/tmp/mnt")
    assert (await box.run("mount", "-t", "tmpfs", "x", "/tmp/mnt"))[0] != 0
    code, out, err = await box.py("""
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.unshare(0x10000000), ctypes.get_errno())          # CLONE_NEWUSER
        print(libc.syscall(101, 0, 0, 0, 0), ctypes.get_errno())      # ptrace(PTRACE_TRACEME)
        print(libc.syscall(165, b"x", b"/tmp", b"tmpfs", 0, 0), ctypes.get_errno())  # mount
        print(libc.syscall(161, b"/tmp"), ctypes.get_errno())          # chroot
        print(libc.syscall(56, 0x10000000 | 17, 0, 0, 0, 0), ctypes.get_errno())  # clone(NEWUSER)
        print(libc.syscall(435, 0, 0), ctypes.get_errno())             # clone3
        print(libc.syscall(425, 8, 0), ctypes.get_errno())             # io_uring_setup
    """)
    rows = [line.split() for line in out.splitlines()]
    assert rows == [["-1", "1"]] * 5 + [["-1", "38"], ["-1", "1"]], (out, err)
    # a pty still works after all that (devpts + Landlock ioctl rights)
    code, out, err = await box.py("import os, pty; m, s = pty.openpty(); print(os.ttyname(s))")
    assert code == 0 and out.startswith("/dev/pts/"), err


async def test_setuid_gives_nothing(box: Box) -> None:
    assert os.stat("/usr/bin/su").st_mode & 0o4000  # really a setuid binary on the host
    code, out, err = await box.run("su", "root", "-c", "id -u")
    assert code != 0 and "0" not in out.split()
    code, out, _ = await box.run("sh", "-c", "cat /proc/self/status | grep -E '^(Uid|CapEff)'")
    assert "0000000000000000" in out and "\t0\t" not in out


async def test_network_isolated(box: Box) -> None:
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        code, out, err = await box.py(f"""
            import socket
            try:
                socket.create_connection(("127.0.0.1", {port}), timeout=2)
                print("connected")
            except OSError as e:
                print("refused", e.errno)
            s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
            c = socket.create_connection(s.getsockname(), timeout=2)
            a, _ = s.accept(); c.sendall(b"ping"); print(a.recv(4).decode())
        """)
    assert out.split("\n")[0].startswith("refused"), (out, err)
    assert out.split("\n")[1] == "ping", (out, err)
    _, out, _ = await box.run("cat", "/proc/net/dev")
    assert "eth" not in out


async def test_kill_neighbour_idempotent(backend: LinuxBackend) -> None:
    a = await new_box(backend)
    b = await new_box(backend)
    assert a.sandbox.host_pid != b.sandbox.host_pid
    await a.run("sh", "-c", "(sleep 60 & sleep 60 &) >/dev/null 2>&1; echo started")
    assert a.sandbox.alive() and (await backend.stats(a.sandbox)).pids >= 3  # probe + 2 sleeps
    cg = a.sandbox.cgroups
    assert cg.exists()
    t0 = time.perf_counter()
    await backend.kill(a.sandbox)
    print(f"kill took {(time.perf_counter() - t0) * 1000:.1f} ms")
    assert not a.sandbox.alive() and not cg.exists()
    await backend.kill(a.sandbox)  # idempotent
    assert not _is_ours(a.sandbox.host_pid)  # gone, or at most a zombie the zygote has yet to reap
    assert (await b.run("echo", "still here"))[1] == "still here\n"
    assert (await b.run("hostname"))[1].strip() == b.sandbox.sandbox_id
    await backend.kill(b.sandbox)
    assert not b.sandbox.cgroups.exists()


def _is_ours(pid: int) -> bool:
    """The pid may already be reused by another process; only check it if it is still a sandbox's."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = dict(line.split(":", 1) for line in f if ":" in line)
        return not status["State"].strip().startswith("Z") and int(status["Uid"].split()[0]) >= UID_BASE
    except OSError:
        return False


_ORPHAN_SCRIPT = """
import asyncio, json, sys, time
from agentcell.backends.base import SandboxSpec
from agentcell.backends.linux.backend import LinuxBackend

async def main():
    be = LinuxBackend(entry_point=%r, max_sandboxes=1000)
    await be.start()
    sb = await be.create(SandboxSpec("orphan1"))
    if sys.argv[1:] == ["paused"]:
        await be.pause(sb)
    print(json.dumps({"pid": sb.host_pid, "cgroup": sb.cgroups.sandbox_id, "dirs": list(sb.cgroups.dirs.values()),
                      "instance": be.cgroup_parent}), flush=True)
    await asyncio.sleep(60)

asyncio.run(main())
"""


def _server_killed_with_its_sandbox(*args: str) -> tuple[dict, int]:
    """_ORPHAN_SCRIPT's server run (with `args`), its sandbox made, then the server SIGKILLed: what it
    printed of the sandbox, and a pidfd of the sandbox taken while the server lived."""
    import json
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT % (PROBE,), *args],
                            stdout=subprocess.PIPE, cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        assert proc.stdout is not None
        info = json.loads(proc.stdout.readline())
        pidfd = os.pidfd_open(info["pid"])
        if args == ("paused",):
            assert Cgroups.at(info["cgroup"]).frozen()
        else:
            assert all(os.path.isdir(d) for d in info["dirs"])
    finally:
        proc.kill()
        proc.wait()
    return info, pidfd


def _dies(pidfd: int, within: float) -> bool:
    import select

    try:
        return bool(select.select([pidfd], [], [], within)[0])
    finally:
        os.close(pidfd)


async def test_a_paused_sandbox_dies_with_the_server_too() -> None:
    """A frozen sandbox notices nothing of its server's death (no socket EOF, no pidfd wakes a frozen
    task): the server's watchdog kills it and removes its cgroups at once, not the next server's start
    (before it, a paused sandbox of a SIGKILLed server held its memory until then: found by chaos.py)."""
    info, pidfd = _server_killed_with_its_sandbox("paused")
    assert _dies(pidfd, 10.0), "the paused sandbox outlived its server"
    deadline = time.monotonic() + 10
    while any(os.path.exists(d) for d in info["dirs"]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(os.path.exists(d) for d in info["dirs"])


async def test_sandboxes_die_with_the_server() -> None:
    """A server that is SIGKILLed takes its zygote and every sandbox along; the next start cleans up."""
    info, pidfd = _server_killed_with_its_sandbox()
    assert _dies(pidfd, 5.0), "the sandbox outlived its server"
    be = LinuxBackend(entry_point=PROBE, max_sandboxes=1000)
    await be.start()  # finds the dead server's instance and removes it
    try:
        assert not any(os.path.exists(d) for d in info["dirs"])
        assert not any(os.path.exists(os.path.dirname(d)) for d in info["dirs"])
    finally:
        await be.close()
    assert not Cgroups.at(be.cgroup_parent).exists()  # close() removes its own instance too


def test_alive_works_for_pidfds_past_fd_setsize() -> None:
    """A server with 1,000 sandboxes holds more than 1,024 fds: select() would fail on their pidfds."""
    import resource
    import subprocess as sp

    from agentcell.backends.linux.backend import LinuxSandbox

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < 2000:
        pytest.skip("needs an fd limit above 2,000")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2000), hard))
    proc = sp.Popen(["sleep", "30"])
    fd = os.pidfd_open(proc.pid)
    high = os.dup2(fd, 1500)
    os.close(fd)
    try:
        sbx = object.__new__(LinuxSandbox)
        sbx.killed, sbx.pidfd = False, high
        assert sbx.alive()
        proc.kill()
        proc.wait()
        assert not sbx.alive()
    finally:
        os.close(high)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
