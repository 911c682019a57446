"""`sudo` inside a sandbox: the agent runs a command as the sandbox's root for any process that asks.

E2B's sandboxes give their user passwordless sudo, and agents type `sudo apt-get install ...`. A
setuid `sudo` cannot work here: every process has `no_new_privs` (nothing gains privilege on exec),
and that stays. Instead `/usr/bin/sudo` is a small client (`sudo_shim.py`) that connects to this
service on an abstract unix socket (private to the sandbox's network namespace: no other sandbox,
nor the host, can reach it), hands over its stdin/stdout/stderr (SCM_RIGHTS) with the command, and
exits with the command's status. The agent starts the command exactly as `commands.run(user="root")`
does (uid 0 of the sandbox's own user namespace, Docker's capabilities less a few, the same seccomp
filter), so sudo grants nothing a tenant could not get through the API. A signal the client gets
(Ctrl-C) is passed to the command's process group; a client that goes away kills it.

Bounds: a request is at most MAX_REQUEST bytes, at most MAX_AT_ONCE sudo commands run at once.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import json
import os
import signal
import socket
from typing import Any

from agentcell.errors import SandboxError
from agentcell.runtime import rootcaps
from agentcell.runtime.processes import spawn_as_root
from agentcell.runtime.reaper import Reaper

SOCKET_NAME = "\0agentcell-sudo"
MAX_REQUEST = 256 * 1024
MAX_AT_ONCE = 64
_SIGNALS = {int(signal.SIGINT), int(signal.SIGTERM), int(signal.SIGHUP), int(signal.SIGQUIT)}


def _spawn(exe: str, argv: list[str], env: dict[str, str], cwd: str, fds: list[int], oom_score_adj: int) -> int:
    actions = [(os.POSIX_SPAWN_DUP2, fd, target) for target, fd in enumerate(fds)]
    return spawn_as_root(exe, argv, env, cwd, actions, oom_score_adj)


class SudoService:
    def __init__(self, reaper: Reaper, oom_score_adj: int) -> None:
        self._reaper = reaper
        self._oom = oom_score_adj
        self._sock: socket.socket | None = None
        self._running = 0
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Listen, unless root is not to be had here (an agent outside a sandbox)."""
        if not rootcaps.available():
            return
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK)
        try:
            sock.bind(SOCKET_NAME)
            sock.listen(16)
        except OSError:
            sock.close()
            return
        self._sock = sock
        loop.add_reader(sock.fileno(), self._accept)

    def close(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(Exception):
                asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None
        for t in self._tasks:
            t.cancel()

    def _accept(self) -> None:
        assert self._sock is not None
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError, ConnectionAbortedError):
            return
        conn.setblocking(False)
        if self._running >= MAX_AT_ONCE:
            with contextlib.suppress(OSError):
                conn.send(b'{"error": "too many sudo commands at once"}\n')
            conn.close()
            return
        task = asyncio.get_running_loop().create_task(self._serve(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        self._running += 1
        fds: list[int] = []
        try:
            request, fds = await _receive(conn)
            pid = self._start(request, fds)
        except Exception as e:  # noqa: BLE001 - a bad request or a failed start: told to the client
            message = e.message if isinstance(e, SandboxError) else str(e)
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"error": message[:500]}).encode() + b"\n")
            conn.close()
            self._running -= 1
            return
        finally:
            for fd in fds:
                os.close(fd)
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[int] = loop.create_future()
        self._reaper.watch(pid, lambda status: ended.done() or ended.set_result(status))
        try:
            while not ended.done():
                readable = asyncio.ensure_future(_readable(conn.fileno()))
                await asyncio.wait([ended, readable], return_when=asyncio.FIRST_COMPLETED)
                readable.cancel()
                if readable.done() and not readable.cancelled() and not ended.done():
                    data = conn.recv(64)
                    if not data:  # the client went away: so does its command
                        _signal_group(pid, signal.SIGKILL)
                        await ended
                        break
                    for line in data.split(b"\n"):
                        with contextlib.suppress(ValueError):
                            sig = int(line)
                            if sig in _SIGNALS:
                                _signal_group(pid, sig)
            status = ended.result()
            code = os.waitstatus_to_exitcode(status)
            with contextlib.suppress(OSError):
                conn.send(json.dumps({"exit": code if code >= 0 else 128 - code}).encode() + b"\n")
        finally:
            conn.close()
            self._running -= 1

    def _start(self, request: dict[str, Any], fds: list[int]) -> int:
        exe = request["exe"]
        argv = request["argv"]
        env = request["env"]
        cwd = request["cwd"]
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise ValueError("argv must be a non-empty list of strings")
        if not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())):
            raise ValueError("env must map strings to strings")
        if not isinstance(exe, str) or not isinstance(cwd, str) or len(fds) != 3:
            raise ValueError("cwd and three file descriptors are needed")
        if not os.path.isdir(cwd):
            cwd = rootcaps.ROOT_HOME
        return _spawn(exe, argv, env, cwd, fds, self._oom)


async def _readable(fd: int) -> None:
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        loop.remove_reader(fd)


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(OSError), rootcaps.kill_capability():
        os.killpg(pid, sig)


async def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    """The request (one JSON line) and the three descriptors that came with its first bytes."""
    buf = bytearray()
    fds: list[int] = []
    try:
        while b"\n" not in buf:
            async with asyncio.timeout(10):
                await _readable(conn.fileno())
            data, ancdata, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(3 * array.array("i").itemsize))
            for level, kind, cdata in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(cdata[: len(cdata) - len(cdata) % got.itemsize])
                    fds.extend(got)
            if not data:
                break
            buf += data
            if len(buf) > MAX_REQUEST:
                raise ValueError(f"the request is over {MAX_REQUEST} bytes")
        return json.loads(buf.split(b"\n", 1)[0]), fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
