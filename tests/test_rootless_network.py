"""Rootless mode with internet: the egress router's uplink is user-mode networking (slirp4netns,
network/usermode.py), and the sandboxes' traffic obeys the same policy as a root server's.

The whole rootless server runs, as an ordinary user made by the test, inside a network namespace the
test made: a stand-in for the user's host whose only links are loopback and a veth into the tests'
internet (tests/internet_services.py on tests/egress_internet.py's documentation and forbidden
addresses), every other destination unreachable. slirp4netns opens its sockets there, never in the
host's namespace. That namespace's /dev/net/tun is a 0666 node the test bind-mounts in `ip netns
exec`'s own mount namespace (udev's default mode; this machine's is root's alone), so the host's is
unchanged. The sandboxes are driven by a client inside the stand-in (the server's port is there).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from agentcell.network import netns_files
from tests.egress_internet import ADDRESSES, DENIED_IP, FORBIDDEN, OTHER, PROBES, UPSTREAM_DNS, WEB
from tests.egress_world import host_state, netns_service
from tests.ordinary_user import OrdinaryUser, ordinary_user, user_venv  # noqa: F401
from tests.servers import ServerProcess

pytestmark = pytest.mark.skipif(shutil.which("newuidmap") is None or shutil.which("slirp4netns") is None,
                                reason="needs newuidmap (apt-get install uidmap) and slirp4netns")
HERE = Path(__file__).resolve().parent
TAG = f"acrlnet{os.getpid() % 100000}"
STANDIN, INET = f"{TAG}-host", f"{TAG}-inet"
LINK_HOST, LINK_INET = "192.0.2.2", "192.0.2.1"  # the stand-in's veth into the internet (documentation range)
PORT = 8099  # the server's, on the stand-in's loopback
RUNNING: dict[str, Any] = {}  # the answers fixture's server (Popen) and what starting another one takes

# What the client (in the stand-in namespace) does: sandboxes with four policies, each asked `exprs`.
CLIENT = r'''
import json, sys, time, httpx
from agentcell.sdk import Sandbox
url, probes, cases = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
deadline = time.monotonic() + 240  # the first start builds the user's runtime store
while True:
    try:
        if httpx.get(url + "/health", timeout=1).status_code == 200:
            break
    except httpx.TransportError:
        pass
    if time.monotonic() > deadline:
        sys.exit("the rootless server did not answer")
    time.sleep(0.3)
out = {}
for name, (kwargs, exprs) in cases.items():
    sbx = Sandbox.create(api_url=url, timeout=300, **kwargs)
    try:
        ex = sbx.run_code(probes)
        assert ex.error is None, ex.error
        answers = {}
        for expr in exprs:
            t = time.monotonic()
            ex = sbx.run_code(f"print({expr})")
            answers[expr] = "".join(ex.logs.stdout).strip() if ex.error is None else repr(ex.error)
            answers["seconds " + expr] = round(time.monotonic() - t, 3)
        answers["interfaces"] = sbx.commands.run("cat /proc/net/dev", timeout=30).stdout
        out[name] = answers
    finally:
        sbx.kill()
print(json.dumps(out))
'''

HUNDRED = f"sum(tcp('{WEB}') == 'ok' for _ in range(100))"  # 100 HTTP exchanges, one connection each
SLIRP_SIDE = ("100.127.0.2", "100.127.0.3")  # slirp4netns' gateway (the user's host) and its DNS
CASES: dict[str, tuple[dict[str, Any], list[str]]] = {
    "open": ({"allow_internet_access": True},
             [f"tcp('{WEB}')", "tcp('allowed.test')", "get('http://other.test/')",
              *(f"tcp('{a}')" for a in FORBIDDEN), *(f"tcp('{a}')" for a in SLIRP_SIDE),
              f"tcp('{SLIRP_SIDE[0]}', {PORT})", f"dns_udp('{UPSTREAM_DNS}')", "names('rebind.test')", HUNDRED]),
    "allow_list": ({"network": {"allow_out": ["allowed.test"]}},
                   ["tcp('allowed.test')", f"tcp('{OTHER}')", "names('other.test')"]),
    "deny_list": ({"network": {"deny_out": [DENIED_IP]}}, [f"tcp('{DENIED_IP}')", f"tcp('{WEB}')"]),
    "offline": ({"allow_internet_access": False}, [f"tcp('{WEB}')", "names('allowed.test')"]),
}


def _ip(ns: str, *args: str) -> None:
    subprocess.run(["ip", "-n", ns, *args], check=True)


def _standin_state() -> str:
    return "\n".join(subprocess.run(["ip", "-n", STANDIN, "-o", *what], capture_output=True, text=True).stdout
                     for what in (["link"], ["-4", "addr"], ["route"]))  # (IPv6 link-local addresses age)


def _serve_in_standin(user: OrdinaryUser, tun: str, port: int, log_path: Path) -> ServerProcess:
    """The user's rootless server (with user-mode networking: the default uplink) inside the stand-in;
    not waited for."""
    return ServerProcess(
        log_path, "--standbys", "1", "--max-sandboxes", "8", "--egress-dns", UPSTREAM_DNS,
        command=["ip", "netns", "exec", STANDIN, "sh", "-c",
                 'mount --bind "$0" /dev/net/tun && u=$1 g=$2 && shift 2 && '
                 'exec setpriv --reuid "$u" --regid "$g" --clear-groups -- "$@"',
                 tun, str(user.uid), str(user.gid), user.python, "-m", "agentcell.server"],
        port=port, host=None, own_state_dir=False, base_env=user.env(),
        env={"AGENTCELL_EGRESS_UPLINK": None},  # the default: host
        cwd=user.home, stop_timeout=30)


def _tun_mode() -> str:
    return oct(os.stat("/dev/net/tun").st_mode) if os.path.exists("/dev/net/tun") else "absent"


@pytest.fixture(scope="module")
def answers(ordinary_user: OrdinaryUser) -> Iterator[tuple[dict[str, dict[str, str]], str, str]]:  # noqa: F811
    """(the client's answers per case, the server's log, the stand-in's links/addresses/routes before)."""
    user = ordinary_user
    before, tun_mode = host_state(), _tun_mode()
    server = None
    services = contextlib.ExitStack()  # the internet's services
    tun_dir = tempfile.mkdtemp(prefix="agentcell-tun-")
    for ns in (STANDIN, INET):
        subprocess.run(["ip", "netns", "add", ns], check=True)
        _ip(ns, "link", "set", "lo", "up")
    try:
        # the stand-in: loopback, a veth into the internet, routes to the internet's addresses (the forbidden
        # ones too: a refusal then proves a rule, not a missing route), every other destination unreachable
        _ip(STANDIN, "link", "add", "wan0", "type", "veth", "peer", "name", "isp0", "netns", INET)
        _ip(STANDIN, "addr", "add", f"{LINK_HOST}/24", "dev", "wan0")
        _ip(STANDIN, "link", "set", "wan0", "up")
        _ip(INET, "addr", "add", f"{LINK_INET}/24", "dev", "isp0")
        _ip(INET, "link", "set", "isp0", "up")
        for addr in ADDRESSES:
            _ip(INET, "addr", "add", f"{addr}/32", "dev", "lo")
            _ip(STANDIN, "route", "add", f"{addr}/32", "via", LINK_INET)
        _ip(STANDIN, "route", "add", "unreachable", "default")
        services.enter_context(netns_service(INET, HERE / "internet_services.py", *ADDRESSES))
        standin_before = _standin_state()
        tun = os.path.join(tun_dir, "tun")
        os.mknod(tun, 0o666 | 0o020000, os.makedev(10, 200))
        os.chmod(tun, 0o666)
        os.chmod(tun_dir, 0o755)
        # the server in the stand-in, as the user (root mounts the node first); the client there waits for it
        server = _serve_in_standin(user, tun, PORT, Path(user.home, "server-net.log"))
        RUNNING.update(server=server.proc, tun=tun, user=user)
        client = subprocess.run(["ip", "netns", "exec", STANDIN, sys.executable, "-c", CLIENT,
                                 server.url, PROBES, json.dumps(CASES)],
                                capture_output=True, text=True, timeout=900, cwd=str(HERE.parent))
        log_text = server.log()
        assert client.returncode == 0, f"{client.stderr[-3000:]}\n--- server log:\n{log_text[-4000:]}"
        yield json.loads(client.stdout.splitlines()[-1]), log_text, standin_before
    finally:
        if server is not None:
            server.stop()
        services.close()
        for ns in (STANDIN, INET):
            subprocess.run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(tun_dir, ignore_errors=True)
        assert host_state() == before, "the host's network changed"
        assert _tun_mode() == tun_mode, "the host's /dev/net/tun changed"


def test_the_server_says_it_uses_user_mode_networking(answers: tuple[dict[str, dict[str, str]], str, str]) -> None:
    _, log, standin_before = answers
    assert "rootless mode" in log and "user-mode networking (slirp4netns)" in log
    # slirp4netns added nothing to the namespace it runs in: its TAP is in the router's namespace
    assert _standin_state() == standin_before


def test_an_open_sandbox_reaches_the_internet_and_nothing_private(
        answers: tuple[dict[str, dict[str, str]], str, str]) -> None:
    got = answers[0]["open"]
    assert got[f"tcp('{WEB}')"] == "ok"
    assert got["tcp('allowed.test')"] == "ok"  # through the router's resolver, upstream through slirp4netns
    assert got["get('http://other.test/')"].startswith(f"hello from {OTHER} host=other.test")
    for addr in FORBIDDEN:  # private, CGNAT, link-local, metadata: routed in the stand-in, refused by policy
        assert got[f"tcp('{addr}')"] != "ok", addr
    for addr in SLIRP_SIDE:  # slirp4netns' gateway (the user's host) and its DNS
        assert got[f"tcp('{addr}')"] != "ok", addr
    assert got[f"tcp('{SLIRP_SIDE[0]}', {PORT})"] != "ok"  # the server's own port on the host's loopback
    assert got[f"dns_udp('{UPSTREAM_DNS}')"] != "ok"  # only the router's resolver
    assert got["names('rebind.test')"] == "noname"  # a private answer: dropped
    assert "eth0" in got["interfaces"]
    assert got[HUNDRED] == "100"
    print(f"100 connections with an HTTP exchange each, through slirp4netns: {got['seconds ' + HUNDRED]} s")


def test_policies_hold(answers: tuple[dict[str, dict[str, str]], str, str]) -> None:
    got = answers[0]
    assert got["allow_list"]["tcp('allowed.test')"] == "ok"
    assert got["allow_list"][f"tcp('{OTHER}')"] != "ok"
    assert got["allow_list"]["names('other.test')"] == "noname"
    assert got["deny_list"][f"tcp('{DENIED_IP}')"] != "ok"
    assert got["deny_list"][f"tcp('{WEB}')"] == "ok"


def test_a_sandbox_without_internet_reaches_nothing(answers: tuple[dict[str, dict[str, str]], str, str]) -> None:
    got = answers[0]["offline"]
    assert got[f"tcp('{WEB}')"] != "ok"
    assert got["names('allowed.test')"] == "noname"


def _netns_files(user: OrdinaryUser) -> list[str]:
    return sorted(os.listdir(os.path.join(user.home, ".cache", "agentcell", "netns")))


def test_a_killed_servers_netns_file_goes_at_the_next_start(answers: tuple[dict[str, dict[str, str]], str, str]) -> None:
    """Last in this module (it ends the server): a server killed outright leaves the empty file its router
    namespace was mounted on; the next server removes it at its start, and its own at its end."""
    user, server = RUNNING["user"], RUNNING["server"]
    (mine,) = _netns_files(user)
    assert os.path.getsize(os.path.join(user.home, ".cache", "agentcell", "netns", mine)) == 0
    server.kill()  # SIGKILL: no cleanup runs
    server.wait()
    assert _netns_files(user) == [mine]  # the leftover
    again = _serve_in_standin(user, RUNNING["tun"], PORT + 1, Path(user.home, "server-net-2.log")).proc
    log_path = os.path.join(user.home, "server-net-2.log")
    try:
        deadline = time.monotonic() + 240
        while not (files := _netns_files(user)) or mine in files:  # its router is made after the sweep
            assert again.poll() is None and time.monotonic() < deadline, Path(log_path).read_text()[-3000:]
            time.sleep(0.3)
        (theirs,) = files
        assert theirs != mine
        again.send_signal(signal.SIGTERM)
        assert again.wait(60) == 0, Path(log_path).read_text()[-3000:]
        assert _netns_files(user) == []
    finally:
        if again.poll() is None:
            again.kill()
            again.wait()


def test_netns_files_nobody_holds_are_removed_held_ones_kept(tmp_path: Path) -> None:
    d = tmp_path
    for name in ("agentcell-dead", "agentcell-held-elsewhere", "agentcell-not-empty", "something-else"):
        (d / name).write_bytes(b"x" if name == "agentcell-not-empty" else b"")
    mine = netns_files.claim(str(d / "agentcell-mine"))  # this process's own hold counts too
    holder = subprocess.Popen(["flock", "--exclusive", "--close", str(d / "agentcell-held-elsewhere"), "sleep", "120"])
    try:
        deadline = time.monotonic() + 10
        while subprocess.run(["flock", "--nonblock", str(d / "agentcell-held-elsewhere"), "true"]).returncode == 0:
            assert time.monotonic() < deadline, "flock(1) did not take its lock"
            time.sleep(0.05)
        assert netns_files.remove_stale(str(d), "agentcell-") == ["agentcell-dead"]
        assert sorted(os.listdir(d)) == ["agentcell-held-elsewhere", "agentcell-mine", "agentcell-not-empty",
                                         "something-else"]
        with pytest.raises(BlockingIOError):
            netns_files.claim(str(d / "agentcell-mine"))
    finally:
        holder.kill()
        holder.wait()
    os.close(mine)
    assert netns_files.remove_stale(str(d), "agentcell-") == ["agentcell-held-elsewhere", "agentcell-mine"]
    assert sorted(os.listdir(d)) == ["agentcell-not-empty", "something-else"]
