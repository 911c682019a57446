"""The system service (docs/system-service.md): one root step, then ordinary users of the group get
sandboxes with no server to start and no URL, each seeing only their own.

systemd is not PID 1 here, so the server runs as the unit would run it: the unit's own command line
(system.units.service_command), with a temporary socket, state dir and group, `--egress-uplink none`.
Users are made by the test (useradd, removed after): `member` and `other` in the group, `outsider` not.
They run /usr/bin/python3 (the repo's venv python lives under /root, which they cannot enter) with the
SDK's few dependencies pip-installed into a directory they can read, and this tree on PYTHONPATH.
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from agentcell.system import units
from tests.servers import ServerProcess, free_port, temporary_state_dir

REPO = Path(__file__).resolve().parent.parent
USER_PYTHON = "/usr/bin/python3"
SDK_DEPENDENCIES = ("httpx==0.29.0", "urllib3==2.8.0", "httptools==0.9.0")  # pyproject's pins
QUOTA = 2
MEMORY_QUOTA_MB = 1024  # two sandboxes of the default 512 MiB
TCP_KEY = "e2b_" + uuid.uuid4().hex

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists(USER_PYTHON) or shutil.which("useradd") is None,
                                reason="needs root, useradd and /usr/bin/python3")


def _readable_dir(prefix: str) -> Path:
    """A directory under /tmp others may enter (pytest's tmp_path is inside a 0700 directory)."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


@dataclass
class Host:
    group: str
    users: dict[str, int]  # name -> uid
    userlib: Path


@pytest.fixture(scope="module")
def host() -> Iterator[Host]:
    """A group, three users (two in it), and the SDK's dependencies where they can import them."""
    tag = uuid.uuid4().hex[:6]
    group = f"acgrp{tag}"
    subprocess.run(["groupadd", "--system", group], check=True)
    names = {"member": f"acmem{tag}", "other": f"acoth{tag}", "outsider": f"acout{tag}"}
    made: list[str] = []
    userlib = _readable_dir("agentcell-userlib-")
    try:
        for role, name in names.items():
            extra = ["-G", group] if role != "outsider" else []
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", *extra, name],
                           check=True)
            made.append(name)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target",
                        str(userlib), *SDK_DEPENDENCIES], check=True)
        subprocess.run(["chmod", "-R", "a+rX", str(userlib)], check=True)
        yield Host(group, {role: pwd.getpwnam(name).pw_uid for role, name in names.items()}, userlib)
    finally:
        for name in made:
            subprocess.run(["userdel", name], check=False)
        subprocess.run(["groupdel", group], check=False)
        shutil.rmtree(userlib, ignore_errors=True)


class Service(ServerProcess):
    """`agentcell serve --system` as agentcell.service runs it, on a socket in a temporary directory."""

    def __init__(self, group: str, *extra: str, activated: socket.socket | None = None,
                 state: Path | None = None) -> None:
        self.dir = _readable_dir("agentcell-sock-")
        self.socket = str(self.dir / "agentcell.sock")
        self.state = state or Path(temporary_state_dir())
        args = ["--uds", self.socket, "--state-dir", str(self.state), "--egress-uplink", "none", "--standbys", "0",
                "--max-sandboxes-per-user", str(QUOTA), "--max-memory-mb-per-user", str(MEMORY_QUOTA_MB), *extra]
        argv = units.service_command(sys.executable, group, args)
        pass_fds: tuple[int, ...] = ()
        if activated is not None:  # as systemd passes it: fd 3, LISTEN_PID = the server's own pid
            self.socket = activated.getsockname()
            argv = ["bash", "-c", f'LISTEN_PID=$$ LISTEN_FDS=1 exec "$@" 3<&{activated.fileno()}', "bash", *argv]
            pass_fds = (activated.fileno(),)
        super().__init__(self.state.parent / f"{self.state.name}.log", command=argv, uds=self.socket,
                         address_args=False, own_state_dir=False, pass_fds=pass_fds, ready_status=200,
                         stop_timeout=30, what="the service")
        self.client = self.http_client()
        self.started()

    tcp: str = ""

    def stop(self, grace: float | None = None, *, or_kill: bool = True, keep_state: bool = False) -> int:
        self.client.close()
        code = super().stop(grace, or_kill=or_kill)
        shutil.rmtree(self.dir, ignore_errors=True)
        if not keep_state:
            shutil.rmtree(self.state, ignore_errors=True)
        self.log_path.unlink(missing_ok=True)
        return code


