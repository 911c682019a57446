"""A create's `volumeMounts` ([{name, path, readOnly?}], E2B's shape; readOnly is agentcell's) checked
and resolved to the caller's volumes: a name another tenant uses is "not found", as a name nobody uses."""

from __future__ import annotations

import posixpath
from collections.abc import Callable
from typing import Any

from agentcell.backends.base import VolumeMount
from agentcell.volumes.store import VolumeError, VolumeStore

MAX_MOUNTS = 16
# Where a volume may be mounted: directories of the sandbox's own writable layers, where the mount
# point can be made without touching the template (rootfs.OVERLAYS and the disk's directories)
MOUNT_ROOTS = ("/mnt", "/home/user", "/srv", "/opt", "/tmp", "/root")


def _path(raw: Any) -> str:
    if not isinstance(raw, str) or not raw.startswith("/") or "\0" in raw:
        raise VolumeError(400, f"a volume mount's 'path' is an absolute path, not {str(raw)[:80]!r}")
    path = posixpath.normpath(raw)
    if path != raw.rstrip("/") or ".." in path.split("/"):
        raise VolumeError(400, f"a volume mount's 'path' must be normalised (no '.', '..' or '//'): {raw[:80]!r}")
    if not any(path.startswith(root + "/") for root in MOUNT_ROOTS):
        raise VolumeError(400, f"a volume can be mounted below one of {', '.join(MOUNT_ROOTS)} (e.g. /mnt/data), "
                               f"not {path!r}")
    return path


def resolve(raw: Any, store: VolumeStore | None, caller: str | None,
            sees: Callable[[str | None, str | None], bool]) -> tuple[VolumeMount, ...]:
    """The mounts a create asks for (VolumeError 400/404 naming what is wrong)."""
    if raw is None or raw == []:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_MOUNTS:
        raise VolumeError(400, f"'volumeMounts' is a list of at most {MAX_MOUNTS} {{name, path}} objects")
    if store is None:
        raise VolumeError(400, "this server has no volumes")
    if (why := store.unavailable()) is not None:
        raise VolumeError(400, why)
    out: list[VolumeMount] = []
    for item in raw:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise VolumeError(400, "each of 'volumeMounts' is an object {\"name\": <volume name>, \"path\": ...}")
        path = _path(item.get("path"))
        read_only = item.get("readOnly", item.get("read_only", False))
        if not isinstance(read_only, bool):
            raise VolumeError(400, "a volume mount's 'readOnly' is true or false")
        name = item["name"]
        volume = store.by_name(name, caller)
        if volume is None and sees(caller, None):  # (no tenancy: every volume is the caller's)
            volume = next((v for v in store.list(caller, sees) if v.name == name), None)
        if volume is None:  # by id too: the JS and Python SDKs send the name, a raw API call may send the id
            by_id = store.get(name)
            volume = by_id if by_id is not None and sees(caller, by_id.owner) else None
        if volume is None:
            raise VolumeError(404, f"volume '{name}' not found (create it first: Volume.create)")
        for other in out:
            if other.path == path or path.startswith(other.path + "/") or other.path.startswith(path + "/"):
                raise VolumeError(400, f"volume mounts at {other.path} and {path} overlap")
        out.append(VolumeMount(volume.volume_id, volume.name, str(store.mount_dir(volume)), path, read_only))
    return tuple(out)


def checkpoint_refusal(rec: Any, what: str) -> str | None:
    """Why `what` (a pause, snapshot or fork that checkpoints memory) cannot be done to this sandbox:
    a gvisor checkpoint would hold the volume's host mount, which its restore cannot have back."""
    if rec.spec.volumes and rec.backend.name == "gvisor":
        return (f"{what}: this gvisor sandbox mounts volumes ({', '.join(m.name for m in rec.spec.volumes)}), and "
                "its checkpoint cannot carry them; kill it (the volumes keep their files) and create a new one")
    return None
