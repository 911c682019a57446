"""Importing OCI images as templates (agentcell/templates/): from a real registry on loopback (Debian's
docker-registry, with no auth, basic auth and bearer tokens), an OCI layout and a `docker save` tarball; layers
unpacked for overlayfs and stored once; the operator's controls (allowlist, insecure registries, size
ceiling, store budget and collection, concurrent imports); and hostile layers, each refused without a
byte written outside the layer. Images are made here (umoci from this host's files, or tar layers
written by hand); nothing reaches beyond 127.0.0.1.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import stat
import subprocess
import tarfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from agentcell.errors import (
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from agentcell.templates.fetch import Credentials
from agentcell.templates.importer import Importer, ImportLimits
from agentcell.templates.refs import ImageRef, RegistryPolicy, parse_ref
from agentcell.templates.store import TemplateStore
from agentcell.templates.unpack import ID_BASE, OPAQUE_XATTR
from tests.oci_images import (
    Registry,
    TokenServer,
    entry,
    host_files_image,
    sha256,
    skopeo_copy,
    tar_bytes,
    write_layout,
)

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0 or not all(shutil.which(t) for t in ("skopeo", "umoci", "docker-registry")),
    reason="needs root and skopeo, umoci, docker-registry (scripts/setup installs them)")

# files no other test of the suite changes meanwhile (ordinary_user.py runs useradd: /etc/passwd changes)
HOST_FILES = {"/bin/tool": "/usr/bin/env", "/etc/host.conf": "/etc/host.conf"}


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An OCI layout made with umoci from this host's files: `base` (two files), and `app-a`, `app-b`
    on top of it (a file each)."""
    layout = tmp_path_factory.mktemp("images") / "layout"
    host_files_image(layout, "base", HOST_FILES)
    host_files_image(layout, "app-a", {"/app/a": "/etc/hostname"}, base="base")
    host_files_image(layout, "app-b", {"/app/b": "/etc/debian_version"}, base="base")
    return layout


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory, images: Path):
    reg = Registry(tmp_path_factory.mktemp("registry"))
    try:
        for tag in ("base", "app-a", "app-b"):
            reg.push(f"oci:{images}:{tag}", f"test/img:{tag}")
        yield reg
    finally:
        reg.stop()


def store_at(tmp_path: Path, max_bytes: int = 1 << 30) -> TemplateStore:
    return TemplateStore(str(tmp_path / "store"), max_bytes)


def tree(store: TemplateStore, diff_id: str) -> Path:
    return Path(store.layer_path(diff_id)) / "tree"


def layer_dirs(store: TemplateStore) -> list[str]:
    return sorted(n for n in os.listdir(store.layers_dir) if not n.endswith(".json"))


def assert_untouched(store: TemplateStore) -> None:
    """A refused import leaves no layer, no template and nothing in the store's work area."""
    assert layer_dirs(store) == []
    assert os.listdir(store.templates_dir) == []
    assert os.listdir(store.tmp_dir) == []


# --- references ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "skopeo"), [
    ("python:3.12-slim", "docker://docker.io/library/python:3.12-slim"),
    ("python", "docker://docker.io/library/python:latest"),
    ("docker://python:3.12-slim", "docker://docker.io/library/python:3.12-slim"),
    ("docker://index.docker.io/library/python:3.12", "docker://docker.io/library/python:3.12"),
    ("bitnami/redis:7", "docker://docker.io/bitnami/redis:7"),
    ("ghcr.io/owner/tool/sub:v1.2", "docker://ghcr.io/owner/tool/sub:v1.2"),
    ("localhost:5000/x", "docker://localhost:5000/x:latest"),
    ("127.0.0.1:5000/a/b:t", "docker://127.0.0.1:5000/a/b:t"),
    ("[::1]:5000/a", "docker://[::1]:5000/a:latest"),
    ("quay.io/a/b@sha256:" + "a" * 64, "docker://quay.io/a/b@sha256:" + "a" * 64),
    ("oci:/srv/layout:v1", "oci:/srv/layout:v1"),
    ("oci:/srv/layout", "oci:/srv/layout"),
    ("docker-archive:/srv/img.tar", "docker-archive:/srv/img.tar"),
])
def test_references_parse_as_skopeo_and_docker_name_them(text: str, skopeo: str) -> None:
    assert parse_ref(text).skopeo() == skopeo


@pytest.mark.parametrize("text", ["Python:3", "a/b:bad tag", "x@sha256:12", "dir:/srv/x", "http://h/x",
                                  "containers-storage:x", "oci:", "host:99999/a", "a//b"])
def test_bad_references_are_refused(text: str) -> None:
    with pytest.raises(InvalidArgumentError):
        parse_ref(text)


