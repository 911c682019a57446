"""Where an exec in an "ask" sandbox waits for a decision (issue 28): fanotify permission events.

One fanotify group per ask-mode sandbox (FAN_CLASS_CONTENT), opened by the server (host root), marks
every mount of the sandbox's mount namespace (FAN_MARK_MOUNT) for FAN_OPEN_EXEC_PERM: the kernel then
stops each exec's open of its program (and of its loader, ld.so, and a script's interpreter: each is
opened for exec) until the server answers, and hands the server an fd of the exact file being opened.

Each event is judged by `needs_asking(fd)` (the caller's; for the exec policy, the verdicts on the
file's identity: exec_verdicts.py): "allow" and "deny" are answered at once (FAN_DENY: the exec fails
with EPERM, "Operation not permitted"), "ask" holds the exec while `ask(held)` (the caller's) waits for
a decision. An allowed file may get an ignore mark (`ignore`): the kernel stops asking about it. What
cannot be decided (a flood past `max_pending`, the timeout, a failed check, close()) gets `fail`: "deny"
for the exec policy's gate, where nothing else stands behind this.

Mount marks, not filesystem marks: a sandbox's mounts are its own (its mount namespace has its own
copies, even of binds of the host's /usr), so a host exec, or another sandbox's, is never seen, while
a filesystem mark on the host's disk would hold the host's execs too. The mounts are found in
/proc/<init>/mountinfo and opened with openat2(RESOLVE_IN_ROOT) below /proc/<init>/root (a symlink the
sandbox planted cannot lead outside it), and each open is checked to be the very mount listed (its
mount id) before it is marked. Mounts the server adds later (file rules) are marked when the
sandbox's mount table changes (its mountinfo polls EPOLLPRI), or at once by `refresh()`.

Bounds: at most `max_pending` execs wait per sandbox (beyond: answered `fail` at once, counted), each
at most `ask_timeout` seconds (then `fail`), and the kernel's queue is unlimited (FAN_UNLIMITED_QUEUE:
a bounded one lets through what it cannot queue), bounded by the sandbox's threads, one blocked
event each. A process
waiting here stays killable (fanotify's wait is TASK_KILLABLE): its ask is then cancelled. The event
loop never blocks on a held exec: events are read from a non-blocking fd, the /proc reading that
describes a held exec runs in a thread with a deadline, and an answer is a write of 8 bytes.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import errno
import os
import select
import struct
import sys
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from agentcell.errors import AgentcellError
from agentcell.policy.linux import held_process
from agentcell.policy.linux.held_process import ProcessInfo
from agentcell.policy.linux.mount_api import open_in_root

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fanotify_init.argtypes = (ctypes.c_uint, ctypes.c_uint)
_libc.fanotify_init.restype = ctypes.c_int
_libc.fanotify_mark.argtypes = (ctypes.c_int, ctypes.c_uint, ctypes.c_uint64, ctypes.c_int, ctypes.c_char_p)
_libc.fanotify_mark.restype = ctypes.c_int
_libc.syscall.restype = ctypes.c_long

# <linux/fanotify.h>
FAN_CLOEXEC, FAN_NONBLOCK, FAN_CLASS_CONTENT, FAN_REPORT_TID = 0x1, 0x2, 0x4, 0x100
FAN_MARK_ADD, FAN_MARK_MOUNT = 0x1, 0x10
FAN_OPEN_EXEC_PERM, FAN_Q_OVERFLOW = 0x40000, 0x4000
FAN_ALLOW, FAN_DENY = 0x1, 0x2
FAN_MARK_REMOVE, FAN_MARK_IGNORED_MASK, FAN_MARK_FLUSH = 0x2, 0x20, 0x80
AT_FDCWD = -100
METADATA_VERSION = 3
_META = struct.Struct("=IBBHQii")  # event_len, vers, reserved, metadata_len, mask, fd, pid
_RESPONSE = struct.Struct("=iI")  # fd, response
# pid = the exec'ing thread (an exec from a non-main thread is that thread's syscall to read)
# FAN_UNLIMITED_QUEUE: a permission event the kernel cannot queue is let through, so the queue must not
# have a bound of its own; it holds at most one event per blocked thread, so the sandbox's pids limit
# bounds it (each event: ~100 bytes of kernel memory)
FAN_UNLIMITED_QUEUE = 0x10
INIT_FLAGS = FAN_CLOEXEC | FAN_NONBLOCK | FAN_CLASS_CONTENT | FAN_REPORT_TID | FAN_UNLIMITED_QUEUE
EVENT_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_LARGEFILE
MAX_GROUPS = "/proc/sys/fs/fanotify/max_user_groups"
MAX_MARKS = "/proc/sys/fs/fanotify/max_user_marks"


MAX_PENDING = 16  # execs waiting for a decision per sandbox
ANCESTORS = 4  # processes of the tree shown above the exec'ing one
DESCRIBE_S = 1.0  # the /proc reading that describes a held exec: at most this long, then asked without
READS_PER_TURN = 16  # reads of the queue per wake-up (each up to ~170 events), then the loop goes on
READ_SIZE = 4096
MOUNT_RETRIES = 3  # mountinfo read again when a mount moved between the read and the open

# The /proc reading of a held process runs here, off the loop. Its threads never wait on the held
# process (the kernel opens the program before taking the exec's locks), but if one ever did, it is
# released by the answer, which never waits for it (DESCRIBE_S).
_describers = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="exec-hold")


class ExecHoldUnavailable(AgentcellError):
    """An exec cannot be held for a decision here: no fanotify permission events, not root, or a
    fanotify limit reached. The message says which and what to change."""


def _mount_id(fd: int) -> int:
    with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
        for line in f:
            if line.startswith(b"mnt_id:"):
                return int(line.split()[1])
    raise OSError(errno.ENOENT, "no mnt_id in fdinfo")


def _unescape(field_: str) -> str:
    """mountinfo's octal escapes (\\040 for a space ...)."""
    if "\\" not in field_:
        return field_
    raw = field_.encode(errors="surrogateescape")
    out, i = bytearray(), 0
    while i < len(raw):
        if raw[i] == 0x5C and raw[i + 1:i + 4].isdigit() and len(raw[i + 1:i + 4]) == 3:
            out.append(int(raw[i + 1:i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return out.decode(errors="surrogateescape")


@dataclass(frozen=True, slots=True)
class Mount:
    id: int
    point: str  # relative to the process's root
    noexec: bool  # nothing can be exec'd from it (the kernel refuses before opening)
    fstype: str


def mounts(host_pid: int) -> list[Mount]:
    """Every mount the process sees, in mount order (/proc/<pid>/mountinfo)."""
    with open(f"/proc/{host_pid}/mountinfo", "rb") as f:
        text = f.read().decode(errors="surrogateescape")
    out = []
    for line in text.splitlines():
        fields, _, rest = line.partition(" - ")
        parts = fields.split(" ")
        if len(parts) > 5:
            out.append(Mount(int(parts[0]), _unescape(parts[4]), "noexec" in parts[5].split(","),
                             rest.split(" ", 1)[0]))
    return out


def _limit(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "?"


def new_group() -> int:
    """A fanotify group for exec permission events; ExecHoldUnavailable saying why not."""
    fd = _libc.fanotify_init(INIT_FLAGS, EVENT_FLAGS)
    if fd >= 0:
        return int(fd)
    e = ctypes.get_errno()
    if e == errno.EMFILE:
        raise ExecHoldUnavailable(
            f"fanotify_init: host root's fanotify groups are all in use (fs.fanotify.max_user_groups = "
            f"{_limit(MAX_GROUPS)}; each ask-mode sandbox holds one, the behaviour record one per sandbox) "
            "or the server is out of file descriptors: raise the limit (sysctl -w fs.fanotify.max_user_groups=N) "
            "or the server's RLIMIT_NOFILE")
    if e == errno.EPERM:
        raise ExecHoldUnavailable("fanotify_init: fanotify permission events need CAP_SYS_ADMIN: run the server "
                                  "as root (exec \"ask\" is not available to a rootless server)")
    if e in (errno.ENOSYS, errno.EINVAL):
        raise ExecHoldUnavailable(f"fanotify_init: {os.strerror(e)}: this kernel has no fanotify permission "
                                  "events (CONFIG_FANOTIFY and CONFIG_FANOTIFY_ACCESS_PERMISSIONS are needed)")
    raise ExecHoldUnavailable(f"fanotify_init: {os.strerror(e)}")


def mark_mount(group: int, fd: int) -> None:
    """Hold the execs of the mount `fd` lies on; ExecHoldUnavailable when it cannot be."""
    # through the magic link: fanotify_mark takes no O_PATH fd as dirfd alone, and "." only for a directory
    where = f"/proc/self/fd/{fd}".encode()
    if _libc.fanotify_mark(group, FAN_MARK_ADD | FAN_MARK_MOUNT, FAN_OPEN_EXEC_PERM, AT_FDCWD, where) == 0:
        return
    e = ctypes.get_errno()
    if e == errno.ENOSPC:
        raise ExecHoldUnavailable(
            f"fanotify_mark: host root's fanotify marks are all in use (fs.fanotify.max_user_marks = "
            f"{_limit(MAX_MARKS)}; an ask-mode sandbox takes one per mount): raise it "
            "(sysctl -w fs.fanotify.max_user_marks=N)")
    if e == errno.EINVAL:
        raise ExecHoldUnavailable(f"fanotify_mark({where.decode()}): EINVAL: this kernel has no FAN_OPEN_EXEC_PERM (Linux 5.0 or newer is needed)")
    raise OSError(e, f"fanotify_mark(FAN_MARK_MOUNT): {os.strerror(e)}")


def available() -> str | None:
    """None when execs can be held on this host; else why not (for `agentcell doctor` and for refusing
    a policy with exec "ask" up front). Costs a group's creation and release (~10 ms)."""
    try:
        group = new_group()
    except ExecHoldUnavailable as e:
        return str(e)
    try:
        root = os.open("/", os.O_PATH | os.O_CLOEXEC)
        try:
            mark_mount(group, root)
        finally:
            os.close(root)
    except (ExecHoldUnavailable, OSError) as e:
        return str(e)
    finally:
        os.close(group)
    return None


@dataclass(eq=False)
class HeldExec:
    """One exec waiting for a decision.

    `fd` is the file the kernel is opening for the exec (read-only, valid until the exec is answered):
    the decision binds it (its inode), not a path. `path` is where it is in the sandbox (readlink of
    the fd: a file deleted meanwhile ends in " (deleted)"), `filename`/`argv` what the process passed
    to execve (its claim, read from its memory; None when unreadable). For the loader or a script's
    interpreter, `path` is that file while `filename`/`argv` are still the exec's. `tree` is the
    process itself then its ancestors up to the sandbox's init.
    """

    fd: int
    host_pid: int  # the exec'ing thread, host numbering
    pid: int | None = None  # ... in the sandbox
    path: str = ""
    filename: str | None = None
    argv: list[str] | None = None
    tree: list[ProcessInfo] = field(default_factory=list)
    at: float = field(default_factory=time.time)
    outcome: str = "pending"  # then: asked (ask returned), failed (ask raised), timeout, exited, closed

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "filename": self.filename, "argv": self.argv, "pid": self.pid,
                "tree": [p.to_json() for p in self.tree]}


# the verdict on the file being opened for exec: "allow", "deny" or "ask" (True: ask, False: allow)
NeedsAsking = Callable[[int], "bool | str"]
# decides a held exec: "allow" or "deny" (None: allow)
Ask = Callable[[HeldExec], Awaitable["str | None"]]


@dataclass
class HoldStats:
    events: int = 0  # exec opens seen
    asked: int = 0  # ... held for ask()
    overflowed: int = 0  # ... that needed asking with max_pending already waiting: let on at once
    foreign: int = 0  # ... by a process outside the sandbox's pid namespace: let on at once
    timeouts: int = 0  # asks cut by ask_timeout
    exited: int = 0  # asks cut because the process died (killed)
    errors: int = 0  # needs_asking or ask raised: answered `fail`
    denied: int = 0  # refused at once by the verdict
    queue_overflows: int = 0  # the kernel's queue overflowed (it let those execs on itself)


class ExecHold:
    """The exec hold of one sandbox (see the module's doc). Use in a running event loop:

        hold = ExecHold(host_pid, needs_asking, ask, ask_timeout=60)
        hold.start()          # marks the mounts; ExecHoldUnavailable if it cannot
        ...
        hold.refresh()        # after the server changed the sandbox's mounts
        await hold.close()    # lets every held exec on, releases the group
    """

    def __init__(self, host_pid: int, needs_asking: NeedsAsking, ask: Ask, *, ask_timeout: float,
                 max_pending: int = MAX_PENDING, name: str = "", fail: str = "allow") -> None:
        """`fail`: the answer of an exec that could not be decided (a flood past `max_pending`, the
        timeout, a failed check or ask, close()): "allow" where something behind enforces anyway, "deny"
        where this is the gate itself (policy/linux/enforcer.py)."""
        self.fail = fail
        self.host_pid = host_pid
        self.needs_asking = needs_asking
        self.ask = ask
        self.ask_timeout = ask_timeout
        self.max_pending = max_pending
        self.name = name or f"sandbox pid {host_pid}"
        self.stats = HoldStats()
        self.marked = 0  # mounts marked by the last start/refresh
        self.refreshes = 0  # refreshes done on the sandbox's mount table changing
        self._mount_watch: tuple[int, select.epoll] | None = None  # its mountinfo, polled for changes
        self._group = -1
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pending: dict[int, tuple[HeldExec, asyncio.Task[None]]] = {}  # event fd -> ...
        self._pidns = -1  # the sandbox's pid namespace (inode) and its level in NSpid
        self._depth = 0
        self._closed = False

    # -- life --------------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        ns = held_process.status(self.host_pid)
        if ns is None:
            raise ExecHoldUnavailable(f"{self.name}: its init (host pid {self.host_pid}) is gone")
        self._depth = len(ns.get("NSpid", "").split()) - 1
        self._pidns = os.stat(f"/proc/{self.host_pid}/ns/pid").st_ino
        self._group = new_group()
        try:
            self.refresh()
        except BaseException:
            os.close(self._group)
            self._group = -1
            raise
        self._loop.add_reader(self._group, self._readable)
        self._watch_mounts()

    def refresh(self) -> int:
        """Mark every mount the sandbox has now (again: marking is idempotent; a mount that went away
        took its mark with it). Returns how many. Call it after the server mounted anything in the
        sandbox: an exec from an unmarked mount is not held (BPF refuses it unless allowed)."""
        root = os.open(f"/proc/{self.host_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for _attempt in range(MOUNT_RETRIES):
                missed = self._mark_all(root)
                if not missed:
                    return self.marked
            raise ExecHoldUnavailable(f"{self.name}: mounts {', '.join(missed)} could not be reached to be "
                                      "marked (moved while being marked, again and again)")
        finally:
            os.close(root)

    def _mark_all(self, root: int) -> list[str]:
        """Mark what can be reached; the mount points that could not be (reachable in principle)."""
        listed = mounts(self.host_pid)
        # a mount covered by a later one on the same mount point cannot be reached by any path
        top = {m.point: m.id for m in listed}
        missed, marked = [], 0
        for m in listed:
            if top[m.point] != m.id or m.noexec:
                continue
            try:
                fd = open_in_root(root, m.point)
            except OSError:
                missed.append(m)  # moved, or covered by a mount above one of its parents
                continue
            try:
                if _mount_id(fd) != m.id:
                    missed.append(m)
                    continue
                mark_mount(self._group, fd)
                marked += 1
            finally:
                os.close(fd)
        self.marked = marked
        return [m.point for m in missed if not _covered(m, listed)]

    def _watch_mounts(self) -> None:
        """Refresh on its own when the sandbox's mount table changes (the server mounting a file rule):
        /proc/<pid>/mountinfo polls EPOLLPRI then. Between the mount and the refresh (one loop turn),
        an exec from the new mount is not held: BPF refuses it unless allowed. Callers that mount call
        refresh() themselves right after, which closes that window."""
        assert self._loop is not None
        info = os.open(f"/proc/{self.host_pid}/mountinfo", os.O_RDONLY | os.O_CLOEXEC)
        ep = select.epoll()
        ep.register(info, select.EPOLLPRI)
        self._mount_watch = (info, ep)
        self._loop.add_reader(ep.fileno(), self._mounts_changed)

    def _mounts_changed(self) -> None:
        if self._mount_watch is None:
            return
        # Only a change wakes this epoll up, but the loop's own epoll, polling it, has acknowledged the
        # change already (the kernel reports a mountinfo change once): what is left is drained, not read.
        self._mount_watch[1].poll(0)
        try:
            self.refresh()
            self.refreshes += 1
        except (ExecHoldUnavailable, OSError) as e:
            _log(f"{self.name}: its mounts changed and could not all be marked again: {e}")

    async def close(self) -> None:
        """Let every held exec on (their asks are cancelled) and release the group."""
        if self._closed:
            return
        self._closed = True
        if self._group >= 0 and self._loop is not None:
            self._loop.remove_reader(self._group)
        if self._mount_watch is not None and self._loop is not None:
            info, ep = self._mount_watch
            self._loop.remove_reader(ep.fileno())
            ep.close()
            os.close(info)
            self._mount_watch = None
        tasks = []
        for held, task in list(self._pending.values()):
            held.outcome = "closed"
            task.cancel()
            self._answer(held, self.fail)
            tasks.append(task)
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task
        if self._group >= 0:
            group, self._group = self._group, -1
            # closing a group waits for the kernel's SRCU grace period (~10 ms): off the loop. The
            # kernel lets on whatever is still queued, unread.
            await asyncio.get_running_loop().run_in_executor(None, os.close, group)

    async def __aenter__(self) -> ExecHold:
        self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- what the kernel need not ask about --------------------------------------------------------------
    def ignore(self, fd: int) -> None:
        """No more events for the file of `fd` (allowed for good): an ignore mark on its inode, which the
        kernel drops when the file is modified (the next exec of it is judged again)."""
        if self._group < 0:
            return
        if _libc.fanotify_mark(self._group, FAN_MARK_ADD | FAN_MARK_IGNORED_MASK, FAN_OPEN_EXEC_PERM, fd, None) != 0:
            err = ctypes.get_errno()
            _log(f"{self.name}: an ignore mark failed ({os.strerror(err)}): that file is judged at each exec")

    def ignore_only(self, fds: Iterable[int]) -> None:
        """Exactly these files ignored: every inode mark of the group removed, then these marked."""
        if self._group < 0:
            return
        _libc.fanotify_mark(self._group, FAN_MARK_FLUSH, 0, AT_FDCWD, None)  # inode marks; mounts stay
        for fd in fds:
            self.ignore(fd)

    @property
    def pending(self) -> list[HeldExec]:
        return [held for held, _ in self._pending.values()]

    # -- events ------------------------------------------------------------------------------------
    def _readable(self) -> None:
        for _ in range(READS_PER_TURN):
            try:
                buf = os.read(self._group, READ_SIZE)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EAGAIN, errno.EMFILE, errno.ENFILE):
                    # out of fds: the kernel let that event on itself; the others wait for the next turn
                    return
                raise
            pos = 0
            while pos + _META.size <= len(buf):
                length, vers, _, _, mask, fd, pid = _META.unpack_from(buf, pos)
                if vers != METADATA_VERSION or length < _META.size:
                    break
                pos += length
                if mask & FAN_Q_OVERFLOW:
                    self.stats.queue_overflows += 1
                if fd >= 0:
                    self._event(fd, pid)

    def _event(self, fd: int, tid: int) -> None:
        self.stats.events += 1
        held = HeldExec(fd, tid)
        try:
            verdict = self.needs_asking(fd)
            verdict = {True: "ask", False: "allow"}.get(verdict, verdict)  # type: ignore[call-overload]
        except Exception as e:  # a broken check must not hold the sandbox
            self.stats.errors += 1
            _log(f"{self.name}: the exec check failed ({e!r}): answered {self.fail}")
            verdict = self.fail
        if verdict != "ask":
            if verdict == "deny":
                self.stats.denied += 1
            self._answer(held, "deny" if verdict == "deny" else "allow")
        elif self._closed:
            self._answer(held, self.fail)
        elif not self._in_sandbox(tid):
            self.stats.foreign += 1
            self._answer(held, "allow")
        elif len(self._pending) >= self.max_pending:
            self.stats.overflowed += 1
            self._answer(held, self.fail)
        else:
            self.stats.asked += 1
            assert self._loop is not None
            with contextlib.suppress(OSError):  # here, not in _describe: the fd is answered and closed here
                held.path = os.readlink(f"/proc/self/fd/{fd}")
            self._pending[fd] = (held, self._loop.create_task(self._hold(held)))

    def _in_sandbox(self, tid: int) -> bool:
        """The host's own processes (the server reaching in through /proc/<pid>/root) are never held."""
        try:
            return os.stat(f"/proc/{tid}/ns/pid").st_ino == self._pidns
        except OSError:
            return False  # gone already

    async def _hold(self, held: HeldExec) -> None:
        assert self._loop is not None
        deadline = self._loop.time() + self.ask_timeout
        died: asyncio.Future[None] = self._loop.create_future()
        pidfd = self._watch_exit(held.host_pid, died)
        asking: asyncio.Future[str | None] | None = None
        verdict = self.fail
        try:
            try:
                found = await asyncio.wait_for(asyncio.shield(self._loop.run_in_executor(
                    _describers, self._describe, held.host_pid)), min(DESCRIBE_S, self.ask_timeout))
                for name, value in found.items():
                    setattr(held, name, value)
            except Exception as e:  # asked with what is known
                if not isinstance(e, (TimeoutError, OSError)):
                    _log(f"{self.name}: describing a held exec failed: {e!r}")
            if died.done():  # killed (or gone) before it could be asked about
                held.outcome = "exited"
                self.stats.exited += 1
                return
            asking = asyncio.ensure_future(self.ask(held))
            remaining = max(0.0, deadline - self._loop.time())
            done, _ = await asyncio.wait({asking, died}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            if asking in done:
                exc = asking.exception()
                held.outcome = "asked" if exc is None else "failed"
                if exc is not None:
                    self.stats.errors += 1
                    _log(f"{self.name}: ask failed ({exc!r}): answered {self.fail}")
                else:
                    verdict = "deny" if asking.result() == "deny" else "allow"
            elif died in done:
                held.outcome = "exited"
                self.stats.exited += 1
            else:
                held.outcome = "timeout"
                self.stats.timeouts += 1
        finally:
            if asking is not None and not asking.done():
                asking.cancel()
                with contextlib.suppress(BaseException):
                    await asking
            if pidfd >= 0:
                self._loop.remove_reader(pidfd)
                os.close(pidfd)
            self._answer(held, verdict)

    def _watch_exit(self, tid: int, died: asyncio.Future[None]) -> int:
        """A pidfd of the exec'ing process, readable once it has died (SIGKILL while held); -1 if none."""
        assert self._loop is not None
        fields = held_process.status(tid)
        try:
            pidfd = os.pidfd_open(int(fields["Tgid"]) if fields else tid)
        except (OSError, KeyError, ValueError):
            if not died.done():
                died.set_result(None)  # gone already
            return -1
        self._loop.add_reader(pidfd, lambda: died.done() or died.set_result(None))
        return pidfd

    def _describe(self, tid: int) -> dict[str, Any]:
        """What /proc says of the exec'ing thread (in a thread: reads of another process's memory and
        status), as HeldExec's fields; the loop sets them if they come in time."""
        fields = held_process.status(tid)
        if fields is None:
            return {}
        pid = held_process.sandbox_pid(fields, self._depth)
        filename, argv = held_process.exec_claim(tid)
        tgid = int(fields.get("Tgid", tid))
        me = ProcessInfo(tgid, pid if tgid == tid else held_process.sandbox_pid(
            held_process.status(tgid) or {}, self._depth), fields.get("Name", "").strip(), held_process.cmdline(tgid))
        tree = [me, *held_process.ancestors(tgid, self._depth, self._pidns, ANCESTORS)]
        return {"pid": pid, "filename": filename, "argv": argv, "tree": tree}

    def _answer(self, held: HeldExec, verdict: str = "allow") -> None:
        """Answer the exec (FAN_DENY: it fails with EPERM) and close its fd: once."""
        if held.fd < 0:
            return
        fd, held.fd = held.fd, -1
        self._pending.pop(fd, None)
        if held.outcome == "pending":
            held.outcome = "let on"
        try:
            if self._group >= 0:
                os.write(self._group, _RESPONSE.pack(fd, FAN_DENY if verdict == "deny" else FAN_ALLOW))
        except OSError as e:
            if e.errno != errno.ENOENT:  # ENOENT: the kernel dropped the event (its process was killed)
                _log(f"{self.name}: answering an exec failed: {e!r}")
        finally:
            os.close(fd)


def _covered(mount: Mount, listed: list[Mount]) -> bool:
    """Whether a later mount hides this one's mount point from every path (mounted on it or above)."""
    later = listed[listed.index(mount) + 1:]
    return any(m.point == mount.point or m.point == "/" or mount.point.startswith(m.point.rstrip("/") + "/")
               for m in later)


def _log(message: str) -> None:
    print(f"agentcell: exec hold: {message}", file=sys.stderr, flush=True)
