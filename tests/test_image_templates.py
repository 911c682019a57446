"""Sandboxes of templates made from images (issue 27): a real server, images made on this host and
imported into its template store, the official E2B SDKs driving sandboxes of them.

Each image kind stands for a family users bring: musl + busybox (Alpine: no glibc, no bash), a root
with no shell (distroless), Debian bookworm (apt, bash, sudo), Debian trixie with its own Python 3.13
(python:3.x-slim's kind: the image's Python differs from the runtime's).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from e2b import CommandExitException
from e2b_code_interpreter import Sandbox

from tests.oci_images import UBUNTU, debian_tar, distroless_root, musl_root, root_image
from tests.servers import ServerProcess

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="image templates need a server running as root")
AGENTCELL = [sys.executable, "-m", "agentcell"]


def _import(store: Path, layout: Path, tag: str, name: str) -> None:
    done = subprocess.run([*AGENTCELL, "template", "import", f"oci:{layout}:{tag}", "--name", name, "--store", str(store)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An OCI layout holding the test images: musl, distroless, and (when the Debian archive is
    reachable) bookworm and trixie-python."""
    tmp = tmp_path_factory.mktemp("images")
    layout = tmp / "layout"
    root_image(layout, "musl", root=musl_root(tmp / "musl"), config={"env": ["GREETING=from-the-image"],
                                                                      "workingdir": "/srv"})
    root_image(layout, "distroless", root=distroless_root(tmp / "distroless"))
    return layout


