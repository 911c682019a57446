"""The exec policy's backstop: what the exec gate (fanotify FAN_OPEN_EXEC_PERM on the sandbox's mounts,
which decides by the identity of each file opened for exec) cannot see, killed in the kernel. A raw
tracepoint on sched_process_exec (bpf/exec_guard.bpf.c), loaded once per server, kills (SIGKILL) a
process of a *guarded* host uid whose exec just started:

* the ELF loader as the main program (`/lib64/ld-linux-x86-64.so.2 /bin/x`, `/lib/ld-musl-x86_64.so.1 x`,
  or a script whose "#!" line names the loader): every dynamic exec opens the loader as its
  interpreter, so the gate must allow that file, and run directly it would open and map any file with
  plain open/mmap calls that no exec check sees (REASONS: "loader");
* a file on a kernel-internal mount: memfd_create(2) files exec'd through /proc/self/fd/N or
  execveat(fd, "", AT_EMPTY_PATH) (fexecve): no mount of the sandbox holds them, so no mark of the
  gate sees them ("internal").

The tracepoint fires past the exec's point of no return and before the new program's first
instruction; the signal is taken on the way back to user space, so the program runs nothing (tests:
`ld.so /bin/touch f` creates no file). The shell that started it sees it killed (status 137, "Killed").

How the loader is recognised: the name of the file the kernel runs (its own name, whatever path or
link led there) is a shared object's (*.so, *.so.*), and the kernel loaded no interpreter for it
(AT_BASE == 0 in the new program's auxiliary vector), which spares the libraries that run with one
(glibc's libc.so.6 prints its version). A list of loader names would miss musl's: its loader is its
libc.so (Debian: /lib/ld-musl-x86_64.so.1 -> x86_64-linux-musl/libc.so). The ELF type cannot tell a
loader from a static-pie program (both ET_DYN without PT_INTERP: Rust's musl binaries), so the name is
the identity: a copy under another name is a new file, which the gate refuses under default deny (an
overlay hard link is a copy-up: a new inode too). Under default allow a renamed copy of the loader
runs, as a copy of a denied program does. A static-pie program named *.so is killed.

Not killed: a script in a memfd (the file run is its interpreter, which the gate judged: as `sh -c`);
a process already running when its uid is guarded. The kill is the kernel's bpf_send_signal(SIGKILL),
forced (a pid namespace's init dies too); were the kernel to refuse it (Kill.signal_error != 0: never
seen; it refuses for a host's init or an exiting task, or when this CPU's deferred signal is still
queued), the program would run: the server should then kill Kill.host_pid itself.

Cost (benchmarks/exec_guard.py, the kernel's BPF statistics): the program runs at every exec of the
host, ~0.2 µs for a process of an unguarded uid (one hash lookup), ~0.45 µs for a guarded one,
against ~450-1000 µs for a fork+exec of /usr/bin/true in a sandbox here.

Each kill is an event in a ring buffer (`fileno()`, `read()`), at most `budget` a second per uid
(beyond: counted, `dropped(uid)`); the kill itself is never skipped.

Needs root (CAP_BPF, CAP_PERFMON), a kernel with BTF, libbpf, and the compiled object (shipped in a
wheel, else clang): `available()` says which is missing; ExecGuard raises ExecGuardUnavailable.
"""

from __future__ import annotations

import ctypes
import functools
import os
import struct
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from agentcell.errors import BackendUnavailableError
from agentcell.record.linux import bpf_objects

SOURCE = Path(__file__).parent / "bpf" / "exec_guard.bpf.c"
CACHE = Path(os.environ.get("AGENTCELL_BPF_CACHE", "/var/cache/agentcell/bpf"))
ALLOW_LOADER = 1  # guard() flags: what the uid may run anyway (bpf source: ALLOW_*)
ALLOW_INTERNAL = 2
REASONS = {1: "loader", 2: "internal"}  # bpf source: R_*
_KILL = struct.Struct("=QIIII16s256s256s")  # struct kill
_BUDGET = struct.Struct("=QQQ")  # struct budget: window_start, count, dropped


class ExecGuardUnavailable(BackendUnavailableError):
    """This host cannot run the exec guard (not root, no BTF, no libbpf or clang, the kernel refused the
    program); the message says what is missing."""


class Kill(NamedTuple):
    monotonic_ns: int
    uid: int  # host uid
    host_pid: int  # the killed process (tgid)
    reason: str  # REASONS: loader, internal
    signal_error: int  # errno of the kernel's refusal to send SIGKILL (0: sent)
    comm: str  # the new program's name
    filename: str  # the path as exec'd (/dev/fd/N for an execveat of an fd)
    name: str  # the file's own name (memfd:<name> for a memfd)


def parse(data: bytes) -> Kill:
    ktime, uid, tgid, reason, err, comm, filename, name = _KILL.unpack_from(data)
    return Kill(ktime, uid, tgid, REASONS.get(reason, str(reason)), err, _text(comm), _text(filename), _text(name))


def _text(b: bytes) -> str:
    b = b.split(b"\0", 1)[0]
    return b.decode() if b.isascii() else b.decode(errors="backslashreplace")


def build(source: Path = SOURCE) -> Path:
    """The compiled object for `source` (bpf_objects.compiled): shipped, cached, or compiled now."""
    return bpf_objects.compiled(source, CACHE, ExecGuardUnavailable)


