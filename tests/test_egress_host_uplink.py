"""`--egress-uplink host` (the production default), run where it cannot reach the real network: the
whole server runs inside a "fake host" network namespace whose only link leads to the tests' internet.

The server's router is linked to the fake host, which masquerades it out of its own interface, as a
real host would. The fake host's own services must stay out of the sandboxes' reach, and when the
server stops, the fake host's ruleset, forwarding switch and links are as they were.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from tests.conftest import REPO
from tests.egress_world import host_state as _host_state
from tests.test_egress import ADDRESSES, FORBIDDEN, HERE, PROBES, UPSTREAM_DNS, WEB

TAG = f"achost{os.getpid() % 100000}"
INET, FAKEHOST = f"{TAG}-inet", f"{TAG}-host"
HOST_ADDR, INET_ADDR = "192.0.2.100", "192.0.2.1"  # the fake host's link, inside these namespaces only

CLIENT = r'''
import json, sys
from agentcell import Sandbox
url, probes, checks = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
out = {}
with Sandbox.create(api_url=url) as sbx:
    sbx.run_code(probes)
    for expr in checks:
        ex = sbx.run_code(f"print({expr})")
        out[expr] = "".join(ex.logs.stdout).strip() if ex.error is None else f"error: {ex.error}"
print(json.dumps(out))
'''


def _in(ns: str, *cmd: str, **kw: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["nsenter", f"--net=/run/netns/{ns}", *cmd], capture_output=True, text=True, check=False,
                          **kw)  # type: ignore[call-overload]


def _state(ns: str) -> tuple[str, ...]:
    links = " ".join(line.split(":")[1].strip() for line in _in(ns, "ip", "-o", "link").stdout.splitlines())
    addrs = "".join(line for line in _in(ns, "ip", "-o", "addr").stdout.splitlines(True) if " fe80::" not in line)
    return (links, addrs, _in(ns, "ip", "-o", "route").stdout,
            _in(ns, "nft", "list", "ruleset").stdout, _in(ns, "sysctl", "-n", "net.ipv4.ip_forward").stdout)


@pytest.fixture(scope="module")
def fake_host() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    before = _host_state()
    procs: list[subprocess.Popen[str]] = []
    for ns in (INET, FAKEHOST):
        subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        inet, fake = ["ip", "-n", INET], ["ip", "-n", FAKEHOST]
        subprocess.run([*inet, "link", "set", "lo", "up"], check=True)
        subprocess.run([*fake, "link", "set", "lo", "up"], check=True)
        for addr in ADDRESSES:
            subprocess.run([*inet, "addr", "add", f"{addr}/32", "dev", "lo"], check=True)
        subprocess.run([*inet, "link", "add", "wan0", "type", "veth", "peer", "name", "eth0", "netns", FAKEHOST],
                       check=True)
        subprocess.run([*inet, "addr", "add", f"{INET_ADDR}/24", "dev", "wan0"], check=True)
        subprocess.run([*inet, "link", "set", "wan0", "up"], check=True)
        subprocess.run([*fake, "addr", "add", f"{HOST_ADDR}/24", "dev", "eth0"], check=True)
        subprocess.run([*fake, "link", "set", "eth0", "up"], check=True)
        subprocess.run([*fake, "route", "add", "default", "via", INET_ADDR], check=True)
        services = subprocess.Popen(["ip", "netns", "exec", INET, sys.executable, str(HERE / "internet_services.py"),
                                     *ADDRESSES], stdout=subprocess.PIPE, text=True)
        procs.append(services)
        assert services.stdout is not None and services.stdout.readline().strip() == "ready"
        # a service of the fake host itself, on all its addresses: no sandbox may reach it
        procs.append(subprocess.Popen(["nsenter", f"--net=/run/netns/{FAKEHOST}", sys.executable, "-m", "http.server",
                                       "8081", "--bind", "0.0.0.0"], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL, text=True))
        yield FAKEHOST
    finally:
        for p in procs:
            p.kill()
            p.wait()
        for ns in (INET, FAKEHOST):
            subprocess.run(["ip", "netns", "del", ns], check=False)
        assert _host_state() == before, "the host's network changed"


def test_host_uplink_masquerades_and_keeps_the_host_out(fake_host: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    before = _state(fake_host)
    notes = set(glob.glob("/run/agentcell/uplink-*"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # free in the host's namespace; the fake host's is empty anyway
    log = (tmp_path / "server.log").open("w")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("AGENTCELL_EGRESS_UPLINK", None)  # the production default: host
    server = subprocess.Popen(["nsenter", f"--net=/run/netns/{fake_host}", sys.executable, "-m", "agentcell.server",
                               "--port", str(port), "--egress-dns", UPSTREAM_DNS, "--standbys", "1"],
                              cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 90
        while _in(fake_host, sys.executable, "-c", f"import urllib.request; urllib.request.urlopen('{url}/health')",
                  ).returncode != 0:
            assert server.poll() is None, (tmp_path / "server.log").read_text()
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.3)
        during = _state(fake_host)
        assert "masquerade" in during[3] and during[4].strip() == "1"
        assert len(set(glob.glob("/run/agentcell/uplink-*")) - notes) == 1  # "forwarding was off", for a cleanup
        checks = [f"tcp('{WEB}')", "tcp('allowed.test')", f"tcp('{HOST_ADDR}', 8081)", f"tcp('{INET_ADDR}', 80)",
                  *(f"tcp('{a}')" for a in FORBIDDEN)]
        r = _in(fake_host, sys.executable, "-c", CLIENT, url, PROBES, json.dumps(checks), cwd=REPO, timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        got = json.loads(r.stdout.strip().splitlines()[-1])
        assert got[f"tcp('{WEB}')"] == "ok" and got["tcp('allowed.test')"] == "ok"
        assert got[f"tcp('{HOST_ADDR}', 8081)"] != "ok"  # the host itself, on its own address
        for a in FORBIDDEN:
            assert got[f"tcp('{a}')"] != "ok", a
        # the web service on the fake host's neighbour is public here (a documentation address): reachable
        assert got[f"tcp('{INET_ADDR}', 80)"] == "ok"
    finally:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        log.close()
    assert _state(fake_host) == before, "the server left changes in its host's network"
    assert set(glob.glob("/run/agentcell/uplink-*")) == notes
