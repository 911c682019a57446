"""The server's handle on one zygote process (zygote.py is the process itself).

A zygote starts in two steps, so that its slow part (importing the sandboxes' Python runtime, ~1.5 s)
can begin before the server knows where its sandboxes go:

1. launch(): the process, from a runtime store, with what its imports need (entry point, caches);
2. place(): the cgroup parent, staging directory, PTY count and egress CA its sandboxes get.

`serve` launches the "base" zygote from the last start's runtime store at its very top
(runtime_prefetch), while the server imports itself and checks the store; the backend places it if the
check found the same store, and discards it otherwise. Both steps' arguments go through the zygote's
stdin (a line each), never argv: every sandbox is a fork of the zygote, and its /proc/<pid>/cmdline
would show them to user code.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess

from agentcell import rootless
from agentcell.backends.linux import cgroups, runtime_store
from agentcell.errors import BackendUnavailableError
from agentcell.server import progress

DEFAULT_ENTRY = "agentcell.runtime.agent:serve"
SPAWN = b"spawn"  # see zygote.SPAWN
SPAWN_NOW = b"spawn-now"  # see zygote.SPAWN_NOW
_ENV = {"PATH", "LANG", "LC_ALL", "PYTHONPATH", "TZ", "AGENTCELL_TIMING", rootless.ENV, cgroups.DELEGATED_ENV}


class ZygoteProcess:
    def __init__(self, template: str, entry: str, preload: bool, runtime: runtime_store.Store,
                 state_dir: str) -> None:
        """Launch (step 1): the process starts importing at once; place() tells it the rest."""
        self.template = template
        self.entry = entry
        self.preload = preload
        self.runtime = runtime
        self.state_dir = state_dir
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        # The zygote's memory is copied into every sandbox, so it gets none of the server's environment
        # (API keys, cloud credentials ...), only what Python and the numeric libraries need.
        env = {k: v for k, v in os.environ.items() if k in _ENV or k.startswith(("OPENBLAS_", "OMP_"))}
        env.setdefault("OPENBLAS_NUM_THREADS", "1")  # keep the zygote single-threaded
        # No host path either: PATH and PYTHONPATH name the runtime store's neutral tree, and the
        # caches live in a private directory (root's, 0700), not in /tmp.
        env.update(runtime.zygote_env())
        env.update(IPYTHONDIR=f"{state_dir}/ipython", MPLCONFIGDIR=f"{state_dir}/matplotlib")
        first = ["--fd", str(theirs.fileno()), "--entry", entry, "--parent", str(os.getpid())]
        if not preload:
            first.append("--no-preload")
        # The launcher execs the zygote from the runtime store's neutral paths (runtime_store.launch).
        self.proc = subprocess.Popen(
            runtime.launcher_command(),
            pass_fds=[theirs.fileno()], stdin=subprocess.PIPE, env=env, close_fds=True, cwd="/",
        )
        theirs.close()
        self.ctl = ours
        self.placed = False
        self.ready = False
        self._ready_task: asyncio.Task[None] | None = None
        self._send_line(first)

    def launched_like(self, template: str, entry: str, preload: bool, runtime: runtime_store.Store,
                      state_dir: str) -> bool:
        """Whether this (early) zygote is the one the backend would launch now: same runtime parts."""
        return (self.alive() and not self.placed and (template, entry, preload, state_dir)
                == (self.template, self.entry, self.preload, self.state_dir)
                and self.runtime.mounts == runtime.mounts and self.runtime.layout.pythonpath == runtime.layout.pythonpath
                and self.runtime.layout.executable == runtime.layout.executable)

    def place(self, cgroup_parent: str, staging: str, ptys: int, extra_ca: str | None) -> None:
        """Step 2: where its sandboxes go. The zygote then finishes its start and says "ready"."""
        second = ["--cgroup", cgroup_parent, "--staging", staging, "--ptys", str(ptys)]
        if extra_ca:
            second += ["--extra-ca", extra_ca]
        self._send_line(second)
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        self.placed = True

    def _send_line(self, args: list[str]) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps(args).encode() + b"\n")
            self.proc.stdin.flush()
        except OSError:
            pass  # it died: wait_ready() says so, with its exit code

    async def wait_ready(self, timeout: float) -> None:
        """Wait for the zygote's "ready" (it has imported everything); raise with a fix if it dies."""
        if self.ready:
            return
        if self._ready_task is None:  # concurrent create() calls share one wait
            self._ready_task = asyncio.get_running_loop().create_task(self._wait_ready(timeout))
        await asyncio.shield(self._ready_task)

    async def _wait_ready(self, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[bytes] = loop.create_future()

        def on_readable() -> None:
            if not fut.done():
                try:
                    fut.set_result(self.ctl.recv(16))
                except OSError as e:
                    fut.set_exception(e)

        loop.add_reader(self.ctl.fileno(), on_readable)
        try:
            with progress.step(f"starting the {self.template!r} zygote (importing the sandbox's Python runtime)"):
                async with asyncio.timeout(timeout):
                    msg = await fut
        except (TimeoutError, OSError) as e:
            self.stop()
            raise BackendUnavailableError(
                f"the {self.template!r} zygote did not start within {timeout:g} s ({e!r}); see its stderr") from None
        finally:
            loop.remove_reader(self.ctl.fileno())
        if msg != b"ready":
            self.stop()
            raise BackendUnavailableError(
                f"the {self.template!r} zygote exited during startup (code {self.proc.poll()}); see its stderr")
        self.ready = True

    def alive(self) -> bool:
        return self.proc.poll() is None

    def spawn(self, sock_fd: int, yield_cpu: bool = True) -> None:
        """Ask for a sandbox on `sock_fd` (prepared at the lowest CPU weight if `yield_cpu`). The request
        itself never goes through the zygote."""
        socket.send_fds(self.ctl, [SPAWN if yield_cpu else SPAWN_NOW], [sock_fd])

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.ctl.close()
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # one never placed reads the end of its stdin and exits
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def discard(self) -> None:
        """An early zygote the backend will not use: it forked nothing, so it goes at once."""
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.stop()
