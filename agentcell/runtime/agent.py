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
import json
import linecache
import os
import signal
import socket
import sys
import traceback
import types
from collections.abc import Awaitable, Callable
from typing import Any, NoReturn

from agentcell.errors import InvalidArgumentError, ResourceExhaustedError, SandboxError
from agentcell.runtime import (
    display,
    filesystem,
    kernel,
    policy,
    processes,
    protocol,
    reaper,
    start_command,
    statedir,
    tunnel,
    watcher,
)
from agentcell.runtime.filesystem import FileSystem, os_error
from agentcell.runtime.kernel import ContextManager
from agentcell.runtime.processes import ProcessTable, Subscriber
from agentcell.runtime.protocol import CHUNK, Frame, ProtocolError, encode_frame, read_frame
from agentcell.runtime.reaper import Reaper
from agentcell.runtime.self_report import SelfReports
from agentcell.runtime.sudo import SudoService

__all__ = ["preload", "serve"]

_PR_SET_DUMPABLE = 4
_PR_SET_CHILD_SUBREAPER = 36
_AGENT_MODULES = (display, filesystem, kernel, policy, processes, protocol, reaper, tunnel, watcher)  # imported now, never lazily
_WARM_TIMEOUT = 10.0  # seconds the default context gets to start before the sandbox says ready anyway


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
    shell.display_formatter.format([1, {"a": 2.5}])  # E2B's JSON formatter (orjson)
    try:
        exec(compile("def _f():\n    1 / 0\n_f()", "<warmup>", "exec"), {})
    except ZeroDivisionError:
        shell.InteractiveTB.structured_traceback(*sys.exc_info())
    shell.transform_cell("1 + 1\n")
    # One silent cell runs IPython's lazy first-run setup here, once, instead of in every sandbox's
    # first run_code (measured: ~8 ms). Silent cells touch no history, count or output.
    shell.run_cell("_agentcell_warm = [i * 2 for i in range(3)]", silent=True)
    shell.user_ns.pop("_agentcell_warm", None)
    _warm_for_forks(shell)
    gc.collect()


# CPython 3.11 specializes a function's bytecode in place after 8 calls. Run here, that rewrite (and
# any lazy setup) happens once in the zygote instead of on copied pages in every sandbox.
_WARM_RUNS = 10


def _warm_for_forks(shell: display.ContextShell) -> None:
    """Run the paths every sandbox runs (a context's first cell, the agent's frame loop) in the zygote.

    A sandbox copies every shared page it writes, and running a function writes its code object (a
    reference count, specialization counters): the functions of these paths get fresh copies of their
    code objects, side by side on few pages instead of scattered over the whole preloaded heap.
    Measured: about 2 MiB less memory per idle sandbox (agent + context, after one run_code)."""
    cached, numbered = set(linecache.cache), dict(shell.compile._filename_map)
    shell.logger  # noqa: B018 - built (an import) on the first non-silent cell otherwise
    hot: set[types.CodeType] = set()

    def called(frame: types.FrameType, event: str, _arg: Any) -> None:
        if event == "call":
            hot.add(frame.f_code)

    sys.setprofile(called)
    try:
        shell.run_cell("1", store_history=True)
        asyncio.run(_warm_agent())
    finally:
        sys.setprofile(None)
    _pack_code(hot)
    for _ in range(_WARM_RUNS):
        shell.run_cell("1", store_history=True)
        asyncio.run(_warm_agent())
    shell.reset(new_session=True)  # count 1, empty In/Out, a fresh user namespace: as if never run
    for name in set(linecache.cache) - cached:
        del linecache.cache[name]
    shell.compile._filename_map = numbered


def _pack_code(hot: set[types.CodeType]) -> None:
    """Give every function whose code is in `hot` an identical copy of it, allocated now, together
    (nested code it creates functions from, such as comprehensions, too)."""
    copies: dict[types.CodeType, types.CodeType] = {}

    def copy(code: types.CodeType) -> types.CodeType:
        if code not in copies:
            consts = tuple(copy(c) if isinstance(c, types.CodeType) and c in hot else c for c in code.co_consts)
            copies[code] = code.replace(co_consts=consts)
        return copies[code]

    for obj in gc.get_objects():
        if isinstance(obj, types.FunctionType) and obj.__code__ in hot:
            obj.__code__ = copy(obj.__code__)


