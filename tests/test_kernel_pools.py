"""Host-wide kernel pools and kernel attack surface, attacked from real sandboxes.

Every test runs hostile code in a sandbox and asserts what the kernel let it do, and where a pool is
shared, that a neighbour still gets its share. Most use the backend with the probe agent (fast); the
disk tests use the real server through the SDK, because "the sandbox lives" means its agent answers.
Run as root on Linux (x86_64 for the raw syscall numbers).
"""

from __future__ import annotations

import asyncio
import os
import platform
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator

import pytest
from helpers import ProbeBox, probe_backend, sh

from agentcell import Sandbox
from agentcell.backends.base import Limits, SandboxSpec
from agentcell.backends.linux import cgroups, host, ns_limits, rootfs
from agentcell.backends.linux.backend import LinuxBackend

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or platform.machine() != "x86_64",
                                reason="needs root, user namespaces and x86_64 syscall numbers")



class Box(ProbeBox):
    async def py(self, code: str, prelude: str = "", timeout: float = 60) -> str:
        """Run Python in the sandbox; its stdout (the test fails on a traceback)."""
        code_, out, err = await self.run("python3", "-c", prelude + textwrap.dedent(code), timeout=timeout)
        assert code_ == 0, (out, err)
        return out

    async def background(self, code: str, out: str) -> None:
        """Start Python that keeps running (holding what it took); it writes its report to `out`."""
        await self.run("sh", "-c", f"python3 -c '{textwrap.dedent(code)}' > {out} 2>&1 &")

    async def wait_file(self, path: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while True:
            code, text, _ = await self.run("cat", path)
            if code == 0 and text.strip():
                return text
            assert time.monotonic() < deadline, f"{path} stayed empty"
            await asyncio.sleep(0.2)

    def memcg(self, name: str) -> int:
        return int(open(f"{self.sandbox.cgroups.dirs['memory']}/{name}").read())


@pytest.fixture(scope="module")
async def backend() -> AsyncIterator[LinuxBackend]:
    async with probe_backend() as be:
        yield be


async def new_box(backend: LinuxBackend, **limits: int) -> Box:
    return await Box.create(backend, "k", **limits)


@pytest.fixture(scope="module")
async def neighbour(backend: LinuxBackend) -> AsyncIterator[Box]:
    b = await new_box(backend)
    yield b
    await backend.kill(b.sandbox)


@pytest.fixture
async def attacker(backend: LinuxBackend, neighbour: Box) -> AsyncIterator[Box]:
    b = await new_box(backend, memory_mb=256, open_files=8192)
    yield b
    await backend.kill(b.sandbox)
    assert (await neighbour.run("echo", "fine"))[1] == "fine\n"


# --- socket families and protocols --------------------------------------------------------------

_SYSCALLS = """
import ctypes, errno, os
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
def call(nr, *args):
    r = libc.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
    return r, errno.errorcode.get(ctypes.get_errno(), "?") if r < 0 else "ok"
def sock(family, type_, proto=0):
    r, e = call(41, family, type_, proto)  # the raw syscall: all 64 bits reach the filter
    if r >= 0:
        os.close(r)
    return e
def pair(family):
    sv = (ctypes.c_int * 2)()
    r = libc.syscall(ctypes.c_long(53), ctypes.c_long(family), ctypes.c_long(1), ctypes.c_long(0), sv)
    if r == 0:
        os.close(sv[0]); os.close(sv[1])
        return "ok"
    return errno.errorcode[ctypes.get_errno()]
"""

_INT80_SOCKETCALL = """
    import ctypes
    libc = ctypes.CDLL(None)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    page = libc.mmap(None, 4096, 7, 0x22 | 0x40, -1, 0)  # rwx, private anonymous, MAP_32BIT
    args = page + 256
    ctypes.memmove(args, (ctypes.c_uint32 * 3)(40, 1, 0), 12)  # socket(AF_VSOCK, SOCK_STREAM, 0)
    le = lambda v: v.to_bytes(4, "little")
    code = (b"\\x53" + b"\\xb8" + le(102) + b"\\xbb" + le(1) + b"\\xb9" + le(args)  # push rbx; eax, ebx, ecx
            + b"\\xcd\\x80" + b"\\x5b\\xc3")  # int 0x80; pop rbx; ret
    ctypes.memmove(page, code, len(code))
    print("socketcall returned", ctypes.CFUNCTYPE(ctypes.c_int)(page)(), flush=True)
"""

AF_VSOCK, AF_PACKET, AF_NETLINK, AF_ALG, AF_BLUETOOTH, AF_XDP = 40, 17, 16, 38, 31, 44
_OTHER_FAMILIES = [0, 3, 4, 5, 9, 11, 15, 21, 29, 30, 32, 33, 43, 45, 46, 255, 1 << 31]
_HIGH_BITS = [(1 << 32) | AF_VSOCK, (1 << 32) | 2, -(1 << 32) | AF_VSOCK, -1]


async def test_only_unix_and_inet_sockets(attacker: Box) -> None:
    families = [AF_VSOCK, AF_PACKET, AF_NETLINK, AF_ALG, AF_BLUETOOTH, AF_XDP, *_OTHER_FAMILIES, *_HIGH_BITS]
    out = await attacker.py(prelude=_SYSCALLS, code=f"""
        print([sock(f, 2) for f in {families}])
        print([sock(AF, 1) for AF in (1, 2, 10)], sock(1, 2), sock(2, 2), sock(10, 2))
        print([pair(f) for f in (2, 10, {AF_VSOCK}, {AF_NETLINK}, (1 << 32) | 1)], pair(1))
        import socket
        print(socket.getaddrinfo("localhost", 80, type=socket.SOCK_STREAM)[0][4][1])
    """)
    refused, allowed, pairs, gai = out.splitlines()
    # VSOCK reaches the VM host whatever the netns; netlink buffers escape the memory cgroup on v1
    assert eval(refused) == ["EAFNOSUPPORT"] * len(families), refused
    assert allowed == "['ok', 'ok', 'ok'] ok ok ok", allowed
    assert pairs == "['EAFNOSUPPORT', 'EAFNOSUPPORT', 'EAFNOSUPPORT', 'EAFNOSUPPORT', 'EAFNOSUPPORT'] ok", pairs
    assert gai == "80"  # glibc resolves without netlink
    # int 0x80 is the i386 ABI, where socket() is socketcall(): a foreign architecture to the filter
    rc, out, err = await attacker.run("python3", "-c", textwrap.dedent(_INT80_SOCKETCALL))
    assert rc == -31 and "returned" not in out, (rc, out, err)  # SIGSYS


async def test_inet_protocols_limited(attacker: Box) -> None:
    sctp, dccp, udplite, mptcp, l2tp, raw = 132, 33, 136, 262, 115, 255
    refused = [(2, 1, sctp), (2, 6, dccp), (2, 2, udplite), (2, 1, mptcp), (2, 2, l2tp), (2, 3, raw),
               (10, 1, sctp), (10, 2, udplite), (10, 1, mptcp), (10, 2, 1), (2, 1, (1 << 32) | 6), (2, 1, -1)]
    out = await attacker.py(prelude=_SYSCALLS, code=f"""
        print([sock(*t) for t in {refused}])
        print([sock(*t) for t in [(2, 1, 0), (2, 1, 6), (2, 2, 17), (10, 1, 6), (10, 2, 17), (10, 2, 0)]])
        print(sock(2, 2, 1), sock(10, 2, 58))  # ping sockets: up to net.ipv4.ping_group_range
    """)
    no, yes, ping = out.splitlines()
    assert eval(no) == ["EPROTONOSUPPORT"] * len(refused), no
    assert eval(yes) == ["ok"] * 6, yes
    assert "EPROTONOSUPPORT" not in ping, ping


# --- syscalls a sandbox never needs -------------------------------------------------------------

async def test_docker_denied_syscalls_and_aio(attacker: Box) -> None:
    out = await attacker.py(prelude=_SYSCALLS, code="""
        pid, ctx = os.getpid(), ctypes.c_ulong(0)
        eperm = {
            "kcmp": call(312, pid, pid, 0, 0, 0), "mbind": call(237, 0, 4096, 0, 0, 0, 0),
            "set_mempolicy": call(238, 0, 0, 0), "get_mempolicy": call(239, 0, 0, 0, 0, 0),
            "migrate_pages": call(256, pid, 64, 0, 0), "move_pages": call(279, 0, 0, 0, 0, 0, 0),
            "memfd_secret": call(447, 0), "fanotify_init": call(300, 0, 0), "modify_ldt": call(154, 0, 0, 0),
            "sysfs": call(139, 3), "ustat": call(136, 0, 0), "process_madvise": call(440, 0, 0, 0, 0, 0),
            "set_mempolicy_home_node": call(450, 0, 4096, 0, 0),
        }
        # Linux AIO draws on the host-wide fs.aio-max-nr: ENOSYS, as on a kernel without it
        enosys = {
            "io_setup": call(206, 8, ctypes.addressof(ctx)), "io_destroy": call(207, 0),
            "io_getevents": call(208, 0, 0, 0, 0, 0), "io_submit": call(209, 0, 0, 0), "io_cancel": call(210, 0, 0, 0),
            "io_pgetevents": call(333, 0, 0, 0, 0, 0, 0),
        }
        print(sorted(k for k, (r, e) in eperm.items() if e != "EPERM"))
        print(sorted(k for k, (r, e) in enosys.items() if e != "ENOSYS"))
    """)
    assert out == "[]\n[]\n", out


async def test_personality_flags_refused(attacker: Box) -> None:
    out = await attacker.py(prelude=_SYSCALLS, code="""
        p = lambda v: (lambda r, e: r if r >= 0 else e)(*call(135, v))
        # ADDR_NO_RANDOMIZE, READ_IMPLIES_EXEC, MMAP_PAGE_ZERO, ADDR_COMPAT_LAYOUT, PER_SVR4, PER_BSD, and
        # allowed values with high bits (the kernel would truncate 0x1_00000008 to PER_LINUX32)
        print([p(v) for v in (0x40000, 0x400000, 0x100000, 0x200000, 0x4100001, 6, 0x40008, 0x1_00000008)])
        print(p(0xffffffff), p(8), p(0x20008), p(0), p(0xffffffff))
    """)
    refused, allowed = out.splitlines()
    assert eval(refused) == ["EPERM"] * 8, refused
    assert allowed.split() == ["0", "0", "8", "131080", "0"], allowed  # each call returns the previous one
    assert (await attacker.run("setarch", "-R", "true"))[0] != 0  # no ASLR-off children either


# --- PTYs, inotify, nested namespaces -------------------------------------------------------------

_HOLD = "import time; time.sleep(60)"


async def test_ptys_capped_per_sandbox(attacker: Box, neighbour: Box) -> None:
    await attacker.background(f"""
import errno, os
fds = []
try:
    while len(fds) < 4000:
        fds.append(os.open("/dev/ptmx", os.O_RDWR | os.O_NOCTTY))
except OSError as e:
    print(len(fds), errno.errorcode[e.errno], flush=True)
{_HOLD}""", "/tmp/ptys")
    taken, err = (await attacker.wait_file("/tmp/ptys")).split()
    assert (int(taken), err) == (rootfs.PTYS_PER_SANDBOX, "ENOSPC")
    # ... while they are held, the neighbour opens one, and the host has room for every sandbox's
    out = await neighbour.py("import os, pty; m, s = pty.openpty(); print(os.ttyname(s))")
    assert out.startswith("/dev/pts/")
    pty_max = host.read_sysctl("kernel.pty.max")
    assert pty_max - host.read_sysctl("kernel.pty.reserve") >= 1000 * rootfs.PTYS_PER_SANDBOX or pty_max == host.PTY_MAX_LIMIT


async def test_inotify_capped_per_sandbox(attacker: Box, neighbour: Box) -> None:
    await attacker.background(f"""
import ctypes, errno
libc = ctypes.CDLL(None, use_errno=True)
n = 0
while n < 10000 and libc.inotify_init1(0) >= 0:
    n += 1
print(n, errno.errorcode[ctypes.get_errno()], flush=True)
{_HOLD}""", "/tmp/inotify")
    made, err = (await attacker.wait_file("/tmp/inotify")).split()
    assert (int(made), err) == (ns_limits.INOTIFY_INSTANCES, "EMFILE")
    out = await neighbour.py("import ctypes; print(ctypes.CDLL(None).inotify_init1(0) >= 0)")
    assert out == "True\n"
    out = await attacker.py("print(open('/proc/sys/user/max_inotify_watches').read().strip())")
    assert int(out) == ns_limits.INOTIFY_WATCHES


_JOIN_USERNS = """
import ctypes, errno, os, sys
pid, uid = int(sys.argv[1]), int(sys.argv[2])
libc = ctypes.CDLL(None, use_errno=True)
fd = os.open(f"/proc/{pid}/ns/user", os.O_RDONLY)
os.setgroups([]); os.setresgid(uid, uid, uid); os.setresuid(uid, uid, uid)
assert libc.setns(fd, 0x10000000) == 0, os.strerror(ctypes.get_errno())
out = []
for flag in (0x10000000, 0x40000000, 0x20000000, 0x08000000, 0x04000000, 0x00020000, 0x02000000):
    out.append("ok" if libc.unshare(flag) == 0 else errno.errorcode[ctypes.get_errno()])
print(" ".join(out))
"""


async def test_no_nested_namespaces_even_without_seccomp(attacker: Box) -> None:
    """The sandbox's user namespace allows no namespaces of any kind under it: shown from a process
    that joined it from the host (all capabilities there, and no seccomp filter at all)."""
    assert (await attacker.run("unshare", "-U", "true"))[0] != 0
    assert (await attacker.py("print(open('/proc/sys/user/max_user_namespaces').read())")).strip() == "0"
    assert (await attacker.run("sh", "-c", "echo 9 > /proc/sys/user/max_user_namespaces"))[0] != 0  # no way back
    pid = attacker.sandbox.host_pid
    uid = 0  # the namespace's owner: host root makes and maps it (two ids: the sandbox's root and user)
    # the setup's handle on the unmasked /proc/sys (how those limits were written) is gone: pid 1
    # holds no path but /dev/null (sockets and pidfds are not paths)
    held = {os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
    assert {h for h in held if h.startswith("/")} == {"/dev/null"}, held
    r = subprocess.run([sys.executable, "-c", _JOIN_USERNS, str(pid), str(uid)], capture_output=True, text=True,
                       timeout=30)
    # user, net, pid, ipc, uts, mount, cgroup
    assert r.stdout.split() == ["ENOSPC"] * 7, (r.stdout, r.stderr)


# --- rlimits, host setup --------------------------------------------------------------------------

async def test_rlimits_set_explicitly(attacker: Box) -> None:
    _, text, _ = await attacker.run("cat", "/proc/self/limits")
    names = {
        "Max open files": "RLIMIT_NOFILE", "Max file size": "RLIMIT_FSIZE", "Max core file size": "RLIMIT_CORE",
        "Max processes": "RLIMIT_NPROC", "Max locked memory": "RLIMIT_MEMLOCK",
        "Max pending signals": "RLIMIT_SIGPENDING", "Max msgqueue size": "RLIMIT_MSGQUEUE",
        "Max realtime priority": "RLIMIT_RTPRIO", "Max nice priority": "RLIMIT_NICE",
        "Max realtime timeout": "RLIMIT_RTTIME",
    }
    import resource

    want = ns_limits.rlimits(Limits(memory_mb=256, open_files=8192))
    seen = {}
    for line in text.splitlines()[1:]:
        for label, name in names.items():
            if line.startswith(label):
                soft, hard = line[len(label):].split()[:2]
                seen[name] = (int(soft), int(hard))
    assert seen == {name: want[getattr(resource, name)] for name in names.values()}, seen


async def test_host_budget_and_parent_cgroup(backend: LinuxBackend, attacker: Box) -> None:
    budget = backend.host_budget
    assert budget is not None
    total = host.mem_total()
    assert budget.memory_bytes + budget.socket_bytes <= total - max(1 << 30, total // 10)
    tasks = min(host.read_sysctl("kernel.pid_max"), host.read_sysctl("kernel.threads-max"))
    assert 0 < budget.pids <= tasks - 1024
    limits = cgroups.parent_limits(backend.cgroup_parent)
    assert limits["memory"] == budget.memory_bytes and limits["pids"] == budget.pids
    shared = cgroups.parent_limits(cgroups.GROUP)  # every server's sandboxes together
    assert shared["memory"] <= total and shared["pids"] <= tasks
    if not cgroups.is_v2():
        assert limits["sockets"] == budget.socket_bytes > 0
        assert attacker.memcg("memory.kmem.tcp.limit_in_bytes") == cgroups.socket_limit_bytes(256)
    if not budget.unprotected:  # the server raised what was too small
        assert host.read_sysctl("fs.file-max") == host.LONG_MAX
        assert host.read_sysctl("kernel.pid_max") >= host.PID_MAX
    # a sandbox asking for more than this host gives is refused up front
    with pytest.raises(Exception, match="open_files must be at most"):
        await backend.create(SandboxSpec("toomany", limits=Limits(open_files=budget.max_open_files + 1)))


def test_opting_out_of_sysctls_reports_what_is_unprotected(capsys: pytest.CaptureFixture[str]) -> None:
    # 1000 sandboxes x 4096 PTYs cannot fit under any kernel.pty.max: named, not silently ignored
    unprotected = host._raise_sysctls(1000, host.HostTuning(tune_sysctls=False, ptys_per_sandbox=4096))
    assert any(u.startswith("kernel.pty.max") for u in unprotected)
    assert "NOT PROTECTED: kernel.pty.max" in capsys.readouterr().err


# --- socket buffers -----------------------------------------------------------------------------

_UDP_FLOOD = """
import socket, time
rx, tx = [], socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
tx.setblocking(False)
for i in range(2000):
    r = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); r.bind(("127.0.0.1", 0)); rx.append(r)
    for _ in range(16):
        try:
            tx.sendto(b"x" * 60000, r.getsockname())
        except BlockingIOError:
            time.sleep(0.001)
queued = sum(int(line.split()[4].split(":")[1], 16) for line in open("/proc/net/udp").readlines()[1:])
print(len(rx), queued, flush=True)
time.sleep(60)
"""

_TCP_FLOOD = """
import socket, time
ls = socket.socket(); ls.bind(("127.0.0.1", 0)); ls.listen(4096)
conns = []
for i in range(3000):
    c = socket.create_connection(ls.getsockname()); s, _ = ls.accept()
    conns.append((c, s))
    for sock in (c, s):
        sock.setblocking(False)
        try:
            while True:
                sock.send(b"x" * 65536)
        except BlockingIOError:
            pass
queued = 0
for line in open("/proc/net/tcp").readlines()[1:]:
    tx, rx = line.split()[4].split(":")
    queued += int(tx, 16) + int(rx, 16)
print(len(conns), queued, flush=True)
time.sleep(60)
"""


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("MemAvailable:"))


@pytest.mark.parametrize("flood", ["udp", "tcp"])
async def test_socket_buffers_bounded(attacker: Box, neighbour: Box, flood: str) -> None:
    """Socket buffers are charged to the sandbox (v1: its own socket limit): UDP stops at the limit,
    TCP at the limit plus its forced minimum per socket (one segment each way, ~16 KiB here)."""
    before = _mem_available()
    await attacker.background(_UDP_FLOOD if flood == "udp" else _TCP_FLOOD, "/tmp/flood")
    sockets, queued = map(int, (await attacker.wait_file("/tmp/flood", timeout=120)).split())
    drop = before - _mem_available()
    limit = cgroups.socket_limit_bytes(256)  # 32 MiB
    n = sockets if flood == "udp" else 2 * sockets
    forced = 0 if flood == "udp" else n * (20 << 10)
    print(f"{flood}: {n} sockets queued {queued >> 20} MiB, host MemAvailable -{drop >> 20} MiB")
    assert queued <= limit + forced + (4 << 20), queued >> 20
    if not cgroups.is_v2():
        peak = attacker.memcg("memory.kmem.tcp.max_usage_in_bytes")
        assert 0 < peak <= limit + forced + (4 << 20), peak >> 20
    # the sandbox's memory (256 MiB) + what it queued, with room for other tests on this host
    assert drop < (256 << 20) + limit + forced + (256 << 20), drop >> 20
    assert (await neighbour.py("print(6 * 7)")) == "42\n"


# --- the disk is memory: one tmpfs, inside the memory limit ---------------------------------------



def test_disk_fill_with_default_limits_is_enospc_and_the_sandbox_lives(server_url: str) -> None:
    with Sandbox.create(api_url=server_url, timeout=300) as sbx:
        sbx.run_code("kept = 'state'")
        disk = Limits().disk_limit_mb
        code, _, err = sh(sbx, "dd if=/dev/zero of=/home/user/big bs=1M count=2000", timeout=120)
        assert code != 0 and "No space left" in err, err
        # /tmp and /dev/shm are the same disk: full too
        for path in ("/tmp/more", "/dev/shm/more"):
            code, _, err = sh(sbx, f"dd if=/dev/zero of={path} bs=1M count=8", timeout=120)
            assert code != 0 and "No space left" in err, (path, err)
        _, out, _ = sh(sbx, "df -m --output=size,used /home/user /tmp /dev/shm | tail -3", timeout=120)
        assert len(set(out.splitlines())) == 1 and abs(int(out.split()[0]) - disk) <= 1, out
        # the agent answers, the files API works, the context kept its state and runs code
        assert sh(sbx, "echo alive", timeout=120)[1] == "alive\n"
        assert "big" in [e.name for e in sbx.files.list("/home/user")]
        assert sbx.run_code("kept").text == "state"
        assert sbx.run_code("sum(range(10**6))").text == str(sum(range(10**6)))
        sh(sbx, "rm -f /home/user/big /tmp/more /dev/shm/more", timeout=120)
        sbx.files.write("/home/user/after", "fits")
        assert sbx.files.read("/home/user/after") == "fits"


def test_a_flood_of_empty_files_is_enospc(server_url: str) -> None:
    """tmpfs inodes are memory the size= limit does not count: they are capped with the disk."""
    with Sandbox.create(api_url=server_url, timeout=300, limits={"memoryMB": 256, "diskMB": 64}) as sbx:
        r = sbx.run_code(
            "import errno, os\n"
            "n, err = 0, None\n"
            "try:\n"
            "    while n < 100_000:\n"
            "        open(f'/tmp/f{n}', 'w').close(); n += 1\n"
            "except OSError as e:\n"
            "    err = errno.errorcode[e.errno]\n"
            "(n, err)"
        )
        n, err = eval(r.text)
        assert err == "ENOSPC" and n < 64 * 1024 // 8, (n, err)
        assert sh(sbx, "rm -rf /tmp/f* && echo cleaned", timeout=120)[1] == "cleaned\n"


def test_disk_must_fit_in_memory(server_url: str) -> None:
    import httpx

    r = httpx.post(f"{server_url}/v2/sandboxes", headers={"X-API-Key": "k"},
                   json={"templateID": "base", "limits": {"memoryMB": 256, "diskMB": 1024}}, timeout=30)
    assert r.status_code == 400 and "memory" in r.text and "diskMB" in r.text, r.text
    with Sandbox.create(api_url=server_url, limits={"memoryMB": 256}) as sbx:  # disk follows memory
        _, out, _ = sh(sbx, "df -m --output=size /tmp | tail -1", timeout=120)
        assert int(out) == Limits(memory_mb=256).disk_limit_mb == 128
