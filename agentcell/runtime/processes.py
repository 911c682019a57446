"""The sandbox's process table: start, connect, list, input, signal, close stdin, resize.

Processes are started with ``posix_spawn`` (vfork: cheap even though the agent holds NumPy, pandas and
IPython in memory) in a new session, with every signal at its default. vfork stops the agent until
the child's exec is done: while the sandbox's policy may hold an exec for a human's decision
(policy.holds_exec(), the exec policy's "ask"), they are started with fork + exec instead, which
costs the agent a copy of its page tables per start but never waits for the exec. The agent's own fds are all
close-on-exec, so a child gets only its stdio. Exit statuses come from the agent's single reaper; the
output of a process fans out to any number of subscribers (the start call plus ``proc.connect`` calls).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import errno
import fcntl
import os
import shutil
import signal
import struct
import termios
from dataclasses import dataclass, field
from typing import Any, NoReturn

from agentcell.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    SandboxError,
)
from agentcell.runtime import policy, rootcaps
from agentcell.runtime.reaper import Reaper, describe_status

READ_SIZE = 256 * 1024  # per read(); well under the 1 MiB frame cap
_HIGH_WATER = 8 << 20  # a subscriber this far behind pauses the process's output (backpressure)
_LOW_WATER = 1 << 20
_PTY_DRAIN_GRACE = 0.5  # pty output reaches the master a moment after the writer exits
_DEADLINE_SLACK = 0.1  # seconds before its deadline within which a process whose caller left is killed
CHILD_OOM_SCORE_ADJ = 500  # user processes die before the agent (-900) when memory runs out
_DEFAULT_SIGNALS = frozenset(signal.valid_signals()) - {signal.SIGKILL, signal.SIGSTOP}

Event = tuple[dict[str, Any], bytes]


def check_user(user: str | None) -> bool:
    """True for root (the sandbox's own: uid 0 of its user namespace, see rootcaps.py)."""
    if user not in (None, "", "user", "root"):
        raise InvalidArgumentError(f"unknown user {user!r}; a sandbox has the users 'user' and 'root'")
    return rootcaps.check(user)


class Subscriber:
    """One consumer of a process's events, with its own queue."""

    def __init__(self, proc: Process) -> None:
        self._proc = proc
        self._items: collections.deque[Event | None] = collections.deque()
        self._ready = asyncio.Event()
        self.pending = 0  # payload bytes queued and not yet taken

    def push(self, item: Event | None) -> None:
        self._items.append(item)
        if item is not None:
            self.pending += len(item[1])
        self._ready.set()

    async def get(self) -> Event | None:
        """The next event; None after the end event (the stream is over)."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if item is not None:
            self.pending -= len(item[1])
            if self.pending < _LOW_WATER:
                self._proc.maybe_resume()
        return item

    @property
    def process(self) -> Process:
        return self._proc

    def close(self) -> None:
        self._proc.unsubscribe(self)


class _InputPipe:
    """A non-blocking writer for a child's stdin (or pty master) that never blocks the agent."""

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int, owns_fd: bool) -> None:
        self._loop = loop
        self.fd = fd
        self._owns = owns_fd
        self._buf = bytearray()
        self._close_when_flushed = False
        self.closed = False

    def write(self, data: bytes) -> None:
        if self.closed or self._close_when_flushed:
            raise InvalidArgumentError("stdin of this process is closed")
        was_empty = not self._buf
        self._buf += data
        if was_empty:
            self._flush()

    def _flush(self) -> None:
        while self._buf:
            try:
                n = os.write(self.fd, self._buf[:READ_SIZE])
            except BlockingIOError:
                self._loop.add_writer(self.fd, self._flush)
                return
            except OSError:  # the reader is gone (EPIPE, EIO): drop what it will never read
                self._buf.clear()
                break
            del self._buf[:n]
        self._loop.remove_writer(self.fd)
        if self._close_when_flushed:
            self.close(force=True)

    def close(self, force: bool = False) -> None:
        if self.closed:
            return
        if self._buf and not force:
            self._close_when_flushed = True
            return
        self._loop.remove_writer(self.fd)
        self.closed = True
        if self._owns:
            with contextlib.suppress(OSError):
                os.close(self.fd)


