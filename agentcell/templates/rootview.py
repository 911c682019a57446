"""A template's root as overlayfs would show it, read from its layer trees on the host, without mounting.

A build needs to look into the root so far without a sandbox: which uid `user` is (/etc/passwd),
where a COPY's destination really is (/bin may be a symlink to usr/bin), what mode and owner a
directory has that a new layer must repeat. The rules are overlayfs's: the topmost layer holding a
name decides; a whiteout (a 0:0 character device) hides the name below it; an opaque directory
(trusted.overlay.opaque=y) hides everything below it; a directory merges with the directories of the
same path beneath it. Symlinks are resolved inside the root (an absolute target starts at the root,
`..` stops at it), as the kernel resolves them in the sandbox: never on the host.

Only lstat, readlink and reads of regular files are done, all on the host, with no path leaving the
layer trees (every component is looked up with lstat, never followed).
"""

from __future__ import annotations

import contextlib
import os
import stat
from dataclasses import dataclass

from agentcell.errors import InvalidArgumentError
from agentcell.templates.unpack import ID_BASE, ID_RANGE, OPAQUE_XATTR

MAX_SYMLINKS = 40
MAX_READ = 1 << 20
# The built-in template's users (backends/linux/sandbox_etc.py): what a build on it may name.
BUILTIN_USERS = {"root": (0, 0, "/root"), "user": (1000, 1000, "/home/user")}
BUILTIN_GROUPS = {"root": 0, "user": 1000}


@dataclass(frozen=True)
class Entry:
    path: str  # its canonical absolute path in the root
    host_path: str  # the topmost layer's file
    st: os.stat_result


class RootView:
    def __init__(self, layer_trees_top_first: list[str], builtin: str | None = None) -> None:
        self.layers = list(layer_trees_top_first)
        self.builtin = builtin

    def _is_whiteout(self, st: os.stat_result) -> bool:
        return stat.S_ISCHR(st.st_mode) and st.st_rdev == 0

    def _opaque(self, host_path: str) -> bool:
        try:
            return os.getxattr(host_path, OPAQUE_XATTR, follow_symlinks=False) == b"y"
        except OSError:
            return False

    def _child(self, dirs: list[str], name: str) -> tuple[Entry | None, list[str]]:
        """`name` in the merged directory whose layer copies are `dirs` (top first): its entry and, for a
        directory, its own layer copies."""
        top: Entry | None = None
        below: list[str] = []
        for d in dirs:
            p = os.path.join(d, name)
            try:
                st = os.lstat(p)
            except (FileNotFoundError, NotADirectoryError):
                continue
            if top is None:
                if self._is_whiteout(st):
                    return None, []
                top = Entry("", p, st)
                if not stat.S_ISDIR(st.st_mode):
                    return top, []
                below.append(p)
                if self._opaque(p):
                    return top, below
                continue
            if not stat.S_ISDIR(st.st_mode):  # a whiteout or a file below a directory: the merge ends
                break
            below.append(p)
            if self._opaque(p):
                break
        return top, below

    def resolve(self, path: str, *, follow_last: bool = True) -> tuple[str, Entry | None]:
        """The canonical path of `path` (absolute, in the root) and its entry (None if it does not exist;
        missing parents are taken literally). Raises InvalidArgumentError for a symlink loop or a file as
        a parent."""
        todo = [p for p in path.split("/") if p not in ("", ".")]
        done: list[str] = []
        dirs = list(self.layers)
        entry: Entry | None = Entry("/", self.layers[0] if self.layers else "/", os.stat_result((0o40755,) + (0,) * 9))
        hops = 0
        while todo:
            name = todo.pop(0)
            if name == "..":
                if done:
                    done.pop()
                todo = done + todo
                done, dirs = [], list(self.layers)
                continue
            entry, below = self._child(dirs, name)
            if entry is None:  # nothing beneath can be a symlink: the rest is taken as it is
                for rest in [name, *todo]:
                    if rest == "..":
                        if done:
                            done.pop()
                    else:
                        done.append(rest)
                break
            if stat.S_ISLNK(entry.st.st_mode) and (todo or follow_last):
                hops += 1
                if hops > MAX_SYMLINKS:
                    raise InvalidArgumentError(f"{path}: too many levels of symbolic links")
                target = os.readlink(entry.host_path)
                parts = [p for p in target.split("/") if p not in ("", ".")]
                todo = ([] if target.startswith("/") else done) + parts + todo
                done, dirs = [], list(self.layers)
                continue
            if todo and not stat.S_ISDIR(entry.st.st_mode):
                raise InvalidArgumentError(f"{path}: /{'/'.join([*done, name])} is not a directory")
            done.append(name)
            dirs = below
        canonical = "/" + "/".join(done)
        if entry is None:
            return canonical, None
        return canonical, Entry(canonical, entry.host_path, entry.st)

    def lookup(self, path: str) -> Entry | None:
        try:
            return self.resolve(path)[1]
        except InvalidArgumentError:
            return None

    def read(self, path: str) -> bytes | None:
        entry = self.lookup(path)
        if entry is None or not stat.S_ISREG(entry.st.st_mode):
            return None
        fd = os.open(entry.host_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        with os.fdopen(fd, "rb") as f:
            return f.read(MAX_READ)

    # users -----------------------------------------------------------------------------------------

    def _table(self, path: str) -> list[list[str]]:
        raw = self.read(path)
        if raw is None:
            return []
        return [line.split(":") for line in raw.decode("utf-8", "replace").splitlines() if line and line[0] != "#"]

    def user(self, name: str) -> tuple[int, int, str] | None:
        """(uid, gid, home) of `name` (or of a number) in the root's /etc/passwd; None if it has none."""
        for row in self._table("/etc/passwd"):
            if len(row) >= 6 and (row[0] == name or (name.isdigit() and row[2] == name)):
                with contextlib.suppress(ValueError):
                    return int(row[2]), int(row[3]), row[5] or "/"
        if self.builtin and name in BUILTIN_USERS:
            return BUILTIN_USERS[name]
        if name == "root" or name == "0":
            return 0, 0, "/root"
        if name.isdigit() and int(name) < ID_RANGE:
            return int(name), int(name), "/"
        return None

    def group(self, name: str) -> int | None:
        for row in self._table("/etc/group"):
            if len(row) >= 3 and (row[0] == name or (name.isdigit() and row[2] == name)):
                with contextlib.suppress(ValueError):
                    return int(row[2])
        if self.builtin and name in BUILTIN_GROUPS:
            return BUILTIN_GROUPS[name]
        if name.isdigit() and int(name) < ID_RANGE:
            return int(name)
        return 0 if name == "root" else None

    def owner(self, spec: str) -> tuple[int, int]:
        """`user` or `user:group` as image ids; InvalidArgumentError naming what the root lacks."""
        user, _, group = spec.partition(":")
        found = self.user(user)
        if found is None:
            raise InvalidArgumentError(f"invalid username: '{user}'")
        uid, gid = found[0], found[1]
        if group:
            g = self.group(group)
            if g is None:
                raise InvalidArgumentError(f"invalid group: '{group}'")
            gid = g
        if not (0 <= uid < ID_RANGE and 0 <= gid < ID_RANGE):
            raise InvalidArgumentError(f"{spec}: ids {uid}:{gid} are outside the 0..{ID_RANGE - 1} a sandbox maps")
        return uid, gid


def stored_id(image_id: int) -> int:
    return ID_BASE + image_id
