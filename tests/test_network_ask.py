"""Network ask (issue 28): a new destination outside a sandbox's allow list waits for a decision.

A real server (tests/ask_server.py: `agentcell serve` whose egress asker is this test, over a unix
socket, until the approvals API calls it) whose uplink leads into the tests' internet namespace
(tests/egress_internet.py: documentation addresses only, nothing leaves the machine), real sandboxes,
real clients inside them (curl, Python). Each sandbox under test has E2B's restricted policy
(allowOut allowed.test, denyOut ALL_TRAFFIC plus a denied name and a denied address) and asks.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import socket
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from agentcell import Sandbox
from tests.ask_server import SOCKET_ENV
from tests.egress_internet import (
    DENIED_IP,
    FORBIDDEN,
    INTERNET_LOG,
    OTHER,
    WEB,
    WILD,
    ask,
    internet_server,
    probed,
)
from tests.servers import ServerProcess

ALL_TRAFFIC = "0.0.0.0/0"
POLICY = {"allow_out": ["allowed.test"], "deny_out": [ALL_TRAFFIC, "denied.test", f"{WILD}/32"]}

Decider = Callable[[dict[str, Any]], "tuple[bool, bool] | None"]


class Approver:
    """The test's end of the harness: questions in, answers out (by `decide`, or none: a timeout)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        deadline = time.monotonic() + 10
        while True:
            try:
                self.sock.connect(path)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        self.file = self.sock.makefile("rwb")
        self.questions: list[dict[str, Any]] = []
        self.cancelled: list[int] = []
        self.replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self.decide: Decider = lambda q: None
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.file:
            message = json.loads(line)
            if message["op"] == "question":
                message["seen"] = time.monotonic()
                self.questions.append(message)
                answer = self.decide(message)
                if answer is not None:
                    self.answer(message["id"], *answer)
            elif message["op"] == "cancelled":
                self.cancelled.append(message["id"])
            else:
                self.replies.put(message)

    def _send(self, message: dict[str, Any]) -> None:
        with self.lock:
            self.file.write(json.dumps(message).encode() + b"\n")
            self.file.flush()

    def answer(self, ident: int, allow: bool, remember: bool = False) -> None:
        self._send({"op": "answer", "id": ident, "allow": allow, "remember": remember})

    def set_ask(self, sbx: Sandbox, enabled: bool = True, timeout: float = 60.0) -> None:
        self._send({"op": "ask", "sandbox": sbx.sandbox_id, "enabled": enabled, "timeout": timeout})
        assert self.replies.get(timeout=10)["slot"] is not None

    def stats(self) -> dict[str, int]:
        self._send({"op": "stats"})
        return self.replies.get(timeout=10)["counts"]

    def about(self, sbx: Sandbox) -> list[dict[str, Any]]:
        return [q for q in self.questions if q["sandbox"] == sbx.sandbox_id]

    def wait_question(self, sbx: Sandbox, count: int = 1, timeout: float = 15) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while len(self.about(sbx)) < count:
            assert time.monotonic() < deadline, f"no question for {sbx.sandbox_id}: {self.questions}"
            time.sleep(0.01)
        return self.about(sbx)[count - 1]


@pytest.fixture(scope="module")
def server_and_approver(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, Approver]]:
    path = str(tmp_path_factory.mktemp("ask") / "ask.sock")
    with internet_server(tmp_path_factory, command=(sys.executable, "-m", "tests.ask_server"),
                         env={SOCKET_ENV: path}) as server:
        yield server, Approver(path)


@pytest.fixture
def approver(server_and_approver: tuple[ServerProcess, Approver]) -> Iterator[Approver]:
    a = server_and_approver[1]
    a.decide = lambda q: None
    yield a
    a.decide = lambda q: None


@pytest.fixture
def make(server_and_approver: tuple[ServerProcess, Approver]) -> Iterator[Callable[..., Sandbox]]:
    made: list[Sandbox] = []

    def create(asks: bool = True, timeout: float = 60.0, network: dict[str, Any] | None = None) -> Sandbox:
        sbx = Sandbox.create(api_url=server_and_approver[0].url, timeout=300, network=network or POLICY)
        made.append(sbx)
        if asks:
            server_and_approver[1].set_ask(sbx, True, timeout)
        return probed(sbx)

    yield create
    for sbx in made:
        with contextlib.suppress(Exception):
            sbx.kill()