def test_policy_default_is_public_registries_only() -> None:
    policy = RegistryPolicy()
    for ref in ("127.0.0.1:5000/a", "10.1.2.3/a", "169.254.169.254/a", "[::1]:5000/a", "192.168.1.1:443/x"):
        with pytest.raises(PermissionDeniedError, match="--allowed-registry"):
            policy.check(parse_ref(ref))
    policy.check(parse_ref("8.8.8.8/a"))  # a public address (checked, never contacted)
    policy.check(parse_ref("oci:/srv/x"))  # local files: not a registry


def test_policy_allowlist_and_insecure_names() -> None:
    policy = RegistryPolicy.of(allowed=["ghcr.io", "https://index.docker.io/"], insecure=["127.0.0.1:5000"])
    policy.check(parse_ref("python:3.12-slim"))  # Docker Hub, by any of its names
    policy.check(parse_ref("ghcr.io/a/b"))
    policy.check(parse_ref("127.0.0.1:5000/a"))  # named insecure: allowed too
    assert policy.is_insecure(parse_ref("127.0.0.1:5000/a"))
    assert not policy.is_insecure(parse_ref("ghcr.io/a/b"))
    with pytest.raises(PermissionDeniedError, match="not allowed"):
        policy.check(parse_ref("quay.io/a/b"))
    with pytest.raises(PermissionDeniedError):
        policy.check(ImageRef("docker", registry="127.0.0.1:5001", repository="a", tag="t"))


# --- imports ---------------------------------------------------------------------------------------


def test_import_from_registry_unpacks_the_image(tmp_path: Path, registry: Registry) -> None:
    store = store_at(tmp_path)
    rec = Importer(store, RegistryPolicy.of(insecure=[registry.address])).import_image(
        f"docker://{registry.address}/test/img:app-a", "app-a")
    assert rec["name"] == "app-a" and rec["source"] == f"docker://{registry.address}/test/img:app-a"
    assert len(rec["layers"]) == 3  # umoci: a layer per inserted file
    assert store.template("app-a") == rec
    files = {}
    for diff_id in rec["layers"]:
        root = tree(store, diff_id)
        files.update({"/" + str(p.relative_to(root)): p for p in root.rglob("*") if p.is_file()})
    assert files["/bin/tool"].read_bytes() == Path("/usr/bin/env").read_bytes()
    assert files["/app/a"].read_bytes() == Path("/etc/hostname").read_bytes()
    st = files["/bin/tool"].stat()
    assert (st.st_uid, st.st_gid) == (ID_BASE, ID_BASE)  # the image's root, shifted: no host user's
    assert st.st_mode & 0o111
    assert os.stat(store.root).st_mode & 0o777 == 0o700
    assert os.listdir(store.tmp_dir) == []


def test_import_from_oci_layout_and_docker_archive_share_the_layers(tmp_path: Path, images: Path) -> None:
    archive = tmp_path / "app-a.tar"
    skopeo_copy(f"oci:{images}:app-a", f"docker-archive:{archive}:test/app-a:1")
    store = store_at(tmp_path)
    importer = Importer(store)
    from_layout = importer.import_image(f"oci:{images}:app-a", "from-layout")
    from_archive = importer.import_image(f"docker-archive:{archive}", "from-archive")
    assert from_archive["layers"] == from_layout["layers"]  # the same uncompressed content: the same layers
    assert len(layer_dirs(store)) == 3
    assert (tree(store, from_archive["layers"][-1]) / "app" / "a").read_bytes() == Path("/etc/hostname").read_bytes()


def test_a_base_layer_two_images_share_is_stored_once(tmp_path: Path, registry: Registry) -> None:
    store = store_at(tmp_path)
    importer = Importer(store, RegistryPolicy.of(insecure=[registry.address]))
    a = importer.import_image(f"docker://{registry.address}/test/img:app-a", "a")
    size_a = store.size_bytes()
    b = importer.import_image(f"docker://{registry.address}/test/img:app-b", "b")
    assert a["layers"][:2] == b["layers"][:2] and a["layers"][2] != b["layers"][2]
    assert len(layer_dirs(store)) == 4  # two shared, one each
    top_b = store.layer_info(b["layers"][2])["file_bytes"]
    assert top_b == Path("/etc/debian_version").stat().st_size
    assert store.size_bytes() == size_a + top_b  # the shared base counted (and stored) once
    assert a["size_bytes"] + b["size_bytes"] > store.size_bytes()


