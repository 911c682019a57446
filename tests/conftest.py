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
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parent.parent
SERVER_ENV_CANARY = "canary-" + os.urandom(8).hex()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def server_log() -> Path:
    return Path(tempfile.gettempdir()) / f"agentcell-test-server-{os.getpid()}.log"


@pytest.fixture(scope="session")
def server_url(server_log: Path) -> Iterator[str]:
    external = os.environ.get("AGENTCELL_TEST_SERVER_URL")
    if external:
        yield external.rstrip("/")
        return
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = server_log.open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentcell.server", "--host", "127.0.0.1", "--port", str(port)],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        # The canary stands for the secrets an operator's server environment holds (API keys,
        # cloud credentials); tests check that no sandbox can find it.
        env={**os.environ, "PYTHONUNBUFFERED": "1", "AGENTCELL_TEST_CANARY": SERVER_ENV_CANARY},
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{server_log.read_text()[-4000:]}")
            try:
                httpx.get(f"{url}/sandboxes", timeout=1)
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the server did not start:\n{server_log.read_text()[-4000:]}") from None
                time.sleep(0.1)
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def e2b_env(server_url: str) -> Iterator[str]:
    """Point the official e2b SDKs at the server (both planes on one URL); yields the URL."""
    values = {"E2B_API_URL": server_url, "E2B_SANDBOX_URL": server_url, "E2B_API_KEY": "e2b_test_key"}
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    os.environ.pop("E2B_DEBUG", None)
    try:
        yield server_url
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
