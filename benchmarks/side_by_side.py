"""agentcell side by side with the floor of what its isolation costs, in one process, interleaved.

    .venv/bin/python benchmarks/side_by_side.py [--runs 30] [--burst 100] [--burst-rounds 3]
        [--sizes 20,200,1000] [--only fork-ns,agentcell-tcp] [--json out.json]

Contenders (table columns):
  agentcell-embedded  own SDK without api_url: the SDK's private server on a unix socket (sdk/embedded.py)
  agentcell-tcp       own SDK over TCP (api_url=) to `python -m agentcell serve` started by this script
  e2b-sdk-tcp         the official e2b_code_interpreter SDK against that same server
  fork                a warm Python (numpy, pandas, matplotlib/Agg imported, gc.freeze()) forks a child
                      that evaluates the lines it is sent
  fork-ns             the same, but the child is pid 1 of a new pid namespace and, as its own
                      unprivileged host uid, unshares user+mount+net+ipc+uts namespaces and maps itself
                      to root there: the floor of agentcell's isolation; every ratio is against it
  bwrap               bubblewrap around a fresh `python -c` (no warm parent); skipped when not installed

The baselines live in one helper process, the *baseline zygote* (this file run with
--baseline-zygote), which forks (or spawns bwrap) on request: the benchmark sends it one end of a
fresh socketpair, the child evaluates what arrives on it. The benchmark process itself stays light,
and every figure runs from the request to the answer arriving back here.

Figures (rows), p50 / p95:
  create -> 1+1        create a sandbox, run_code("1+1") returns "2" (the kill afterwards is not counted)
  burst: wall, each    --burst creates at once (asyncio.gather; baselines: that many fork requests)
  run_code 1+1         a follow-up round trip on a sandbox that already exists
  commands.run true    the same for a command (baselines: `bash -c true` from the child)
  idle PSS @N          N idle sandboxes that ran 1+1 once: their processes' summed PSS / N. For agentcell:
                       what the server's cgroups, <cgroup root>/agentcell/<server pid>-*/*/, hold after
                       the N creates minus what they held before (its standbys, refilled by then), over
                       N; processes still being prepared (host root) are left out. For baselines: every
                       descendant of the baseline zygote. Measured on
                       agentcell-tcp only (agentcell-embedded runs the same server code).

Interleaving: each round shuffles the contenders and takes one sample of each, so noise on the machine
hits all of them alike. The script measures the agentcell checkout it lives in (it puts that first on
sys.path and PYTHONPATH). Everything stays on this machine: loopback TCP and unix sockets only.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import glob
import inspect
import json
import os
import random
import resource
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
REFERENCE = "fork-ns"
AGENTCELL = ("agentcell-embedded", "agentcell-tcp", "e2b-sdk-tcp")
BASELINES = ("fork", "fork-ns", "bwrap")
ALL_CONTENDERS = AGENTCELL + BASELINES
MEMORY_CONTENDERS = ("agentcell-tcp", *BASELINES)
LONG_TIMEOUT_S = 3600  # the server's default --max-timeout: sandboxes that must outlive a long run
BASELINE_UID_BASE = 2_000_000_000  # fork-ns children's host uids: far above agentcell's ranges (uids.py)

# --- Linux bits the baselines need (Python 3.11 has no os.unshare / os.setns) ----------------------

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
PR_SET_PDEATHSIG, PR_SET_DUMPABLE = 1, 4
_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def unshare(flags: int) -> None:
    _check(_libc.unshare(flags), "unshare")


def setns(fd: int, nstype: int) -> None:
    _check(_libc.setns(fd, nstype), "setns")


def prctl(option: int, arg: int) -> None:
    _check(_libc.prctl(option, arg, 0, 0, 0), "prctl")


# --- statistics and output ----------------------------------------------------------------------------


def quantile(samples: list[float], q: float) -> float:
    """Nearest-rank quantile: with few samples p95 is simply the largest but one or the largest."""
    s = sorted(samples)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


@dataclass
class Cell:
    """One table cell: p50 / p95 of samples in the row's unit, or a note instead (or beside them)."""

    samples: list[float] = field(default_factory=list)
    note: str = ""

    @property
    def p50(self) -> float:
        return quantile(self.samples, 0.5)

    @property
    def p95(self) -> float:
        return quantile(self.samples, 0.95)


