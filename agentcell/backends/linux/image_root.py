"""A sandbox's root made from an image's layers (templates imported or built: agentcell/templates/).

The default template's root is the host's /usr under overlays (rootfs.py). A template made from an
image has a root of its own: one overlayfs whose lower layers are the image's layer trees, from the
template store, and whose upper layer is on the sandbox's disk, so the whole root is writable as on
E2B (`/0/x`, `/usr/local/bin/tool` as root), each change a copy on the sandbox's disk, counted in its
disk limit and gone at kill.

How the layers get in: the server (host root, the host's mount namespace) clones each layer's tree
as a *detached mount* (open_tree, syscalls.open_tree_one) and passes the fds on the sandbox's socket;
the standby, after rootfs.enter() pivoted it into the zygote's staging root, gives each the id map
below (an idmapped mount), attaches it on its disk, mounts the overlay there, moves /proc, /dev and
the runtime's mounts into it and pivots again. The store's trees never appear in any sandbox's mount
table by their host paths, and the zygote never holds anything of a template: one zygote serves every
template, and a new template costs no new zygote.

Owners: the store keeps an image's id N as host id ID_BASE + N (templates/unpack.py). The layers are
idmapped through a user namespace that maps ID_BASE to the sandbox root's host id and ID_BASE + 1000
to its user's, so the image's root and uid 1000 are the sandbox's root and user; files of other image
ids show as nobody (65534): readable as their modes say, never changeable (copy-up needs the owner).

The runtime: the agent is a fork of the zygote (its libraries are mapped already), but what it loads
later (a C extension imported for the first time, with its libraries) and the programs it execs (its
sudo) must come from the host, whatever the image's libc (glibc of another version, musl, or none):
the host's /usr, read-only at SYSTEM_USR, and the zygote runs with LD_LIBRARY_PATH naming its library
directory there (runtime_store.launch binds it at the same path, so the loader finds it in the zygote
and in every image sandbox alike).
"""

from __future__ import annotations

import os
import socket
import stat
import sys
import uuid
from pathlib import Path

from agentcell.backends import disk_archive
from agentcell.backends.linux import rootfs, runtime_store
from agentcell.backends.linux import syscalls as sc
from agentcell.templates.unpack import ID_BASE

SYSTEM_USR, SYSTEM_LIBS = runtime_store.SYSTEM_USR, runtime_store.SYSTEM_LIBS  # the host's /usr, for the runtime
MAX_LAYERS = 250  # below SCM_MAX_FD (253) and overlayfs's 500 lower layers
_ROOT_OVERLAY = 0  # the disk's .root/0: its upper layer (what disk_archive.py keeps of the root) ...
ROOT = "/"  # ... is the overlay of "/" (disk_archive's `overlays` for an image sandbox)
# where agentcell mounts in every image root (the runtime's binds are all under NEUTRAL_ROOT): kept out
# of disk archives and layers, and no archive may put anything there
MOUNT_POINTS = ("/proc", "/dev", "/home/user", runtime_store.NEUTRAL_ROOT)
# directories it writes into, or that must exist: /tmp is the root's own here (an image's /tmp files,
# e.g. a build's COPY there, are seen as in Docker), in the root's upper layer on the same disk
_SKELETON = ("/etc", "/root", "/tmp")
_MODES = {"/tmp": 0o1777, "/root": 0o700}


def open_layers(paths: tuple[str, ...]) -> list[int]:
    """Server side: a detached clone of each layer tree, top first, for one sandbox."""
    if len(paths) > MAX_LAYERS:
        raise ValueError(f"an image of {len(paths)} layers: at most {MAX_LAYERS} are supported")
    fds: list[int] = []
    try:
        for path in paths:
            fds.append(sc.open_tree_one(path))
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds


def receive_layers(sock_fd: int, count: int) -> list[int]:
    """Child side: the layer fds the server sent right after the request frame (and archive)."""
    return receive_fds(sock_fd, count, "image layers")


def receive_fds(sock_fd: int, count: int, what: str) -> list[int]:
    """Child side: `count` fds the server sent on the sandbox socket in one message (SCM_RIGHTS)."""
    with socket.socket(fileno=os.dup(sock_fd)) as sock:
        _, fds, _, _ = socket.recv_fds(sock, 1, count)
    if len(fds) != count:
        for fd in fds:
            os.close(fd)
        raise RuntimeError(f"the server announced {count} {what} but sent {len(fds)}")
    return fds


def _image_ids(root_id: int, user_id: int) -> str:
    return f"{ID_BASE} {root_id} 1\n{ID_BASE + rootfs.SANDBOX_UID} {user_id} 1\n"


