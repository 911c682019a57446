"""Private state directories (the zygote's Matplotlib font cache, its IPython dir), created safely.

A cache that every sandbox's memory inherits must not sit where another local user can pre-create it
(a symlink to somewhere else, a poisoned font cache): /tmp is out. ``private_dir`` walks the path
one component at a time without following symlinks, creates what is missing, and refuses a
directory that another user owns or could write to.

What lives in a `default_state_dir` is shared by every server of the user (root: every server of the
host), unlike a server's --state-dir, which is its own (server/state_lock.py). That is safe because
nothing in it is any server's or any tenant's: the zygote's Matplotlib font cache is derived from the
host's fonts alone (Matplotlib writes it under a lock file and rebuilds one it cannot read), and its
IPython dir holds an empty profile (history is off: display.py); both are written by zygotes, which run
only agentcell's code, before any sandbox exists. A sandbox, a fork of the zygote, sees neither: it
runs in its own root. Sharing them spares each new --state-dir a font scan at its first start.
(`agent` is only used where the agent runs outside a zygote, e.g. gvisor's guest, in its own
filesystem.)
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from agentcell import durable, rootless
from agentcell.errors import BackendUnavailableError

STATE_ROOT = "/var/lib/agentcell/state"  # a 0700 directory per user of it below


class UnsafeDirectoryError(BackendUnavailableError):
    """A state directory exists but someone else could have put (or could change) what is in it."""


def default_state_dir(name: str) -> str:
    """Where `name` keeps its state: under STATE_ROOT for root, the user's cache dir otherwise."""
    if os.geteuid() == 0 and not rootless.active():
        return f"{STATE_ROOT}/{name}"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "agentcell", name)


def private_dir(path: str) -> str:
    """Make sure `path` is a directory only we can use (ours, mode 0700) and return it.

    Every ancestor must be a real directory (no symlink) owned by root or by us and writable by no
    one else, so nobody can swap a component while we use it. Missing components are created
    (ancestors 0755, the last one 0700). Raises UnsafeDirectoryError with what to fix.
    """
    path = os.path.abspath(path)
    me = os.geteuid()
    parts = [p for p in path.split("/") if p]
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _check(fd, "/", me, last=not parts)
        for i, name in enumerate(parts):
            last = i == len(parts) - 1
            here = "/" + "/".join(parts[: i + 1])
            created = False
            try:
                os.mkdir(name, 0o700 if last else 0o755, dir_fd=fd)
                created = True
            except FileExistsError:
                pass
            try:
                child = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except OSError as e:
                raise UnsafeDirectoryError(
                    f"{here} is not a plain directory ({e.strerror}): remove it and restart") from None
            os.close(fd)
            fd = child
            if created:
                os.fchmod(fd, 0o700 if last else 0o755)  # whatever the umask
            _check(fd, here, me, last)
    finally:
        os.close(fd)
    return path


def owned_dir(path: str) -> str:
    """`path` (made if missing, mode 0700) as a directory of ours that no one else can read or
    change: for what lives under a server's --state-dir (its egress CA's key). Its parents are the
    operator's choice (a test's temporary directory under /tmp is fine)."""
    path = os.path.abspath(path)
    durable.make_dirs(Path(path).parent, mode=0o755)  # each new parent's entry synced too (a power cut)
    try:
        os.mkdir(path, 0o700)
        durable.fsync_dir(Path(path).parent)  # its entry on disk before what is written in it (a power cut)
    except FileExistsError:
        pass
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise UnsafeDirectoryError(f"{path} is not a plain directory ({e.strerror}): remove it and restart") from None
    try:
        _check(fd, path, os.geteuid(), last=True)
    finally:
        os.close(fd)
    return path


def _check(fd: int, where: str, me: int, last: bool) -> None:
    st = os.fstat(fd)
    if last:
        if st.st_uid != me or stat.S_IMODE(st.st_mode) != 0o700:
            raise UnsafeDirectoryError(
                f"{where} must belong to uid {me} with mode 0700 (it is uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}); someone else may have created it: remove it and restart")
    elif st.st_uid not in _trusted_owners(me) or st.st_mode & 0o022:
        raise UnsafeDirectoryError(
            f"{where} is writable by other users or belongs to uid {st.st_uid}; a private state directory "
            "cannot live under it")


def _trusted_owners(me: int) -> tuple[int, ...]:
    """Who may own a private directory's ancestors: root and us. Inside a rootless server's user
    namespace host root is unmapped and shows as the overflow id; the launcher checked the same
    directories as the real user before it entered (cli/rootless_serve.py)."""
    return (0, me, OVERFLOW_UID) if rootless.active() else (0, me)


OVERFLOW_UID = 65534
