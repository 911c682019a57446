"""E2B's template builder against a real `agentcell serve`: the official e2b SDK's `Template` API (build,
build_in_background + get_build_status, exists, tags, delete), the upload links, refusals naming the
step, builds from a loopback registry's image, the layer cache, and hostile uploads.

Every step is built for real into the template store and checked there; RUN steps run in sandboxes of
the layers so far (the linux backend's image roots).
"""

from __future__ import annotations

import asyncio
import gzip
import hashlib
import os
import re
import stat
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from e2b import Template, TemplateTagInfo, wait_for_port
from e2b.exceptions import BuildException, TemplateException

from agentcell.templates.builds import BuildRegistry, BuildsBusyError
from agentcell.templates.store import TemplateStore
from agentcell.templates.unpack import ID_BASE
from tests.oci_images import Registry, entry, tar_bytes, write_layout
from tests.servers import SERVE, ServerProcess

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="template builds need a root server (the store shifts owners)")

KEY = "e2b_" + "7" * 40
APP_UID = 1500


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A loopback registry with `test/app:1`: Debian-like merged /usr (/bin -> usr/bin), a user `app`
    (uid 1500), a symlink pointing far out of the root, and a working directory in its config."""
    root = tmp_path_factory.mktemp("images")
    passwd = (f"root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/sh\n"
              f"app:x:{APP_UID}:{APP_UID}::/home/app:/bin/sh\n").encode()
    busybox = Path("/bin/busybox").read_bytes()  # static: a shell and coreutils for the image's sandboxes
    layer = tar_bytes([
        entry("usr/", tarfile.DIRTYPE, mode=0o755),
        entry("usr/bin/", tarfile.DIRTYPE, mode=0o755),
        entry("usr/bin/busybox", data=busybox, mode=0o755),
        *[entry(f"usr/bin/{tool}", tarfile.SYMTYPE, linkname="busybox") for tool in ("sh", "cat", "id", "pwd", "env")],
        entry("etc/", tarfile.DIRTYPE, mode=0o755),
        entry("etc/passwd", data=passwd),
        entry("etc/group", data=f"root:x:0:\nuser:x:1000:\napp:x:{APP_UID}:\n".encode()),
        entry("usr/bin/hello", data=b"#!/bin/sh\necho hello\n", mode=0o755),
        entry("bin", tarfile.SYMTYPE, linkname="usr/bin"),
        entry("srv/", tarfile.DIRTYPE, mode=0o750, uid=APP_UID, gid=APP_UID),
        entry("escape", tarfile.SYMTYPE, linkname="../../../../../../tmp/agentcell-build-escape"),
        entry("home/", tarfile.DIRTYPE, mode=0o755),
        entry("home/app/", tarfile.DIRTYPE, mode=0o700, uid=APP_UID, gid=APP_UID),
        entry("home/user/", tarfile.DIRTYPE, mode=0o755, uid=1000, gid=1000),
    ])
    write_layout(root / "layout", [layer], tag="1",
                 config={"Env": ["PATH=/usr/bin:/bin", "IMAGE=yes"], "WorkingDir": "/home/app", "User": "app"})
    reg = Registry(root / "registry")
    try:
        reg.push(f"oci:{root / 'layout'}:1", "test/app:1")
        reg.push(f"oci:{root / 'layout'}:1", "library/ubuntu:22.04")  # Docker Hub's name, through the mirror
        yield reg
    finally:
        reg.stop()


def _serve(tmp_path: Path, registry: Registry | None, *extra: str) -> ServerProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    args = ["--state-dir", str(tmp_path / "state"), "--egress-uplink", "none", "--standbys", "0", "--no-record",
            "--api-key", KEY, "--allowed-registry", "registry.invalid",  # never Docker Hub: loopback only
            "--e2b-base-image", "builtin", *extra]
    if registry is not None:
        args += ["--insecure-registry", registry.address]
    return ServerProcess(tmp_path / "server.log", *args, command=SERVE)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, registry: Registry) -> Iterator[ServerProcess]:
    with _serve(tmp_path_factory.mktemp("server"), registry, "--max-image-mb", "64",
                "--registry-mirror", f"docker.io={registry.address}") as s:
        yield s


def opts(server: ServerProcess) -> dict[str, Any]:
    return {"api_url": server.url, "api_key": KEY}


def api(server: ServerProcess) -> httpx.Client:
    http = server.http_client(60)
    http.headers["X-API-Key"] = KEY
    return http


def store_of(server: ServerProcess) -> TemplateStore:
    state = server.proc.args[server.proc.args.index("--state-dir") + 1]
    return TemplateStore(os.path.join(state, "templates"))


def record_of(server: ServerProcess, template_id: str, build_id: str) -> dict[str, Any]:
    return store_of(server).template(f"{template_id}.{build_id}")


def tree(server: ServerProcess, diff_id: str) -> Path:
    return Path(store_of(server).layer_path(diff_id)) / "tree"


def context(tmp_path: Path, files: dict[str, str]) -> Path:
    ctx = tmp_path / "ctx"
    for name, text in files.items():
        (ctx / name).parent.mkdir(parents=True, exist_ok=True)
        (ctx / name).write_text(text)
    return ctx


class Logs:
    """An on_build_logs callback that keeps what it gets (never falsy: the SDK tests `if on_build_logs`)."""

    def __init__(self) -> None:
        self.entries: list[Any] = []

    def __call__(self, entry: Any) -> None:
        self.entries.append(entry)

    def text(self) -> str:
        return "\n".join(str(getattr(e, "message", e)) for e in self.entries)


def built_seconds(logs: Logs) -> float:
    found = re.search(r"built in ([0-9.]+)s", logs.text())
    assert found, logs.text()
    return float(found.group(1))


# --- builds ---------------------------------------------------------------------------------------------


def test_a_build_on_the_default_base_stores_its_layers_and_config(server: ServerProcess, tmp_path: Path) -> None:
    ctx = context(tmp_path, {"folder/test.txt": "This is a test file.", "folder/sub/deep.txt": "deep"})
    os.symlink("test.txt", ctx / "folder" / "link.txt")
    template = (Template(file_context_path=str(ctx)).from_base_image()
                .copy("folder/*", "folder", force_upload=True)
                .set_envs({"GREETING": "hi", "BOTH": "$GREETING there"})
                .set_workdir("/app")
                .set_start_cmd("python -m http.server 8000", wait_for_port(8000)))
    logs = Logs()
    info = Template.build(template, "default-base:v1", on_build_logs=logs, **opts(server))
    assert info.tags == ["v1"]
    text = logs.text()
    assert "Uploaded 'folder/*'" in text and "[builder 1/3] COPY folder/* folder" in text
    assert "Build finished" in text
    record = record_of(server, info.template_id, info.build_id)
    assert record["builtin_base"] == "base" and len(record["layers"]) == 2  # COPY, WORKDIR (ENV: config only)
    assert "GREETING=hi" in record["config"]["Env"] and "BOTH=hi there" in record["config"]["Env"]
    assert record["config"]["WorkingDir"] == "/app"
    assert record["agentcell"]["start_cmd"] == "python -m http.server 8000" and "8000" in record["agentcell"]["ready_cmd"]
    copied = tree(server, record["layers"][0]) / "home" / "user" / "folder"  # relative to the base's /home/user
    assert (copied / "test.txt").read_text() == "This is a test file."
    assert (copied / "deep.txt").read_text() == "deep"  # Docker's rule: a matched directory's contents
    assert os.readlink(copied / "link.txt") == "test.txt"  # kept as a symlink, never followed
    st = os.stat(copied / "test.txt")
    assert (st.st_uid, st.st_gid) == (ID_BASE, ID_BASE)  # root's, shifted as the importer stores owners
    assert (tree(server, record["layers"][1]) / "app").is_dir()


def test_an_unchanged_rebuild_is_cached_and_a_change_rebuilds_from_that_step(server: ServerProcess, tmp_path: Path) -> None:
    ctx = context(tmp_path, {"a.txt": "one", "b.txt": "two"})

    def template(b_text: str) -> Any:
        (ctx / "b.txt").write_text(b_text)
        return (Template(file_context_path=str(ctx)).from_base_image()
                .copy("a.txt", "/opt/a.txt").copy("b.txt", "/opt/b.txt").set_workdir("/srv/work"))

    first = Logs()
    one = Template.build(template("two"), "cache-test", on_build_logs=first, **opts(server))
    again = Logs()
    two = Template.build(template("two"), "cache-test", on_build_logs=again, **opts(server))
    assert again.text().count("CACHED") == 3, again.text()
    assert "Skipping upload of 'a.txt', already cached" in again.text()
    assert built_seconds(again) < 0.5
    layers_one = record_of(server, one.template_id, one.build_id)["layers"]
    assert record_of(server, two.template_id, two.build_id)["layers"] == layers_one
    changed = Logs()
    three = Template.build(template("changed"), "cache-test", on_build_logs=changed, **opts(server))
    layers_three = record_of(server, three.template_id, three.build_id)["layers"]
    assert layers_three[0] == layers_one[0] and layers_three[1:] != layers_one[1:]  # from the changed step on
    assert changed.text().count("CACHED") == 1
    assert (tree(server, layers_three[1]) / "opt" / "b.txt").read_text() == "changed"
    forced = Logs()
    four = Template.build(template("changed"), "cache-test", skip_cache=True, on_build_logs=forced, **opts(server))
    assert "CACHED" not in forced.text()
    assert not set(record_of(server, four.template_id, four.build_id)["layers"]) & set(layers_three)
    assert one.template_id == two.template_id == three.template_id == four.template_id  # one template, 4 builds


def test_a_build_from_a_registry_image_copies_through_its_symlinks_as_its_users(
        server: ServerProcess, registry: Registry, tmp_path: Path) -> None:
    ctx = context(tmp_path, {"tool.sh": "#!/bin/sh\necho tool\n", "data/x.txt": "x"})
    template = (Template(file_context_path=str(ctx)).from_image(f"{registry.address}/test/app:1")
                .copy("tool.sh", "/bin/", user="app", mode=0o750)  # /bin -> usr/bin in the image
                .copy("data", "mine")  # relative to the image's WorkingDir, /home/app
                .copy("data/x.txt", "/escape/x.txt")  # a symlink far out of the root: stays inside it
                .set_user("app"))
    info = Template.build(template, "from-image", **opts(server))
    record = record_of(server, info.template_id, info.build_id)
    assert record["builtin_base"] is None and len(record["layers"]) == 4
    assert "IMAGE=yes" in record["config"]["Env"] and record["config"]["User"] == "app"
    copy1 = tree(server, record["layers"][1])
    assert sorted(os.listdir(copy1)) == ["usr"]  # no /bin directory hiding the image's symlink
    tool = copy1 / "usr" / "bin" / "tool.sh"
    st = os.lstat(tool)
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (ID_BASE + APP_UID, ID_BASE + APP_UID, 0o750)
    usr = os.stat(copy1 / "usr")  # a directory the layer repeats: the image's mode and owner
    assert (usr.st_uid, stat.S_IMODE(usr.st_mode)) == (ID_BASE, 0o755)
    assert (tree(server, record["layers"][2]) / "home" / "app" / "mine" / "x.txt").read_text() == "x"
    assert (tree(server, record["layers"][3]) / "tmp" / "agentcell-build-escape" / "x.txt").read_text() == "x"
    assert not os.path.exists("/tmp/agentcell-build-escape")
    # a second template from the first: its layers, and more
    child = Template.build(Template(file_context_path=str(ctx)).from_template("from-image").copy("data/x.txt", "/y"),
                           "child", **opts(server))
    child_layers = record_of(server, child.template_id, child.build_id)["layers"]
    assert child_layers[:4] == record["layers"] and len(child_layers) == 5


def test_a_sandbox_of_a_built_template_has_its_files_and_config(server: ServerProcess, registry: Registry,
                                                                  tmp_path: Path) -> None:
    """Sandbox.create("name") of a template built here: its layers are the sandbox's root (the backend's
    image roots), the build's ENV its environment."""
    from e2b import Sandbox

    ctx = context(tmp_path, {"tool.sh": "echo tool ran\n"})
    template = (Template(file_context_path=str(ctx)).from_image(f"{registry.address}/test/app:1")
                .copy("tool.sh", "/bin/tool.sh", mode=0o755).set_envs({"GREETING": "built"}).set_workdir("/srv"))
    Template.build(template, "runnable:v1", **opts(server))
    base_only = Template.build(Template().from_base_image().set_envs({"A": "1"}), "on-default-base", **opts(server))
    conn = {"api_key": KEY, "api_url": server.url, "sandbox_url": server.url}
    for name in ("runnable", "runnable:v1"):
        sbx = Sandbox.create(name, **conn)
        try:
            out = sbx.commands.run("sh /usr/bin/tool.sh; echo $GREETING $IMAGE", user="root")
            assert out.stdout.split("\n")[:2] == ["tool ran", "built yes"], out
        finally:
            sbx.kill()
    with pytest.raises(Exception, match="default base"):  # not startable yet: said so, not a broken root
        Sandbox.create("on-default-base", **conn)
    with pytest.raises(Exception, match="not found"):  # a build's store record by its name: another's is hidden
        Sandbox.create("runnable:nope", **conn)
    assert base_only.template_id


