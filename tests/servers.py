"""Real `agentcell serve` and `agentcell gateway` processes for the tests that start their own (the
session server in conftest.py is one too).

A `ServerProcess` listens on a free loopback port or on a unix socket, writes its output to a log file,
is ready once /health answers, and stops on SIGTERM (SIGKILL after a grace period). The variants the
tests need are options: the command to run (another python, a wheel's script, a gateway, a prefix such
as nsenter), extra arguments, the environment, an ordinary user to run as, HTTPS, a start timeout, and
a server expected not to start (`refused`). As a context manager it waits until ready and stops on exit.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from tests.ordinary_user import OrdinaryUser

REPO = Path(__file__).resolve().parent.parent
SERVER = (sys.executable, "-m", "agentcell.server")
SERVE = (sys.executable, "-m", "agentcell", "serve")
GATEWAY = (sys.executable, "-m", "agentcell", "gateway")

_own_state_dirs: list[str] = []  # made for servers here; removed when the test run ends (see below)


def _remove_own_state_dirs() -> None:
    """At the end of the test run, the state directories made for servers (a test may restart a server
    on its predecessor's, so not before). One with anything still mounted under it is left alone: a
    recursive removal would go into the mount (and a test of leaks is what should find it)."""
    with open("/proc/self/mountinfo") as f:
        mount_points = [line.split()[4] for line in f]
    for state in _own_state_dirs:
        if not any(m == state or m.startswith(state + "/") for m in mount_points):
            shutil.rmtree(state, ignore_errors=True)


atexit.register(_remove_own_state_dirs)


def temporary_state_dir() -> str:
    """A new, empty state directory for a server, removed when the test run ends."""
    _own_state_dirs.append(tempfile.mkdtemp(prefix="agentcell-state-"))
    return _own_state_dirs[-1]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the kernel's pick)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerError(RuntimeError):
    """A test's server did not start, or did not stop when asked to; the message ends with its log."""


class ServerProcess:
    """`command *address *args` in a subprocess, its stdout and stderr in `log_path`.

    The address: `--uds <uds>` when given, else `--host <host> --port <port>` (a free port unless one
    is given; no --host when host is None); `address_args=False` when the arguments or a config file
    name it already. Unless the arguments have one, `--state-dir` is a new temporary directory
    (`own_state_dir=False` leaves the server's default, and a gateway has none). The environment is
    `base_env` (this process's by default, the user's when run as `user`) with PYTHONUNBUFFERED=1 and
    `env` over it (a None value removes the variable).
    """

    def __init__(self, log_path: Path, *args: str, command: Sequence[str] = SERVER, uds: str | None = None,
                 port: int | None = None, host: str | None = "127.0.0.1", address_args: bool = True,
                 own_state_dir: bool = True, env: Mapping[str, str | None] | None = None,
                 base_env: Mapping[str, str] | None = None, cwd: Path | str | None = None,
                 user: OrdinaryUser | None = None, pass_fds: Sequence[int] = (), stdout_to_log: bool = True,
                 tls: ssl.SSLContext | None = None, ready_status: int | None = None, start_timeout: float = 90,
                 stop_timeout: float = 20, what: str = "the server") -> None:
        self.uds = uds
        self.port = 0 if uds else (port or free_port())
        self.url = "http://localhost" if uds else f"{'https' if tls else 'http'}://{host or '127.0.0.1'}:{self.port}"
        self.log_path = log_path
        self.tls = tls
        self.ready_status = ready_status  # None: any answer to /health will do
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self.what = what
        added: list[str] = []  # the address, a state dir
        if address_args:
            added = ["--uds", uds] if uds else [*(("--host", host) if host else ()), "--port", str(self.port)]
        if own_state_dir and "--state-dir" not in args:  # its snapshots and paused sandboxes: gone with the run
            added += ["--state-dir", temporary_state_dir()]
        environ = dict(base_env if base_env is not None else user.env() if user else os.environ)
        environ["PYTHONUNBUFFERED"] = "1"
        for name, value in (env or {}).items():
            if value is None:
                environ.pop(name, None)
            else:
                environ[name] = value
        as_user = {"user": user.uid, "group": user.gid, "extra_groups": []} if user else {}
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [*command, *added, *args], cwd=cwd or (user.home if user else REPO), env=environ,
                stdout=log if stdout_to_log else subprocess.DEVNULL, stderr=log, pass_fds=tuple(pass_fds),
                **as_user)  # type: ignore[call-overload]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def http_client(self, timeout: float = 30) -> httpx.Client:
        """An HTTP client of this server (over its socket when it has one)."""
        transport = httpx.HTTPTransport(uds=self.uds) if self.uds else None
        return httpx.Client(base_url=self.url, transport=transport, verify=self.tls or True, timeout=timeout)

    def answers(self) -> bool:
        """Whether /health answers now (with `ready_status`, when one is asked for)."""
        try:
            with self.http_client(timeout=1) as c:
                status = c.get("/health").status_code
        except httpx.TransportError:
            return False
        return self.ready_status is None or status == self.ready_status

    def wait_ready(self, timeout: float | None = None) -> None:
        timeout = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise ServerError(f"{self.what} exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            if self.answers():
                return
            if time.monotonic() > deadline:
                raise ServerError(f"{self.what} did not start within {timeout:g} s:\n{self.log()[-4000:]}")
            time.sleep(0.1)

    def refused(self, timeout: float = 90) -> str:
        """For a server that must not start: waits for it to exit, asserts it failed; its log."""
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise ServerError(f"{self.what} neither started nor refused within {timeout:g} s:\n"
                              f"{self.log()[-3000:]}") from None
        assert code != 0, f"{self.what} exited with 0 instead of refusing:\n{self.log()[-3000:]}"
        return self.log()

    def terminate(self) -> None:
        """SIGTERM, without waiting (its shutdown runs meanwhile)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, grace: float | None = None, *, or_kill: bool = True) -> int:
        """SIGTERM, then SIGKILL after `grace` seconds; its exit code. With or_kill=False a server that
        needs the SIGKILL is an error (a test of its shutdown)."""
        grace = self.stop_timeout if grace is None else grace
        self.terminate()
        try:
            return self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            if not or_kill:
                raise ServerError(f"{self.what} did not stop within {grace:g} s of SIGTERM:\n"
                                  f"{self.log()[-3000:]}") from None
            return self.proc.returncode

    def started(self, timeout: float | None = None) -> ServerProcess:
        """Itself once ready; one that does not get there is stopped (no server outlives a failed test)."""
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def __enter__(self) -> ServerProcess:
        return self.started()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.stop()


class GatewayProcess(ServerProcess):
    """`agentcell gateway --port <free> --cell <url>... *args`, ready once its /health says 200."""

    def __init__(self, log_path: Path, cells: list[str], *args: str) -> None:
        super().__init__(log_path, *(a for c in cells for a in ("--cell", c)), *args, command=GATEWAY, host=None,
                         own_state_dir=False, ready_status=200, start_timeout=30, stop_timeout=10,
                         what="the gateway")

    def cells(self) -> dict[str, dict[str, Any]]:
        return {c["cellId"]: c for c in httpx.get(self.url + "/v1/cells", timeout=5).json() if c["cellId"]}