async def _warm_agent() -> None:
    """A few requests through the agent's frame loop over a socketpair, on a loop of its own."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        reader, writer = await asyncio.open_unix_connection(sock=ours, limit=protocol.MAX_HEADER)
        peer_reader, peer_writer = await asyncio.open_unix_connection(sock=theirs)
        no_reaper = Reaper()  # never installed: the zygote's SIGCHLD handler stays
        agent = Agent(writer, ProcessTable(no_reaper, {}, "/", 0), FileSystem("/"),
                      ContextManager(no_reaper, {}, "/", 0))  # fmt: skip
        for call_id, name in enumerate(("ping", "proc.list", "code.context_list"), 1):
            peer_writer.write(encode_frame({"id": call_id, "op": name}))
        peer_writer.write(encode_frame({"id": 0, "op": "credit", "target": 1, "bytes": 1}))
        run = asyncio.create_task(agent.run(reader))
        for _ in range(3):
            await read_frame(peer_reader)
        peer_writer.close()
        await run
        writer.close()


def serve(sock: socket.socket | None, config: dict[str, Any]) -> NoReturn:
    """Serve the agent protocol on `sock` until it closes, then exit the process. `sock` None: on the
    character device whose fd is config["channel_fd"] (a microVM's virtio-serial port)."""
    code = 0
    try:
        _harden()
        if sock is not None:
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


async def _open_channel(sock: socket.socket | None, config: dict[str, Any]) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """The server's channel: a socket, or a character device (asyncio's pipe transports take those)."""
    if sock is not None:
        return await asyncio.open_unix_connection(sock=sock, limit=protocol.MAX_HEADER)
    loop = asyncio.get_running_loop()
    fd = int(config["channel_fd"])
    reader = asyncio.StreamReader(limit=protocol.MAX_HEADER)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", buffering=0))
    transport, proto = await loop.connect_write_pipe(
        lambda: asyncio.StreamReaderProtocol(asyncio.StreamReader()), os.fdopen(os.dup(fd), "wb", buffering=0))
    return reader, asyncio.StreamWriter(transport, proto, None, loop)


async def _serve(sock: socket.socket | None, config: dict[str, Any]) -> None:
    policy.configure(config.get("strict_seccomp"))  # before any fork: contexts inherit it (kernel.py)
    home = os.path.abspath(config.get("home") or "/home/user")
    envs = {str(k): str(v) for k, v in (config.get("envs") or {}).items()}
    envs.setdefault("HOME", home)
    # "/": the agent resolves every path itself; a working directory under /home/user would be taken
    # from under it by a policy's file rules there (policy/linux/file_rules.py)
    os.chdir("/")
    loop = asyncio.get_running_loop()
    server_pidfd = config.get("server_pidfd")
    if isinstance(server_pidfd, int):
        # The sandbox dies with its server even if its socket were somehow kept open: pid 1 exits,
        # and the kernel kills the whole pid namespace.
        loop.add_reader(server_pidfd, os._exit, 1)
    the_reaper = Reaper()
    the_reaper.install(loop)
    reader, writer = await _open_channel(sock, config)
    # The backend knows whether the agent got its low OOM score; children take what it says.
    oom = int(config.get("child_oom_score_adj", processes.CHILD_OOM_SCORE_ADJ))
    # an image template's WorkingDir is where commands and code start (E2B's template workdir)
    workdir = str(config.get("workdir") or "") if os.path.isdir(str(config.get("workdir") or "")) else home
    agent = Agent(writer, ProcessTable(the_reaper, envs, workdir, oom), FileSystem(home),
                  ContextManager(the_reaper, envs, workdir, oom, python=config.get("python")))  # fmt: skip
    sudo_service = SudoService(the_reaper, oom)
    self_reports: SelfReports | None = None
    sudo_service.start(loop)  # /usr/bin/sudo's way to root (runtime/sudo.py); nothing of a tenant's in it
    try:
        with contextlib.suppress(SandboxError, OSError, ProtocolError, TimeoutError):
            # Forked and warmed now, while the sandbox is a standby, so the first run_code is fast.
            async with asyncio.timeout(_WARM_TIMEOUT):
                await agent.contexts.default().warm()
        if config.get("start_cmd"):  # a template's service: up before the sandbox is (start_command.py)
            await start_command.start(agent.processes, str(config["start_cmd"]), str(config.get("ready_cmd") or ""))
        writer.write(encode_frame({"id": 0, "event": "ready"}))
        await writer.drain()
        # A standby until the server claims it for a tenant: the claim brings the tenant's env vars.
        claim = await read_frame(reader)
        if claim is None or claim.header.get("op") != "claim":
            return
        on_claim = config.get("on_claim")  # the backend's own step at the claim (gvisor: the host name)
        extra = on_claim(claim.header) if callable(on_claim) else {}
        agent.claim({**extra, **{str(k): str(v) for k, v in (claim.header.get("envs") or {}).items()}})
        self_reports = SelfReports(lambda report: writer.write(encode_frame({"id": 0, "event": "report", **report})))
        self_reports.start(loop)
        await agent.run(reader)
    finally:
        if self_reports is not None:
            self_reports.close()
        sudo_service.close()
        agent.watchers.close()
        agent.processes.kill_all()
        agent.contexts.close()


class Call:
    """One request being answered: streams frames for its id within its flow-control window."""

    def __init__(self, agent: Agent, call_id: int) -> None:
        self.agent = agent
        self.id = call_id
        self.credit = protocol.CALL_WINDOW  # bytes of stream frames the server will still take
        self.cancelled = False
        self.task: asyncio.Task[None] | None = None
        self.on_cancel: Callable[[], None] | None = None  # default: cancel the task
        self._on_data: Callable[[Frame], None] | None = None  # takes the request's ``data`` frames
        self._early_data: list[Frame] = []  # data frames that came before the handler took them
        self._line_open = False
        self._held: bytes | None = None  # a small line that goes out with whatever comes next

    def take_data(self, on_data: Callable[[Frame], None] | None) -> None:
        """Hand the request's ``data`` frames (an upload's content) to `on_data`, those that already
        arrived first. They can arrive before the handler task runs, so none may be lost."""
        self._on_data = on_data
        early, self._early_data = self._early_data, []
        for frame in early:
            if on_data is not None:
                on_data(frame)

    def data(self, frame: Frame) -> None:
        if self._on_data is not None:
            self._on_data(frame)
        else:
            self._early_data.append(frame)

    def has_credit(self) -> bool:
        return self.credit > 0 and self.agent.conn_credit > 0

    async def wait_credit(self) -> None:
        """Until the server takes more of this call's frames (or lost interest in it)."""
        while not self.cancelled and not self.has_credit():
            await self.agent.credit_changed()

    def emit(self, header: dict[str, Any], payload: bytes = b"") -> None:
        """Write a frame now. A stream frame spends credit; callers wait for credit before emitting
        (sync emitters such as output readers pause while has_credit() is false)."""
        if self.cancelled:
            return
        if self._held is not None:
            self._emit_held()
        size = self.agent.write({"id": self.id, **header}, payload)
        if not header.get("done"):
            self.credit -= size
            self.agent.conn_credit -= size

    async def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        """A stream frame, once the server has room for it."""
        await self.wait_credit()
        self.emit(header, payload)
        await self.agent.drain()

    # Lines of a code run: one line's frames must never interleave with another's, so a line sent in
    # several frames holds the "line slot" while it waits for credit between them.
    def can_emit_line(self) -> bool:
        return self.has_credit() and not self._line_open

    async def wait_line_slot(self) -> None:
        while not self.cancelled and not self.can_emit_line():
            await self.agent.credit_changed()

    def hold_line(self, line: bytes) -> bool:
        """Keep back a small line that may wait (False if it is too big: send it with send_line). It
        goes out just before the next frame of this call, whatever that is (output, another line, the
        end), so the client gets it with that instead of on its own. Call it when a line may start."""
        if len(line) > HELD_LINE:
            return False
        if self._held is not None:
            self._emit_held()
        self._held = line
        return True

    def _emit_held(self) -> None:
        line, self._held = self._held, None
        assert line is not None
        self.emit({"event": "line", "more": False}, line)

    def emit_line(self, line: bytes) -> None:
        """One E2B NDJSON line (JSON bytes) now, in ``line`` frames of at most CHUNK bytes each."""
        parts = protocol.pieces(line)
        for i, part in enumerate(parts):
            self.emit({"event": "line", "more": i < len(parts) - 1}, part)

    async def send_line(self, line: bytes) -> None:
        """The same, each frame once the server has room for it."""
        await self.wait_line_slot()
        parts = protocol.pieces(line)
        self._line_open = len(parts) > 1
        try:
            for i, part in enumerate(parts):
                await self.send({"event": "line", "more": i < len(parts) - 1}, part)
        finally:
            self._line_open = False
            self.agent.wake_credit_waiters()

    def cancel(self) -> None:
        if self.cancelled:
            return
        self.cancelled = True
        self.agent.wake_credit_waiters()
        if self.on_cancel is not None:
            self.on_cancel()
        elif self.task is not None:
            self.task.cancel()


Handler = Callable[["Agent", Call, Frame], Awaitable[dict[str, Any] | None]]
_HANDLERS: dict[str, Handler] = {}
_INLINE_ANSWER = 64 << 10  # answers bigger than this go in ``part`` frames (flow-controlled)
_FLUSH_AT = 64 << 10  # frames written but not yet sent that drain() sends at once
HELD_LINE = 16 << 10  # the largest line Call.hold_line() keeps back


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
        self.watchers = watcher.Watchers(fs)
        self.contexts = contexts
        self._calls: dict[int, Call] = {}
        self.conn_credit = protocol.CONN_WINDOW  # of all calls together
        self._credit_waiters: list[asyncio.Future[None]] = []
        self._out: list[bytes] = []  # frames written in this turn of the event loop, sent at its end
        self._out_size = 0

    def claim(self, envs: dict[str, str]) -> None:
        """The sandbox now serves one tenant: its env vars join every process's and context's."""
        os.environ.update(envs)
        self.processes.update_envs(envs)
        self.contexts.update_envs(envs)

    def write(self, header: dict[str, Any], payload: bytes = b"") -> int:
        """Write one frame; returns its size (header + payload). Frames written in one turn of the
        event loop (a run's last line and its end, say) reach the server in one piece: one wakeup of
        the server, not one per frame."""
        data = encode_frame(header, payload)
        if not self._writer.is_closing():
            if not self._out:
                asyncio.get_running_loop().call_soon(self._flush)
            self._out.append(data)
            self._out_size += len(data)
        return len(data) - protocol.PREFIX.size

    def _flush(self) -> None:
        out, self._out, self._out_size = self._out, [], 0
        if out and not self._writer.is_closing():
            self._writer.write(b"".join(out))

    async def credit_changed(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self._credit_waiters.append(fut)
        await fut

    def wake_credit_waiters(self) -> None:
        waiters, self._credit_waiters = self._credit_waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)

    async def drain(self) -> None:
        """Wait while the socket's buffer is full (the server reads slower than we write)."""
        if self._out_size >= _FLUSH_AT:  # big data goes to the socket now, where backpressure applies
            self._flush()
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
            if call_id == 0:  # control frames for other calls
                self._control(str(name), frame.header)
                continue
            if name == "data":  # a piece of an earlier request's data (an upload)
                target = self._calls.get(call_id)
                if target is not None:
                    target.data(frame)
                continue
            call = Call(self, call_id)
            self._calls[call_id] = call
            call.task = asyncio.get_running_loop().create_task(self._handle(call, str(name), frame))

    def _control(self, name: str, header: dict[str, Any]) -> None:
        target = self._calls.get(header.get("target"))  # type: ignore[arg-type]
        if name == "credit":
            nbytes = header.get("bytes")
            if isinstance(nbytes, int) and nbytes > 0:
                if not header.get("call_only"):  # call_only: a tunnel's (see tunnel.py)
                    self.conn_credit += nbytes
                if target is not None:
                    target.credit += nbytes
                self.wake_credit_waiters()
        elif name == "cancel" and target is not None:
            target.cancel()

    async def _handle(self, call: Call, name: str, frame: Frame) -> None:
        try:
            handler = _HANDLERS.get(name)
            if handler is None:
                raise SandboxError(f"unknown op {name!r}", "unimplemented")
            result = await handler(self, call, frame)
            await self._answer(call, result or {})
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

    async def _answer(self, call: Call, result: dict[str, Any]) -> None:
        """The final frame; a big answer (a long listing) goes first in flow-controlled parts."""
        data = json.dumps(result, separators=(",", ":")).encode()
        if len(data) <= _INLINE_ANSWER:
            call.emit({**result, "done": True})
            return
        for part in protocol.pieces(data):
            await call.send({"event": "part"}, part)
        call.emit({"done": True, "parts": True})


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


@op("policy")
async def _policy(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    """The sandbox policy's runtime parts (runtime/policy.py): syscalls and hold_exec."""
    syscalls, hold_exec = policy.check(frame.header.get("syscalls"), frame.header.get("hold_exec"))
    policy.set_hold_exec(hold_exec)  # first: the contexts restarted below start through it
    kept: list[str] = []
    if syscalls == "strict":
        policy.load_strict()
        kept = agent.contexts.adopt_strict()
    return {"syscalls": policy.syscalls(), "hold_exec": policy.holds_exec(), "contexts_kept": kept}


# -- processes --------------------------------------------------------------------------------------
async def _stream(call: Call, sub: Subscriber) -> None:
    try:
        while True:
            item = await sub.get()
            if item is None:
                return
            header, payload = item
            for part in protocol.pieces(payload):
                await call.send(header, part)
    finally:
        sub.close()


@op("proc.start")
async def _proc_start(agent: Agent, call: Call, frame: Frame) -> None:
    sub = agent.processes.start(frame.header)
    try:
        await _stream(call, sub)
    except asyncio.CancelledError:
        sub.process.expire_if_due()
        raise


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
    sig = _field(frame, "signal", int, 15)
    proc = agent.processes.signal(frame.header.get("pid"), frame.header.get("tag"), sig)
    if sig == signal.SIGKILL:  # as envd: the answer comes once the process is gone (reaped), ≤ 2 s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2.0
        while proc.status is None and loop.time() < deadline:
            await asyncio.sleep(0.002)
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
    with agent.fs.acting_as(frame.header.get("user")):
        return {"entry": agent.fs.stat(frame.header.get("path"))}


@op("fs.list")
async def _fs_list(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    with agent.fs.acting_as(frame.header.get("user")):
        return {"entries": agent.fs.list(frame.header.get("path"), _field(frame, "depth", int, 1))}


@op("fs.mkdir")
async def _fs_mkdir(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    with agent.fs.acting_as(frame.header.get("user")):
        entry = agent.fs.mkdir(frame.header.get("path"))
    agent.watchers.pump()  # a recursive watcher watches the new directory before the answer goes out
    return {"entry": entry}


@op("fs.move")
async def _fs_move(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    with agent.fs.acting_as(frame.header.get("user")):
        entry = agent.fs.move(frame.header.get("source"), frame.header.get("destination"))
    agent.watchers.pump()
    return {"entry": entry}


@op("fs.remove")
async def _fs_remove(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    with agent.fs.acting_as(frame.header.get("user")):
        agent.fs.remove(frame.header.get("path"))
    agent.watchers.pump()
    return {}


# -- directory watchers -----------------------------------------------------------------------------
def _watch_fields(frame: Frame) -> tuple[Any, bool, bool]:
    return (frame.header.get("path"), bool(_field(frame, "recursive", bool, False)),
            bool(_field(frame, "include_entry", bool, False)))  # fmt: skip


_WATCH_BATCH = 256  # events per stream frame


@op("fs.watch")
async def _fs_watch(agent: Agent, call: Call, frame: Frame) -> None:
    """A stream of envd's WatchDir: a start frame, then batches of events, read from inotify only
    while the server takes them (a stalled client leaves them in the kernel's bounded queue)."""
    w = agent.watchers.open_stream(*_watch_fields(frame))
    try:
        await call.send({"event": "start"})
        while True:
            await call.wait_credit()
            await w.readable()
            events = w.read()
            for i in range(0, len(events), _WATCH_BATCH):
                await call.send({"event": "fs", "events": events[i:i + _WATCH_BATCH]})
    finally:
        agent.watchers.close_stream(w)


@op("fs.watcher_create")
async def _fs_watcher_create(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    return {"watcher_id": agent.watchers.create(*_watch_fields(frame))}


@op("fs.watcher_events")
async def _fs_watcher_events(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    return {"events": agent.watchers.events(frame.header.get("watcher_id"))}


@op("fs.watcher_remove")
async def _fs_watcher_remove(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    agent.watchers.remove(frame.header.get("watcher_id"))
    return {}


@op("fs.read")
async def _fs_read(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    with agent.fs.acting_as(frame.header.get("user")):  # the open only: the fd reads what it may
        path, fd = agent.fs.open_for_read(frame.header.get("path"))
    size = 0
    try:
        while True:
            await call.wait_credit()  # read no further than the client takes
            try:
                chunk = os.read(fd, CHUNK)
            except OSError as e:
                raise os_error(e, path) from None
            if not chunk:
                return {"size": size}
            size += len(chunk)
            if size > filesystem.MAX_READ:
                raise ResourceExhaustedError(
                    f"{path} grew past {filesystem.MAX_READ >> 20} MiB, the most files.read returns")
            await call.send({"event": "data"}, chunk)
    finally:
        os.close(fd)


@op("fs.write")
async def _fs_write(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    metadata = _field(frame, "metadata", dict)
    path = frame.header.get("path")
    user = frame.header.get("user")
    if not frame.header.get("stream"):
        with agent.fs.acting_as(user):
            entry = agent.fs.write(path, frame.payload, metadata)
        agent.watchers.pump()
        return {"entry": entry}
    # The content follows in ``data`` frames, written as they arrive: nothing is held in memory.
    with agent.fs.acting_as(user):  # the temp file is made as `user`; writes go to its fd
        upload = agent.fs.open_upload(path)
    done: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def on_data(piece: Frame) -> None:
        if done.done():
            return
        try:
            upload.write(piece.payload)
        except SandboxError as e:
            done.set_exception(e)
            return
        if piece.header.get("eof"):
            done.set_result(None)

    call.take_data(on_data)
    try:
        await done
        with agent.fs.acting_as(user):
            entry = upload.finish(metadata)
        agent.watchers.pump()
        return {"entry": entry}
    finally:
        call.take_data(None)
        with agent.fs.acting_as(user):
            upload.close()


# -- ports served out -------------------------------------------------------------------------------
@op("net.connect")
async def _net_connect(agent: Agent, call: Call, frame: Frame) -> dict[str, Any]:
    return await tunnel.relay(call, frame)


# -- code contexts ----------------------------------------------------------------------------------
@op("code.run")
async def _code_run(agent: Agent, call: Call, frame: Frame) -> None:
    code = frame.payload.decode("utf-8", "replace") if frame.payload else _field(frame, "code", str, "")
    env_vars = _field(frame, "env_vars", dict)
    ctx = agent.contexts.get(_field(frame, "context_id", str), _field(frame, "language", str))

    def set_interrupt(interrupt: Callable[[], None]) -> None:
        call.on_cancel = interrupt  # a cancelled run is interrupted, and finishes quietly

    await ctx.run(code, env_vars, _field(frame, "timeout_ms", int, 0), call, set_interrupt)


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
