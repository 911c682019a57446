"""Shared fixtures: one real agentcell server (linux backend) for the whole test session.

`server_url` starts `python -m agentcell.server` on a free 127.0.0.1 port in a subprocess (so a
misbehaving sandbox can never take pytest down with it; tests/servers.py) and yields its base URL. Set
AGENTCELL_TEST_SERVER_URL to run the tests against a server that is already running instead.
The server's log goes to `server_log` (printed when a test fails is up to the caller).
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcell import Sandbox
from tests.helpers import e2b_pointed_at
from tests.servers import ServerProcess

REPO = Path(__file__).resolve().parent.parent
# The network rule: no server the tests start (their own, embedded ones, the SDK's) may route sandbox
# traffic out of this machine. Tests of egress pass --egress-uplink netns:<a test's "internet"> instead.
os.environ["AGENTCELL_EGRESS_UPLINK"] = "none"
SERVER_ENV_CANARY = "canary-" + os.urandom(8).hex()
# The session server's backend: AGENTCELL_TEST_BACKEND=gvisor runs the suites against runsc sandboxes.
TEST_BACKEND = os.environ.get("AGENTCELL_TEST_BACKEND", "linux")
BACKEND_ARGS = ("--backend", TEST_BACKEND) if TEST_BACKEND != "linux" else ()
GVISOR = TEST_BACKEND == "gvisor"
# AGENTCELL_TEST_BACKEND=microvm: QEMU VMs, under TCG on hosts without usable KVM (this project's CI)
MICROVM = TEST_BACKEND == "microvm"
if MICROVM:
    BACKEND_ARGS += ("--accel", os.environ.get("AGENTCELL_MICROVM_ACCEL", "tcg"))
GUEST_KERNEL = GVISOR or MICROVM  # the sandbox runs on a kernel of its own, not the host's


@pytest.fixture(scope="session")
def server_log() -> Path:
    return Path(tempfile.gettempdir()) / f"agentcell-test-server-{os.getpid()}.log"


@pytest.fixture(scope="session")
def server(server_log: Path) -> Iterator[ServerProcess | None]:
    """The session's server; None when the tests run against AGENTCELL_TEST_SERVER_URL."""
    if os.environ.get("AGENTCELL_TEST_SERVER_URL"):
        yield None
        return
    # The canary stands for the secrets an operator's server environment holds (API keys, cloud
    # credentials); tests check that no sandbox can find it.
    # a microvm server boots and saves its template VM first (minutes under TCG on a loaded host)
    with ServerProcess(server_log, *BACKEND_ARGS, env={"AGENTCELL_TEST_CANARY": SERVER_ENV_CANARY},
                       start_timeout=900 if MICROVM else 90) as srv:
        yield srv


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