@dataclass
class Row:
    label: str
    unit: str  # "ms" (samples in seconds, shown in ms) or "MiB" (one sample: MiB per sandbox)
    cells: dict[str, Cell] = field(default_factory=dict)
    errors: dict[str, list[str]] = field(default_factory=dict)
    details: dict[str, dict[str, Any]] = field(default_factory=dict)  # for --json only

    def cell(self, contender: str) -> Cell:
        return self.cells.setdefault(contender, Cell())

    def add(self, contender: str, value: float) -> None:
        self.cell(contender).samples.append(value)

    def fail(self, contender: str, exc: BaseException) -> None:
        self.errors.setdefault(contender, []).append(describe(exc))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e)[:160]}"


def _num(v: float) -> str:
    return f"{v:.0f}" if v >= 1000 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def _format(row: Row, contender: str, reference: Cell | None) -> tuple[str, str]:
    """(value line, ratio line) of one cell."""
    c = row.cells.get(contender)
    if c is None or not c.samples:
        return (c.note if c else "-"), ""
    scale = 1000.0 if row.unit == "ms" else 1.0
    if row.unit == "MiB":  # a single figure per size
        value = f"{_num(c.p50)} MiB" + (f" ({c.note})" if c.note else "")
        ratio = f"x{c.p50 / reference.p50:.1f}" if reference and reference.samples and reference.p50 else ""
        return value, ratio
    value = f"{_num(c.p50 * scale)} / {_num(c.p95 * scale)}"
    ratio = ""
    if reference and reference.samples and reference.p50 and reference.p95:
        ratio = f"x{c.p50 / reference.p50:.1f} / x{c.p95 / reference.p95:.1f}"
    return value, ratio


def render_table(rows: list[Row], columns: list[str]) -> str:
    """Rows = figures, columns = contenders; each cell 'p50 / p95', below it the ratio to fork-ns."""
    head = ["figure", *columns]
    lines: list[list[str]] = [head]
    for row in rows:
        ref = row.cells.get(REFERENCE)
        values, ratios = zip(*(_format(row, c, ref) for c in columns), strict=True)
        lines.append([f"{row.label} ({row.unit})", *values])
        if any(ratios):
            lines.append([f"  vs {REFERENCE}", *ratios])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    out = []
    for i, line in enumerate(lines):
        out.append("  ".join(text.ljust(w) if j == 0 else text.rjust(w) for j, (text, w) in
                             enumerate(zip(line, widths, strict=True))).rstrip())
        if i == 0:
            out.append("-" * len(out[0]))
    return "\n".join(out)


def render_errors(rows: list[Row]) -> str:
    out = []
    for row in rows:
        for contender, errs in row.errors.items():
            out.append(f"  {row.label} / {contender}: {len(errs)} failed, first: {errs[0]}")
    return "errors (samples left out of the table):\n" + "\n".join(out) if out else ""


# --- the baseline zygote: the helper process that forks the baselines ------------------------------


def child_loop(rfd: int, wfd: int) -> None:
    """A baseline sandbox: answer each line on rfd on wfd. An expression -> str(its value);
    '!cmd' -> cmd's exit status under `bash -c`. Self-contained: bwrap runs its source with `python -c`."""
    import os
    import subprocess

    namespace: dict = {}
    buf = b""
    while True:
        data = os.read(rfd, 65536)
        if not data:
            return
        buf += data
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            text = line.decode()
            if text.startswith("!"):
                out = str(subprocess.run(["/bin/bash", "-c", text[1:]], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL).returncode)
            else:
                out = str(eval(text, namespace))
            os.write(wfd, out.encode() + b"\n")


CHILD_SOURCE = textwrap.dedent(inspect.getsource(child_loop)) + "\nchild_loop(0, 1)\n"


def _preload() -> None:
    """What a warm parent has imported: the same data stack agentcell's zygote preloads."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot  # noqa: F401
    import numpy  # noqa: F401
    import pandas  # noqa: F401

    gc.collect()
    gc.freeze()  # keep the collector off the inherited objects, so children do not copy their pages


def _enter_namespaces(uid: int) -> None:
    """fork-ns child (already pid 1 of its pid namespace): become `uid` on the host, then root of
    new user+mount+net+ipc+uts namespaces, the way agentcell's sandbox_init does."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)
    prctl(PR_SET_DUMPABLE, 1)  # the id change cleared it, which would leave /proc/self/*_map root's
    unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {uid} 1"), ("gid_map", f"0 {uid} 1")):
        with open(f"/proc/self/{name}", "w") as f:
            f.write(text)


