"""Code contexts: each one is a kernel process; Python's is an IPython shell forked from the agent.

A context process (a "kernel") is a fork of the agent, so it starts with the shell, NumPy, pandas and
Matplotlib already imported and costs a few milliseconds to make. User code there cannot block or crash
the agent. Agent and kernel talk over a socketpair with the agent framing: the agent sends
``{"env_vars"}`` with the code as payload; the kernel answers with ``{"line": true}`` frames whose
payload is one E2B line as JSON, and ``{"done": true}``. User code can write to that socket too, so
the agent treats what it reads there as hostile: a malformed frame ends the context, nothing else.
The kernel's fds 1 and 2 are pipes the agent reads itself, so ``print`` and output of C code or
subprocesses both stream as stdout/stderr lines. Before the kernel sends a frame it flushes its stdio,
and the agent drains the pipes before it forwards the frame, so lines keep their order.

The other languages' kernels (JavaScript, TypeScript, bash, Java, R) are programs started the same way and
spoken to on the same socket and pipes (kernel_exec.KernelSpec: kernel_node.py, kernel_bash.py, kernel_r.py), so
flow control, interrupts, deadlines and restarts below serve every language. So is Python's in a
template whose image has its own interpreter (``python=``: kernel_image_python.py).
"""

from __future__ import annotations

import asyncio
import codecs
import contextlib
import ctypes
import datetime
import os
import resource
import signal
import socket
import sys
import traceback
import uuid
from collections.abc import Callable
from typing import Any, NoReturn, Protocol

from agentcell.errors import InvalidArgumentError, NotFoundError, SandboxError
from agentcell.runtime import (
    display,
    forkstate,
    kernel_bash,
    kernel_image_python,
    kernel_java,
    kernel_node,
    kernel_r,
    policy,
    rootcaps,
    stdio,
)
from agentcell.runtime.kernel_exec import KernelSpec
from agentcell.runtime.processes import CHILD_OOM_SCORE_ADJ, set_oom_score_adj
from agentcell.runtime.protocol import ProtocolError, encode_frame, read_frame, recv_frame
from agentcell.runtime.reaper import Reaper, describe_status

LANGUAGES = {
    "python": "python", "python3": "python",
    "javascript": "javascript", "js": "javascript", "node": "javascript",
    "typescript": "typescript", "ts": "typescript",
    "bash": "bash", "sh": "bash", "shell": "bash",
    "r": "r", "java": "java",
}
# Languages E2B's template lists a default context of even before it is used (its server starts them).
LISTED_DEFAULTS = ("python", "javascript")
INTERRUPT_GRACE = 2.0  # seconds a run gets to stop after SIGINT before its kernel is killed
MAX_LINE = 32 << 20  # the largest single output line (a result, e.g. a PNG or HTML) a run may produce
_OUTPUT_READ = 64 * 1024
_DRAIN_MAX = 2 * _OUTPUT_READ  # output taken ahead of a result frame, to keep print/result order
_EXIT_GRACE = 0.2  # seconds the socket of a kernel whose process ended is read before it is cut
PARTIAL_LINE_S = 0.05  # how long a whole_lines kernel's unfinished line waits for its end (R may be descheduled mid-line)
_PR_SET_DUMPABLE = 4



class LineSink(Protocol):
    """The run's call (agent.Call): where the lines of a run go, within the call's flow control."""

    cancelled: bool

    def can_emit_line(self) -> bool: ...
    async def wait_line_slot(self) -> None: ...
    def emit_line(self, line: bytes) -> None: ...
    async def send_line(self, line: bytes) -> None: ...
    def hold_line(self, line: bytes) -> bool: ...


encode_line = display.encode_line

_shell: display.ContextShell | None = None


def preload() -> None:
    """Build the shared shell once (in the zygote), before any fork."""
    global _shell
    if _shell is None:
        _shell = display.build_shell()


def normalize_language(language: str | None) -> str:
    lang = (language or "python").strip().lower()
    if lang not in LANGUAGES:
        raise InvalidArgumentError(f"language {language!r} is not supported; agentcell contexts run "
                                   "python, javascript (js), typescript (ts), bash, java and r")  # fmt: skip
    return LANGUAGES[lang]


