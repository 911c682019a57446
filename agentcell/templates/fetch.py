"""skopeo: an image's manifest (`inspect --raw`) and the image itself (`copy` into an OCI layout).

skopeo (containers/image) speaks the OCI distribution API (basic auth and bearer tokens both, from the
same credentials), reads OCI layouts and `docker save` tarballs, and verifies every blob's digest as it
copies. It runs hermetic: a private registries.conf (empty: no mirror, no short-name alias), a policy
that accepts any image (signatures are not checked yet), and an authfile in a private 0700 directory
(credentials never on a command line, where other users could read them; the host's own credentials
are never used). Plain HTTP or an unverified certificate only for a registry the operator named.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass

from agentcell.errors import (
    AgentcellError,
    BackendUnavailableError,
    DeadlineExceededError,
    InvalidArgumentError,
    NotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
)
from agentcell.templates.refs import ImageRef

DEFAULT_TIMEOUT_S = 1800.0
WATCH_S = 0.1  # how often a download's size is looked at
MAX_OUTPUT = 4 << 20  # of skopeo's stdout (a manifest) and stderr read back


@dataclass(frozen=True)
class Credentials:
    username: str
    password: str  # a password or an access token (skopeo trades it for a bearer token if asked)


class Skopeo:
    """One import's skopeo: its private directory holds the config files skopeo is given."""

    def __init__(self, private_dir: str, *, insecure: bool, credentials: Credentials | None = None,
                 registry: str = "", timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if shutil.which("skopeo") is None:
            raise BackendUnavailableError("skopeo is not installed (apt-get install skopeo): agentcell imports "
                                          "images with it")
        self.dir = private_dir
        self.insecure = insecure
        self.timeout_s = timeout_s
        os.chmod(private_dir, 0o700)
        self.registries_conf = self._write("registries.conf", "")
        self.policy = self._write("policy.json", json.dumps({"default": [{"type": "insecureAcceptAnything"}]}))
        auths = {}
        if credentials is not None and registry:
            token = base64.b64encode(f"{credentials.username}:{credentials.password}".encode()).decode()
            auths[registry] = {"auth": token}
        self.authfile = self._write("auth.json", json.dumps({"auths": auths}))

    def _write(self, name: str, text: str) -> str:
        path = os.path.join(self.dir, name)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return path

    def _run(self, args: list[str], what: str, *, into: str | None = None, max_bytes: int | None = None) -> bytes:
        """skopeo `args`; with `max_bytes`, what it writes under `into` is bounded: no one file may grow past
        it (RLIMIT_FSIZE, the kernel's), and all of them together are watched and skopeo killed past it
        (containers/image checks a blob's digest only at its end: a registry could send gigabytes)."""
        cmd = ["skopeo", "--registries-conf", self.registries_conf, "--policy", self.policy, *args]
        if max_bytes is not None:
            cmd = ["prlimit", f"--fsize={max_bytes}", "--", *cmd]
        env = {"PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"), "HOME": self.dir, "TMPDIR": self.dir,
               "XDG_RUNTIME_DIR": self.dir, "XDG_CONFIG_HOME": self.dir}
        deadline = time.monotonic() + self.timeout_s
        with tempfile.TemporaryFile(dir=self.dir) as out, tempfile.TemporaryFile(dir=self.dir) as err:
            proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, stdin=subprocess.DEVNULL)
            try:
                while True:
                    try:
                        proc.wait(timeout=WATCH_S)
                        break
                    except subprocess.TimeoutExpired:
                        pass
                    if time.monotonic() > deadline:
                        raise DeadlineExceededError(f"{what} took longer than {self.timeout_s:.0f} s")
                    if max_bytes is not None and into is not None and disk_usage(into) > max_bytes:
                        raise ResourceExhaustedError(f"{what}: the image takes more than the {max_bytes} bytes an "
                                                     "image may take on this server (serve --max-image-mb)")
            finally:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            out.seek(0)
            err.seek(0)
            stdout, stderr = out.read(MAX_OUTPUT), err.read(MAX_OUTPUT).decode(errors="replace")
        if proc.returncode != 0:
            if max_bytes is not None and (proc.returncode == -signal.SIGXFSZ or "file too large" in stderr.lower()):
                raise ResourceExhaustedError(f"{what}: a blob of the image is bigger than the {max_bytes} bytes an "
                                             "image may take on this server (serve --max-image-mb)")
            raise skopeo_error(stderr, what)
        return stdout

    def _source_flags(self, ref: ImageRef) -> list[str]:
        if ref.transport != "docker":
            return []
        return ["--authfile", self.authfile, f"--src-tls-verify={'false' if self.insecure else 'true'}"]

    def inspect_raw(self, ref: ImageRef, digest: str | None = None) -> bytes:
        """The manifest (or image index) of `ref` as the registry serves it."""
        flags = ["--authfile", self.authfile, f"--tls-verify={'false' if self.insecure else 'true'}"] \
            if ref.transport == "docker" else []
        return self._run(["inspect", "--raw", "--retry-times", "2", *flags, ref.skopeo(digest)], f"reading {ref}'s manifest")

    def copy(self, ref: ImageRef, layout: str, max_bytes: int, digest: str | None = None) -> None:
        """`ref` (this manifest of it, with `digest`) into a new OCI layout directory, which may take at
        most `max_bytes`."""
        self._run(["copy", "--quiet", "--retry-times", "2", *self._source_flags(ref), ref.skopeo(digest),
                   f"oci:{layout}:image"], f"fetching {ref}", into=layout, max_bytes=max_bytes)


def disk_usage(path: str) -> int:
    """The bytes the files under `path` take on disk (a directory skopeo writes: no symlinks followed)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def skopeo_error(stderr: str, what: str) -> AgentcellError:
    """skopeo's failure as a typed error that says what to do."""
    text = stderr.strip().splitlines()[-1] if stderr.strip() else "skopeo failed"
    low = stderr.lower()
    if "server gave http response to https client" in low:
        return PermissionDeniedError(f"{what}: the registry serves plain HTTP, which is refused unless the operator "
                                     "names it (serve --insecure-registry HOST:PORT)")
    if "x509:" in low or "certificate" in low and "verify" in low:
        return PermissionDeniedError(f"{what}: the registry's TLS certificate is not trusted ({text}); the operator "
                                     "may name it with serve --insecure-registry HOST:PORT")
    if "unauthorized" in low or "authentication required" in low or "401" in low or "denied" in low:
        return PermissionDeniedError(f"{what}: the registry refused access (wrong or missing credentials?): {text}")
    if "digest" in low and ("did not match" in low or "mismatch" in low or "does not match" in low):
        return InvalidArgumentError(f"{what}: a blob's content does not match its digest (corrupt image): {text}")
    if "manifest unknown" in low or "not found" in low or "no such file" in low or "name unknown" in low:
        return NotFoundError(f"{what}: no such image: {text}")
    if "connection refused" in low or "no such host" in low or "i/o timeout" in low or "network is unreachable" in low:
        return BackendUnavailableError(f"{what}: the registry cannot be reached: {text}")
    return InvalidArgumentError(f"{what} failed: {text}")
