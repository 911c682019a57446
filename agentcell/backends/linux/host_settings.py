"""Host-wide settings that several agentcell servers may change: who relies on each change, and what
the value was before any of them changed it.

A sysctl such as net.ipv4.ip_forward or kernel.pid_max, or the kernel's audit status, is one value for
the whole host (or for one network namespace), yet every server on the host may need it changed, and
each may stop, or die, at any moment. So no server restores such a value on its own: the first one to
change it saves the original, every server that relies on the change is a *holder*, and the last holder
to let go puts the original back.

The registry lives in /run/agentcell/host-settings (a tmpfs: gone at reboot, as the changes are):

* `<key>.json`: {"original": ..., "holders": {id: {"pid", "name", "since", ...}}, "pids": [...]},
  replaced atomically (rename);
* `.lock`: flock'd around every read-modify-write, and around the change or the restore it decides, so
  that servers starting and stopping at once see each other's holds;
* `holders/<id>`: a file each holder keeps flock'd for its whole life. A holder whose file someone else
  can lock is dead (the kernel dropped its lock when it exited, however it exited, whatever process now
  has its pid); dead holders are dropped at every access, and `sweep` restores a setting whose holders
  are all dead.

A setting's key names exactly one kernel object: per-network-namespace sysctls carry the namespace's
cookie (`netns_key`), so a test's stand-in host namespace never shares a record with the real host.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import re
import socket
import struct
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

REGISTRY = "/run/agentcell/host-settings"
LOCK_TIMEOUT_S = 30.0  # a registry lock held this long is a bug of its holder: say so instead of hanging
SO_NETNS_COOKIE = 71  # Linux 5.14+: a namespace's id, never reused while the host runs
_SAFE = re.compile(r"[^A-Za-z0-9_.@-]")

Holders = Mapping[str, Mapping[str, Any]]


class HostSettingsError(RuntimeError):
    """The registry of host-wide settings could not be used; the message names the file and the fix."""


@dataclass(frozen=True)
class Setting:
    """A host-wide value: `read()` gives it (JSON-able), `restore(original, pids)` puts the original back
    (`pids`: every process that held it since, for a restore that must tell agentcell's own traces, such
    as a registered audit daemon, from another program's)."""

    key: str
    read: Callable[[], Any]
    restore: Callable[[Any, frozenset[int]], None]


def sysctl(name: str, key: str | None = None) -> Setting:
    """An integer-valued (or single-word) sysctl of this process's view, e.g. "net.ipv4.ip_forward"."""
    path = "/proc/sys/" + name.replace(".", "/")

    def read() -> str:
        with open(path) as f:
            return f.read().strip()

    def restore(original: Any, pids: frozenset[int]) -> None:
        write_sysctl(name, str(original))

    return Setting(key or name, read, restore)


def write_sysctl(name: str, value: str) -> None:
    with open("/proc/sys/" + name.replace(".", "/"), "w") as f:
        f.write(value)


def netns_key(name: str) -> str:
    """`name` qualified by this process's network namespace (its cookie; its inode on kernels before
    5.14, which can be reused once the namespace is gone)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            cookie = struct.unpack("=Q", s.getsockopt(socket.SOL_SOCKET, SO_NETNS_COOKIE, 8))[0]
            return f"{name}@netns-{cookie}"
        except OSError:
            return f"{name}@netns-ino-{os.stat('/proc/self/ns/net').st_ino}"


class Holder:
    """One server's (or one of its processes') claim on host settings, alive while this object is:
    `hold` before changing a setting, `release` (or `close`) when the change is no longer needed.
    `name` says whose it is in the registry (a server's instance id)."""

    def __init__(self, name: str, registry: str = REGISTRY) -> None:
        self.name = name
        self.registry = registry
        self.id = _SAFE.sub("_", f"{name}.{os.getpid()}.{os.urandom(4).hex()}")
        self.held: dict[str, Setting] = {}
        os.makedirs(registry, mode=0o700, exist_ok=True)
        os.makedirs(os.path.join(registry, "holders"), mode=0o700, exist_ok=True)
        self._path = os.path.join(registry, "holders", self.id)
        self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(self._fd, json.dumps({"pid": os.getpid(), "name": name}).encode())

    def hold(self, setting: Setting, change: Callable[[Any, Holders], None] | None = None,
             **info: Any) -> Any:
        """Register as relying on `setting` and return its original value (saved now by the first
        holder). `change(original, holders)` then runs under the registry's lock (`holders`: every live
        one, with its `info`); if it raises, the hold is undone (and the original restored if no one
        else holds it)."""
        with _locked(self.registry):
            record = _live(self.registry, setting.key)
            if record is None:
                record = {"original": setting.read(), "holders": {}, "pids": []}
            record["holders"][self.id] = {"pid": os.getpid(), "name": self.name, "since": time.time(), **info}
            record["pids"] = sorted({*record["pids"], os.getpid()})
            _store(self.registry, setting.key, record)  # before the change: a crash now leaves the original known
            self.held[setting.key] = setting
            if change is not None:
                try:
                    change(record["original"], record["holders"])
                except BaseException:
                    self._drop(setting, record)
                    raise
            return record["original"]

    def original(self, setting: Setting) -> Any:
        """The value `setting` had before any holder changed it (this holder must hold it)."""
        with _locked(self.registry):
            record = _load(self.registry, setting.key)
            if record is None or self.id not in record["holders"]:
                raise HostSettingsError(f"{setting.key} is not held by {self.id}")
            return record["original"]

    def release(self, setting: Setting) -> bool:
        """No longer rely on `setting`; the last live holder restores it. True if this call restored it."""
        with _locked(self.registry):
            record = _live(self.registry, setting.key)
            return self._drop(setting, record)

    def _drop(self, setting: Setting, record: dict[str, Any] | None) -> bool:
        self.held.pop(setting.key, None)
        if record is None:
            return False
        record["holders"].pop(self.id, None)
        if record["holders"]:
            _store(self.registry, setting.key, record)
            return False
        try:
            setting.restore(record["original"], frozenset(record["pids"]))
        finally:
            _remove(self.registry, setting.key)
        return True

    def close(self) -> None:
        """Release every setting still held, then end this holder (its lock file goes)."""
        for setting in list(self.held.values()):
            try:
                self.release(setting)
            except (OSError, HostSettingsError) as e:  # the others go back all the same
                print(f"agentcell: could not put {setting.key} back: {e}", file=sys.stderr, flush=True)
        if self._fd >= 0:
            with contextlib.suppress(OSError):
                os.unlink(self._path)
            os.close(self._fd)
            self._fd = -1


def sweep(setting: Setting, registry: str = REGISTRY) -> bool:
    """Restore `setting` if everyone who changed it is dead (a server that crashed or was killed); True
    if it was restored."""
    if not os.path.isdir(registry):
        return False
    with _locked(registry):
        record = _live(registry, setting.key)
        if record is None or record["holders"]:
            return False
        try:
            setting.restore(record["original"], frozenset(record["pids"]))
        finally:
            _remove(registry, setting.key)
        return True


def holders(key: str, registry: str = REGISTRY) -> dict[str, dict[str, Any]]:
    """The live holders of `key` (for logs and tests)."""
    if not os.path.isdir(registry):
        return {}
    with _locked(registry):
        record = _live(registry, key)
        return {} if record is None else dict(record["holders"])


# --- the registry's files -----------------------------------------------------------------------------


@contextlib.contextmanager
def _locked(registry: str) -> Iterator[None]:
    os.makedirs(registry, mode=0o700, exist_ok=True)
    fd = os.open(os.path.join(registry, ".lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise HostSettingsError(
                        f"{registry}/.lock has been held for {LOCK_TIMEOUT_S:.0f} s by another agentcell process; "
                        "find it with `fuser` and stop it") from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # drops the lock


def _file(registry: str, key: str) -> str:
    return os.path.join(registry, _SAFE.sub("_", key) + ".json")


def _load(registry: str, key: str) -> dict[str, Any] | None:
    try:
        with open(_file(registry, key)) as f:
            record = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise HostSettingsError(f"{_file(registry, key)} is unreadable ({e}); if no agentcell server runs, "
                                "put the setting back by hand and remove the file") from None
    if not isinstance(record, dict) or not isinstance(record.get("holders"), dict) or "original" not in record:
        raise HostSettingsError(f"{_file(registry, key)} is not a holders record; if no agentcell server runs, "
                                "put the setting back by hand and remove the file")
    record.setdefault("pids", [])
    return record


def _live(registry: str, key: str) -> dict[str, Any] | None:
    """The record of `key` with its dead holders dropped (None if there is none)."""
    record = _load(registry, key)
    if record is not None:
        record["holders"] = {h: v for h, v in record["holders"].items() if _alive(registry, h)}
    return record


def _store(registry: str, key: str, record: dict[str, Any]) -> None:
    path = _file(registry, key)
    tmp = f"{path}.{os.getpid()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(record, f)
    os.replace(tmp, path)


def _remove(registry: str, key: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(_file(registry, key))


def _alive(registry: str, holder_id: str) -> bool:
    """Whether the holder still keeps its file locked (a dead one's file is removed)."""
    path = os.path.join(registry, "holders", _SAFE.sub("_", holder_id))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return True
        raise
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return False
    finally:
        os.close(fd)