def curl(sbx: Sandbox, url: str, seconds: int = 30) -> tuple[int, str]:
    """curl's exit code, and "<body>|<status>" (status 000: no HTTP answer)."""
    r = sbx.commands.run(f"curl -sS -m {seconds} -w '\\n%{{http_code}}' {url}; echo \" $?\"",
                         timeout=seconds + 30)
    out, code = r.stdout.rstrip("\n").rsplit(" ", 1)
    body, _, status = out.rpartition("\n")
    return int(code), f"{body}|{status}"


def events(sbx: Sandbox, wanted: Callable[[dict[str, Any]], bool], timeout: float = 10) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        found = [e for e in sbx.events() if wanted(e)]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def log_mark() -> int:
    return INTERNET_LOG.stat().st_size if INTERNET_LOG.exists() else 0


def dns_seen(name: str, since: int) -> bool:
    """Whether a query for `name` reached the internet's resolver since `since` (a log_mark())."""
    return INTERNET_LOG.exists() and f"dns {name}.".encode() in INTERNET_LOG.read_bytes()[since:]


def test_an_approved_host_gets_the_page(make, approver: Approver) -> None:  # type: ignore[no-untyped-def]
    sbx = make()
    mark = log_mark()
    stand_in = ask(sbx, "names('other.test')")  # answered with a stand-in: not resolved before it is allowed
    assert stand_in.startswith("['198.18.") and stand_in == ask(sbx, "names('OTHER.test')"), stand_in
    assert not dns_seen("other.test", mark)
    approver.decide = lambda q: (True, False)
    code, out = curl(sbx, "http://other.test/")
    assert code == 0 and out.startswith(f"hello from {OTHER} host=other.test") and out.endswith("|200"), out
    q = approver.about(sbx)[-1]
    assert (q["host"], q["address"], q["port"]) == ("other.test", None, 80)
    assert dns_seen("other.test", mark)  # resolved once allowed
    code, out = curl(sbx, "https://other.test/")  # TLS: the upstream verified for other.test, as ever
    assert code == 0 and "Host: other.test" in out and out.endswith("|200"), out  # (its HTTPS echoes)
    assert ask(sbx, "get('http://other.test/')").startswith(f"hello from {OTHER}")  # Python's urllib
    assert ask(sbx, "tcp('other.test', 8080, timeout=10)") == "ok"  # any TCP port
    assert approver.about(sbx)[-1]["port"] == 8080 and approver.about(sbx)[-1]["host"] == "other.test"
    assert ask(sbx, f"tcp('{OTHER}', 8080, timeout=10)") == "ok"  # an address without a name: asked as such
    assert [approver.about(sbx)[-1][k] for k in ("host", "address", "port")] == [None, OTHER, 8080]
    assert len(approver.about(sbx)) == 5  # approved once each: every new connection asks again
    assert ask(sbx, "tcp('allowed.test')") == "ok" and len(approver.about(sbx)) == 5  # the allow list: not asked
    approved = events(sbx, lambda e: e.get("rule") == "ask" and e.get("decision") == "approved")
    assert approved and approved[0]["kind"] == "net.connect" and approved[0]["dst"] == OTHER
    assert approved[0]["stand_in"].startswith("198.18.") and approved[0]["domain"] == "other.test"
    on_8080 = [e for e in approved if e["dport"] == 8080 and e.get("stand_in")]
    assert on_8080 and on_8080[0]["domain"] == "other.test" and on_8080[0]["claim"] == "none"  # named by its stand-in