@dataclass(eq=False)
class Process:
    pid: int
    tag: str | None
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str
    pty: bool
    loop: asyncio.AbstractEventLoop
    table: ProcessTable
    out_fds: dict[int, str] = field(default_factory=dict)  # fd -> event name (stdout/stderr/pty)
    stdin: _InputPipe | None = None
    subscribers: set[Subscriber] = field(default_factory=set)
    status: int | None = None
    timeout: asyncio.TimerHandle | None = None
    ended: bool = False
    paused: bool = False
    timed_out: bool = False

    def info(self) -> dict[str, Any]:
        return {"pid": self.pid, "tag": self.tag, "cmd": self.cmd, "args": self.args,
                "envs": self.envs, "cwd": self.cwd}  # fmt: skip

    def subscribe(self) -> Subscriber:
        sub = Subscriber(self)
        sub.push(({"event": "start", "pid": self.pid}, b""))
        self.subscribers.add(sub)
        return sub

    def unsubscribe(self, sub: Subscriber) -> None:
        self.subscribers.discard(sub)
        self.maybe_resume()

    def _broadcast(self, header: dict[str, Any], payload: bytes = b"") -> None:
        for sub in self.subscribers:
            sub.push((header, payload))
            if sub.pending > _HIGH_WATER and not self.paused:
                self.paused = True
                for fd in self.out_fds:
                    self.loop.remove_reader(fd)

    def maybe_resume(self) -> None:
        if self.paused and all(s.pending < _LOW_WATER for s in self.subscribers):
            self.paused = False
            for fd in self.out_fds:
                self.loop.add_reader(fd, self._on_readable, fd)

    def watch_output(self) -> None:
        for fd in self.out_fds:
            os.set_blocking(fd, False)
            self.loop.add_reader(fd, self._on_readable, fd)

    def _on_readable(self, fd: int) -> None:
        self._read_once(fd)

    def _read_once(self, fd: int) -> bool:
        """Forward one chunk; False when nothing more is readable now (EAGAIN) or ever (EOF)."""
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return False
        except OSError as e:  # EIO: the pty's last slave fd closed
            if e.errno != errno.EIO:
                raise
            data = b""
        if not data:
            self._close_output(fd)
            if self.status is not None and not self.out_fds:
                self._finish()
            return False
        self._broadcast({"event": self.out_fds[fd]}, data)
        return True

    def _close_output(self, fd: int) -> None:
        self.loop.remove_reader(fd)
        self.out_fds.pop(fd, None)
        if self.stdin is not None and self.stdin.fd == fd:  # the pty master serves both directions
            self.stdin.close(force=True)
        with contextlib.suppress(OSError):
            os.close(fd)

    def on_exit(self, status: int) -> None:
        self.status = status
        if self.timeout is not None:
            self.timeout.cancel()
        # Everything the process wrote before exiting is in its pipes now; take it, then end. Output
        # of leftover grandchildren is not waited for (as envd: Wait closes the pipes).
        for fd in list(self.out_fds):
            while fd in self.out_fds and self._read_once(fd):
                pass
        if self.out_fds and self.pty:
            self.loop.call_later(_PTY_DRAIN_GRACE, self._finish)
        else:
            self._finish()

    def _finish(self) -> None:
        if self.ended:
            return
        self.ended = True
        for fd in list(self.out_fds):
            while fd in self.out_fds and self._read_once(fd):
                pass
            if fd in self.out_fds:
                self._close_output(fd)
        if self.stdin is not None:
            self.stdin.close(force=True)
        assert self.status is not None
        exit_code, exited, text = describe_status(self.status)
        end: dict[str, Any] = {"event": "end", "exit_code": exit_code, "exited": exited, "status": text}
        if self.timed_out:  # the server turns this into Connect deadline_exceeded, as envd does
            end["timed_out"] = True
            end["error"] = "the command ran past its timeout and was killed"
        self._broadcast(end)
        for sub in self.subscribers:
            sub.push(None)
        self.subscribers.clear()
        self.table.forget(self)

    def kill(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError), rootcaps.kill_capability():
            os.kill(self.pid, sig)

    def kill_on_deadline(self) -> None:
        self.timed_out = True
        self.kill_group()

    def expire_if_due(self) -> None:
        """The caller stopped waiting at (about) the process's deadline: the server's Connect timer
        for the request started before ours, so it fires first. Kill the process now, not a moment
        later, so that the caller's next command cannot find it still running."""
        if self.timeout is not None and not self.ended and self.timeout.when() - self.loop.time() <= _DEADLINE_SLACK:
            self.timeout.cancel()
            self.kill_on_deadline()

    def kill_group(self) -> None:
        """Timeouts take the whole session's process group, not just the shell."""
        try:
            with rootcaps.kill_capability():
                os.killpg(self.pid, signal.SIGKILL)
        except OSError:
            self.kill(signal.SIGKILL)


