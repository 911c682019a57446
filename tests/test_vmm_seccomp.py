"""The microvm VMM's seccomp allow-list (backends/microvm/vmm_seccomp.py): a whole VM life runs under it,
a syscall off the list kills the jailed process, and every VMM carries it (Seccomp: 2, with QEMU's own
filter stacked on it). Real VMs under QEMU TCG, a real jail."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcell import Sandbox
from agentcell.backends.base import Limits
from agentcell.backends.microvm import vmm, vmm_seccomp
from agentcell.backends.microvm.backend import MicrovmBackend, MicrovmSandbox
from tests.helpers import started
from tests.servers import SERVE, ServerProcess

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or vmm.qemu_path() is None or shutil.which("bwrap") is None,
    reason="needs root, QEMU and bubblewrap")

SIGSYS_EXIT = 128 + signal.SIGSYS  # bwrap exits with its command's signal so
JAIL_UID = 0x7FFF0000  # an id no account has; the probe writes nothing


@pytest.fixture(scope="module")
def microvm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    state = tmp_path_factory.mktemp("microvm-state")
    with ServerProcess(state / "server.log", "--backend", "microvm", "--accel", "tcg", "--egress-uplink", "none",
                       "--standbys", "1", "--state-dir", str(state / "state"), command=SERVE,
                       start_timeout=900) as server:
        yield server


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                kids.append(int(entry))
    return kids


def _qemus_of(pid: int) -> list[int]:
    """The QEMU processes descended from `pid` (through bwrap, its pid 1 and setpriv's exec)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        for kid in _children(p):
            todo.append(kid)
            with open(f"/proc/{kid}/comm") as f:
                if f.read().startswith("qemu-system"):
                    found.append(kid)
    return found


def _seccomp_status(pid: int) -> tuple[int, int]:
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return int(fields["Seccomp"]), int(fields["Seccomp_filters"])


def _assert_filtered(qemus: list[int]) -> None:
    """Each QEMU and each of its threads: seccomp mode 2, ours (loaded by bwrap) and QEMU's -sandbox."""
    assert qemus, "no QEMU found"
    for pid in qemus:
        for tid in os.listdir(f"/proc/{pid}/task"):
            mode, filters = _seccomp_status(int(tid))
            assert mode == 2 and filters >= 2, (pid, tid, mode, filters)


def test_a_whole_vm_life_under_the_allow_list(microvm: ServerProcess) -> None:
    url = microvm.url
    sbx = Sandbox.create(api_url=url, timeout=600, request_timeout=300)
    try:
        assert sbx.run_code("x = 6 * 7; x").text == "42"
        r = sbx.commands.run("head -c 1000000 /dev/urandom | sha256sum | wc -c; uname -r", timeout=120)
        assert r.exit_code == 0 and r.stdout.startswith("68\n"), r  # "<64 hex>  -\n"
        sbx.files.write("/home/user/kept.txt", "kept across everything")
        # the balloon's free page reporting: pages touched, then freed
        assert sbx.run_code("b = bytearray(64 << 20); b[::4096] = b'1' * len(b[::4096]); del b; 1").text == "1"
        assert sbx.pause() is True  # memory kept: a migration to a file (checkpoint)
        sbx.connect(timeout=600)  # its restore: -incoming defer, migrate-incoming from an fd
        assert sbx.run_code("x").text == "42"
        snap = sbx.create_snapshot()  # the VM running on afterwards (stop, migrate, cont)
        assert sbx.files.read("/home/user/kept.txt") == "kept across everything"
        twin = Sandbox.create(snap.snapshot_id, api_url=url, timeout=600, request_timeout=300)
        try:
            assert twin.files.read("/home/user/kept.txt") == "kept across everything"
            assert twin.run_code("x + 1").text == "43"
        finally:
            twin.kill()
        assert sbx.run_code("x - 1").text == "41"
    finally:
        sbx.kill()
    assert "outside its seccomp allow-list" not in microvm.log()


async def _save(sb: MicrovmSandbox, path: str, ignore_shared: bool) -> None:
    """The VM (stopped) migrated to a file the test opened: QMP's getfd, then migrate fd:."""
    assert sb.qmp is not None
    await sb.qmp.call("stop")
    await sb.qmp.call("migrate-set-capabilities", capabilities=[{"capability": "x-ignore-shared",
                                                                 "state": ignore_shared}])
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        await sb.qmp.send_fd("out", out)
    finally:
        os.close(out)
    await sb.qmp.call("migrate", uri="fd:out")
    await sb.qmp.wait_migration(timeout=300)


async def _quit(sb: MicrovmSandbox) -> int | None:
    assert sb.qmp is not None and sb.proc is not None
    await sb.qmp.call("quit")
    return await asyncio.to_thread(sb.proc.wait, 60)


async def test_a_migrations_under_the_allow_list(tmp_path: Path) -> None:
    """The VMM side of a template, a standby and a snapshot, whatever the guest is doing (it need not be
    ready): RAM in a shared file migrated out (x-ignore-shared), a clone mapping it private restored
    with -incoming defer + migrate-incoming from an fd (this found msync), stop/cont, a full migration
    to an fd and its restore into anonymous RAM, ringbuf-read, quit, SIGKILL. None may die of SIGSYS."""
    b = MicrovmBackend(accel="tcg", standbys=0, max_sandboxes=4, ready_timeout=600)
    async with started(b):
        limits = Limits()
        ram = os.path.join(b.state, "ram")
        fd = os.open(ram, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.fchown(fd, b._free_uids[-1], b._free_uids[-1])
        try:
            tpl = await b._spawn("tpl", limits, ram_fd=fd, ram_shared=True)
        finally:
            os.close(fd)
        await asyncio.sleep(10)  # the guest runs (TCG), wherever its boot gets to
        assert tpl.qmp is not None and tpl.proc is not None
        _assert_filtered(_qemus_of(tpl.proc.pid))
        await tpl.qmp.call("ringbuf-read", device="console", size=4096, format="utf8")
        await _save(tpl, str(tmp_path / "state"), ignore_shared=True)
        assert await _quit(tpl) == 0
        await b.kill(tpl)
        os.chmod(ram, 0o444)
        fd = os.open(ram, os.O_RDONLY | os.O_CLOEXEC)
        try:
            clone = await b._spawn("clone", limits, ram_fd=fd, incoming=True)
        finally:
            os.close(fd)
        await b._load(clone, str(tmp_path / "state"), ignore_shared=True)
        assert clone.qmp is not None
        await asyncio.sleep(5)
        await clone.qmp.call("stop")
        await clone.qmp.call("cont")
        await _save(clone, str(tmp_path / "memory"), ignore_shared=False)
        await clone.qmp.call("cont")
        restored = await b._spawn("restored", limits, incoming=True)
        await b._load(restored, str(tmp_path / "memory"), ignore_shared=False)
        await asyncio.sleep(5)
        assert restored.qmp is not None
        await restored.qmp.call("ringbuf-read", device="console", size=4096, format="utf8")
        assert await _quit(restored) == 0
        await b.kill(restored)
        assert clone.alive(), f"the clone died: {b._log_tail(clone)}"
        await b.kill(clone)
        assert clone.proc is not None and clone.proc.returncode not in (SIGSYS_EXIT, -signal.SIGSYS)


def test_c_every_vmm_carries_the_allow_list_and_qemus_filter(microvm: ServerProcess) -> None:
    sbx = Sandbox.create(api_url=microvm.url, timeout=300, request_timeout=300)
    try:
        assert sbx.run_code("1").text == "1"
        deadline = time.monotonic() + 30
        while not (qemus := _qemus_of(microvm.pid)) and time.monotonic() < deadline:
            time.sleep(0.2)
        _assert_filtered(qemus)
    finally:
        sbx.kill()


# -- a syscall off the list ---------------------------------------------------------------------------

PRELUDE = """
import ctypes, errno, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.syscall.restype = ctypes.c_long
print("ready", flush=True)
"""
# each probe: python code run in the jail after PRELUDE; (expected exit, expected last line)
KILLED = {
    "unshare": "libc.unshare(0x04000000)",  # CLONE_NEWUTS
    "mount": "libc.mount(b'none', b'/tmp', b'tmpfs', 0, None)",
    "ptrace": "libc.ptrace(16, 1, None, None)",  # PTRACE_ATTACH
    "bpf": "libc.syscall(321, 0, None, 0)",
    "fork": "os.fork()",  # clone without CLONE_THREAD
    "thread_in_new_ns": "libc.syscall(56, 0x00010000 | 0x00000100 | 0x00000800 | 0x40000000, 0, 0, 0, 0)",
    "inet_socket": "import socket; socket.socket(socket.AF_INET, socket.SOCK_STREAM)",
    "prctl_other": "libc.prctl(4, 1, 0, 0, 0)",  # PR_SET_DUMPABLE
    "x32_abi": "libc.syscall(0x40000000 | 39)",  # getpid through the x32 entry
    # getpid through int 0x80 (the i386 entry): mov eax, 20; int 0x80; ret
    "i386_abi": ("m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC);"
                 "m.write(bytes([0xb8, 20, 0, 0, 0, 0xcd, 0x80, 0xc3]));"
                 "f = ctypes.CFUNCTYPE(ctypes.c_int)(ctypes.addressof(ctypes.c_char.from_buffer(m)));"
                 "f()"),
}


def _in_jail(code: str) -> subprocess.CompletedProcess[str]:
    """`python3 -S -c code` in the VMM's jail (vmm.jail_argv: bwrap, its allow-list, setpriv) in place of QEMU."""
    bpf = vmm_seccomp.build()
    fd = vmm_seccomp.program_fd(bpf)
    try:
        argv = vmm.jail_argv([vmm.QEMU], JAIL_UID, "tcg", fd)
        at = argv.index(vmm.qemu_path() or f"/usr/bin/{vmm.QEMU}")
        argv[at:] = ["/usr/bin/python3", "-S", "-c", PRELUDE + code + "\nprint('survived', flush=True)"]
        return subprocess.run(argv, pass_fds=[fd], capture_output=True, text=True, timeout=60)
    finally:
        os.close(fd)


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="the probe runs the host's python3")
@pytest.mark.parametrize("probe", sorted(KILLED))
def test_b_a_syscall_off_the_list_kills_the_process(probe: str) -> None:
    r = _in_jail(KILLED[probe])
    assert r.stdout.startswith("ready"), r  # the probe got as far as its syscall
    assert "survived" not in r.stdout
    assert r.returncode == SIGSYS_EXIT, r


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="the probe runs the host's python3")
def test_b_fallbacks_get_enosys_and_threads_still_start() -> None:
    r = _in_jail("print(libc.syscall(435, None, 0), ctypes.get_errno() == errno.ENOSYS);"  # clone3
                 "print(libc.syscall(425, 8, None), ctypes.get_errno() == errno.ENOSYS);"  # io_uring_setup
                 "import threading; t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()")
    assert r.returncode == 0, r
    assert r.stdout.split("\n")[:4] == ["ready", "-1 True", "-1 True", "thread"], r


def test_the_program_is_small_and_built_fast() -> None:
    t0 = time.perf_counter()
    bpf = vmm_seccomp.build()
    ms = (time.perf_counter() - t0) * 1000
    assert 0 < vmm_seccomp.instructions(bpf) < 400
    assert ms < 200
