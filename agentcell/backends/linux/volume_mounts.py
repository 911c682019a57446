"""Volumes (agentcell/volumes/) in a linux sandbox: the server sends a detached clone of each volume's
mount (open_tree) on the sandbox's socket; the child, still host root in the sandbox's private mount
namespace, idmaps it through the sandbox's user namespace and attaches it at its path before it enters
that namespace, so the kernel locks the mount (and its read-only flag) like every other one.

The idmap: a volume keeps ids as the sandbox sees them (0: its root, 1000: its user), so every sandbox
that mounts it, each with host ids of its own, reads and writes the same files as its own root and user.
"""

from __future__ import annotations

import os
import socket
import stat
from typing import Any

from agentcell.backends.base import VolumeMount
from agentcell.backends.linux import image_root
from agentcell.backends.linux import syscalls as sc


def request_part(volumes: tuple[VolumeMount, ...]) -> list[dict[str, Any]]:
    """What the request frame says of the volumes (their fds follow the frame)."""
    return [{"path": m.path, "read_only": m.read_only} for m in volumes]


def send(sock: socket.socket, volumes: tuple[VolumeMount, ...]) -> None:
    """Server side: a detached clone of each volume's mount, one message, ours closed after."""
    fds: list[int] = []
    try:
        for m in volumes:
            fds.append(sc.open_tree_one(m.source))
        socket.send_fds(sock, [b"V"], fds)
    finally:
        for fd in fds:
            os.close(fd)


def receive(sock_fd: int, count: int) -> list[int]:
    """Child side: the volume fds the server sent after the request frame (and archive, and layers)."""
    return image_root.receive_fds(sock_fd, count, "volumes") if count else []


def _mount_point(path: str) -> None:
    """Make `path` a directory in the sandbox's root, never through a symlink (a disk archive the sandbox
    starts from could hold one where the mount point goes)."""
    current = ""
    for part in path.strip("/").split("/"):
        current += "/" + part
        try:
            st = os.lstat(current)
        except FileNotFoundError:
            os.mkdir(current, 0o755)
            continue
        if not stat.S_ISDIR(st.st_mode):
            raise RuntimeError(f"the volume mount point {path}: {current} is not a directory")


def attach(volumes: list[dict[str, Any]], fds: list[int], userns_fd: int) -> None:
    """In the child (host root, the sandbox's mount namespace, its root as /): every volume at its path."""
    try:
        for spec, fd in zip(volumes, fds, strict=True):
            attrs = sc.MOUNT_ATTR_NOSUID | sc.MOUNT_ATTR_NODEV | (sc.MOUNT_ATTR_RDONLY if spec["read_only"] else 0)
            sc.set_idmap(fd, userns_fd, attrs, spec["path"])
            _mount_point(spec["path"])
            sc.move_mount_fd(fd, spec["path"])
    finally:
        for fd in fds:
            os.close(fd)