def _skeleton_paths() -> list[str]:
    return [*MOUNT_POINTS, *_SKELETON, *rootfs.python_paths(), SYSTEM_USR]


def _skeleton(up: str, root_ids: tuple[int, int]) -> None:
    """The mount points every sandbox root needs, in the upper layer (owned by the sandbox's root):
    merged with the image's own directories of those names. Never through a symlink: an extracted
    archive's upper layer is the sandbox's (disk_archive kept these paths plain directories)."""
    for point in _skeleton_paths():
        path = up
        for part in point.strip("/").split("/"):
            path = f"{path}/{part}"
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                os.mkdir(path)
                os.chmod(path, _MODES.get(point, 0o755))
                os.chown(path, *root_ids)
                continue
            if not stat.S_ISDIR(st.st_mode):
                raise RuntimeError(f"the root's upper layer has a non-directory at {point}")


def _bind(src: str, dst: str, flags: int = 0) -> None:
    sc.mount(src, dst, None, sc.MS_BIND | sc.MS_REC | flags)


def finish(sandbox_id: str, disk_mb: int, host_uid: int, host_gid: int, layer_fds: list[int],
           root_ids: tuple[int, int], files_fd: int = -1) -> int:
    """In the standby, after rootfs.enter() (host root, its own mount namespace, in the staging root):
    the image's root, made writable, with /proc, /dev and the runtime moved in; pivots into it.
    Returns an O_PATH fd of the disk's root, as rootfs.finish does."""
    scratch = rootfs._SCRATCH
    inodes = max(1024, disk_mb * 1024 // rootfs._DISK_KIB_PER_INODE)
    sc.mount("tmpfs", scratch, "tmpfs", rootfs._BASE, f"size={disk_mb}m,nr_inodes={inodes},mode=0755")
    disk_fd = os.open(scratch, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    for _target, name, mode in rootfs._WRITABLE:
        os.mkdir(f"{scratch}/{name}")
        os.chmod(f"{scratch}/{name}", mode)
    os.chown(f"{scratch}/home", host_uid, host_gid)
    os.chown(f"{scratch}/shm", *root_ids)  # root's, as in an image's own root
    if files_fd >= 0:  # a paused or snapshotted sandbox's files: home, tmp and the root's upper layer
        with os.fdopen(files_fd, "rb") as archive:
            disk_archive.extract_archive(archive, disk_fd, host_uid, host_gid, *root_ids, overlays=[ROOT],
                                         protected=MOUNT_POINTS)
    # the image's ids through the sandbox's: image root = its root, image uid 1000 = its user
    ids = sc.new_userns(_image_ids(root_ids[0], host_uid), _image_ids(root_ids[1], host_gid))
    lowers = []
    try:
        for i, fd in enumerate(layer_fds):
            sc.set_idmap(fd, ids, sc.MOUNT_ATTR_RDONLY | sc.MOUNT_ATTR_NOSUID | sc.MOUNT_ATTR_NODEV, f"layer {i}")
            lower = f"{scratch}/.l{i}"
            os.mkdir(lower, 0o700)
            sc.move_mount_fd(fd, lower)
            lowers.append(lower)
    finally:
        os.close(ids)
        for fd in layer_fds:
            os.close(fd)
    base = f"{scratch}/.root/{_ROOT_OVERLAY}"
    up, work, merged = f"{base}/up", f"{base}/work", f"{scratch}/.merged"
    os.makedirs(up, exist_ok=True)  # an extracted archive made it
    os.mkdir(work)
    os.mkdir(merged)
    os.chmod(up, 0o755)
    os.chown(up, *root_ids)
    _skeleton(up, root_ids)
    # whole files and plain directories in the upper layer (what a disk archive keeps); the layers
    # cannot carry overlay's own xattrs (templates/unpack.py drops trusted.* but the opaque marker)
    sc.mount("overlay", merged, "overlay", rootfs._BASE,
             f"lowerdir={':'.join(lowers)},upperdir={up},workdir={work},redirect_dir=off,metacopy=off,index=off")
    for lower in lowers:
        sc.umount2(lower, sc.MNT_DETACH)  # the overlay keeps its own references
        os.rmdir(lower)
    # what the staging root has that the image root needs: the same mounts, at the same paths
    _bind("/proc", f"{merged}/proc")
    _bind("/dev", f"{merged}/dev")
    for path in rootfs.python_paths():
        _bind(path, merged + path)
    _bind("/usr", merged + SYSTEM_USR)  # the staging's /usr is the host's, read-only
    for target, name, _mode in rootfs._WRITABLE:
        if target != "/tmp":  # (the root's own, above)
            sc.mount(f"{scratch}/{name}", merged + target, None, sc.MS_BIND)
    rootfs.write_file(f"{scratch}/.boot_id", f"{uuid.uuid4()}\n")
    boot_id = f"{merged}/proc/sys/kernel/random/boot_id"
    if os.path.exists(boot_id):
        sc.mount(f"{scratch}/.boot_id", boot_id, None, sc.MS_BIND)
        sc.mount(None, boot_id, None, sc.MS_REMOUNT | sc.MS_BIND | sc.MS_RDONLY | rootfs._BASE | sc.MS_NOEXEC)
    os.chdir(merged)
    sc.pivot_root(".", ".")
    sc.umount2(".", sc.MNT_DETACH)  # the staging root (and the disk's own mount) are gone from here
    os.chdir("/")
    _etc(sandbox_id)
    _sudo()
    return disk_fd


# The runtime's programs run with the host's loader and libraries, whatever the image's libc: the
# directories the zygote's loader searches (runtime_store.launch), kept before the agent clears its env.
_LIBRARY_PATH = os.environ.get("LD_LIBRARY_PATH", SYSTEM_LIBS)
_LOADERS = ("ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1")


def _runtime_python() -> str:
    """The runtime's interpreter itself (not the venv's link to it), by a path an image root has: one of
    the host's /usr (a wheel's venv of /usr/bin/python3) is at SYSTEM_USR there. Resolved in the zygote,
    where the host's paths are still seen."""
    real = os.path.realpath(sys.executable)
    return SYSTEM_USR + real[len("/usr"):] if real.startswith("/usr/") else real


_PYTHON = _runtime_python()


def _sudo() -> None:
    """The sandbox's sudo (runtime/sudo_shim.py: asks the agent), as in the default template; here a
    shell script that runs it on the runtime's Python through the host's loader. Not for an image
    without /bin/sh or /usr/bin (a distroless one has neither shell nor sudo)."""
    loader = next((f"{SYSTEM_LIBS}/{n}" for n in _LOADERS if os.path.exists(f"{SYSTEM_LIBS}/{n}")), "")
    python = _PYTHON
    if not (loader and os.path.exists("/bin/sh") and os.path.isdir("/usr/bin")):
        return
    shim = Path(rootfs.__file__).parents[2] / "runtime" / "sudo_shim.py"
    rootfs._write_nofollow(rootfs.SUDO_PATH, f"#!/bin/sh\nexec {loader} --library-path {_LIBRARY_PATH} "
                           f"{python} -I -S {shim} \"$@\"\n", 0o755)


def _etc(sandbox_id: str) -> None:
    """The files every sandbox's /etc has from agentcell, written through the overlay (never following
    a link the image has there): its name, the resolver, its user when the image has none."""
    rootfs._write_nofollow("/etc/hosts", rootfs.etc_hosts(sandbox_id))
    rootfs._write_nofollow("/etc/hostname", sandbox_id + "\n")
    generated = rootfs.sandbox_etc.generated(rootfs.SANDBOX_UID, rootfs.HOME)
    rootfs._write_nofollow("/etc/resolv.conf", generated["resolv.conf"])
    shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
    for name, line in (("passwd", f"user:x:{rootfs.SANDBOX_UID}:{rootfs.SANDBOX_UID}:user:{rootfs.HOME}:{shell}"),
                       ("group", f"user:x:{rootfs.SANDBOX_UID}:")):
        text = _read_nofollow(f"/etc/{name}")
        rootfs._write_nofollow(f"/etc/{name}", with_user(text, line), 0o644)


def with_user(text: str, line: str) -> str:
    """`text` (passwd or group) with E2B's `user` (uid/gid 1000): as it is if it has that name; else the
    line goes before an entry of the image that has id 1000 under another name (ubuntu, node ...), so
    that 1000 reads as `user` and the image's name still works, or at the end."""
    entries = text.splitlines()
    if any(e.split(":", 1)[0] == "user" for e in entries):
        return text
    at = next((i for i, e in enumerate(entries) if e.split(":")[2:3] == [str(rootfs.SANDBOX_UID)]), len(entries))
    return "\n".join([*entries[:at], line, *entries[at:]]) + "\n"


def _read_nofollow(path: str) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(1 << 20).decode("utf-8", "replace")
    finally:
        os.close(fd)


def system_paths() -> None:
    """In the sandbox, before its entry point: the runtime's own Python files that came from the host's
    /usr are found at SYSTEM_USR (the image's /usr is its own)."""
    moved = [p.replace("/usr/", f"{SYSTEM_USR}/", 1) if p.startswith("/usr/") else p for p in sys.path]
    if moved != sys.path:
        sys.path[:] = moved
        sys.path_importer_cache.clear()