def test_a_denied_host_is_refused(make, approver: Approver) -> None:  # type: ignore[no-untyped-def]
    sbx = make()
    mark = log_mark()
    approver.decide = lambda q: (False, False)
    code, out = curl(sbx, "http://other.test/")
    assert out.endswith("|403") and "ask:denied" in out, out
    assert not dns_seen("other.test", mark)  # refused: never resolved
    code, out = curl(sbx, "https://other.test/")
    assert code != 0 and not out.endswith("|200"), out
    assert ask(sbx, f"tcp('{OTHER}', 8080, timeout=10)") != "ok"
    assert ask(sbx, f"http_as('{OTHER}', 'other.test', timeout=10)") == "HTTP/1.1 403 Forbidden"
    denied = events(sbx, lambda e: e.get("rule") == "ask" and e.get("decision") == "denied")
    assert denied and denied[0]["kind"] == "net.deny" and denied[0]["verdict"] == "denied"
    assert {e["domain"] for e in denied if e.get("stand_in")} == {"other.test"}


def test_an_unanswered_question_is_a_refusal(make, approver: Approver) -> None:  # type: ignore[no-untyped-def]
    sbx = make(timeout=1.5)
    t = time.monotonic()
    code, out = curl(sbx, "http://other.test/")
    took = time.monotonic() - t
    assert out.endswith("|403") and "ask:timeout" in out, out
    assert 1.4 < took < 6, took
    assert events(sbx, lambda e: e.get("rule") == "ask" and e.get("decision") == "timeout")
    # what a client sees while held: connected at once, then nothing until the decision (here: none)
    ex = sbx.run_code("""
import socket, time
t = time.monotonic()
s = socket.create_connection(('other.test', 8080), timeout=5)
connected = time.monotonic() - t
s.sendall(b"GET / HTTP/1.0\\r\\n\\r\\n")
s.settimeout(0.5)
try:
    s.recv(10)
    waited = 'data'
except TimeoutError:
    waited = 'waiting'
s.settimeout(5)
print(round(connected, 3), waited, s.recv(10) or b'closed')
""")
    connected, waited, then = "".join(ex.logs.stdout).split()
    assert float(connected) < 0.5 and waited == "waiting" and then == "b'closed'", (connected, waited, then)


def test_remember_opens_the_host_for_later_connections(make, approver: Approver) -> None:  # type: ignore[no-untyped-def]
    sbx = make()
    approver.decide = lambda q: (True, True)
    code, out = curl(sbx, "http://other.test/")
    assert code == 0 and out.endswith("|200"), out
    assert len(approver.about(sbx)) == 1
    approver.decide = lambda q: (False, False)  # asked again would be refused now
    for url in ("http://other.test/", "https://other.test/", "http://other.test:8080/"):
        code, out = curl(sbx, url)
        assert code == 0 and out.endswith("|200"), (url, out)
    assert ask(sbx, "names('other.test')") == f"['{OTHER}']"  # answered for real now, and pinned
    assert ask(sbx, f"tcp('{OTHER}', 8080)") == "ok"  # another port: through the kernel now
    assert len(approver.about(sbx)) == 1
    # an address without a name, remembered as an address
    approver.decide = lambda q: (True, True)
    assert ask(sbx, f"tcp('{DENIED_IP}', 8080, timeout=10)") == "ok"
    q = approver.about(sbx)[-1]
    assert (q["host"], q["address"], q["port"]) == (None, DENIED_IP, 8080)
    approver.decide = lambda q: (False, False)
    assert ask(sbx, f"tcp('{DENIED_IP}', 80)") == "ok" and len(approver.about(sbx)) == 2
    remembered = events(sbx, lambda e: e.get("rule") == "ask" and e.get("decision") == "remembered")
    assert remembered