def kernel_spec(language: str, kernels: dict[str, KernelSpec] | None = None) -> KernelSpec:
    """The kernel of a normalized language; InvalidArgumentError (a 400) naming what the host lacks."""
    spec = (kernels or _KERNELS)[language]
    missing = spec.missing()
    if missing:
        raise InvalidArgumentError(missing)
    return spec


def timestamp() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat()


# ---------------------------------------------------------------------------------------------------
# Agent side
# ---------------------------------------------------------------------------------------------------


class _Kernel:
    """One kernel process as the agent sees it. A restart makes a new one."""

    def __init__(self, spec: KernelSpec, loop: asyncio.AbstractEventLoop, reaper: Reaper, cwd: str,
                 envs: dict[str, str], oom_score_adj: int) -> None:  # fmt: skip
        self.spec = spec
        self._loop = loop
        self.status: int | None = None
        self.exited: asyncio.Future[int] = loop.create_future()
        self.sink: LineSink | None = None  # the current run; output between runs is dropped
        self.kill_reason = ""
        self.reader: asyncio.StreamReader | None = None
        self._paused = False
        self.writer: asyncio.StreamWriter | None = None
        self._envs: dict[str, str] | None = None  # for connect() to send
        self._strict_pending = False  # for connect() to send: load the strict filter (never ran code)
        self.ran = False  # code of a tenant's was sent to it
        self.strict = policy.syscalls() == "strict"  # carries the strict filter (inherited at its start)
        ours, theirs = socket.socketpair()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            pid = spec.launch(theirs.fileno(), out_w, err_w, cwd, envs, oom_score_adj)
        except (OSError, SandboxError) as e:
            for fd in (out_r, out_w, err_r, err_w):
                os.close(fd)
            ours.close()
            theirs.close()
            if isinstance(e, SandboxError):
                raise
            raise SandboxError(f"cannot start a code context: {e.strerror} (process limit reached?)",
                               "resource_exhausted") from None  # fmt: skip
        self.pid = pid
        reaper.watch(pid, self._on_exit)
        theirs.close()
        os.close(out_w)
        os.close(err_w)
        self.sock = ours
        self._decoders: dict[int, tuple[str, Any]] = {}
        self._partial: dict[int, str] = {}  # fd -> the unfinished line held (spec.whole_lines)
        self._partial_timer: asyncio.TimerHandle | None = None
        self._stderr_fd = err_r
        for fd, kind in ((out_r, "stdout"), (err_r, "stderr")):
            os.set_blocking(fd, False)
            self._decoders[fd] = (kind, codecs.getincrementaldecoder("utf-8")("replace"))
            loop.add_reader(fd, self._read_output, fd)

    @property
    def alive(self) -> bool:
        return self.status is None

    def _on_exit(self, status: int) -> None:
        self.status = status
        if not self.exited.done():
            self.exited.set_result(status)
        # A process the kernel started may hold its socket open (R's `cat`s, a command left running in
        # the background): what the kernel sent is read in the grace time, then the socket is cut, so
        # a run waiting on it ends (_report_death) instead of waiting for that process.
        self._loop.call_later(_EXIT_GRACE, self._cut_socket)

    def _cut_socket(self) -> None:
        if self.writer is not None:
            self.writer.transport.abort()

    async def connect(self) -> None:
        """Open the streams; the kernel's first frame says its warm-up is done (_serve_kernel)."""
        if self.reader is None:
            self.reader, self.writer = await asyncio.open_unix_connection(sock=self.sock)
            if self._envs is not None:  # env vars that came while it warmed up (the claim's)
                self.writer.write(self.spec.encode_env(self._envs))
                self._envs = None
            if self._strict_pending:
                self.writer.write(encode_frame({"seccomp": "strict"}))
                self._strict_pending = False
            try:
                warm = await read_frame(self.reader, 1 << 10)
            except (OSError, ValueError, ProtocolError):
                warm = None
            if warm is None or not warm.header.get("warm"):
                self.kill("it broke its protocol while starting")

    def load_strict(self) -> None:
        """A Python kernel forked from the agent that never ran code: it loads the strict filter itself
        before the next frame it reads (frames are taken in order, so before any run). A kernel that
        cannot load it exits, and the context restarts from the agent, which carries it."""
        if self.writer is not None:
            self.writer.write(encode_frame({"seccomp": "strict"}))
        else:
            self._strict_pending = True
        self.strict = True

    def set_envs(self, envs: dict[str, str]) -> None:
        """Replace the kernel's os.environ before its next run."""
        if self.writer is not None:
            self.writer.write(self.spec.encode_env(envs))
        else:
            self._envs = dict(envs)  # sent by connect(), which may be waiting for the warm frame now

    def _read_output(self, fd: int) -> bool:
        sink = self.sink
        if sink is not None and not sink.cancelled and not sink.can_emit_line():
            self._pause(sink)  # the client reads slower than the code prints: let the pipe fill up
            return False
        try:
            data = os.read(fd, _OUTPUT_READ)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        kind, decoder = self._decoders[fd]
        if not data:
            self._loop.remove_reader(fd)
            del self._decoders[fd]
            os.close(fd)
            self.flush_partial()
            return False
        text = decoder.decode(data)
        if text and self.spec.whole_lines:
            text = self._hold_partial(fd, self._partial.pop(fd, "") + text)
        if text and sink is not None:
            sink.emit_line(encode_line({"type": kind, "text": text, "timestamp": timestamp()}))
        return True

    def _hold_partial(self, fd: int, text: str) -> str:
        """The finished lines of `text`; the rest is held until its line ends or PARTIAL_LINE_S pass."""
        cut = text.rfind("\n") + 1
        if cut < len(text):
            self._partial[fd] = text[cut:]
            if self._partial_timer is None:
                self._partial_timer = self._loop.call_later(PARTIAL_LINE_S, self.flush_partial)
        return text[:cut]

    def flush_partial(self) -> None:
        """Forward the unfinished lines held (a prompt, a progress bar: output without a newline)."""
        if self._partial_timer is not None:
            self._partial_timer.cancel()
            self._partial_timer = None
        held, self._partial = self._partial, {}
        sink = self.sink
        for fd, text in held.items():
            if sink is not None and not sink.cancelled:
                kind = "stderr" if fd == self._stderr_fd else "stdout"
                sink.emit_line(encode_line({"type": kind, "text": text, "timestamp": timestamp()}))

    def _pause(self, sink: LineSink) -> None:
        """Stop reading the output pipes (the kernel then blocks writing) until the call has room."""
        if self._paused:
            return
        self._paused = True
        for fd in self._decoders:
            self._loop.remove_reader(fd)
        self._loop.create_task(self._resume(sink))

    async def _resume(self, sink: LineSink) -> None:
        try:
            await sink.wait_line_slot()
        finally:
            self._paused = False
            for fd in self._decoders:
                self._loop.add_reader(fd, self._read_output, fd)

    def drain(self) -> None:
        """Forward what is in the output pipes now: it was written before the frame being handled."""
        for fd in list(self._decoders):
            taken = 0
            while fd in self._decoders and taken < _DRAIN_MAX and self._read_output(fd):
                taken += _OUTPUT_READ

    def interrupt(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            if self.spec.interrupt_group:
                os.killpg(self.pid, signal.SIGINT)
            else:
                os.kill(self.pid, signal.SIGINT)

    def kill(self, reason: str = "") -> None:
        if reason and not self.kill_reason:
            self.kill_reason = reason
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)

    def close(self) -> None:
        self.kill()
        if self._partial_timer is not None:
            self._partial_timer.cancel()
        for fd in list(self._decoders):
            self._loop.remove_reader(fd)
            os.close(fd)
        self._decoders.clear()
        if self.writer is not None:
            self.writer.close()
        else:
            self.sock.close()


