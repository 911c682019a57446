"""benchmarks/side_by_side.py end to end with tiny counts: every contender answers and every figure is filled."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_side_by_side_runs_with_tiny_counts(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "side_by_side.py"), "--runs", "2", "--burst", "3",
         "--burst-rounds", "1", "--sizes", "2", "--seed", "1", "--json", str(out)],
        capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "vs fork-ns" in proc.stdout
    data = json.loads(out.read_text())
    contenders = set(data["contenders"])
    assert {"agentcell-embedded", "agentcell-tcp", "fork", "fork-ns"} <= contenders
    for label in ("create -> 1+1", "burst 3: wall", "burst 3: each", "run_code 1+1", "commands.run true"):
        figure = data["figures"][label]
        assert not figure["errors"], (label, figure["errors"])
        for name in contenders:
            assert figure["cells"][name]["n"] >= 1, (label, name)
    memory = data["figures"]["idle PSS/sandbox @2"]["cells"]
    for name in ("agentcell-tcp", "fork", "fork-ns"):
        assert memory[name]["p50"] > 0, (name, memory[name])


def test_lifecycle_benchmark_runs_with_tiny_counts() -> None:
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "lifecycle.py"), "--runs", "2", "--idle", "2", "--disk-mib", "1"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    for row in ("pause (SDK", "baseline: freezer write alone", "create_snapshot(mode=filesystem)",
                "create from snapshot", "paused"):
        assert row in proc.stdout, (row, proc.stdout)


def test_record_overhead_benchmark_runs_with_tiny_counts() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "record_overhead.py"), "--runs", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("| overhead") == 3 and "events recorded for one build" in proc.stdout


def test_egress_hardening_benchmark_runs_with_tiny_counts() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "egress_hardening.py"), "--runs", "3",
                           "--megabytes", "5", "--rounds", "1", "--flood-s", "2"],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for row in ("create -> first result", "kernel (no interception)", "proxy, plain HTTP", "proxy, HTTPS with a secret",
                "connections tried"):
        assert row in proc.stdout, (row, proc.stdout)


def test_startup_benchmark_runs_once() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "startup.py"), "--runs", "1", "--skip-embedded"],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for row in ("serve, first start: to first sandbox", "serve, warm start: to first sandbox"):
        assert row in proc.stdout, (row, proc.stdout)
    assert "runtime store: building /opt/agentcell/venv" in proc.stdout  # the first start's progress, shown
    for target in ("≤ 10 s", "≤ 2 s"):  # the targets, printed next to the figures
        assert target in proc.stdout, (target, proc.stdout)


def test_report_benchmark_runs_with_tiny_counts() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "report.py"), "--events", "2000", "--rounds", "1"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for row in ("build (JSON report)", "text render", "HTML render", "reverse-shell (critical)"):
        assert row in proc.stdout, (row, proc.stdout)


def test_mcp_benchmark_runs_with_tiny_counts() -> None:
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "mcp.py"), "--runs", "3"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    for row in ("SDK run_code (TCP)", "MCP stdio", "MCP HTTP (/mcp of serve)", "MCP HTTP (agentcell mcp --http)"):
        assert row in proc.stdout, (row, proc.stdout)