def test_explicit_denials_and_the_never_list_are_never_asked(make, approver: Approver) -> None:  # type: ignore[no-untyped-def]
    sbx = make()
    approver.decide = lambda q: (True, True)  # were anything asked, it would get through
    t, mark = time.monotonic(), log_mark()
    assert ask(sbx, "names('denied.test')") == "noname"  # a denied name does not resolve
    assert ask(sbx, f"http_as('{DENIED_IP}', 'denied.test')") == "HTTP/1.1 403 Forbidden"  # nor is asked about
    assert ask(sbx, f"tls_as('{DENIED_IP}', 'denied.test')") == "closed"
    assert ask(sbx, f"tcp('{WILD}', 80)") != "ok"  # a denied address (the kernel drops it)
    assert ask(sbx, f"tcp('{WILD}', 8080)") != "ok"
    for addr in FORBIDDEN:
        assert ask(sbx, f"tcp('{addr}')") != "ok", addr
        assert ask(sbx, f"tcp('{addr}', 8080)") != "ok", addr
    assert ask(sbx, f"http_as('{WEB}', 'other.test')") == "HTTP/1.1 403 Forbidden"  # a name at an address of
    assert ask(sbx, f"tls_as('{WEB}', 'other.test')") == "closed"  # its own: names are asked via their stand-ins
    stand_in = ask(sbx, "names('other.test')")[2:-2]
    assert ask(sbx, f"http_as('{stand_in}', 'secret.test')") == "HTTP/1.1 403 Forbidden"  # another name's
    assert ask(sbx, f"tls_as('{stand_in}', 'secret.test')") == "closed"
    assert ask(sbx, "tcp('198.18.77.77', 8080)") != "ok"  # a stand-in never answered
    assert ask(sbx, "names('*.other.test')") == "noname"  # no stand-in for what is no host name
    assert ask(sbx, "names('_x.other.test')") == "noname"
    assert ask(sbx, f"udp('{OTHER}', 7)") != "ok"  # UDP is not held: refused
    assert approver.about(sbx) == [], approver.about(sbx)
    assert time.monotonic() - t < 60
    assert not dns_seen("secret.test", mark) and not dns_seen("denied.test", mark)
    # a name approved, whose answer is private: refused after the approval (never-list, as ever)
    assert ask(sbx, "names('rebind.test')").startswith("['198.18.")  # a stand-in, until approved
    assert ask(sbx, "tcp('rebind.test', 8080, timeout=10)") != "ok"
    assert [q["host"] for q in approver.about(sbx)] == ["rebind.test"]
    assert events(sbx, lambda e: e.get("rule") == "ask" and e.get("decision") == "unresolved")


def test_a_flood_is_bounded_and_the_others_go_on(make, approver: Approver) -> None:  # type: ignore[no-untyped-def]
    sbx = make(timeout=20)
    bystander = make(asks=False)
    before = approver.stats().get("flood", 0)
    ex = sbx.run_code(f"""
import socket, threading, time
results = []
def one():
    t = time.monotonic()
    try:
        s = socket.create_connection(('{OTHER}', 8080), timeout=5)
        s.sendall(b"GET / HTTP/1.0\\r\\nHost: other.test\\r\\n\\r\\n")
        s.settimeout(15)
        data = s.recv(10)
        results.append(('data' if data else 'closed', time.monotonic() - t))
    except OSError as e:
        results.append((type(e).__name__, time.monotonic() - t))
threads = [threading.Thread(target=one) for _ in range(60)]
for th in threads: th.start()
""")
    assert ex.error is None, ex.error
    q = approver.wait_question(sbx)
    time.sleep(1.0)
    assert len(approver.about(sbx)) == 1  # one decision for every connection waiting on the same question
    flooded = approver.stats().get("flood", 0) - before
    assert flooded >= 60 - 32, flooded  # past 32 held: refused at once, counted
    # a bystander and the server's API are unaffected meanwhile
    t = time.monotonic()
    assert ask(bystander, "tcp('allowed.test')") == "ok"
    assert ask(bystander, "names('other.test')") == "noname"  # it does not ask: its policy as ever
    assert time.monotonic() - t < 5
    assert approver.about(bystander) == []
    approver.answer(q["id"], True)
    ex = sbx.run_code("for th in threads: th.join()\nrefused = [r for r in results if r[0] != 'data']\n"
                      "print(len(results) - len(refused), len(refused), max(r[1] for r in refused))")
    served, refused, slowest_refusal = "".join(ex.logs.stdout).split()
    assert int(served) + int(refused) == 60 and int(refused) == flooded  # held ones went on once approved
    assert float(slowest_refusal) < 1.5  # the flood's refusals came at once, before any decision