@pytest.fixture(scope="module")
def server(images: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    state = tmp_path_factory.mktemp("state")
    for tag in ("musl", "distroless"):
        _import(state / "templates", images, tag, tag)
    with ServerProcess(state / "server.log", "--state-dir", str(state), "--egress-uplink", "none",
                       "--standbys", "1") as srv:
        srv.state = state  # type: ignore[attr-defined]
        yield srv


@pytest.fixture(scope="module")
def debian(server: ServerProcess, images: Path) -> str:
    root_image(images, "bookworm", tar=debian_tar("bookworm"))
    _import(server.state / "templates", images, "bookworm", "bookworm")  # type: ignore[attr-defined]
    return "bookworm"


def sandbox(server: ServerProcess, template: str, **kw: object) -> Sandbox:
    return Sandbox.create(template=template, api_key="e2b_test", api_url=server.url, sandbox_url=server.url, **kw)


def run(sb: Sandbox, cmd: str, user: str = "user") -> str:
    return sb.commands.run(cmd, user=user, timeout=60).stdout  # type: ignore[arg-type]


def test_musl_image_commands_files_and_root(server: ServerProcess) -> None:
    sb = sandbox(server, "musl")
    try:
        assert "ID=alpine" in run(sb, "cat /etc/os-release")
        assert run(sb, "id -u; id -un").split() == ["1000", "user"]
        # the image's Env and WorkingDir; HOME stays the sandbox user's
        assert run(sb, "echo $GREETING; pwd; echo $HOME").split() == ["from-the-image", "/srv", "/home/user"]
        assert run(sb, "ls /lib").split() == ["ld-musl-x86_64.so.1"]  # no glibc came in with the runtime
        assert not run(sb, "test -e /bin/bash && echo bash || true").strip()
        # the whole root is writable by the sandbox's root: a new top-level directory, a new tool
        run(sb, "mkdir /0 && echo x > /0/x && printf '#!/bin/sh\\necho tool ran\\n' > /usr/local/bin/tool"
                " && chmod 755 /usr/local/bin/tool", user="root")
        assert run(sb, "cat /0/x; tool").split() == ["x", "tool", "ran"]
        # ... and not by its user, where the image's modes say so
        with pytest.raises(CommandExitException):
            run(sb, "echo y > /etc/passwd")
        sb.files.write("/home/user/note.txt", "hello")
        assert sb.files.read("/home/user/note.txt") == "hello"
        # its root may delete the image's own files: a copy-on-write layer over them
        run(sb, "rm /bin/busybox.bak 2>/dev/null; cp /bin/busybox /tmp/bb && rm /bin/cat", user="root")
        assert "not found" in sb.commands.run("/bin/cat /etc/os-release 2>&1 || true").stdout
        # run_code: the image has no Python, so the runtime's own runs it, libraries included
        execution = sb.run_code("import ssl, sqlite3, numpy\nint(numpy.arange(3).sum())")
        assert execution.error is None and execution.text == "3"
    finally:
        sb.kill()
    fresh = sandbox(server, "musl")
    try:  # nothing of the last sandbox's: the layers are the image's, unchanged
        assert "ID=alpine" in run(fresh, "cat /etc/os-release")
        assert not run(fresh, "ls /0 2>/dev/null || true").strip()
        assert not run(fresh, "ls /usr/local/bin").strip()
    finally:
        fresh.kill()


def test_sandbox_root_cannot_change_the_store_or_escape(server: ServerProcess) -> None:
    store = server.state / "templates" / "layers"  # type: ignore[attr-defined]
    before = {p: p.stat().st_mtime_ns for p in store.rglob("*") if not p.is_symlink()}
    sb = sandbox(server, "musl")
    try:
        # agentcell's own mounts in the image root stay read-only to the sandbox's root
        for path in ("/opt/agentcell/system/usr/x", "/opt/agentcell/venv/x", "/dev/x", "/proc/x"):
            with pytest.raises(CommandExitException):
                run(sb, f"touch {path}", user="root")
        # a file of an image id other than 0 and 1000 cannot be made: ids outside the sandbox's two
        with pytest.raises(CommandExitException):
            run(sb, "touch /tmp/f && chown 4242 /tmp/f", user="root")
        out = run(sb, "cat /proc/self/mountinfo; /bin/busybox rm -rf /bin /etc /lib && echo done", user="root")
        assert out.endswith("done\n")
        assert str(store) not in out  # no host path of the layers
    finally:
        sb.kill()
    after = {p: p.stat().st_mtime_ns for p in store.rglob("*") if not p.is_symlink()}
    assert after == before


def test_distroless_image_runs_code_without_a_shell(server: ServerProcess) -> None:
    sb = sandbox(server, "distroless")
    try:
        execution = sb.run_code("open('/etc/os-release').read()")
        assert execution.error is None and "distroless" in (execution.text or "")
        execution = sb.run_code("import subprocess\nsubprocess.run(['/app/busybox', 'echo', 'hi'], capture_output=True, text=True).stdout")
        assert "hi" in (execution.text or "")
    finally:
        sb.kill()


def test_disk_limit_bounds_the_root_overlay(server: ServerProcess) -> None:
    with httpx.Client(base_url=server.url, headers={"X-API-Key": "e2b_test"}, timeout=60) as http:
        created = http.post("/sandboxes", json={"templateID": "musl", "limits": {"diskMB": 64, "memoryMB": 512}})
        assert created.status_code == 201, created.text
    sb = Sandbox.connect(created.json()["sandboxID"], api_key="e2b_test", api_url=server.url, sandbox_url=server.url)
    try:
        out = sb.commands.run("dd if=/dev/zero of=/big bs=1M count=200 2>&1; echo rc=$?", user="root").stdout
        assert "No space left on device" in out and "rc=1" in out
    finally:
        sb.kill()


def test_unknown_template_is_404_and_builtin_names_stay_builtin(server: ServerProcess, images: Path) -> None:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r = http.post("/sandboxes", json={"templateID": "no-such-template"}, headers={"X-API-Key": "e2b_test"})
        assert r.status_code == 404 and "GET /templates" in r.text
    done = subprocess.run([*AGENTCELL, "template", "import", f"oci:{images}:musl", "--name", "base",
                           "--store", str(server.state / "templates")], capture_output=True, text=True)  # type: ignore[attr-defined]
    assert done.returncode != 0 and "built-in" in done.stderr


def test_debian_image_bash_apt_sudo_and_owners(server: ServerProcess, debian: str) -> None:
    sb = sandbox(server, debian)
    try:
        assert "bookworm" in run(sb, "cat /etc/os-release")
        assert run(sb, "echo $0; readlink /proc/$$/exe; true").split() == ["/bin/bash", "/usr/bin/bash"]
        assert run(sb, "sudo id -u").strip() == "0"
        assert "apt 2." in run(sb, "apt-get --version | head -1")
        # the image's own owners: root's files are the sandbox's root's; shadow's group is no id here
        assert run(sb, "stat -c '%U %G' /etc/passwd /etc/shadow").split() == ["root", "root", "root", "nogroup"]
        with pytest.raises(CommandExitException):
            run(sb, "cat /etc/shadow")
        # a setuid-root program of the image gives the user nothing (nosuid layers, no_new_privs)
        assert run(sb, "ls -l /usr/bin/su | cut -c1-10").startswith("-rwsr-xr-x")
        assert "uid=1000" in sb.commands.run("su -c id root </dev/null 2>&1; id").stdout
        assert sb.run_code("import sys; sys.version_info[:2]").error is None
    finally:
        sb.kill()


def test_start_command_runs_and_the_sandbox_is_ready_when_the_ready_command_says(server: ServerProcess,
                                                                                  images: Path) -> None:
    """E2B's set_start_cmd(start, ready): the service is up when create returns, in every sandbox."""
    store = server.state / "templates"  # type: ignore[attr-defined]
    _import(store, images, "musl", "svc")
    record_path = store / "templates" / "svc.json"
    record = json.loads(record_path.read_text())
    record["agentcell"] = {"start_cmd": "sleep 1; echo up > /tmp/started; exec sleep 1000",
                           "ready_cmd": "test -f /tmp/started"}
    record_path.write_text(json.dumps(record))
    for _ in range(2):  # the first prepared on demand, the second from the template's standby pool
        sb = sandbox(server, "svc")
        try:
            assert run(sb, "cat /tmp/started").strip() == "up"
            assert any(p.tag == "start_cmd" for p in sb.commands.list())
        finally:
            sb.kill()


def test_pause_resume_and_snapshot_keep_the_root_changes(server: ServerProcess) -> None:
    """The root's copy-on-write layer (a new tool, a deleted image file) and home survive a pause with
    a cold start, and a snapshot's sandboxes start on the image's layers with those changes."""
    sb = sandbox(server, "musl", timeout=120)
    try:
        run(sb, "printf '#!/bin/sh\\necho kept\\n' > /usr/local/bin/kept && chmod 755 /usr/local/bin/kept"
                " && rm /etc/os-release && mkdir /data && echo d > /data/d", user="root")
        sb.files.write("/home/user/marker.txt", "persisted\n")
        assert sb.pause(mode="filesystem") is True
        sb.connect()  # a cold start from its files
        assert run(sb, "kept; cat /data/d /home/user/marker.txt; test -e /etc/os-release || echo gone").split() \
            == ["kept", "d", "persisted", "gone"]
        assert "ID=alpine" not in run(sb, "cat /etc/*release* 2>/dev/null; true")
        snap = sb.create_snapshot(name=f"img-{sb.sandbox_id[:8]}")
        child = Sandbox.create(snap.snapshot_id, api_key="e2b_test", api_url=server.url, sandbox_url=server.url)
        try:
            assert run(child, "kept; cat /data/d; ls /bin/busybox").split() == ["kept", "d", "/bin/busybox"]
            assert run(child, "test -e /etc/os-release || echo gone").strip() == "gone"
        finally:
            child.kill()
    finally:
        sb.kill()


def test_layers_in_use_outlive_their_template(server: ServerProcess, images: Path, tmp_path: Path) -> None:
    """A template removed (or replaced) while its sandboxes run: collection leaves its layers, which
    the server leases while it may run sandboxes on them."""
    root = musl_root(tmp_path / "root")
    (root / "etc/variant").write_text("lease\n")
    root_image(images, "lease", root=root)
    store = server.state / "templates"  # type: ignore[attr-defined]
    _import(store, images, "lease", "lease-me")
    layers = json.loads((store / "templates" / "lease-me.json").read_text())["layers"]
    sb = sandbox(server, "lease-me")
    try:
        for args in (["rm", "lease-me"], ["gc"]):
            done = subprocess.run([*AGENTCELL, "template", *args, "--store", str(store)], capture_output=True, text=True)
            assert done.returncode == 0, done.stderr
        assert (store / "layers" / layers[0].split(":")[1]).is_dir()
        assert run(sb, "cat /etc/variant; ls /bin/busybox").split() == ["lease", "/bin/busybox"]
    finally:
        sb.kill()


@pytest.fixture(scope="module")
def python_image(server: ServerProcess, images: Path) -> str:
    """python:3.x-slim's kind: Debian trixie with its own Python (3.13), not the runtime's."""
    root_image(images, "trixie-python", tar=debian_tar("trixie", ("python3", "python3-pip")))
    _import(server.state / "templates", images, "trixie-python", "trixie-python")  # type: ignore[attr-defined]
    return "trixie-python"


def _wheel(name: str, body: str) -> bytes:
    """A pure-Python wheel of one module, made here (no index, no network)."""
    import base64
    import hashlib
    import io
    import zipfile

    files = {f"{name}.py": body.encode(),
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{name}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for path, data in files.items()) + f"{name}-1.0.dist-info/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for path, data in {**files, f"{name}-1.0.dist-info/RECORD": record.encode()}.items():
            z.writestr(path, data)
    return buf.getvalue()


def test_run_code_uses_the_images_own_python_and_sees_what_pip_installs(server: ServerProcess,
                                                                         python_image: str) -> None:
    sb = sandbox(server, python_image)
    try:
        execution = sb.run_code("import sys; sys.version_info[:2], sys.executable")
        assert execution.error is None and execution.text == "((3, 13), '/usr/bin/python3')"
        assert "python 3.13" in run(sb, "python3 --version").lower()
        assert "ModuleNotFoundError" in str(sb.run_code("import numpy").error)  # not the runtime's
        sb.files.write("/tmp/hello_pkg-1.0-py3-none-any.whl", _wheel("hello_pkg", "GREETING = 'installed'\n"))
        out = sb.commands.run("pip install --user --break-system-packages --no-index "
                              "/tmp/hello_pkg-1.0-py3-none-any.whl 2>&1", timeout=120)
        assert out.exit_code == 0, out.stdout
        execution = sb.run_code("import hello_pkg; hello_pkg.GREETING")
        assert execution.error is None and execution.text == "installed"
        assert run(sb, "sudo python3 -c 'import os; print(os.getuid())'").strip() == "0"
    finally:
        sb.kill()


@pytest.fixture(scope="module")
def ubuntu(server: ServerProcess, images: Path) -> str:
    root_image(images, "noble", tar=debian_tar("noble", archive=UBUNTU))
    _import(server.state / "templates", images, "noble", "noble")  # type: ignore[attr-defined]
    return "noble"


def test_ubuntu_image(server: ServerProcess, ubuntu: str) -> None:
    sb = sandbox(server, ubuntu)
    try:
        assert "Ubuntu" in run(sb, "cat /etc/os-release")
        assert run(sb, "id -un; sudo id -un").split() == ["user", "root"]
        assert "(Ubuntu" in run(sb, "ldd --version | head -1")  # the image's own glibc, not the host's
        execution = sb.run_code("import ctypes, sqlite3; sqlite3.sqlite_version_info >= (3, 0, 0)")
        assert execution.error is None and execution.text == "True"
    finally:
        sb.kill()


def test_uid_1000_of_another_name_reads_as_user() -> None:
    """An image whose uid 1000 has a name (ubuntu:24.04's `ubuntu`, node's `node`): E2B's `user` goes
    first, so 1000 reads as `user`, and the image's name still resolves."""
    from agentcell.backends.linux.image_root import with_user

    line = "user:x:1000:1000:user:/home/user:/bin/bash"
    image = "root:x:0:0:root:/root:/bin/bash\nubuntu:x:1000:1000::/home/ubuntu:/bin/bash\n"
    assert with_user(image, line).splitlines() == ["root:x:0:0:root:/root:/bin/bash", line,
                                                    "ubuntu:x:1000:1000::/home/ubuntu:/bin/bash"]
    assert with_user(image + line + "\n", line) == image + line + "\n"  # already there: unchanged
    assert with_user("root:x:0:0::/root:/bin/sh", line).splitlines()[-1] == line


def test_pty_and_ports_in_a_musl_sandbox(server: ServerProcess) -> None:
    """A terminal (through /bin/sh: no bash) and a port served by the image's own program (busybox
    httpd), reached through the server as E2B's get_host(port) names it."""
    from e2b import PtySize

    sb = sandbox(server, "musl")
    try:
        term = sb.pty.create(PtySize(rows=24, cols=80))
        sb.pty.send_stdin(term.pid, b"stty size; tty; exit 0\n")
        out = bytearray()
        term.wait(on_pty=out.extend)
        assert b"24 80" in out and b"/dev/pts/" in out, out
        sb.files.write("/home/user/www/index.html", "served by the image")
        sb.commands.run("httpd -f -p 8080 -h /home/user/www", background=True)
        host = sb.get_host(8080)
        for _ in range(100):
            r = httpx.get(server.url + "/", headers={"Host": host}, timeout=5)
            if r.status_code == 200:
                break
            time.sleep(0.1)
        assert r.text == "served by the image"
    finally:
        sb.kill()


def test_the_record_sees_an_image_sandbox(server: ServerProcess) -> None:
    """The behaviour record works on an image root: the image's shell exec'd, a file written in the
    home, a write refused on a file of the image's root."""
    from agentcell.sdk import Sandbox as Ours
    from tests.helpers import wait_for_events

    sb = sandbox(server, "musl")
    sid = sb.sandbox_id
    sb.commands.run("echo x > /home/user/seen.txt; echo y > /etc/passwd 2>/dev/null; true")
    sb.kill()
    events = wait_for_events(lambda: Ours.events(sid, api_url=server.url),
                             lambda got: any(e["kind"] == "sandbox.killed" for e in got), timeout=15)
    assert any(e["kind"] == "process.exec" and (e.get("argv") or [""])[0] == "/bin/sh" for e in events), events
    assert any(e["kind"] == "deny.write" and e.get("path") == "/etc/passwd" for e in events), events
    assert any(e["kind"].startswith("file.") and e.get("path") == "/home/user/seen.txt" for e in events), events


def test_pip_install_in_a_build_step_is_importable_by_run_code(server: ServerProcess, python_image: str,
                                                               tmp_path: Path) -> None:
    """E2B's Template() on the Python image: a wheel copied in and pip-installed by a RUN step (as root,
    into the image's own site-packages) imports in run_code of the built template's sandboxes."""
    from e2b import Template

    (tmp_path / "built_pkg-1.0-py3-none-any.whl").write_bytes(_wheel("built_pkg", "WHERE = 'built in'\n"))
    template = (Template(file_context_path=str(tmp_path)).from_template(python_image)
                .copy("built_pkg-1.0-py3-none-any.whl", "/tmp/")
                .run_cmd("pip install --break-system-packages --no-index /tmp/built_pkg-1.0-py3-none-any.whl",
                         user="root"))
    Template.build(template, "py-with-pkg", api_url=server.url, api_key="e2b_test", on_build_logs=lambda e: print(e))
    sb = sandbox(server, "py-with-pkg")
    try:
        execution = sb.run_code("import built_pkg, sys; built_pkg.WHERE, sys.version_info[:2]")
        assert execution.error is None and execution.text == "('built in', (3, 13))"
    finally:
        sb.kill()


def test_the_templates_last_user_root_is_the_default_user(server: ServerProcess) -> None:
    """E2B: a template's last set_user (a Dockerfile's last USER) is its sandboxes' default user."""
    from e2b import Template

    Template.build(Template().from_template("musl").set_user("root"), "musl-as-root", api_url=server.url,
                   api_key="e2b_test")
    sb = sandbox(server, "musl-as-root")
    try:
        assert sb.commands.run("id -u").stdout.strip() == "0"
        assert sb.commands.run("id -u", user="user").stdout.strip() == "1000"
    finally:
        sb.kill()
    sb = sandbox(server, "musl")
    try:
        assert sb.commands.run("id -u").stdout.strip() == "1000"
    finally:
        sb.kill()


def test_a_paused_image_sandbox_resumes_after_a_server_restart(images: Path, tmp_path: Path) -> None:
    """A sandbox paused with its files is kept on disk by the server; the next server on the same state
    dir resumes it on its template's layers, its root's changes there."""
    state = tmp_path / "state"
    _import(state / "templates", images, "musl", "musl")
    args = ("--state-dir", str(state), "--egress-uplink", "none", "--standbys", "0")
    with ServerProcess(tmp_path / "one.log", *args) as one:
        sb = sandbox(one, "musl", timeout=300)
        run(sb, "echo kept > /srv/mark", user="root")
        assert sb.pause(mode="filesystem") is True
        sandbox_id = sb.sandbox_id
    with ServerProcess(tmp_path / "two.log", *args) as two:
        sb = Sandbox.connect(sandbox_id, api_key="e2b_test", api_url=two.url, sandbox_url=two.url)
        try:
            assert run(sb, "cat /srv/mark; cat /etc/os-release | grep ^ID=").split() == ["kept", "ID=alpine"]
        finally:
            sb.kill()