def _fork_child(mode: str, fd: int, seq: int, pidns: int, ctl: socket.socket) -> None:
    if mode == "fork-ns":
        unshare(CLONE_NEWPID)  # the next child is pid 1 of a new pid namespace (one fork, like agentcell)
    try:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                ctl.close()
                if mode == "fork-ns":
                    _enter_namespaces(BASELINE_UID_BASE + seq % 1_000_000)
                prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after the id change, which clears it
                child_loop(fd, fd)
            except BaseException as e:  # a child must never return into the zygote's loop
                print(f"baseline child: {e!r}", file=sys.stderr, flush=True)
                code = 1
            os._exit(code)
    finally:
        if mode == "fork-ns":
            setns(pidns, CLONE_NEWPID)  # only the zygote gets here: its later children go back to its own


def _spawn_bwrap(fd: int) -> None:
    bwrap = shutil.which("bwrap")
    assert bwrap, "bwrap is not installed"
    # the interpreter's environment stays in sight when it lives under /tmp (a checkout's venv there)
    keep = ["--ro-bind", sys.prefix, sys.prefix] if sys.prefix.startswith("/tmp/") else []
    argv = [bwrap, "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp", *keep,
            "--unshare-all", "--die-with-parent", "--new-session", "--", sys.executable, "-c", CHILD_SOURCE]
    os.posix_spawn(bwrap, argv, os.environ,
                   file_actions=[(os.POSIX_SPAWN_DUP2, fd, 0), (os.POSIX_SPAWN_DUP2, fd, 1)])


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def zygote_main(ctl_fd: int) -> None:
    """The helper: preload, say "ready", then one child per message ("fork", "fork-ns" or "bwrap",
    with the child's socket attached). Exits when the benchmark closes its end."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # never outlive the benchmark
    _preload()
    pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
    ctl = socket.socket(fileno=ctl_fd)
    ctl.send(b"ready")
    seq = 0
    while True:
        readable, _, _ = select.select([ctl], [], [], 0.5)
        _reap()
        if not readable:
            continue
        msg, fds, _, _ = socket.recv_fds(ctl, 64, 1)
        if not msg:
            return
        seq += 1
        try:
            if msg == b"bwrap":
                _spawn_bwrap(fds[0])
            else:
                _fork_child(msg.decode(), fds[0], seq, pidns, ctl)
        except Exception as e:  # the benchmark sees EOF on the child's socket and reports it
            print(f"baseline zygote: {msg!r}: {e!r}", file=sys.stderr, flush=True)
        finally:
            for fd in fds:
                os.close(fd)


class BaselineZygote:
    """The benchmark's handle on the helper process."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MPLBACKEND": "Agg"}  # single-threaded forks
        self.proc = subprocess.Popen([sys.executable, __file__, "--baseline-zygote", str(theirs.fileno())],
                                     pass_fds=[theirs.fileno()], env=env, stdin=subprocess.DEVNULL)
        theirs.close()
        self.ctl = ours
        self.ctl.settimeout(120)
        if self.ctl.recv(16) != b"ready":
            raise RuntimeError("the baseline zygote did not start")
        self.ctl.settimeout(None)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def spawn(self, mode: str) -> socket.socket:
        """Ask for one child; returns our end of its socket (the child answers once it is up)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        socket.send_fds(self.ctl, [mode.encode()], [theirs.fileno()])
        theirs.close()
        return ours

    def stop(self) -> None:
        self.ctl.close()  # EOF: the zygote exits, its children get SIGKILL (pdeathsig)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def ask(sock: socket.socket, line: str) -> str:
    sock.sendall(line.encode() + b"\n")
    buf = b""
    while not buf.endswith(b"\n"):
        data = sock.recv(4096)
        if not data:
            raise RuntimeError("the baseline child died (see the zygote's stderr)")
        buf += data
    return buf[:-1].decode()


# --- memory ----------------------------------------------------------------------------------------


@dataclass
class Memory:
    pss_kib: int = 0
    private_dirty_kib: int = 0
    processes: int = 0

    def add_pid(self, pid: int) -> None:
        try:
            text = Path(f"/proc/{pid}/smaps_rollup").read_text()
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            return  # gone meanwhile
        for line in text.splitlines():
            if line.startswith("Pss:"):
                self.pss_kib += int(line.split()[1])
                self.processes += 1
            elif line.startswith("Private_Dirty:"):
                self.private_dirty_kib += int(line.split()[1])


def settled_descendants(root: int, timeout: float = 10.0) -> list[int]:
    """descendants(root) once the set is the same twice 0.3 s apart: a baseline taken while the children of
    an earlier figure (a burst's bwrap sandboxes) still exit would make the next figure's delta negative."""
    deadline = time.monotonic() + timeout
    last = sorted(descendants(root))
    while time.monotonic() < deadline:
        time.sleep(0.3)
        now = sorted(descendants(root))
        if now == last:
            return now
        last = now
    return last


def descendants(root: int) -> list[int]:
    """Every process below `root` (not root itself), from /proc/*/stat's ppid field."""
    children: dict[int, list[int]] = {}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
        except (FileNotFoundError, ProcessLookupError):
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after the comm field, which may hold spaces
        children.setdefault(ppid, []).append(int(name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def agentcell_sandbox_pids(server_pid: int) -> list[int]:
    """Processes of the sandboxes of the server `server_pid`: in its cgroups, not host root."""
    base = "/sys/fs/cgroup/memory" if os.path.isdir("/sys/fs/cgroup/memory/agentcell") else "/sys/fs/cgroup"
    pids = []
    for procs in glob.glob(f"{base}/agentcell/{server_pid}-*/*/cgroup.procs"):
        try:
            members = [int(p) for p in Path(procs).read_text().split()]
        except FileNotFoundError:
            continue
        for pid in members:
            try:
                if os.stat(f"/proc/{pid}").st_uid != 0:  # root: a child still being prepared
                    pids.append(pid)
            except FileNotFoundError:
                continue
    return pids


def memory_of(pids: list[int]) -> Memory:
    m = Memory()
    for pid in pids:
        m.add_pid(pid)
    return m


def wait_until(pred: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


# --- contenders ------------------------------------------------------------------------------------


@dataclass
class Burst:
    wall: float
    latencies: list[float]
    failures: list[BaseException]


@dataclass
class IdleMemory:
    per_sandbox: Memory | None  # None: the server refused to create them all
    created: int = 0
    note: str = ""  # why fewer than asked for were created


def is_refusal(e: BaseException) -> bool:
    """The server said no to one more sandbox (429 / 507), in either SDK's words."""
    return type(e).__name__ in ("RateLimitException", "NotEnoughSpaceException")


class Contender:
    """One column: how it creates a sandbox, round-trips on one, bursts, and idles."""

    name: str

    def setup(self) -> None:
        """Warm up (not a sample) and open the session sandbox the round trips use."""

    def teardown(self) -> None:
        """Close the session sandbox."""

    def create_once(self) -> float:
        raise NotImplementedError

    def run_code_rt(self) -> float:
        raise NotImplementedError

    def command_rt(self) -> float:
        raise NotImplementedError

    async def burst(self, n: int) -> Burst:
        raise NotImplementedError

    async def idle_memory(self, n: int) -> IdleMemory:
        raise NotImplementedError


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def expect(got: object, want: object) -> None:
    assert got == want, f"{got!r} != {want!r}"


class SdkContender(Contender):
    """agentcell through an E2B-shaped SDK: our own (embedded or TCP) or the official e2b one."""

    def __init__(self, name: str, sync_cls: Any, async_cls: Any, create_kwargs: dict[str, Any],
                 server_pid: Callable[[], int] | None = None) -> None:
        self.name = name
        self.sync_cls, self.async_cls = sync_cls, async_cls
        self.kw = create_kwargs
        self.server_pid = server_pid
        self.session: Any = None

    def setup(self) -> None:
        self.create_once()  # warm-up (and, embedded, the server's start): not a sample
        self.session = self.sync_cls.create(timeout=LONG_TIMEOUT_S, **self.kw)
        self.run_code_rt()
        self.command_rt()

    def teardown(self) -> None:
        if self.session is not None:
            self.session.kill()
            self.session = None

    def create_once(self) -> float:
        t = time.perf_counter()
        sbx = self.sync_cls.create(**self.kw)
        try:
            result = sbx.run_code("1+1").text
            elapsed = time.perf_counter() - t
            assert result == "2", result
        finally:
            sbx.kill()
        return elapsed

    def run_code_rt(self) -> float:
        return timed(lambda: expect(self.session.run_code("1+1").text, "2"))

    def command_rt(self) -> float:
        return timed(lambda: expect(self.session.commands.run("true").exit_code, 0))

    async def _create_and_run(self, timeout: int = 300) -> tuple[Any, float]:
        t = time.perf_counter()
        sbx = await self.async_cls.create(timeout=timeout, **self.kw)
        try:
            result = (await sbx.run_code("1+1")).text
            elapsed = time.perf_counter() - t
            expect(result, "2")
        except BaseException:
            await sbx.kill()
            raise
        return sbx, elapsed

    async def _kill_all(self, sandboxes: list[Any]) -> None:
        await asyncio.gather(*(s.kill() for s in sandboxes), return_exceptions=True)

    async def burst(self, n: int) -> Burst:
        t0 = time.perf_counter()
        results = await asyncio.gather(*(self._create_and_run() for _ in range(n)), return_exceptions=True)
        wall = time.perf_counter() - t0
        ok = [r for r in results if isinstance(r, tuple)]
        await self._kill_all([sbx for sbx, _ in ok])
        return Burst(wall, [lat for _, lat in ok], [r for r in results if isinstance(r, BaseException)])

    async def idle_memory(self, n: int) -> IdleMemory:
        assert self.server_pid is not None
        server = self.server_pid()
        before = memory_of(agentcell_sandbox_pids(server))
        sem = asyncio.Semaphore(16)  # the server's own create concurrency is what it is; 16 keeps it busy

        async def one() -> Any:
            async with sem:
                return (await self._create_and_run(timeout=LONG_TIMEOUT_S))[0]

        results = await asyncio.gather(*(one() for _ in range(n)), return_exceptions=True)
        sandboxes = [r for r in results if not isinstance(r, BaseException)]
        failed = [r for r in results if isinstance(r, BaseException)]
        try:
            note = f"{len(failed)} of {n} creates failed, first: {describe(failed[0])}" if failed else ""
            if any(is_refusal(e) for e in failed):
                return IdleMemory(None, len(sandboxes), "refused: " + note)
            if not sandboxes:
                raise failed[0]
            # Other failures (transport errors) are reported, and the figure is over those created.
            await asyncio.sleep(1)  # let the last agents settle into their idle state
            after = memory_of(agentcell_sandbox_pids(server))
            return IdleMemory(_per_sandbox(before, after, len(sandboxes)), len(sandboxes), note)
        finally:
            await self._kill_all(sandboxes)
            wait_until(lambda: len(agentcell_sandbox_pids(server)) <= before.processes, 60)


def _per_sandbox(before: Memory, after: Memory, n: int) -> Memory:
    return Memory((after.pss_kib - before.pss_kib) // n, (after.private_dirty_kib - before.private_dirty_kib) // n,
                  after.processes - before.processes)


class BaselineContender(Contender):
    """fork, fork-ns or bwrap, served by the baseline zygote."""

    def __init__(self, mode: str, zygote: BaselineZygote) -> None:
        self.name = mode
        self.zygote = zygote
        self.session: socket.socket | None = None

    def setup(self) -> None:
        self.create_once()
        self.session = self.zygote.spawn(self.name)
        self.run_code_rt()
        self.command_rt()

    def teardown(self) -> None:
        if self.session is not None:
            self.session.close()
            self.session = None

    def create_once(self) -> float:
        t = time.perf_counter()
        sock = self.zygote.spawn(self.name)
        try:
            result = ask(sock, "1+1")
            elapsed = time.perf_counter() - t
            assert result == "2", result
        finally:
            sock.close()  # EOF: the child exits
        return elapsed

    def run_code_rt(self) -> float:
        assert self.session is not None
        session = self.session
        return timed(lambda: expect(ask(session, "1+1"), "2"))

    def command_rt(self) -> float:
        assert self.session is not None
        session = self.session
        return timed(lambda: expect(ask(session, "!true"), "0"))

    async def burst(self, n: int) -> Burst:
        t0 = time.perf_counter()
        sent: dict[socket.socket, float] = {}
        for _ in range(n):  # all requests first, then the answers: the zygote forks them back to back
            sock = self.zygote.spawn(self.name)
            sock.sendall(b"1+1\n")
            sent[sock] = time.perf_counter()
        latencies, failures = self._collect(sent)
        return Burst(time.perf_counter() - t0, latencies, failures)

    @staticmethod
    def _collect(sent: dict[socket.socket, float], timeout: float = 120) -> tuple[list[float], list[BaseException]]:
        """Wait for every child's answer; per child, the time from its request to its answer."""
        latencies: list[float] = []
        failures: list[BaseException] = []
        bufs = {s: b"" for s in sent}
        with selectors.DefaultSelector() as sel:
            for s in sent:
                sel.register(s, selectors.EVENT_READ)
            deadline = time.monotonic() + timeout
            while bufs and time.monotonic() < deadline:
                for key, _ in sel.select(1.0):
                    s = key.fileobj
                    assert isinstance(s, socket.socket)
                    data = s.recv(4096)
                    bufs[s] += data
                    if data and not bufs[s].endswith(b"\n"):
                        continue
                    if data and bufs[s] == b"2\n":
                        latencies.append(time.perf_counter() - sent[s])
                    else:
                        failures.append(RuntimeError(f"baseline child answered {bufs[s]!r}"))
                    sel.unregister(s)
                    del bufs[s]
            failures += [TimeoutError("no answer from a baseline child")] * len(bufs)
        for s in sent:
            s.close()
        return latencies, failures

    async def idle_memory(self, n: int) -> IdleMemory:
        root = self.zygote.pid
        before = memory_of(settled_descendants(root))
        socks = []
        try:
            for _ in range(n):
                socks.append(self.zygote.spawn(self.name))
                assert ask(socks[-1], "1+1") == "2"
            await asyncio.sleep(1)
            after = memory_of(descendants(root))
            return IdleMemory(_per_sandbox(before, after, n), n)
        finally:
            for s in socks:
                s.close()
            wait_until(lambda: len(descendants(root)) <= before.processes, 60)


# --- the agentcell server and the SDKs ---------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(max_sandboxes: int, log_path: Path, extra: list[str]) -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    port = free_port()
    with log_path.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentcell", "serve", "--host", "127.0.0.1", "--port", str(port),
             "--max-sandboxes", str(max_sandboxes), "--egress-uplink", "none",
             "--state-dir", tempfile.mkdtemp(prefix="agentcell-bench-"), *extra],  # a state dir serves one server
            cwd=REPO, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the agentcell server exited ({proc.returncode}); log: {log_path}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code < 500:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.1)
    stop_process(proc)
    raise SystemExit(f"the agentcell server did not start within 120 s; log: {log_path}")


