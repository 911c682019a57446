"""One server per state directory.

Everything a server keeps across requests and restarts lives in its `--state-dir`: the record's
database, snapshots, paused sandboxes' files, fork images, its egress CA. Two servers on one directory
would list, resume and delete each other's snapshots and paused sandboxes, and write one database from
two processes. So a server holds an exclusive `flock` on `<state dir>/server.lock` for as long as it
runs (the kernel drops it when the process ends, however it ends), with who holds it written inside;
a second server on the same directory refuses to start and names the holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from dataclasses import dataclass

from agentcell import rootless

LOCK_NAME = "server.lock"


class StateDirError(RuntimeError):
    """The state directory cannot be this server's; the message says why and what to do."""


class StateDirInUseError(StateDirError):
    """Another live server holds this state directory."""


@dataclass
class StateDirLock:
    path: str
    fd: int

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)  # drops the lock; the file stays (a stale holder in it is harmless)
            self.fd = -1


def acquire(state_dir: str, listen: str) -> StateDirLock:
    """Hold `state_dir` for this process (made 0700 if missing); `listen` says where this server
    listens, for the message another server will show. Raises StateDirInUseError naming the holder."""
    path = os.path.join(state_dir, LOCK_NAME)
    try:
        os.makedirs(state_dir, mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        why = ("the server runs as root (it creates namespaces and cgroups): start it with sudo"
               if os.geteuid() != 0 else "give it a --state-dir it can write")
        raise StateDirError(f"cannot use --state-dir {state_dir} ({e.strerror}): {why}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = _describe(fd)
        os.close(fd)
        raise StateDirInUseError(
            f"--state-dir {state_dir} is in use by another agentcell server ({holder}); two servers must not "
            "share one (each would list, resume and delete the other's snapshots and paused sandboxes): give "
            "this server its own --state-dir, or stop that one") from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    holder = {"pid": _holder_pid(), "rootless": rootless.active(), "listen": listen, "started": time.time()}
    os.pwrite(fd, json.dumps(holder).encode(), 0)
    return StateDirLock(path, fd)


def _holder_pid() -> int | None:
    """This server's pid as its user sees it. A rootless server is pid 1 of a pid namespace of its own:
    the pid of its launcher outside (which passes signals on), or None when there is none to tell."""
    if not rootless.active():
        return os.getpid()
    return rootless.outside_pid()


def _describe(fd: int) -> str:
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        info = json.loads(os.pread(fd, 4096, 0))
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(info["started"])))
        pid, kind = info.get("pid"), "a rootless server, " if info.get("rootless") else ""
        who = f"pid {int(pid)}" if isinstance(pid, int) else "whose pid cannot be told from here"
        return f"{kind}{who}, listening on {info['listen']}, started {started}"
    return "its holder has not said who it is yet"