def test_a_held_connection_ends_with_its_sandbox(make, approver: Approver) -> None:  # type: ignore[no-untyped-def]
    sbx = make()
    sbx.commands.run("curl -sS -m 120 http://other.test/ > /tmp/out 2>&1", background=True)
    q = approver.wait_question(sbx)
    sbx.kill()
    deadline = time.monotonic() + 10
    while q["id"] not in approver.cancelled:
        assert time.monotonic() < deadline, "the decision outlived its sandbox"
        time.sleep(0.05)
    approver.answer(q["id"], True)  # a late answer goes nowhere
    other = make()  # the next sandboxes (the slot is reused in turn) meet nothing of it
    approver.decide = lambda q: (True, False)
    code, out = curl(other, "http://other.test/")
    assert code == 0 and out.endswith("|200"), out


def test_turning_ask_off_and_the_round_trip(make, approver: Approver) -> None:  # type: ignore[no-untyped-def]
    sbx = make()
    approver.decide = lambda q: (True, False)
    timing = """
import socket, time
def once(host, port=80):
    t = time.perf_counter()
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(b"GET / HTTP/1.1\\r\\nHost: " + host.encode() + b"\\r\\nConnection: close\\r\\n\\r\\n")
    data = s.recv(20)
    s.close()
    assert data.startswith(b"HTTP/1.1 200"), data
    return (time.perf_counter() - t) * 1000
"""
    assert sbx.run_code(timing).error is None
    asked = [float(ask(sbx, "once('other.test')")) for _ in range(15)]
    allowed = [float(ask(sbx, "once('allowed.test')")) for _ in range(15)]
    print(f"\nfirst answer, ms: asked (approved at once) p50 {statistics.median(asked):.1f} "
          f"max {max(asked):.1f}; allowed p50 {statistics.median(allowed):.1f} max {max(allowed):.1f}")
    assert statistics.median(asked) < statistics.median(allowed) + 50
    approver.set_ask(sbx, False)
    n = len(approver.about(sbx))
    assert ask(sbx, "tcp('other.test', timeout=2)") != "ok"  # E2B's policy alone again: not asked, refused
    assert len(approver.about(sbx)) == n
    assert os.path.exists("/run/netns")


def test_nothing_but_what_is_approved(make, approver: Approver) -> None:  # type: ignore[no-untyped-def]
    """denyOut ALL_TRAFFIC and no allow list: every destination is asked about."""
    sbx = make(network={"deny_out": [ALL_TRAFFIC]})
    approver.decide = lambda q: (q["host"] == "allowed.test", False)
    code, out = curl(sbx, "http://allowed.test/")
    assert code == 0 and out.endswith("|200"), out
    code, out = curl(sbx, "http://other.test/")
    assert out.endswith("|403") and "ask:denied" in out, out
    assert [q["host"] for q in approver.about(sbx)] == ["allowed.test", "other.test"]


