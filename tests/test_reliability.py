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


def _run(script: str, *args: str, timeout: float, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / script), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})


def test_a_short_soak_leaves_nothing_behind(tmp_path: Path) -> None:
    proc = _run("soak.py", "--minutes", "1.5", "--warmup", "30", "--rate", "24", "--burst", "4",
                "--burst-every", "40", "--concurrency", "4", "--sample", "15", "--window", "45",
                "--out", str(tmp_path), timeout=900)
    assert proc.returncode == 0 and "soak: PASS" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-3000:]
    for kind in ("code", "commands", "files", "pause", "network"):
        assert f"  {kind:<10}" in proc.stdout
    assert (tmp_path / "soak.png").stat().st_size > 10_000  # the plot was drawn


@pytest.mark.parametrize("fault", ["server-kill9", "disk-full", "clock-step", "power-cut", "runsc-kill9"])
def test_a_fault_leaves_what_it_must(fault: str) -> None:
    """kill -9 of the server mid-burst (paused sandboxes, snapshots, volumes and records survive; the
    sandboxes that died with it are reported ended), a full state disk (507, nothing torn), a step of
    the host's clock (timeouts count real time), a power cut at a few steps of a pause to disk and of a
    snapshot (the state dir on a filesystem that keeps only what was fsynced; the script's own run cuts at
    every step), a gvisor sandbox's runsc killed (it is reported ended, its neighbours run on): each with
    the host's counts back at baseline after.
    benchmarks/chaos.py runs these and the other faults (the zygote's, the record's and the egress
    process's kill -9, memory pressure, a cell lost behind the gateway, the ceiling held)."""
    proc = _run("chaos.py", "--only", fault, timeout=900, CHAOS_POWER_CUT_POINTS="5")
    assert proc.returncode == 0 and f"PASS {fault}" in proc.stdout, proc.stdout[-6000:] + proc.stderr[-3000:]