class Context:
    def __init__(self, manager: ContextManager, context_id: str, language: str, cwd: str) -> None:
        self.id = context_id
        self.language = language
        self.cwd = cwd
        self._manager = manager
        self._lock = asyncio.Lock()
        self.kernel: _Kernel | None = None

    def info(self) -> dict[str, str]:
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    def start(self) -> None:
        self.kernel = self._manager.spawn(self.cwd, self.language)

    async def warm(self) -> None:
        """Until the kernel has run its warm-up (a standby's context is ready before its claim)."""
        async with self._lock:
            if self.kernel is not None:
                await self.kernel.connect()

    def restart(self) -> None:
        old, self.kernel = self.kernel, None
        if old is not None:
            old.kill("the context was restarted")
            old.close()
        self.start()

    def close(self) -> None:
        if self.kernel is not None:
            self.kernel.close()
            self.kernel = None

    async def run(self, code: str, env_vars: dict[str, str] | None, timeout_ms: int, sink: LineSink,
                  on_interrupt: Callable[[Callable[[], None]], None]) -> None:  # fmt: skip
        """Run `code`, sending each E2B line to `sink`. `on_interrupt` receives the function that
        interrupts this run (the agent calls it when the caller cancels)."""
        async with self._lock:
            if self.kernel is None or not self.kernel.alive:
                if self.kernel is not None:
                    self.kernel.close()
                self.start()
            kernel = self.kernel
            assert kernel is not None
            await kernel.connect()
            assert kernel.reader is not None and kernel.writer is not None
            loop = asyncio.get_running_loop()
            hard_kill: list[asyncio.TimerHandle] = []

            def interrupt() -> None:
                if hard_kill or not kernel.alive:
                    return
                kernel.interrupt()
                hard_kill.append(loop.call_later(INTERRUPT_GRACE, kernel.kill,
                                                 f"it did not stop within {INTERRUPT_GRACE:g} s of the interrupt"))  # fmt: skip

            def deadline_passed() -> None:
                note = f"Execution timed out after {timeout_ms / 1000:g} s: interrupting it\n"
                if sink.can_emit_line():
                    sink.emit_line(encode_line({"type": "stderr", "text": note, "timestamp": timestamp()}))
                interrupt()

            on_interrupt(interrupt)
            deadline = loop.call_later(timeout_ms / 1000, deadline_passed) if timeout_ms > 0 else None
            kernel.sink = sink
            kernel.ran = True
            try:
                kernel.writer.write(kernel.spec.encode_run(code, env_vars or {}))
                while True:
                    try:
                        frame = await read_frame(kernel.reader, MAX_LINE + (1 << 10))
                    except (OSError, ValueError, ProtocolError):
                        frame = None  # the socket broke, or user code wrote junk to it
                    await sink.wait_line_slot()
                    kernel.drain()
                    if frame is None or frame.done:
                        # (an unfinished line is held over other frames: the kernel may be writing it now)
                        kernel.flush_partial()
                    if frame is None:
                        await self._report_death(kernel, sink)
                        break
                    if frame.done:
                        break
                    if not (frame.header.get("hold") and sink.hold_line(frame.payload)):
                        await sink.send_line(frame.payload)
            finally:
                kernel.sink = None
                if deadline is not None:
                    deadline.cancel()
                for handle in hard_kill:
                    handle.cancel()
            if not kernel.alive and self.kernel is kernel:
                # Restart now, so the next run finds a warm kernel (it would restart anyway).
                kernel.close()
                self.kernel = None
                with contextlib.suppress(SandboxError):
                    self.start()

    async def _report_death(self, kernel: _Kernel, sink: LineSink) -> None:
        kernel.kill()  # a kernel that closed its socket is of no use any more
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(kernel.exited), 1.0)
        kernel.drain()
        kernel.flush_partial()
        how = describe_status(kernel.status)[2] if kernel.status is not None else "it closed its socket"
        if kernel.status is not None and os.WIFSIGNALED(kernel.status) and os.WTERMSIG(kernel.status) == 9:
            how += ", perhaps by the out-of-memory killer"
        reason = kernel.kill_reason or f"the context process ended ({how})"
        await sink.send_line(encode_line({"type": "error", "name": "UnexpectedEndOfExecution",
                                          "value": f"{reason}; its state is lost and it restarts on the next run",
                                          "traceback": ""}))  # fmt: skip


