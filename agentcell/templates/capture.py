"""A sandbox's changes to its image root, as a new layer: what a build step (templates built from a
Dockerfile or E2B's Template()) leaves behind.

An image sandbox's disk holds the root overlay's upper layer (.root/0/up, backends/linux/image_root.py)
and /home/user (home/). Both are read the way a disk archive is (backends/disk_archive.py: through
directory fds from the disk's root, never following a link, owners the sandbox's 0 and 1000), then
rewritten as an OCI layer tar: overlay whiteouts become `.wh.NAME` entries and opaque directories get
`.wh..wh..opq`, home/ goes under home/user/. What agentcell itself writes into every image sandbox
(its name, its resolver, its sudo) is left out. The tar is then unpacked into the template store like
any imported layer (templates/unpack.py: its hostile-archive checks apply to a sandbox's files too).
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile
import tempfile
import time
from dataclasses import asdict
from typing import BinaryIO

from agentcell.backends import disk_archive
from agentcell.backends.linux import image_root
from agentcell.templates.store import TemplateStore
from agentcell.templates.unpack import WHITEOUT, unpack_layer

LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
_OPAQUE = WHITEOUT + WHITEOUT + ".opq"
# agentcell's own, regenerated in every sandbox (image_root._etc, image_root._sudo)
_GENERATED = frozenset({"etc/hosts", "etc/hostname", "etc/resolv.conf"})
_SUDO = "usr/bin/sudo"
_SPOOL = 16 << 20  # the disk archive is spooled in memory up to this, then on disk


def _layer_name(name: str) -> str | None:
    """The disk archive's name for an entry -> the layer's, or None to leave it out."""
    place, _, rest = name.partition("/")
    if place == "home":
        return "home/user/" + rest if rest else "home/user"
    if place != "root":
        return None  # tmp/: scratch, as a fresh sandbox's /tmp is empty
    rest = rest.lstrip("/")
    if not rest or rest in _GENERATED:
        return None
    return rest


def write_layer(disk_fd: int, out: BinaryIO, max_bytes: int, owners: disk_archive.Owners) -> str:
    """The changes on the disk at `disk_fd` as an uncompressed layer tar into `out`; returns its
    digest (sha256:..., the layer's diff_id). Raises ResourceExhaustedError past `max_bytes`."""
    digest = hashlib.sha256()

    class _Hashing:
        def write(self, data: bytes) -> int:
            digest.update(data)
            return out.write(data)

    with tempfile.SpooledTemporaryFile(_SPOOL) as spool:
        disk_archive.write_archive(disk_fd, spool, max_bytes, owners, overlays=[image_root.ROOT],
                                   mount_points=image_root.MOUNT_POINTS)
        spool.seek(0)
        with tarfile.open(fileobj=spool, mode="r|") as src, \
                tarfile.open(fileobj=_Hashing(), mode="w|", format=tarfile.PAX_FORMAT) as dst:  # type: ignore[call-overload]
            for member in src:
                name = _layer_name(member.name)
                if name is None:
                    continue
                data: BinaryIO | None = src.extractfile(member) if member.isreg() else None  # type: ignore[assignment]
                if name == _SUDO and data is not None and member.size < 4096:
                    script = data.read()
                    if script.startswith(b"#!/bin/sh\nexec /opt/agentcell/"):
                        continue
                    data = io.BytesIO(script)
                member.name = name
                if member.islnk():
                    member.linkname = _layer_name(member.linkname) or member.linkname
                if member.ischr() and member.devmajor == 0 and member.devminor == 0:  # an overlay whiteout
                    head, _, leaf = name.rpartition("/")
                    member = tarfile.TarInfo(f"{head}/{WHITEOUT}{leaf}" if head else WHITEOUT + leaf)
                    member.mtime = int(time.time())
                opaque = member.isdir() and member.pax_headers.get(disk_archive.OPAQUE_PAX) == "y"
                member.pax_headers = {}
                dst.addfile(member, data)
                if opaque:
                    marker = tarfile.TarInfo(f"{name}/{_OPAQUE}")
                    marker.mtime = member.mtime
                    dst.addfile(marker)
    return "sha256:" + digest.hexdigest()


def store_layer(store: TemplateStore, tar_path: str, diff_id: str, max_bytes: int, max_entries: int = 1_000_000) -> dict:
    """Unpack a layer tar written by write_layer into the store (once: a layer already there is kept);
    returns the layer's record."""
    if store.has_layer(diff_id):
        return store.layer_info(diff_id)
    stage = tempfile.mkdtemp(prefix="layer-", dir=store.tmp_dir)
    os.mkdir(os.path.join(stage, "tree"), 0o755)
    fd = os.open(os.path.join(stage, "tree"), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        got = unpack_layer(tar_path, LAYER_TAR, diff_id, diff_id, fd, max_bytes=max_bytes, max_entries=max_entries)
    finally:
        os.close(fd)
    info = {**asdict(got), "digest": diff_id, "media_type": LAYER_TAR, "imported_at": time.time()}
    store.commit_layer(diff_id, stage, info)
    return info
