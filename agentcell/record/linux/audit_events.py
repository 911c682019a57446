"""The process collector of the behaviour record (issue 10): execs, exits and refused operations of
every process of a sandbox, observed from the host.

Mechanisms (docs/architecture.md, "The behaviour record", has the measurements behind the choice):

* execs, exits and refused path syscalls: eBPF programs (record/linux/kernel_trace.py) on the sched_process_exec and
  sched_process_exit tracepoints, and for the refusals (``denials``) on cap_capable ("failures", the
  default: a refusal is seen at the failed capability check that makes it, so an allowed call costs
  nothing; read-only mounts' EROFS is not seen) or on sys_exit ("syscalls": every EACCES/EPERM/EROFS of
  a path syscall, at the price of every syscall of the host taking the kernel's slow path). With the
  tracer, no audit exit rule and a task rule that gives the sandbox processes no audit context: their
  syscalls keep the kernel's fast path.
* without the tracer (no clang, libbpf or BTF), or with ``trace_source="audit"``: audit rules on
  syscall exit, limited to the server's host uid range (every sandbox process runs as one of its ids),
  keyed ``agentcell:<first>-<last>:<what>`` so a server removes its own rules at close and a dead
  server's stale ones at start. The kernel writes the SYSCALL record (host pid, ppid, uid, comm, exe),
  EXECVE (argv), CWD and PATH records of the call; seccomp refusals come as SECCOMP records (the
  sandbox's filter is loaded with SECCOMP_FILTER_FLAG_LOG; RET_ERRNO is in
  /proc/sys/kernel/seccomp/actions_logged by default). Either way the kernel hands over an exec before the new program runs a single
  instruction: a `true` that exits at once is recorded too.
* seccomp refusals, with or without the tracer: SECCOMP audit records, which the kernel writes for a
  filter loaded with SECCOMP_FILTER_FLAG_LOG whether or not the process has an audit context (the
  refusals of clone3 and the other "not implemented" calls come from a second filter without the flag:
  glibc tries clone3 at every fork).
* Landlock refusals: ABI 7 kernels (6.15+) write LANDLOCK_ACCESS records; landlock.py asks for them
  after exec too (LANDLOCK_RESTRICT_SELF_LOG_NEW_EXEC_ON). With the tracer they come without a syscall
  context: tied to a sandbox by their domain, paired with the tracer's refusal of the same path where
  the tracer sees it (denials="syscalls"); else alone, without the process (no pid, no comm).
* exits: with the tracer, its exit events (written only for processes it saw exec, status as wait(2)
  has it); without it, the proc connector (record/linux/audit_proc.py), which sends every exit of the host.

The records are read as the audit daemon when none is registered (then nothing reaches the kernel
log), or from the read-only multicast group next to the operator's auditd (whose log then holds the
sandboxes' records too). The collector never lets the kernel block a task for it: as the daemon it sets
a large backlog with no wait (a full backlog drops records, which the kernel counts and we report).
The audit status is one for the host and every server's collector may change it, so it is a shared host
setting (backends/linux/host_settings.py): the first collector to hold it saves the original, the last
one to let go puts it back (also when the others were killed), whoever was the daemon.

Bounds: each sandbox gets `budget` events per `window_s`; what it causes beyond that is counted and
reported as one ``record.dropped`` per window, and a sandbox far over budget is excluded in the
kernel (an exclude rule on its uids) for the rest of the window, so a flood of denied syscalls costs
neither the kernel's queue nor the server's loop. A netlink overrun (ENOBUFS) and the kernel's own
lost counter are reported to every watched sandbox, since the lost records cannot be attributed.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import struct
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pyseccomp

from agentcell.backends.linux import host_settings, uids
from agentcell.errors import BackendUnavailableError
from agentcell.record.events import EventSink, event
from agentcell.record.linux import audit_netlink as an
from agentcell.record.linux import audit_records as ar
from agentcell.record.linux.audit_proc import Exit, ProcConnector
from agentcell.record.linux.kernel_trace import DENIALS, Denial, Exec, KernelTrace, KernelTraceUnavailable
from agentcell.record.linux.target import WatchTarget, nspid

SANDBOX_UID = 1000  # rootfs.SANDBOX_UID: what the sandbox's user id is inside
EXECVE, EXECVEAT = 59, 322
# syscalls that take a path and may be refused with EACCES/EPERM/EROFS (x86_64 numbers)
PATH_SYSCALLS = {
    2: "open", 257: "openat", 437: "openat2", 85: "creat", 76: "truncate", 83: "mkdir", 258: "mkdirat",
    87: "unlink", 263: "unlinkat", 84: "rmdir", 82: "rename", 264: "renameat", 316: "renameat2",
    86: "link", 265: "linkat", 88: "symlink", 266: "symlinkat", 90: "chmod", 268: "fchmodat",
    452: "fchmodat2", 92: "chown", 94: "lchown", 260: "fchownat", 133: "mknod", 259: "mknodat",
    132: "utime", 235: "utimes", 280: "utimensat", 188: "setxattr", 189: "lsetxattr",
}
_OPEN_FLAGS_ARG = {2: "a1", 257: "a2"}  # open(path, flags), openat(dirfd, path, flags)
_WRITE_INTENT = 0o1 | 0o2 | 0o100 | 0o1000  # O_WRONLY | O_RDWR | O_CREAT | O_TRUNC
_OPENS = frozenset({2, 257, 437, 85})  # open, openat, openat2, creat: the tracer gives their flags
_EACCES, _EPERM, _EROFS = 13, 1, 30
# the record's code is the filter's action only (its errno is not logged)
_SECCOMP_ACTIONS = {0x00050000: "errno", 0x80000000: "kill_process", 0x00000000: "kill_thread", 0x00030000: "trap"}
# refused by the filter but not worth a record: glibc tries clone3 for every thread and spawn and
# falls back to clone (seccomp_filter.NOT_IMPLEMENTED)
_NOT_DENIALS = frozenset({"clone3"})
# the agent's own attempts, refused as intended, on every command: raising a child's OOM score
_AGENT_NOISE = re.compile(r"^/proc/(self|\d+)/oom_score_adj$")
_KEY_RANGE = re.compile(r"^agentcell:(\d+)-(\d+):")  # the uid range in a rule's key
_SUPPRESS_FACTOR = 4  # a sandbox past budget * this in one window is excluded in the kernel
LANDLOCK_PAIR_S = 0.25  # with the tracer: a refusal and Landlock's record of it, paired within this long
READ_DELAY_S = 0.02  # records are read this long after they arrive, in batches (see _read_later) ...
SLICE_S = 0.001  # ... for this long at a time, so that a request never waits longer behind them
UNWATCH_READ_S = 0.05  # at a sandbox's end, what is queued is read for this long at most
TRACE_READ = 64  # the tracer's events parsed at a time (~1 ms), the rest left in its ring till the next
AUDIT_KEY = "kernel.audit"  # the audit status in the registry of shared host settings


@dataclass
class _Sandbox:
    target: WatchTarget
    window_start: float = 0.0
    count: int = 0
    dropped: int = 0
    suppressed: list[an.Rule] | None = None  # its exclude rules while it is suppressed
    procs: set[int] = field(default_factory=set)  # host pids seen exec'ing, for their exits
    pid_level: int = 0  # its pid namespace's level (where its numbers stand in a traced exec's pids)
    traced_dropped: dict[int, int] = field(default_factory=dict)  # host uid -> events the tracer counted
    # with the tracer: EACCES/EPERM refusals and Landlock's records, each waiting for the other a moment
    held_refusals: deque[tuple[float, Denial]] = field(default_factory=deque)
    held_walls: deque[tuple[float, ar.Record]] = field(default_factory=deque)


@dataclass
class _Proc:
    sandbox: _Sandbox
    start: float
    comm: str
    pid: int | None
    ppid: int | None


class AuditCollector:
    """See the module docstring. `uid_first`..`uid_last`: the server's whole host uid range."""


    def __init__(self, sink: EventSink, uid_first: int, uid_last: int, *, budget: int = 1000,
                 window_s: float = 1.0, backlog: int = 8192, exempt_host: bool = True,
                 trace_source: str = "auto", denials: str = "failures") -> None:
        """`trace_source`: "bpf" (the kernel tracer, or fail), "audit" (audit rules), "auto" (the
        tracer where it loads, else audit). `denials`: what the tracer sees of refused path syscalls
        (kernel_trace.DENIALS: "failures" or "syscalls", see the module docstring)."""
        if trace_source not in ("auto", "bpf", "audit"):
            raise ValueError(f"trace_source must be auto, bpf or audit, not {trace_source!r}")
        if denials not in DENIALS:
            raise ValueError(f"denials must be one of {', '.join(DENIALS)}, not {denials!r}")
        self.trace_source = trace_source
        self.denials = denials
        self._trace: KernelTrace | None = None
        self._traced: list[Exec | Denial | Exit] = []  # read from the tracer, not handled yet
        self._ring_more = False  # the last read took its limit: the ring may hold more
        # with the tracer, Landlock's records come alone (no syscall context): a refusal the tracer saw
        # and Landlock's record of it wait LANDLOCK_PAIR_S for each other (one event, with the blockers)
        self._domains: OrderedDict[str, _Sandbox] = OrderedDict()  # Landlock domain -> its sandbox
        self._unplaced: OrderedDict[str, list[ar.Record]] = OrderedDict()  # records of a domain not known yet
        self._holding: dict[str, _Sandbox] = {}  # sandboxes with a refusal or a Landlock record held
        self._held_timer: asyncio.TimerHandle | None = None
        self._trace_lost = 0
        self.sink = sink
        self.first, self.last = uid_first, uid_last
        self.budget, self.window_s, self.backlog = budget, window_s, backlog
        self.exempt_host = exempt_host
        self.key = f"agentcell:{uid_first}-{uid_last}:"
        self._key_b = f'key="{self.key}'.encode()
        self._names: dict[int, str | None] = {}  # syscall numbers' names
        self._by_uid: dict[int, _Sandbox] = {}
        self._by_id: dict[str, _Sandbox] = {}
        self._procs: dict[int, _Proc] = {}
        self._early_exits: OrderedDict[int, tuple[Exit, float]] = OrderedDict()  # exits seen before their exec
        self._pending: OrderedDict[int, tuple[float, list[ar.Record]]] = OrderedDict()  # serial -> records
        self._ctl: an.AuditSocket | None = None
        self._reader: an.AuditSocket | None = None
        self._batch: an.BatchReader | None = None  # reads _reader's records, many per system call
        self._exits: ProcConnector | None = None
        self._holder: host_settings.Holder | None = None  # this collector's hold on the audit status
        self.daemon = False  # registered as the audit daemon (else: the multicast group)
        self._rules: list[an.Rule] = []
        self._tick: asyncio.TimerHandle | None = None
        self._reading: dict[int, Callable[[], bool | None]] = {}  # fd -> its handler, while read (_read_later)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.lost_overruns = 0  # ENOBUFS on our socket
        self._kernel_lost = 0
        self.stats = {"records": 0, "events": 0, "dropped": 0}

    # -- lifecycle -----------------------------------------------------------------------------

    def rules(self) -> list[an.Rule]:
        uids = ((an.F_ARCH, an.OP_EQ, an.ARCH_X86_64), (an.F_UID, an.OP_GE, self.first),
                (an.F_UID, an.OP_LE, self.last))
        if self._trace is not None:  # the kernel tracer has execs and refusals: no exit rule at all
            return []
        rules = [an.Rule(an.FILTER_EXIT, an.ALWAYS, (EXECVE, EXECVEAT), (*uids, (an.F_SUCCESS, an.OP_EQ, 1)),
                         self.key + "exec")]
        for err in (_EACCES, _EPERM, _EROFS):
            rules.append(an.Rule(an.FILTER_EXIT, an.ALWAYS, tuple(PATH_SYSCALLS), (*uids, (an.F_EXIT, an.OP_EQ, -err)),
                                 self.key + "deny"))
        return rules

    def host_exemption(self) -> list[an.Rule]:
        """A task rule: a process forked with a host id below every agentcell range (uids.AUTO_START,
        or this server's range if an operator put it lower) gets no audit context, so the host's own
        processes keep the kernel's fast syscall path. Sandbox processes (forked by their agent after it
        took the sandbox's ids), of this server or another, are audited; the agent itself (pid 1, forked
        as root by the zygote) is not."""
        return [an.Rule(an.FILTER_TASK, an.NEVER, (), ((an.F_UID, an.OP_LT, min(self.first, uids.AUTO_START)),),
                        self.key + "host")]

    @property
    def traced(self) -> bool:
        """Whether the kernel tracer records execs and refusals (else audit's exit rules do)."""
        return self._trace is not None

    @property
    def sees_failed_syscalls(self) -> bool:
        """Whether every refused path syscall is seen at its exit (read-only mounts' EROFS too, the
        path as the call named it, Landlock's refusals with their process): audit's rules or the
        tracer's sys_exit program."""
        return self._trace is None or self.denials == "syscalls"

    def untraced(self) -> list[an.Rule]:
        """With the kernel tracer, a task rule: the server's sandbox processes get no audit context,
        so their syscalls keep the kernel's fast path (an audit context costs every syscall, +165 ns
        to +960 ns measured, whatever the rules)."""
        return [an.Rule(an.FILTER_TASK, an.NEVER, (), ((an.F_UID, an.OP_GE, self.first), (an.F_UID, an.OP_LE, self.last)),
                        self.key + "untraced")]

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            self._ctl = an.AuditSocket()
            status = self._ctl.status()
        except OSError as e:
            raise BackendUnavailableError(f"cannot reach the kernel's audit subsystem ({e}); the behaviour "
                                          "record needs CONFIG_AUDITSYSCALL and host root") from None
        if status.enabled == 2:
            raise BackendUnavailableError("the kernel's audit configuration is locked (auditctl -e 2): its rules "
                                          "cannot be changed until reboot, so the behaviour record cannot use it")
        if status.failure == 2:
            raise BackendUnavailableError(
                "the kernel's audit failure mode is panic (auditctl -f 2): a sandbox flooding refused syscalls "
                "would panic the host; set auditctl -f 1 or run the server without the kernel audit record")
        self.remove_stale()
        # registered before anything changes: the original is saved (by the first collector on the host),
        # and no other server's stop can put it back under us
        self._holder = host_settings.Holder(f"audit-{self.first}-{self.last}")
        self._holder.hold(audit_setting())
        # someone else audits this host: leave their tasks alone
        theirs = [r for r in self._ctl.rules()
                  if not an.rule_key(r).startswith("agentcell:") and not self._our_exclusion(r, any_server=True)]
        foreign = bool(theirs)
        if any(an.rule_head(r)[:2] == (an.FILTER_TASK, an.NEVER) for r in theirs):
            print("agentcell audit: the host's audit rules include `-a never,task` (a common default): processes "
                  "forked under it have no audit context, so sandbox execs and refusals may go unrecorded; "
                  "remove that rule to record them", file=sys.stderr)
        try:
            if self.trace_source != "audit":
                try:
                    self._trace = self._load_tracer()
                except KernelTraceUnavailable as e:
                    if self._trace is not None:
                        self._trace.close()
                        self._trace = None
                    if self.trace_source == "bpf":
                        raise
                    print(f"agentcell audit: execs and refusals recorded by audit rules instead of the kernel tracer "
                          f"({e}); every syscall of a sandbox then pays audit's cost", file=sys.stderr)
            if self._trace is None:  # (the tracer writes the exits of the processes it saw exec)
                self._exits = ProcConnector()
            if status.pid == 0:
                try:
                    self._become_daemon(status)
                except an.AuditError as e:
                    if e.errno != errno.EEXIST:
                        raise
                    if self._reader is not None:
                        self._reader.close()
                    self._reader = None  # another daemon registered just now: read next to it
            if self._reader is None:  # the operator's auditd: read next to it, change nothing of its settings
                self._reader = an.AuditSocket(groups=1 << (an.AUDIT_NLGRP_READLOG - 1))
                if not status.enabled:
                    self._ctl.set_status(enabled=1)
            self._reader.sock.setblocking(False)
            rules = self.rules()
            if self.daemon:  # nobody else reads them: the kernel need not write what we never read
                rules.append(an.Rule(an.FILTER_EXCLUDE, an.NEVER, (), (
                    (an.F_MSGTYPE, an.OP_EQ, an.PROCTITLE), (an.F_UID, an.OP_GE, self.first),
                    (an.F_UID, an.OP_LE, self.last))))  # no key: see _suppress
            if self.daemon and not foreign and self.exempt_host:
                rules += self.host_exemption()
            if self._trace is not None and not foreign:  # (an operator's rules may want these processes)
                rules += self.untraced()
            for rule in rules:
                self._ctl.add_rule(rule)
                self._rules.append(rule)
        except BaseException:
            await self.close()
            raise
        self._kernel_lost = self._ctl.status().lost
        self._read_later(self._reader.fileno(), self._on_audit)
        if self._exits is not None:
            self._read_later(self._exits.fileno(), self._on_exits)
        if self._trace is not None:
            self._read_later(self._trace.fileno(), self._on_traced)
        self._tick = self._loop.call_later(self.window_s, self._on_tick)

    def _load_tracer(self) -> KernelTrace:
        """The kernel tracer; where the kernel has no cap_capable tracepoint (before 6.14) or refuses the
        program that reads it, the one that sees refusals at every syscall's exit, said so."""
        budget = self.budget * _SUPPRESS_FACTOR
        try:
            return KernelTrace(self.first, self.last, budget=budget, denials=self.denials)
        except KernelTraceUnavailable as e:
            if self.denials != "failures":
                raise
            trace = KernelTrace(self.first, self.last, budget=budget, denials="syscalls")
            print(f"agentcell audit: refused file operations are seen at every syscall's exit ({e}): every "
                  "syscall of the host pays the kernel's slow path while this server runs", file=sys.stderr)
            self.denials = "syscalls"
            return trace

    def _read_later(self, fd: int, handler: Callable[[], bool | None]) -> None:
        """Read `fd` in batches, READ_DELAY_S after it becomes readable: the records of a command
        arrive with its output, and the loop serves the output first (a parse costs ~50-170 µs of
        Python per exec, which would otherwise sit on the command's round trip)."""
        assert self._loop is not None
        loop = self._loop
        self._reading[fd] = handler

        def readable() -> None:
            loop.remove_reader(fd)
            loop.call_later(READ_DELAY_S, drain)

        def drain() -> None:
            if self._reading.get(fd) is not handler:
                return  # the socket was swapped or closed meanwhile
            if handler():  # its slice is up and more is queued: on after what else is ready
                loop.call_soon(drain)
            else:
                loop.add_reader(fd, readable)

        loop.add_reader(fd, readable)

    def _stop_reading(self, fd: int) -> None:
        assert self._loop is not None
        self._reading.pop(fd, None)
        self._loop.remove_reader(fd)

    def _become_daemon(self, status: an.Status) -> None:
        assert self._ctl is not None
        self._reader = an.AuditSocket()
        # registered from the reading socket: the kernel sends records to the port that registered
        self._reader.set_status(pid=os.getpid())
        self.daemon = True
        # No task ever waits for us (wait 0); a burst queues in the kernel rather than being lost; a
        # full backlog is counted silently (failure 0), not written to the kernel log for every record.
        self._ctl.set_status(enabled=1, failure=0, backlog_limit=max(self.backlog, status.backlog_limit),
                             backlog_wait_time=0)

    def _take_over(self, status: an.Status) -> None:
        """Become the daemon: records would otherwise go to the kernel log."""
        assert self._loop is not None and self._reader is not None
        self._stop_reading(self._reader.fileno())
        self._reader.close()
        self._become_daemon(status)
        assert self._reader is not None
        self._reader.sock.setblocking(False)
        self._read_later(self._reader.fileno(), self._on_audit)

    def _collector_asks(self, body: bytes) -> bool:
        """Whether the process an AUDIT_REPLACE names (the one the kernel refused the daemon's role) is
        another agentcell server's collector: it holds the audit setting before it asks (start), and when
        refused it reads the multicast group, so the role stays here. Without this, two servers started
        at once took each other for auditd, and the daemon gave up its role and its rules."""
        if len(body) < 4:
            return False
        pid = struct.unpack("=I", body[:4])[0]
        try:
            return any(h.get("pid") == pid for h in host_settings.holders(AUDIT_KEY).values())
        except (OSError, host_settings.HostSettingsError):
            return False

    def _step_aside(self) -> None:
        """Another audit daemon (the operator's auditd) asks for the role: give it up, put the
        settings back, and read from the multicast group from now on. (The kernel refused that
        daemon's first attempt while we held the role: it registers on its next.)"""
        assert self._loop is not None and self._reader is not None and self._ctl is not None
        print("agentcell audit: another audit daemon wants the kernel's records: reading next to it",
              file=sys.stderr)
        old = self._reader
        self._stop_reading(old.fileno())
        with contextlib.suppress(OSError, host_settings.HostSettingsError):
            if self._holder is not None:  # the daemon's settings as they were; from now on they are its own
                saved = self._holder.original(audit_setting())
                self._ctl.set_status(failure=saved["failure"], backlog_limit=saved["backlog_limit"],
                                     backlog_wait_time=saved["backlog_wait_time"])
        with contextlib.suppress(OSError):
            old.set_status(pid=0)
        old.close()
        self.daemon = False
        for rule in [r for r in self._rules if r.key in (self.key + "host", self.key + "untraced")]:  # its tasks are its business
            with contextlib.suppress(OSError):
                self._ctl.delete_rule(rule)
            self._rules.remove(rule)
        self._reader = an.AuditSocket(groups=1 << (an.AUDIT_NLGRP_READLOG - 1))
        self._reader.sock.setblocking(False)
        self._read_later(self._reader.fileno(), self._on_audit)

    def remove_stale(self) -> int:
        """Remove the rules on this server's uids left by a server that died (or by us): a key of a
        range that overlaps ours, or an exclude rule (which cannot have a key) on an id of ours. Live
        servers' ranges are disjoint (uids.py), so an overlapping one is a dead server's: left in place,
        its exec rule would match first and give our sandboxes' records its key (they would be lost)."""
        assert self._ctl is not None
        removed = 0
        for raw in self._ctl.rules():
            m = _KEY_RANGE.match(an.rule_key(raw))
            if (m is not None and int(m[1]) <= self.last and self.first <= int(m[2])) or self._our_exclusion(raw):
                removed += self._ctl.delete_rule(raw)
        return removed

    def _our_exclusion(self, raw: bytes, any_server: bool = False) -> bool:
        """An exclude rule on an id of this server's range (any_server: of any agentcell range)."""
        if an.rule_head(raw)[0] != an.FILTER_EXCLUDE:
            return False
        bounds = [value for field, _op, value in an.rule_conditions(raw) if field == an.F_UID]
        if any_server:
            return bool(bounds) and all(uid >= min(self.first, uids.AUTO_START) for uid in bounds)
        return any(self.first <= uid <= self.last for uid in bounds)

    async def close(self) -> None:
        if self._tick is not None:
            self._tick.cancel()
            self._tick = None
        loop = self._loop
        for src in (self._reader, self._exits, self._trace):
            if src is not None and loop is not None:
                with contextlib.suppress(ValueError, OSError):
                    loop.remove_reader(src.fileno())
                    self._reading.pop(src.fileno(), None)
        ctl = self._ctl
        if ctl is not None:
            for state in self._by_id.values():
                self._unsuppress(state)
            for rule in self._rules:
                with contextlib.suppress(OSError):
                    ctl.delete_rule(rule)
            self._rules.clear()
            with contextlib.suppress(OSError):
                self.remove_stale()
        # the last collector on the host to let go puts the settings back, while still the daemon (the
        # kernel's notes of the changes come to us, not to its log); while another server's collector
        # still holds them, audit stays on, and that one takes over as the daemon at its next tick
        if self._holder is not None:
            self._holder.close()
            self._holder = None
        if self.daemon and self._reader is not None:  # audit is off again: unregistering writes no note
            with contextlib.suppress(OSError):
                self._reader.set_status(pid=0)
            self.daemon = False
        for sock in (self._reader, self._ctl, self._exits, self._trace):
            if sock is not None:
                sock.close()
        self._reader = self._ctl = self._exits = self._trace = None

    # -- sandboxes -----------------------------------------------------------------------------

    def watch(self, target: WatchTarget) -> None:
        state = _Sandbox(target, window_start=time.monotonic(), pid_level=len(nspid(target.host_pid) or [0]) - 1)
        self._by_id[target.sandbox_id] = state
        for uid in target.host_uids:
            if not self.first <= uid <= self.last:
                raise ValueError(f"sandbox {target.sandbox_id}: host uid {uid} is outside {self.first}-{self.last}")
            self._by_uid[uid] = state

    def claimed(self, sandbox_id: str) -> None:
        """Nothing a claim changes matters here (record.Collector)."""

    def unwatch(self, sandbox_id: str) -> None:
        if sandbox_id not in self._by_id:
            return
        until = time.monotonic() + UNWATCH_READ_S
        for handler in list(self._reading.values()):  # what is already queued (its last execs and exits) first
            with contextlib.suppress(OSError):
                while handler() and time.monotonic() < until:
                    pass
        state = self._by_id.pop(sandbox_id, None)
        if state is None:
            return
        self._release_held(state)
        self._flush_dropped(state)
        self._unsuppress(state)
        for uid in state.target.host_uids:
            if self._by_uid.get(uid) is state:
                del self._by_uid[uid]
        for pid in state.procs:
            proc = self._procs.get(pid)
            if proc is not None and proc.sandbox is state:
                del self._procs[pid]

    # -- emitting, within each sandbox's budget ------------------------------------------------

    def _emit(self, state: _Sandbox, ev: dict[str, Any]) -> None:
        now = time.monotonic()
        if now - state.window_start >= self.window_s:
            self._flush_dropped(state)
            state.window_start, state.count = now, 0
        if state.count >= self.budget:
            state.dropped += 1
            self.stats["dropped"] += 1
            # a flood going on now (not a backlog being read late): stop it at the source
            if state.dropped >= self.budget * _SUPPRESS_FACTOR and state.suppressed is None \
                    and time.time() - ev["time"] < self.window_s:
                self._suppress(state)
            return
        state.count += 1
        self.stats["events"] += 1
        self.sink(state.target.sandbox_id, ev)

    def _flush_dropped(self, state: _Sandbox) -> None:
        if state.dropped:
            reason = "rate limit"
            if state.suppressed is not None:
                reason += " (its records were excluded in the kernel for the rest of the window, uncounted)"
            self.sink(state.target.sandbox_id, event("record.dropped", count=state.dropped, reason=reason,
                                                     window_s=self.window_s))
            state.dropped = 0

    def _suppress(self, state: _Sandbox) -> None:
        """Stop the kernel from writing this sandbox's records until the window ends."""
        if self._ctl is None:
            return
        # One rule per uid, never a range: its two ids are far apart (user, root), and every sandbox
        # of the server has ids between them. No key: the kernel's exclude filter stops at a condition
        # it does not evaluate (a key is one) and logs the record anyway (seen on 6.18); remove_stale
        # finds these by their uids instead.
        rules = [an.Rule(an.FILTER_EXCLUDE, an.NEVER, (), ((an.F_UID, an.OP_EQ, uid),))
                 for uid in sorted(set(state.target.host_uids))]
        added: list[an.Rule] = []
        try:
            for rule in rules:
                self._ctl.add_rule(rule)
                added.append(rule)
        except OSError as e:
            print(f"agentcell audit: cannot exclude sandbox {state.target.sandbox_id}'s records: {e}", file=sys.stderr)
        state.suppressed = added or None
        if self._trace is not None:  # its traced events too (counted by the tracer, reported as dropped)
            for uid in set(state.target.host_uids):
                with contextlib.suppress(OSError):
                    self._trace.mute(uid)
            state.suppressed = state.suppressed or []

    def _unsuppress(self, state: _Sandbox) -> None:
        if state.suppressed is not None and self._ctl is not None:
            for rule in state.suppressed:
                with contextlib.suppress(OSError):
                    self._ctl.delete_rule(rule)
        if state.suppressed is not None and self._trace is not None:  # (muted by _suppress)
            for uid in set(state.target.host_uids):
                with contextlib.suppress(OSError):
                    self._trace.mute(uid, False)
        state.suppressed = None

    def _on_tick(self) -> None:
        """Once a window: report drops of quiet sandboxes, lift exclusions, expire partial records."""
        assert self._loop is not None
        self._tick = self._loop.call_later(self.window_s, self._on_tick)
        now = time.monotonic()
        for state in self._by_id.values():
            if now - state.window_start >= self.window_s:
                self._flush_dropped(state)
                self._unsuppress(state)
                state.window_start, state.count = now, 0
        while self._pending and next(iter(self._pending.values()))[0] < now - 2.0:
            _, (_, recs) = self._pending.popitem(last=False)
            self._complete(recs)  # no EOE came (records without a syscall's context)
        while self._early_exits and next(iter(self._early_exits.values()))[1] < now - 5.0:
            self._early_exits.popitem(last=False)
        if self._trace is not None:
            self._trace_counts()
        if not self.daemon and self._ctl is not None and self._reader is not None:
            with contextlib.suppress(OSError):
                status = self._ctl.status()
                if status.pid == 0:  # the daemon (another agentcell server, or auditd) went away
                    self._take_over(status)
        if self.daemon and self._ctl is not None:
            with contextlib.suppress(OSError):
                lost = self._ctl.status().lost
                if lost > self._kernel_lost:
                    self._lost(lost - self._kernel_lost, "the kernel's audit backlog was full")
                self._kernel_lost = lost

    def _trace_counts(self) -> None:
        """What the kernel tracer counted instead of writing: a sandbox's events over its budget (per
        sandbox), events lost to a full ring (host-wide)."""
        assert self._trace is not None
        for state in self._by_id.values():
            over = 0
            for uid in set(state.target.host_uids):
                count = self._trace.dropped(uid)
                over += count - state.traced_dropped.get(uid, count)  # counted before the watch: not its own
                state.traced_dropped[uid] = count
            if over > 0:
                self.sink(state.target.sandbox_id, event(
                    "record.dropped", count=over, collector="process",
                    reason=f"rate limit (execs and refusals over {self.budget * _SUPPRESS_FACTOR}/s, counted by the kernel)"))
        lost = self._trace.lost()
        if lost > self._trace_lost:
            self._lost(lost - self._trace_lost, "the kernel tracer's ring buffer was full")
        self._trace_lost = lost

    def _lost(self, count: int | None, reason: str) -> None:
        for state in self._by_id.values():
            self.sink(state.target.sandbox_id, event("record.dropped", count=count, reason=reason + " (host-wide: "
                                                     "records of any sandbox may be among them)"))

    # -- the audit stream ----------------------------------------------------------------------

    def _on_audit(self) -> bool:
        """Read and handle records for at most SLICE_S (the loop's other work waits no longer);
        True if that ran out with more maybe queued."""
        assert self._reader is not None
        fd = self._reader.fileno()
        if self._batch is None or self._batch.fd != fd:  # the reader was swapped (daemon <-> multicast)
            self._batch = an.BatchReader(fd)
        until = time.monotonic() + SLICE_S
        while time.monotonic() < until:
            try:
                batch = self._batch.read()
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    self.lost_overruns += 1
                    self._lost(None, "the server's audit socket overflowed")
                    continue
                raise
            for data in batch:
                for mtype, _seq, body in an.split(data):
                    self._on_record(mtype, body)
            if len(batch) < self._batch.count:
                return False
        return True

    def _on_record(self, mtype: int, body: bytes) -> None:
        """Records of one syscall share a serial: a Landlock record comes during the call, then SYSCALL
        (ours if it has our key), its EXECVE/CWD/PATH, and EOE. A record whose serial has nothing
        pending is someone else's and is skipped unparsed."""
        if mtype == an.REPLACE and self.daemon:
            if not self._collector_asks(body):  # auditd: it gets the role; another server's collector reads beside us
                self._step_aside()
            return
        if self._trace is not None and mtype in (an.LANDLOCK_ACCESS, an.LANDLOCK_DOMAIN):
            rec = ar.parse(mtype, body)  # alone: the tracer's processes have no syscall context
            if rec is not None:
                self.stats["records"] += 1
                self._landlock(rec)
            return
        if mtype == an.SECCOMP:  # complete in itself (uid, pid, syscall); the SYSCALL record adds nothing
            rec = ar.parse(mtype, body)
            if rec is not None:
                self.stats["records"] += 1
                self._seccomp(rec)
            return
        if mtype == an.EOE:
            stamp = ar.head(body)
            entry = self._pending.pop(stamp[1], None) if stamp is not None else None
            if entry is not None:
                self._complete(entry[1])
            return
        if mtype in (an.EXECVE, an.CWD, an.PATH) or (mtype == an.SYSCALL and self._key_b not in body):
            stamp = ar.head(body)  # (someone else's, e.g. an operator's auditd's: nothing more is done)
            entry = self._pending.get(stamp[1]) if stamp is not None else None
            rec = ar.parse(mtype, body) if entry is not None else None  # its fields: parsed when read
            if entry is not None and rec is not None:
                self.stats["records"] += 1
                entry[1].append(rec)
            return
        if mtype not in (an.SYSCALL, an.LANDLOCK_ACCESS):
            return
        rec = ar.parse(mtype, body)
        if rec is None:
            return
        self.stats["records"] += 1
        entry = self._pending.get(rec.serial)
        if entry is None:
            if len(self._pending) > 4096:  # never unbounded, whatever the kernel sends
                self._pending.popitem(last=False)
            entry = self._pending[rec.serial] = (time.monotonic(), [])
        entry[1].append(rec)

    def _sandbox_of(self, rec: ar.Record) -> tuple[_Sandbox, int] | None:
        uid = rec.int("uid")
        state = self._by_uid.get(uid) if uid is not None else None
        if state is None or uid is None:
            return None
        return state, (SANDBOX_UID if uid == state.target.host_uids[0] else 0)

    def _seccomp(self, rec: ar.Record) -> None:
        found = self._sandbox_of(rec)
        if found is None:
            return
        state, _ = found
        nr = rec.int("syscall")
        name = self._syscall_name(nr, rec.int("arch", 16))
        if name in _NOT_DENIALS:
            return
        host_pid = rec.int("pid")
        action = _SECCOMP_ACTIONS.get((rec.int("code", 16) or 0) & 0xFFFF0000, "other")
        self._emit(state, event("deny.syscall", pid=_ns_pid(host_pid, state), at=rec.time, syscall=name, nr=nr,
                                action=action, comm=rec.get("comm"), host_pid=host_pid))

    def _syscall_name(self, nr: int | None, arch: int | None) -> str | None:
        if nr is None:
            return None
        if nr not in self._names:
            name = None
            with contextlib.suppress(Exception):
                name = pyseccomp.resolve_syscall(arch or pyseccomp.system_arch(), nr).decode()
            self._names[nr] = name
        return self._names[nr]

    def _complete(self, recs: list[ar.Record]) -> None:
        syscall = next((r for r in recs if r.type == an.SYSCALL), None)
        if syscall is None:
            return
        found = self._sandbox_of(syscall)
        if found is None:
            return
        state, inside_uid = found
        key = syscall.get("key", "")
        landlock = [r for r in recs if r.type == an.LANDLOCK_ACCESS]
        if key == self.key + "exec":
            self._exec(state, inside_uid, syscall, recs)
        elif landlock or key == self.key + "deny":
            self._deny(state, syscall, recs, landlock)

    def _exec(self, state: _Sandbox, inside_uid: int, syscall: ar.Record, recs: list[ar.Record]) -> None:
        host_pid = syscall.int("pid") or 0
        host_ppid = syscall.int("ppid")
        cwd = next((r.get("cwd") for r in recs if r.type == an.CWD), None)
        parent = self._procs.get(host_ppid or 0)
        known = parent is not None and parent.sandbox is state and parent.pid is not None
        ppid = parent.pid if known and parent is not None else _ns_pid(host_ppid, state)
        self._exec_event(state, host_pid, host_ppid, _ns_pid(host_pid, state), ppid, syscall.time,
                         _monotonic_of(syscall.time), syscall.get("comm", ""),
                         path=_path(recs, cwd, first=True) or syscall.get("exe"),
                         argv=ar.argv([r for r in recs if r.type == an.EXECVE]), cwd=cwd, uid=inside_uid,
                         exe=syscall.get("exe"))

    def _on_traced(self) -> bool:
        """The kernel tracer's events, for at most SLICE_S; True if some are left for the next turn."""
        assert self._trace is not None
        until = time.monotonic() + SLICE_S
        if not self._traced:
            self._traced = self._trace.read(TRACE_READ)
            self._ring_more = len(self._traced) >= TRACE_READ
        done = 0
        for done, ex in enumerate(self._traced, 1):
            if isinstance(ex, Exec):
                self._traced_exec(ex)
            elif isinstance(ex, Exit):
                self._exit(ex)  # (after its exec: the ring keeps their order)
            else:
                self._traced_denial(ex)
            if done % 16 == 0 and time.monotonic() > until:
                break
        else:
            done = len(self._traced)
        del self._traced[:done]
        return bool(self._traced) or self._ring_more

    def _traced_exec(self, ex: Exec) -> None:
        state = self._by_uid.get(ex.uid)
        if state is None:
            return
        level = state.pid_level
        pid = ex.pids[level] if len(ex.pids) > level else None
        ppid = ex.ppids[level] if len(ex.ppids) > level else None  # None: a parent outside the sandbox
        path = ex.file
        if not path.startswith("/") and ex.cwd is not None:
            path = os.path.normpath(os.path.join(ex.cwd, path))
        extra = {"argv_cut": True} if ex.argv_cut else {}
        self._exec_event(state, ex.host_pid, ex.host_ppid, pid, ppid, _wall_of(ex.monotonic_ns), ex.monotonic_ns / 1e9,
                         ex.comm, path=path, argv=ex.argv, cwd=ex.cwd, exe=ex.exe,
                         uid=SANDBOX_UID if ex.uid == state.target.host_uids[0] else 0, **extra)

    def _traced_denial(self, d: Denial) -> None:
        state = self._by_uid.get(d.uid)
        if state is None or _AGENT_NOISE.match(d.path):
            return
        if d.errno != _EROFS and self.denials == "syscalls":  # Landlock's are EACCES: its record may be on its way
            self._hold(state, d)
            return
        self._denial_event(state, d)

    def _denial_event(self, state: _Sandbox, d: Denial, landlock: ar.Record | None = None) -> None:
        level = state.pid_level
        common = {"pid": d.pids[level] if len(d.pids) > level else None, "at": _wall_of(d.monotonic_ns),
                  "path": d.path, "syscall": PATH_SYSCALLS.get(d.nr, d.nr), "comm": d.comm, "host_pid": d.host_pid,
                  "errno": d.errno}
        if landlock is not None:
            self._emit(state, event("deny.write", reason="landlock", blockers=landlock.get("blockers"), **common))
        elif d.errno == _EROFS:
            self._emit(state, event("deny.write", reason="read-only", **common))
        elif d.open_flags & _WRITE_INTENT if d.nr in _OPENS else True:  # a call that changes something
            self._emit(state, event("deny.write", reason="permission", **common))
        else:
            self._emit(state, event("deny.access", **common))

    # -- Landlock's records, with the tracer ------------------------------------------------------

    def _landlock(self, rec: ar.Record) -> None:
        """A domain's first record names its creator (a sandbox's uid); its refusals name the domain."""
        domain = rec.get("domain") or ""
        if rec.type == an.LANDLOCK_DOMAIN:
            state = self._by_uid.get(rec.int("uid") or -1)
            if state is not None and rec.get("status") == "allocated":
                self._domains[domain] = state
                while len(self._domains) > 4096:
                    self._domains.popitem(last=False)
                for waiting in self._unplaced.pop(domain, []):
                    self._wall(state, waiting)
            return
        state = self._domains.get(domain)
        if state is not None:
            self._wall(state, rec)
        else:  # its domain's record comes right after a domain's first refusal
            self._unplaced.setdefault(domain, []).append(rec)
            while len(self._unplaced) > 256 or len(self._unplaced[domain]) > 64:
                self._unplaced.popitem(last=False) if len(self._unplaced) > 256 else self._unplaced[domain].pop(0)

    def _wall(self, state: _Sandbox, rec: ar.Record) -> None:
        """A Landlock refusal of a sandbox: paired with the tracer's view of the call where it has one."""
        if self.denials == "syscalls":
            self._hold(state, rec)
        else:  # the tracer sees no Landlock refusal (no capability is asked): the record alone
            self._release(state, rec)

    def _hold(self, state: _Sandbox, item: Denial | ar.Record) -> None:
        """Pair a refusal with Landlock's record of it (either may come first), or hold it a moment.
        A sandbox's Landlock records are few; its refusals may be many: each is compared with the
        held records only, a record with the held refusals."""
        if isinstance(item, Denial):
            for i, (_, wall) in enumerate(state.held_walls):
                if _walled(item, wall):
                    del state.held_walls[i]
                    self._denial_event(state, item, landlock=wall)
                    return
            held: deque[Any] = state.held_refusals
        else:
            for i, (_, refusal) in enumerate(state.held_refusals):
                if _walled(refusal, item):
                    del state.held_refusals[i]
                    self._denial_event(state, refusal, landlock=item)
                    return
            held = state.held_walls
        held.append((time.monotonic(), item))
        if len(held) > 512:  # bounded: the oldest goes out unpaired
            self._release(state, held.popleft()[1])
        self._holding[state.target.sandbox_id] = state
        if self._held_timer is None and self._loop is not None:
            self._held_timer = self._loop.call_later(LANDLOCK_PAIR_S, self._release_held)

    def _release_held(self, only: _Sandbox | None = None) -> None:
        """What waited its time (or, with `only`, all of that sandbox's) goes out unpaired."""
        if only is None:
            self._held_timer = None
        due = time.monotonic() - LANDLOCK_PAIR_S if only is None else float("inf")
        for state in [only] if only is not None else list(self._holding.values()):
            for held in (state.held_refusals, state.held_walls):
                while held and held[0][0] <= due:
                    self._release(state, held.popleft()[1])
            if not state.held_refusals and not state.held_walls:
                self._holding.pop(state.target.sandbox_id, None)
        if self._holding and self._held_timer is None and self._loop is not None:
            self._held_timer = self._loop.call_later(LANDLOCK_PAIR_S, self._release_held)

    def _release(self, state: _Sandbox, item: Denial | ar.Record) -> None:
        if isinstance(item, Denial):
            self._denial_event(state, item)
        else:  # a Landlock refusal of a call the tracer does not watch
            self._emit(state, event("deny.write", reason="landlock", blockers=item.get("blockers"), pid=None,
                                    at=item.time, path=item.get("path"), syscall=None, comm=None, host_pid=None,
                                    errno=_EACCES))

    def _exec_event(self, state: _Sandbox, host_pid: int, host_ppid: int | None, pid: int | None,
                    ppid: int | None, at: float, monotonic: float, comm: str, **fields: Any) -> None:
        """A process.exec, and the process kept for its exit (which may have come first)."""
        proc = self._procs.get(host_pid)
        if proc is None or proc.sandbox is not state:  # a second exec of a process keeps its start
            proc = self._procs[host_pid] = _Proc(state, at, comm, pid, ppid)
            state.procs.add(host_pid)
        proc.comm = comm
        self._emit(state, event("process.exec", pid=pid, ppid=ppid, at=at, host_pid=host_pid, host_ppid=host_ppid,
                                **fields))
        early = self._early_exits.pop(host_pid, None)
        if early is not None and early[0].monotonic_ns / 1e9 >= monotonic:
            self._exit(early[0])

    def _deny(self, state: _Sandbox, syscall: ar.Record, recs: list[ar.Record], landlock: list[ar.Record]) -> None:
        nr = syscall.int("syscall") or 0
        err = -(syscall.int("exit") or 0)
        cwd = next((r.get("cwd") for r in recs if r.type == an.CWD), None)
        path = _path(recs, cwd) or (landlock[0].get("path") if landlock else None)
        host_pid = syscall.int("pid")
        if path is not None and _AGENT_NOISE.match(path):
            return
        common = {"pid": _ns_pid(host_pid, state), "at": syscall.time, "path": path, "syscall": PATH_SYSCALLS.get(nr, nr),
                  "comm": syscall.get("comm"), "host_pid": host_pid}
        if landlock:
            self._emit(state, event("deny.write", reason="landlock", blockers=landlock[0].get("blockers"),
                                    errno=err, **common))
        elif err == _EROFS:
            self._emit(state, event("deny.write", reason="read-only", errno=err, **common))
        elif _writes(nr, syscall):
            self._emit(state, event("deny.write", reason="permission", errno=err, **common))
        else:
            self._emit(state, event("deny.access", errno=err, **common))

    # -- exits ---------------------------------------------------------------------------------

    def _on_exits(self) -> None:
        assert self._exits is not None
        for _ in range(256):
            try:
                exits = self._exits.read()
            except BlockingIOError:
                return
            except OSError as e:
                if e.errno == errno.ENOBUFS:  # exits of unknown processes lost: theirs stay unreported
                    self.lost_overruns += 1
                    continue
                raise
            for ex in exits:
                if ex.host_pid in self._procs:
                    self._exit(ex)
                else:  # its exec may still be on its way through the audit queue
                    self._early_exits[ex.host_pid] = (ex, time.monotonic())
                    if len(self._early_exits) > 8192:
                        self._early_exits.popitem(last=False)

    def _exit(self, ex: Exit) -> None:
        proc = self._procs.pop(ex.host_pid, None)
        if proc is None:
            return
        proc.sandbox.procs.discard(ex.host_pid)
        at = _wall_of(ex.monotonic_ns)
        fields: dict[str, Any] = {"code": ex.code} if ex.signal is None else {"signal": ex.signal}
        self._emit(proc.sandbox, event("process.exit", pid=proc.pid, ppid=proc.ppid, at=at, comm=proc.comm,
                                       duration_s=round(max(at - proc.start, 0.0), 6), host_pid=ex.host_pid,
                                       **fields))


