"""Embedded mode: with neither `api_url` nor AGENTCELL_URL, the SDK starts one private local server per
process (`python -m agentcell serve --uds <0700 dir>/agentcell.sock`), shared by Sandbox and AsyncSandbox.

It stops at interpreter exit (atexit), and also when this process dies without running atexit: the server
holds the read end of a "lifeline" pipe (AGENTCELL_LIFELINE_FD) and shuts down when it reads EOF.
"""

from __future__ import annotations

import atexit
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import httpx

from agentcell import rootless
from agentcell.errors import EmbeddedServerError
from agentcell.sdk.config import Endpoint
from agentcell.sdk.startup_log import DEFAULT_UPLINK, StartupLog, first_use_notice

START_TIMEOUT_S = 60.0
LIFELINE_ENV = "AGENTCELL_LIFELINE_FD"


class EmbeddedServer:
    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="agentcell-")  # mode 0700: only this user reaches the socket
        self.socket = os.path.join(self.dir, "agentcell.sock")
        self.log_path = os.path.join(self.dir, "server.log")
        self.endpoint = Endpoint("http://localhost", self.socket)
        self.owner_pid = os.getpid()
        read_end, self._lifeline = os.pipe()
        env = {**os.environ, LIFELINE_ENV: str(read_end), "PYTHONUNBUFFERED": "1"}
        env.pop("AGENTCELL_SERVER_API_KEY", None)  # the 0700 socket is the access control here
        env.pop("AGENTCELL_CONFIG", None)  # an operator's config file is for their server, not this private one
        # sandboxes get the internet through this host unless AGENTCELL_EGRESS_UPLINK says otherwise, as on
        # E2B (README, "Quick start"); said once at first use (first_use_notice)
        self.uplink = env.setdefault("AGENTCELL_EGRESS_UPLINK", DEFAULT_UPLINK)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                # its own state dir too: a server's state is its own (server/state_lock.py), and this one
                # is private to this process, as its sandboxes are
                [sys.executable, "-m", "agentcell", "serve", "--uds", self.socket,
                 "--state-dir", os.path.join(self.dir, "state"), *rootless.embedded_serve_args()],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env, pass_fds=(read_end,),
                # Its own session: a Ctrl-C meant for this program must not kill the server before atexit
                # has cleaned up.
                start_new_session=True,
            )
        os.close(read_end)

    def log_tail(self, n: int = 4000) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode("utf-8", "replace")[-n:]
        except OSError:
            return "(no server log)"

    def wait_ready(self) -> None:
        startup = StartupLog(self.log_path)  # its progress to logging "agentcell"; a long start said on stderr
        try:
            self._wait_ready(startup)
        finally:
            startup.finish()
        first_use_notice(self.uplink)

    def _wait_ready(self, startup: StartupLog) -> None:
        transport = httpx.HTTPTransport(uds=self.socket)
        deadline = time.monotonic() + START_TIMEOUT_S
        delay = 0.01
        with httpx.Client(transport=transport, base_url="http://localhost", timeout=2) as client:
            while True:
                if self.proc.poll() is not None:
                    raise EmbeddedServerError(self._failure(f"exited with code {self.proc.returncode}"))
                if os.path.exists(self.socket):
                    try:
                        if client.get("/health").status_code < 500:
                            return
                    except httpx.TransportError:
                        pass
                # a server that keeps saying how far it is (a first start's build) gets more time
                deadline = max(deadline, startup.last_at + START_TIMEOUT_S)
                if time.monotonic() > deadline:
                    self.stop()
                    raise EmbeddedServerError(self._failure(f"did not answer within {START_TIMEOUT_S:.0f} s"))
                startup.poll()
                time.sleep(delay)
                delay = min(delay * 1.5, 0.1)

    def _failure(self, what: str) -> str:
        if hasattr(os, "geteuid") and os.geteuid() != 0:
            fix = ("As you are not root it ran rootless (docs/rootless.md): `agentcell doctor` says what this host "
                   "lacks for that. Or use a server run by root (the system service, or `sudo agentcell serve "
                   "--port 49982` with AGENTCELL_URL=http://127.0.0.1:49982 or api_url=).")
        else:
            fix = ("Start a server yourself to see the full error (`agentcell serve --port 49982`) and point the "
                   "SDK at it with AGENTCELL_URL=http://127.0.0.1:49982 or api_url=.")
        return f"the embedded agentcell server {what}. {fix}\n--- server log (tail) ---\n{self.log_tail()}"

    def stop(self) -> None:
        if os.getpid() != self.owner_pid:
            return  # a forked child must not stop its parent's server
        try:
            os.close(self._lifeline)
        except OSError:
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful: the server kills its sandboxes
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


_lock = threading.Lock()
_server: EmbeddedServer | None = None


def running_endpoint() -> Endpoint | None:
    s = _server
    return s.endpoint if s is not None and s.proc.poll() is None else None


def ensure_server() -> Endpoint:
    """The embedded server's endpoint, starting the server on first use (blocking, thread-safe)."""
    global _server
    s = _server
    if s is not None and s.proc.poll() is None:
        return s.endpoint
    with _lock:
        s = _server
        if s is not None and s.proc.poll() is None:
            return s.endpoint
        if s is not None:  # it died: report it once, then allow a fresh start
            _server = None
            s.stop()
            raise EmbeddedServerError(s._failure(f"stopped unexpectedly (exit code {s.proc.returncode})"))
        s = EmbeddedServer()
        try:
            s.wait_ready()
        except BaseException:
            s.stop()
            raise
        _server = s
        atexit.register(_stop_at_exit)
        return s.endpoint


def _stop_at_exit() -> None:
    global _server
    s, _server = _server, None
    if s is None:
        return
    from agentcell.sdk.fast_http import close_clients
    from agentcell.sdk.transport import close_sync_clients

    close_sync_clients()
    close_clients()
    s.stop()


def stop_server() -> None:
    """Stop the embedded server now (it is started again on the next use)."""
    _stop_at_exit()