def test_run_steps_run_in_a_sandbox_of_the_layers_so_far_and_are_cached(server: ServerProcess, registry: Registry,
                                                                        tmp_path: Path) -> None:
    ctx = context(tmp_path, {"in.txt": "from the context\n"})

    def template(word: str) -> Any:
        return (Template(file_context_path=str(ctx)).from_image(f"{registry.address}/test/app:1")
                .copy("in.txt", "/opt/in.txt").set_envs({"WORD": word}).set_user("root").set_workdir("/opt")
                .run_cmd("cat in.txt > out.txt; echo $WORD >> out.txt; id -u; rm /usr/bin/hello")
                .run_cmd("echo $(cat out.txt) > /home/user/note; echo to-stderr >&2", user="user"))

    logs = Logs()
    info = Template.build(template("one"), "runs", on_build_logs=logs, **opts(server))
    text = logs.text()
    assert "[builder 5/6] RUN cat in.txt" in text and "\n0\n" in f"\n{text}\n"  # id -u of root, streamed
    assert "to-stderr" in text
    record = record_of(server, info.template_id, info.build_id)
    run1, run2 = (tree(server, d) for d in record["layers"][-2:])
    assert (run1 / "opt" / "out.txt").read_text() == "from the context\none\n"
    whiteout = os.lstat(run1 / "usr" / "bin" / "hello")  # deleted from the image: an overlay whiteout
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    note = run2 / "home" / "user" / "note"
    assert note.read_text() == "from the context one\n" and os.stat(note).st_uid == ID_BASE + 1000
    again = Logs()
    Template.build(template("one"), "runs", on_build_logs=again, **opts(server))
    assert again.text().count("CACHED") == 3 and built_seconds(again) < 0.5  # COPY, RUN, RUN (/opt: the COPY made it)
    changed = Logs()
    Template.build(template("two"), "runs", on_build_logs=changed, **opts(server))
    assert changed.text().count("CACHED") == 1  # the COPY; the ENV change makes both RUNs anew
    with pytest.raises(BuildException, match="exit status 3"):
        failing = Template().from_image(f"{registry.address}/test/app:1").set_workdir("/").run_cmd("exit 3", user="root")
        Template.build(failing, "fails", **opts(server))
    with pytest.raises(BuildException, match="as root or as uid 1000"):
        Template.build(Template().from_image(f"{registry.address}/test/app:1").run_cmd("true", user="app"),
                       "other-user", **opts(server))