def test_layer_semantics_whiteouts_opaque_dirs_links_setuid_xattrs(tmp_path: Path) -> None:
    cap = bytes.fromhex("0100000200040000000000000000000000000000")  # v2: cap_net_bind_service, permitted, effective
    layer = tar_bytes([
        entry("./", tarfile.DIRTYPE, mode=0o755),
        entry("bin/", tarfile.DIRTYPE, mode=0o755),
        entry("bin/su", data=b"#!setuid", mode=0o4755),
        entry("bin/su-again", tarfile.LNKTYPE, linkname="bin/su"),
        entry("bin/ping", data=b"ping", mode=0o755, pax={"SCHILY.xattr.security.capability": cap.decode("latin-1")}),
        entry("bin/tagged", data=b"x", pax={"SCHILY.xattr.user.origin": "test", "SCHILY.xattr.trusted.evil": "y"}),
        entry("etc/", tarfile.DIRTYPE),
        entry("etc/.wh.removed"),
        entry("var/cache/", tarfile.DIRTYPE, mode=0o700, uid=100, gid=101),
        entry("var/cache/.wh..wh..opq"),
        entry("var/log", tarfile.SYMTYPE, linkname="/etc/shadow"),
        entry("run/pipe", tarfile.FIFOTYPE, mode=0o620),
        entry("home/u/", tarfile.DIRTYPE, uid=1000, gid=1000),
        entry("home/u/f", data=b"mine", uid=1000, gid=1000, mode=0o2750),
    ])
    write_layout(tmp_path / "layout", [layer])
    store = store_at(tmp_path)
    rec = Importer(store).import_image(f"oci:{tmp_path}/layout:latest", "semantics")
    root = tree(store, rec["layers"][0])
    su, again = (root / "bin/su").stat(), (root / "bin/su-again").stat()
    assert su.st_ino == again.st_ino and su.st_nlink == 2
    assert stat.S_IMODE(su.st_mode) == 0o4755 and su.st_uid == ID_BASE  # setuid to the image's root, shifted
    wh = (root / "etc/removed").lstat()
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0  # an overlay whiteout
    assert not (root / "etc/.wh.removed").exists()
    assert os.getxattr(root / "var/cache", OPAQUE_XATTR) == b"y"
    assert not (root / "var/cache/.wh..wh..opq").exists()
    cache = (root / "var/cache").stat()
    assert (cache.st_uid, cache.st_gid, stat.S_IMODE(cache.st_mode)) == (ID_BASE + 100, ID_BASE + 101, 0o700)
    assert os.readlink(root / "var/log") == "/etc/shadow"  # kept as it is
    assert stat.S_ISFIFO((root / "run/pipe").lstat().st_mode)
    f = (root / "home/u/f").stat()
    assert (f.st_uid, stat.S_IMODE(f.st_mode)) == (ID_BASE + 1000, 0o2750)
    assert os.getxattr(root / "bin/tagged", "user.origin") == b"test"
    assert "trusted.evil" not in os.listxattr(root / "bin/tagged")
    # a namespaced capability of ID_BASE as root: honoured in a sandbox's namespace, never on the host
    stored = os.getxattr(root / "bin/ping", "security.capability")
    assert stored == bytes.fromhex("01000003") + cap[4:20] + ID_BASE.to_bytes(4, "little")
    if shutil.which("getcap"):
        shown = subprocess.run(["getcap", "-n", str(root / "bin/ping")], capture_output=True, text=True).stdout
        assert f"[rootid={ID_BASE}]" in shown and "cap_net_bind_service" in shown, shown
    info = store.layer_info(rec["layers"][0])
    assert info["capabilities"] == {"/bin/ping": cap.hex()}
    assert "/bin/tagged: trusted.evil" in info["dropped_xattrs"]


@pytest.mark.parametrize("compression", ["zstd", "none"])
def test_zstd_and_uncompressed_layers(tmp_path: Path, compression: str) -> None:
    layers = [tar_bytes([entry("a", data=b"one")]), tar_bytes([entry("b/", tarfile.DIRTYPE), entry("b/c", data=b"two")])]
    write_layout(tmp_path / "layout", layers, compression=compression)
    store = store_at(tmp_path)
    rec = Importer(store).import_image(f"oci:{tmp_path}/layout", compression)
    assert rec["layers"] == [sha256(t) for t in layers]
    assert (tree(store, rec["layers"][1]) / "b/c").read_bytes() == b"two"


def test_an_image_file_capability_is_not_honoured_on_the_host(tmp_path: Path) -> None:
    """A program of the image with cap_net_bind_service=ep, run on the host by an unprivileged user,
    gets no capability (the same bytes as a host v2 capability would give it: the control)."""
    cap = bytes.fromhex("0100000200040000000000000000000000000000")
    cat = Path("/usr/bin/cat").read_bytes()
    write_layout(tmp_path / "layout", [tar_bytes([
        entry("cat", data=cat, mode=0o755, pax={"SCHILY.xattr.security.capability": cap.decode("latin-1")})])])
    store = store_at(tmp_path)
    rec = Importer(store).import_image(f"oci:{tmp_path}/layout", "caps")
    control = tmp_path / "control-cat"
    control.write_bytes(cat)
    control.chmod(0o755)
    os.setxattr(control, "security.capability", cap)  # a host (v2) capability

    def permitted_as_nobody(program: Path) -> int:
        status = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(program),
                                 "/proc/self/status"], capture_output=True, text=True, check=True).stdout
        return int(next(line for line in status.splitlines() if line.startswith("CapPrm:")).split()[1], 16)

    os.chmod(tmp_path, 0o755)
    os.chmod(store.root, 0o711)  # only for this test: nobody may reach the program
    for d in (store.layers_dir, store.layer_path(rec["layers"][0])):
        os.chmod(d, 0o711)
    assert permitted_as_nobody(control) == 1 << 10  # cap_net_bind_service: a host capability works
    assert permitted_as_nobody(tree(store, rec["layers"][0]) / "cat") == 0


