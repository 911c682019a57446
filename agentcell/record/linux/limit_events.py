"""Limits a sandbox hit, observed from the host (issue 10): `limit.oom`, `limit.pids`, `limit.disk`,
`limit.cpu`. A collector of agentcell/record/linux/target.py's protocol.

Sources, all read by the server as host root, none reachable from inside a sandbox:

* **OOM kills**: the kernel log, read from /dev/kmsg (opened at its end, by a thread). The OOM
  killer writes two records per kill: `oom-kill:constraint=...,task_memcg=<memory cgroup>,task=<comm>,
  pid=<host pid>,uid=<host uid>` (rate limited by the kernel: 10 per 5 s host-wide, with the whole
  report) and `Memory cgroup out of memory: Killed process <pid> (<comm>) total-vm:...kB, anon-rss:...kB,
  file-rss:...kB, shmem-rss:...kB, UID:<host uid> ...` (never rate limited). A kill belongs to a sandbox
  when the first record's task_memcg is exactly the sandbox's memory cgroup or, without it, when the
  second's UID is one of the sandbox's host uids (each sandbox has ids of its own). The victim's pid in
  the sandbox is read from /proc/<host pid>/status (NSpid, checked to be in the sandbox's memory
  cgroup) as the record arrives, which is why a thread reads the log rather than the busy loop: the
  victim exists until its parent reaps it, a few ms after the kill. If it is gone, `pid` is None and
  `host_pid` still names it (the process collector's events can tell its number in the sandbox).
  Only kernel-facility records count: a /dev/kmsg writer cannot give facility 0 (and a sandbox has no
  /dev/kmsg), and the only sandbox-chosen text at the start of a kernel record is a 15-byte comm,
  too short to spell either record. The cgroup's own OOM kill counter (v1 memory.oom_control's
  `oom_kill`, v2 memory.events) is polled too: kills the log did not explain (records lost when the
  log wrapped, no /dev/kmsg) still give an event, with `pid` None and their `count`.
* **pids**: the pids cgroup's `max` counter (pids.events), forks it refused; and pids.current at the
  limit (or pids.peak, for a burst between polls), since RLIMIT_NPROC, set to the same number per uid
  (ns_limits.py) and checked first, refuses a one-uid fork bomb before the cgroup does and no counter
  records that. Edge-triggered like the disk. Polled (the counter has a notification, but kernfs
  files poll as always readable, useless in an event loop).
* **disk**: the disk is one tmpfs of disk_mb (rootfs.finish), so full is ENOSPC. fstatvfs on a dup of
  its root fd, polled; edge-triggered: one event when it fills (no free block or inode), armed again
  once 2 % (at least 1 MiB) is free. A disk filled and emptied between two polls is not seen.
* **CPU**: the CFS quota's throttling, cpu.stat's nr_throttled and throttled_time (v2 throttled_usec).
  One event per `window` in which the sandbox was throttled in at least `cpu_min_ratio` (10 %) of its
  periods *and* for at least that share of the window's time (nr_periods counts only the periods the
  sandbox ran in: an idle sandbox throttled once in the three periods it woke for is not a miner),
  with the time throttled, and `streak`: how many windows in a row it was (a crypto-miner's
  pattern: throttled window after window). cpu.stat is read once a window, at its end.

Cost: one timer for all sandboxes; per watched sandbox and poll, three pread()s of cgroup files kept
open (four until pids.peak reached the limit once) and one fstatvfs, and cpu.stat once a window: 6
fds per sandbox. The poll runs in slices of `slice_size` sandboxes with the loop free between them;
benchmarks/limit_events_cost.py measures it. Bounded: at most one event per
kind per sandbox per `window`; more of the same kind in a window are folded into one event sent when
the window ends, with `count` (OOM kills, refused forks).

Wiring: `LimitsCollector(sink)`, `await start()` on the server's loop, `watch(WatchTarget)` when a
tenant claims a sandbox, `unwatch(id)` before the backend removes its cgroups (a last poll then
catches what the sandbox hit just before it died).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import select
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from agentcell.backends.linux import cgroups
from agentcell.record.events import EventSink, event
from agentcell.record.linux.target import WatchTarget

KMSG = "/dev/kmsg"
_KMSG_RECORDS_PER_WAKE = 512  # then back to poll(), which also checks for close()
_DISK_REARM_FRACTION = 0.02
_DISK_REARM_MIN_BYTES = 1 << 20
_PENDING_VICTIMS = 64  # oom-kill records waiting for their "Killed process" record

# `oom-kill:` record (mm/oom_kill.c dump_oom_victim, memcontrol's print_oom_context). The cgroup paths
# are the host's names; the comm is the task's and may hold anything but is at most 15 bytes: the greedy
# `task=(.*)` with the line's end anchored takes the kernel's own `,pid=..,uid=..` tail.
_OOM_KILL_RE = re.compile(
    r"^oom-kill:constraint=(\w+),.*?,task_memcg=(/[^,]*),task=(.*),pid=(\d+),uid=(\d+)$")
# the victim's record (mm/oom_kill.c __oom_kill_process)
_KILLED_RE = re.compile(
    r"^(Memory cgroup out of memory|Out of memory(?: \(oom_kill_allocating_task\))?): Killed process (\d+) "
    r"\((.*)\) total-vm:(\d+)kB, anon-rss:(\d+)kB, file-rss:(\d+)kB, shmem-rss:(\d+)kB, UID:(\d+)")


def _pread(fd: int) -> bytes:
    return os.pread(fd, 4096, 0)  # a cgroup file is a seq_file: a read at 0 renders it afresh


def _value(text: bytes, key: bytes) -> int:
    """The value of `key` ("key value" lines) in a cgroup file; 0 if absent. A find, not a parse: the
    poll's cost is mostly Python's, per sandbox."""
    i = text.find(key)
    if i < 0:
        return 0
    if i and text[i - 1] != 10:  # a longer key's tail
        i = text.find(b"\n" + key) + 1
        if i <= 0:
            return 0
    j = text.find(b"\n", i)
    return int(text[i + len(key):j if j >= 0 else None])


@dataclass
class _Files:
    """The cgroup files one sandbox's poll reads, open for its whole watch (v1 or v2 names)."""

    oom: int  # memory.oom_control (v1) / memory.events (v2): `oom_kill`
    pids: int  # pids.events: `max`
    pids_current: int  # pids.current
    pids_peak: int  # pids.peak (-1: none, or no longer needed)
    cpu: int  # cpu.stat
    pids_limit: int
    cpu_quota: tuple[str, ...]  # v1 cfs_quota_us + cfs_period_us, or v2 cpu.max
    throttled_key: bytes
    throttled_ns_per_unit: int

    def close(self) -> None:
        for fd in (self.oom, self.pids, self.pids_current, self.pids_peak, self.cpu):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def drop_peak(self) -> None:
        if self.pids_peak >= 0:
            os.close(self.pids_peak)
            self.pids_peak = -1


