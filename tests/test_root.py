"""Root inside a sandbox and its copy-on-write root filesystem, through the unchanged e2b SDK.

The sandbox's root is uid 0 of its own user namespace only (a host id of its own, never host root),
with a bounded capability set; /usr, /etc, /var, /opt ... are overlays whose changes land on the
sandbox's disk and never on the host (docs/security.md "Root inside a sandbox").
"""

from __future__ import annotations

import io
import os
import subprocess
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from e2b import CommandExitException, Sandbox

from agentcell.backends.linux.sandbox_init import ROOT_CAPS_MASK


@pytest.fixture(scope="module")
def sbx(e2b_env: str) -> Iterator[Sandbox]:
    s = Sandbox.create()
    yield s
    s.kill()


def run(s: Sandbox, cmd: str, user: str = "user") -> str:
    return s.commands.run(cmd, user=user).stdout  # type: ignore[arg-type]


def fails(s: Sandbox, cmd: str, user: str = "user") -> str:
    with pytest.raises(CommandExitException) as info:
        s.commands.run(cmd, user=user)  # type: ignore[arg-type]
    return info.value.stderr + info.value.stdout


def status(s: Sandbox, user: str) -> dict[str, str]:
    text = run(s, "cat /proc/self/status", user)
    return {k: v.strip() for k, _, v in (line.partition(":") for line in text.splitlines())}


def host_ids(s: Sandbox) -> dict[str, int]:
    """inside id -> host id, from the sandbox's uid_map."""
    return {r.split()[0]: int(r.split()[1]) for r in run(s, "cat /proc/self/uid_map").splitlines()}


def test_default_user_stays_user(sbx: Sandbox) -> None:
    assert run(sbx, "whoami; echo $HOME; pwd").split() == ["user", "/home/user", "/home/user"]
    st = status(sbx, "user")
    assert int(st["CapEff"], 16) == 0 and int(st["CapPrm"], 16) == 0 and st["NoNewPrivs"] == "1"


def test_root_is_uid_0_of_the_sandbox_only(sbx: Sandbox, e2b_env: str) -> None:
    assert run(sbx, "whoami; id -u; id -g; echo $HOME; pwd", "root").split() == ["root", "0", "0", "/root", "/root"]
    st = status(sbx, "root")
    assert int(st["CapEff"], 16) == ROOT_CAPS_MASK and int(st["CapBnd"], 16) == ROOT_CAPS_MASK
    assert st["NoNewPrivs"] == "1" and st["Seccomp"] == "2"
    ids = host_ids(sbx)
    assert set(ids) == {"0", "1000"} and ids["0"] != ids["1000"] and min(ids.values()) >= 1 << 20
    other = Sandbox.create()
    try:
        theirs = host_ids(other)
        assert not set(theirs.values()) & set(ids.values())  # no host id shared with another sandbox
    finally:
        other.kill()


def test_root_writes_the_system_and_the_host_never_changes(sbx: Sandbox) -> None:
    token = uuid.uuid4().hex[:12]
    paths = [f"/usr/local/bin/ac-{token}", f"/etc/ac-{token}", f"/var/lib/ac-{token}", f"/opt/ac-{token}",
             f"/usr/lib/ac-{token}", f"/root/ac-{token}", f"/srv/ac-{token}"]
    run(sbx, " && ".join(f"echo {token} > {p}" for p in paths), "root")
    assert run(sbx, f"cat {' '.join(paths)}", "root").split() == [token] * len(paths)
    # an existing host file changed and another removed inside ...
    run(sbx, "echo changed > /usr/share/common-licenses/GPL-3 && rm /usr/bin/true && echo '# x' >> /etc/hosts", "root")
    assert run(sbx, "head -1 /usr/share/common-licenses/GPL-3", "root") == "changed\n"
    assert "No such file" in fails(sbx, "/usr/bin/true")
    # ... and on the host nothing happened
    for p in paths:
        assert not os.path.exists(p), p
    assert os.path.exists("/usr/bin/true")
    assert Path("/usr/share/common-licenses/GPL-3").read_text().startswith("                    GNU GENERAL")
    # the files are root's inside; the default user reads them but cannot write the system
    assert run(sbx, f"stat -c %U:%G {paths[0]} /usr/bin/ls /etc").split() == ["root:root"] * 3
    for p in ("/usr/bin/ls", "/etc/passwd", f"/usr/local/bin/ac-{token}"):
        assert "Permission denied" in fails(sbx, f"echo x >> {p}"), p
    # another sandbox sees the template, not this one's changes
    other = Sandbox.create()
    try:
        assert "No such file" in fails(other, f"cat {paths[0]}", "root")
        assert run(other, "test -x /usr/bin/true && echo yes") == "yes\n"
    finally:
        other.kill()


def test_the_overlay_counts_against_the_disk(e2b_env: str) -> None:
    s = Sandbox.create()
    try:
        free_mb = int(run(s, "df -m --output=avail /tmp | tail -1"))
        out = fails(s, f"dd if=/dev/zero of=/usr/big bs=1M count={free_mb + 64}", "root")
        assert "No space left" in out, out
        assert run(s, "df -m --output=avail /tmp | tail -1").strip() in ("0", "1")  # one disk for all of it
        run(s, "rm /usr/big", "root")
        assert run(s, "echo ok") == "ok\n"
    finally:
        s.kill()