def audit_setting() -> host_settings.Setting:
    """The kernel's audit status (enabled, failure mode, backlog, its wait, the lost count and the daemon's
    pid) as a host-wide setting every server's collector may change."""

    def read() -> dict[str, int]:
        ctl = an.AuditSocket()
        try:
            s = ctl.status()
        finally:
            ctl.close()
        return {"enabled": s.enabled, "failure": s.failure, "backlog_limit": s.backlog_limit,
                "backlog_wait_time": s.backlog_wait_time, "lost": s.lost, "pid": s.pid}

    return host_settings.Setting(AUDIT_KEY, read, _restore_audit)


def _restore_audit(original: dict[str, int], pids: frozenset[int]) -> None:
    """Put the audit status back, unless another program (the operator's auditd) is the daemon now: its
    settings are its own (if it was the daemon all along, agentcell only turned auditing on)."""
    ctl = an.AuditSocket()
    try:
        status = ctl.status()
        if status.pid and status.pid not in pids and _running(status.pid):
            if status.pid == original.get("pid"):
                ctl.set_status(enabled=original["enabled"])
            return
        ctl.set_status(enabled=original["enabled"], failure=original["failure"],
                       backlog_limit=original["backlog_limit"], backlog_wait_time=original["backlog_wait_time"])
        if original["lost"] == 0 and ctl.status().lost:  # the losses were agentcell's
            ctl.set_status(lost=0)
    finally:
        ctl.close()


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _monotonic_of(wall: float) -> float:
    return wall - time.time() + time.monotonic() - 0.01  # audit stamps are coarse (jiffies)