def _open_files(target: WatchTarget) -> _Files:
    cg = target.cgroup
    if cg.v2:
        d = cg.dirs["unified"]
        m = p = c = d
        oom_name, quota = "memory.events", (f"{d}/cpu.max",)
        key, unit = b"throttled_usec ", 1000
    else:
        m, p, c = cg.dirs["memory"], cg.dirs["pids"], cg.dirs["cpu"]
        oom_name, quota = "memory.oom_control", (f"{c}/cpu.cfs_quota_us", f"{c}/cpu.cfs_period_us")
        key, unit = b"throttled_time ", 1
    limit = _pids_limit(cg)
    fds: list[int] = []
    try:
        for name in (f"{m}/{oom_name}", f"{p}/pids.events", f"{p}/pids.current", f"{c}/cpu.stat"):
            fds.append(os.open(name, os.O_RDONLY | os.O_CLOEXEC))
        try:
            fds.append(os.open(f"{p}/pids.peak", os.O_RDONLY | os.O_CLOEXEC))
        except FileNotFoundError:  # before linux 6.1
            fds.append(-1)
    except BaseException:
        for fd in fds:
            if fd >= 0:
                os.close(fd)
        raise
    return _Files(fds[0], fds[1], fds[2], fds[4], fds[3], limit, quota, key, unit)


def _pids_limit(cg: cgroups.Cgroups) -> int:
    limit = _read_small(f"{cg.dirs['unified' if cg.v2 else 'pids']}/pids.max")
    return (1 << 62) if limit == "max" else int(limit)


