"""Mount points of volumes in the gvisor backend's shared root (rootfs.py): the gofer mounts a bind
mount at its destination in the *host* tree it serves, which is read-only, so volumes go below /mnt, a
small tmpfs of its own there where the backend makes each mount point before `runsc run` and removes it
once no sandbox uses it (empty directories: another sandbox meanwhile sees their names, nothing more).
"""

from __future__ import annotations

import contextlib
import os
import posixpath

from agentcell.backends.base import VolumeMount
from agentcell.errors import InvalidArgumentError

ROOT = "/mnt"


def check(volumes: tuple[VolumeMount, ...]) -> None:
    for m in volumes:
        if not m.path.startswith(ROOT + "/"):
            raise InvalidArgumentError(f"on the gvisor backend a volume is mounted below {ROOT} (e.g. /mnt/data), "
                                       f"not at {m.path}")


class MountPoints:
    """Mount-point directories under `<root>/mnt`, counted by the sandboxes that use them."""

    def __init__(self, root: str) -> None:
        self.root = root
        self._users: dict[str, int] = {}

    def take(self, volumes: tuple[VolumeMount, ...]) -> None:
        for m in volumes:
            os.makedirs(self.root + m.path, 0o755, exist_ok=True)  # only the backend writes this tmpfs
            self._users[m.path] = self._users.get(m.path, 0) + 1

    def give_back(self, volumes: tuple[VolumeMount, ...]) -> None:
        for m in volumes:
            left = self._users.get(m.path, 0) - 1
            if left > 0:
                self._users[m.path] = left
                continue
            self._users.pop(m.path, None)
            path = m.path
            while path != ROOT and not any(p == path or p.startswith(path + "/") for p in self._users):
                with contextlib.suppress(OSError):
                    os.rmdir(self.root + path)
                path = posixpath.dirname(path)
