"""OCI images made here for the template tests, and Debian's `docker-registry` on loopback to serve them
(with basic auth, or bearer tokens from a token server made here).

Images are made two ways: with umoci from this host's own files (the field's tool, real layers), and
by hand from tar layers written with tarfile (`write_layout`), for the hostile layers no tool makes.
Nothing here reaches beyond 127.0.0.1 but mmdebstrap, which fetches Debian packages from the archive.
"""

from __future__ import annotations

import base64
import datetime
import gzip
import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from cryptography.x509.oid import NameOID

from tests.servers import free_port

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG = "application/vnd.oci.image.config.v1+json"
OCI_LAYER_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
OCI_LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def tar_bytes(entries: list[tuple[tarfile.TarInfo, bytes | None]], fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for info, data in entries:
            if data is not None:
                info.size = len(data)
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    return buf.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, *, data: bytes | None = None, mode: int = 0o644,
          uid: int = 0, gid: int = 0, linkname: str = "", pax: dict[str, str] | None = None,
          devmajor: int = 0, devminor: int = 0) -> tuple[tarfile.TarInfo, bytes | None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = mode
    info.uid, info.gid = uid, gid
    info.mtime = 1_700_000_000
    info.linkname = linkname
    info.devmajor, info.devminor = devmajor, devminor
    if pax:
        info.pax_headers = dict(pax)
    if kind == tarfile.REGTYPE and data is None:
        data = b""
    return info, data


def write_layout(path: Path, layers: list[bytes], *, tag: str = "latest", compression: str = "gzip",
                 config: dict[str, Any] | None = None, diff_ids: list[str] | None = None) -> str:
    """An OCI image layout at `path` holding one image of these uncompressed layer tars (`diff_ids`:
    what its config says they are, their digests unless given); returns the manifest's digest."""
    blobs = path / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    (path / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))

    def put(data: bytes) -> str:
        digest = sha256(data)
        (blobs / digest.split(":")[1]).write_bytes(data)
        return digest

    descs = []
    for tar in layers:
        if compression == "gzip":
            blob = gzip.compress(tar, mtime=0)
        elif compression == "broken-gzip":  # its digest is right, its deflate data is not
            good = bytearray(gzip.compress(tar, mtime=0))
            good[12] ^= 0xFF  # the deflate stream's first block header
            blob = bytes(good)
        elif compression == "zstd":
            blob = subprocess.run(["zstd", "-q", "-c"], input=tar, check=True, capture_output=True).stdout
        else:
            blob = tar
        media = {"gzip": OCI_LAYER_GZIP, "broken-gzip": OCI_LAYER_GZIP, "zstd": OCI_LAYER_TAR + "+zstd"}.get(compression, OCI_LAYER_TAR)
        descs.append({"mediaType": media, "digest": put(blob), "size": len(blob)})
    cfg = {"architecture": "amd64", "os": "linux", "config": config or {"Cmd": ["/bin/sh"]},
           "rootfs": {"type": "layers", "diff_ids": diff_ids or [sha256(t) for t in layers]}}
    cfg_blob = json.dumps(cfg).encode()
    manifest = json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                           "config": {"mediaType": OCI_CONFIG, "digest": put(cfg_blob), "size": len(cfg_blob)},
                           "layers": descs}).encode()
    mdigest = put(manifest)
    index_path = path / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {"schemaVersion": 2, "manifests": []}
    index["manifests"] = [m for m in index["manifests"]
                          if m.get("annotations", {}).get("org.opencontainers.image.ref.name") != tag]
    index["manifests"].append({"mediaType": OCI_MANIFEST, "digest": mdigest, "size": len(manifest),
                               "annotations": {"org.opencontainers.image.ref.name": tag}})
    index_path.write_text(json.dumps(index))
    return mdigest


def umoci(*args: str) -> None:
    subprocess.run(["umoci", *args], check=True, capture_output=True)


def skopeo_copy(src: str, dst: str) -> None:
    """Copy between this test's own places (a loopback registry over plain HTTP included)."""
    subprocess.run(["skopeo", "copy", "--quiet", "--src-tls-verify=false", "--dest-tls-verify=false", src, dst],
                   check=True, capture_output=True)


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


