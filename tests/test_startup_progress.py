"""A cold start is not silent: `agentcell serve` prints progress lines (server/progress.py) while it
builds its runtime store, and the embedded SDK passes them to Python logging and says a long start once
on stderr (sdk/startup_log.py). Real servers on an empty runtime store (AGENTCELL_RUNTIME_STORE in a
directory of the test's), nothing leaving the machine (--egress-uplink none)."""

from __future__ import annotations

import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentcell.sdk import startup_log
from tests.servers import SERVE, ServerProcess

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the server needs root")


@pytest.fixture
def fresh_store() -> Iterator[dict[str, str]]:
    """The environment of a first start after an install: an empty runtime store and tracer cache."""
    base = Path(f"/var/lib/agentcell-test-progress-{os.getpid()}")
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(mode=0o700)
    env = {**os.environ, "AGENTCELL_RUNTIME_STORE": str(base / "runtime"), "AGENTCELL_BPF_CACHE": str(base / "bpf"),
           "AGENTCELL_EGRESS_UPLINK": "none", "PYTHONPATH": str(REPO)}
    env.pop("AGENTCELL_URL", None)
    try:
        yield env
    finally:
        shutil.rmtree(base, ignore_errors=True)


# the server's log line: `<time> INFO    agentcell.progress: <message>` (agentcell/logs.py)
_LINE = r"^\S+ INFO +agentcell\.progress: "
PROGRESS = re.compile(_LINE + r"runtime store: building /opt/agentcell/venv from \S+: [\d,]+/[\d,]+ files "
                      r"\(\d+ %\), [\d.]+ s$", re.M)
DONE = re.compile(_LINE + r"runtime store: building /opt/agentcell/venv from \S+: done in [\d.]+ s", re.M)


def test_serve_says_what_a_cold_start_waits_for(fresh_store: dict[str, str], tmp_path: Path) -> None:
    # its stderr alone in the log (the progress lines are log lines)
    srv = ServerProcess(tmp_path / "stderr.log", "--state-dir", str(tmp_path / "state"), "--standbys", "0",
                        command=SERVE, uds=str(tmp_path / "s.sock"), base_env=fresh_store, stdout_to_log=False,
                        ready_status=200, start_timeout=300)
    try:
        srv.wait_ready()
    finally:
        srv.stop(60, or_kill=False)
    err = srv.log()
    assert PROGRESS.search(err), err[-3000:]  # what, how far, how long
    assert DONE.search(err), err[-3000:]
    assert re.search(_LINE + r"runtime store: built /opt/agentcell/venv .* "
                     r"in [\d.]+ s: [\d,]+ files", err, re.M), err[-3000:]


EMBEDDED = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(name)s | %(message)s")
from agentcell import Sandbox
with Sandbox.create() as sbx:
    assert sbx.run_code("1+1").text == "2"
print("CREATED")
"""


def test_embedded_sdk_logs_the_progress_and_says_a_long_start_once(fresh_store: dict[str, str]) -> None:
    home = tempfile.mkdtemp()
    try:
        done = subprocess.run([sys.executable, "-c", EMBEDDED], env={**fresh_store, "HOME": home}, capture_output=True,
                              text=True, timeout=600, cwd=home)
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert done.returncode == 0 and "CREATED" in done.stdout, done.stderr[-3000:]
    logged = [line for line in done.stdout.splitlines() if line.startswith("LOG agentcell | ")]
    assert any(re.search(r"runtime store: building /opt/agentcell/venv .*\(\d+ %\)", line) for line in logged), logged
    assert any("runtime store: built /opt/agentcell/venv" in line for line in logged), logged
    notices = [line for line in done.stderr.splitlines() if line.startswith("agentcell: starting the local sandbox server")]
    assert len(notices) == 1, done.stderr[-3000:]
    assert "Progress goes to the Python logger 'agentcell'" in notices[0]


def test_the_egress_default_is_said_once_per_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    first, second = io.StringIO(), io.StringIO()
    assert startup_log.first_use_notice("host", first)
    assert not startup_log.first_use_notice("host", second)
    assert "out through this host" in first.getvalue() and "AGENTCELL_EGRESS_UPLINK=none" in first.getvalue()
    assert second.getvalue() == ""
    assert not startup_log.first_use_notice("none", second)  # no uplink: nothing to say