class ProcessTable:
    def __init__(self, reaper: Reaper, base_env: dict[str, str], home: str,
                 oom_score_adj: int = CHILD_OOM_SCORE_ADJ) -> None:  # fmt: skip
        self._reaper = reaper
        self._oom_score_adj = oom_score_adj
        self._base_env = dict(base_env)
        self._home = home
        self._procs: dict[int, Process] = {}

    def update_envs(self, envs: dict[str, str]) -> None:
        """Env vars every process started from now on gets (the tenant's, at the claim)."""
        self._base_env.update(envs)

    # -- lookup ---------------------------------------------------------------------------------
    def find(self, pid: int | None = None, tag: str | None = None) -> Process:
        if pid is not None:
            proc = self._procs.get(int(pid))
            if proc is not None:
                return proc
            raise NotFoundError(f"process with pid {pid} not found (it ended or never existed)")
        if tag is not None:
            for proc in self._procs.values():
                if proc.tag == tag:
                    return proc
            raise NotFoundError(f"process with tag {tag!r} not found (it ended or never existed)")
        raise InvalidArgumentError("give a pid or a tag")

    def forget(self, proc: Process) -> None:
        self._procs.pop(proc.pid, None)

    def list(self) -> list[dict[str, Any]]:
        return [p.info() for p in self._procs.values()]

    # -- start ----------------------------------------------------------------------------------
    def start(self, req: dict[str, Any]) -> Subscriber:
        """Spawn the process of a ``proc.start`` request and return its first subscriber."""
        as_root = check_user(req.get("user"))
        cmd = req.get("cmd")
        if not isinstance(cmd, str) or not cmd:
            raise InvalidArgumentError("cmd must be a non-empty string")
        args = [str(a) for a in req.get("args") or []]
        envs = {str(k): str(v) for k, v in (req.get("envs") or {}).items()}
        base = self._base_env
        if as_root:  # root's own HOME, name and PATH (with the sbin directories), as su - would set
            base = {**base, "HOME": rootcaps.ROOT_HOME, "USER": "root", "LOGNAME": "root", "PATH": rootcaps.root_path(base.get("PATH", os.defpath))}
        env = {**base, **envs}
        cwd = self._resolve_cwd(req.get("cwd"), rootcaps.ROOT_HOME if as_root else self._home)
        exe = cmd if "/" in cmd else shutil.which(cmd, path=env.get("PATH", os.defpath))
        if exe is None:
            raise NotFoundError(f"command {cmd!r} not found in PATH {env.get('PATH', '')!r}")
        if exe == "/bin/bash" and not os.path.exists(exe) and os.path.exists("/bin/sh"):
            # E2B's SDKs run every command through /bin/bash -l -c: an image without bash (Alpine's
            # busybox, for one) runs it with its POSIX shell, named as itself (busybox picks by argv[0])
            exe = cmd = "/bin/sh"
        pty_size = req.get("pty")
        loop = asyncio.get_running_loop()

        child_fds: list[int] = []  # our copies of the child's ends, closed once it runs
        out_fds: dict[int, str] = {}
        stdin: _InputPipe | None = None
        try:
            if pty_size:
                master, slave = os.openpty()
                child_fds.append(slave)
                out_fds[master] = "pty"
                _set_winsize(master, int(pty_size.get("cols") or 80), int(pty_size.get("rows") or 24))
                stdin = _InputPipe(loop, master, owns_fd=False)
                try:  # opening the slave by name after setsid makes it the controlling tty
                    first = (os.POSIX_SPAWN_OPEN, 0, os.ttyname(slave), os.O_RDWR, 0)
                except OSError:
                    first = (os.POSIX_SPAWN_DUP2, slave, 0)
                actions = [first, (os.POSIX_SPAWN_DUP2, 0, 1), (os.POSIX_SPAWN_DUP2, 0, 2)]
            else:
                out_r, out_w = os.pipe()
                err_r, err_w = os.pipe()
                child_fds += [out_w, err_w]
                out_fds[out_r] = "stdout"
                out_fds[err_r] = "stderr"
                if req.get("stdin"):
                    in_r, in_w = os.pipe()
                    child_fds.append(in_r)
                    os.set_blocking(in_w, False)
                    stdin = _InputPipe(loop, in_w, owns_fd=True)
                    first = (os.POSIX_SPAWN_DUP2, in_r, 0)
                else:
                    first = (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0)
                actions = [first, (os.POSIX_SPAWN_DUP2, out_w, 1), (os.POSIX_SPAWN_DUP2, err_w, 2)]
            if as_root:
                pid = spawn_as_root(exe, [cmd, *args], env, cwd, actions, self._oom_score_adj)
            else:
                pid = spawn(exe, [cmd, *args], env, cwd, actions, self._oom_score_adj)
        except BaseException:
            for fd in [*child_fds, *out_fds]:
                with contextlib.suppress(OSError):
                    os.close(fd)
            if stdin is not None:
                stdin.close(force=True)
            raise
        for fd in child_fds:
            os.close(fd)
        proc = Process(pid, req.get("tag"), cmd, args, envs, cwd, bool(pty_size), loop, self, out_fds, stdin)
        self._reaper.watch(pid, proc.on_exit)
        self._procs[pid] = proc
        if as_root:
            set_oom_score_adj(pid, self._oom_score_adj)  # (spawn sets it for the others)
        timeout_ms = int(req.get("timeout_ms") or 0)
        if timeout_ms > 0:
            proc.timeout = loop.call_later(timeout_ms / 1000, proc.kill_on_deadline)
        sub = proc.subscribe()
        proc.watch_output()
        return sub

    def _resolve_cwd(self, cwd: str | None, home: str = "") -> str:
        home = home or self._home
        path = os.path.normpath(os.path.join(home, cwd)) if cwd else home
        if not os.path.isdir(path):
            raise InvalidArgumentError(f"cwd {path!r} is not an existing directory")
        return path

    # -- control --------------------------------------------------------------------------------
    def input(self, pid: int | None, tag: str | None, data: bytes) -> None:
        proc = self.find(pid, tag)
        if proc.stdin is None:
            raise InvalidArgumentError(f"process {proc.pid} has no stdin pipe (start it with stdin=true)")
        proc.stdin.write(data)

    def close_stdin(self, pid: int | None, tag: str | None) -> None:
        proc = self.find(pid, tag)
        if proc.stdin is not None and not proc.pty:
            proc.stdin.close()

    def signal(self, pid: int | None, tag: str | None, sig: int) -> Process:
        proc = self.find(pid, tag)
        if int(sig) not in signal.valid_signals():
            raise InvalidArgumentError(f"invalid signal {sig}")
        proc.kill(int(sig))
        return proc

    def resize(self, pid: int | None, tag: str | None, cols: int, rows: int) -> None:
        proc = self.find(pid, tag)
        if not proc.pty or proc.stdin is None or proc.stdin.closed:
            raise InvalidArgumentError(f"process {proc.pid} has no pty to resize")
        _set_winsize(proc.stdin.fd, int(cols), int(rows))

    def kill_all(self) -> None:
        for proc in list(self._procs.values()):
            proc.kill_group()


