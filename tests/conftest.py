"""Shared fixtures: one real agentcell server (linux backend) for the whole test session.

`server_url` starts `python -m agentcell.server` on a free 127.0.0.1 port in a subprocess (so a
misbehaving sandbox can never take pytest down with it) and yields its base URL. Set
AGENTCELL_TEST_SERVER_URL to run the tests against a server that is already running instead.
The server's log goes to `server_log` (printed when a test fails is up to the caller).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentcell import Sandbox
from tests.helpers import e2b_pointed_at

REPO = Path(__file__).resolve().parent.parent
# The network rule: no server the tests start (their own, embedded ones, the SDK's) may route sandbox
# traffic out of this machine. Tests of egress pass --egress-uplink netns:<a test's "internet"> instead.
os.environ["AGENTCELL_EGRESS_UPLINK"] = "none"
SERVER_ENV_CANARY = "canary-" + os.urandom(8).hex()
# The session server's backend: AGENTCELL_TEST_BACKEND=gvisor runs the suites against runsc sandboxes.
TEST_BACKEND = os.environ.get("AGENTCELL_TEST_BACKEND", "linux")
BACKEND_ARGS = ("--backend", TEST_BACKEND) if TEST_BACKEND != "linux" else ()
GVISOR = TEST_BACKEND == "gvisor"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server_log() -> Path:
    return Path(tempfile.gettempdir()) / f"agentcell-test-server-{os.getpid()}.log"


class ServerProcess:
    """A real `python -m agentcell.server` on a free loopback port, for tests that need one of their own."""

    def __init__(self, log_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = log_path.open("wb")
        if "--state-dir" not in args:  # its snapshots and paused sandboxes' files: its own, gone with the test run
            args = ("--state-dir", tempfile.mkdtemp(prefix="agentcell-state-"), *args)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agentcell.server", "--host", "127.0.0.1", "--port", str(self.port), *args],
            cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                httpx.get(f"{self.url}/health", timeout=1)
                return
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start:\n{self.log()[-4000:]}") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@pytest.fixture(scope="session")
def server(server_log: Path) -> Iterator[ServerProcess | None]:
    """The session's server; None when the tests run against AGENTCELL_TEST_SERVER_URL."""
    if os.environ.get("AGENTCELL_TEST_SERVER_URL"):
        yield None
        return
    # The canary stands for the secrets an operator's server environment holds (API keys, cloud
    # credentials); tests check that no sandbox can find it.
    srv = ServerProcess(server_log, *BACKEND_ARGS, env={"AGENTCELL_TEST_CANARY": SERVER_ENV_CANARY})
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="session")
def server_url(server: ServerProcess | None) -> str:
    external = os.environ.get("AGENTCELL_TEST_SERVER_URL")
    if external:
        return external.rstrip("/")
    assert server is not None
    return server.url


@pytest.fixture(scope="module")
def neighbour(server_url: str) -> Iterator[Sandbox]:
    """A sandbox created before a module's attacks, holding state they must not disturb."""
    sbx = Sandbox.create(api_url=server_url, timeout=900)
    sbx.run_code("canary = 'alive'")
    yield sbx
    sbx.kill()


@pytest.fixture(scope="session")
def e2b_env(server_url: str) -> Iterator[str]:
    """Point the official e2b SDKs at the server (both planes on one URL); yields the URL."""
    with e2b_pointed_at(server_url):
        yield server_url


@pytest.fixture
def host_secret() -> Iterator[Path]:
    """A file on the host, outside any sandbox, in two places an attacker would look."""
    token = uuid.uuid4().hex
    paths = [Path(f"/root/agentcell-secret-{token}"), Path(f"/tmp/agentcell-secret-{token}")]
    for p in paths:
        p.write_text(token)
    yield paths[1]
    for p in paths:
        p.unlink(missing_ok=True)