class ContextManager:
    def __init__(self, reaper: Reaper, envs: dict[str, str], home: str,
                 oom_score_adj: int = CHILD_OOM_SCORE_ADJ, python: str | None = None) -> None:  # fmt: skip
        """`python`: a template image's interpreter (a path in the sandbox); Python contexts then run
        on it (kernel_image_python.py) instead of being forks of the agent."""
        preload()
        self._kernels = dict(_KERNELS)
        if kernel_image_python.usable(python):
            assert python is not None
            self._kernels["python"] = kernel_image_python.image_python_spec(python)
        self._reaper = reaper
        self._oom_score_adj = oom_score_adj
        self._envs = dict(envs)
        self._home = home
        self._contexts: dict[str, Context] = {}
        self._defaults: dict[str, Context] = {}  # language -> its default context (run_code(language=))

    def update_envs(self, envs: dict[str, str]) -> None:
        """Env vars for every context from now on, and for the running ones before their next run."""
        self._envs.update(envs)
        for ctx in self._contexts.values():
            if ctx.kernel is not None and ctx.kernel.alive:
                ctx.kernel.set_envs(self._envs)

    def spawn(self, cwd: str, language: str = "python") -> _Kernel:
        return _Kernel(self._kernels[language], asyncio.get_running_loop(), self._reaper, cwd, self._envs,
                       self._oom_score_adj)  # fmt: skip

    def _resolve_cwd(self, cwd: str | None) -> str:
        path = os.path.normpath(os.path.join(self._home, cwd)) if cwd else self._home
        if not os.path.isdir(path):
            raise InvalidArgumentError(f"cwd {path!r} is not an existing directory")
        return path

    def create(self, language: str | None = None, cwd: str | None = None, start: bool = True) -> Context:
        lang = normalize_language(language)
        kernel_spec(lang, self._kernels)
        ctx = Context(self, str(uuid.uuid4()), lang, self._resolve_cwd(cwd))
        if start:
            ctx.start()
        self._contexts[ctx.id] = ctx
        return ctx

    def default(self, language: str | None = None, start: bool = True) -> Context:
        """The language's default context, made when first asked for. One that is only listed is made
        without its process (a JavaScript context is a node process: started by its first run)."""
        lang = normalize_language(language)
        ctx = self._defaults.get(lang)
        if ctx is None or ctx.id not in self._contexts:
            ctx = self._defaults[lang] = self.create(lang, start=start)
        return ctx

    def get(self, context_id: str | None, language: str | None = None) -> Context:
        if context_id:
            ctx = self._contexts.get(context_id)
            if ctx is None:
                raise NotFoundError(f"context {context_id!r} not found")
            return ctx
        return self.default(language)

    def list(self) -> list[dict[str, str]]:
        """Every context, with the default ones E2B's server lists from its start (python, javascript)."""
        listed = []
        for lang in LISTED_DEFAULTS:  # first, as E2B's server lists them (it made them at its start)
            with contextlib.suppress(InvalidArgumentError):  # a host without node lists no javascript
                listed.append(self.default(lang, start=False))
        return [c.info() for c in listed] + [c.info() for c in self._contexts.values() if c not in listed]

    def delete(self, context_id: str) -> None:
        ctx = self._contexts.pop(context_id, None)
        if ctx is None:
            raise NotFoundError(f"context {context_id!r} not found")
        ctx.close()

    def restart(self, context_id: str) -> None:
        ctx = self._contexts.get(context_id)
        if ctx is None:
            raise NotFoundError(f"context {context_id!r} not found")
        ctx.restart()

    def close(self) -> None:
        for ctx in self._contexts.values():
            ctx.close()

    def forget_warm_up(self) -> None:
        """The code the contexts ran so far was the standby's own warm-up, none of a tenant's: they
        count as unused (adopt_strict can still hand them a filter)."""
        for ctx in self._contexts.values():
            if ctx.kernel is not None:
                ctx.kernel.ran = False

    def adopt_strict(self) -> list[str]:
        """After the agent loaded the strict seccomp filter (policy.py): kernels that never ran code
        take it too (a Python fork loads it itself, another kernel is restarted); the ids of the
        contexts whose kernels ran code and keep the old filter."""
        kept = []
        for ctx in self._contexts.values():
            kernel = ctx.kernel
            if kernel is None or not kernel.alive or kernel.strict:
                continue  # (none running: its next start is a child of the agent's, filtered)
            if kernel.ran:
                kept.append(ctx.id)
            elif kernel.spec.launch is _fork_python:
                kernel.load_strict()
            else:
                with contextlib.suppress(SandboxError):  # (if it fails, its next run starts it)
                    ctx.restart()
        return kept