def spawn(exe: str, argv: list[str], env: dict[str, str], cwd: str, actions: list[tuple],
          oom_score_adj: int | None = None) -> int:
    """Start `exe` in a new session, every signal at its default, in `cwd`: posix_spawn, or fork + exec
    while the sandbox's policy holds execs (policy.holds_exec(), module doc). `oom_score_adj`: set once
    the exec is done (callers may set it themselves right after, as posix_spawn returns after the exec)."""
    if policy.holds_exec():
        return fork_exec(exe, argv, env, cwd, actions, as_root=False, oom_score_adj=oom_score_adj)
    # posix_spawn has no chdir action in Python 3.11: switch the agent's cwd around the call. The agent
    # is single-threaded and resolves every path itself, so nothing else sees the change. It goes back
    # to "/", never to a path a policy's file rules may have put a mount over (or taken one from) since.
    os.chdir(cwd)
    try:
        pid = os.posix_spawn(exe, argv, env, file_actions=actions, setsid=True,
                             setsigdef=_DEFAULT_SIGNALS, setsigmask=())  # fmt: skip
    except PermissionError as e:
        raise PermissionDeniedError(f"cannot execute {exe!r}: {e.strerror}") from None
    except FileNotFoundError:
        raise NotFoundError(f"command {exe!r} not found") from None
    except OSError as e:
        raise SandboxError(f"cannot start {exe!r}: {e.strerror}", "resource_exhausted"
                           if e.errno in (errno.EAGAIN, errno.ENOMEM) else "internal") from None  # fmt: skip
    finally:
        os.chdir("/")
    if oom_score_adj is not None:
        set_oom_score_adj(pid, oom_score_adj)
    return pid