def test_docker_hub_images_come_from_the_operators_mirror(server: ServerProcess, registry: Registry) -> None:
    info = Template.build(Template().from_image("ubuntu:22.04").set_workdir("/").run_cmd("whoami", user="root"),
                          "mirrored", **opts(server))
    record = record_of(server, info.template_id, info.build_id)
    assert record["base"] == f"docker://{registry.address}/library/ubuntu:22.04"
    assert any("/v2/library/ubuntu/manifests/22.04" in line for line in registry.requests())


def test_the_operator_can_name_an_image_for_e2bs_default_base(tmp_path: Path, registry: Registry) -> None:
    """serve --e2b-base-image: Template() and from_base_image() start from that image, so RUN steps run
    and the result starts sandboxes (Docker Hub's name through the mirror, here the test image)."""
    from e2b import Sandbox

    with _serve(tmp_path, registry, "--registry-mirror", f"docker.io={registry.address}",
                "--e2b-base-image", "ubuntu:22.04") as srv:
        template = Template().from_base_image().set_workdir("/").run_cmd("echo on-the-base > /base-note", user="root")
        info = Template.build(template, "on-base", **opts(srv))
        assert record_of(srv, info.template_id, info.build_id)["base"] == \
            f"docker://{registry.address}/library/ubuntu:22.04"
        sbx = Sandbox.create("on-base", api_key=KEY, api_url=srv.url, sandbox_url=srv.url)
        try:
            assert sbx.commands.run("cat /base-note", user="root").stdout == "on-the-base\n"
        finally:
            sbx.kill()