def _wall_of(monotonic_ns: int) -> float:
    return time.time() - (time.monotonic_ns() - monotonic_ns) / 1e9


def _walled(refusal: Denial, wall: ar.Record) -> bool:
    """Whether Landlock's record names what the refusal's call named (or its directory)."""
    where = (wall.get("path") or "").rstrip("/")
    return refusal.errno == _EACCES and (refusal.path == where or refusal.path.startswith(where + "/"))


def _ns_pid(host_pid: int | None, state: _Sandbox) -> int | None:
    """The pid inside the sandbox, while the process exists and still runs as one of its ids."""
    if not host_pid:
        return None
    try:  # os.open/os.read: a third of what a buffered open costs, once per exec
        fd = os.open(f"/proc/{host_pid}/status", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        status = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    nspid = uid = None
    for line in status.split(b"\n"):
        if line.startswith(b"NSpid:"):
            nspid = line.split()[-1]
        elif line.startswith(b"Uid:"):
            uid = int(line.split()[1])
    if uid not in state.target.host_uids or nspid is None:
        return None  # gone, its pid reused by another process
    return int(nspid)


def _path(recs: list[ar.Record], cwd: str | None, first: bool = False) -> str | None:
    """The path a syscall named: its PATH record (not the parent directory's), made absolute."""
    paths = [r for r in recs if r.type == an.PATH]
    if not paths:
        return None
    if first:  # the kernel writes them in item order: the first is item 0 (not parsed further, the others)
        chosen = paths[0] if paths[0].raw.get("item") == "0" else min(paths, key=lambda r: r.int("item") or 0)
    else:
        chosen = next((r for r in paths if r.raw.get("nametype") != "PARENT"), paths[0])
    name = chosen.get("name")
    if name is None or name == "(null)":
        return None
    if not name.startswith("/") and cwd:
        name = os.path.normpath(os.path.join(cwd, name))
    return name


def _writes(nr: int, syscall: ar.Record) -> bool:
    """Whether the refused call meant to change something (an open for writing or creating, a mkdir ...)."""
    arg = _OPEN_FLAGS_ARG.get(nr)
    if arg is not None:
        flags = syscall.int(arg, 16) or 0
        return bool(flags & _WRITE_INTENT)
    return nr != 437  # openat2 keeps its flags in memory: a read unless we know better