def spawn_as_root(exe: str, argv: list[str], env: dict[str, str], cwd: str, actions: list[tuple],
                  oom_score_adj: int) -> int:
    """fork + exec as the sandbox's root (posix_spawn cannot change ids). The fork copies the agent's
    page tables (a few ms): only commands run as root pay it."""
    return fork_exec(exe, argv, env, cwd, actions, as_root=True, oom_score_adj=oom_score_adj)


def fork_exec(exe: str, argv: list[str], env: dict[str, str], cwd: str, actions: list[tuple], as_root: bool,
              oom_score_adj: int | None) -> int:
    """fork, then exec in the child (as the sandbox's root if `as_root`, else with no capability).

    Exec errors come back on a close-on-exec pipe (EOF: the exec happened). While the policy holds
    execs (a human may take minutes to answer), the agent does not wait for that: the call returns at
    once, and a failed exec shows as the child's stderr line and exit status 126 / 127, as a shell's.
    Otherwise the agent waits (the exec is a few ms away) and raises the typed error."""
    hold = policy.holds_exec()
    if hold:
        _check_executable(exe, as_root)  # the usual mistakes still get their typed error
    err_r, err_w = os.pipe()  # close-on-exec
    try:
        pid = os.fork()
    except OSError as e:
        os.close(err_r)
        os.close(err_w)
        raise SandboxError(f"cannot start {exe!r}: {e.strerror}", "resource_exhausted"
                           if e.errno in (errno.EAGAIN, errno.ENOMEM) else "internal") from None  # fmt: skip
    if pid == 0:  # pragma: no cover - the child execs or exits
        _exec_child(exe, argv, env, cwd, actions, as_root, oom_score_adj, err_w, tell_stderr=hold)
    os.close(err_w)
    if hold:
        _after_exec(err_r, pid, oom_score_adj)
        return pid
    try:
        with os.fdopen(err_r, "rb") as f:
            failed = f.read(16)
    finally:
        if failed:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
    if failed:
        raise _exec_error(exe, int(failed), as_root)
    if oom_score_adj is not None and not as_root:
        set_oom_score_adj(pid, oom_score_adj)
    return pid