def test_build_in_background_status_and_log_offsets(server: ServerProcess, tmp_path: Path) -> None:
    ctx = context(tmp_path, {"f": "f"})
    template = Template(file_context_path=str(ctx)).from_base_image().copy("f", "/f").set_workdir("/w")
    info = Template.build_in_background(template, "background", **opts(server))
    deadline = time.monotonic() + 30
    entries: list[Any] = []
    while True:
        status = Template.get_build_status(info, logs_offset=len(entries), **opts(server))
        entries += status.log_entries
        if status.status.value in ("ready", "error") and not status.log_entries:
            break
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert status.status.value == "ready"
    messages = [e.message for e in entries]
    assert len(messages) == len(set(messages)) or messages.count("Build finished") == 1  # each entry once
    assert messages[-1] == "Build finished" and any("[builder 1/2] COPY f /f" in m for m in messages)
    with api(server) as http:
        base = f"/templates/{info.template_id}/builds/{info.build_id}"
        page = http.get(base + "/status", params={"logsOffset": 1, "limit": 2}).json()
        assert [e["message"] for e in page["logEntries"]] == messages[1:3]
        assert all({"timestamp", "level", "message"} <= set(e) for e in page["logEntries"])
        assert http.get(base + "/status", params={"level": "error"}).json()["logEntries"] == []
        assert http.get(base + "/status", params={"level": "loud"}).status_code == 400
        assert len(http.get(base + "/logs").json()["logs"]) == len(messages)
        assert http.get(f"/templates/{info.template_id}/builds/00000000-0000-0000-0000-000000000000/status").status_code == 404