def stop_process(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()  # graceful: the server kills its sandboxes
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def agentcell_contenders(names: list[str], url: str | None, server_pid: int | None) -> list[Contender]:
    from agentcell import AsyncSandbox, Sandbox

    out: list[Contender] = []
    if "agentcell-embedded" in names:
        out.append(SdkContender("agentcell-embedded", Sandbox, AsyncSandbox, {}))
    if "agentcell-tcp" in names:
        assert url and server_pid
        out.append(SdkContender("agentcell-tcp", Sandbox, AsyncSandbox, {"api_url": url}, lambda: server_pid))
    if "e2b-sdk-tcp" in names:
        try:
            from e2b_code_interpreter import AsyncSandbox as E2BAsync
            from e2b_code_interpreter import Sandbox as E2BSync
        except ImportError:
            log("note: e2b-sdk-tcp skipped: e2b_code_interpreter is not installed")
        else:
            # Both of its planes on our server (as tests/conftest.py's e2b_env does); the domain only
            # makes sure nothing it might derive from it could leave this machine.
            assert url
            os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY="e2b_side_by_side",
                              E2B_DOMAIN="localhost")
            os.environ.pop("E2B_DEBUG", None)
            out.append(SdkContender("e2b-sdk-tcp", E2BSync, E2BAsync, {}))
    return out


