"""One sandbox's exec rules as verdicts on files (issue 28): which files it may exec, by identity.

A file's identity is (st_dev, st_ino) of the exact file the kernel opens for the exec (fstat of the
fanotify event's fd; under an overlay, the real file's). Every file a verdict names is pinned (an
O_PATH fd held here), so its inode stays alive and its identity cannot pass to another file while
the verdict stands. A copy, a new file, or a file changed through an overlay (copied up) is another
identity: it has no verdict, and the sandbox's default decides.

    verdict(fd) -> "allow" | "deny" | "ask"

* a denied file: deny; an allowed one: allow; one allowed once (an approval without `remember`):
  allow, and the approval is used up;
* the ELF loader (ld.so): allow, since every dynamic program opens it for exec as its interpreter;
  exec'd as the main program it is killed by the backstop (exec_guard.py) unless allowed by a rule;
* with the default "allow": allow; otherwise a script ("#!"): allow, as its interpreter is the
  next file opened for exec, and that one is judged; otherwise the default ("deny" or "ask").
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

Identity = tuple[int, int]
MAX_PINNED = 4096  # files one sandbox's verdicts may pin (rules' matches and remembered approvals)


class TooManyVerdicts(ValueError):
    pass


def identity(fd: int) -> Identity:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _pin(fd: int) -> int:
    """An O_PATH fd of the same file as `fd` (which may be any kind of fd)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_PATH | os.O_CLOEXEC)


class ExecVerdicts:
    def __init__(self, default: str = "allow") -> None:
        self.default = default
        self._allow: dict[Identity, int] = {}  # identity -> pinned fd
        self._deny: dict[Identity, int] = {}
        self._once: dict[Identity, tuple[int, int]] = {}  # identity -> (pinned fd, uses left)
        self._loaders: dict[Identity, int] = {}

    # -- building -----------------------------------------------------------------------------------

    def _add(self, table: dict[Identity, int], fd: int) -> Identity:
        ident = identity(fd)
        if ident not in table:
            if len(self._allow) + len(self._deny) + len(self._once) + len(self._loaders) >= MAX_PINNED:
                raise TooManyVerdicts(f"a sandbox's exec rules may name at most {MAX_PINNED} files")
            table[ident] = _pin(fd)
        return ident

    def allow(self, fd: int) -> Identity:
        ident = self._add(self._allow, fd)
        self._drop(self._deny, ident)
        return ident

    def deny(self, fd: int) -> Identity:
        ident = self._add(self._deny, fd)
        self._drop(self._allow, ident)
        return ident

    def allow_once(self, fd: int) -> Identity:
        ident = identity(fd)
        pinned, uses = self._once.get(ident, (-1, 0))
        self._once[ident] = (pinned if pinned >= 0 else _pin(fd), uses + 1)
        return ident

    def loader(self, fd: int) -> Identity:
        return self._add(self._loaders, fd)

    @staticmethod
    def _drop(table: dict[Identity, int], ident: Identity) -> None:
        fd = table.pop(ident, -1)
        if fd >= 0:
            os.close(fd)

    def allowed(self) -> Iterable[int]:
        """Pinned fds of the files allowed for good (the gate's ignore marks)."""
        return list(self._allow.values()) + list(self._loaders.values())

    # -- deciding -----------------------------------------------------------------------------------

    def named(self, fd: int) -> bool:
        """Whether a rule names the file of `fd` (a denial by rule, not by the default)."""
        try:
            return identity(fd) in self._deny
        except OSError:
            return False

    def verdict(self, fd: int) -> str:
        try:
            ident = identity(fd)
        except OSError:
            return "deny" if self.default != "allow" else "allow"
        if ident in self._deny:
            return "deny"
        if ident in self._allow or ident in self._loaders:
            return "allow"
        once = self._once.get(ident)
        if once is not None:
            pinned, uses = once
            if uses <= 1:
                del self._once[ident]
                os.close(pinned)
            else:
                self._once[ident] = (pinned, uses - 1)
            return "allow"
        if self.default == "allow":
            return "allow"
        if _is_script(fd):
            return "allow"
        return self.default

    def close(self) -> None:
        for table in (self._allow, self._deny, self._loaders):
            for fd in table.values():
                with contextlib.suppress(OSError):
                    os.close(fd)
            table.clear()
        for fd, _ in self._once.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._once.clear()


def _is_script(fd: int) -> bool:
    try:
        return os.pread(fd, 2, 0) == b"#!"
    except OSError:
        return False