def _near(limit: int) -> int:
    """Tasks from which a sandbox is at its pids limit: a fork may be refused (by the cgroup or by
    RLIMIT_NPROC, which also counts its tasks still being reaped)."""
    return limit - max(1, limit // 32)


def _read_small(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


@dataclass
class _Watched:
    target: WatchTarget
    files: _Files
    disk_fd: int  # our own dup of the target's
    memcg: str  # its memory cgroup as the kernel log names it: "/agentcell/<instance>/<name>"
    pids_max_count: int = 0  # the counters at the last poll
    pids_at_limit: bool = False  # edge trigger: armed again once well below the limit
    throttled_periods: int = 0  # cpu.stat at the current window's start
    throttled_ns: int = 0
    periods: int = 0
    oom_told: int = 0  # kills given an event: from the log, or unexplained by it
    oom_counted_before: int = 0  # the counter one poll ago (the log had a whole interval to explain it)
    disk_full: bool = False
    cpu_window_start: float = 0.0
    cpu_streak: int = 0
    last_sent: dict[str, float] = field(default_factory=dict)  # kind -> monotonic time of its last event
    held: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> event folded, sent at window end
    gone: bool = False


class LimitsCollector:
    """The limits a sandbox hit (see the module's docstring). Runs on the server's event loop."""


    def __init__(self, sink: EventSink, *, interval: float = 1.0, window: float = 10.0,
                 slice_size: int = 100, kmsg: str = KMSG, cpu_min_ratio: float = 0.1) -> None:
        self.sink = sink
        self.interval = interval
        self.window = window  # at most one event per kind per sandbox per window; the CPU window
        self.slice_size = slice_size
        # a window counts as throttled from this share of its periods and of its time: not a moment's
        # burst of threads
        self.cpu_min_ratio = cpu_min_ratio
        self.kmsg_path = kmsg
        self._watched: dict[str, _Watched] = {}
        self._by_memcg: dict[str, str] = {}  # memcg path -> sandbox id
        self._by_uid: dict[int, str] = {}  # host uid -> sandbox id
        # host pid -> (sandbox id, event so far); the kernel log's thread's alone
        self._victims: dict[int, tuple[str, dict[str, Any]]] = {}
        self._kmsg_fd = -1
        self._kmsg_thread: threading.Thread | None = None
        self._wake_w = -1  # a byte here stops the thread
        self._task: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.kmsg_lost = 0  # records the log overwrote before we read them (EPIPE)

    # -- the Collector protocol ------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        try:
            fd = os.open(self.kmsg_path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            print(f"agentcell: limit events: cannot read the kernel log {self.kmsg_path} ({e}); OOM kills are "
                  "recorded from the cgroup counters only, without the victim", file=sys.stderr)
        else:
            os.lseek(fd, 0, os.SEEK_END)  # only what happens from now on
            self._kmsg_fd = fd
            wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
            # A thread of its own, not the loop's reader: the victim's pid in the sandbox is readable only
            # until its parent reaps it, a few ms after the kill, however busy the loop is.
            self._kmsg_thread = threading.Thread(target=self._kmsg_main, args=(wake_r,), daemon=True,
                                                 name="agentcell-limit-kmsg")
            self._kmsg_thread.start()
        self._task = self._loop.create_task(self._run())

    def watch(self, target: WatchTarget) -> None:
        if target.sandbox_id in self._watched:
            self.unwatch(target.sandbox_id)
        files = _open_files(target)
        try:
            disk_fd = os.dup(target.disk_fd)
        except OSError:
            files.close()
            raise
        w = _Watched(target, files, disk_fd, "/" + target.cgroup.sandbox_id.strip("/"))
        w.cpu_window_start = time.monotonic()
        try:
            self._sample(w, baseline=True)
        except OSError:
            files.close()
            os.close(disk_fd)
            raise
        self._watched[target.sandbox_id] = w
        self._by_memcg[w.memcg] = target.sandbox_id
        for uid in target.host_uids:
            self._by_uid[uid] = target.sandbox_id

    def claimed(self, sandbox_id: str) -> None:
        """A standby watched since its preparation was claimed: its pids limit may have changed."""
        w = self._watched.get(sandbox_id)
        if w is not None:
            w.files.pids_limit = _pids_limit(w.target.cgroup)

    def unwatch(self, sandbox_id: str) -> None:
        w = self._watched.pop(sandbox_id, None)
        if w is None:
            return
        if not w.gone:  # what it hit since the last poll (its cgroup is still there if the caller was early)
            with contextlib.suppress(OSError):
                self._poll_one(w, time.monotonic())
        self._flush(w, force=True)
        if self._by_memcg.get(w.memcg) == sandbox_id:
            del self._by_memcg[w.memcg]
        for uid in w.target.host_uids:
            if self._by_uid.get(uid) == sandbox_id:
                del self._by_uid[uid]
        w.files.close()
        with contextlib.suppress(OSError):
            os.close(w.disk_fd)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        if self._kmsg_thread is not None:
            os.write(self._wake_w, b"x")
            await asyncio.to_thread(self._kmsg_thread.join)
            self._kmsg_thread = None
            os.close(self._wake_w)
            os.close(self._kmsg_fd)
            self._kmsg_fd = -1
        for sandbox_id in list(self._watched):
            self.unwatch(sandbox_id)

    # -- polling -----------------------------------------------------------------------------------------

    async def _run(self) -> None:
        next_tick = time.monotonic()
        while True:
            next_tick += self.interval
            await asyncio.sleep(max(0.0, next_tick - time.monotonic()))
            watched = list(self._watched.values())
            for i in range(0, len(watched), self.slice_size):
                if i:
                    await asyncio.sleep(0)  # the loop's other work between slices
                try:
                    self.poll(watched[i:i + self.slice_size])
                except Exception as e:  # a bug must not end the record of every sandbox
                    print(f"agentcell: limit events: poll failed: {e!r}", file=sys.stderr)
            if time.monotonic() > next_tick + self.interval:  # fell behind (a stalled loop): no burst of polls
                next_tick = time.monotonic()

    def poll(self, watched: list[_Watched] | None = None) -> None:
        """One poll of `watched` (all by default): synchronous, for the timer and the benchmark."""
        now = time.monotonic()
        for w in self._watched.values() if watched is None else watched:
            if w.gone or self._watched.get(w.target.sandbox_id) is not w:
                continue
            try:
                self._poll_one(w, now)
            except (OSError, ValueError) as e:
                # ENODEV: its cgroup was removed, it died (unwatch() tidies up); anything else would come
                # back every poll: said once, and this sandbox is no longer polled
                w.gone = True
                if not (isinstance(e, OSError) and e.errno in (errno.ENODEV, errno.ENOENT)):
                    print(f"agentcell: limit events: {w.target.sandbox_id} no longer watched: {e!r}", file=sys.stderr)
            self._flush(w)

    def _sample(self, w: _Watched, baseline: bool = False) -> tuple[int, int, int, int]:
        f = w.files
        oom = _value(_pread(f.oom), b"oom_kill ")
        refused = _value(_pread(f.pids), b"max ")
        tasks = int(_pread(f.pids_current))
        # pids.peak: a burst to the limit between two polls. It never goes down, so it tells only of the
        # first one; it is closed once it did (or if the sandbox was there before its watch).
        peak = int(_pread(f.pids_peak)) if f.pids_peak >= 0 else 0
        if peak >= _near(f.pids_limit):
            f.drop_peak()
        if baseline:
            w.oom_told = w.oom_counted_before = oom
            w.pids_max_count = refused
            w.periods, w.throttled_periods, w.throttled_ns = self._sample_cpu(w)
            peak = 0
        return oom, refused, tasks, peak

    @staticmethod
    def _sample_cpu(w: _Watched) -> tuple[int, int, int]:
        """cpu.stat's periods, throttled periods, throttled ns: read once a window, not every poll."""
        cpu = _pread(w.files.cpu)
        return (_value(cpu, b"nr_periods "), _value(cpu, b"nr_throttled "),
                _value(cpu, w.files.throttled_key) * w.files.throttled_ns_per_unit)

    def _poll_one(self, w: _Watched, now: float) -> None:
        oom, refused, tasks, peak = self._sample(w)
        # OOM kills the log did not explain within a whole poll interval
        unexplained = w.oom_counted_before - w.oom_told
        if unexplained > 0:
            w.oom_told += unexplained
            self._emit(w, event("limit.oom", count=unexplained, host_pid=None, comm=None, constraint=None,
                                victim_known=False), now)
        w.oom_counted_before = oom
        self._poll_pids(w, refused, tasks, peak, now)
        self._poll_disk(w, now)
        if now - w.cpu_window_start >= self.window:
            self._end_cpu_window(w, now)

    def _end_cpu_window(self, w: _Watched, now: float) -> None:
        periods, throttled, throttled_ns = self._sample_cpu(w)
        n_periods, n_throttled = periods - w.periods, throttled - w.throttled_periods
        throttled_s, window_s = (throttled_ns - w.throttled_ns) / 1e9, now - w.cpu_window_start
        if (n_throttled > 0 and n_throttled >= self.cpu_min_ratio * n_periods
                and throttled_s >= self.cpu_min_ratio * window_s):
            w.cpu_streak += 1
            self._emit(w, event("limit.cpu", throttled_s=round(throttled_s, 3), window_s=round(window_s, 3),
                                throttled_periods=n_throttled, periods=n_periods, cpu_limit=self._cpu_limit(w), streak=w.cpu_streak), now)
        else:
            w.cpu_streak = 0
        w.cpu_window_start = now
        w.periods, w.throttled_periods, w.throttled_ns = periods, throttled, throttled_ns

    def _poll_pids(self, w: _Watched, refused: int, tasks: int, peak: int, now: float) -> None:
        """Forks refused. RLIMIT_NPROC (ns_limits.py) equals the pids limit and is checked first, so a
        fork bomb of one uid is mostly refused by it, which no counter records: a sandbox at its limit
        (or whose peak reached it since the last poll) counts as refused too, once until it is well
        below again."""
        limit = w.files.pids_limit
        at_limit = tasks >= _near(limit) or peak >= _near(limit)
        counted = refused - w.pids_max_count
        w.pids_max_count = refused
        if counted > 0 or (at_limit and not w.pids_at_limit):
            self._emit(w, event("limit.pids", count=counted, tasks=tasks, pids_max=limit,
                                refused_by="cgroup" if counted > 0 else "limit"), now)
        if at_limit:
            w.pids_at_limit = True
        elif tasks < limit - 2 * (limit - _near(limit)):
            w.pids_at_limit = False

    def _poll_disk(self, w: _Watched, now: float) -> None:
        st = os.fstatvfs(w.disk_fd)
        size = st.f_blocks * st.f_frsize
        free = st.f_bavail * st.f_frsize
        if not w.disk_full:
            if st.f_bavail == 0 or st.f_favail == 0:
                w.disk_full = True
                self._emit(w, event("limit.disk", used_mb=round((size - free) / (1 << 20), 1),
                                    limit_mb=round(size / (1 << 20), 1),
                                    reason="inodes" if st.f_bavail else "space"), now)
        elif free >= max(_DISK_REARM_MIN_BYTES, size * _DISK_REARM_FRACTION) and st.f_favail > 0:
            w.disk_full = False

    @staticmethod
    def _cpu_limit(w: _Watched) -> float | None:
        try:
            if len(w.files.cpu_quota) == 1:
                quota, period = _read_small(w.files.cpu_quota[0]).split()
            else:
                quota, period = (_read_small(p) for p in w.files.cpu_quota)
            return None if quota in ("max", "-1") else round(int(quota) / int(period), 3)
        except (OSError, ValueError):
            return None

    # -- rate limit: one event per kind per sandbox per window ----------------------------------------------

    def _emit(self, w: _Watched, ev: dict[str, Any], now: float) -> None:
        kind = ev["kind"]
        last = w.last_sent.get(kind)
        if last is None or now - last >= self.window:
            w.last_sent[kind] = now
            self.sink(w.target.sandbox_id, ev)
            return
        held = w.held.get(kind)
        if held is None:
            w.held[kind] = ev
        else:  # fold: the latest event's details, the window's total count
            ev["count"] = held.get("count", 1) + ev.get("count", 1)
            ev["time"] = held["time"]
            w.held[kind] = ev

    def _flush(self, w: _Watched, force: bool = False) -> None:
        if not w.held:
            return
        now = time.monotonic()
        for kind in list(w.held):
            if force or now - w.last_sent.get(kind, 0.0) >= self.window:
                w.last_sent[kind] = now
                self.sink(w.target.sandbox_id, w.held.pop(kind))

    # -- the kernel log ---------------------------------------------------------------------------------

    def _kmsg_main(self, wake_r: int) -> None:
        """The kernel log's thread: reads every record, hands OOM kills of watched sandboxes to the loop."""
        poller = select.poll()
        poller.register(self._kmsg_fd, select.POLLIN)
        poller.register(wake_r, select.POLLIN)
        try:
            while True:
                if any(fd == wake_r for fd, _ in poller.poll()):
                    return
                self._read_kmsg()
        finally:
            os.close(wake_r)

    def _read_kmsg(self) -> None:
        for _ in range(_KMSG_RECORDS_PER_WAKE):
            try:
                record = os.read(self._kmsg_fd, 8192)
            except BlockingIOError:
                return
            except BrokenPipeError:  # the ring overwrote records we had not read: the counters still count
                self.kmsg_lost += 1
                continue
            except OSError:
                return
            if not record:
                return
            if b"oom-kill:" in record or b"Killed process" in record:
                found = self._kmsg_record(record)
                if found is not None and self._loop is not None:
                    with contextlib.suppress(RuntimeError):  # the loop closed
                        self._loop.call_soon_threadsafe(self._oom_seen, *found)

    def _oom_seen(self, sandbox_id: str, ev: dict[str, Any]) -> None:
        """On the loop: an OOM kill the log attributed to a sandbox."""
        w = self._watched.get(sandbox_id)
        if w is None:
            return
        w.oom_told += 1
        self._emit(w, ev, time.monotonic())

    def _kmsg_record(self, record: bytes) -> tuple[str, dict[str, Any]] | None:
        """In the log's thread: (sandbox id, limit.oom event) for a kill of a watched sandbox's task. It
        only reads the loop's maps (single dict lookups, atomic under the GIL)."""
        header, sep, rest = record.partition(b";")
        prio = header.split(b",", 1)[0]
        if not sep or not prio.isdigit() or int(prio) >> 3 != 0:  # not the kernel's own (facility 0)
            return None
        text = rest.split(b"\n", 1)[0].decode("utf-8", "replace")
        m = _OOM_KILL_RE.match(text)
        if m is not None:
            constraint, task_memcg, comm, pid, uid = m.groups()
            sid = self._by_memcg.get(task_memcg)
            if sid is not None:
                if len(self._victims) >= _PENDING_VICTIMS:  # their second records were lost: the oldest goes
                    del self._victims[next(iter(self._victims))]
                host_pid = int(pid)
                self._victims[host_pid] = (sid, {
                    "host_pid": host_pid, "comm": comm, "host_uid": int(uid),
                    "constraint": "memcg" if constraint == "CONSTRAINT_MEMCG" else constraint.lower(),
                    "pid": self._ns_pid(host_pid, task_memcg)})
            return None
        m = _KILLED_RE.match(text)
        if m is None:
            return None
        message, pid, comm, total_vm, anon, file_rss, shmem, uid = m.groups()
        host_pid = int(pid)
        known = self._victims.pop(host_pid, None)
        if known is not None:
            sid, info = known
        else:  # its oom-kill record was rate limited away: the uid tells whose it is
            sid = self._by_uid.get(int(uid))
            w = self._watched.get(sid) if sid is not None else None
            if sid is None or w is None:
                return None
            info = {"host_pid": host_pid, "comm": comm, "host_uid": int(uid),
                    "constraint": "memcg" if message.startswith("Memory cgroup") else "global",
                    "pid": self._ns_pid(host_pid, w.memcg)}
        pid_in = info.pop("pid")
        return sid, event("limit.oom", pid=pid_in, count=1, victim_known=True,
                          rss_kb=int(anon) + int(file_rss) + int(shmem), anon_rss_kb=int(anon),
                          total_vm_kb=int(total_vm), **info)

    @staticmethod
    def _ns_pid(host_pid: int, memcg: str | None) -> int | None:
        """The victim's pid in its sandbox, while it still exists and is in the sandbox's memory cgroup."""
        try:
            with open(f"/proc/{host_pid}/status", "rb") as f:
                status = f.read()
            with open(f"/proc/{host_pid}/cgroup", "rb") as f:
                groups = f.read().decode(errors="replace").splitlines()
        except OSError:
            return None
        if memcg is None or not any(line.split(":", 2)[1] in ("memory", "") and line.split(":", 2)[2] == memcg
                                    for line in groups if line.count(":") >= 2):
            return None
        for line in status.splitlines():
            if line.startswith(b"NSpid:"):
                return int(line.split()[-1])
        return None