def check_host() -> None:
    """ExecGuardUnavailable, saying what is missing, unless this host has what the guard needs (short
    of loading it: available() does)."""
    if os.geteuid() != 0:
        raise ExecGuardUnavailable("the exec guard needs the server to run as root (a BPF program); rootless "
                                   "servers cannot enforce exec rules")
    if not Path("/sys/kernel/btf/vmlinux").exists():
        raise ExecGuardUnavailable("the exec guard needs a kernel with BTF (/sys/kernel/btf/vmlinux, "
                                   "CONFIG_DEBUG_INFO_BTF=y)")


@functools.cache
def available() -> str | None:
    """None if the guard loads on this host, else why not (the first time: a load and close, ~ms)."""
    try:
        ExecGuard().close()
    except ExecGuardUnavailable as e:
        return str(e)
    return None


class ExecGuard:
    """The guard's program, loaded and attached (one per server; thread-safe). `guard()`/`unguard()` take
    effect at once for every later exec of those uids. `fileno()` is readable when kills were written;
    `read()` returns them in the order the kernel wrote them."""

    def __init__(self, budget: int = 100, source: Path = SOURCE) -> None:
        check_host()
        path = build(source)
        self._lock = threading.Lock()
        self._got: list[Kill] = []
        self._limit = 0  # read(): events to take at most (0: all)
        self._cpus = max(bpf_objects.libbpf(ExecGuardUnavailable).libbpf_num_possible_cpus(), 1)

        def configure(obj: bpf_objects.BpfObject) -> None:  # before the program sees anything
            config = (ctypes.c_uint32 * 2)(budget, 0)
            if obj.lib.bpf_map_update_elem(obj.map_fd("config"), ctypes.byref(ctypes.c_uint32(0)), config, 0) != 0:
                raise obj.error("configuring the exec guard")

        self._bpf = bpf_objects.BpfObject(
            path, ExecGuardUnavailable, "the exec guard", "kills", self._on_kill,
            load_hint=" (it needs the server to run as root, with CAP_BPF and CAP_PERFMON)", configure=configure)
        self._lib = self._bpf.lib
        self._guarded = self._bpf.map_fd("guarded")
        self._budgets = self._bpf.map_fd("budgets")
        self._lost = self._bpf.map_fd("lost")

    def _on_kill(self, _ctx: int | None, data: int, size: int) -> int:
        try:
            self._got.append(parse(ctypes.string_at(data, size)))
        except (struct.error, ValueError):
            pass  # a short or odd event: not ours to crash on
        return -1 if self._limit and len(self._got) >= self._limit else 0  # < 0: libbpf stops after this one

    def guard(self, uids: Iterable[int], flags: int = 0) -> None:
        """Guard host uids `uids` (a sandbox's), allowing what `flags` (ALLOW_LOADER | ALLOW_INTERNAL)
        says; guarding a uid again replaces its flags."""
        if flags & ~(ALLOW_LOADER | ALLOW_INTERNAL):
            raise ValueError(f"unknown exec guard flags {flags:#x}")
        value = ctypes.c_uint32(flags)
        with self._lock:
            for uid in uids:
                if self._lib.bpf_map_update_elem(self._guarded, ctypes.byref(ctypes.c_uint32(uid)),
                                                 ctypes.byref(value), 0) != 0:
                    raise self._bpf.error(f"guarding uid {uid}")

    def unguard(self, uids: Iterable[int]) -> None:
        """Stop guarding host uids `uids` (unguarded ones: nothing)."""
        with self._lock:
            for uid in uids:
                self._lib.bpf_map_delete_elem(self._guarded, ctypes.byref(ctypes.c_uint32(uid)))
                self._lib.bpf_map_delete_elem(self._budgets, ctypes.byref(ctypes.c_uint32(uid)))

    def flags(self, uid: int) -> int | None:
        """The uid's flags, None if it is not guarded."""
        value = ctypes.c_uint32()
        if self._lib.bpf_map_lookup_elem(self._guarded, ctypes.byref(ctypes.c_uint32(uid)), ctypes.byref(value)) != 0:
            return None
        return value.value

    def fileno(self) -> int:
        return self._bpf.ring_fd()

    def read(self, limit: int = 0) -> list[Kill]:
        """The kills the ring holds now, the first `limit` of them if given; the rest stays for the next read."""
        with self._lock:
            self._limit = limit
            self._bpf.consume()
            got, self._got = self._got, []
        return got

    def lost(self) -> int:
        """Kills the kernel could not write (the ring was full), since the load."""
        values = (ctypes.c_uint64 * self._cpus)()
        if self._lib.bpf_map_lookup_elem(self._lost, ctypes.byref(ctypes.c_uint32(0)), values) != 0:
            return 0
        return sum(values)

    def dropped(self, uid: int) -> int:
        """Kills of host uid `uid` over its budget (counted, not written) since it was guarded."""
        value = ctypes.create_string_buffer(_BUDGET.size)
        if self._lib.bpf_map_lookup_elem(self._budgets, ctypes.byref(ctypes.c_uint32(uid)), value) != 0:
            return 0
        return _BUDGET.unpack(value.raw)[2]

    def close(self) -> None:
        """Detach the program (no uid is guarded any more) and free it (idempotent)."""
        self._bpf.close()