def test_umoci_whiteouts_unpack_as_overlay_whiteouts(tmp_path: Path, images: Path) -> None:
    layout = tmp_path / "layout"
    shutil.copytree(images, layout)
    subprocess.run(["umoci", "tag", "--image", f"{layout}:base", "gone"], check=True)
    subprocess.run(["umoci", "insert", "--image", f"{layout}:gone", "--whiteout", "/etc/host.conf"], check=True,
                   capture_output=True)
    store = store_at(tmp_path)
    rec = Importer(store).import_image(f"oci:{layout}:gone", "gone")
    wh = (tree(store, rec["layers"][-1]) / "etc/host.conf").lstat()
    assert stat.S_ISCHR(wh.st_mode) and wh.st_rdev == 0


def test_a_corrupt_blob_in_the_registry_is_refused(tmp_path: Path, images: Path) -> None:
    reg = Registry(tmp_path / "registry")
    try:
        reg.push(f"oci:{images}:app-a", "corrupt/img:1")
        manifest = json.loads((images / "blobs/sha256" / _manifest_digest(images, "app-a").split(":")[1]).read_bytes())
        data = reg.blob_data(manifest["layers"][-1]["digest"])
        raw = bytearray(data.read_bytes())
        raw[-20] ^= 0xFF  # the same size, another content
        data.write_bytes(bytes(raw))
        store = store_at(tmp_path)
        with pytest.raises(InvalidArgumentError, match="digest"):
            Importer(store, RegistryPolicy.of(insecure=[reg.address])).import_image(
                f"docker://{reg.address}/corrupt/img:1", "corrupt")
        assert_untouched(store)
    finally:
        reg.stop()


def test_a_registry_sending_more_than_the_manifest_says_is_cut_off(tmp_path: Path) -> None:
    """The manifest's sizes pass the ceiling; the blob the registry then sends is 64 MiB more (its digest
    would fail only at its end): the download stops at the ceiling."""
    write_layout(tmp_path / "layout", [tar_bytes([entry("a", data=b"small")])])
    reg = Registry(tmp_path / "registry")
    try:
        reg.push(f"oci:{tmp_path}/layout:latest", "liar/img:1")
        manifest = json.loads((tmp_path / "layout/blobs/sha256" / _manifest_digest(tmp_path / "layout", "latest")
                               .split(":")[1]).read_bytes())
        with open(reg.blob_data(manifest["layers"][0]["digest"]), "ab") as f:
            f.write(os.urandom(64 << 20))
        store = store_at(tmp_path)
        with pytest.raises(ResourceExhaustedError, match="--max-image-mb"):
            Importer(store, RegistryPolicy.of(insecure=[reg.address]), ImportLimits(max_image_bytes=4 << 20)).import_image(
                f"docker://{reg.address}/liar/img:1", "liar")
        assert_untouched(store)
    finally:
        reg.stop()


def test_a_corrupt_blob_in_a_layout_is_refused(tmp_path: Path) -> None:
    write_layout(tmp_path / "layout", [tar_bytes([entry("a", data=b"hello" * 100)])])
    blobs = tmp_path / "layout/blobs/sha256"
    manifest = json.loads((blobs / _manifest_digest(tmp_path / "layout", "latest").split(":")[1]).read_bytes())
    blob = blobs / manifest["layers"][0]["digest"].split(":")[1]
    raw = bytearray(blob.read_bytes())
    raw[-9] ^= 0xFF  # gzip's crc: the tar inside stays whole, only the digest tells
    blob.write_bytes(bytes(raw))
    store = store_at(tmp_path)
    with pytest.raises(InvalidArgumentError, match="digest"):
        Importer(store).import_image(f"oci:{tmp_path}/layout", "corrupt")
    assert_untouched(store)


def test_broken_compressed_data_is_refused(tmp_path: Path) -> None:
    write_layout(tmp_path / "layout", [tar_bytes([entry("a", data=os.urandom(50_000))])], compression="broken-gzip")
    store = store_at(tmp_path)
    with pytest.raises(InvalidArgumentError, match="not a valid tar"):
        Importer(store).import_image(f"oci:{tmp_path}/layout", "broken")
    assert_untouched(store)