@pytest.fixture(scope="module")
def service(host: Host) -> Iterator[Service]:
    """With its TCP listener too (and so an API key): the socket's users must not need the key."""
    port = free_port()
    svc = Service(host.group, "--system-tcp", "--host", "127.0.0.1", "--port", str(port), "--api-key", TCP_KEY)
    svc.tcp = f"http://127.0.0.1:{port}"
    try:
        yield svc
    finally:
        svc.stop()


def as_user(host: Host, role: str, code: str, socket_path: str) -> subprocess.CompletedProcess[str]:
    """Run `code` with /usr/bin/python3 as that user (their groups from /etc/group), in a clean environment:
    no AGENTCELL_URL, only AGENTCELL_SYSTEM_SOCKET pointing at the test's socket."""
    name = pwd.getpwuid(host.users[role]).pw_name
    env = ["PATH=/usr/bin:/bin", "HOME=/tmp", "PYTHONDONTWRITEBYTECODE=1", f"PYTHONPATH={host.userlib}:{REPO}",
           f"AGENTCELL_SYSTEM_SOCKET={socket_path}"]
    return subprocess.run(["runuser", "-u", name, "--", "env", "-i", *env, USER_PYTHON, "-c", code],
                          capture_output=True, text=True, timeout=120)


def answer(done: subprocess.CompletedProcess[str]) -> dict:
    assert done.returncode == 0, f"exit {done.returncode}\nstdout: {done.stdout}\nstderr: {done.stderr}"
    return json.loads(done.stdout.strip().splitlines()[-1])


CREATE = """
import json
from agentcell import Sandbox
sbx = Sandbox.create(timeout=600)
out = sbx.commands.run("echo hello from $(id -un)")
print(json.dumps({"id": sbx.sandbox_id, "token": sbx._conn.access_token, "out": out.stdout}))
"""


@pytest.fixture(scope="module")
def members_sandbox(host: Host, service: Service) -> dict:
    """A sandbox `member` made with Sandbox.create() and nothing else: the SDK found the socket."""
    return answer(as_user(host, "member", CREATE, service.socket))


def test_member_creates_a_sandbox_with_no_url(host: Host, service: Service, members_sandbox: dict) -> None:
    assert members_sandbox["out"].startswith("hello from")
    # it is the member's: root (the administrator) sees it, and its record names the member's uid
    listed = service.client.get("/sandboxes").json()
    assert members_sandbox["id"] in [s["sandboxID"] for s in listed]
    created = service.client.get(f"/sandboxes/{members_sandbox['id']}/events", params={"kind": "sandbox.created"})
    events = [json.loads(line) for line in created.text.splitlines()]
    # the record says who: the uid the kernel vouched for, as the owner and as the verified caller
    uid = f"uid:{host.users['member']}"
    assert [(e["owner"], e["key_id"]) for e in events] == [(uid, uid)]
    # the async SDK finds it the same way
    code = """
import asyncio, json
from agentcell import AsyncSandbox
async def main():
    sbx = await AsyncSandbox.create(timeout=60)
    out = await sbx.commands.run("echo async")
    await sbx.kill()
    print(json.dumps({"out": out.stdout}))
asyncio.run(main())
"""
    assert answer(as_user(host, "member", code, service.socket)) == {"out": "async\n"}


