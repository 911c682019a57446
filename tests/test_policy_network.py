"""Network ask through the sandbox's policy and the approvals API (issue 28), end to end: a real server
whose uplink leads into the tests' internet (tests/egress_internet.py: documentation addresses only),
a sandbox created with `policy={"network": {"default": "ask"}}` and E2B's restricted network policy,
curl inside it, and a client answering through `sbx.approvals`. The egress side's own suite:
tests/test_network_ask.py."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest

from agentcell import Sandbox
from tests.egress_internet import ECHO, internet_server, probed
from tests.helpers import wait_until
from tests.servers import ServerProcess

NETWORK = {"allow_out": ["allowed.test"], "deny_out": ["0.0.0.0/0", "denied.test"]}


@pytest.fixture(scope="module")
def inet_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with internet_server(tmp_path_factory) as srv:
        yield srv


def curl(sbx: Sandbox, url: str, out: dict[str, str]) -> threading.Thread:
    def run() -> None:
        r = sbx.commands.run(f"curl -sS -m 30 -o /dev/null -w '%{{http_code}}' {url}; echo \" $?\"", timeout=60)
        out["result"] = r.stdout.strip()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_a_new_host_waits_for_the_approval(inet_server: ServerProcess) -> None:
    sbx = probed(Sandbox.create(api_url=inet_server.url, timeout=300, network=NETWORK,
                                policy={"network": {"default": "ask"}, "ask_timeout_s": 5}))
    try:
        out: dict[str, str] = {}
        job = curl(sbx, "http://other.test/", out)
        req = wait_until("a network request", lambda: sbx.approvals.list(), timeout=20)[0]
        assert (req["kind"], req["host"], req["port"]) == ("network", "other.test", 80), req
        sbx.approvals.allow(req["id"], remember=True)
        job.join(60)
        assert out["result"] == "200 0", out
        # remembered: asked no more
        out = {}
        curl(sbx, "http://other.test/", out).join(60)
        assert out["result"] == "200 0" and sbx.approvals.list() == []
        # denied, and an explicitly denied host is never asked about
        out = {}
        job = curl(sbx, f"http://{ECHO}:8080/", out)
        req = wait_until("another request", lambda: sbx.approvals.list(), timeout=20)[0]
        assert req["address"] == ECHO and req["port"] == 8080
        sbx.approvals.deny(req["id"])
        job.join(60)
        assert not out["result"].endswith(" 0"), out
        out = {}
        curl(sbx, "http://denied.test/", out).join(60)
        assert not out["result"].endswith(" 0") and sbx.approvals.list() == []
        kinds = [e["kind"] for e in sbx.events(kinds="approval.")]
        assert kinds == ["approval.request", "approval.decision"] * 2, kinds
    finally:
        with contextlib.suppress(Exception):
            sbx.kill()


def test_network_ask_without_an_uplink_is_a_400(server_url: str) -> None:
    with pytest.raises(Exception, match="policy.network"):
        Sandbox.create(api_url=server_url, policy={"network": {"default": "ask"}})
