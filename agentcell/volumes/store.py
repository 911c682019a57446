"""The server's volumes: one ext4 image per volume under `<state_dir>/volumes/<id>/`, loop-mounted by
the server (host root) at `mnt/`, the image's size being the volume's quota (the kernel's ENOSPC).

Each volume has an owner (the tenant that created it, server/tenancy.py; None without tenancy), a name
unique per owner (E2B's `volumeMounts` name volumes), and a token: the bearer credential of its content
API. `volume.json` (0600) keeps them across server runs; start() mounts every image again. The image
is on disk before `volume.json` is written, atomically (agentcell/durable.py); a damaged `volume.json`
is refused at start with a message saying where the volume's data is, and left where it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

from agentcell import durable, rootless
from agentcell.backends.base import new_cell_sandbox_id

log = logging.getLogger("agentcell.volumes")

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
MIN_SIZE_MB = 16  # an ext4 image below this leaves little room after its metadata
ROOT_IDS = (1000, 1000)  # the volume's root directory: the sandbox's user ("user") may write there


class VolumeError(Exception):
    """A refused volume operation: `status` is the HTTP status, the message says what to do."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class Volume:
    volume_id: str
    name: str
    token: str
    size_mb: int
    owner: str | None
    created_at: str


@dataclass(frozen=True)
class Limits:
    default_size_mb: int = 1024
    max_size_mb: int = 10240
    max_volumes: int = 100  # each holds a loop device while the server runs


def _run(argv: list[str]) -> None:
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise OSError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


def _reserve(fd: int, size: int) -> None:
    """The image's whole size taken on the state directory's disk now (fallocate), so that the volumes'
    quotas together never promise more disk than there is: a volume is then full at its own size,
    never because the host's disk filled up. A filesystem without fallocate gets a sparse file, if it
    has that much free space now."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise VolumeError(507, f"the server's disk has no room for a {size >> 20} MiB volume: ask for a "
                                   "smaller one (sizeMB), or destroy volumes") from None
        if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
    if shutil.disk_usage(f"/proc/self/fd/{fd}").free < size:
        raise VolumeError(507, f"the server's disk has no room for a {size >> 20} MiB volume")
    os.ftruncate(fd, size)


def _read_record(meta: Path) -> Volume:
    """A volume's volume.json; TornFileError if it is not whole."""
    what = "a volume's record (volume.json)"
    remedy = (f"the volume is not mounted and nothing of it was changed: its data is in {meta.parent / 'image.ext4'} "
              "(an ext4 image: `mount -o loop,ro` it to copy what you need); write its record again from a backup, "
              f"or remove {meta.parent} to free the space")
    data = durable.read_json(meta, what, remedy)
    try:
        volume = Volume(**data)
    except TypeError as e:
        raise durable.TornFileError(meta, what, f"not a volume's fields: {e}", remedy) from None
    if volume.volume_id != meta.parent.name:
        raise durable.TornFileError(meta, what, f"it names {volume.volume_id!r}, not its directory", remedy)
    return volume