def test_tcp_listener_is_one_tenant_behind_its_key(host: Host, service: Service, members_sandbox: dict) -> None:
    assert httpx.get(f"{service.tcp}/sandboxes").status_code == 401  # no key, no entry (any local user reaches it)
    key = {"X-API-KEY": TCP_KEY}
    assert httpx.get(f"{service.tcp}/sandboxes", headers=key).json() == []  # the socket users' are not the key's
    assert httpx.get(f"{service.tcp}/sandboxes/{members_sandbox['id']}", headers=key).status_code == 404
    made = httpx.post(f"{service.tcp}/sandboxes", json={"timeout": 60}, headers=key, timeout=60).json()["sandboxID"]
    try:
        code = "import json; from agentcell import Sandbox; print(json.dumps([s.sandbox_id for s in Sandbox.list().next_items()]))"
        assert made not in answer(as_user(host, "member", code, service.socket))
        assert made in [s["sandboxID"] for s in service.client.get("/sandboxes").json()]  # root sees it
    finally:
        assert httpx.delete(f"{service.tcp}/sandboxes/{made}", headers=key).status_code == 204


PROBE = """
import json, httpx
from agentcell import Sandbox, NotFoundException
sid, token, everything = {sid!r}, {token!r}, {everything!r}
seen = {{"listed": sid in [s.sandbox_id for s in Sandbox.list().next_items()]}}
c = httpx.Client(transport=httpx.HTTPTransport(uds={socket!r}), base_url="http://localhost")
calls = [("get", "GET", "", None), ("events", "GET", "/events", None), ("report", "GET", "/report", None),
         ("metrics", "GET", "/metrics", None)]
if everything:  # calls that change the sandbox: only where they must fail
    calls += [("pause", "POST", "/pause", {{}}), ("timeout", "POST", "/timeout", {{"timeout": 5}}),
              ("snapshot", "POST", "/snapshots", {{}}), ("fork", "POST", "/fork", {{}})]
for what, method, path, body in calls:
    seen[what] = c.request(method, f"/sandboxes/{{sid}}{{path}}", json=body).status_code
# the data plane, even with the sandbox's own access token: answered as for an id that does not exist
# (E2B's proxy answers 502 "The sandbox was not found" there)
for name, target in (("", sid), ("unknown ", "nosuchsandbox0000000")):
    envd = {{"E2b-Sandbox-Id": target, "X-Access-Token": token}}
    r = c.get("/files", params={{"path": "/etc/hostname"}}, headers=envd)
    seen[name + "files"] = [r.status_code, r.json().get("message") if r.status_code != 200 else "ok"]
    r = c.post("/process.Process/List", json={{}}, headers={{**envd, "Content-Type": "application/json"}})
    seen[name + "process"] = [r.status_code, r.json().get("message") if r.status_code != 200 else "ok"]
try:
    Sandbox.connect(sid)
    seen["connect"] = "connected"
except NotFoundException:
    seen["connect"] = "not found"
seen["kill"] = Sandbox.kill(sid)
print(json.dumps(seen))
"""


def test_another_user_finds_nothing(host: Host, service: Service, members_sandbox: dict) -> None:
    def probe(role: str, everything: bool) -> dict:
        code = PROBE.format(sid=members_sandbox["id"], token=members_sandbox["token"], socket=service.socket,
                            everything=everything)
        return answer(as_user(host, role, code, service.socket))

    gone = [502, "The sandbox was not found"]
    assert probe("other", True) == {
        "listed": False, "get": 404, "events": 404, "report": 404, "metrics": 404, "pause": 404, "timeout": 404,
        "snapshot": 404, "fork": 404, "files": gone, "process": gone, "unknown files": gone, "unknown process": gone,
        "connect": "not found", "kill": False}
    # the member's sandbox was untouched: the same calls as its owner go through (its kill last)
    assert probe("member", False) == {
        "listed": True, "get": 200, "events": 200, "report": 200, "metrics": 200, "files": [200, "ok"],
        "process": [200, "ok"], "unknown files": gone, "unknown process": gone, "connect": "connected", "kill": True}