def test_a_wrong_diff_id_is_refused(tmp_path: Path) -> None:
    """A config whose diff_id is not its layer's uncompressed digest (the blob's own digest is right)."""
    good, other = tar_bytes([entry("a", data=b"1")]), tar_bytes([entry("a", data=b"2")])
    write_layout(tmp_path / "layout", [good], diff_ids=[sha256(other)])
    store = store_at(tmp_path)
    with pytest.raises(InvalidArgumentError, match="uncompressed"):
        Importer(store).import_image(f"oci:{tmp_path}/layout", "wrong")
    assert_untouched(store)


def _manifest_digest(layout: Path, tag: str) -> str:
    index = json.loads((layout / "index.json").read_text())
    return next(m["digest"] for m in index["manifests"]
                if m.get("annotations", {}).get("org.opencontainers.image.ref.name") == tag)


# --- the operator's controls -----------------------------------------------------------------------


def test_a_plain_http_registry_is_refused_unless_named_insecure(tmp_path: Path, registry: Registry) -> None:
    store = store_at(tmp_path)
    with pytest.raises(PermissionDeniedError, match="--insecure-registry"):
        Importer(store, RegistryPolicy.of(allowed=[registry.address])).import_image(
            f"docker://{registry.address}/test/img:base", "plain")
    assert_untouched(store)
    Importer(store, RegistryPolicy.of(insecure=[registry.address])).import_image(
        f"docker://{registry.address}/test/img:base", "plain")


def test_a_registry_outside_the_allowlist_is_refused_before_any_request(tmp_path: Path, registry: Registry) -> None:
    store = store_at(tmp_path)
    before = registry.requests()
    with pytest.raises(PermissionDeniedError, match="not allowed"):
        Importer(store, RegistryPolicy.of(allowed=["registry.example.com"])).import_image(
            f"docker://{registry.address}/test/img:base", "x")
    with pytest.raises(PermissionDeniedError, match="loopback, private or reserved"):
        Importer(store).import_image(f"docker://{registry.address}/test/img:base", "x")  # default: public only
    assert registry.requests() == before
    assert_untouched(store)


def test_the_api_imports_from_registries_only(tmp_path: Path, images: Path) -> None:
    store = store_at(tmp_path)
    with pytest.raises(InvalidArgumentError, match="only registry images"):
        Importer(store).import_image(f"oci:{images}:base", "x", remote=True)


def test_basic_auth_registry(tmp_path: Path, images: Path) -> None:
    reg = Registry(tmp_path / "registry", users={"alice": "s3cret-pw"})
    try:
        reg.push(f"oci:{images}:base", "private/img:1", creds="alice:s3cret-pw")
        store = store_at(tmp_path)
        importer = Importer(store, RegistryPolicy.of(insecure=[reg.address]))
        ref = f"docker://{reg.address}/private/img:1"
        with pytest.raises(PermissionDeniedError, match="refused access"):
            importer.import_image(ref, "private")
        with pytest.raises(PermissionDeniedError, match="refused access"):
            importer.import_image(ref, "private", Credentials("alice", "wrong"))
        assert_untouched(store)
        rec = importer.import_image(ref, "private", Credentials("alice", "s3cret-pw"))
        assert (tree(store, rec["layers"][1]) / "etc/host.conf").read_bytes() == Path("/etc/host.conf").read_bytes()
        assert os.listdir(store.tmp_dir) == []  # the authfile went with the import's private directory
    finally:
        reg.stop()


