"""What the server's helper processes (the record's collectors, the egress proxy) have in common: the
socketpair they talk over, dying with the server, finding them in /proc, and how often one that died
is started again."""

from __future__ import annotations

import array
import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any

import orjson

from agentcell import rootless

_PR_SET_PDEATHSIG = 1


def socketpair(buffer: int) -> tuple[socket.socket, socket.socket]:
    """A SOCK_SEQPACKET pair (one message a packet) whose queues hold `buffer` bytes each way."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for s in (ours, theirs):
        for opt, force in ((socket.SO_SNDBUF, 32), (socket.SO_RCVBUF, 33)):  # SO_*BUFFORCE: past wmem_max
            try:
                s.setsockopt(socket.SOL_SOCKET, force, buffer)
            except OSError:  # without CAP_NET_ADMIN: as much as the host's maximum allows
                s.setsockopt(socket.SOL_SOCKET, opt, buffer)
    return ours, theirs


def die_with_parent() -> bool:
    """SIGTERM when the server dies; False if it is already gone (nothing to do then)."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    # a rootless server is pid 1 of its own pid namespace (whose end ends every process in it)
    return os.getppid() != 1 or os.environ.get(rootless.ENV) == "1"


def processes_of(server_pid: int, module: str) -> list[int]:
    """The pids of a server's children started as `python -m module`, from /proc."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if ppid == server_pid and module.encode() in f.read():
                    found.append(int(pid))
        except (OSError, ValueError, IndexError):
            continue
    return found


class RestartBudget:
    """At most `times` restarts in `period_s`: a child that keeps dying is left dead (and said so)."""

    def __init__(self, times: int, period_s: float) -> None:
        self.times, self.period_s = times, period_s
        self._at: list[float] = []

    def take(self) -> bool:
        now = time.monotonic()
        self._at = [t for t in self._at if now - t < self.period_s] + [now]
        return len(self._at) <= self.times


class ChildGone(Exception):
    """The child closed its end (it exited, or was killed); the message says how."""


SKIP = object()  # receive(): nothing waiting, or a packet that is no message (skipped)


def receive(sock: socket.socket, buffer: bytearray, proc: subprocess.Popen[bytes] | None) -> Any:
    """The next packet's message (an orjson array), SKIP when none is waiting or it is not JSON;
    ChildGone when the child's end is closed."""
    try:
        n = sock.recv_into(buffer)
    except BlockingIOError:
        return SKIP
    except OSError as e:
        n, why = 0, str(e)
    else:
        why = "it exited"
    if not n:
        code = proc.poll() if proc is not None else None
        raise ChildGone(f"{why}{'' if code is None else f' with status {code}'}")
    try:
        return orjson.loads(memoryview(buffer)[:n])
    except orjson.JSONDecodeError:
        return SKIP