REPORT_STATUS = """
import httpx
c = httpx.Client(transport=httpx.HTTPTransport(uds={socket!r}), base_url="http://localhost")
print('{{"status": %d}}' % c.get("/sandboxes/{sid}/report").status_code)
"""


def test_a_gone_sandboxs_record_stays_its_owners(host: Host, service: Service) -> None:
    made = answer(as_user(host, "member", CREATE + "sbx.kill()\n", service.socket))
    code = REPORT_STATUS.format(socket=service.socket, sid=made["id"])
    assert answer(as_user(host, "other", code, service.socket)) == {"status": 404}
    assert answer(as_user(host, "member", code, service.socket)) == {"status": 200}


def test_outsider_is_refused_with_the_fix(host: Host, service: Service) -> None:
    code = """
import json, os, socket
from agentcell import Sandbox
from agentcell.errors import NoLocalServerError
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(os.environ["AGENTCELL_SYSTEM_SOCKET"])
    raw = "connected"
except PermissionError:
    raw = "permission denied"
try:
    Sandbox.create()
    print(json.dumps({"raw": raw, "sdk": "created"}))
except NoLocalServerError as e:
    print(json.dumps({"raw": raw, "sdk": str(e)}))
"""
    seen = answer(as_user(host, "outsider", code, service.socket))
    assert seen["raw"] == "permission denied"
    name = pwd.getpwuid(host.users["outsider"]).pw_name
    assert f"only members of group '{host.group}'" in seen["sdk"] and f"usermod -aG {host.group} {name}" in seen["sdk"]


def test_no_service_names_the_install_command(host: Host) -> None:
    code = """
import json
from agentcell import Sandbox
from agentcell.errors import NoLocalServerError
try:
    Sandbox.create()
except NoLocalServerError as e:
    print(json.dumps({"error": str(e)}))
"""
    seen = answer(as_user(host, "member", code, "/run/agentcell-test-nothing-here/agentcell.sock"))
    assert "sudo agentcell system install" in seen["error"] and "rootless" in seen["error"]


def test_per_user_quota(host: Host, service: Service) -> None:
    code = """
import json
from agentcell import Sandbox, RateLimitException
made, refused = [], None
for _ in range(COUNT):
    try:
        made.append(Sandbox.create(timeout=120))
    except RateLimitException as e:
        refused = str(e)
for s in made:
    s.kill()
print(json.dumps({"made": len(made), "refused": refused}))
""".replace("COUNT", str(QUOTA + 1))
    seen = answer(as_user(host, "other", code, service.socket))
    assert seen["made"] == QUOTA
    assert f"may have at most {QUOTA} at once" in seen["refused"] and "--max-sandboxes-per-user" in seen["refused"]
    # root has no quota: the administrator's own sandboxes are not a user's
    ids = [service.client.post("/sandboxes", json={"timeout": 60}).json()["sandboxID"] for _ in range(QUOTA + 1)]
    for sid in ids:
        assert service.client.delete(f"/sandboxes/{sid}").status_code == 204


IDEMPOTENT_CREATE = """
import json, httpx
c = httpx.Client(transport=httpx.HTTPTransport(uds={socket!r}), base_url="http://localhost", timeout=60)
made = c.post("/v2/sandboxes", json={{"timeout": 60}}, headers={{"Idempotency-Key": {key!r}}}).json()
print(json.dumps({{"id": made["sandboxID"], "token": made["envdAccessToken"]}}))
"""


def test_an_idempotency_key_never_replays_another_users_create(host: Host, service: Service) -> None:
    code = IDEMPOTENT_CREATE.format(socket=service.socket, key=f"k-{uuid.uuid4().hex}")
    first = answer(as_user(host, "other", code, service.socket))
    again = answer(as_user(host, "other", code, service.socket))
    assert again == first  # the same user's retry is a replay
    second = answer(as_user(host, "member", code, service.socket))
    assert second["id"] != first["id"] and second["token"] != first["token"]
    for made in (first, second):
        assert service.client.delete(f"/sandboxes/{made['id']}").status_code == 204