def test_bearer_token_auth(tmp_path: Path, images: Path) -> None:
    """A registry with distribution's token auth (Docker Hub's kind): its Bearer challenge sends the
    client to a token server, which takes the import's credentials as basic auth and returns a JWT the
    registry verifies (RS256, against the token server's certificate) and checks the scope of."""
    tokens = TokenServer(tmp_path / "token", {"bob": "t0ken-pw"})
    reg = Registry(tmp_path / "registry", token_auth=tokens)
    try:
        reg.push(f"oci:{images}:base", "private/img:1", creds="bob:t0ken-pw")
        challenge = httpx.get(f"http://{reg.address}/v2/").headers["www-authenticate"]
        assert challenge.startswith(f'Bearer realm="{tokens.realm}"') and f'service="{tokens.service}"' in challenge
        store = store_at(tmp_path)
        importer = Importer(store, RegistryPolicy.of(insecure=[reg.address]))
        ref = f"docker://{reg.address}/private/img:1"
        pull = ["repository:private/img:pull"]

        log = reg.root / "registry.log"

        def authorized_pulls(since: int) -> list[str]:
            """The registry's log lines since byte `since` saying it let a GET of the image through."""
            with open(log, "rb") as f:
                f.seek(since)
                return [line for line in f.read().decode(errors="replace").splitlines()
                        if 'msg="authorized request"' in line and "http.request.method=GET" in line
                        and "/v2/private/img/" in line]

        seen = log.stat().st_size
        tokens.requests.clear()
        with pytest.raises(PermissionDeniedError, match="refused access"):
            importer.import_image(ref, "private")
        assert tokens.requests and all(user is None for user, _, _ in tokens.requests)  # anonymous tokens only
        tokens.requests.clear()
        with pytest.raises(PermissionDeniedError, match="refused access"):
            importer.import_image(ref, "private", Credentials("bob", "wrong"))
        assert ("bob", pull, 401) in tokens.requests
        # the registry takes only tokens: the right credentials sent to it as basic auth are refused too
        manifest = httpx.get(f"http://{reg.address}/v2/private/img/manifests/1", auth=("bob", "t0ken-pw"))
        assert manifest.status_code == 401 and manifest.headers["www-authenticate"].startswith("Bearer ")
        assert authorized_pulls(seen) == []
        assert_untouched(store)

        seen = log.stat().st_size
        tokens.requests.clear()
        rec = importer.import_image(ref, "private", Credentials("bob", "t0ken-pw"))
        assert (tree(store, rec["layers"][1]) / "etc/host.conf").read_bytes() == Path("/etc/host.conf").read_bytes()
        assert tokens.requests and all(r == ("bob", pull, 200) for r in tokens.requests)
        authorized = authorized_pulls(seen)  # the registry took bob's token for the manifest and the blobs
        assert any("/v2/private/img/manifests/1" in line for line in authorized)
        assert any("/v2/private/img/blobs/" in line for line in authorized)
        assert os.listdir(store.tmp_dir) == []  # the authfile went with the import's private directory
    finally:
        reg.stop()
        tokens.stop()


def test_the_size_ceiling_refuses_before_downloading(tmp_path: Path, registry: Registry) -> None:
    store = store_at(tmp_path)
    limits = ImportLimits(max_image_bytes=20_000)  # /usr/bin/env alone is bigger
    before = registry.requests()
    with pytest.raises(ResourceExhaustedError, match="--max-image-mb"):
        Importer(store, RegistryPolicy.of(insecure=[registry.address]), limits).import_image(
            f"docker://{registry.address}/test/img:base", "big")
    assert not any("/blobs/" in r for r in registry.requests()[len(before):])  # only the manifest was read
    assert_untouched(store)


def test_the_size_ceiling_bounds_a_local_image_too(tmp_path: Path, images: Path) -> None:
    store = store_at(tmp_path)
    with pytest.raises(ResourceExhaustedError, match="--max-image-mb"):
        Importer(store, limits=ImportLimits(max_image_bytes=20_000)).import_image(f"oci:{images}:base", "big")
    assert_untouched(store)


def test_the_store_budget_collects_unused_layers_then_refuses(tmp_path: Path, images: Path) -> None:
    env_size = Path("/usr/bin/env").stat().st_size
    store = store_at(tmp_path, max_bytes=env_size + 10_000)  # room for one base, not two different images
    importer = Importer(store)
    importer.import_image(f"oci:{images}:base", "one")
    other = tmp_path / "other"
    write_layout(other, [tar_bytes([entry("big", data=os.urandom(env_size))])])
    with pytest.raises(ResourceExhaustedError, match="--template-store-max-gb"):
        importer.import_image(f"oci:{other}", "two")
    assert [t["name"] for t in store.templates()] == ["one"]
    assert os.listdir(store.tmp_dir) == []
    store.delete_template("one")  # its layers are now unused: the next import collects them
    rec = importer.import_image(f"oci:{other}", "two")
    assert layer_dirs(store) == [rec["layers"][0].split(":")[1]]
    assert store.size_bytes() == env_size


def test_collection_removes_unreferenced_layers_and_keeps_shared_ones(tmp_path: Path, images: Path) -> None:
    store = store_at(tmp_path)
    importer = Importer(store)
    a = importer.import_image(f"oci:{images}:app-a", "a")
    b = importer.import_image(f"oci:{images}:app-b", "b")
    assert store.collect().removed_layers == []
    store.delete_template("a")
    with pytest.raises(NotFoundError):
        store.template("a")
    done = store.collect()
    assert done.removed_layers == [a["layers"][2]]  # a's own layer; the base stays for b
    assert done.freed_bytes == Path("/etc/hostname").stat().st_size
    assert sorted(layer_dirs(store)) == sorted(d.split(":")[1] for d in b["layers"])
    assert (tree(store, b["layers"][0]) / "bin/tool").exists()
    # re-importing a brings back only its own layer
    importer.import_image(f"oci:{images}:app-a", "a")
    assert len(layer_dirs(store)) == 4


