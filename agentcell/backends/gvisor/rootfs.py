"""The read-only tree every gVisor sandbox of one backend gets as its root, built once on the host.

A tmpfs at <state>/root holding what the linux backend's template holds (linux/rootfs.py): /usr and the
runtime store's parts at their neutral paths as host-level read-only bind mounts, a generated /etc
(sandbox_etc.py), empty mount points for /home/user, /tmp, /root ... The tmpfs itself is remounted
read-only at the end, so nothing in this tree can change on the host, whatever the gofer is asked.
runsc serves it through the gofer as the sandbox's root, with a memory overlay on top
(--overlay2=root:memory): the sandbox may write anywhere its users' modes allow, and its changes
stay in its own memory.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Callable

from agentcell.backends.linux import rootfs as linux_rootfs
from agentcell.backends.linux import runtime_store, sandbox_etc
from agentcell.backends.linux import syscalls as sc

_BASE = sc.MS_NOSUID | sc.MS_NODEV


def _bind_ro(src: str, dst: str) -> None:
    sc.mount(src, dst, None, sc.MS_BIND | sc.MS_REC)
    sc.mount(None, dst, None, sc.MS_REMOUNT | sc.MS_BIND | sc.MS_RDONLY | sc.MS_NOSUID | sc.MS_NODEV)


def _write(path: str, text: str, mode: int = 0o644) -> None:
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, mode)


def build(root: str, store: runtime_store.Store, sandbox_uid: int = linux_rootfs.SANDBOX_UID) -> None:
    """Make the tree at `root` (host root, host mount namespace); remove() undoes it."""
    os.makedirs(root, mode=0o755, exist_ok=True)
    sc.mount("tmpfs", root, "tmpfs", _BASE, "size=16m,mode=0755")
    try:
        for name in ("bin", "lib", "lib32", "lib64", "libx32", "sbin"):
            if os.path.islink(f"/{name}"):  # merged /usr (Debian 12): the same symlinks
                os.symlink(os.readlink(f"/{name}"), f"{root}/{name}")
            elif os.path.isdir(f"/{name}"):
                os.mkdir(f"{root}/{name}", 0o755)
                _bind_ro(f"/{name}", f"{root}/{name}")
        os.mkdir(f"{root}/usr", 0o755)
        _bind_ro("/usr", f"{root}/usr")
        for src, target in store.mounts:  # the runtime at its neutral paths, never a host path
            os.makedirs(root + target, mode=0o755, exist_ok=True)
            _bind_ro(src, root + target)
        etc = f"{root}/etc"
        os.mkdir(etc, 0o755)
        sandbox_etc.copy_from_host(etc)
        for name, text in sandbox_etc.generated(sandbox_uid, linux_rootfs.HOME).items():
            _write(f"{etc}/{name}", text)
        # no DNS at all here (--network=none): only names the sandbox's own files give
        _write(f"{etc}/resolv.conf", "")
        for name in ("hosts", "hostname"):  # written by the guest for its own name (guest.py)
            _write(f"{etc}/{name}", "")
        os.symlink("/proc/self/mounts", f"{etc}/mtab")
        for d in ("proc", "dev", "sys", "home", "tmp", "run", "var", "mnt", "opt", "srv", "var/lib", "var/log",
                  "var/cache", "var/local", "var/mail", "var/spool", "var/opt", "var/backups"):
            os.makedirs(f"{root}/{d}", 0o755, exist_ok=True)
        os.chmod(f"{root}/tmp", 0o1777)
        os.mkdir(f"{root}/root", 0o700)
        os.makedirs(f"{root}{linux_rootfs.HOME}", 0o755, exist_ok=True)
        os.symlink("/tmp", f"{root}/var/tmp")
        if os.path.isdir(linux_rootfs.DPKG_DB):  # so `apt-get install` as root knows what /usr holds
            os.mkdir(f"{root}{linux_rootfs.DPKG_DB}", 0o755)
            _bind_ro(linux_rootfs.DPKG_DB, f"{root}{linux_rootfs.DPKG_DB}")
        # the one writable part: volumes' mount points, made by the backend (volume_points.py)
        sc.mount("tmpfs", f"{root}/mnt", "tmpfs", _BASE | sc.MS_NOEXEC, "size=64k,nr_inodes=4096,mode=0755")
        sc.mount(None, root, None, sc.MS_REMOUNT | _BASE | sc.MS_RDONLY)
    except BaseException:
        remove(root)
        raise


def remove(root: str) -> None:
    """Detach the tree (every mount below `root` goes with it) and its mount point."""
    with contextlib.suppress(OSError):
        sc.umount2(root, sc.MNT_DETACH)
    with contextlib.suppress(OSError):
        os.rmdir(root)


def remove_stale(base: str, alive: Callable[[str], bool]) -> list[str]:
    """The state of dead servers' instances under `base` (<base>/<instance>/...): their trees detached,
    their directories removed. Their sandboxes must be dead already (cgroups.remove_stale_instances)."""
    gone = []
    with contextlib.suppress(OSError):
        for name in os.listdir(base):
            if not alive(name):
                gone.append(name)
                remove(os.path.join(base, name, "root"))
                subprocess.run(["rm", "-rf", "--one-file-system", os.path.join(base, name)], check=False)
    return gone