def test_exists_tags_list_and_delete(server: ServerProcess) -> None:
    o = opts(server)
    info = Template.build(Template().from_base_image().set_envs({"A": "1"}), "tagged:v1", **o)
    assert Template.exists("tagged", **o) and Template.exists("base", **o)
    assert not Template.exists("never-built", **o)
    assigned = Template.assign_tags("tagged:v1", ["production", "latest"], **o)
    assert isinstance(assigned, TemplateTagInfo) and assigned.build_id == info.build_id
    assert set(assigned.tags) == {"production", "latest"}
    for bad in (":invalid-tag", "tagged:"):
        with pytest.raises(TemplateException):
            Template.assign_tags("tagged:v1", bad, **o)
    with pytest.raises(TemplateException):
        Template.assign_tags("tagged:nope", "x", **o)
    tags = {t.tag: t.build_id for t in Template.get_tags("tagged", **o)}
    assert tags == {"v1": info.build_id, "production": info.build_id, "latest": info.build_id}
    Template.remove_tags("tagged", ["production", "latest"], **o)
    assert [t.tag for t in Template.get_tags(info.template_id, **o)] == ["v1"]
    with pytest.raises(TemplateException):
        Template.remove_tags("tagged", "never-there", **o)
    with pytest.raises(TemplateException):
        Template.get_tags("never-built", **o)
    with api(server) as http:
        listed = {t["templateID"]: t for t in http.get("/templates").json()}
        assert listed[info.template_id]["aliases"] == ["tagged"] and listed[info.template_id]["buildStatus"] == "ready"
        one = http.get(f"/templates/{info.template_id}").json()
        assert [b["buildID"] for b in one["builds"]] == [info.build_id]
        store_name = f"{info.template_id}.{info.build_id}"
        assert store_of(server).template(store_name)
        assert http.delete("/templates/tagged").status_code == 204
        assert http.get(f"/templates/{info.template_id}/tags").status_code == 404
        assert http.delete("/templates/tagged").status_code == 404
        assert http.delete("/templates/base").status_code == 400  # built-in (ControlPlane's answer)
    assert not Template.exists("tagged", **o)
    assert store_name not in [t["name"] for t in store_of(server).templates()]


def test_bad_specs_are_refused_naming_the_step(server: ServerProcess, registry: Registry) -> None:
    with api(server) as http:
        req = http.post("/v3/templates", json={"name": "bad-specs"})
        assert req.status_code == 202, req.text
        tid, bid = req.json()["templateID"], req.json()["buildID"]
        assert http.get(f"/templates/{tid}/builds/{bid}/status").json()["status"] == "waiting"
        start = f"/v2/templates/{tid}/builds/{bid}"
        cases = [
            ({"steps": [{"type": "ENV", "args": ["A", "1"]}, {"type": "FROB", "args": []}]}, "step 2: unknown step type"),
            ({"steps": [{"type": "RUN", "args": []}]}, "step 1 (RUN"),
            ({"steps": [{"type": "COPY", "args": ["a", "/b"]}]}, "COPY needs 'filesHash'"),
            ({"steps": [{"type": "COPY", "args": ["../a", "/b"], "filesHash": "ab" * 32}]}, "inside the build context"),
            ({"steps": [{"type": "ENV", "args": ["A"]}]}, "ENV takes"),
            ({"fromImage": "x", "fromImageRegistry": {"type": "aws"}, "steps": []}, "no cloud registry types"),
            ({"fromImage": "x", "fromTemplate": "y", "steps": []}, "not both"),
        ]
        for body, message in cases:
            refused = http.post(start, json=body)
            assert refused.status_code == 400 and message in refused.json()["message"], (body, refused.text)
        assert http.post("/v3/templates", json={"name": "base"}).status_code == 409  # a built-in's name
        assert http.post("/v3/templates", json={"name": "Bad Name"}).status_code == 400
        assert http.post("/v3/templates", json={"name": "ok", "memoryMB": 1}).status_code == 400
        assert http.post("/v2/templates", json={}).status_code == 501  # the old API: not served
    o = opts(server)
    with pytest.raises(BuildException) as no_user:
        Template.build(Template().from_image(f"{registry.address}/test/app:1").run_cmd("whoami", user="root123"),
                       "no-such-user", **o)
    assert "failed to run command 'whoami': command failed: unauthenticated: invalid username: 'root123'" \
        in str(no_user.value)
    with pytest.raises(BuildException, match="default base"):  # RUN needs an image's layers under it
        Template.build(Template().from_base_image().run_cmd("true"), "run-later", **o)
    with pytest.raises(BuildException, match="not found|does not exist"):
        Template.build(Template().from_template("no-such-template"), "from-nothing", **o)
    with pytest.raises(BuildException) as missing_image:
        Template.build(Template().from_image(f"{registry.address}/test/none:1"), "no-image", **o)
    assert "test/none" in str(missing_image.value)


