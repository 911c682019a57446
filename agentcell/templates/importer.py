"""Importing an OCI image as a template: the operator's policy first, then skopeo, then the layers.

    1. the reference is parsed and checked against the registry policy (refs.py) before skopeo runs
    2. docker://: the manifest is read (`skopeo inspect --raw`; an index gives this host's platform's),
       and its blobs' sizes checked against the size ceiling before anything is downloaded
    3. skopeo copies that very manifest (by digest) into a private OCI layout, verifying every blob
    4. each layer the store lacks is unpacked (unpack.py) under the ceiling's rest, its digests checked
       again, and committed; the store's budget is checked (unused layers collected first if needed)
    5. the template is written: the image's config and its layers' diff_ids, bottom first
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any

from agentcell.errors import InvalidArgumentError, ResourceExhaustedError
from agentcell.templates import layout as oci_layout
from agentcell.templates.fetch import DEFAULT_TIMEOUT_S, Credentials, Skopeo
from agentcell.templates.refs import ImageRef, RegistryPolicy, parse_ref
from agentcell.templates.store import TemplateStore, check_name
from agentcell.templates.unpack import unpack_layer

DEFAULT_MAX_IMAGE_BYTES = 4 << 30
DEFAULT_MAX_ENTRIES = 1_000_000
DEFAULT_CONCURRENT = 2
JSON_SLACK = 1 << 20  # the manifest, config and index.json a download holds besides the layers


@dataclass(frozen=True)
class ImportLimits:
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES  # the image's size, compressed and unpacked (serve --max-image-mb)
    max_entries: int = DEFAULT_MAX_ENTRIES  # files, directories, links ... of the whole image
    concurrent: int = DEFAULT_CONCURRENT  # imports at once; more are refused (try again)
    timeout_s: float = DEFAULT_TIMEOUT_S


class ImportsBusyError(ResourceExhaustedError):
    """As many imports as the operator allows at once are running: try again later."""


class Importer:
    def __init__(self, store: TemplateStore, policy: RegistryPolicy | None = None,
                 limits: ImportLimits | None = None) -> None:
        self.store = store
        self.policy = policy or RegistryPolicy()
        self.limits = limits or ImportLimits()
        self._slots = threading.BoundedSemaphore(self.limits.concurrent)

    def import_image(self, ref_text: str, name: str, credentials: Credentials | None = None, *,
                     remote: bool = False) -> dict[str, Any]:
        """Import the image `ref_text` (skopeo's syntax) as template `name`; return the template record.

        `remote`: the request came through the API, where only registries may be named (a path would
        be one of the server's own files)."""
        check_name(name)
        ref = parse_ref(ref_text)
        if remote and ref.transport != "docker":
            raise InvalidArgumentError("through the API only registry images (docker://...) can be imported; "
                                       "import local files with `agentcell template import` on the server's host")
        self.policy.check(ref)
        if not self._slots.acquire(blocking=False):
            raise ImportsBusyError(f"{self.limits.concurrent} image imports are running already; try again later")
        try:
            try:
                return self._attempt(ref, name, credentials)
            except _OverBudget:
                # collection needs the store to itself: after this attempt, then once more
                if not self.store.collect().removed_layers:
                    raise self._over_budget_error(self.store.size_bytes(), None) from None
            try:
                return self._attempt(ref, name, credentials)
            except _OverBudget as e:
                raise self._over_budget_error(self.store.size_bytes(), e.new_bytes) from None
        finally:
            self._slots.release()

    def _attempt(self, ref: ImageRef, name: str, credentials: Credentials | None) -> dict[str, Any]:
        with self.store.importing():
            work = self.store.private_dir()
            try:
                return self._import(ref, name, credentials, work)
            finally:
                shutil.rmtree(work, ignore_errors=True)

    def _import(self, ref: ImageRef, name: str, credentials: Credentials | None, work: str) -> dict[str, Any]:
        os.mkdir(os.path.join(work, "skopeo"), 0o700)
        skopeo = Skopeo(os.path.join(work, "skopeo"), insecure=self.policy.is_insecure(ref), credentials=credentials, registry=ref.registry,
                        timeout_s=self.limits.timeout_s)
        digest = None
        if ref.transport == "docker":
            digest = self._checked_manifest(skopeo, ref)
        image_dir = os.path.join(work, "image")
        skopeo.copy(ref, image_dir, self.limits.max_image_bytes + JSON_SLACK, digest)
        image = oci_layout.read_image(image_dir)
        self._check_size(image.blob_bytes, ref)
        left = self.limits.max_image_bytes
        entries_left = self.limits.max_entries
        new_bytes = 0
        staged: list[tuple[str, str, dict[str, Any]]] = []
        for layer in image.layers:
            if any(s[0] == layer.diff_id for s in staged):
                continue
            if self.store.has_layer(layer.diff_id):
                info = self.store.layer_info(layer.diff_id)
                left -= info["file_bytes"]
                entries_left -= info["entries"]
                if left < 0:
                    self._check_size(self.limits.max_image_bytes - left, ref)
                continue
            blob = oci_layout.blob_path(image_dir, layer.digest)
            if os.stat(blob).st_size != layer.size:
                raise InvalidArgumentError(f"layer {layer.digest}: its blob is not the manifest's {layer.size} bytes")
            stage = os.path.join(work, "layer-" + layer.diff_id.split(":")[1])
            os.mkdir(stage, 0o700)
            os.mkdir(os.path.join(stage, "tree"), 0o755)
            fd = os.open(os.path.join(stage, "tree"), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                got = unpack_layer(blob, layer.media_type, layer.digest, layer.diff_id, fd,
                                   max_bytes=max(0, left), max_entries=max(0, entries_left))
            finally:
                os.close(fd)
            left -= got.file_bytes
            entries_left -= got.entries
            new_bytes += got.file_bytes
            info = {**asdict(got), "digest": layer.digest, "media_type": layer.media_type, "imported_at": time.time()}
            staged.append((layer.diff_id, stage, info))
        self._check_budget(new_bytes)
        for diff_id, stage, info in staged:
            self.store.commit_layer(diff_id, stage, info)
        record = {
            "name": name,
            "source": str(ref),
            "manifest_digest": image.manifest_digest,
            "config_digest": image.config_digest,
            "config": image.config.get("config") or {},
            "architecture": image.config.get("architecture", ""),
            "os": image.config.get("os", ""),
            "layers": [layer.diff_id for layer in image.layers],
            "size_bytes": self.limits.max_image_bytes - left,
            "imported_at": time.time(),
        }
        self.store.write_template(name, record)
        return record

    def _checked_manifest(self, skopeo: Skopeo, ref: ImageRef) -> str:
        """The digest of the manifest to copy, once its blobs are known to fit the size ceiling."""
        raw = skopeo.inspect_raw(ref)
        doc = _manifest_json(raw)
        digest = ref.digest or oci_layout.sha256_of(raw)
        if doc.get("mediaType") in oci_layout.INDEX_TYPES or "manifests" in doc:
            digest = oci_layout.pick_manifest(doc)
            raw = skopeo.inspect_raw(ref, digest)
            doc = _manifest_json(raw)
            if oci_layout.sha256_of(raw) != digest:
                raise InvalidArgumentError(f"{ref}: the registry's manifest does not match its digest {digest}")
        sizes = [d.get("size", 0) for d in [doc.get("config") or {}, *(doc.get("layers") or [])]]
        if not all(isinstance(s, int) and s >= 0 for s in sizes):
            raise InvalidArgumentError(f"{ref}: the manifest's sizes are not numbers")
        self._check_size(sum(sizes), ref)
        return digest

    def _check_size(self, size: int, ref: ImageRef) -> None:
        if size > self.limits.max_image_bytes:
            raise ResourceExhaustedError(
                f"{ref} takes {size} bytes, more than the {self.limits.max_image_bytes} an image may take on "
                "this server (serve --max-image-mb)")

    def _check_budget(self, new_bytes: int) -> None:
        if new_bytes and self.store.size_bytes() + new_bytes > self.store.max_bytes:
            raise _OverBudget(new_bytes)

    def _over_budget_error(self, size: int, new_bytes: int | None) -> ResourceExhaustedError:
        more = f"this image's {new_bytes} new bytes" if new_bytes is not None else "this image"
        return ResourceExhaustedError(
            f"the template store holds {size} bytes of the {self.store.max_bytes} it may (serve "
            f"--template-store-max-gb): no room for {more} once unused layers are collected; delete templates "
            "(`agentcell template rm`) and try again")


class _OverBudget(Exception):
    def __init__(self, new_bytes: int) -> None:
        self.new_bytes = new_bytes


def _manifest_json(raw: bytes) -> dict[str, Any]:
    if len(raw) > oci_layout.MAX_JSON_BYTES:
        raise InvalidArgumentError("the image's manifest is too big")
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise InvalidArgumentError(f"the image's manifest is not JSON: {e}") from None
    if not isinstance(doc, dict):
        raise InvalidArgumentError("the image's manifest is not a JSON object")
    return doc
