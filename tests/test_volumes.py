"""Volumes (docs/volumes.md) for real: a server of this module's own (its state directory is restarted
on), the official e2b SDK and agentcell's, real sandboxes mounting them, and the attacks of issue 30:
symlinks and `..` out of a volume, a quota filled from two mounts at once, another tenant, a sandbox
without the mount.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from conftest import GVISOR
from e2b import NotFoundException as E2BNotFound
from e2b import Sandbox as E2BSandbox
from e2b import Volume as E2BVolume
from e2b.exceptions import VolumeException, VolumeNotFoundException
from helpers import e2b_pointed_at
from servers import ServerProcess, free_port

from agentcell import AsyncVolume, InvalidArgumentException, NotFoundException, Sandbox, Volume

pytestmark = [
    pytest.mark.skipif(bool(os.environ.get("AGENTCELL_TEST_SERVER_URL")),
                       reason="these tests start and restart a server of their own"),
    pytest.mark.skipif(os.geteuid() != 0, reason="volumes are loop-mounted ext4 images: a root server"),
]

KEY = "e2b_" + "0" * 40
BACKEND_ARGS = ("--backend", "gvisor") if GVISOR else ()


class VolumeServer:
    """`agentcell serve` on a state directory that outlives its restarts."""

    def __init__(self, *extra: str) -> None:
        self.state = Path(tempfile.mkdtemp(prefix="agentcell-vol-state-"))
        self.port = free_port()
        self.extra = extra
        self.proc: ServerProcess | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> VolumeServer:
        # 64 MiB volumes unless a test asks: each one's size is reserved on this machine's disk
        self.proc = ServerProcess(self.state.parent / f"{self.state.name}.log", "--api-key", KEY, "--state-dir",
                                  str(self.state), "--egress-uplink", "none", "--volume-size-mb", "64",
                                  *BACKEND_ARGS, *self.extra,
                                  port=self.port, command=(sys.executable, "-m", "agentcell", "serve"))
        self.proc.started()
        return self

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.stop()
            self.proc = None

    def remove(self) -> None:
        """Stopped, and its state directory gone (the server unmounted its volumes when it stopped)."""
        self.stop()
        shutil.rmtree(self.state, ignore_errors=True)

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-KEY": KEY}, timeout=60)


@pytest.fixture(scope="module")
def srv() -> Iterator[VolumeServer]:
    s = VolumeServer().start()
    with e2b_pointed_at(s.url):
        os.environ["E2B_API_KEY"] = KEY
        yield s
    s.remove()


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


# --- the API, through the official SDK --------------------------------------------------------------


def test_e2b_sdk_volume_lifecycle(srv: VolumeServer) -> None:
    vol = E2BVolume.create(unique("life"))
    assert vol.token and vol.volume_id
    info = E2BVolume.get_info(vol.volume_id)
    assert (info.name, info.token) == (vol.name, vol.token)
    assert vol.volume_id in [v.volume_id for v in E2BVolume.list()]
    again = E2BVolume.connect(vol.volume_id)
    assert again.name == vol.name
    assert E2BVolume.destroy(vol.volume_id) is True
    assert vol.volume_id not in [v.volume_id for v in E2BVolume.list()]
    assert E2BVolume.destroy(vol.volume_id) is False
    with pytest.raises(VolumeNotFoundException):
        E2BVolume.get_info(vol.volume_id)
    r = srv.api().post("/volumes", json={"name": "../etc"})
    assert r.status_code == 400, r.text


def test_e2b_sdk_content_without_a_sandbox(srv: VolumeServer) -> None:
    import io

    vol = E2BVolume.create(unique("content"))
    try:
        stat = vol.write_file("/hello.txt", "Hello, World!")
        assert (stat.name, stat.type.value, stat.path, stat.size) == ("hello.txt", "file", "/hello.txt", 13)
        assert vol.read_file("/hello.txt") == "Hello, World!"
        vol.write_file("/bin.dat", bytes(range(256)) * 1000)
        assert vol.read_file("/bin.dat", format="bytes") == bytes(range(256)) * 1000
        assert b"".join(vol.read_file("/bin.dat", format="stream")) == bytes(range(256)) * 1000
        vol.write_file("/from-io.txt", io.BytesIO(b"streamed"))
        assert vol.read_file("/from-io.txt") == "streamed"
        vol.write_file("/empty.txt", "")
        assert vol.read_file("/empty.txt") == ""
        with pytest.raises(VolumeException):
            vol.write_file("/hello.txt", "again")  # exists, no force
        vol.write_file("/hello.txt", "replaced", force=True)
        assert vol.read_file("/hello.txt") == "replaced"
        vol.write_file("/meta.txt", "m", uid=1001, gid=1002, mode=0o640)
        meta = vol.get_info("/meta.txt")
        assert (meta.uid, meta.gid, meta.mode) == (1001, 1002, 0o640)
        assert vol.update_metadata("/meta.txt", mode=0o600, uid=0).mode == 0o600
        with pytest.raises(E2BNotFound):
            vol.update_metadata("/missing", mode=0o644)

        with pytest.raises(E2BNotFound):
            vol.make_dir("/a/b/c")  # no parents without force
        made = vol.make_dir("/a/b/c", force=True, mode=0o750)
        assert (made.type.value, made.mode) == ("directory", 0o750)
        with pytest.raises(VolumeException):
            vol.make_dir("/a/b/c")
        vol.make_dir("/a/b/c", force=True)
        vol.write_file("/a/b/c/f.txt", "deep")
        assert sorted(e.name for e in vol.list("/")) == ["a", "bin.dat", "empty.txt", "from-io.txt", "hello.txt",
                                                          "meta.txt"]
        assert [e.path for e in vol.list("/a", depth=3)] == ["/a/b", "/a/b/c", "/a/b/c/f.txt"]
        with pytest.raises(E2BNotFound):
            vol.list("/nope")
        assert vol.exists("/a/b/c/f.txt") and not vol.exists("/nope")
        vol.remove("/a")
        assert not vol.exists("/a/b/c/f.txt")
        with pytest.raises(E2BNotFound):
            vol.remove("/a")
        # the content API takes the volume's token, nothing else
        r = httpx.get(f"{srv.url}/volumecontent/{vol.volume_id}/path", params={"path": "/"},
                      headers={"X-API-KEY": KEY})
        assert r.status_code == 401
        r = httpx.get(f"{srv.url}/volumecontent/{vol.volume_id}/path", params={"path": "/"},
                      headers={"Authorization": "Bearer " + vol.token[:-1] + "x"})
        assert r.status_code == 401
    finally:
        E2BVolume.destroy(vol.volume_id)


# --- mounts -----------------------------------------------------------------------------------------


def test_one_volume_in_several_sandboxes_rw_and_ro(srv: VolumeServer) -> None:
    vol = E2BVolume.create(unique("shared"))
    vol.write_file("/seed.txt", "from the API")
    a = E2BSandbox.create(volume_mounts={"/mnt/data": vol})
    b = E2BSandbox.create(volume_mounts={"/home/user/shared": vol.name})  # by name, as the SDK allows
    r = srv.api().post("/sandboxes", json={"templateID": "base", "volumeMounts": [
        {"name": vol.name, "path": "/mnt/ro", "readOnly": True}]})
    assert r.status_code == 201, r.text
    c = E2BSandbox.connect(r.json()["sandboxID"])
    try:
        assert a.commands.run("cat /mnt/data/seed.txt").stdout == "from the API"
        a.commands.run("echo from-a > /mnt/data/a.txt && mkdir /mnt/data/dir && echo x > /mnt/data/dir/x")
        # the other sandbox sees it at once, as its own user's file (the idmapped mount)
        out = b.commands.run("cat /home/user/shared/a.txt; stat -c '%U %a' /home/user/shared/a.txt").stdout
        assert out == "from-a\nuser 644\n"
        b.commands.run("echo from-b >> /home/user/shared/a.txt")
        assert vol.read_file("/a.txt") == "from-a\nfrom-b\n"
        assert vol.get_info("/a.txt").uid == 1000
        root_file = a.commands.run("sudo sh -c 'echo r > /mnt/data/root.txt'; stat -c %u /mnt/data/root.txt")
        assert root_file.stdout.strip() == "0" and vol.get_info("/root.txt").uid == 0
        # read-only: for its user and its root alike, and its root cannot remount or unmount it
        assert c.commands.run("cat /mnt/ro/a.txt").stdout == "from-a\nfrom-b\n"
        for cmd in ("touch /mnt/ro/new", "sudo touch /mnt/ro/new", "sudo mount -o remount,rw /mnt/ro",
                    "sudo umount /mnt/ro", "sudo rm /mnt/ro/a.txt"):
            assert c.commands.run(cmd + " 2>&1; echo rc=$?").stdout.strip().endswith(("rc=1", "rc=32")), cmd
        assert "ro," in c.commands.run("grep ' /mnt/ro ' /proc/self/mountinfo").stdout
        assert not vol.exists("/new")
        # get_info lists them (E2B's volumeMounts)
        info = srv.api().get(f"/sandboxes/{a.sandbox_id}").json()
        assert info["volumeMounts"] == [{"name": vol.name, "path": "/mnt/data"}]
        # destroy refuses while mounted: 409, nothing lost
        with pytest.raises(VolumeException, match="mounted by sandbox"):
            E2BVolume.destroy(vol.volume_id)
        assert vol.read_file("/seed.txt") == "from the API"
    finally:
        for s in (a, b, c):
            s.kill()
    # killed: the data stays, the volume can go
    again = E2BSandbox.create(volume_mounts={"/mnt/data": vol})
    try:
        assert again.commands.run("cat /mnt/data/dir/x").stdout == "x\n"
    finally:
        again.kill()
    assert E2BVolume.destroy(vol.volume_id) is True


def test_bad_mounts_are_refused_clearly(srv: VolumeServer) -> None:
    vol = E2BVolume.create(unique("bad"))
    api = srv.api()
    try:
        cases = {
            "not found": ([{"name": "no-such-volume", "path": "/mnt/x"}], 404),
            "relative": ([{"name": vol.name, "path": "mnt/x"}], 400),
            "dotdot": ([{"name": vol.name, "path": "/mnt/../etc"}], 400),
            "system dir": ([{"name": vol.name, "path": "/etc/x"}], 400),
            "the template's root": ([{"name": vol.name, "path": "/data"}], 400),
            "the root": ([{"name": vol.name, "path": "/"}], 400),
            "overlap": ([{"name": vol.name, "path": "/mnt/a"}, {"name": vol.name, "path": "/mnt/a/b"}], 400),
            "not a list": ({"name": vol.name}, 400),
        }
        for what, (mounts, status) in cases.items():
            r = api.post("/sandboxes", json={"templateID": "base", "volumeMounts": mounts})
            assert r.status_code == status, (what, r.text)
            assert r.json()["message"], what
    finally:
        E2BVolume.destroy(vol.volume_id)


# --- agentcell's SDK -------------------------------------------------------------------------------


def test_agentcell_sdk_sync_and_async(srv: VolumeServer) -> None:
    vol = Volume.create(unique("ours"), size_mb=32, api_url=srv.url, api_key=KEY)
    try:
        vol.write_file("/x.txt", "ours")
        assert Volume.get_info(vol.volume_id, api_url=srv.url, api_key=KEY).size_mb == 32
        assert vol.volume_id in [v.volume_id for v in Volume.list(api_url=srv.url, api_key=KEY)]
        with Sandbox.create(api_url=srv.url, api_key=KEY,
                            volume_mounts={"/mnt/rw": vol, "/mnt/ro": {"volume": vol, "read_only": True}}) as sbx:
            assert sbx.commands.run("cat /mnt/ro/x.txt").stdout == "ours"
            sbx.commands.run("echo more > /mnt/rw/y.txt")
            assert "Read-only" in sbx.commands.run("touch /mnt/ro/z 2>&1 || true").stdout
        assert vol.read_file("/y.txt") == "more\n"
        with pytest.raises(NotFoundException):
            vol.read_file("/none")

        async def async_part() -> None:
            avol = await AsyncVolume.connect(vol.volume_id, api_url=srv.url, api_key=KEY)
            await avol.write_file("/async.txt", b"async bytes")
            assert await avol.read_file("/async.txt", format="bytes") == b"async bytes"
            await avol.make_dir("/ad/sub", force=True)
            assert [e.name for e in await avol.list("/ad")] == ["sub"]
            assert (await avol.update_metadata("/async.txt", mode=0o600)).mode == 0o600
            chunks = [c async for c in await avol.read_file("/async.txt", format="stream")]
            assert b"".join(chunks) == b"async bytes"
            await avol.remove("/ad")
            assert not await avol.exists("/ad")

        asyncio.run(async_part())
        with pytest.raises(InvalidArgumentException):
            Sandbox.create(api_url=srv.url, api_key=KEY, volume_mounts={"/etc/nope": vol})
    finally:
        assert Volume.destroy(vol.volume_id, api_url=srv.url, api_key=KEY)


# --- attacks ---------------------------------------------------------------------------------------


def test_symlinks_and_dotdot_never_leave_the_volume(srv: VolumeServer, host_secret: Path) -> None:
    """A sandbox plants links in the volume; the content API (host root) never follows one."""
    secret = host_secret.read_text()
    vol = E2BVolume.create(unique("links"))
    sbx = E2BSandbox.create(volume_mounts={"/mnt/v": vol})
    try:
        sbx.commands.run(f"cd /mnt/v && ln -s {host_secret} secret && ln -s / root && ln -s /tmp tmpdir "
                         f"&& ln -s ../../../../../.. up && mkfifo fifo && mkdir d && ln -s {host_secret} d/s")
        for path in ("/secret", "/root" + str(host_secret), "/up" + str(host_secret), "/../../.." + str(host_secret),
                     "/d/s", "/fifo", "/tmpdir/" + host_secret.name):
            with pytest.raises((E2BNotFound, VolumeException)):
                got = vol.read_file(path)
                assert secret not in got
        link = vol.get_info("/secret")
        assert (link.type.value, link.target) == ("symlink", str(host_secret))  # the link itself, not its target
        with pytest.raises(VolumeException):
            vol.list("/root")
        for path in ("/root/evil", "/tmpdir/evil"):
            with pytest.raises(VolumeException):
                vol.write_file(path, "x")
        assert not Path("/evil").exists() and not Path("/tmp/evil").exists()
        # writing "over" a link replaces the link, never its target
        vol.write_file("/secret", "overwritten", force=True)
        assert host_secret.read_text() == secret
        sbx.commands.run(f"ln -s {host_secret} /mnt/v/secret2")
        with pytest.raises(VolumeException):
            vol.update_metadata("/secret2", mode=0o777)
        vol.update_metadata("/secret2", uid=1000)  # lchown: the link
        assert oct(host_secret.stat().st_mode & 0o777) != "0o777" and host_secret.stat().st_uid == 0
        vol.remove("/root")  # the link goes, / stays
        vol.remove("/d")
        assert host_secret.exists() and Path("/etc/passwd").exists()
        # `..` in a path stays inside: /../x is the volume's /x
        vol.write_file("/../../../x.txt", "inside")
        assert sbx.commands.run("cat /mnt/v/x.txt").stdout == "inside"
        # from inside the sandbox: `..` and links resolve in the sandbox's own root, never the host's
        out = sbx.commands.run(f"cat /mnt/v/../../..{host_secret} 2>&1; cat /mnt/v/up{host_secret} 2>&1; true").stdout
        assert secret not in out.replace(str(host_secret), ""), out  # (its name holds the token too)
    finally:
        sbx.kill()
        E2BVolume.destroy(vol.volume_id)


def test_quota_filled_from_two_mounts(srv: VolumeServer) -> None:
    r = srv.api().post("/volumes", json={"name": unique("quota"), "sizeMB": 16})
    assert r.status_code == 201, r.text
    vol = E2BVolume.connect(r.json()["volumeID"])
    image = srv.state / "volumes" / vol.volume_id / "image.ext4"
    assert image.stat().st_blocks * 512 >= 16 << 20  # its disk is reserved: quotas never overcommit the host's
    a = E2BSandbox.create(volume_mounts={"/mnt/q": vol})
    b = E2BSandbox.create(volume_mounts={"/mnt/q": vol})
    try:
        # A fills the volume while B writes: both meet ENOSPC, nobody gets past the image's size
        fill = "dd if=/dev/zero of=/mnt/q/{n} bs=1M count=64 2>&1; echo rc=$?"
        ha = a.commands.run(fill.format(n="a"), background=True)
        hb = b.commands.run(fill.format(n="b"), background=True)
        ra, rb = _finished(ha), _finished(hb)
        assert "No space left on device" in ra and "rc=1" in ra, ra
        assert "No space left on device" in rb and "rc=1" in rb, rb
        used = a.commands.run("du -sm /mnt/q | cut -f1").stdout.strip()
        assert int(used) <= 16, used
        # the content API too: 507, and the old file stays as it was
        with pytest.raises(VolumeException, match="full"):
            vol.write_file("/big.bin", b"\0" * (20 << 20))
        assert not vol.exists("/big.bin")
        # the host's disk and the server are fine: another sandbox starts, freeing space works
        with Sandbox.create(api_url=srv.url, api_key=KEY) as other:
            assert other.commands.run("echo ok").stdout == "ok\n"
        vol.remove("/a")
        assert b.commands.run("echo after > /mnt/q/after && cat /mnt/q/after").stdout == "after\n"
    finally:
        a.kill()
        b.kill()
        E2BVolume.destroy(vol.volume_id)


def _finished(handle: object) -> str:
    from e2b import CommandExitException

    try:
        return handle.wait().stdout  # type: ignore[attr-defined]
    except CommandExitException as e:
        return e.stdout


def test_a_sandbox_without_the_mount_cannot_reach_it(srv: VolumeServer) -> None:
    marker = uuid.uuid4().hex
    vol = E2BVolume.create(unique("private"))
    vol.write_file(f"/{marker}.txt", marker)
    holder = E2BSandbox.create(volume_mounts={"/mnt/p": vol})
    outsider = E2BSandbox.create()
    try:
        assert holder.commands.run(f"cat /mnt/p/{marker}.txt").stdout == marker
        probe = outsider.commands.run(
            "cat /proc/self/mountinfo; ls /dev; ls /mnt /srv /opt 2>&1; "
            f"sudo find / -path /proc -prune -o -path /sys -prune -o -name '{marker}*' -print 2>/dev/null; "
            f"sudo grep -rl {marker} /tmp /home /mnt /srv /opt /root 2>/dev/null; true", timeout=120).stdout
        assert marker not in probe
        assert "/dev/loop" not in probe and "idmapped" not in probe
    finally:
        holder.kill()
        outsider.kill()
        E2BVolume.destroy(vol.volume_id)


def test_data_survives_a_server_restart() -> None:
    s = VolumeServer().start()
    try:
        with e2b_pointed_at(s.url):
            os.environ["E2B_API_KEY"] = KEY
            vol = E2BVolume.create(unique("persist"))
            sbx = E2BSandbox.create(volume_mounts={"/mnt/d": vol})
            sbx.commands.run("echo kept > /mnt/d/kept.txt")
            paused = E2BSandbox.create(volume_mounts={"/mnt/p": vol})
            assert s.api().post(f"/sandboxes/{paused.sandbox_id}/pause", json={"memory": False}).status_code == 204
            s.stop()  # the running sandbox dies with the server; the volume's image stays, unmounted
            assert not os.path.ismount(s.state / "volumes" / vol.volume_id / "mnt")
            s.start()
            assert E2BVolume.get_info(vol.volume_id).token == vol.token
            assert vol.read_file("/kept.txt") == "kept\n"
            again = E2BSandbox.create(volume_mounts={"/mnt/d": vol})
            assert again.commands.run("cat /mnt/d/kept.txt").stdout == "kept\n"
            again.kill()
            # the paused one, kept across the restart, mounts it again when it resumes
            with pytest.raises(VolumeException, match="mounted by sandbox"):
                E2BVolume.destroy(vol.volume_id)
            resumed = E2BSandbox.connect(paused.sandbox_id)
            assert resumed.commands.run("cat /mnt/p/kept.txt").stdout == "kept\n"
            resumed.kill()
            assert E2BVolume.destroy(vol.volume_id)
            assert not (s.state / "volumes" / vol.volume_id).exists()
    finally:
        s.remove()


def test_a_volume_is_no_way_around_the_exec_policy(srv: VolumeServer) -> None:
    vol = Volume.create(unique("policy"), api_url=srv.url, api_key=KEY)
    try:
        with Sandbox.create(api_url=srv.url, api_key=KEY, volume_mounts={"/mnt/v": vol},
                            policy={"exec": {"default": "deny", "allow": ["bash", "sh", "cp"]}}) as sbx:
            out = sbx.commands.run("cp /usr/bin/id /mnt/v/id && /mnt/v/id 2>&1; echo rc=$?").stdout
            assert "Operation not permitted" in out and "rc=126" in out, out
    finally:
        Volume.destroy(vol.volume_id, api_url=srv.url, api_key=KEY)


# --- tenants ---------------------------------------------------------------------------------------


def _as_nobody(sock: str, calls: list[tuple[str, str, object]]) -> list[tuple[int, object]]:
    """`calls` (method, path, json) on the unix socket as uid 65534 (another tenant than the TCP key)."""
    import grp

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drops to nobody, then asks
        try:
            os.close(read)
            gid = grp.getgrnam("nogroup").gr_gid
            os.setgroups([gid])
            os.setgid(gid)
            os.setuid(65534)
            out = []
            with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://localhost", timeout=60) as c:
                for method, path, body in calls:
                    r = c.request(method, path, json=body)
                    try:
                        out.append((r.status_code, r.json()))
                    except ValueError:
                        out.append((r.status_code, r.text))
            os.write(write, json.dumps(out).encode())
        finally:
            os._exit(0)
    os.close(write)
    data = b""
    while chunk := os.read(read, 1 << 16):
        data += chunk
    os.close(read)
    os.waitpid(pid, 0)
    return [tuple(x) for x in json.loads(data)]  # type: ignore[misc]


def test_another_tenant_cannot_see_mount_or_read_it() -> None:
    sock_dir = tempfile.mkdtemp(prefix="agentcell-vol-sock-")
    os.chmod(sock_dir, 0o755)
    sock = f"{sock_dir}/agentcell.sock"
    state = Path(tempfile.mkdtemp(prefix="agentcell-vol-state-"))
    port = free_port()
    argv = [sys.executable, "-m", "agentcell", "serve", "--system", "--socket-group", "nogroup", "--uds", sock,
            "--system-tcp", "--host", "127.0.0.1", "--port", str(port), "--api-key", KEY, "--state-dir", str(state),
            "--egress-uplink", "none", "--standbys", "0", "--volume-size-mb", "64", *BACKEND_ARGS]
    srv = ServerProcess(state.parent / f"{state.name}.log", command=argv, uds=sock, address_args=False,
                        own_state_dir=False, ready_status=200)
    srv.started()
    tcp = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers={"X-API-KEY": KEY}, timeout=60)
    try:
        mine = tcp.post("/volumes", json={"name": "tenant-a"}).json()
        name = mine["name"]
        theirs = _as_nobody(sock, [
            ("GET", "/volumes", None),
            ("GET", f"/volumes/{mine['volumeID']}", None),
            ("DELETE", f"/volumes/{mine['volumeID']}", None),
            ("POST", "/sandboxes", {"templateID": "base", "volumeMounts": [{"name": name, "path": "/mnt/x"}]}),
            ("POST", "/sandboxes", {"templateID": "base", "volumeMounts": [{"name": mine["volumeID"],
                                                                            "path": "/mnt/x"}]}),
            ("POST", "/volumes", {"name": name}),  # the same name is free for another tenant
        ])
        assert theirs[0] == (200, [])
        assert [t[0] for t in theirs[1:5]] == [404, 404, 404, 404], theirs
        assert theirs[5][0] == 201
        their_volume = theirs[5][1]
        assert isinstance(their_volume, dict) and their_volume["volumeID"] != mine["volumeID"]
        # and the other way round: the key's tenant does not see the socket user's volume
        assert [v["volumeID"] for v in tcp.get("/volumes").json()] == [mine["volumeID"]]
        assert tcp.get(f"/volumes/{their_volume['volumeID']}").status_code == 404
        # a mount by that name is the caller's own volume, never the other's
        r = tcp.post("/sandboxes", json={"templateID": "base", "volumeMounts": [{"name": name, "path": "/mnt/x"}]})
        assert r.status_code == 201, r.text
        sid = r.json()["sandboxID"]
        assert tcp.get(f"/sandboxes/{sid}").json()["volumeMounts"] == [{"name": name, "path": "/mnt/x"}]
        with contextlib.suppress(Exception):
            tcp.delete(f"/sandboxes/{sid}")
    finally:
        tcp.close()
        srv.stop()
        shutil.rmtree(state, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)


def test_rootless_refuses_clearly(tmp_path: Path) -> None:
    """What an unprivileged server says (the store's check, as `agentcell serve --rootless` runs it)."""
    code = ("import os; from agentcell.volumes.store import VolumeStore; os.setuid(65534); "
            "print(VolumeStore.unavailable())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "root" in out.stdout and "rootless" in out.stdout, out


# --- the gvisor backend -------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("runsc") is None, reason="the gvisor backend needs runsc")
def test_gvisor_sandboxes_share_a_volume() -> None:
    s = VolumeServer("--backend", "gvisor", "--standbys", "0") if not GVISOR else VolumeServer("--standbys", "0")
    s.start()
    try:
        with e2b_pointed_at(s.url):
            os.environ["E2B_API_KEY"] = KEY
            vol = E2BVolume.create(unique("gv"))
            vol.write_file("/seed.txt", "seed")
            a = E2BSandbox.create(volume_mounts={"/mnt/data": vol})
            r = s.api().post("/sandboxes", json={"templateID": "base", "volumeMounts": [
                {"name": vol.name, "path": "/mnt/ro", "readOnly": True}]})
            assert r.status_code == 201, r.text
            b = E2BSandbox.connect(r.json()["sandboxID"])
            try:
                assert a.commands.run("cat /mnt/data/seed.txt; echo a > /mnt/data/a.txt").stdout == "seed"
                assert b.commands.run("cat /mnt/ro/a.txt").stdout == "a\n"
                assert vol.get_info("/a.txt").uid == 1000
                for cmd in ("touch /mnt/ro/x", "sudo touch /mnt/ro/x"):
                    assert "Read-only" in b.commands.run(cmd + " 2>&1; true").stdout
                bad = s.api().post("/sandboxes", json={"templateID": "base", "volumeMounts": [
                    {"name": vol.name, "path": "/home/user/v"}]})
                assert bad.status_code == 400 and "/mnt" in bad.json()["message"]
                # a checkpoint cannot carry a host mount: refused, clearly
                paused = s.api().post(f"/sandboxes/{a.sandbox_id}/pause")
                assert paused.status_code == 400 and "volumes" in paused.json()["message"]
            finally:
                a.kill()
                b.kill()
            assert E2BVolume.destroy(vol.volume_id)
    finally:
        s.remove()


# --- through the gateway --------------------------------------------------------------------------------


def test_volumes_through_the_gateway(tmp_path: Path) -> None:
    from servers import GatewayProcess

    ids = ("volcella", "volcellb")
    cells = [ServerProcess(tmp_path / f"{c}.log", "--cell-id", c, "--standbys", "0", "--egress-uplink", "none",
                           "--volume-size-mb", "64", "--state-dir", str(tmp_path / f"{c}-state"), *BACKEND_ARGS)
             for c in ids]
    gw: GatewayProcess | None = None
    try:
        for c in cells:
            c.started()
        gw = GatewayProcess(tmp_path / "gw.log", [c.url for c in cells])
        gw.started()
        a = httpx.post(f"{cells[0].url}/volumes", json={"name": "on-a"}).json()
        b = httpx.post(f"{cells[1].url}/volumes", json={"name": "on-b"}).json()
        assert a["volumeID"].startswith(ids[0]) and b["volumeID"].startswith(ids[1])
        assert {v["name"] for v in httpx.get(f"{gw.url}/volumes").json()} >= {"on-a", "on-b"}
        placed = httpx.post(f"{gw.url}/volumes", json={"name": "placed"})
        assert placed.status_code == 201 and placed.json()["volumeID"][:8] in ids
        with e2b_pointed_at(gw.url):
            vol_a, vol_b = E2BVolume.connect(a["volumeID"]), E2BVolume.connect(b["volumeID"])
            vol_a.write_file("/a.txt", "on cell a")  # /volumecontent through the gateway, to its cell
            vol_b.write_file("/b.txt", "on cell b")
            for vol, cell, name in ((vol_a, ids[0], "a.txt"), (vol_b, ids[1], "b.txt")):
                sbx = E2BSandbox.create(volume_mounts={"/mnt/v": vol})  # lands on the volume's cell
                try:
                    assert sbx.sandbox_id.startswith(cell)
                    assert sbx.commands.run(f"cat /mnt/v/{name}").stdout == f"on cell {cell[-1]}"
                finally:
                    sbx.kill()
            both = httpx.post(f"{gw.url}/sandboxes", json={"templateID": "base", "volumeMounts": [
                {"name": "on-a", "path": "/mnt/a"}, {"name": "on-b", "path": "/mnt/b"}]})
            assert both.status_code == 400, both.text
            assert ids[0] in both.json()["message"] and ids[1] in both.json()["message"]
            assert httpx.get(f"{gw.url}/volumes/{b['volumeID']}").json()["name"] == "on-b"
            assert E2BVolume.destroy(a["volumeID"]) and E2BVolume.destroy(b["volumeID"])
            assert httpx.get(f"{gw.url}/volumes/{a['volumeID']}").status_code == 404
    finally:
        if gw is not None:
            gw.stop()
        for c in cells:
            c.stop()


@pytest.mark.skipif(GVISOR, reason="gvisor refuses checkpoints of sandboxes with volumes (test_gvisor_sandboxes_share_a_volume)")
def test_a_linux_fork_mounts_the_same_volume(srv: VolumeServer) -> None:
    """A filesystem fork (linux) copies the sandbox's own disk; its volumes are mounted again, shared, not
    copied: what the fork writes there the original reads, and destroying waits for both to end."""
    vol = E2BVolume.create(unique("fork"))
    a = E2BSandbox.create(volume_mounts={"/mnt/data": vol})
    forks: list[E2BSandbox] = []
    try:
        a.commands.run("echo own > /home/user/own.txt && echo shared > /mnt/data/s.txt")
        forks = a.fork()  # type: ignore[assignment]
        forks = forks if isinstance(forks, list) else [forks]
        f = forks[0]
        assert f.commands.run("cat /home/user/own.txt /mnt/data/s.txt").stdout == "own\nshared\n"
        f.commands.run("echo from-fork > /mnt/data/f.txt")
        assert a.commands.run("cat /mnt/data/f.txt").stdout == "from-fork\n"
        assert "/mnt/data" in f.commands.run("grep ' /mnt/data ' /proc/self/mountinfo").stdout
    finally:
        for s in (a, *forks):
            s.kill()
    assert E2BVolume.destroy(vol.volume_id) is True
