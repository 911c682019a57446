"""The files a rootless server bind-mounts its router's network namespace on (network/usermode.py).

The mount is in the server's own mount namespace and goes with it; the file under it, in the user's
~/.cache/agentcell/netns, does not: a server that is killed (SIGKILL, a crash, a reboot) cannot
remove it. So a server holds an exclusive `flock` on its file for as long as it runs (the kernel drops
it however the process ends), and a starting server removes every file of ours that nobody holds.
Another live server's file stays: its lock is held (it is taken on the file itself, which every
server's mount namespace shows, since each one's mount covers the path in its own namespace only).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat


def claim(path: str) -> int:
    """Create `path` (empty) and hold it for this process; the fd keeps the hold (close it to let go).
    Raises BlockingIOError if another process holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def remove_stale(directory: str, prefix: str) -> list[str]:
    """Remove the empty files named `prefix...` in `directory` that no live process holds: those of
    servers that died. Returns their names."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return []
    gone = []
    for name in names:
        if not name.startswith(prefix):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size:
                continue  # not one of ours
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # held: a live server's
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)
                gone.append(name)
        finally:
            os.close(fd)
    return gone
