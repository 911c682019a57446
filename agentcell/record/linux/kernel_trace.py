"""Execs, exits and refused path syscalls of a uid range, from eBPF programs (bpf/kernel_trace.bpf.c): the
behaviour record's source of `process.exec`, `process.exit` and `deny.write`/`deny.access` (issue 10)
where the kernel and the host allow it, kernel audit's exit rules and the proc connector otherwise
(record/linux/audit_events.py). An exit is written only for a process whose exec was (the
last of its threads, with its status), so it always follows its exec in the ring, and the server
does not receive every exit of the host as the proc connector would send it.

Why: an audit exit rule gives every process of the range an audit context, and every one of its
syscalls then pays audit's entry/exit path and, for a path, the name's collection (measured in a
sandbox: getppid +165 ns, stat +700 ns, open+close +960 ns); an exec then costs 6 records formatted by
the kernel and parsed in Python (~60 µs of the exec'ing process, ~200 µs of the server). Here an exec
costs a raw tracepoint on sched_process_exec (~10 µs with the server's handling), and a syscall
nothing unless it is refused:

* denials="failures" (the default): refused path syscalls are seen at the failed capability check
  that refuses them (the cap_capable tracepoint, 6.14+); a call that checks no capability (nearly
  all) never meets the tracer. Not seen: EROFS (read-only mounts), and refusals that involve no
  capability check (bpf/kernel_trace.bpf.c, on_cap_denied, says which).
* denials="syscalls": every path syscall failing with EACCES, EPERM or EROFS, at its exit (the sys_exit
  tracepoint). That tracepoint is global: while it is attached every syscall of every process of the
  host takes the kernel's slow path (measured in a sandbox: getppid 546 -> 648 ns, stat 3,386 -> 3,583
  ns; the build-like benchmark +5.5 %, against -1 % without it).

Each event comes structured: argv as the new program received it,
the path as exec'd or as the refused call named it, the working directory, the pid at every
pid-namespace level (no /proc lookup racing the process's end).

The programs are compiled with clang (-target bpf, bpf_build.py) when a wheel is built, and shipped in
it next to their source; from a checkout (or on another machine than the wheel's), the first time a
server starts with this source, into a cache (`AGENTCELL_BPF_CACHE`, /var/cache/agentcell/bpf). They
are loaded with libbpf (libbpf1, through ctypes): libbpf relocates their struct offsets against the
running kernel's BTF (/sys/kernel/btf/vmlinux), so no kernel headers are needed and one object fits
every kernel. Needs root (CAP_BPF, CAP_PERFMON).
"""

from __future__ import annotations

import ctypes
import os
import struct
from pathlib import Path
from typing import NamedTuple

from agentcell.errors import BackendUnavailableError
from agentcell.record.linux import bpf_build, bpf_objects
from agentcell.record.linux.audit_proc import Exit

SOURCE = Path(__file__).parent / "bpf" / bpf_build.SOURCE_NAME
CACHE = Path(os.environ.get("AGENTCELL_BPF_CACHE", "/var/cache/agentcell/bpf"))
LEVELS = 4  # pid-namespace levels in an event (bpf source: LEVELS)
F_ARGS_CUT, F_CWD_CUT, F_EXE_CUT = 1, 2, 4
T_EXEC, T_DENIAL, T_EXIT = 1, 2, 4
DENIALS = ("failures", "syscalls")  # which program sees refused path syscalls (see the module's doc)
# struct event's head: type, pad; ktime_ns; tgid, ppid, uid, flags; level, parent_level; pids[4],
# ppids[4]; file_len, cwd_len, exe_len, args_len; comm[16]; file[256]; cwd[4096 + 256]; exe[...]; args
_HEAD = struct.Struct(f"=IIQIIIIII{LEVELS}i{LEVELS}iIIII16s")
# struct denial: type, tgid; ktime_ns; uid, err, nr, open_flags, level, flags; pids[4]; path_len,
# cwd_len; comm[16]; path[4096 + 256]; cwd[4096 + 256]
_DENIAL = struct.Struct(f"=IIQIIIIII{LEVELS}iII16s")
_EXIT = struct.Struct("=IIQII")  # struct exit_event: type, tgid; ktime_ns; uid, status
_FILE, _PATH = 256, 4096 + 256
_CWD_AT = _HEAD.size + _FILE
_EXE_AT = _CWD_AT + _PATH
_ARGS_AT = _EXE_AT + _PATH
_BUDGET = struct.Struct("=QQQ")  # struct budget: window_start, count, dropped


