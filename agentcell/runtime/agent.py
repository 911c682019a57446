"""The in-sandbox agent: pid 1 of every sandbox, speaking docs/internal-protocol.md over one socket.

``preload()`` runs once in the template's zygote (imports, the shared IPython shell, warmed fonts);
the isolation backend then forks, fences the child and calls ``serve(sock, config)`` in it. serve()
never returns: it exits the process when the server closes the socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import io
import os
import signal
import socket
import sys
import traceback
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from agentcell.errors import InvalidArgumentError, SandboxError
from agentcell.runtime import display, filesystem, kernel, processes, protocol, reaper, statedir
from agentcell.runtime.filesystem import FileSystem, os_error
from agentcell.runtime.kernel import ContextManager
from agentcell.runtime.processes import ProcessTable, Subscriber
from agentcell.runtime.protocol import CHUNK, Frame, encode_frame, read_frame
from agentcell.runtime.reaper import Reaper

__all__ = ["preload", "serve"]

_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_CONGESTED = 16 << 20  # bytes queued for the server beyond which code output is read no further
_AGENT_MODULES = (display, filesystem, kernel, processes, protocol, reaper)  # imported now, never lazily


def preload() -> None:
    """Import and build everything sandboxes share, so a sandbox start is a cheap fork."""
    for var, sub in (("IPYTHONDIR", "ipython"), ("MPLCONFIGDIR", "matplotlib")):
        if var not in os.environ:  # matplotlib's font cache survives zygote restarts here
            # not /tmp: any local user could pre-create it there (a symlink, a poisoned font cache)
            os.environ[var] = os.path.join(statedir.private_dir(statedir.default_state_dir("agent")), sub)
        os.makedirs(os.environ[var], exist_ok=True)
    import matplotlib

    matplotlib.use(display.INLINE_BACKEND)
    import matplotlib.pyplot as plt
    import numpy  # noqa: F401
    import pandas as pd

    kernel.preload()
    shell = kernel._shell
    assert shell is not None
    # Warm fonts, the PNG and HTML formatters and the traceback formatter without touching user state.
    fig, ax = plt.subplots(figsize=(1, 1))
    ax.plot([0, 1], [0, 1])
    ax.set_title("warm")
    shell.display_formatter.format(fig)
    fig.savefig(io.BytesIO(), format="png")
    plt.close(fig)
    shell.display_formatter.format(pd.DataFrame({"a": [1, 2]}))
    try:
        exec(compile("def _f():\n    1 / 0\n_f()", "<warmup>", "exec"), {})
    except ZeroDivisionError:
        shell.InteractiveTB.structured_traceback(*sys.exc_info())
    shell.transform_cell("1 + 1\n")
    # One silent cell runs IPython's lazy first-run setup here, once, instead of in every sandbox's
    # first run_code (measured: ~8 ms). Silent cells touch no history, count or output.
    shell.run_cell("_agentcell_warm = [i * 2 for i in range(3)]", silent=True)
    shell.user_ns.pop("_agentcell_warm", None)
    gc.collect()


def serve(sock: socket.socket, config: dict[str, Any]) -> NoReturn:
    """Serve the agent protocol on `sock` until it closes, then exit the process."""
    code = 0
    try:
        _harden()
        sock.set_inheritable(False)
        asyncio.run(_serve(sock, config))
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os._exit(code)


def _harden() -> None:
    # As pid 1 the kernel drops default-action signals sent from inside the sandbox.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0)  # same-uid user code cannot open /proc/1/mem
    libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans come to us even when not pid 1 (tests)
    # Children inherit nothing but their stdio: every other fd of ours is close-on-exec.
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.dup2(os.open(os.devnull, os.O_RDWR), fd)
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc/self/fd"):
            if int(name) > 2:
                with contextlib.suppress(OSError):
                    os.set_inheritable(int(name), False)


async def _serve(sock: socket.socket, config: dict[str, Any]) -> None:
    home = os.path.abspath(config.get("home") or "/home/user")
    envs = {str(k): str(v) for k, v in (config.get("envs") or {}).items()}
    envs.setdefault("HOME", home)
    with contextlib.suppress(OSError):
        os.chdir(home)
    loop = asyncio.get_running_loop()
    server_pidfd = config.get("server_pidfd")
    if isinstance(server_pidfd, int):
        # The sandbox dies with its server even if its socket were somehow kept open: pid 1 exits,
        # and the kernel kills the whole pid namespace.
        loop.add_reader(server_pidfd, os._exit, 1)
    the_reaper = Reaper()
    the_reaper.install(loop)
    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=protocol.MAX_HEADER)
    # The backend knows whether the agent got its low OOM score; children take what it says.
    oom = int(config.get("child_oom_score_adj", processes.CHILD_OOM_SCORE_ADJ))
    agent = Agent(writer, ProcessTable(the_reaper, envs, home, oom), FileSystem(home),
                  ContextManager(the_reaper, envs, home, oom))  # fmt: skip
    try:
        with contextlib.suppress(SandboxError):
            agent.contexts.default()  # forked now so the first run_code is fast
        writer.write(encode_frame({"id": 0, "event": "ready"}))
        await writer.drain()
        await agent.run(reader)
    finally:
        agent.processes.kill_all()
        agent.contexts.close()


class Call:
    """One request being answered: streams frames for its id, and knows how to stop."""

    def __init__(self, agent: Agent, call_id: int) -> None:
        self.agent = agent
        self.id = call_id
        self.cancelled = False
        self.task: asyncio.Task[None] | None = None
        self.on_cancel: Callable[[], None] | None = None  # default: cancel the task

    def emit(self, header: dict[str, Any], payload: bytes = b"") -> None:
        if not self.cancelled:
            self.agent.write({"id": self.id, **header}, payload)

    async def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        self.emit(header, payload)
        await self.agent.drain()

    def cancel(self) -> None:
        if self.cancelled:
            return
        self.cancelled = True
        if self.on_cancel is not None:
            self.on_cancel()
        elif self.task is not None:
            self.task.cancel()


Handler = Callable[["Agent", Call, Frame], Awaitable[dict[str, Any] | None]]
_HANDLERS: dict[str, Handler] = {}


def op(name: str) -> Callable[[Handler], Handler]:
    def register(fn: Handler) -> Handler:
        _HANDLERS[name] = fn
        return fn

    return register


class Agent:
    def __init__(self, writer: asyncio.StreamWriter, procs: ProcessTable, fs: FileSystem,
                 contexts: ContextManager) -> None:  # fmt: skip
        self._writer = writer
        self.processes = procs
        self.fs = fs
        self.contexts = contexts
        self._calls: dict[int, Call] = {}

    def write(self, header: dict[str, Any], payload: bytes = b"") -> None:
        if not self._writer.is_closing():
            self._writer.write(encode_frame(header, payload))

    def congested(self) -> bool:
        transport = self._writer.transport
        return transport.get_write_buffer_size() > _CONGESTED

    async def drain(self) -> None:
        with contextlib.suppress(ConnectionError):
            await self._writer.drain()

    async def run(self, reader: asyncio.StreamReader) -> None:
        while True:
            try:
                frame = await read_frame(reader)
            except (protocol.ProtocolError, OSError):
                return
            if frame is None:
                return
            call_id = frame.header.get("id")
            name = frame.header.get("op")
            if not isinstance(call_id, int):
                continue
            if name == "cancel":
                target = self._calls.get(frame.header.get("target"))  # type: ignore[arg-type]
                if target is not None:
                    target.cancel()
                continue
            call = Call(self, call_id)
            self._calls[call_id] = call
            call.task = asyncio.get_running_loop().create_task(self._handle(call, str(name), frame))

    async def _handle(self, call: Call, name: str, frame: Frame) -> None:
        try:
            handler = _HANDLERS.get(name)
            if handler is None:
                raise SandboxError(f"unknown op {name!r}", "unimplemented")
            result = await handler(self, call, frame)
            call.emit({**(result or {}), "done": True})
        except asyncio.CancelledError:
            pass  # the server lost interest; it expects no answer
        except SandboxError as e:
            call.emit({"done": True, "error": {"code": e.code, "message": e.message}})
        except OSError as e:
            err = os_error(e)
            call.emit({"done": True, "error": {"code": err.code, "message": err.message}})
        except Exception as e:  # a bug here must not take the agent down
            call.emit({"done": True, "error": {"code": "internal", "message": f"{type(e).__name__}: {e}"}})
        finally:
            self._calls.pop(call.id, None)
        await self.drain()


def _field(frame: Frame, name: str, kind: type | tuple[type, ...], default: Any = None) -> Any:
    value = frame.header.get(name, default)
    if value is None:
        return default
    if not isinstance(value, kind):
        raise InvalidArgumentError(f"field {name!r} has the wrong type")
    return value


# -- misc -------------------------------------------------------------------------------------------
@op("ping")
async def _ping(agent: Agent, call: Call, frame: Frame) -> None:
    return None


# -- processes --------------------------------------------------------------------------------------
async def _stream(call: Call, sub: Subscriber) -> None:
    try:
        while True:
            item = await sub.get()
            if item is None:
                return
            await call.send(*item)
    finally:
        sub.close()


@op("proc.start")
async def _proc_start(agent: Agent, call: Call, frame: Frame) -> None:
    await _stream(call, agent.processes.start(frame.header))


@op("proc.connect")
async def _proc_connect(agent: Agent, call: Call, frame: Frame) -> None:
    proc = agent.processes.find(frame.header.get("pid"), frame.header.get("tag"))
    await _stream(call, proc.subscribe())


@op("proc.list")
async def _proc_list(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    return {"processes": agent.processes.list()}


@op("proc.input")
async def _proc_input(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    agent.processes.input(frame.header.get("pid"), frame.header.get("tag"), frame.payload)
    return {}


@op("proc.signal")
async def _proc_signal(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    agent.processes.signal(frame.header.get("pid"), frame.header.get("tag"), _field(frame, "signal", int, 15))
    return {}


@op("proc.close_stdin")
async def _proc_close_stdin(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    agent.processes.close_stdin(frame.header.get("pid"), frame.header.get("tag"))
    return {}


@op("proc.resize")
async def _proc_resize(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    agent.processes.resize(frame.header.get("pid"), frame.header.get("tag"),
                           _field(frame, "cols", int, 80), _field(frame, "rows", int, 24))  # fmt: skip
    return {}


# -- filesystem -------------------------------------------------------------------------------------
@op("fs.stat")
async def _fs_stat(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    return {"entry": agent.fs.stat(frame.header.get("path"))}


@op("fs.list")
async def _fs_list(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    return {"entries": agent.fs.list(frame.header.get("path"), _field(frame, "depth", int, 1))}


@op("fs.mkdir")
async def _fs_mkdir(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    return {"entry": agent.fs.mkdir(frame.header.get("path"))}


@op("fs.move")
async def _fs_move(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    return {"entry": agent.fs.move(frame.header.get("source"), frame.header.get("destination"))}


@op("fs.remove")
async def _fs_remove(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    agent.fs.remove(frame.header.get("path"))
    return {}


@op("fs.read")
async def _fs_read(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    path, fd = agent.fs.open_for_read(frame.header.get("path"))
    size = 0
    try:
        while True:
            try:
                chunk = os.read(fd, CHUNK)
            except OSError as e:
                raise os_error(e, path) from None
            if not chunk:
                return {"size": size}
            size += len(chunk)
            await call.send({"event": "data"}, chunk)
    finally:
        os.close(fd)


@op("fs.write")
async def _fs_write(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    metadata = _field(frame, "metadata", dict)
    return {"entry": agent.fs.write(frame.header.get("path"), frame.payload, metadata)}


# -- code contexts ----------------------------------------------------------------------------------
@op("code.run")
async def _code_run(agent: Agent, call: Call, frame: Frame) -> None:
    code = _field(frame, "code", str, "")
    env_vars = _field(frame, "env_vars", dict)
    ctx = agent.contexts.get(_field(frame, "context_id", str), _field(frame, "language", str))

    def set_interrupt(interrupt: Callable[[], None]) -> None:
        call.on_cancel = interrupt  # a cancelled run is interrupted, and finishes quietly

    await ctx.run(code, env_vars, _field(frame, "timeout_ms", int, 0),
                  lambda line: call.emit({"line": line}), agent.drain, agent.congested, set_interrupt)  # fmt: skip


@op("code.context_create")
async def _context_create(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    ctx = agent.contexts.create(_field(frame, "language", str), _field(frame, "cwd", str))
    return {"context": ctx.info()}


@op("code.context_list")
async def _context_list(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    return {"contexts": agent.contexts.list()}


@op("code.context_delete")
async def _context_delete(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    agent.contexts.delete(_field(frame, "context_id", str, ""))
    return {}


@op("code.context_restart")
async def _context_restart(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    agent.contexts.restart(_field(frame, "context_id", str, ""))
    return {}
