"""Reading the private OCI image layout skopeo wrote: the image's manifest, its config, its layers.

Every blob read here is checked against its digest (skopeo checked them on the way in; this is the
layout on this host's disk, read again before it is trusted)."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import re
from dataclasses import dataclass
from typing import Any

from agentcell.errors import InvalidArgumentError

MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json")
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
MAX_JSON_BYTES = 4 << 20  # a manifest or config bigger than this is no image's
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Layer:
    digest: str  # of the blob as stored (compressed)
    media_type: str
    size: int  # the blob's
    diff_id: str  # of the uncompressed tar (the config's rootfs.diff_ids)


@dataclass(frozen=True)
class Image:
    manifest_digest: str
    config_digest: str
    config: dict[str, Any]  # the image config: "config" (Env, Cmd, Entrypoint, User, WorkingDir ...), "rootfs" ...
    layers: tuple[Layer, ...]

    @property
    def blob_bytes(self) -> int:
        return sum(layer.size for layer in self.layers)


def check_digest(digest: Any) -> str:
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise InvalidArgumentError(f"{digest!r} is not a sha256 digest")
    return digest


def sha256_of(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def blob_path(layout: str, digest: str) -> str:
    return os.path.join(layout, "blobs", "sha256", check_digest(digest).split(":", 1)[1])


def _read_blob(layout: str, digest: str, what: str) -> bytes:
    path = blob_path(layout, digest)
    with open(path, "rb") as f:
        data = f.read(MAX_JSON_BYTES + 1)
    if len(data) > MAX_JSON_BYTES:
        raise InvalidArgumentError(f"the image's {what} is bigger than {MAX_JSON_BYTES} bytes")
    if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
        raise InvalidArgumentError(f"the image's {what} does not match its digest {digest}")
    return data


def _json(data: bytes, what: str) -> dict[str, Any]:
    try:
        doc = json.loads(data)
    except ValueError as e:
        raise InvalidArgumentError(f"the image's {what} is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise InvalidArgumentError(f"the image's {what} is not a JSON object")
    return doc


def host_platform() -> tuple[str, str]:
    machine = platform.machine().lower()
    return "linux", {"x86_64": "amd64", "aarch64": "arm64", "armv7l": "arm", "ppc64le": "ppc64le",
                     "s390x": "s390x", "riscv64": "riscv64"}.get(machine, machine)


def pick_manifest(index: dict[str, Any]) -> str:
    """The digest of this host's platform's manifest in an image index (a multi-platform image)."""
    want = host_platform()
    for entry in index.get("manifests") or []:
        p = entry.get("platform") or {}
        if (p.get("os"), p.get("architecture")) == want and entry.get("mediaType", MANIFEST_TYPES[0]) in MANIFEST_TYPES:
            return check_digest(entry.get("digest"))
    raise InvalidArgumentError(f"the image has no manifest for this host's platform {want[0]}/{want[1]}")


def read_image(layout: str) -> Image:
    """The one image of the layout (skopeo copied exactly one into it)."""
    with open(os.path.join(layout, "index.json"), "rb") as f:
        index = _json(f.read(MAX_JSON_BYTES), "layout index")
    manifests = index.get("manifests") or []
    if len(manifests) != 1:
        raise InvalidArgumentError("the image layout must hold exactly one image")
    digest = check_digest(manifests[0].get("digest"))
    manifest = _json(_read_blob(layout, digest, "manifest"), "manifest")
    if manifest.get("mediaType", MANIFEST_TYPES[0]) in INDEX_TYPES:
        digest = pick_manifest(manifest)
        manifest = _json(_read_blob(layout, digest, "manifest"), "manifest")
    config_desc = manifest.get("config") or {}
    config_digest = check_digest(config_desc.get("digest"))
    config = _json(_read_blob(layout, config_digest, "config"), "config")
    diff_ids = (config.get("rootfs") or {}).get("diff_ids") or []
    descs = manifest.get("layers") or []
    if len(diff_ids) != len(descs):
        raise InvalidArgumentError(f"the image's config names {len(diff_ids)} layers, its manifest {len(descs)}")
    layers = []
    for desc, diff_id in zip(descs, diff_ids, strict=True):
        size = desc.get("size")
        if not isinstance(size, int) or size < 0:
            raise InvalidArgumentError("a layer of the image's manifest has no valid size")
        layers.append(Layer(check_digest(desc.get("digest")), str(desc.get("mediaType", "")), size, check_digest(diff_id)))
    return Image(digest, config_digest, config, tuple(layers))
