"""Snapshots kept on disk: E2B's `create_snapshot`, `list_snapshots`, `delete_snapshot`, and the
snapshot id a `Sandbox.create(snapshot_id)` starts from.

Each snapshot is a directory under the server's state dir, `snapshots/<template id>/`, holding
`meta.json` and its content: `files.tar` (a disk archive, backends/disk_archive.py: mode
"filesystem") or `image/` (a backend's checkpoint: mode "full"). They survive a server restart.
Together they are bounded by the operator's quota (bytes and count): a snapshot that would pass it
is refused, and a half-written one is removed. The content is on disk (fsync) before meta.json is
written (atomically: agentcell/durable.py); a meta.json or content found damaged at start is moved into
`snapshots/damaged/` (docs/reliability.md).

Ids follow E2B's: a snapshot is a template; its id is `<name>:default` when it was given a name,
else `<template id>:default`; `names` lists the named forms. A create may name it by any of them,
with or without the tag.

Names belong to their tenant (server/tenancy.py): with tenancy on, user A and user B may each have a
snapshot named "mine", and each name resolves among its caller's own snapshots only; another tenant's
is not found, as one that never existed. The administrator (uid 0) resolves its own names first, then
any snapshot's template id, then another's name if only one tenant has it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from agentcell import durable
from agentcell.backends.base import Limits, new_cell_sandbox_id
from agentcell.server.tenancy import ADMIN

log = logging.getLogger("agentcell.server")

TAG = "default"
DAMAGED = "damaged"  # under snapshots/: snapshots the server cannot use, for the operator
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,62}$")
# 20 random characters, after the cell id when the server has one (a gateway routes a create by it)
_DIR_RE = re.compile(r"^[a-z0-9]{20,64}$")


class SnapshotError(Exception):
    """A snapshot cannot be made, found or used; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Snapshot:
    template_id: str  # the directory's name: [cell id +] 20 lowercase letters and digits
    name: str | None
    mode: str  # "full" (memory and files) | "filesystem"
    backend: str
    sandbox_id: str  # the sandbox it was taken of
    source_template: str  # that sandbox's template
    created_at: float
    size_bytes: int
    limits: dict[str, Any] = field(default_factory=dict)  # the source's limits (a create's defaults)
    owner: str | None = None  # the tenant that took it (server/tenancy.py); None: the server has no tenancy

    @property
    def snapshot_id(self) -> str:
        return f"{self.name or self.template_id}:{TAG}"

    @property
    def names(self) -> list[str]:
        return [f"{self.name}:{TAG}"] if self.name else []

    def info(self) -> dict[str, Any]:
        """E2B's SnapshotInfo, plus what agentcell adds (mode, source, size)."""
        return {"snapshotID": self.snapshot_id, "names": self.names, "mode": self.mode,
                "sandboxID": self.sandbox_id, "templateID": self.template_id, "sizeBytes": self.size_bytes,
                "createdAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created_at))}

    def source_limits(self) -> Limits | None:
        try:
            return Limits(**self.limits) if self.limits else None
        except TypeError:
            return None


class SnapshotStore:
    def __init__(self, root: Path, quota_bytes: int, max_count: int) -> None:
        self.root = root
        self.quota_bytes = quota_bytes
        self.max_count = max_count
        self._snapshots: dict[str, Snapshot] = {}
        self._reserved = 0  # bytes promised to snapshots being written

    def load(self) -> None:
        """Read the snapshots a previous run left. A half-written one (no meta.json: it never existed,
        its id was never given out) is removed; one whose meta.json or content is damaged is moved
        into damaged/ and said in the log, never deleted."""
        durable.make_dirs(self.root)
        for d in sorted(self.root.iterdir()):
            if not _DIR_RE.match(d.name):
                continue
            if not (d / "meta.json").exists():
                log.info("snapshot %s was never finished (no meta.json: the server stopped while writing it): "
                         "removed", d.name)
                shutil.rmtree(d, ignore_errors=True)
                continue
            try:
                snap = self._read(d)
            except (OSError, ValueError) as e:
                log.error("a snapshot cannot be used: %s. Moved to: %s", e, durable.set_aside(d, self.root / DAMAGED))
                continue
            self._snapshots[snap.template_id] = snap
        damaged = self.root / DAMAGED
        if damaged.is_dir() and (count := len(list(damaged.iterdir()))):
            log.warning("%d damaged snapshots wait in %s for you to look at and delete", count, damaged)

    def _read(self, d: Path) -> Snapshot:
        """The snapshot in directory `d`, its meta.json whole and its content as meta.json says;
        TornFileError if not."""
        meta = d / "meta.json"
        what = f"snapshot {d.name}"
        remedy = (f"the snapshot cannot be used and is kept in {self.root / DAMAGED} for you: its files.tar (if "
                  "any) is a tar of the sandbox's files (`tar -tf` lists them); delete it once you no longer need it")
        data = durable.read_json(meta, what, remedy)
        try:
            snap = Snapshot(**data)
        except TypeError as e:
            raise durable.TornFileError(meta, what, f"not a snapshot's fields: {e}", remedy) from None
        if snap.template_id != d.name:
            raise durable.TornFileError(meta, what, f"it names {snap.template_id!r}, not its directory", remedy)
        content = self.content(snap)
        if snap.mode == "full":
            if not content.is_dir() or not any(content.iterdir()):
                raise durable.TornFileError(meta, what, f"its checkpoint {content} is missing or empty", remedy)
        elif not content.is_file():
            raise durable.TornFileError(meta, what, f"its archive {content} is missing", remedy)
        elif (size := content.stat().st_size) != snap.size_bytes:  # cut short, or not the one it was taken with
            raise durable.TornFileError(meta, what, f"its archive {content} is {size} bytes, meta.json says "
                                                    f"{snap.size_bytes}", remedy)
        return snap

    # --- queries ---------------------------------------------------------------------------------

    def find(self, ref: str, caller: str | None = None) -> Snapshot | None:
        """The snapshot `ref` names for `caller` (a tenant; None: the server has no tenancy): its id or a
        name, with or without the tag, among the snapshots the caller owns (the administrator: see above)."""
        base = _untagged(ref)
        named = [s for s in self._snapshots.values() if base in (s.template_id, s.name)]
        if caller is None:
            return named[0] if named else None
        own = [s for s in named if s.owner == caller]
        if own or caller != ADMIN:
            return own[0] if own else None
        by_id = [s for s in named if s.template_id == base]
        if by_id:
            return by_id[0]
        return named[0] if len({s.owner for s in named}) == 1 else None

    def list(self, sandbox_id: str | None = None, name: str | None = None) -> list[Snapshot]:
        snaps = sorted(self._snapshots.values(), key=lambda s: (-s.created_at, s.template_id))
        if sandbox_id:
            snaps = [s for s in snaps if s.sandbox_id == sandbox_id]
        if name:
            snaps = [s for s in snaps if s.name == _untagged(name)]
        return snaps

    def used_bytes(self) -> int:
        return sum(s.size_bytes for s in self._snapshots.values()) + self._reserved

    def content(self, snap: Snapshot) -> Path:
        d = self.root / snap.template_id
        return d / ("image" if snap.mode == "full" else "files.tar")

    # --- mutations -------------------------------------------------------------------------------

    def begin(self, name: str | None, owner: str | None, at_most: int) -> tuple[str, Path, int]:
        """A new snapshot's id, its directory (created) and the bytes it may take: `at_most` (the most
        its sandbox can make) or what is left of the quota, whichever is less, reserved until its commit
        or abort (snapshots taken at once each hold their own share, never all that is left). Raises
        SnapshotError when the name is bad or taken (by `owner`'s own snapshots: names are per tenant),
        or the quota is spent."""
        if name is not None:
            if not NAME_RE.match(name):
                raise SnapshotError(400, f"snapshot name {name!r} must be 1-63 lowercase letters, digits, '.', '_' "
                                         "or '-', starting with a letter or digit")
            if any(s.name == name and s.owner == owner for s in self._snapshots.values()):
                raise SnapshotError(409, f"a snapshot named {name!r} exists already: delete it or choose another name")
        if len(self._snapshots) >= self.max_count:
            raise SnapshotError(429, f"this server keeps at most {self.max_count} snapshots: delete some first")
        room = self.quota_bytes - self.used_bytes()
        if room <= 0:
            raise SnapshotError(429, f"the snapshots on this server use all of their {self.quota_bytes >> 20} MiB: "
                                     "delete some first")
        template_id = new_cell_sandbox_id()
        d = self.root / template_id
        d.mkdir(parents=True, mode=0o700)
        room = min(room, at_most)
        self._reserved += room
        return template_id, d, room

    async def commit(self, snap: Snapshot, reserved: int) -> None:
        """The snapshot exists once its meta.json does: its content goes to disk first (fsync), then
        meta.json, atomically (in a thread: seconds for a large one). Removed (and raised) if that
        fails. A cancelled caller does not stop it: the snapshot is then kept or removed all the same."""
        d = self.root / snap.template_id

        def write() -> None:
            durable.fsync_tree(self.content(snap))
            durable.fsync_dir(self.root)  # d's own entry
            durable.write_json(d / "meta.json", asdict(snap))

        def done(written: asyncio.Future[None]) -> None:
            if written.cancelled() or written.exception() is not None:
                self.abort(snap.template_id, reserved)
            else:
                self._reserved -= reserved
                self._snapshots[snap.template_id] = snap

        written = asyncio.get_running_loop().run_in_executor(None, write)
        written.add_done_callback(done)  # before the caller resumes: it answers with the snapshot's id
        await asyncio.shield(written)

    def abort(self, template_id: str, reserved: int) -> None:
        self._reserved -= reserved
        shutil.rmtree(self.root / template_id, ignore_errors=True)

    def delete(self, snap: Snapshot) -> bool:
        if self._snapshots.pop(snap.template_id, None) is None:
            return False
        with contextlib.suppress(OSError):
            (self.root / snap.template_id / "meta.json").unlink()
        shutil.rmtree(self.root / snap.template_id, ignore_errors=True)
        return True


def _untagged(ref: str) -> str:
    return ref[: -len(TAG) - 1] if ref.endswith(":" + TAG) else ref


def tree_size(path: Path) -> int:
    """Bytes a snapshot's content takes (a file, or a directory's files)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())