class TokenServer:
    """A token server of distribution's token auth (the Docker Hub kind) on 127.0.0.1, in a thread: a
    client the registry sent here with a Bearer challenge asks `GET /token?service=...&scope=...`, with
    basic credentials or none; it gets a JWT (RS256) granting the scope's actions to a user of `users`
    (wrong credentials: 401; none: an anonymous token granting nothing). The registry trusts
    the signing key through a self-signed certificate (`cert_path`, its rootcertbundle), which the JWT
    carries in its `x5c` header. `requests` records what was asked: (the user named or None, scopes, status)."""

    def __init__(self, root: Path, users: dict[str, str], *, service: str = "agentcell-test-registry",
                 issuer: str = "agentcell-test-token-server") -> None:
        self.users = dict(users)
        self.service, self.issuer = service, issuer
        self.key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        now = datetime.datetime.now(datetime.UTC)
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)])
        self.cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                     .public_key(self.key.public_key()).serial_number(x509.random_serial_number())
                     .not_valid_before(now - datetime.timedelta(hours=1))
                     .not_valid_after(now + datetime.timedelta(days=1))
                     .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                     .sign(self.key, hashes.SHA256()))
        self.cert_path = root / "token-signer.pem"
        root.mkdir(parents=True, exist_ok=True)
        self.cert_path.write_bytes(self.cert.public_bytes(serialization.Encoding.PEM))
        self.requests: list[tuple[str | None, list[str], int]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's name)
                url = urlsplit(self.path)
                query = parse_qs(url.query)
                scopes = [s for value in query.get("scope", []) for s in value.split(" ") if s]
                user, right = server._basic(self.headers.get("Authorization", ""))
                if url.path != "/token" or query.get("service") != [server.service]:
                    status, body = 404, {"errors": [{"code": "NOT_FOUND"}]}
                elif user is not None and not right:
                    status, body = 401, {"errors": [{"code": "UNAUTHORIZED", "message": "wrong credentials"}]}
                else:  # anonymous: a token that grants nothing (the registry then refuses the pull)
                    status, body = 200, server._token(user or "", scopes if user else [])
                server.requests.append((user, scopes, status))
                data = json.dumps(body).encode()
                self.send_response(status)
                if status == 401:
                    self.send_header("WWW-Authenticate", 'Basic realm="token"')
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.realm = f"http://127.0.0.1:{self.httpd.server_address[1]}/token"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def _basic(self, authorization: str) -> tuple[str | None, bool]:
        """The user the basic credentials name (None without any), and whether they are right."""
        if not authorization:
            return None, False
        scheme, _, value = authorization.partition(" ")
        try:
            user, _, password = base64.b64decode(value, validate=True).decode().partition(":")
        except ValueError:
            return "", False
        return user, scheme.lower() == "basic" and user in self.users and self.users[user] == password

    def _token(self, user: str, scopes: list[str]) -> dict[str, Any]:
        access = []
        for scope in scopes:  # "repository:NAME:pull,push" (NAME has no colon: no host in it)
            kind, name, actions = scope.split(":", 2) if scope.count(":") >= 2 else (scope, "", "")
            access.append({"type": kind, "name": name, "actions": [a for a in actions.split(",") if a]})
        now = int(time.time())
        claims = {"iss": self.issuer, "sub": user, "aud": self.service, "iat": now, "nbf": now - 5,
                  "exp": now + 300, "jti": uuid.uuid4().hex, "access": access}
        header = {"typ": "JWT", "alg": "RS256",
                  "x5c": [base64.b64encode(self.cert.public_bytes(serialization.Encoding.DER)).decode()]}
        signing_input = f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(claims).encode())}"
        signature = self.key.sign(signing_input.encode(), padding.PKCS1v15(), hashes.SHA256())
        token = f"{signing_input}.{b64url(signature)}"
        return {"token": token, "access_token": token, "expires_in": 300,
                "issued_at": datetime.datetime.fromtimestamp(now, datetime.UTC).isoformat()}

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