def test_the_upload_link_flow(server: ServerProcess, tmp_path: Path) -> None:
    files_hash = hashlib.sha256(b"my files").hexdigest()
    payload = _tgz([entry("dir/", tarfile.DIRTYPE, mode=0o755), entry("dir/f.txt", data=b"uploaded")])
    with api(server) as http:
        req = http.post("/v3/templates", json={"name": "uploads"}).json()
        link = http.get(f"/templates/{req['templateID']}/files/{files_hash}")
        assert link.status_code == 201 and link.json()["present"] is False
        url = link.json()["url"]
        assert url.startswith(server.url + "/template-files/") and len(url.rsplit("/", 1)[1]) >= 40
        assert http.get("/templates/nope/files/" + files_hash).status_code == 404
        assert http.get(f"/templates/{req['templateID']}/files/not-hex").status_code == 400
    with httpx.Client(timeout=30) as anonymous:  # the token is the only credential, as S3's presigned URLs
        assert anonymous.put(server.url + "/template-files/" + "A" * 43, content=payload).status_code == 403
        assert anonymous.put(url, content=payload).status_code == 200
        assert anonymous.put(url, content=payload).status_code == 403  # spent
    with api(server) as http:
        again = http.get(f"/templates/{req['templateID']}/files/{files_hash}").json()
        assert again["present"] is True and again["url"] != url
        start = http.post(f"/v2/templates/{req['templateID']}/builds/{req['buildID']}",
                          json={"fromTemplate": "base", "steps": [
                              {"type": "COPY", "args": ["dir", "/data", "user", "0640"], "filesHash": files_hash}]})
        assert start.status_code == 202, start.text
        status = _wait(http, req["templateID"], req["buildID"])
        assert status["status"] == "ready", status
        assert http.post(f"/v2/templates/{req['templateID']}/builds/{req['buildID']}", json={}).status_code == 400
    record = record_of(server, req["templateID"], req["buildID"])
    f = tree(server, record["layers"][0]) / "data" / "f.txt"
    st = os.stat(f)
    assert f.read_text() == "uploaded" and (st.st_uid, stat.S_IMODE(st.st_mode)) == (ID_BASE + 1000, 0o640)


def test_an_upload_is_bounded(tmp_path: Path) -> None:
    with _serve(tmp_path, None, "--max-image-mb", "1") as small, api(small) as http:
        req = http.post("/v3/templates", json={"name": "big"}).json()
        url = http.get(f"/templates/{req['templateID']}/files/{'ab' * 32}").json()["url"]
        declared = httpx.put(url, content=b"x" * (2 << 20), timeout=30)
        assert declared.status_code == 413

        def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it comes
            for _ in range(40):
                yield b"y" * 65536

        streamed = httpx.put(url, content=chunks(), timeout=30)
        assert streamed.status_code == 413
        files = Path(small.proc.args[small.proc.args.index("--state-dir") + 1]) / "template-builds" / "files"
        assert [p for p in files.rglob("*") if p.is_file()] == []  # nothing kept of either


HOSTILE = {
    "absolute name": [entry("/etc/evil", data=b"x")],
    "dot-dot": [entry("dir/../../evil", data=b"x")],
    "through its own symlink": [entry("dir/", tarfile.DIRTYPE), entry("dir/l", tarfile.SYMTYPE, linkname="/tmp"),
                                entry("dir/l/evil", data=b"x")],
    "device node": [entry("dir/", tarfile.DIRTYPE), entry("dir/null", tarfile.CHRTYPE, devmajor=1, devminor=3)],
    "whiteout name": [entry("dir/", tarfile.DIRTYPE), entry("dir/.wh.passwd", data=b"")],
    "decompression bomb": [entry("dir/", tarfile.DIRTYPE), entry("dir/zeros", data=b"\0" * (3 << 20))],
}


def test_hostile_uploads_fail_the_build_and_write_nothing_outside(tmp_path: Path) -> None:
    outside = Path("/tmp/agentcell-build-escape")
    with _serve(tmp_path, None, "--max-image-mb", "2") as srv, api(srv) as http:
        for name, entries in HOSTILE.items():
            files_hash = hashlib.sha256(name.encode()).hexdigest()
            req = http.post("/v3/templates", json={"name": "hostile"}).json()
            url = http.get(f"/templates/{req['templateID']}/files/{files_hash}").json()["url"]
            assert httpx.put(url, content=_tgz(entries), timeout=30).status_code == 200, name
            http.post(f"/v2/templates/{req['templateID']}/builds/{req['buildID']}", json={"steps": [
                {"type": "ENV", "args": ["A", "1"]},
                {"type": "COPY", "args": ["dir", "/data"], "filesHash": files_hash}]}).raise_for_status()
            status = _wait(http, req["templateID"], req["buildID"])
            assert status["status"] == "error", (name, status)
            assert status["reason"]["step"] == "2", (name, status)
        store = store_of(srv)
        assert os.listdir(store.tmp_dir) == []
    assert not outside.exists() and not os.path.exists("/etc/evil") and not os.path.exists("/evil")