def _deb(tmp: Path, name: str) -> bytes:
    root = tmp / "pkg"
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        f"Package: {name}\nVersion: 1.0\nArchitecture: all\nMaintainer: agentcell tests <t@example.invalid>\n"
        "Description: a tiny package built by the test\n")
    (root / "usr/bin").mkdir(parents=True)
    tool = root / f"usr/bin/{name}"
    tool.write_text("#!/bin/sh\necho installed-by-dpkg\n")
    tool.chmod(0o755)
    subprocess.run(["dpkg-deb", "--root-owner-group", "--build", str(root), str(tmp / "p.deb")], check=True,
                   capture_output=True)
    return (tmp / "p.deb").read_bytes()


def test_dpkg_install_as_root_stays_in_the_sandbox(sbx: Sandbox, tmp_path: Path) -> None:
    name = "agentcell-demo-" + uuid.uuid4().hex[:8]
    sbx.files.write("/tmp/p.deb", _deb(tmp_path, name))
    assert "superuser" in fails(sbx, "dpkg -i /tmp/p.deb")  # as user: refused
    run(sbx, "dpkg -i /tmp/p.deb", "root")
    assert run(sbx, name) == "installed-by-dpkg\n"  # the user runs what root installed
    assert "install ok installed" in run(sbx, f"dpkg -s {name}")
    assert not os.path.exists(f"/usr/bin/{name}")
    host = subprocess.run(["dpkg", "-s", name], capture_output=True, text=True)
    assert host.returncode != 0  # the host's dpkg database never heard of it


def _wheel(name: str) -> bytes:
    buf = io.BytesIO()
    dist = f"{name}-1.0.dist-info"
    files = {f"{name}/__init__.py": "VALUE = 42\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n",
             f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    with zipfile.ZipFile(buf, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{dist}/RECORD", "".join(f"{p},,\n" for p in files) + f"{dist}/RECORD,,\n")
    return buf.getvalue()


@pytest.mark.parametrize("user", ["user", "root"])
def test_pip_install_of_a_local_wheel(e2b_env: str, user: str) -> None:
    name = "acdemo_" + uuid.uuid4().hex[:8]
    s = Sandbox.create()
    try:
        s.files.write(f"/tmp/{name}-1.0-py3-none-any.whl", _wheel(name))
        run(s, f"pip install --no-index --no-deps /tmp/{name}-1.0-py3-none-any.whl", user)
        assert run(s, f"python -c 'import {name}; print({name}.VALUE)'") == "42\n"
        assert not any(Path(p).exists() for p in (f"/opt/agentcell/venv/lib/{name}",))
        host_venvs = subprocess.run(["find", "/opt", "/usr", "-maxdepth", "6", "-name", name], capture_output=True,
                                    text=True).stdout
        assert host_venvs == ""
    finally:
        s.kill()


def test_files_api_as_root(server_url: str, e2b_env: str) -> None:
    """files.* with user="root": root's files, where root may go, relative paths from /root (as envd);
    the default user's files API stays the user's."""
    import httpx
    from e2b import Sandbox as E2BSandbox
    from e2b import SandboxException

    sbx = E2BSandbox.create()
    try:
        info = sbx.files.write("/etc/agentcell-root-file", "root wrote this", user="root")
        assert info.path == "/etc/agentcell-root-file"
        assert sh_e2b(sbx, "stat -c %U:%G /etc/agentcell-root-file") == "root:root"
        assert sbx.files.write("notes.txt", "x", user="root").path == "/root/notes.txt"
        sbx.commands.run("echo secret > /root/only-root && chmod 600 /root/only-root", user="root")
        assert sbx.files.read("/root/only-root", user="root") == "secret\n"
        with pytest.raises(SandboxException, match="Permission denied"):  # the user may not read root's file
            sbx.files.read("/root/only-root")
        with pytest.raises(SandboxException, match="Permission denied"):  # nor write the system
            sbx.files.write("/etc/user-wrote-this", "x")
        assert "only-root" in [e.name for e in sbx.files.list("/root", user="root")]
        sbx.files.make_dir("/opt/rootdir", user="root")
        sbx.files.rename("/opt/rootdir", "/opt/rootdir2", user="root")
        sbx.files.remove("/opt/rootdir2", user="root")
        assert not sbx.files.exists("/opt/rootdir2", user="root")
        # a signed upload URL as root, with a plain `file` form field (E2B's JS signing test)
        url = sbx.upload_url("/root/signed.txt", user="root", use_signature_expiration=60)
        r = httpx.post(url, files={"file": (None, "signed content")})
        assert r.status_code == 200, r.text
        assert r.json()[0]["path"] == "/root/signed.txt"
        assert sbx.files.read("/root/signed.txt", user="root") == "signed content"
    finally:
        sbx.kill()


def sh_e2b(sbx, cmd: str) -> str:  # type: ignore[no-untyped-def]
    return sbx.commands.run(cmd, user="root").stdout.strip()
