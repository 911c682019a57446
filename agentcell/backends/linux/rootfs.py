"""The sandbox's root filesystem: a tmpfs holding read-only binds of the host's /usr, the Python
prefixes and an allow-list of /etc, plus private tmpfs for /home/user, /tmp, /dev/shm.

Two steps, because they need different privileges:

* `build(...)` runs in child A as *host root* inside a private mount namespace (A can traverse
  directories such as /root that the sandbox's unprivileged id cannot). Everything is mounted
  read-only/nosuid/nodev here; when A then unshares into the new user namespace the kernel copies
  these mounts and *locks* their flags, so not even the sandbox's namespace root can undo them.
* `enter(...)` runs in B (pid 1, inside the new namespaces): a fresh /proc and /dev/pts, then
  pivot_root into the tree and detach the host's root.
"""

from __future__ import annotations

import os
import sys

from agentcell.backends.linux import syscalls as sc

STAGING = "/run/agentcell/root"

# /etc entries the sandbox may see (read-only); whatever of these exists on the host is bound.
ETC_ALLOW = (
    "ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "ca-certificates",
    "ca-certificates.conf", "fonts", "localtime", "timezone", "nsswitch.conf", "bash.bashrc", "profile",
    "profile.d", "inputrc", "os-release", "debian_version", "mime.types", "protocols", "services",
    "host.conf", "gai.conf", "terminfo", "magic", "magic.mime", "locale.alias", "environment", "shells",
    "skel", "python3", "python3.11", "mailcap", "gitconfig", "wgetrc", "vim", "xdg", "issue", "networks",
    "login.defs", "pip.conf",
)
DEVICES = ("null", "zero", "full", "random", "urandom", "tty")
SANDBOX_UID = 1000
HOME = "/home/user"

_BASE = sc.MS_NOSUID | sc.MS_NODEV
_ST_TO_MS = (
    (os.ST_RDONLY, sc.MS_RDONLY), (os.ST_NOSUID, sc.MS_NOSUID), (os.ST_NODEV, sc.MS_NODEV),
    (os.ST_NOEXEC, sc.MS_NOEXEC), (os.ST_NOATIME, sc.MS_NOATIME), (os.ST_NODIRATIME, sc.MS_NODIRATIME),
    (os.ST_RELATIME, sc.MS_RELATIME),
)


def _locked_flags(path: str) -> int:
    """The mount flags `path` already has: a remount must repeat them or the kernel refuses (EPERM)."""
    f = os.statvfs(path).f_flag
    return sum(ms for st, ms in _ST_TO_MS if f & st)


def _bind_ro(src: str, dst: str, extra: int = sc.MS_NODEV) -> None:
    sc.mount(src, dst, None, sc.MS_BIND | sc.MS_REC)
    flags = _locked_flags(dst) | sc.MS_RDONLY | sc.MS_NOSUID | extra
    sc.mount(None, dst, None, sc.MS_REMOUNT | sc.MS_BIND | flags)


def _mountpoint_for(src: str, dst: str) -> None:
    if os.path.isdir(src):
        os.makedirs(dst, mode=0o755, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(dst), mode=0o755, exist_ok=True)
        if not os.path.exists(dst):
            os.close(os.open(dst, os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC, 0o644))