def test_concurrent_imports_are_bounded(tmp_path: Path, images: Path) -> None:
    store = store_at(tmp_path)
    importer = Importer(store, limits=ImportLimits(concurrent=1))
    lock = os.open(os.path.join(store.root, "lock"), os.O_RDWR)
    fcntl.flock(lock, fcntl.LOCK_EX)  # as a collection would: the first import waits for it
    results: dict[str, object] = {}

    def run(name: str, tag: str) -> None:
        try:
            results[name] = importer.import_image(f"oci:{images}:{tag}", name)
        except Exception as e:  # noqa: BLE001 (the test looks at it)
            results[name] = e

    first = threading.Thread(target=run, args=("first", "base"), daemon=True)
    first.start()
    time.sleep(0.5)
    second = threading.Thread(target=run, args=("second", "app-a"), daemon=True)
    second.start()
    second.join(10)  # refused at once, not queued behind the first
    os.close(lock)
    first.join(60)
    assert isinstance(results.get("second"), ResourceExhaustedError), results.get("second")
    assert "running already" in str(results["second"])
    assert isinstance(results.get("first"), dict) and store.template("first")
    importer.import_image(f"oci:{images}:app-a", "second")  # the slot is free again


# --- hostile layers --------------------------------------------------------------------------------


def _sparse_tar(tmp_path: Path) -> bytes:
    """GNU tar's own sparse entry (pax format): a 64 GiB file of one byte."""
    src = tmp_path / "sparse-src"
    src.mkdir()
    with open(src / "huge", "wb") as f:
        f.truncate(64 << 30)
        f.seek(1 << 20)
        f.write(b"x")
    return subprocess.run(["tar", "-C", str(src), "--sparse", "--format=posix", "-cf", "-", "huge"],
                          check=True, capture_output=True).stdout


def _pax_bomb() -> bytes:
    info, _ = entry("a", data=b"")
    info.pax_headers = {"comment": "x" * (2 << 20)}
    return tar_bytes([(info, b"")])


HOSTILE = {
    "absolute-name": (lambda p: tar_bytes([entry("/outside/pwned", data=b"x")]), InvalidArgumentError, "absolute"),
    "dot-dot-name": (lambda p: tar_bytes([entry("a/../../outside/pwned", data=b"x")]), InvalidArgumentError, "'..'"),
    "symlink-then-through-it": (lambda p: tar_bytes([
        entry("link", tarfile.SYMTYPE, linkname=str(p / "outside")),
        entry("link/pwned", data=b"x")]), InvalidArgumentError, "not a directory"),
    "symlink-dir-then-through-it": (lambda p: tar_bytes([
        entry("d/", tarfile.DIRTYPE), entry("d/up", tarfile.SYMTYPE, linkname="../../../.."),
        entry("d/up/" + str(p / "outside/pwned").lstrip("/"), data=b"x")]), InvalidArgumentError, "not a directory"),
    "hardlink-out": (lambda p: tar_bytes([entry("pw", tarfile.LNKTYPE, linkname=str(p / "outside/secret"))]),
                     InvalidArgumentError, "absolute"),
    "hardlink-to-nothing-earlier": (lambda p: tar_bytes([entry("pw", tarfile.LNKTYPE, linkname="etc/shadow")]),
                                    InvalidArgumentError, "not an earlier file"),
    "foreign-owner": (lambda p: tar_bytes([entry("f", data=b"x", uid=100_000)]), InvalidArgumentError, "outside the ids"),
    "one-huge-file": (lambda p: tar_bytes([entry("zeros", data=bytes(48 << 20))]), ResourceExhaustedError,
                      "huge or sparse"),
    # zeros after the tar's end: no file to count, the decompressed stream itself is the bomb
    "decompression-bomb": (lambda p: tar_bytes([entry("a", data=b"x")]) + bytes(64 << 20), ResourceExhaustedError,
                           "decompression bomb"),
    "huge-sparse-file": (_sparse_tar, ResourceExhaustedError, "huge or sparse"),
    "huge-pax-header": (lambda p: _pax_bomb(), ResourceExhaustedError, "extended tar header"),
    "many-entries": (lambda p: tar_bytes([entry(f"f{i}", data=b"") for i in range(300)]), ResourceExhaustedError,
                     "entries"),
}


