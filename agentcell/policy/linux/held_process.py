"""What the server can read of a process blocked in an exec (issue 28, exec "ask"): the argv it passed
to execve/execveat and a few of its ancestors, for the person asked to decide.

Read from the host's /proc: /proc/<tid>/syscall gives the blocked syscall's arguments, /proc/<tid>/mem
the strings they point to (the exec'ing process still has its old memory while the kernel opens the
program and its loader). What is read there is the process's claim: another of its threads may change
that memory meanwhile, so it is shown to a human, never used to decide anything (the decision binds
the file itself, by inode). Everything is bounded (arguments, bytes, ancestors) and best effort: a
process gone, a 32-bit process or a foreign architecture gives None, never an error.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field
from typing import Any

MAX_ARGS = 256  # argv entries read at most ...
MAX_ARG_BYTES = 4096  # ... each this long at most ...
MAX_ARGV_BYTES = 32 << 10  # ... and this much in all
MAX_CMDLINE = 4096  # an ancestor's /proc/<pid>/cmdline, at most
PAGE = 4096
# execve(filename, argv, envp) and execveat(dirfd, filename, argv, envp, flags): syscall numbers
_EXEC_NR = {"x86_64": {59: 0, 322: 1}, "aarch64": {221: 0, 281: 1}}.get(platform.machine(), {})


@dataclass(frozen=True, slots=True)
class ProcessInfo:
    """One process of the tree: host pid, its pid in the sandbox (None if not in its pid namespace),
    its name and its command line (at most MAX_CMDLINE bytes; [] for a kernel thread or one gone)."""

    host_pid: int
    pid: int | None
    comm: str
    argv: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "comm": self.comm, "argv": self.argv}


def status(host_pid: int) -> dict[str, str] | None:
    """/proc/<pid>/status as {field: value}; None once the process is gone."""
    try:
        with open(f"/proc/{host_pid}/status", "rb") as f:
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)


def sandbox_pid(fields: dict[str, str], depth: int) -> int | None:
    """A process's pid at its sandbox's pid-namespace level (`depth` in NSpid), from its status."""
    ns = fields.get("NSpid", "").split()
    return int(ns[depth]) if len(ns) > depth else None


def _split(raw: bytes) -> list[str]:
    return [a.decode(errors="backslashreplace") for a in raw.split(b"\0")]


def cmdline(host_pid: int) -> list[str]:
    try:
        with open(f"/proc/{host_pid}/cmdline", "rb") as f:
            raw = f.read(MAX_CMDLINE)
    except OSError:
        return []
    return _split(raw.rstrip(b"\0")) if raw else []


def process_info(host_pid: int, depth: int) -> tuple[ProcessInfo, int] | None:
    """The process, and its parent's host pid (0 for none); None once it is gone."""
    fields = status(host_pid)
    if fields is None:
        return None
    info = ProcessInfo(host_pid, sandbox_pid(fields, depth), fields.get("Name", "").strip(), cmdline(host_pid))
    return info, int(fields.get("PPid", "0").strip() or 0)


def ancestors(host_pid: int, depth: int, pidns: int, limit: int) -> list[ProcessInfo]:
    """Up to `limit` ancestors of `host_pid`, its parent first, while they are in the pid namespace
    whose inode is `pidns` (the sandbox's: its init is the last one shown, the host's never)."""
    out: list[ProcessInfo] = []
    found = process_info(host_pid, depth)
    parent = found[1] if found else 0
    while parent > 0 and len(out) < limit:
        try:
            if os.stat(f"/proc/{parent}/ns/pid").st_ino != pidns:
                break
        except OSError:
            break
        found = process_info(parent, depth)
        if found is None:
            break
        out.append(found[0])
        if found[0].pid == 1:
            break
        parent = found[1]
    return out


class _Memory:
    """Bounded reads of a process's memory (/proc/<pid>/mem): never across an unmapped page."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.budget = MAX_ARGV_BYTES

    def read(self, addr: int, size: int) -> bytes:
        out = b""
        while size > 0:
            chunk = min(size, PAGE - addr % PAGE)
            data = os.pread(self.fd, chunk, addr)
            out += data
            if len(data) < chunk:
                break
            addr, size = addr + chunk, size - chunk
        return out

    def string(self, addr: int) -> bytes:
        out = b""
        while len(out) < MAX_ARG_BYTES and self.budget > 0:
            chunk = self.read(addr + len(out), min(PAGE - (addr + len(out)) % PAGE, self.budget))
            if not chunk:
                break
            end = chunk.find(b"\0")
            if end >= 0:
                out += chunk[:end]
                break
            out += chunk
        out = out[:MAX_ARG_BYTES]
        self.budget -= len(out) + 1
        return out

    def pointers(self, addr: int) -> list[int]:
        out: list[int] = []
        while len(out) < MAX_ARGS:
            raw = self.read(addr + 8 * len(out), min(8 * (MAX_ARGS - len(out)), PAGE - (addr + 8 * len(out)) % PAGE))
            if len(raw) < 8:
                break
            for i in range(0, len(raw) - 7, 8):
                p = int.from_bytes(raw[i:i + 8], "little")
                if p == 0:
                    return out
                out.append(p)
        return out


def exec_claim(tid: int) -> tuple[str | None, list[str] | None]:
    """(filename, argv) the thread `tid` passed to the execve/execveat it is blocked in; (None, None)
    when it is not (any more) in one, or they cannot be read."""
    try:
        with open(f"/proc/{tid}/syscall", "rb") as f:
            words = f.read(512).split()
    except OSError:
        return None, None
    if len(words) < 7 or not words[0].isdigit():  # "running", or "-1 ..." (not in a syscall)
        return None, None
    which = _EXEC_NR.get(int(words[0]))
    if which is None:
        return None, None
    args = [int(w, 16) for w in words[1:7]]
    try:
        fd = os.open(f"/proc/{tid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None, None
    try:
        mem = _Memory(fd)
        filename = mem.string(args[which]).decode(errors="backslashreplace") if args[which] else None
        argv = [mem.string(p) for p in mem.pointers(args[which + 1])] if args[which + 1] else []
        return filename, [a.decode(errors="backslashreplace") for a in argv]
    except OSError:
        return None, None
    finally:
        os.close(fd)