def _exec_child(exe: str, argv: list[str], env: dict[str, str], cwd: str, actions: list[tuple], as_root: bool,
                oom_score_adj: int | None, err_w: int, tell_stderr: bool) -> NoReturn:  # pragma: no cover
    code = errno.EPERM
    try:
        if as_root:
            rootcaps.become_root()
        else:
            rootcaps.drop_in_child()  # what posix_spawn's exec does: nothing of the agent's set survives
        os.setsid()
        for action in actions:
            if action[0] == os.POSIX_SPAWN_OPEN:
                _, fd, path, flags, mode = action
                opened = os.open(path, flags, mode)  # after setsid: a tty opened so is the controlling one
                if opened != fd:
                    os.dup2(opened, fd)
                    os.close(opened)
            else:
                os.dup2(action[1], action[2])
        for sig in _DEFAULT_SIGNALS:
            with contextlib.suppress(OSError, ValueError):
                signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        if as_root and oom_score_adj is not None:
            set_oom_score_adj("self", oom_score_adj)  # the agent's own score is lower: raise it here
        os.chdir(cwd)
        os.execve(exe, argv, env)
    except OSError as e:
        code = e.errno or errno.EPERM
    except BaseException:  # noqa: BLE001
        pass
    with contextlib.suppress(OSError):
        os.write(err_w, str(code).encode())
        if tell_stderr:  # nobody waits for the pipe: the process's own stderr says it
            os.write(2, f"agentcell: cannot execute {exe}: {os.strerror(code)}\n".encode())
    os._exit(127 if code == errno.ENOENT else 126)


def _after_exec(err_r: int, pid: int, oom_score_adj: int | None) -> None:
    """Watch the exec pipe without waiting: at EOF (the exec happened, the child is dumpable again)
    its oom_score_adj is set; an error was told on the child's stderr."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        os.close(err_r)
        return

    def done() -> None:
        loop.remove_reader(err_r)
        try:
            failed = os.read(err_r, 16)
        except OSError:
            failed = b"?"
        os.close(err_r)
        if not failed and oom_score_adj is not None:
            set_oom_score_adj(pid, oom_score_adj)

    loop.add_reader(err_r, done)


def _check_executable(exe: str, as_root: bool) -> None:
    if not os.path.exists(exe):
        raise NotFoundError(f"command {exe!r} not found")
    if os.path.isdir(exe) or not os.access(exe, os.X_OK if not as_root else os.F_OK):
        raise PermissionDeniedError(f"cannot execute {exe!r}: Permission denied")


def _exec_error(exe: str, code: int, as_root: bool) -> SandboxError:
    who = " as root" if as_root else ""
    if code in (errno.EACCES, errno.EPERM):
        return PermissionDeniedError(f"cannot execute {exe!r}{who}: {os.strerror(code)}")
    if code == errno.ENOENT:
        return NotFoundError(f"command {exe!r} not found")
    return SandboxError(f"cannot start {exe!r}{who}: {os.strerror(code)}", "resource_exhausted"
                        if code in (errno.EAGAIN, errno.ENOMEM) else "internal")  # fmt: skip


def set_oom_score_adj(pid: int | str, value: int) -> None:
    """Best effort: raising a score is always allowed; a child that already exited has no file."""
    with contextlib.suppress(OSError):
        fd = os.open(f"/proc/{pid}/oom_score_adj", os.O_WRONLY)
        try:
            os.write(fd, str(value).encode())
        finally:
            os.close(fd)


def _set_winsize(fd: int, cols: int, rows: int) -> None:
    if not (0 < cols < 65536 and 0 < rows < 65536):
        raise InvalidArgumentError(f"pty size must be 1..65535, got {cols}x{rows}")
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