def test_per_user_memory_quota(host: Host, service: Service) -> None:
    code = """
import json
from agentcell import Sandbox, RateLimitException
big = Sandbox.create(timeout=120, limits={"memoryMB": 768})
try:
    Sandbox.create(timeout=120)
    refused = None
except RateLimitException as e:
    refused = str(e)
big.kill()
print(json.dumps({"refused": refused}))
"""
    refused = answer(as_user(host, "other", code, service.socket))["refused"]
    assert f"hold 768 MiB of sandbox memory on this server and may hold at most {MEMORY_QUOTA_MB} MiB" in refused
    assert "--max-memory-mb-per-user" in refused


SNAPSHOT_NAMED_MINE = """
import json
from agentcell import Sandbox
sbx = Sandbox.create(timeout=120)
sbx.files.write("/home/user/whose", "WHO")
snap = sbx.create_snapshot(name="mine")
sbx.kill()
print(json.dumps({"id": snap.snapshot_id}))
"""

SNAPSHOT_SEEN = """
import json
from agentcell import Sandbox
listed = [s.snapshot_id for s in Sandbox.list_snapshots()]
child = Sandbox.create("mine:default", timeout=60)
whose = child.files.read("/home/user/whose")
child.kill()
print(json.dumps({"listed": listed, "whose": whose}))
"""


def test_snapshot_names_are_per_user(host: Host, service: Service) -> None:
    """Two users may both name a snapshot "mine": each name resolves among its user's own snapshots."""
    for role in ("member", "other"):
        made = answer(as_user(host, role, SNAPSHOT_NAMED_MINE.replace("WHO", role), service.socket))
        assert made == {"id": "mine:default"}  # the other's "mine" took nothing from this one (it was 409)
    for role in ("member", "other"):
        assert answer(as_user(host, role, SNAPSHOT_SEEN, service.socket)) == {"listed": ["mine:default"], "whose": role}
    # root, the administrator, sees both
    assert [s["snapshotID"] for s in service.client.get("/snapshots").json()].count("mine:default") == 2
    # a user's delete is of its own: the other's "mine" stays, and a second delete finds nothing
    delete = "import json; from agentcell import Sandbox; print(json.dumps([Sandbox.delete_snapshot('mine:default') for _ in range(2)]))"
    assert answer(as_user(host, "other", delete, service.socket)) == [True, False]
    assert answer(as_user(host, "member", SNAPSHOT_SEEN, service.socket)) == {"listed": ["mine:default"], "whose": "member"}
    assert answer(as_user(host, "member", delete, service.socket)) == [True, False]
    assert service.client.get("/snapshots").json() == []


def test_socket_is_root_and_group_only(host: Host, service: Service) -> None:
    st = os.stat(service.socket)
    assert (st.st_mode & 0o777, st.st_uid, grp.getgrgid(st.st_gid).gr_name) == (0o660, 0, host.group)


CONNECT = """
import json
from agentcell import Sandbox, NotFoundException
try:
    sbx = Sandbox.connect({sid!r})
    print(json.dumps({{"out": sbx.commands.run("cat /home/user/kept").stdout}}))
except NotFoundException:
    print(json.dumps({{"out": "not found"}}))
"""


def test_a_paused_sandbox_stays_its_owners_across_a_restart(host: Host) -> None:
    """The owner is kept with a sandbox paused on disk: after the service restarts, only its owner resumes it."""
    first = Service(host.group)
    state = first.state
    try:
        code = CREATE + "sbx.files.write('/home/user/kept', 'still mine')\nsbx.pause(keep_memory=False)\n"
        made = answer(as_user(host, "member", code, first.socket))
    finally:
        first.stop(keep_state=True)
    second = Service(host.group, state=state)
    try:
        connect = CONNECT.format(sid=made["id"])
        assert answer(as_user(host, "other", connect, second.socket)) == {"out": "not found"}
        assert answer(as_user(host, "member", connect, second.socket)) == {"out": "still mine"}
    finally:
        second.stop()