class KernelTraceUnavailable(BackendUnavailableError):
    """This host cannot run the kernel tracer (no clang, no libbpf, no BTF, no BPF privilege)."""


class Exec(NamedTuple):  # (a tuple: a third of a frozen dataclass's cost to make, per exec)
    monotonic_ns: int
    host_pid: int
    host_ppid: int
    uid: int  # host uid
    pids: tuple[int, ...]  # the process's pid at levels 0..level (0: the host's)
    ppids: tuple[int, ...]  # its parent's
    comm: str
    file: str  # as exec'd (may be relative to cwd)
    cwd: str | None  # relative to the process's root; None if cut
    exe: str | None  # the file the kernel runs (a script's interpreter), so; None if cut
    argv: list[str]
    argv_cut: bool


class Denial(NamedTuple):
    monotonic_ns: int
    host_pid: int
    uid: int  # host uid
    errno: int  # EACCES, EPERM or EROFS
    nr: int  # the syscall's number (x86_64)
    open_flags: int  # an open's flags (0 for the other calls)
    pids: tuple[int, ...]
    comm: str
    path: str  # as the call named it (read from its memory after the call), made absolute with its cwd


def parse(data: bytes) -> Exec | Denial | Exit:
    kind = int.from_bytes(data[:4], "little")
    if kind == T_EXIT:
        (_type, tgid, ktime, _uid, status) = _EXIT.unpack_from(data)
        return Exit(tgid, status, ktime)
    if kind == T_DENIAL:
        return _denial(data)
    (_type, _pad, ktime, tgid, ppid, uid, flags, level, plevel, *rest) = _HEAD.unpack_from(data)
    pids, ppids = rest[:LEVELS], rest[LEVELS:2 * LEVELS]
    file_len, cwd_len, exe_len, args_len, comm = rest[2 * LEVELS:]
    file = data[_HEAD.size:_HEAD.size + max(file_len - 1, 0)]
    args = data[_ARGS_AT:_ARGS_AT + args_len]
    argv = args[:-1].split(b"\0") if args.endswith(b"\0") else args.split(b"\0")
    return Exec(ktime, tgid, ppid, uid, tuple(pids[:level + 1]), tuple(ppids[:plevel + 1]),
                _text(comm.split(b"\0", 1)[0]), _text(file),
                None if flags & F_CWD_CUT else _path(data[_CWD_AT:_CWD_AT + cwd_len]),
                None if flags & F_EXE_CUT else _path(data[_EXE_AT:_EXE_AT + exe_len]),
                [_text(a) for a in argv] if args else [], bool(flags & F_ARGS_CUT))


def _denial(data: bytes) -> Denial:
    (_type, tgid, ktime, uid, err, nr, open_flags, level, flags, *rest) = _DENIAL.unpack_from(data)
    pids = rest[:LEVELS]
    path_len, cwd_len, comm = rest[LEVELS:]
    at = _DENIAL.size
    path = _text(data[at:at + max(path_len - 1, 0)])
    if path and not path.startswith("/") and not flags & F_CWD_CUT:
        path = os.path.normpath(os.path.join(_path(data[at + _PATH:at + _PATH + cwd_len]), path))
    return Denial(ktime, tgid, uid, err, nr, open_flags, tuple(pids[:level + 1]), _text(comm.split(b"\0", 1)[0]), path)


def _path(components: bytes) -> str:
    """A path from its components as the program walked them up: innermost first, NUL-terminated."""
    return _text(b"/" + b"/".join(reversed(components.split(b"\0")[:-1])))


def _text(b: bytes) -> str:
    """Valid text for JSON and SQLite whatever the bytes: UTF-8 as is, other bytes as \\xNN."""
    return b.decode() if b.isascii() else b.decode(errors="backslashreplace")


def build(source: Path = SOURCE) -> Path:
    """The compiled object for `source` (bpf_objects.compiled): shipped, cached, or compiled now."""
    return bpf_objects.compiled(source, CACHE, KernelTraceUnavailable)