# ---------------------------------------------------------------------------------------------------
# Kernel side (runs in the forked context process)
# ---------------------------------------------------------------------------------------------------

_CTRL_FD = 3
# SIGINT interrupts only user code: while it runs the handler is the C default_int_handler (so no
# frame of ours shows in the KeyboardInterrupt traceback); between runs and while a frame is being
# sent it is _defer_sigint, which only notes the interrupt (a half-sent frame would break the stream).
_running = False
_interrupt_pending = False
_held_result = b""  # the main result's frame, sent with the next frame (_send_line)


def _defer_sigint(signum: int, frame: Any) -> None:
    global _interrupt_pending
    _interrupt_pending = True


def _arm_sigint() -> None:
    global _running
    _running = True
    signal.signal(signal.SIGINT, signal.default_int_handler)


_last_cwd = ""


def _rejoin_cwd() -> None:
    """Enter the working directory again, by its path, before each run: the server may have put a
    policy's file rules (mounts) over it since (policy/linux/file_rules.py); a working directory taken
    before keeps reaching what is under the rules. A chdir() of the user's own code is kept: it is
    the path that is entered again."""
    global _last_cwd
    try:
        here = os.getcwd()
    except OSError:  # the mount it was on was replaced and detached: its path, as last known
        here = _last_cwd
    if here:
        with contextlib.suppress(OSError):
            os.chdir(here)
            _last_cwd = here