class Registry:
    """Debian's docker-registry (the CNCF distribution registry) on 127.0.0.1, its storage in `root`,
    with htpasswd (bcrypt) basic auth when `users` are given, or distribution's token auth (Bearer
    tokens from `token_auth`) when that is."""

    def __init__(self, root: Path, users: dict[str, str] | None = None, token_auth: TokenServer | None = None) -> None:
        self.root = root
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.storage = root / "storage"
        self.storage.mkdir(parents=True)
        config = {"version": 0.1, "log": {"level": "info"},
                  "storage": {"filesystem": {"rootdirectory": str(self.storage)}, "delete": {"enabled": True}},
                  "http": {"addr": self.address}}
        if users:
            lines = [subprocess.run(["htpasswd", "-nbB", u, p], check=True, capture_output=True, text=True).stdout.strip()
                     for u, p in users.items()]
            (root / "htpasswd").write_text("\n".join(lines) + "\n")
            config["auth"] = {"htpasswd": {"realm": "test", "path": str(root / "htpasswd")}}
        if token_auth is not None:
            config["auth"] = {"token": {"realm": token_auth.realm, "service": token_auth.service,
                                        "issuer": token_auth.issuer, "rootcertbundle": str(token_auth.cert_path)}}
        (root / "config.yml").write_text(json.dumps(config))  # YAML reads JSON
        self.log = open(root / "registry.log", "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(["docker-registry", "serve", str(root / "config.yml")],
                                     stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 20
        while True:
            try:
                if httpx.get(f"http://{self.address}/v2/", timeout=1).status_code in (200, 401):
                    break
            except httpx.TransportError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("docker-registry did not start: " + (root / "registry.log").read_text())
            time.sleep(0.1)

    def push(self, src: str, repo_tag: str, creds: str | None = None) -> None:
        args = ["skopeo", "copy", "--quiet", "--dest-tls-verify=false"]
        if creds:
            args += ["--dest-creds", creds]
        subprocess.run([*args, src, f"docker://{self.address}/{repo_tag}"], check=True, capture_output=True)

    def requests(self) -> list[str]:
        """The requests the registry served so far (its access log's lines)."""
        self.log.flush()
        return [line for line in (self.root / "registry.log").read_text(errors="replace").splitlines()
                if '"GET /v2/' in line or '"HEAD /v2/' in line]

    def blob_data(self, digest: str) -> Path:
        hexa = digest.split(":")[1]
        return self.storage / "docker" / "registry" / "v2" / "blobs" / "sha256" / hexa[:2] / hexa / "data"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def host_files_image(layout: Path, tag: str, files: dict[str, str], *, base: str | None = None) -> None:
    """With umoci: an image `layout:tag` whose top layer holds these host files (path in the image ->
    host path), on top of `layout:base` when given (else an empty image)."""
    if not (layout / "index.json").exists():
        umoci("init", "--layout", str(layout))
    if base is None:
        umoci("new", "--image", f"{layout}:{tag}")
    else:
        umoci("tag", "--image", f"{layout}:{base}", tag)
    for dest, src in files.items():
        umoci("insert", "--image", f"{layout}:{tag}", src, dest)



# --- root filesystems for sandboxes of image templates ------------------------------------------------
# Made on this host, no registry reached: a musl/busybox one (Alpine's kind: no glibc, no bash), a
# distroless one (no shell at all), and Debian ones from the Debian archive (mmdebstrap, the package
# mirrors being the one network the tests may use). Debian roots are cached between runs of one host.

IMAGE_CACHE = Path(os.environ.get("AGENTCELL_TEST_IMAGE_CACHE", "/var/tmp/agentcell-test-images"))


def musl_root(root: Path) -> Path:
    """Alpine's kind of root: busybox (static) as every command, musl's loader, no bash, no glibc."""
    busybox = shutil.which("busybox") or "/bin/busybox"
    musl = "/usr/lib/x86_64-linux-musl/libc.so"
    if not os.path.exists(busybox) or not os.path.exists(musl):
        pytest.skip("the musl test image needs busybox-static and musl (scripts/setup installs them)")
    for d in ("bin", "lib", "etc", "usr/bin", "usr/local/bin", "tmp", "root", "srv", "var/empty"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy(busybox, root / "bin/busybox")
    applets = subprocess.run([busybox, "--list"], check=True, capture_output=True, text=True).stdout.split()
    for applet in applets:
        if applet not in ("busybox", "bash"):
            os.symlink("busybox", root / "bin" / applet)
    shutil.copy(musl, root / "lib/ld-musl-x86_64.so.1")
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/sbin/nologin\n")
    (root / "etc/group").write_text("root:x:0:\nnogroup:x:65534:\n")
    (root / "etc/os-release").write_text('NAME="agentcell musl test"\nID=alpine\n')
    return root


def distroless_root(root: Path) -> Path:
    """A distroless kind of root: a few /etc files and one static program, no shell."""
    busybox = shutil.which("busybox") or "/bin/busybox"
    if not os.path.exists(busybox):
        pytest.skip("the distroless test image needs busybox-static (scripts/setup installs it)")
    for d in ("etc", "app", "tmp"):
        (root / d).mkdir(parents=True, exist_ok=True)
    shutil.copy(busybox, root / "app/busybox")
    (root / "etc/passwd").write_text("root:x:0:0:root:/root:/sbin/nologin\nnonroot:x:65532:65532::/home/nonroot:/sbin/nologin\n")
    (root / "etc/group").write_text("root:x:0:\nnonroot:x:65532:\n")
    (root / "etc/os-release").write_text('NAME="agentcell distroless test"\nID=distroless\n')
    return root


UBUNTU = ("http://archive.ubuntu.com/ubuntu", "/usr/share/keyrings/ubuntu-archive-keyring.gpg")


def debian_tar(suite: str, include: tuple[str, ...] = (), archive: tuple[str, str] | None = None) -> Path:
    """A minbase Debian root of `suite` as a tar (mmdebstrap, from the Debian archive; `archive`: another
    distribution's (mirror, keyring), e.g. UBUNTU), cached."""
    name = "-".join((suite, *include)) + ".tar"
    cached = IMAGE_CACHE / name
    if cached.exists():
        return cached
    if shutil.which("mmdebstrap") is None:
        pytest.skip("the Debian test images need mmdebstrap (scripts/setup installs it)")
    IMAGE_CACHE.mkdir(parents=True, exist_ok=True)
    partial = cached.with_suffix(".partial")
    if archive is not None and not os.path.exists(archive[1]):
        pytest.skip(f"the {suite} test image needs the keyring {archive[1]} (scripts/setup installs ubuntu-keyring)")
    args = ["mmdebstrap", "--variant=minbase", "--format=tar", "--quiet", *(["--include=" + ",".join(include)] if include else []),
            *([f"--keyring={archive[1]}", "--components=main"] if archive else []), suite, str(partial),
            *([archive[0]] if archive else [])]
    done = subprocess.run(args, capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        pytest.skip(f"mmdebstrap {suite} failed (is the Debian archive reachable?): {done.stderr[-500:]}")
    partial.rename(cached)
    return cached


def root_image(layout: Path, tag: str, root: Path | None = None, tar: Path | None = None,
               config: dict[str, object] | None = None) -> None:
    """An image `layout:tag` of one layer: the directory `root` (umoci insert) or the tar `tar`
    (umoci raw add-layer), with `config` (umoci config options: env=[...], workdir=..., cmd=[...])."""
    if not (layout / "index.json").exists():
        umoci("init", "--layout", str(layout))
    umoci("new", "--image", f"{layout}:{tag}")
    if root is not None:
        umoci("insert", "--image", f"{layout}:{tag}", str(root), "/")
    if tar is not None:
        umoci("raw", "add-layer", "--image", f"{layout}:{tag}", str(tar))
    for key, value in (config or {}).items():
        for item in value if isinstance(value, list) else [value]:
            umoci("config", "--image", f"{layout}:{tag}", f"--config.{key}={item}")