# --- the run -----------------------------------------------------------------------------------------


def sample(row: Row, contender: Contender, fn: Callable[[], float]) -> None:
    try:
        row.add(contender.name, fn())
    except Exception as e:  # one failed sample must not end a long run; it is reported under the table
        row.fail(contender.name, e)


def measure_rounds(contenders: list[Contender], runs: int, rng: random.Random, rows: dict[str, Row]) -> None:
    for i in range(runs):
        order = contenders[:]
        rng.shuffle(order)
        for c in order:
            sample(rows["create"], c, c.create_once)
            sample(rows["run_code"], c, c.run_code_rt)
            sample(rows["command"], c, c.command_rt)
        log(f"  round {i + 1}/{runs}")


def measure_bursts(contenders: list[Contender], n: int, rounds: int, rng: random.Random,
                   run: Callable[[Awaitable[Burst]], Burst], rows: dict[str, Row]) -> None:
    for i in range(rounds):
        order = contenders[:]
        rng.shuffle(order)
        for c in order:
            try:
                b = run(c.burst(n))
            except Exception as e:
                rows["burst_wall"].fail(c.name, e)
                continue
            rows["burst_wall"].add(c.name, b.wall)
            rows["burst_each"].cells.setdefault(c.name, Cell()).samples.extend(b.latencies)
            for e in b.failures:
                rows["burst_each"].fail(c.name, e)
            log(f"  burst {i + 1}/{rounds} {c.name}: {b.wall:.2f} s, {len(b.failures)} failed")


