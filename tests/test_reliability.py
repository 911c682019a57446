"""The soak and chaos scripts' short versions (benchmarks/soak.py, benchmarks/chaos.py): a few minutes of
mixed traffic that must leave every host count back at its baseline, and the faults that CI can afford,
each asserting what survives. The long runs and the figures are in docs/reliability.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="soak.py and chaos.py start root servers")


def _run(script: str, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_a_short_soak_leaves_nothing_behind(tmp_path: Path) -> None:
    proc = _run("soak.py", "--minutes", "1.5", "--warmup", "30", "--rate", "24", "--burst", "4",
                "--burst-every", "40", "--concurrency", "4", "--sample", "15", "--window", "45",
                "--out", str(tmp_path), timeout=900)
    assert proc.returncode == 0 and "soak: PASS" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-3000:]
    for kind in ("code", "commands", "files", "pause", "network"):
        assert f"  {kind:<10}" in proc.stdout
    assert (tmp_path / "soak.png").stat().st_size > 10_000  # the plot was drawn


def test_a_server_killed_mid_burst_loses_nothing_it_kept(tmp_path: Path) -> None:
    proc = _run("chaos.py", "--only", "server-kill9", timeout=900)
    assert proc.returncode == 0 and "PASS server-kill9" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-3000:]