def test_device_nodes_are_left_out_and_recorded(tmp_path: Path) -> None:
    """A layer's device nodes (rootfs tools put /dev/console, /dev/null ... in their tars) are never
    made: the image imports without them, and the layer's record names them."""
    layer = tar_bytes([entry("dev/", tarfile.DIRTYPE), entry("dev/mem", tarfile.CHRTYPE, devmajor=1, devminor=1),
                       entry("dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=0), entry("kept", data=b"x")])
    write_layout(tmp_path / "layout", [layer])
    store = store_at(tmp_path)
    record = Importer(store).import_image(f"oci:{tmp_path}/layout", "devices")
    tree = Path(store.layer_path(record["layers"][0])) / "tree"
    assert sorted(os.listdir(tree / "dev")) == []
    assert (tree / "kept").read_bytes() == b"x"
    assert store.layer_info(record["layers"][0])["dropped_devices"] == ["dev/mem", "dev/sda"]


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_layer_is_refused_without_writing_outside(tmp_path: Path, kind: str) -> None:
    make, error, message = HOSTILE[kind]
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host secret")
    write_layout(tmp_path / "layout", [make(tmp_path)])
    store = store_at(tmp_path)
    limits = ImportLimits(max_image_bytes=8 << 20, max_entries=200)
    started = time.monotonic()
    with pytest.raises(error, match=message):
        Importer(store, limits=limits).import_image(f"oci:{tmp_path}/layout", "hostile")
    assert time.monotonic() - started < 60
    assert sorted(os.listdir(outside)) == ["secret"]
    assert (outside / "secret").read_text() == "host secret"
    assert os.stat(outside / "secret").st_nlink == 1
    assert_untouched(store)


# --- the API and the CLI ---------------------------------------------------------------------------


def test_the_api_route_imports_from_the_registry(tmp_path: Path, registry: Registry) -> None:
    """A real `agentcell serve` with the operator's flags: an import through POST /templates/imports."""
    from tests.servers import SERVE, ServerProcess

    state = tmp_path / "state"
    args = ["--state-dir", str(state), "--egress-uplink", "none", "--standbys", "0", "--no-record",
            "--insecure-registry", registry.address, "--allowed-registry", "registry.example.com",
            "--max-image-mb", "64", "--template-store-max-gb", "1", "--api-key", "test-key"]
    with ServerProcess(tmp_path / "server.log", *args, command=SERVE) as server, server.http_client(120) as http:
        anonymous = http.post("/templates/imports", json={"name": "app-a", "fromImage": f"{registry.address}/test/img:app-a"})
        assert anonymous.status_code == 401  # the control plane's API key, as for every other route
        http.headers["X-API-KEY"] = "test-key"
        ok = http.post("/templates/imports", json={"name": "app-a", "fromImage": f"{registry.address}/test/img:app-a"})
        assert ok.status_code == 201, ok.text
        body = ok.json()
        assert body["templateID"] == "app-a" and len(body["layers"]) == 3
        assert body["source"] == f"docker://{registry.address}/test/img:app-a"
        store = TemplateStore(str(state / "templates"))
        assert store.template("app-a")["layers"] == body["layers"]
        refused = http.post("/templates/imports", json={"name": "x", "fromImage": "127.0.0.2:5000/test/img:app-a"})
        assert refused.status_code == 403 and "not allowed" in refused.json()["message"]
        local = http.post("/templates/imports", json={"name": "x", "fromImage": f"oci:{tmp_path}"})
        assert local.status_code == 400 and "only registry images" in local.json()["message"]
        missing = http.post("/templates/imports", json={"name": "x", "fromImage": f"{registry.address}/test/nope:1"})
        assert missing.status_code == 404, missing.text
        bad = http.post("/templates/imports", json={"name": "x", "fromImage": f"{registry.address}/test/img:app-a",
                                                     "fromImageRegistry": {"type": "gcp"}})
        assert bad.status_code == 400
        # the E2B routes around it still answer as before
        assert http.post("/templates/other", json={}).status_code == 501
    assert sorted(os.listdir(state / "templates" / "tmp")) == []


def test_the_cli_imports_lists_removes_and_collects(tmp_path: Path, images: Path) -> None:
    from click.testing import CliRunner

    from agentcell.cli import main

    store_dir = str(tmp_path / "store")
    runner = CliRunner()
    done = runner.invoke(main, ["template", "import", f"oci:{images}:app-a", "--name", "a", "--store", store_dir, "--json"])
    assert done.exit_code == 0, done.output
    assert len(json.loads(done.output)["layers"]) == 3
    listed = runner.invoke(main, ["template", "ls", "--store", store_dir])
    assert listed.exit_code == 0 and f"oci:{images}:app-a" in listed.output
    refused = runner.invoke(main, ["template", "import", "127.0.0.1:1/x", "--name", "b", "--store", store_dir])
    assert refused.exit_code != 0 and "loopback, private or reserved" in refused.output
    assert runner.invoke(main, ["template", "rm", "a", "--store", store_dir]).exit_code == 0
    gc = runner.invoke(main, ["template", "gc", "--store", store_dir, "--json"])
    assert gc.exit_code == 0 and len(json.loads(gc.output)["removed_layers"]) == 3
    assert layer_dirs(TemplateStore(store_dir)) == []