class KernelTrace:
    """The loaded, attached tracer for host uids `uid_first`..`uid_last`, each of which may have `budget`
    execs a second written (beyond: counted, `dropped`). `denials` picks the program that sees refused
    path syscalls (DENIALS; the module's doc). `fileno()` is readable when events are waiting; `read()`
    returns them in the order the kernel wrote them."""

    def __init__(self, uid_first: int, uid_last: int, budget: int = 4000, source: Path = SOURCE,
                 denials: str = "failures") -> None:
        if denials not in DENIALS:
            raise ValueError(f"denials must be one of {', '.join(DENIALS)}, not {denials!r}")
        if not Path("/sys/kernel/btf/vmlinux").exists():
            raise KernelTraceUnavailable("the kernel has no BTF (/sys/kernel/btf/vmlinux): the tracer needs a kernel "
                                         "built with CONFIG_DEBUG_INFO_BTF=y")
        path = build(source)
        self._got: list[Exec | Denial | Exit] = []
        self._limit = 0  # read(): events to take at most (0: all)
        self._cpus = max(bpf_objects.libbpf(KernelTraceUnavailable).libbpf_num_possible_cpus(), 1)

        def configure(obj: bpf_objects.BpfObject) -> None:  # before the programs see anything
            config = (ctypes.c_uint32 * 4)(uid_first, uid_last, budget, 0)
            if obj.lib.bpf_map_update_elem(obj.map_fd("config"), ctypes.byref(ctypes.c_uint32(0)), config, 0) != 0:
                raise obj.error("configuring the kernel tracer")

        self._bpf = bpf_objects.BpfObject(
            path, KernelTraceUnavailable, "the kernel tracer", "events", self._on_event,
            skip=("on_sys_exit" if denials == "failures" else "on_cap_denied",), sizes={"scratch": self._cpus},
            load_hint=" (it needs the server to run as root, with CAP_BPF and CAP_PERFMON)", configure=configure)
        self._lib = self._bpf.lib
        self._lost_fd = self._bpf.map_fd("lost")
        self._budgets_fd = self._bpf.map_fd("budgets")
        self._muted_fd = self._bpf.map_fd("muted")

    def _error(self, what: str) -> KernelTraceUnavailable:
        err = ctypes.get_errno()
        return KernelTraceUnavailable(f"{what}: {os.strerror(err) if err else 'failed'}")

    def _on_event(self, _ctx: int | None, data: int, size: int) -> int:
        try:
            self._got.append(parse(ctypes.string_at(data, size)))
        except (struct.error, ValueError):
            pass  # a short or odd event: not ours to crash on
        return -1 if self._limit and len(self._got) >= self._limit else 0  # < 0: libbpf stops after this one

    def fileno(self) -> int:
        return self._bpf.ring_fd()

    def read(self, limit: int = 0) -> list[Exec | Denial | Exit]:
        """What the ring holds now, the first `limit` events of it if given (none: an empty list); the
        rest stays in the ring for the next read."""
        self._limit = limit
        self._bpf.consume()
        got, self._got = self._got, []
        return got

    def lost(self) -> int:
        """Events the kernel could not write (the ring was full), since the load."""
        values = (ctypes.c_uint64 * max(self._cpus, 1))()
        key = ctypes.c_uint32(0)
        if self._lib.bpf_map_lookup_elem(self._lost_fd, ctypes.byref(key), values) != 0:
            return 0
        return sum(values)

    def dropped(self, uid: int) -> int:
        """Execs of host uid `uid` over its budget (counted by the kernel, not written), since the load."""
        key = ctypes.c_uint32(uid)
        value = ctypes.create_string_buffer(_BUDGET.size)
        if self._lib.bpf_map_lookup_elem(self._budgets_fd, ctypes.byref(key), value) != 0:
            return 0
        return _BUDGET.unpack(value.raw)[2]

    def mute(self, uid: int, muted: bool = True) -> None:
        """Stop (or resume) writing the execs of host uid `uid`; muted ones are counted as dropped."""
        key, one = ctypes.c_uint32(uid), ctypes.c_uint32(1)
        if muted:
            if self._lib.bpf_map_update_elem(self._muted_fd, ctypes.byref(key), ctypes.byref(one), 0) != 0:
                raise self._error(f"muting uid {uid}")
        else:
            self._lib.bpf_map_delete_elem(self._muted_fd, ctypes.byref(key))

    def close(self) -> None:
        self._bpf.close()
