"""record/report.py: each flag from the events that should raise it (and only those), citing them;
the tracking stays bounded whatever the record holds."""

from __future__ import annotations

import json
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
                     "sensitive-paths": [7], "crypto-mining": [8], "cpu-bound": [9],
                     "denied-egress": [1, 2], "credential-read": [7]}


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


SPECIALS = ("\x1b", "\x07", "\x9b", "\x7f", "\r", "\x00", "\u202e", "\u2066", "\u2028")


def test_the_text_report_escapes_every_value_from_the_record() -> None:
    """issue 25 #11: argv, paths, hosts, syscalls, limits and API actions full of terminal escapes and
    bidi overrides; none reaches the text raw, and the FLAGS section is still there to read."""
    evil = "\x1b[2J\x1b[H\x1b]0;owned\x07\u202e\x9b31m\r\x00\x7f\u2066\u2028"
    events = _events(
        {"kind": "process.exec", "pid": 5, "ppid": 1, "argv": ["xmrig", evil], "path": evil},
        {"kind": "process.exit", "pid": 5, "code": evil},
        {"kind": "file.write", "path": f"/home/user/.bashrc{evil}"},
        {"kind": "file.write", "path": "/home/user/.bashrc", "count": 1},
        {"kind": "file.create", "path": f"/tmp/{evil}"},
        {"kind": "dns.query", "domain": f"{evil}.example", "verdict": "denied", "rule": evil},
        {"kind": "net.deny", "dst": evil, "dport": 80, "rule": evil},
        {"kind": "deny.syscall", "syscall": evil, "nr": 1},
        {"kind": "deny.write", "path": evil, "reason": evil},
        {"kind": "limit.pids", "detail": evil},
        {"kind": "api.call", "source": "api", "action": evil},
    )
    rep = report.build(events, {"sandbox_id": evil, "dropped": evil})
    text = report.render(rep)
    assert not [c for c in SPECIALS if c in text], [c for c in SPECIALS if c in text]
    assert "\nFLAGS\n" in text and "persistence" in text and "crypto-mining" in text
    assert "\\x1b[2J" in text and "\\u202e" in text  # shown, escaped
    plain = json.loads(json.dumps(events).replace(json.dumps(evil)[1:-1], "x"))
    assert text.count("\n") == report.render(report.build(plain, {"sandbox_id": "x", "dropped": "x"})).count("\n")


def test_online_flags_merge_with_the_stored_events_flags() -> None:
    """The store's flags (raised on every event, stored or not) and the report's pass over what was
    stored: each flag once, citing both, counting what was not stored."""
    from agentcell.record.flags import FlagSet

    online = FlagSet()
    online.see({"kind": "process.exec", "pid": 3, "argv": ["./xmrig"], "time": 1000.0}, None)  # dropped
    online.see({"kind": "file.write", "path": "/home/user/.profile"}, 2)
    online.lost("per-sandbox cap")
    stored = _events({"kind": "deny.syscall", "syscall": "bpf"}, {"kind": "file.write", "path": "/home/user/.profile"})
    flags = {f["flag"]: f for f in report.build(stored, {"flags_seen": online.snapshot(1010.0)})["flags"]}
    assert flags["crypto-mining"]["events"] == [] and flags["crypto-mining"]["not_stored"] == 1
    assert flags["persistence"]["events"] == [2] and flags["persistence"]["count"] == 1
    assert flags["privilege-syscalls"]["events"] == [1]
    assert flags["record-incomplete"]["count"] == 1
    assert "flags_seen" not in report.build(stored, {"flags_seen": online.snapshot(None)})
