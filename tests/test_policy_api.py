"""The policy's API (issue 28): what a create or an update with a malformed or unenforceable policy
gets (a 400 naming the part, nothing created), the policy as the server holds it, approvals' endpoints.
The enforcement itself: tests/test_policy.py."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from agentcell import Sandbox
from tests.conftest import GUEST_KERNEL
from tests.helpers import create_sandbox


@pytest.fixture(scope="module")
def http(server_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server_url, timeout=60) as c:
        yield c


BAD = [
    ({"exce": {"default": "deny"}}, "policy.exce"),
    ({"exec": {"default": "never"}}, "policy.exec.default"),
    ({"exec": {"allow": "python3"}}, "policy.exec.allow"),
    ({"exec": {"allow": ["bin/python3"]}}, "policy.exec.allow[0]"),
    ({"exec": {"deny": ["/usr/bin/../bin/ls"]}}, "policy.exec.deny[0]"),
    ({"files": [{"path": "home/user", "access": "read"}]}, "policy.files[0].path"),
    ({"files": [{"path": "/home/user", "access": "rw"}]}, "policy.files[0].access"),
    ({"files": [{"path": "/a", "access": "read"}, {"path": "/a/", "access": "none"}]}, "policy.files[1].path"),
    ({"files": [{"path": "/a", "access": "read", "mode": 1}]}, "policy.files[0].mode"),
    ({"syscalls": "paranoid"}, "policy.syscalls"),
    ({"processes": {"max": 0}}, "policy.processes.max"),
    ({"processes": {"max": 100000}}, "policy.processes.max"),
    ({"network": {"default": "deny"}}, "policy.network.default"),
    ({"ask_timeout_s": 0}, "policy.ask_timeout_s"),
    ([], "policy"),
]


@pytest.mark.parametrize(("policy", "part"), BAD, ids=[p for _, p in BAD])
def test_a_bad_policy_is_a_400_naming_its_part_and_creates_nothing(http: httpx.Client, policy: object,
                                                                      part: str) -> None:
    before = len(http.get("/sandboxes").json())
    r = http.post("/v2/sandboxes", json={"templateID": "base", "policy": policy})
    assert r.status_code == 400, r.text
    assert r.json()["message"].startswith(part + ":"), r.json()
    assert len(http.get("/sandboxes").json()) == before


def test_no_policy_is_the_default_and_approvals_are_empty(http: httpx.Client) -> None:
    sbx = create_sandbox(http)
    sid = sbx["sandboxID"]
    try:
        got = http.get(f"/sandboxes/{sid}/policy").json()
        assert got["exec"] == {"default": "allow", "allow": [], "deny": []}
        assert got["files"] == [] and got["syscalls"] == "default" and got["processes"] == {"max": None}
        assert http.get(f"/sandboxes/{sid}/approvals").json() == {"approvals": []}
        r = http.post(f"/sandboxes/{sid}/approvals/a1nothere", json={"allow": True})
        assert r.status_code == 404, r.text
        r = http.post(f"/sandboxes/{sid}/approvals/a1nothere", json={"allow": "yes"})
        assert r.status_code == 400, r.text
        r = http.put(f"/sandboxes/{sid}/policy", json={"files": [{"path": "/x", "access": "sometimes"}]})
        assert r.status_code == 400 and "policy.files[0].access" in r.text
        assert http.get(f"/sandboxes/{sid}/policy").json() == got  # a refused update changed nothing
    finally:
        http.delete(f"/sandboxes/{sid}")
    assert http.get(f"/sandboxes/{sid}/policy").status_code == 404


def test_what_the_backend_enforces_and_what_it_refuses(server_url: str, http: httpx.Client) -> None:
    """On every backend a strict syscall filter holds; on gvisor the parts it cannot enforce are a 400
    naming them (the linux backend's enforcement: tests/test_policy.py)."""
    sbx = Sandbox.create(api_url=server_url, policy={"syscalls": "strict"})
    try:
        r = sbx.run_code("import socket\ntry:\n    socket.socket(socket.AF_INET, socket.SOCK_DGRAM, socket.IPPROTO_ICMP)\n"
                         "    print('ping socket')\nexcept OSError as e:\n    print(e.errno)")
        assert r.logs.stdout == ["1\n"], r
        r2 = http.put(f"/sandboxes/{sbx.sandbox_id}/policy", json={"syscalls": "default"})
        assert r2.status_code == 400 and r2.json()["message"].startswith("policy.syscalls:"), r2.text
    finally:
        sbx.kill()
    for part, policy in (("policy.exec", {"exec": {"default": "deny", "allow": ["python3"]}}),
                         ("policy.files", {"files": [{"path": "/home/user/x", "access": "read"}]}),
                         ("policy.processes", {"processes": {"max": 64}})):
        r = http.post("/v2/sandboxes", json={"templateID": "base", "policy": policy})
        if GUEST_KERNEL:  # gvisor, microvm: the guest's execs, files and processes are its own kernel's
            assert r.status_code == 400 and r.json()["message"].startswith(part + ":"), r.text
        else:
            assert r.status_code == 201, r.text
            http.delete(f"/sandboxes/{r.json()['sandboxID']}")


def test_strict_names_the_contexts_that_keep_the_default(server_url: str, http: httpx.Client) -> None:
    sbx = Sandbox.create(api_url=server_url)
    try:
        ctx = sbx.create_code_context()
        sbx.run_code("x = 1", context=ctx)  # tenant code ran there: the filter cannot be handed to it
        r = http.put(f"/sandboxes/{sbx.sandbox_id}/policy", json={"syscalls": "strict"})
        assert r.status_code == 200 and ctx.id in r.json()["contextsKept"], r.text
    finally:
        sbx.kill()