class VolumeStore:
    """Volumes of one server: created, found, mounted and destroyed here (blocking work in threads)."""

    def __init__(self, state_dir: Path, limits: Limits = Limits()) -> None:
        self.dir = state_dir / "volumes"
        self.limits = limits
        self._volumes: dict[str, Volume] = {}
        self._lock = asyncio.Lock()
        # the volume ids live sandboxes (running or paused) mount: destroy refuses those (set by the app)
        self.in_use: Callable[[str], list[str]] = lambda volume_id: []

    # --- paths ---------------------------------------------------------------------------------------

    def mount_dir(self, volume: Volume) -> Path:
        """Where the server has the volume's filesystem mounted: its root is the volume's `/`."""
        return self.dir / volume.volume_id / "mnt"

    def _image(self, volume_id: str) -> Path:
        return self.dir / volume_id / "image.ext4"

    # --- lifecycle -----------------------------------------------------------------------------------

    @staticmethod
    def unavailable() -> str | None:
        """Why this server cannot have volumes (None: it can)."""
        if rootless.active() or os.geteuid() != 0:
            return ("volumes need a server run as root: each is a loop-mounted ext4 image, whose size is its "
                    "quota; a rootless server cannot mount one (docs/volumes.md)")
        if shutil.which("mkfs.ext4") is None or shutil.which("mount") is None:
            return "volumes need mkfs.ext4 and mount on the server's host (apt-get install e2fsprogs mount)"
        return None

    async def start(self) -> None:
        """Load the volumes of earlier runs and mount their images (a volume already mounted stays)."""
        if not self.dir.is_dir():
            return
        for meta in sorted(self.dir.glob("*/volume.json")):
            durable.remove_temps(meta.parent)
            try:
                volume = _read_record(meta)
            except (OSError, ValueError) as e:
                # left where it is (the volume's data is beside it): this says so at every start
                log.error("a volume cannot be mounted: %s", e)
                continue
            try:
                await asyncio.to_thread(self._mount, volume)
            except OSError as e:
                log.error("volume %s (%s) could not be mounted: %s", volume.volume_id, volume.name, e)
                continue
            self._volumes[volume.volume_id] = volume
        if self._volumes:
            log.info("volumes: %d mounted from %s", len(self._volumes), self.dir)

    async def close(self) -> None:
        """Unmount every volume (lazily: a sandbox still dying may hold it; its loop device goes after)."""
        for volume in list(self._volumes.values()):
            with contextlib.suppress(OSError):
                await asyncio.to_thread(self._unmount, volume)

    def _mount(self, volume: Volume) -> None:
        mnt = self.mount_dir(volume)
        mnt.mkdir(mode=0o700, exist_ok=True)
        if os.path.ismount(mnt):
            return
        # nosuid, nodev: nothing on a volume grants ids or devices, wherever it is mounted
        _run(["mount", "-t", "ext4", "-o", "loop,nosuid,nodev,noatime", str(self._image(volume.volume_id)), str(mnt)])

    def _unmount(self, volume: Volume) -> None:
        mnt = self.mount_dir(volume)
        if os.path.ismount(mnt):
            _run(["umount", "-l", str(mnt)])  # -o loop set autoclear: the loop device goes with the last user

    # --- the API's operations ------------------------------------------------------------------------

    def list(self, caller: str | None, sees: Callable[[str | None, str | None], bool]) -> list[Volume]:
        return sorted((v for v in self._volumes.values() if sees(caller, v.owner)), key=lambda v: v.created_at)

    def get(self, volume_id: str) -> Volume | None:
        return self._volumes.get(volume_id)

    def by_name(self, name: str, owner: str | None) -> Volume | None:
        for v in self._volumes.values():
            if v.name == name and v.owner == owner:
                return v
        return None

    def by_token(self, volume_id: str, token: str) -> Volume | None:
        volume = self._volumes.get(volume_id)
        if volume is None or not secrets.compare_digest(volume.token.encode(), token.encode()):
            return None
        return volume

    async def create(self, name: str, owner: str | None, size_mb: int | None) -> Volume:
        if (why := self.unavailable()) is not None:
            raise VolumeError(501, why)
        if not isinstance(name, str) or not NAME_RE.match(name):
            raise VolumeError(400, "a volume's 'name' is 1-128 characters of letters, digits, '.', '_' and '-', "
                                   "starting with a letter or digit")
        size = self.limits.default_size_mb if size_mb is None else size_mb
        if isinstance(size, bool) or not isinstance(size, int) or not MIN_SIZE_MB <= size <= self.limits.max_size_mb:
            raise VolumeError(400, f"'sizeMB' is a whole number of MiB from {MIN_SIZE_MB} to "
                                   f"{self.limits.max_size_mb} (the server's --max-volume-size-mb)")
        async with self._lock:
            if self.by_name(name, owner) is not None:
                raise VolumeError(409, f"you already have a volume named '{name}': connect to it, or pick another name")
            if len(self._volumes) >= self.limits.max_volumes:
                raise VolumeError(429, f"this server holds {len(self._volumes)} volumes, its most "
                                       "(--max-volumes): destroy one first")
            volume = Volume(new_cell_sandbox_id(), name, secrets.token_urlsafe(32), size, owner,
                            datetime.now(UTC).isoformat())
            try:
                await asyncio.to_thread(self._make, volume)
            except (OSError, VolumeError) as e:
                await asyncio.to_thread(self._remove_files, volume)
                if isinstance(e, VolumeError):
                    raise
                log.error("volume %s could not be made: %s", volume.volume_id, e)
                raise VolumeError(500, "the volume could not be made (the server log has the details)") from None
            self._volumes[volume.volume_id] = volume
        return volume

    def _make(self, volume: Volume) -> None:
        durable.make_dirs(self.dir)
        home = self.dir / volume.volume_id
        home.mkdir(mode=0o700)
        image = self._image(volume.volume_id)
        fd = os.open(image, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _reserve(fd, volume.size_mb << 20)
        finally:
            os.close(fd)
        # -m 0: no blocks reserved for root (every writer meets ENOSPC at the same point)
        # nodiscard: mkfs would punch the reserved blocks out of the image again
        _run(["mkfs.ext4", "-q", "-F", "-m", "0", "-E", f"root_owner={ROOT_IDS[0]}:{ROOT_IDS[1]},nodiscard",
              "-L", "agentcell-vol", str(image)])
        self._mount(volume)
        with contextlib.suppress(OSError):
            os.rmdir(self.mount_dir(volume) / "lost+found")  # not the tenant's; e2fsck makes it again if needed
        # the image (mkfs's writes) and the directory's entries on disk before the record that makes
        # the volume exist; the record itself is written atomically (old or new, never torn)
        durable.fsync_tree(image)
        durable.fsync_dir(self.dir)
        durable.write_json(home / "volume.json", asdict(volume))

    async def destroy(self, volume_id: str) -> None:
        async with self._lock:
            volume = self._volumes.get(volume_id)
            if volume is None:
                raise VolumeError(404, f"volume '{volume_id}' not found")
            users = self.in_use(volume_id)
            if users:
                raise VolumeError(409, f"volume '{volume.name}' is mounted by sandbox {', '.join(sorted(users))}: "
                                       "kill those sandboxes first (a volume is never pulled from under one)")
            del self._volumes[volume_id]
        await asyncio.to_thread(self._remove_files, volume)

    def _remove_files(self, volume: Volume) -> None:
        with contextlib.suppress(OSError):
            self._unmount(volume)
        shutil.rmtree(self.dir / volume.volume_id, ignore_errors=True)
