"""The files an exec policy's patterns name inside a sandbox, opened (O_PATH): the files the exec
gate's verdicts pin (exec_verdicts.py).

Patterns are the policy's `exec.allow` / `exec.deny` entries:

* a bare name or glob (`python3`, `pip*`): the entries of that name in the sandbox's PATH directories
  (DEFAULT_PATH, plus `extra_dirs`);
* an absolute path or glob (`/usr/bin/git`, `/opt/tools/*/bin/run`): globbed in the sandbox's root.

Every path is resolved inside the sandbox's root, as its processes would: openat2(RESOLVE_IN_ROOT) on
an fd of /proc/<its init pid>/root, so a symlink of the sandbox (`/usr/bin/python3 -> python3.11`, or
one it planted, `-> /etc/shadow` or `-> ../../..`) leads to the sandbox's file, never the host's. What
is returned is the file the name resolves to now: its verdict binds that inode, so a later rename or
symlink swap does not carry the verdict to another file.

A pattern may match at most `max_matches` files (ExecPatternError naming it beyond): a verdict pins
each file it marks.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import os
import re
import stat
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from agentcell.backends.linux.runtime_store import NEUTRAL_ROOT
from agentcell.errors import InvalidArgumentError
from agentcell.policy.linux.mount_api import open_in_root

# the default template's PATH (its runtime's venv first: python3, pip) and the usual system dirs
DEFAULT_PATH = (f"{NEUTRAL_ROOT}/venv/bin", "/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
# ELF program interpreters (PT_INTERP) a root may hold, glibc's and musl's of each architecture: exec'd
# directly they run any file without an exec of it (exec_guard.py kills that). Exact names: a
# lookup each, no listing of /lib.
_ARCHS = ("x86_64", "aarch64", "i386", "armhf", "riscv64", "s390x", "ppc64le")
LOADERS = ("/lib64/ld-linux-x86-64.so.2", "/lib/ld-linux-aarch64.so.1", "/lib/ld-linux.so.2", "/lib/ld-linux-armhf.so.3",
           "/lib/ld-linux-riscv64-lp64d.so.1", "/lib/ld64.so.1", "/lib64/ld64.so.2", "/lib64/ld-linux-x32.so.2",
           "/libx32/ld-linux-x32.so.2", "/lib/x86_64-linux-gnu/ld-linux-x86-64.so.2",
           "/lib/aarch64-linux-gnu/ld-linux-aarch64.so.1", *(f"/lib/ld-musl-{a}.so.1" for a in _ARCHS))
MAX_MATCHES = 256
_MAGIC = frozenset("*?[")

class ExecPatternError(InvalidArgumentError):
    """A pattern matches more files than an exec policy may mark."""

    def __init__(self, pattern: str, message: str) -> None:
        super().__init__(message)
        self.pattern = pattern


@dataclass(frozen=True)
class Target:
    pattern: str
    path: str  # in the sandbox, as matched (before its symlinks)
    fd: int  # O_PATH|O_CLOEXEC of the file it resolves to in the sandbox's root: the caller closes it


@contextlib.contextmanager
def sandbox_root(init_pid: int) -> Iterator[int]:
    """An fd of the root of the sandbox whose init is host pid `init_pid`."""
    fd = os.open(f"/proc/{init_pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        yield fd
    finally:
        os.close(fd)


class _Resolver:
    """One root's lookups, listings kept for the patterns of one call."""

    def __init__(self, root_fd: int, max_matches: int) -> None:
        self.root_fd = root_fd
        self.max_matches = max_matches
        self._listings: dict[str, list[str]] = {}

    def file(self, path: str) -> int | None:
        """An O_PATH fd of the regular file `path` resolves to, or None (missing, not a file)."""
        try:
            fd = open_in_root(self.root_fd, path)
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EACCES, errno.EXDEV):
                return None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None
        return fd

    def names(self, directory: str) -> list[str]:
        if directory not in self._listings:
            try:
                fd = open_in_root(self.root_fd, directory, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                self._listings[directory] = []
            else:
                try:
                    self._listings[directory] = os.listdir(fd)
                finally:
                    os.close(fd)
        return self._listings[directory]

    def glob(self, path: str) -> Iterator[str]:
        """The in-root paths `path` (absolute, components may be globs) names, directories resolved
        in the root as they are walked."""
        parts = [p for p in path.split("/") if p]
        prefixes = ["/"]
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            nxt: list[str] = []
            for prefix in prefixes:
                if _MAGIC.isdisjoint(part):
                    nxt.append(os.path.join(prefix, part))
                else:
                    nxt.extend(os.path.join(prefix, n) for n in _matching(self.names(prefix), part))
                if not last and len(nxt) > self.max_matches:
                    raise ExecPatternError(path, f"exec pattern {path!r} matches more than {self.max_matches} "
                                                 "directories: name the files more narrowly")
            prefixes = nxt
        yield from prefixes


def resolve(init_pid: int, patterns: Iterable[str], extra_dirs: Iterable[str] = (),
            max_matches: int = MAX_MATCHES) -> list[Target]:
    """The files `patterns` name in the sandbox whose init is host pid `init_pid`, each file once per
    pattern (a PATH dir that is a symlink of another, /bin -> usr/bin, is not walked twice). A pattern
    matching nothing adds nothing. The caller closes the returned fds."""
    with sandbox_root(init_pid) as root_fd:
        return resolve_in(root_fd, patterns, extra_dirs, max_matches)


def resolve_in(root_fd: int, patterns: Iterable[str], extra_dirs: Iterable[str] = (),
               max_matches: int = MAX_MATCHES) -> list[Target]:
    r = _Resolver(root_fd, max_matches)
    dirs = _distinct_dirs(r, [*DEFAULT_PATH, *extra_dirs])
    out: list[Target] = []
    try:
        for pattern in patterns:
            if not pattern or "\0" in pattern:
                raise ExecPatternError(pattern, f"exec pattern {pattern!r} is empty or holds a NUL")
            if pattern.startswith("/"):
                candidates: Iterable[str] = r.glob(pattern)
            elif "/" in pattern:
                raise ExecPatternError(pattern, f"exec pattern {pattern!r}: give a program's name (python3, pip*) "
                                                "or an absolute path (/usr/bin/git)")
            elif _MAGIC.isdisjoint(pattern):
                candidates = (os.path.join(d, pattern) for d in dirs)
            else:
                candidates = (os.path.join(d, n) for d in dirs for n in _matching(r.names(d), pattern))
            out.extend(_open_distinct(r, pattern, candidates))
    except BaseException:
        for t in out:
            os.close(t.fd)
        raise
    return out


def loaders(init_pid: int) -> list[Target]:
    """The ELF loaders (ld.so) of the sandbox's root (LOADERS), each file once."""
    with sandbox_root(init_pid) as root_fd:
        return loaders_in(root_fd)


def loaders_in(root_fd: int) -> list[Target]:
    r = _Resolver(root_fd, MAX_MATCHES)
    seen: set[tuple[int, int]] = set()
    out: list[Target] = []
    for pattern in LOADERS:
        for t in _open_distinct(r, pattern, r.glob(pattern)):
            st = os.fstat(t.fd)
            if (st.st_dev, st.st_ino) in seen:
                os.close(t.fd)
            else:
                seen.add((st.st_dev, st.st_ino))
                out.append(t)
    return out


def _open_distinct(r: _Resolver, pattern: str, candidates: Iterable[str]) -> list[Target]:
    seen: set[tuple[int, int]] = set()
    out: list[Target] = []
    try:
        for path in candidates:
            fd = r.file(path)
            if fd is None:
                continue
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) in seen:
                os.close(fd)
                continue
            if len(out) >= r.max_matches:
                os.close(fd)
                raise ExecPatternError(pattern, f"exec pattern {pattern!r} matches more than {r.max_matches} files: "
                                                "name the programs more narrowly")
            seen.add((st.st_dev, st.st_ino))
            out.append(Target(pattern, path, fd))
    except BaseException:
        for t in out:
            os.close(t.fd)
        raise
    return out


def _matching(names: list[str], glob: str) -> list[str]:
    """The names `glob` matches, in order (a leading dot only by a glob that starts with one, as a shell)."""
    match = re.compile(fnmatch.translate(glob)).match
    hidden = glob.startswith(".")
    return sorted(n for n in names if match(n) and (hidden or n[0] != "."))


def _distinct_dirs(r: _Resolver, dirs: list[str]) -> list[str]:
    """`dirs` that exist in the root, the first of several that resolve to one directory."""
    seen: set[tuple[int, int]] = set()
    out = []
    for d in dirs:
        try:
            fd = open_in_root(r.root_fd, d, os.O_PATH | os.O_DIRECTORY)
        except OSError:
            continue
        st = os.fstat(fd)
        os.close(fd)
        if (st.st_dev, st.st_ino) not in seen:
            seen.add((st.st_dev, st.st_ino))
            out.append(d)
    return out