def test_cells_sharing_a_store_share_built_templates(tmp_path: Path, registry: Registry) -> None:
    """Two servers (cells) with one --template-store-dir: a template built on one starts sandboxes on the
    other by its name, and a cell starting meanwhile leaves the other's running build alone."""
    from e2b import Sandbox

    store = tmp_path / "store"
    a = _serve(tmp_path / "a", registry, "--cell-id", "cella001", "--template-store-dir", str(store))
    with a:
        slow = Template().from_image(f"{registry.address}/test/app:1").set_workdir("/").run_cmd(
            "sleep 2; echo built-on-a > /where", user="root")
        info = Template.build_in_background(slow, "shared:v1", **opts(a))
        with _serve(tmp_path / "b", registry, "--cell-id", "cellb002", "--template-store-dir", str(store)) as b:
            with api(a) as http:
                status = _wait(http, info.template_id, info.build_id)
            assert status["status"] == "ready", status.get("reason")  # b's start did not call a's build interrupted
            sbx = Sandbox.create("shared:v1", api_key=KEY, api_url=b.url, sandbox_url=b.url)
            try:
                assert sbx.commands.run("cat /where", user="root").stdout == "built-on-a\n"
                assert sbx.sandbox_id.startswith("cellb002")
            finally:
                sbx.kill()
            assert Template.exists("shared", **opts(b))


def test_a_build_through_the_gateway_runs_on_every_cell(tmp_path: Path, registry: Registry) -> None:
    """E2B's builder through `agentcell gateway` (docs/gateway.md): the build, its upload link and its
    status on one cell, sandboxes of the result on both."""
    from e2b import Sandbox

    from tests.servers import GatewayProcess

    store = tmp_path / "store"
    cells = [ServerProcess(tmp_path / f"{cid}.log", "--cell-id", cid, "--standbys", "0", "--egress-uplink", "none",
                           "--no-record", "--template-store-dir", str(store), "--insecure-registry", registry.address,
                           "--allowed-registry", "registry.invalid") for cid in ("cella001", "cellb002")]
    gateway = None
    try:
        for c in cells:
            c.wait_ready()
        gateway = GatewayProcess(tmp_path / "gw.log", [c.url for c in cells])
        gateway.wait_ready()
        ctx = context(tmp_path, {"greeting.txt": "through the gateway\n"})
        template = (Template(file_context_path=str(ctx)).from_image(f"{registry.address}/test/app:1").set_workdir("/")
                    .copy("greeting.txt", "/greeting.txt").run_cmd("cat /greeting.txt > /copied", user="root"))
        gw = {"api_key": "e2b_x", "api_url": gateway.url, "sandbox_url": gateway.url}
        Template.build(template, "via-gateway", **gw)
        seen: dict[str, Any] = {}
        try:
            for _ in range(24):  # creates go to the less loaded cell: until each has one
                sb = Sandbox.create("via-gateway", **gw)
                if sb.sandbox_id[:8] in seen:
                    sb.kill()
                    continue
                seen[sb.sandbox_id[:8]] = sb
                if len(seen) == 2:
                    break
            assert sorted(seen) == ["cella001", "cellb002"]
            for sb in seen.values():
                assert sb.commands.run("cat /copied", user="root").stdout == "through the gateway\n"
        finally:
            for sb in seen.values():
                sb.kill()
    finally:
        if gateway is not None:
            gateway.stop()
        for c in cells:
            c.stop()


# --- the records, slots and limits (builds.py) ------------------------------------------------------------