class ChildProcess:
    """The server's end of a helper process (`python -m MODULE <socket fd> <config JSON>`): starting it
    and waiting for its `["started", ...]`, receiving its packets, closing it, and starting it again
    when it dies (RestartBudget), telling it again what it must know (`_respawned`). A subclass names
    itself (`module`, `what`, `error`), reads what is readable (`_readable`, calling `_receive`) and
    handles each message (`_handle`)."""

    module = ""
    what = "a helper process"  # "the <what> is gone ..." in the log
    error: type[Exception] = OSError  # raised when it does not start
    cut = ""  # what its death costs, said in the log
    without = ""  # what goes on without it, if it cannot be started again
    start_timeout_s = 30.0
    close_timeout_s = 10.0
    restart_delay_s = 0.5

    def __init__(self, config: dict[str, Any], *, buffer: int, max_packet: int, restarts: int,
                 period_s: float) -> None:
        self.config = config
        self.gone: str | None = None  # why the child is gone (None while it runs)
        self._buffer_size = buffer
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._started: asyncio.Future[Any] | None = None  # the child's word, while it starts
        self._buffer = bytearray(max_packet)
        self._restarts = RestartBudget(restarts, period_s)
        self._restarting: asyncio.Task[None] | None = None  # while it is started again
        self._closing = False

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self.gone is None else None

    async def start(self) -> Any:
        """What the child said it started with (`["started", what]`); `error` if it did not start."""
        self._loop = asyncio.get_running_loop()
        return await self._spawn()

    async def _spawn(self) -> Any:
        assert self._loop is not None
        ours, theirs = socketpair(self._buffer_size)
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", self.module, str(theirs.fileno()), orjson.dumps(self.config).decode()],
                pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL,
                start_new_session=True)  # a terminal's ^C is the server's to handle: it closes the child
        finally:
            theirs.close()
        ours.setblocking(False)
        self._sock, self.gone = ours, None
        self._started = self._loop.create_future()
        self._loop.add_reader(ours.fileno(), self._readable)
        try:
            return await asyncio.wait_for(asyncio.shield(self._started), self.start_timeout_s)
        except (TimeoutError, self.error) as e:
            if self._proc.poll() is None:
                self._proc.kill()
            self._shut(f"did not start: {e or 'timed out'}")
            raise self.error(f"the {self.what} did not start: {e or 'timed out'}") from None

    def _send_packet(self, data: bytes, fds: tuple[int, ...] = ()) -> None:
        """One message to the child; OSError if it is gone, or stuck (its queue is full)."""
        if self.gone is not None or self._sock is None:
            raise OSError(f"the {self.what} is gone ({self.gone})")
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        try:
            self._sock.sendmsg([data], ancillary)
        except BlockingIOError:
            raise OSError(f"the {self.what} does not keep up") from None

    async def close(self) -> None:
        self._closing = True
        if self._restarting is not None:
            self._restarting.cancel()
        if self._sock is not None and self.gone is None:
            with contextlib.suppress(OSError):
                self._send_packet(orjson.dumps(["close"]))
        if self._proc is not None:
            try:
                await asyncio.to_thread(self._proc.wait, self.close_timeout_s)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                await asyncio.to_thread(self._proc.wait)
        self._shut("closed")

    def _readable(self) -> None:
        raise NotImplementedError

    def _handle(self, message: list[Any]) -> None:
        raise NotImplementedError

    def _receive(self) -> bool:
        """One packet from the child, handled; False if none is waiting (or the child is gone)."""
        if self._sock is None:
            return False
        try:
            message = receive(self._sock, self._buffer, self._proc)
        except ChildGone as e:
            self._shut(str(e))
            return False
        if message is SKIP:
            return False
        if message[0] == "started":
            if self._started is not None and not self._started.done():
                self._started.set_result(message[1] if len(message) > 1 else None)
        else:
            self._handle(message)
        return True

    def _gone(self) -> None:
        """The child is gone: whatever waits on it stops waiting."""

    async def _respawned(self, why: str) -> None:
        """Started again after it died of `why`: tell it again what it must know."""

    def _shut(self, why: str) -> None:
        if self._sock is not None:
            if self._loop is not None:
                self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        if self.gone is not None:
            return
        self.gone = why
        self._gone()
        if self._started is not None and not self._started.done():
            self._started.set_exception(self.error(why))
            return
        if self._closing or self._loop is None:
            return
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()  # (a child that closed its socket but lives on is no use)
        again = self._restarts.take()
        print(f"agentcell: the {self.what} is gone ({why}){self.cut}; "
              f"{'starting it again' if again else 'not started again: it died too often'}", file=sys.stderr, flush=True)
        if again:
            self._restarting = self._loop.create_task(self._restart(why))

    async def _restart(self, why: str) -> None:
        await asyncio.sleep(self.restart_delay_s)
        if self._closing:
            return
        try:
            await self._spawn()
        except self.error as e:
            print(f"agentcell: {e}; {self.without}", file=sys.stderr, flush=True)
            return
        await self._respawned(why)