def _disarm_sigint() -> None:
    global _running
    signal.signal(signal.SIGINT, _defer_sigint)
    _running = False


def _fork_python(ctrl_fd: int, out_w: int, err_w: int, cwd: str, envs: dict[str, str], oom_score_adj: int) -> int:
    """Python's launcher: a fork of the agent, its shell built already (preload)."""
    pid = os.fork()
    if pid == 0:
        _kernel_child(ctrl_fd, out_w, err_w, cwd, envs, oom_score_adj)  # never returns
    return pid


def _kernel_child(ctrl_fd: int, out_w: int, err_w: int, cwd: str, envs: dict[str, str],
                  oom_score_adj: int) -> NoReturn:  # fmt: skip
    try:
        rootcaps.drop_in_child()  # user code never holds the agent's root capabilities
        os.setsid()  # user code's killpg(0) or terminal signals cannot reach the agent
        signal.set_wakeup_fd(-1)  # the agent's loop wakeup pipe is not ours
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, _defer_sigint)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.dup2(ctrl_fd, _CTRL_FD, inheritable=False)
        os.closerange(_CTRL_FD + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        with contextlib.suppress(OSError):
            ctypes.CDLL(None).prctl(_PR_SET_DUMPABLE, 1, 0, 0, 0)  # user code; the agent stays closed
        set_oom_score_adj("self", oom_score_adj)  # the OOM killer takes a context before the agent
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(envs)
        _scrub_inherited_environ()
        forkstate.refresh()  # PRNG seeds and caches of the zygote: not the same in every sandbox
        asyncio.set_event_loop_policy(None)  # forget the agent's loop (its fds are gone here)
        _serve_kernel(socket.socket(fileno=_CTRL_FD))
    except BaseException:
        with contextlib.suppress(BaseException):
            os.write(2, traceback.format_exc().encode())
    os._exit(1)


def _scrub_inherited_environ() -> None:
    """Zero the environment block this process inherited (the zygote's, from its exec).

    /proc/self/environ shows that block, not os.environ, so without this user code could read the
    host-side environment of the zygote. C getenv() no longer points into it: os.environ.update()
    gave every variable a fresh heap copy.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end (stat fields 50, 51)
    except (OSError, IndexError, ValueError):
        return
    if 0 < start < end and end - start < (16 << 20):
        ctypes.memset(start, 0, end - start)


def _install_stdio() -> None:
    stdio.install()  # line-buffered, and what is printed without a newline goes out within ~10 ms


def _flush_stdio() -> None:
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            if stream is not None:
                stream.flush()


def _send(sock: socket.socket, header: dict[str, Any], payload: bytes = b"") -> None:
    global _interrupt_pending, _held_result
    running = _running
    if running:
        signal.signal(signal.SIGINT, _defer_sigint)
    try:
        _flush_stdio()
        data, _held_result = _held_result + encode_frame(header, payload), b""
        sock.sendall(data)
    finally:
        if running:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    if running and _interrupt_pending:
        _interrupt_pending = False
        raise KeyboardInterrupt


def _send_line(sock: socket.socket, line: dict[str, Any]) -> None:
    """One E2B line. The count of executions and the main result may wait in the agent ("hold") until
    the next line or the end of the run, so they reach the client with it instead of on their own.
    The main result comes at the end of a cell: it waits here already, and goes out in the same write
    as the next frame (the run's end, usually), so the agent wakes once for both."""
    global _held_result
    data = encode_line(line)
    if len(data) > MAX_LINE:
        # Too big for one line: the run goes on and says so, instead of breaking the context.
        what = line.get("type", "output")
        data = encode_line({"type": "error", "name": "OutputTooLarge",
                            "value": f"a {what} of {len(data)} bytes is over the {MAX_LINE >> 20} MiB limit of one "
                                     "output; write it to a file and read it with files.read",
                            "traceback": ""})  # fmt: skip
    if line.get("is_main_result") is True:
        _held_result += encode_frame({"line": True, "hold": True}, data)
        return
    hold = line.get("type") == "number_of_executions"
    _send(sock, {"line": True, "hold": True} if hold else {"line": True}, data)


def _warm_run_path(shell: display.ContextShell) -> None:
    """Run one cell on the path a user's cell takes (history, displayhook, formatters, the result
    line), output discarded and its traces undone. The copy-on-write faults of a first cell are paid
    here, while the sandbox is a standby, instead of in its first run_code (measured: ~10 ms)."""
    hm = shell.history_manager
    assert hm is not None
    saved_ns = dict(shell.user_ns)
    saved_lists = [(lst, list(lst)) for lst in (hm.input_hist_parsed, hm.input_hist_raw)]
    saved_dicts = [(d, dict(d)) for d in (hm.output_hist, hm.output_hist_reprs)]
    count = shell.execution_count
    display.sink = encode_line  # encoded, then dropped
    try:
        shell.run_cell("_agentcell_warm = [i * 2 for i in range(3)]\nlen(_agentcell_warm)", store_history=True)
    finally:
        display.sink = display._discard
        shell.execution_count = count
        for lst, old in saved_lists:
            lst[:] = old
        for d, old in saved_dicts:
            d.clear()
            d.update(old)
        shell.user_ns.clear()  # the same dict (it is __main__'s): only its contents go back
        shell.user_ns.update(saved_ns)


def _serve_kernel(sock: socket.socket) -> NoReturn:
    global _interrupt_pending
    _install_stdio()
    shell = _shell
    assert shell is not None
    _warm_run_path(shell)
    display.sink = lambda line: _send_line(sock, line)
    sock.sendall(encode_frame({"warm": True}))  # the agent's connect() waits for this
    while True:
        # An interrupt from here on is for the run about to come (its deadline may pass before the
        # code even starts, under load); one that came before was for a run that has ended.
        _interrupt_pending = False
        frame = recv_frame(sock)
        if frame is None:
            os._exit(0)
        if frame.header.get("seccomp") == "strict":  # before any run (ContextManager.adopt_strict)
            try:
                policy.load_strict()
            except SandboxError:
                os._exit(1)
            continue
        if "set_env" in frame.header:  # the claim's env vars (ContextManager.update_envs)
            os.environ.clear()
            os.environ.update({str(k): str(v) for k, v in frame.header["set_env"].items()})
            # a context restored from a template (the gvisor backend) was not forked for its sandbox:
            # its generators are redrawn at the claim, before any user code
            forkstate.refresh()
            continue
        _rejoin_cwd()
        code = frame.payload.decode("utf-8", "replace")
        env_vars = {str(k): str(v) for k, v in (frame.header.get("env_vars") or {}).items()}
        saved = {k: os.environ.get(k) for k in env_vars}
        try:
            try:
                os.environ.update(env_vars)
            except ValueError as e:  # a NUL or '=' the server let through: this run fails, the context lives
                _send_line(sock, {"type": "error", "name": "ValueError", "value": f"invalid env_vars: {e}",
                                  "traceback": ""})  # fmt: skip
                continue
            _send_line(sock, {"type": "number_of_executions", "execution_count": shell.execution_count})
            try:
                _arm_sigint()
                if _interrupt_pending:  # it came before the code started: the code never starts
                    _interrupt_pending = False
                    raise KeyboardInterrupt
                shell.run_cell(code, store_history=True)
            finally:
                _disarm_sigint()
        except KeyboardInterrupt:  # landed outside the user's code, in the shell's own machinery
            _send_line(sock, {"type": "error", "name": "KeyboardInterrupt", "value": "",
                              "traceback": "KeyboardInterrupt"})  # fmt: skip
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            _send(sock, {"done": True})


_KERNELS: dict[str, KernelSpec] = {
    "python": KernelSpec("python", _fork_python),
    "javascript": kernel_node.JAVASCRIPT,
    "typescript": kernel_node.TYPESCRIPT,
    "bash": kernel_bash.BASH,
    "java": kernel_java.JAVA,
    "r": kernel_r.R,
}