def measure_memory(contenders: list[Contender], sizes: list[int], rng: random.Random,
                   run: Callable[[Awaitable[IdleMemory]], IdleMemory]) -> list[Row]:
    rows = []
    for n in sizes:
        row = Row(f"idle PSS/sandbox @{n}", "MiB")
        order = [c for c in contenders if c.name in MEMORY_CONTENDERS]
        rng.shuffle(order)
        for c in order:
            log(f"  idle memory: {n} x {c.name}")
            try:
                m = run(c.idle_memory(n))
            except Exception as e:
                row.fail(c.name, e)
                continue
            if m.note:
                row.errors.setdefault(c.name, []).append(m.note)
            if m.per_sandbox is None:
                row.cells[c.name] = Cell(note=f"refused at {m.created}")
                continue
            per = m.per_sandbox
            row.cells[c.name] = Cell([per.pss_kib / 1024], note="" if m.created == n else f"over {m.created}")
            row.details[c.name] = {"pss_kib": per.pss_kib, "private_dirty_kib": per.private_dirty_kib,
                                   "processes_in_all": per.processes, "sandboxes": m.created}
            log(f"    per sandbox: {per.pss_kib / 1024:.2f} MiB PSS, {per.private_dirty_kib / 1024:.2f} MiB "
                f"private dirty ({per.processes} processes in all)")
        if "agentcell-tcp" in row.cells:
            for name in ("agentcell-embedded", "e2b-sdk-tcp"):
                row.cells[name] = Cell(note="= tcp server")
        rows.append(row)
    return rows


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--runs", type=int, default=30, help="rounds of create / run_code / command samples")
    ap.add_argument("--burst", type=int, default=100, help="creates at once in a burst (0: no bursts)")
    ap.add_argument("--burst-rounds", type=int, default=3)
    ap.add_argument("--sizes", default="20,200,1000",
                    help="idle sandbox counts for the memory figure, comma-separated ('' for none)")
    ap.add_argument("--only", default=",".join(ALL_CONTENDERS), help="contenders, comma-separated")
    ap.add_argument("--server-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for the TCP server, repeatable (e.g. --server-arg=--standbys=100)")
    ap.add_argument("--json", type=Path, help="also write every sample here")
    ap.add_argument("--seed", type=int, help="seed of the round order (default: random)")
    ap.add_argument("--baseline-zygote", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.only = [x for x in args.only.split(",") if x]
    unknown = set(args.only) - set(ALL_CONTENDERS)
    if unknown:
        ap.error(f"unknown contenders {sorted(unknown)}; choose from {', '.join(ALL_CONTENDERS)}")
    args.sizes = [int(x) for x in args.sizes.split(",") if x]
    return args


def prepare_environment() -> None:
    """Measure this checkout; embedded mode must not find a server URL; room for 1,000 sockets."""
    sys.path.insert(0, str(REPO))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    os.environ.pop("AGENTCELL_URL", None)
    # the embedded server too: sandboxes without internet, as the baselines (benchmarks/egress.py has its cost)
    os.environ["AGENTCELL_EGRESS_UPLINK"] = "none"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    if hard < 4096:
        log(f"note: only {hard} open files allowed; 1,000 idle sandboxes may not fit")


def to_json(rows: list[Row], columns: list[str], args: argparse.Namespace) -> dict[str, Any]:
    def cell_json(row: Row, name: str, c: Cell) -> dict[str, Any]:
        if not c.samples:
            return {"note": c.note}
        return {"p50": c.p50, "p95": c.p95, "n": len(c.samples), "unit": "s" if row.unit == "ms" else row.unit,
                "samples": c.samples, **row.details.get(name, {})}

    return {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "baseline_zygote"},
        "host": {"cpus": os.cpu_count(), "kernel": os.uname().release},
        "contenders": columns,
        "figures": {row.label: {"cells": {n: cell_json(row, n, c) for n, c in row.cells.items()},
                                "errors": row.errors} for row in rows},
    }


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.baseline_zygote is not None:
        zygote_main(args.baseline_zygote)
        return
    prepare_environment()
    names = list(args.only)
    if "bwrap" in names and shutil.which("bwrap") is None:
        log("note: bwrap skipped: bubblewrap is not installed (no `bwrap` on PATH)")
        names.remove("bwrap")
    rng = random.Random(args.seed)
    server: subprocess.Popen[bytes] | None = None
    zygote: BaselineZygote | None = None
    contenders: list[Contender] = []
    runner = asyncio.Runner()  # one event loop for every async part: the SDKs keep clients per loop
    try:
        url = None
        if {"agentcell-tcp", "e2b-sdk-tcp"} & set(names):
            log_path = Path(tempfile.gettempdir()) / f"agentcell-side-by-side-{os.getpid()}.log"
            server, url = start_server(max([*args.sizes, args.burst]) + 100, log_path, args.server_arg)
            log(f"agentcell server pid {server.pid} at {url}, log {log_path}")
        if set(BASELINES) & set(names):
            zygote = BaselineZygote()
            log(f"baseline zygote pid {zygote.pid}")
        contenders = agentcell_contenders(names, url, server.pid if server else None)
        contenders += [BaselineContender(n, zygote) for n in BASELINES if n in names and zygote]
        for c in contenders:
            log(f"setting up {c.name}")
            c.setup()
        columns = [n for n in ALL_CONTENDERS if n in {c.name for c in contenders}]
        rows = {k: Row(label, "ms") for k, label in (
            ("create", "create -> 1+1"), ("burst_wall", f"burst {args.burst}: wall"),
            ("burst_each", f"burst {args.burst}: each"), ("run_code", "run_code 1+1"),
            ("command", "commands.run true"))}
        log(f"{args.runs} rounds")
        measure_rounds(contenders, args.runs, rng, rows)
        if args.burst > 0:
            log(f"{args.burst_rounds} bursts of {args.burst}")
            measure_bursts(contenders, args.burst, args.burst_rounds, rng, runner.run, rows)
        for c in contenders:  # the session sandboxes must not count as idle ones
            c.teardown()
        memory_rows = measure_memory(contenders, args.sizes, rng, runner.run)
        table = [r for r in rows.values() if r.cells or r.errors] + memory_rows
        print(render_table(table, columns))
        errors = render_errors(table)
        if errors:
            print(errors)
        if args.json:
            args.json.write_text(json.dumps(to_json(table, columns, args), indent=1))
            log(f"wrote {args.json}")
    finally:
        for c in contenders:
            try:
                c.teardown()
            except Exception as e:
                log(f"teardown of {c.name}: {e!r}")
        runner.close()
        if "agentcell-embedded" in names:
            from agentcell.sdk.embedded import stop_server

            stop_server()
        if zygote:
            zygote.stop()
        if server:
            stop_process(server)


if __name__ == "__main__":
    main()
