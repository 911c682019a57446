"""Image references in skopeo's transport syntax, and the operator's registry policy.

    docker://HOST[:PORT]/REPO[:TAG|@DIGEST]   a registry (the OCI distribution API)
    python:3.12-slim                          the same on Docker Hub: docker://docker.io/library/python:3.12-slim
    oci:DIR[:TAG]                             an OCI image layout directory
    docker-archive:FILE[:REF]                 a `docker save` tarball

The reference is parsed here, not by skopeo, so that the registry the policy checks is the one skopeo
contacts: Docker Hub's names are normalised as Docker does (`python` is `docker.io/library/python`), and
skopeo is given the fully qualified name (with a private, empty registries.conf: no host mirror or
short-name alias can send it elsewhere).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from agentcell.errors import InvalidArgumentError, PermissionDeniedError

DOCKER_HUB = "docker.io"
_HUB_ALIASES = {"index.docker.io", "registry-1.docker.io", "registry.hub.docker.com", DOCKER_HUB}
_COMPONENT = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_HOST = re.compile(r"(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
                   r"|\[[0-9A-Fa-f:.]+\]")
_PORT = re.compile(r"[0-9]{1,5}")


@dataclass(frozen=True)
class ImageRef:
    transport: str  # "docker", "oci", "docker-archive"
    registry: str = ""  # docker: HOST[:PORT], Docker Hub as docker.io
    repository: str = ""  # docker: library/python
    tag: str = ""
    digest: str = ""
    path: str = ""  # oci, docker-archive: the directory or file
    reference: str = ""  # oci's tag, docker-archive's image in the file

    @property
    def host(self) -> str:
        """The registry's host name or address, without port or brackets."""
        host = self.registry
        if host.startswith("["):
            return host[1:host.index("]")]
        return host.rsplit(":", 1)[0] if ":" in host else host

    def skopeo(self, digest: str | None = None) -> str:
        """The reference as skopeo takes it (`digest`: this very manifest of the repository)."""
        if self.transport == "docker":
            name = f"{self.registry}/{self.repository}"
            if digest or self.digest:
                return f"docker://{name}@{digest or self.digest}"
            return f"docker://{name}:{self.tag or 'latest'}"
        suffix = f":{self.reference}" if self.reference else ""
        return f"{self.transport}:{self.path}{suffix}"

    def __str__(self) -> str:
        return self.skopeo()


def parse_ref(text: str) -> ImageRef:
    """`text` as an ImageRef; InvalidArgumentError says what is wrong with it."""
    text = text.strip()
    if text.startswith("docker://"):
        return _parse_docker(text[len("docker://"):], text)
    for transport in ("oci", "docker-archive"):
        if text.startswith(transport + ":"):
            path, _, reference = text[len(transport) + 1:].partition(":")  # skopeo splits at the first colon
            if not path:
                raise InvalidArgumentError(f"image reference {text!r}: {transport}: needs a path")
            return ImageRef(transport, path=path, reference=reference)
    if "://" in text or text.split(":", 1)[0] in ("dir", "containers-storage", "docker-daemon", "oci-archive", "ostree", "sif"):
        raise InvalidArgumentError(f"image reference {text!r}: agentcell imports docker://, oci: and docker-archive: "
                                   "references only")
    return _parse_docker(text, text)


def _parse_docker(name: str, text: str) -> ImageRef:
    digest = ""
    if "@" in name:
        name, digest = name.split("@", 1)
        if not _DIGEST.fullmatch(digest):
            raise InvalidArgumentError(f"image reference {text!r}: the digest must be sha256:<64 hex digits>")
    tag = ""
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name, tag = name.rsplit(":", 1)
        if not _TAG.fullmatch(tag):
            raise InvalidArgumentError(f"image reference {text!r}: {tag!r} is not a valid tag")
    first, sep, rest = name.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
        registry, repository = first, rest
    else:
        registry, repository = DOCKER_HUB, name
    host, _, port = registry.rpartition(":") if registry.rfind(":") > registry.rfind("]") else (registry, "", "")
    if not _HOST.fullmatch(host) or (port and not (_PORT.fullmatch(port) and 0 < int(port) < 65536)):
        raise InvalidArgumentError(f"image reference {text!r}: {registry!r} is not a registry host[:port]")
    if registry.lower() in _HUB_ALIASES:
        registry = DOCKER_HUB
    if registry == DOCKER_HUB and "/" not in repository:
        repository = "library/" + repository  # Docker Hub's official images
    if not repository or not all(_COMPONENT.fullmatch(c) for c in repository.split("/")):
        raise InvalidArgumentError(f"image reference {text!r}: {repository!r} is not a repository name "
                                   "(lowercase letters, digits, separators . _ -)")
    return ImageRef("docker", registry=registry, repository=repository, tag=tag or ("" if digest else "latest"),
                    digest=digest)


def registry_key(entry: str) -> str:
    """An operator's --allowed-registry / --insecure-registry entry as refs name registries."""
    entry = entry.strip().lower().removeprefix("https://").removeprefix("http://").rstrip("/")
    return DOCKER_HUB if entry in _HUB_ALIASES else entry


@dataclass(frozen=True)
class RegistryPolicy:
    """Which registries an import may contact (`serve --allowed-registry`, `--insecure-registry`).

    No allowlist: any registry whose address is public (a user of the API must not make the server
    fetch from its loopback, its private network or a cloud metadata address); an allowlist: only the
    registries it names, whatever their address. An insecure registry (plain HTTP or an unverified
    certificate) is contacted only if named with --insecure-registry, which also allows it."""

    allowed: tuple[str, ...] = ()
    insecure: tuple[str, ...] = ()

    @classmethod
    def of(cls, allowed: tuple[str, ...] | list[str] = (), insecure: tuple[str, ...] | list[str] = ()) -> RegistryPolicy:
        return cls(tuple(registry_key(a) for a in allowed), tuple(registry_key(i) for i in insecure))

    def is_insecure(self, ref: ImageRef) -> bool:
        return ref.registry.lower() in self.insecure

    def check(self, ref: ImageRef) -> None:
        """PermissionDeniedError if the operator does not allow `ref`'s registry (docker:// only)."""
        if ref.transport != "docker":
            return
        registry = ref.registry.lower()
        if registry in self.insecure:
            return
        if self.allowed:
            if registry not in self.allowed and ref.host.lower() not in self.allowed:
                raise PermissionDeniedError(
                    f"registry {ref.registry} is not allowed on this server (allowed: {', '.join(self.allowed)}); "
                    "the operator can add it with serve --allowed-registry")
            return
        for address in _addresses(ref.host):
            if not address.is_global:
                raise PermissionDeniedError(
                    f"registry {ref.registry} is at {address}, a loopback, private or reserved address: only "
                    "public registries are allowed unless the operator names it (serve --allowed-registry "
                    f"{ref.registry}, or --insecure-registry for plain HTTP)")


def _addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    try:
        return [ipaddress.ip_address(host)]
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise InvalidArgumentError(f"registry {host} cannot be resolved: {e}") from None
    return [ipaddress.ip_address(str(info[4][0]).split("%", 1)[0]) for info in infos]