def test_socket_activation(host: Host) -> None:
    """The socket systemd passes (fd 3, LISTEN_PID/LISTEN_FDS) is the one served: not --uds."""
    sock_dir = _readable_dir("agentcell-activated-")
    path = str(sock_dir / "activated.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chown(path, 0, grp.getgrnam(host.group).gr_gid)
    os.chmod(path, 0o660)
    listener.listen(16)
    svc = Service(host.group, activated=listener)
    listener.close()  # the server holds its own descriptor
    try:
        assert not os.path.exists(svc.dir / "agentcell.sock")  # --uds was not bound
        code = "import json; from agentcell import Sandbox; print(json.dumps({'n': len(Sandbox.list().next_items())}))"
        assert answer(as_user(host, "member", code, path)) == {"n": 0}
    finally:
        svc.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_tcp_listener_needs_a_key(host: Host) -> None:
    done = subprocess.run([*units.service_command(sys.executable, host.group, ["--system-tcp"])], cwd=REPO,
                          capture_output=True, text=True, timeout=60, env={**os.environ, "AGENTCELL_SERVER_API_KEY": ""})
    assert done.returncode != 0
    assert "--system-tcp needs --api-key" in done.stderr


# --- agentcell system install / uninstall --------------------------------------------------------------


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentcell", "system", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_install_dry_run_prints_the_plan_and_changes_nothing() -> None:
    group = f"acdry{uuid.uuid4().hex[:6]}"
    unit = Path("/etc/systemd/system") / units.SOCKET_UNIT
    before = unit.exists()
    done = _cli("install", "--dry-run", "--group", group, "--no-packages")
    assert done.returncode == 0, done.stderr
    assert f"would create the system group '{group}'" in done.stdout
    assert f"would write {unit}" in done.stdout and "ListenStream=/run/agentcell/agentcell.sock" in done.stdout
    assert "serve --system --socket-group " + group in done.stdout
    with pytest.raises(KeyError):
        grp.getgrnam(group)
    assert unit.exists() == before


def test_install_into_a_root_writes_units_systemd_accepts(tmp_path: Path) -> None:
    done = _cli("install", "--root", str(tmp_path), "--serve-arg=--max-sandboxes-per-user=5")
    assert done.returncode == 0, done.stderr
    unit_dir = tmp_path / "etc/systemd/system"
    socket_unit, service_unit = (unit_dir / units.SOCKET_UNIT).read_text(), (unit_dir / units.SERVICE_UNIT).read_text()
    assert "SocketMode=0660" in socket_unit and "SocketGroup=agentcell" in socket_unit
    assert f"ExecStart={sys.executable} -m agentcell serve --system --socket-group agentcell " \
           "--max-sandboxes-per-user=5" in service_unit
    if shutil.which("systemd-analyze"):
        verify = subprocess.run(["systemd-analyze", "verify", units.SOCKET_UNIT, units.SERVICE_UNIT], cwd=unit_dir,
                                capture_output=True, text=True, timeout=60)
        problems = [line for line in verify.stderr.splitlines() if units.SERVICE_UNIT in line or
                    units.SOCKET_UNIT in line or "Unknown" in line or "ignoring" in line]
        assert verify.returncode == 0 and not problems, verify.stderr
    again = _cli("install", "--root", str(tmp_path), "--serve-arg=--max-sandboxes-per-user=5")
    assert "nothing to change" in again.stdout  # an install run again changes nothing
    removed = _cli("uninstall", "--root", str(tmp_path))
    assert removed.returncode == 0 and f"remove {unit_dir / units.SOCKET_UNIT}" in removed.stdout
    assert not any(unit_dir.iterdir())