def _under(path: str, roots: list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


def python_paths() -> list[str]:
    """Host directories the sandbox's Python needs, bound read-only at the same paths."""
    # the agentcell package itself (agentcell/backends/linux/rootfs.py -> agentcell), so in-sandbox
    # helpers of the agent can import it; it holds no secrets
    pkg = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths: list[str] = []
    for p in (sys.base_prefix, sys.prefix, pkg):
        p = os.path.realpath(p)
        if not _under(p, ["/usr", *paths]):
            paths.append(p)
    return paths


def _etc(root: str, sandbox_id: str) -> None:
    etc = root + "/etc"
    os.mkdir(etc, 0o755)
    sc.mount("tmpfs", etc, "tmpfs", _BASE | sc.MS_NOEXEC, "size=1m,mode=0755")
    files = {
        "passwd": "root:x:0:0:root:/root:/bin/bash\n"
        f"user:x:{SANDBOX_UID}:{SANDBOX_UID}:user:{HOME}:/bin/bash\n"
        "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n",
        "group": f"root:x:0:\nuser:x:{SANDBOX_UID}:\nnogroup:x:65534:\n",
        "hosts": f"127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{sandbox_id}\n",
        "hostname": sandbox_id + "\n",
        "resolv.conf": "",  # no network: nothing to resolve with
    }
    for name, text in files.items():
        with open(f"{etc}/{name}", "w") as f:
            f.write(text)
    os.symlink("/proc/self/mounts", f"{etc}/mtab")
    for name in ETC_ALLOW:
        src = f"/etc/{name}"
        dst = f"{etc}/{name}"
        if os.path.islink(src):
            os.symlink(os.readlink(src), dst)  # e.g. localtime -> /usr/share/zoneinfo/...
        elif os.path.exists(src):
            _mountpoint_for(src, dst)
            _bind_ro(src, dst)
    sc.mount(None, etc, None, sc.MS_REMOUNT | _BASE | sc.MS_NOEXEC | sc.MS_RDONLY)


def _dev(root: str, shm_mb: int) -> None:
    dev = root + "/dev"
    os.mkdir(dev, 0o755)
    sc.mount("tmpfs", dev, "tmpfs", sc.MS_NOSUID | sc.MS_NOEXEC, "size=64k,mode=0755")
    for name in DEVICES:
        if os.path.exists(f"/dev/{name}"):
            _mountpoint_for(f"/dev/{name}", f"{dev}/{name}")
            # device nodes need a mount without nodev; their own bind keeps the host's flags
            sc.mount(f"/dev/{name}", f"{dev}/{name}", None, sc.MS_BIND)
            sc.mount(None, f"{dev}/{name}", None, sc.MS_REMOUNT | sc.MS_BIND | sc.MS_NOSUID | sc.MS_NOEXEC
                     | (_locked_flags(f"{dev}/{name}") & ~sc.MS_NODEV))
    os.mkdir(f"{dev}/pts", 0o755)
    os.mkdir(f"{dev}/shm", 0o1777)
    os.symlink("pts/ptmx", f"{dev}/ptmx")
    os.symlink("/proc/self/fd", f"{dev}/fd")
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        os.symlink(f"/proc/self/fd/{i}", f"{dev}/{name}")
    sc.mount("tmpfs", f"{dev}/shm", "tmpfs", _BASE, f"size={shm_mb}m,mode=1777")
    sc.mount(None, dev, None, sc.MS_REMOUNT | sc.MS_NOSUID | sc.MS_NOEXEC | sc.MS_RDONLY)


def build(sandbox_id: str, disk_mb: int, host_uid: int, host_gid: int, staging: str = STAGING) -> None:
    """Assemble the root at `staging` (host root, private mount namespace)."""
    sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)
    sc.mount("tmpfs", staging, "tmpfs", _BASE, "size=4m,mode=0755")
    root = staging
    for name in ("bin", "lib", "lib32", "lib64", "libx32", "sbin"):
        target = os.readlink(f"/{name}") if os.path.islink(f"/{name}") else None
        if target:  # merged /usr (Debian 12): keep the same symlinks
            os.symlink(target, f"{root}/{name}")
        elif os.path.isdir(f"/{name}"):
            os.mkdir(f"{root}/{name}", 0o755)
            _bind_ro(f"/{name}", f"{root}/{name}")
    os.mkdir(f"{root}/usr", 0o755)
    _bind_ro("/usr", f"{root}/usr")
    for path in python_paths():
        _mountpoint_for(path, root + path)
        _bind_ro(path, root + path)
    _etc(root, sandbox_id)
    _dev(root, disk_mb)
    os.mkdir(f"{root}/proc", 0o555)
    for d in ("home", "run", "var", "mnt", "opt", "srv"):
        os.makedirs(f"{root}/{d}", 0o755, exist_ok=True)
    os.symlink("/tmp", f"{root}/var/tmp")
    os.mkdir(f"{root}{HOME}", 0o755)
    size = f"size={disk_mb}m"
    sc.mount("tmpfs", f"{root}{HOME}", "tmpfs", _BASE, f"{size},mode=0755,uid={host_uid},gid={host_gid}")
    os.mkdir(f"{root}/tmp", 0o1777)
    sc.mount("tmpfs", f"{root}/tmp", "tmpfs", _BASE, f"{size},mode=1777")
    sc.mount(None, root, None, sc.MS_REMOUNT | _BASE | sc.MS_RDONLY)


def enter(staging: str = STAGING) -> None:
    """In B (namespace root, pid 1): fresh /proc and /dev/pts, pivot_root, drop the host's tree."""
    sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)
    # the copied mounts are locked; a fresh recursive bind on top is ours, so pivot_root accepts it
    sc.mount(staging, staging, None, sc.MS_BIND | sc.MS_REC)
    # proc must be mounted while the host's proc is still visible (kernel rule for user namespaces)
    sc.mount("proc", f"{staging}/proc", "proc", _BASE | sc.MS_NOEXEC)
    sc.mount("devpts", f"{staging}/dev/pts", "devpts", sc.MS_NOSUID | sc.MS_NOEXEC,
             "newinstance,ptmxmode=0666,mode=0620")
    os.chdir(staging)
    sc.pivot_root(".", ".")
    sc.umount2(".", sc.MNT_DETACH)
    os.chdir("/")
