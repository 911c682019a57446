"""`--egress-uplink host` (the production default), run where it cannot reach the real network: the
whole server runs inside a "fake host" network namespace whose only link leads to the tests' internet.

The server's router is linked to the fake host, which masquerades it out of its own interface, as a
real host would. The fake host's own services must stay out of the sandboxes' reach, and when the
server stops, the fake host's ruleset, forwarding switch and links are as they were.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.egress_world import host_state as _host_state
from tests.egress_world import netns_service
from tests.servers import ServerProcess, free_port
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
    procs = contextlib.ExitStack()  # the internet's services and the fake host's own
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
        procs.enter_context(netns_service(INET, HERE / "internet_services.py", *ADDRESSES))
        # a service of the fake host itself, on all its addresses: no sandbox may reach it
        fake_service = subprocess.Popen(["nsenter", f"--net=/run/netns/{FAKEHOST}", sys.executable, "-m", "http.server",
                                         "8081", "--bind", "0.0.0.0"], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, text=True)
        procs.callback(fake_service.wait)
        procs.callback(fake_service.kill)
        yield FAKEHOST
    finally:
        procs.close()
        for ns in (INET, FAKEHOST):
            subprocess.run(["ip", "netns", "del", ns], check=False)
        assert _host_state() == before, "the host's network changed"


class HostModeServer(ServerProcess):
    """A real server with the production default uplink (host), run inside the stand-in host `fake_host`,
    with a --state-dir of its own under `tmp`."""

    def __init__(self, fake_host: str, tmp: Path, *args: str) -> None:
        self.fake_host = fake_host
        port = free_port()  # free in the host's namespace; the fake host's is empty anyway
        super().__init__(tmp / f"server-{port}.log", "--egress-dns", UPSTREAM_DNS, "--standbys", "1", "--state-dir",
                         str(tmp / f"state-{port}"), *args, port=port, host=None,
                         command=["nsenter", f"--net=/run/netns/{fake_host}", sys.executable, "-m", "agentcell.server"],
                         env={"AGENTCELL_EGRESS_UPLINK": None},  # the production default: host
                         stop_timeout=30)

    def answers(self) -> bool:
        """Asked from inside the fake host (the server's port is there)."""
        return _in(self.fake_host, sys.executable, "-c",
                   f"import urllib.request; urllib.request.urlopen('{self.url}/health')").returncode == 0

    def probe(self, checks: list[str]) -> dict[str, str]:
        """`checks` (expressions of PROBES) evaluated in a new sandbox of this server."""
        r = _in(self.fake_host, sys.executable, "-c", CLIENT, self.url, PROBES, json.dumps(checks), cwd=REPO,
                timeout=120)
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout.strip().splitlines()[-1])


def host_settings_records() -> set[str]:
    """The shared host settings' records (backends/linux/host_settings.py): who changed what, and its original."""
    return set(glob.glob("/run/agentcell/host-settings/*.json"))


def test_host_uplink_masquerades_and_keeps_the_host_out(fake_host: str, tmp_path: Path) -> None:
    before = _state(fake_host)
    records = host_settings_records()
    with HostModeServer(fake_host, tmp_path) as server:
        during = _state(fake_host)
        assert "masquerade" in during[3] and during[4].strip() == "1"
        # ip_forward of the fake host: its original and its holder (the host-wide sysctls have their own)
        assert len([r for r in host_settings_records() - records if "ip_forward@netns-" in r]) == 1
        checks = [f"tcp('{WEB}')", "tcp('allowed.test')", f"tcp('{HOST_ADDR}', 8081)", f"tcp('{INET_ADDR}', 80)",
                  *(f"tcp('{a}')" for a in FORBIDDEN)]
        got = server.probe(checks)
        assert got[f"tcp('{WEB}')"] == "ok" and got["tcp('allowed.test')"] == "ok"
        assert got[f"tcp('{HOST_ADDR}', 8081)"] != "ok"  # the host itself, on its own address
        for a in FORBIDDEN:
            assert got[f"tcp('{a}')"] != "ok", a
        # the web service on the fake host's neighbour is public here (a documentation address): reachable
        assert got[f"tcp('{INET_ADDR}', 80)"] == "ok"
    assert _state(fake_host) == before, "the server left changes in its host's network"
    assert host_settings_records() == records