def test_builds_wait_for_a_slot_are_bounded_and_time_out(tmp_path: Path) -> None:
    async def scenario() -> None:
        reg = BuildRegistry(str(tmp_path / "builds"), concurrent=1, queue=1, timeout_s=0.5)
        gate = asyncio.Event()

        async def held(b: Any) -> None:
            await gate.wait()
            reg.succeed(b)

        _, first = reg.request("slots", [], None, 1, 512, set())
        _, second = reg.request("slots", [], None, 1, 512, set())
        _, third = reg.request("slots", [], None, 1, 512, set())
        reg.start(first, held)
        reg.start(second, held)
        assert (first.status, second.status) == ("building", "waiting")
        with pytest.raises(BuildsBusyError):
            reg.start(third, held)
        gate.set()
        while second.status != "ready":
            await asyncio.sleep(0.01)
        _, slow = reg.request("slots", [], None, 1, 512, set())

        async def forever(b: Any) -> None:
            await asyncio.sleep(60)

        reg.start(slow, forever)
        while slow.status != "error":
            await asyncio.sleep(0.05)
        assert "longer than" in slow.reason["message"]  # type: ignore[index]
        # persisted: a new registry (a restarted server) reads them back; nothing is left half-built
        _, unfinished = reg.request("slots", [], None, 1, 512, set())
        again = BuildRegistry(str(tmp_path / "builds"))
        assert again.builds[first.build_id].status == "ready"
        assert again.builds[unfinished.build_id].status == "error"
        assert "restarted" in again.builds[unfinished.build_id].reason["message"]  # type: ignore[index]

    asyncio.run(scenario())


def test_names_are_per_tenant(tmp_path: Path) -> None:
    reg = BuildRegistry(str(tmp_path / "builds"))
    alice, _ = reg.request("app", [], "uid:1001", 1, 512, set())
    bob, _ = reg.request("app", [], "uid:1002", 1, 512, set())
    assert alice.template_id != bob.template_id  # one name each, no clash, no hint of the other
    assert reg.find("app", "uid:1001") is alice and reg.find("app", "uid:1002") is bob
    assert reg.find(alice.template_id, "uid:1002") is None  # another's id: not found
    assert reg.find(alice.template_id, "uid:0") is alice  # the administrator sees all
    assert [t.template_id for t in reg.visible("uid:1001")] == [alice.template_id]


def test_damaged_records_are_set_aside_said_and_the_rest_load(tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A template's or a build's record that is not whole (cut short, empty, the wrong fields) is moved
    into templates/damaged/ or builds/damaged/ at the start, byte for byte, and said in the log; the
    good ones beside it load. Before, they were skipped without a word: the template was just gone."""
    root = tmp_path / "builds"
    reg = BuildRegistry(str(root))
    good, good_build = reg.request("good", [], None, 1, 512, set())
    cut, _ = reg.request("cut", [], None, 1, 512, set())
    _, emptied = reg.request("emptied", [], None, 1, 512, set())
    odd, _ = reg.request("odd", [], None, 1, 512, set())
    placed = {}
    for path, data in ((root / "templates" / f"{cut.template_id}.json", None),
                       (root / "builds" / f"{emptied.build_id}.json", b""),
                       (root / "templates" / f"{odd.template_id}.json", b'{"templateID": 3}')):
        data = path.read_bytes()[:40] if data is None else data
        path.write_bytes(data)
        placed[path] = data
    leftover = root / "templates" / f".{good.template_id}.json.x1y2z3.tmp"  # a crashed write's
    leftover.write_text('{"half a rec')
    with caplog.at_level("ERROR", logger="agentcell.templates"):
        again = BuildRegistry(str(root))
    assert again.find("good", None) is not None and good_build.build_id in again.builds
    assert again.find("cut", None) is None and again.find("odd", None) is None
    assert emptied.build_id not in again.builds
    for path, data in placed.items():
        assert not path.exists()
        assert (path.parent / "damaged" / path.name).read_bytes() == data
        [said] = [r.getMessage() for r in caplog.records if str(path) in r.getMessage()]
        assert "damaged" in said and f"{path.parent.name}/damaged/" in said, said
    assert not leftover.exists()
    assert BuildRegistry(str(root)).find("good", None) is not None  # a third start: nothing more moved


# --- helpers ----------------------------------------------------------------------------------------------


def _tgz(entries: list[Any]) -> bytes:
    return gzip.compress(tar_bytes(entries), mtime=0)


def _wait(http: httpx.Client, template_id: str, build_id: str) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while True:
        status: dict[str, Any] = http.get(f"/templates/{template_id}/builds/{build_id}/status").json()
        if status["status"] in ("ready", "error"):
            return status
        assert time.monotonic() < deadline, status
        time.sleep(0.05)


def test_e2b_base_is_e2bs_own_image_by_default(tmp_path: Path) -> None:
    """With no --e2b-base-image, Template() / from_base_image() start from E2B's own base image, pulled
    like any import: here the registry policy refuses Docker Hub, and the build's error says so (nothing
    leaves the machine)."""
    args = ["--state-dir", str(tmp_path / "state"), "--egress-uplink", "none", "--standbys", "0", "--no-record",
            "--api-key", KEY, "--allowed-registry", "registry.invalid"]
    with ServerProcess(tmp_path / "server.log", *args, command=SERVE) as srv:
        with pytest.raises(BuildException) as failed:
            Template.build(Template().from_base_image().run_cmd("true"), "on-e2b-base", **opts(srv))
    assert "registry docker.io is not allowed" in str(failed.value), str(failed.value)