async def test_the_gate_alone() -> None:
    """ask.py without a sandbox: one decision per question however many wait on it, the bound per
    sandbox, the timeout, remember, a failing asker, forget; stand-ins unique and bounded."""
    import asyncio

    from agentcell.network import ask as ask_module
    from agentcell.network.ask import MAX_HELD_PER_SANDBOX, AskGate, Question, StandIns

    remembered: list[Question] = []

    async def on_remember(slot: int, q: Question) -> None:
        remembered.append(q)

    gate = AskGate(on_remember)
    asked: list[tuple[Any, ...]] = []
    release = asyncio.Event()

    async def asker(owner: str, host: str | None, address: str | None, port: int) -> tuple[bool, bool]:
        asked.append((owner, host, address, port))
        if host == "boom.test":
            raise RuntimeError("the approvals store failed")
        await release.wait()
        return host != "no.test", host == "keep.test"

    q = Question("sbx", "a.test", None, 443)
    assert (await gate.ask(1, q)).outcome == "no-asker"
    gate.set_asker(asker)
    gate.configure(1, True, 5)
    waiting = [asyncio.create_task(gate.ask(1, q)) for _ in range(MAX_HELD_PER_SANDBOX)]
    await asyncio.sleep(0.01)
    assert (await gate.ask(1, q)).outcome == "flood" and gate.flooded[1] == 1  # at once, counted
    assert len(asked) == 1 and gate.held(1) == MAX_HELD_PER_SANDBOX
    release.set()
    assert {(await w).outcome for w in waiting} == {"approved"} and gate.held(1) == 0
    assert (await gate.ask(1, Question("sbx", "keep.test", None, 80))).outcome == "remembered"
    assert [r.host for r in remembered] == ["keep.test"]
    assert (await gate.ask(1, Question("sbx", "no.test", None, 80))).outcome == "denied"
    assert (await gate.ask(1, Question("sbx", "boom.test", None, 80))).outcome == "error"
    release.clear()
    gate.configure(1, True, 0.2)
    t = asyncio.get_running_loop().time()
    assert (await gate.ask(1, Question("sbx", "slow.test", None, 80))).outcome == "timeout"
    assert 0.15 < asyncio.get_running_loop().time() - t < 2
    held = asyncio.create_task(gate.ask(1, Question("sbx", "gone.test", None, 80)))
    await asyncio.sleep(0.01)
    gate.forget(1)  # its sandbox killed: the decision is cancelled, the setting gone
    with pytest.raises(asyncio.CancelledError):
        await held
    assert not gate.enabled(1) and gate.held(1) == 0
    with pytest.raises(ask_module.AskError):
        gate.configure(2, True, 0)
    stand_ins = StandIns()
    first = [stand_ins.address_for(f"n{i}.test") for i in range(ask_module.MAX_STAND_INS)]
    assert len(set(first)) == len(first) and all(a.startswith("198.1") for a in first)
    assert stand_ins.address_for("n0.test") == first[0]  # the same name, the same address (and fresh again)
    extra = stand_ins.address_for("new.test")  # past the bound: the least recently answered goes
    assert stand_ins.name_of(first[1]) is None and stand_ins.name_of(first[0]) == "n0.test"
    assert stand_ins.name_of(extra) == "new.test" and extra not in first[2:]


def test_a_client_that_leaves_lets_go_of_its_place(make, approver: Approver) -> None:  # type: ignore[no-untyped-def]
    from agentcell.network.ask import MAX_HELD_PER_SANDBOX

    sbx = make(timeout=30)
    before = approver.stats().get("flood", 0)
    approver.decide = lambda q: threading.Timer(3.0, approver.answer, (q["id"], True)).start()  # type: ignore[func-returns-value]
    ex = sbx.run_code(f"""
import socket, time
held = [socket.create_connection(('other.test', 8080), timeout=5) for _ in range({MAX_HELD_PER_SANDBOX})]
for s in held:
    s.close()  # given up (a client's own timeout)
time.sleep(0.5)
s = socket.create_connection(('other.test', 8080), timeout=5)
s.sendall(b"GET / HTTP/1.0\\r\\nHost: other.test\\r\\n\\r\\n")
s.settimeout(15)
print(s.recv(12))
""")
    assert ex.error is None, ex.error
    assert "".join(ex.logs.stdout).strip() == "b'HTTP/1.1 200'"  # held in a place the others let go of
    assert approver.stats().get("flood", 0) == before
    assert len(approver.about(sbx)) == 1  # they all waited on the one question


def test_update_network_keeps_asking_and_what_was_remembered(make, approver: Approver) -> None:  # type: ignore[no-untyped-def]
    sbx = make()
    approver.decide = lambda q: (True, True)
    code, out = curl(sbx, "http://other.test/")
    assert code == 0 and out.endswith("|200"), out
    sbx.update_network({"allow_out": ["api.wild.test"], "deny_out": [ALL_TRAFFIC, "secret.test"]})
    approver.decide = lambda q: (False, False)
    code, out = curl(sbx, "http://other.test/")  # remembered: not asked again
    assert code == 0 and out.endswith("|200"), out
    assert ask(sbx, "tcp('api.wild.test')") == "ok"  # the new allow list
    code, out = curl(sbx, "http://allowed.test/")  # no longer on it: asked (and refused)
    assert out.endswith("|403") and "ask:denied" in out, out
    assert ask(sbx, "names('secret.test')") == "noname"  # newly denied: refused, not asked
    assert [q["host"] for q in approver.about(sbx)] == ["other.test", "allowed.test"]
