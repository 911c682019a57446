"""record/report.py: each flag from the events that should raise it (and only those), citing them;
the tracking stays bounded whatever the record holds."""

from __future__ import annotations

from typing import Any

from agentcell.record import report


def _events(*specs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"time": 1000.0 + i, "source": "host", "pid": None, "ppid": None, "seq": i + 1, **s}
            for i, s in enumerate(specs)]


def _flags(events: list[dict[str, Any]], summary: dict[str, Any] | None = None) -> dict[str, list[int]]:
    return {f["flag"]: f["events"] for f in report.build(events, summary)["flags"]}


def test_an_ordinary_session_raises_no_flag() -> None:
    events = _events(
        {"kind": "process.exec", "pid": 5, "ppid": 1, "argv": ["python3", "train.py"]},
        {"kind": "file.write", "path": "/home/user/out.csv", "size": 10, "count": 3},
        {"kind": "dns.query", "domain": "pypi.org", "answers": ["151.101.0.223"], "verdict": "allowed"},
        {"kind": "net.connect", "dst": "151.101.0.223", "dport": 443, "domain": "pypi.org", "state": "open"},
        {"kind": "process.exit", "pid": 5, "code": 0},
        {"kind": "api.call", "source": "api", "action": "run_code"},
    )
    rep = report.build(events)
    assert rep["flags"] == []
    assert rep["processes"][0]["exit"] == 0 and rep["api_calls"] == {"run_code": 1}
    assert rep["files"][0]["ops"] == {"write": 3}


def test_each_flag_cites_its_events() -> None:
    events = _events(
        {"kind": "net.deny", "dst": "169.254.169.254", "dport": 80, "rule": "never4"},  # 1
        {"kind": "net.deny", "dst": "10.0.0.1", "dport": 22, "rule": "never4"},  # 2
        {"kind": "deny.syscall", "syscall": "unshare", "nr": 272},  # 3
        {"kind": "deny.syscall", "syscall": "getrandom", "nr": 318},  # 4: not a privilege syscall
        {"kind": "file.create", "path": "/home/user/.bashrc"},  # 5
        {"kind": "file.write", "path": "/home/user/notes.txt"},  # 6
        {"kind": "deny.access", "path": "/root/.ssh/id_rsa", "errno": 13},  # 7
        {"kind": "process.exec", "pid": 9, "ppid": 1, "argv": ["./xmrig", "-o", "stratum+tcp://pool:3333"]},  # 8
        {"kind": "limit.cpu", "throttled_s": 8.0, "streak": 3},  # 9
    )
    flags = _flags(events)
    assert flags == {"cloud-metadata": [1], "host-or-lan": [2], "privilege-syscalls": [3], "persistence": [5],
                     "sensitive-paths": [7], "crypto-mining": [8], "cpu-bound": [9]}


def test_scans_and_processes_left_behind() -> None:
    probes = [{"kind": "net.deny", "dst": "203.0.113.7", "dport": port, "rule": "policy"} for port in range(1, 26)]
    assert "scanning" in _flags(_events(*probes))
    assert "scanning" not in _flags(_events(*probes[:5]))
    hosts = [{"kind": "net.connect", "dst": f"198.51.100.{i}", "dport": 443, "state": "open"} for i in range(25)]
    assert "scanning" in _flags(_events(*hosts))
    long = _events({"kind": "process.exec", "pid": 7, "ppid": 1, "argv": ["sleep", "1000"]},
                   {"kind": "api.call", "source": "api", "action": "run_code"})
    assert _flags(long, {"ended": 1000.0 + 120})["left-running"] == [1]
    assert "left-running" not in _flags(long, {"ended": 1000.0 + 10})  # short: not "left behind"
    exited = [*long, {"kind": "process.exit", "pid": 7, "code": 0, "time": 1100.0, "seq": 3, "source": "host"}]
    assert "left-running" not in _flags(exited, {"ended": 1000.0 + 120})


def test_an_exec_without_fork_ends_the_previous_program() -> None:
    events = _events({"kind": "process.exec", "pid": 4, "ppid": 1, "argv": ["bash", "-c", "exec python3"]},
                     {"kind": "process.exec", "pid": 4, "ppid": 1, "argv": ["python3"]},
                     {"kind": "process.exit", "pid": 4, "signal": 9})
    procs = report.build(events)["processes"]
    assert [p["exit"] for p in procs] == ["exec", 9]
    assert "exec'd a new program" in report.render(report.build(events))


def test_tracking_is_bounded() -> None:
    many = ({"kind": "file.create", "path": f"/tmp/f{i}", "time": float(i), "seq": i + 1, "source": "host"}
            for i in range(3 * report.MAX_TRACKED))
    rep = report.build(many)
    assert rep["counts"]["file.create"] == 3 * report.MAX_TRACKED
    assert len(rep["files"]) <= report.MAX_LISTED * 4
    text = report.render(rep)
    assert len(text) < 20_000
