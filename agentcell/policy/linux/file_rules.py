"""A sandbox policy's `files` rules (issue 28), enforced by the kernel with mounts in the sandbox's mount
namespace: [{"path": "/home/user/repo", "access": "read" | "write" | "none"}, ...], most specific wins.

    read  -> a read-only copy of the path's mounts bound over it (their nosuid/nodev/noexec kept)
    none  -> a directory: an empty read-only tmpfs directory, mode 000, owned by host root; a file: an
             empty mode-000 file of that tmpfs bound over it. Host root is unmapped in the sandbox, so
             not even its root gets past the mode (no capability applies to an unmapped owner).
    write -> under a read or none rule: a writable copy of the original place bound on top; elsewhere
             nothing (it is what the sandbox has anyway; refused where the sandbox cannot write).

Every process of the sandbox sees the same mounts, the agent that serves the files API included, and
the sandbox cannot change them: its seccomp filter refuses the whole mount API and unshare/setns
(backends/linux/seccomp_filter.py). Symlinks, hard links, `..`, /proc/self/root and renames all end up
on an inode of some mount, and the mount decides.

How. A short-lived server thread leaves the process's shared fs_struct (unshare(CLONE_FS)), enters
the sandbox's mount namespace (setns) and works on file descriptors only (mount_api.py): every path
is resolved once with openat2(RESOLVE_NO_SYMLINKS), so a symlink a sandbox planted fails the rule
rather than redirecting a mount.

At the first apply the thread unshares a copy of the sandbox's mount namespace: the "workshop", owned
by host root's user namespace, the sandbox's mounts as they were before any rule (same files). Every
copy of an original place is cloned there (open_tree), so an update never copies our own earlier
mounts; and a detached mount tree counts as a mount namespace of its creator's namespace's owner: in
the sandbox's own namespace the sandbox's limit of 0 namespaces (ns_limits.py) would refuse it
(ENOSPC). The new rules are assembled there as detached trees (nested rules mounted inside their
parent's tree), then the thread goes back into the sandbox's namespace and attaches them:

    * a rule area that did not change keeps its mounts;
    * a changed one is swapped: the new tree is mounted beneath the old one (MOVE_MOUNT_BENEATH), then
      the old one is detached, so at every instant the path shows the old rules or the new ones;
    * a new one is attached; one inside an area whose rules go away is attached to the original place
      beneath them, then revealed when they are detached.

A failure while assembling (a symlink in a path, a missing mount) or attaching leaves the old rules in
force (FileRulesError); one while detaching old mounts leaves them on top (FileRulesApplyError).

Limits (docs/security.md): a file descriptor, an open directory or a working directory taken before an
update keeps reaching what it was opened on with the access it had; a rule protects the directory that
was at its path when applied: renaming an ancestor moves the protected tree (still protected) and frees
the name.
"""

from __future__ import annotations

import ctypes
import errno
import os
import posixpath
import stat
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from agentcell.policy.linux import mount_api as m

MAX_RULES = 64
ACCESS = ("none", "read", "write")
# Never ruled: the kernel's and the runtime's own trees (the agent runs from /opt/agentcell).
RESERVED = ("/proc", "/dev", "/sys", "/opt/agentcell")
_COVER_ATTRS = m.MOUNT_ATTR_RDONLY | m.MOUNT_ATTR_NOSUID | m.MOUNT_ATTR_NODEV | m.MOUNT_ATTR_NOEXEC
_CLONE_FS = 0x200
_CLONE_NEWNS = 0x00020000
_libc = ctypes.CDLL(None, use_errno=True)
T = TypeVar("T")


class FileRuleLike(Protocol):
    @property
    def path(self) -> str: ...

    @property
    def access(self) -> str: ...


class FileRulesError(Exception):
    """A rule that cannot be enforced (`index`: its place in the policy's `files`, None for the whole
    list); the message says why and what to write instead. The old rules stay in place."""

    def __init__(self, index: int | None, message: str) -> None:
        self.index = index
        self.message = message
        self.part = "policy.files" if index is None else f"policy.files[{index}]"
        super().__init__(f"{self.part}: {message}")


class FileRulesApplyError(FileRulesError):
    """The kernel refused a step after the new rules were being attached: `applied` describes what is
    now in place (every area shows its old rules or its new ones); keep it for the next update/clear."""

    def __init__(self, message: str, applied: Applied) -> None:
        super().__init__(None, message)
        self.applied = applied


@dataclass(frozen=True)
class _Rule:
    index: int
    path: str
    access: str


@dataclass
class _Root:
    """The mounts we stacked at one path, bottom first (fds of their roots), for the rules in its area."""

    path: str
    signature: tuple[tuple[str, str, bool], ...]
    fds: list[int]
    under_fd: int  # O_PATH fd of the original place the bottom mount covers
    old_signature: tuple[tuple[str, str, bool], ...] = ()


@dataclass
class Applied:
    """What apply() put in place for one sandbox: pass it to the next apply() (an update) or to clear().
    Holds file descriptors (the workshop namespace pins the sandbox's filesystems): clear() or close() it
    when the sandbox ends."""

    init_pid: int
    mntns: tuple[int, int]
    rules: tuple[tuple[str, str], ...]
    workshop_fd: int  # the sandbox's mounts before any rule, see the module's docstring
    roots: dict[str, _Root] = field(default_factory=dict)
    absent: tuple[str, ...] = ()  # rule paths that do not exist and cannot be created: nothing to cover
    apply_ms: float = 0.0

    def close(self) -> None:
        """Close our descriptors (the mounts stay where they are until the namespace goes)."""
        for root in self.roots.values():
            for fd in (*root.fds, root.under_fd):
                _close(fd)
        self.roots.clear()
        _close(self.workshop_fd)
        self.workshop_fd = -1


def validate(rules: Sequence[FileRuleLike]) -> tuple[_Rule, ...]:
    """The checks that need no sandbox: count, access, absolute normalised paths, no reserved tree."""
    if len(rules) > MAX_RULES:
        raise FileRulesError(None, f"at most {MAX_RULES} rules")
    out: list[_Rule] = []
    seen: dict[str, int] = {}
    for i, rule in enumerate(rules):
        path, access = rule.path, rule.access
        if access not in ACCESS:
            raise FileRulesError(i, f"access must be one of {', '.join(ACCESS)}")
        if not isinstance(path, str) or not path.startswith("/") or "\0" in path:
            raise FileRulesError(i, "path must be an absolute path inside the sandbox")
        if posixpath.normpath(path) != path or path.startswith("//") or ".." in path.split("/"):
            raise FileRulesError(i, f"{path!r} is not a normalised path (write {posixpath.normpath(path)!r})")
        if path == "/":
            raise FileRulesError(i, "a rule on / is not possible: name the top-level directories (/home, /usr ...)")
        for reserved in RESERVED:
            if path == reserved or path.startswith(reserved + "/"):
                raise FileRulesError(i, f"{reserved} is the kernel's or the runtime's: no rule may name it")
            if access == "none" and reserved.startswith(path + "/"):
                raise FileRulesError(i, f"'none' on {path} would hide {reserved}, which the sandbox needs")
        if path in seen:
            raise FileRulesError(i, f"{path!r} has a rule already (policy.files[{seen[path]}])")
        seen[path] = i
        out.append(_Rule(i, path, access))
    # least specific first: a rule's parent rules come before it
    return tuple(sorted(out, key=lambda r: (r.path.count("/"), r.path)))


def _parent_rule(rule: _Rule, rules: Sequence[_Rule]) -> _Rule | None:
    best = None
    for other in rules:
        if rule.path.startswith(other.path + "/") and (best is None or len(other.path) > len(best.path)):
            best = other
    return best


def _needs_mount(rule: _Rule, parent: _Rule | None) -> bool:
    inherited = parent.access if parent else "write"
    return rule.access != inherited


@dataclass
class _Node:
    """One mount to make: the rule, its kind in the original tree, the rule mounts nested in it."""

    rule: _Rule
    is_dir: bool
    ident: tuple[int, int]  # (st_dev, st_ino) of what the rule's path named when planned
    children: list[_Node] = field(default_factory=list)

    def check(self, fd: int) -> None:
        """Refuse to mount over `fd` unless it is still what was planned: a sandbox renaming things
        meanwhile must not get a copy of one directory mounted over another."""
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != self.ident:
            raise FileRulesError(self.rule.index, f"{self.rule.path} changed while the rules were applied; "
                                 "the previous rules stay, try again")

    def signature(self, base: str) -> tuple[tuple[str, str, bool], ...]:
        own = ((posixpath.relpath(self.rule.path, base), self.rule.access, self.is_dir),)
        return own + tuple(s for c in self.children for s in c.signature(base))


def apply(init_pid: int, rules: Sequence[FileRuleLike], previous: Applied | None = None) -> Applied:
    """Put `rules` in force in the mount namespace of the sandbox whose init is `init_pid` (host pid),
    replacing `previous` (what the last apply() returned; None: no rules in place yet). Raises
    FileRulesError naming the rule (old rules untouched) or FileRulesApplyError (see there)."""
    checked = validate(rules)
    ns_fd = os.open(f"/proc/{init_pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(ns_fd)
        mntns = (st.st_dev, st.st_ino)
        if _same_ns(init_pid, "mnt") or _same_ns(init_pid, "user"):  # never the server's own mounts
            raise FileRulesError(None, f"process {init_pid} is not in a sandbox (it shares the server's namespaces)")
        if previous is not None and previous.mntns != mntns:
            raise FileRulesError(None, f"process {init_pid} is not the sandbox the previous rules were applied to")
        return _in_namespace(ns_fd, lambda proc_fd: _apply(ns_fd, mntns, init_pid, checked, previous, proc_fd))
    finally:
        os.close(ns_fd)


def _same_ns(pid: int, kind: str) -> bool:
    theirs, ours = os.stat(f"/proc/{pid}/ns/{kind}"), os.stat(f"/proc/self/ns/{kind}")
    return (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino)


def clear(init_pid: int, applied: Applied) -> None:
    """Remove every mount apply() made (lazily: open files keep working) and close `applied`."""
    try:
        if applied.roots and os.path.exists(f"/proc/{init_pid}/ns/mnt"):
            ns_fd = os.open(f"/proc/{init_pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            try:
                st = os.fstat(ns_fd)
                if (st.st_dev, st.st_ino) == applied.mntns:
                    _in_namespace(ns_fd, lambda proc_fd: _detach_all(applied, proc_fd))
            finally:
                os.close(ns_fd)
    finally:
        applied.close()


def _detach_all(applied: Applied, proc_fd: int) -> None:
    for root in applied.roots.values():
        _detach_stack(root, proc_fd)


def _detach_stack(root: _Root, proc_fd: int) -> None:
    """Lazily detach our mounts at one path, top first: a umount through a mount's fd reaches the
    topmost mount stacked on it, so a lower one goes only once those above are gone."""
    while root.fds:
        m.umount_fd(proc_fd, root.fds[-1])
        _close(root.fds.pop())


def _in_namespace(ns_fd: int, work: Callable[[int], T]) -> T:
    """Run work(host /proc fd) in a fresh thread that has entered the mount namespace `ns_fd`.

    A thread of a multi-threaded process may setns into a mount namespace once it has its own
    fs_struct (root, cwd): unshare(CLONE_FS). The thread then ends, taking that state with it. It
    imports nothing and reads no file by path (a path there is the sandbox's)."""
    result: list[object] = []
    proc_fd = os.open("/proc", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)

    def run() -> None:
        try:
            if _libc.unshare(ctypes.c_int(_CLONE_FS)) != 0:
                raise OSError(ctypes.get_errno(), "unshare(CLONE_FS)")
            _setns(ns_fd)
            result.append(work(proc_fd))
        except BaseException as e:  # handed to the caller's thread, formatted there
            result.append(e)

    try:
        thread = threading.Thread(target=run, name="file-rules", daemon=True)
        thread.start()
        thread.join()
    finally:
        os.close(proc_fd)
    if isinstance(result[0], BaseException):
        raise result[0]
    return result[0]  # type: ignore[return-value]


def _setns(ns_fd: int) -> None:
    if _libc.setns(ctypes.c_int(ns_fd), ctypes.c_int(_CLONE_NEWNS)) != 0:
        raise OSError(ctypes.get_errno(), "setns(mount namespace)")


def _unshare_mount_ns() -> None:
    if _libc.unshare(ctypes.c_int(_CLONE_NEWNS)) != 0:
        raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWNS)")


def _apply(ns_fd: int, mntns: tuple[int, int], init_pid: int, rules: tuple[_Rule, ...], previous: Applied | None,
           proc_fd: int) -> Applied:
    """In the thread, in the sandbox's mount namespace."""
    t0 = time.perf_counter()
    if previous is None:
        _unshare_mount_ns()  # the workshop: a copy of the sandbox's mounts as they are now, owned by host root
        workshop = os.open("thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc_fd)
    else:
        workshop = previous.workshop_fd
        _setns(workshop)
    made: list[int] = []  # fds of detached trees made here: closed once attached (the mounts stay)
    old = previous.roots if previous else {}
    applied = Applied(init_pid, mntns, tuple((r.path, r.access) for r in rules), workshop)
    try:
        pristine = m.open_exact(m.AT_FDCWD, "/")
        try:
            roots, applied.absent = _plan(rules, pristine)
            trees = {path: _build(node, pristine, made) for path, node in roots.items()}
        finally:
            os.close(pristine)
        _setns(ns_fd)
        _switch(roots, trees, old, applied, proc_fd)
    except BaseException:
        if previous is None:
            _close(workshop)
        raise
    finally:
        keep = {fd for r in (*applied.roots.values(), *old.values()) for fd in r.fds}
        for fd in made:
            if fd not in keep:
                _close(fd)
    if previous is not None:
        previous.workshop_fd = -1  # `applied` owns it now; previous.roots is empty
    applied.apply_ms = (time.perf_counter() - t0) * 1000
    return applied


def _plan(rules: tuple[_Rule, ...], pristine: int) -> tuple[dict[str, _Node], tuple[str, ...]]:
    """Which mounts to make, as trees of nodes (root path -> node), after checking each rule against
    the original tree. Missing paths for a mount are created (directories, owned like their parent)."""
    nodes: dict[str, _Node] = {}
    roots: dict[str, _Node] = {}
    absent: list[str] = []
    for rule in rules:
        parent = _parent_rule(rule, rules)
        rel = rule.path.lstrip("/")
        kind = _kind(pristine, rel, rule)
        if rule.access == "write" and _read_only_place(pristine, rel, rule):
            raise FileRulesError(rule.index, f"{rule.path} is read-only in this sandbox's template: 'write' is "
                                 "not possible there (its overlays, /home/user and /tmp are writable)")
        if not _needs_mount(rule, parent):
            continue
        if kind is None:
            kind = _create_dir(pristine, rel, rule)
            if kind is None:  # on a read-only mount: nobody in the sandbox can create it either
                absent.append(rule.path)
                continue
        node = _Node(rule, kind, _ident(pristine, rel))
        host = _mount_parent(rule, nodes)
        if host is None:
            roots[rule.path] = node
        else:
            host.children.append(node)
        nodes[rule.path] = node
    return roots, tuple(absent)


def _mount_parent(rule: _Rule, nodes: dict[str, _Node]) -> _Node | None:
    best = None
    for path, node in nodes.items():
        if rule.path.startswith(path + "/") and (best is None or len(path) > len(best.rule.path)):
            best = node
    return best


def _kind(pristine: int, rel: str, rule: _Rule) -> bool | None:
    """True: a directory, False: another file, None: missing."""
    try:
        fd = m.open_exact(pristine, rel)
    except OSError as e:
        if e.errno == errno.ENOENT:
            return None
        if e.errno == errno.ELOOP:
            raise FileRulesError(rule.index, f"{rule.path} is or goes through a symlink: name the real path") from None
        if e.errno == errno.ENOTDIR:
            raise FileRulesError(rule.index, f"a parent of {rule.path} is not a directory") from None
        raise
    try:
        return stat.S_ISDIR(os.fstat(fd).st_mode)
    finally:
        os.close(fd)


def _ident(pristine: int, rel: str) -> tuple[int, int]:
    fd = m.open_exact(pristine, rel)
    try:
        st = os.fstat(fd)
        return st.st_dev, st.st_ino
    finally:
        os.close(fd)


def _read_only_place(pristine: int, rel: str, rule: _Rule) -> bool:
    """Whether the mount holding `rel` (or its nearest existing ancestor) is read-only."""
    while True:
        try:
            fd = m.open_exact(pristine, rel)
            break
        except OSError as e:
            if e.errno != errno.ENOENT or not rel:
                raise FileRulesError(rule.index, f"{rule.path}: {e.strerror}") from None
            rel = posixpath.dirname(rel)
    try:
        return bool(os.fstatvfs(fd).f_flag & os.ST_RDONLY)
    finally:
        os.close(fd)


def _create_dir(pristine: int, rel: str, rule: _Rule) -> bool | None:
    """mkdir -p in the original tree, each directory owned like its parent, never through a symlink."""
    parts = rel.split("/")
    fd = m.open_exact(pristine, "")
    try:
        for name in parts:
            try:
                nxt = m.open_exact(fd, name)
            except FileNotFoundError:
                try:
                    os.mkdir(name, 0o755, dir_fd=fd)
                except OSError as e:
                    if e.errno in (errno.EROFS, errno.EACCES, errno.EPERM):
                        return None
                    raise FileRulesError(rule.index, f"cannot create {rule.path}: {e.strerror}") from None
                nxt = m.open_exact(fd, name, os.O_RDONLY | os.O_DIRECTORY)
                parent = os.fstat(fd)
                os.fchown(nxt, parent.st_uid, parent.st_gid)
                os.fchmod(nxt, 0o755)
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise FileRulesError(rule.index, f"{rule.path} goes through a symlink: name the real path") from None
                raise
            os.close(fd)
            fd = nxt
        return True
    finally:
        os.close(fd)


def _build(node: _Node, pristine: int, made: list[int]) -> int:
    """The detached tree for `node` with its children mounted inside: an fd."""
    rule, rel = node.rule, node.rule.path.lstrip("/")
    if rule.access == "none":
        tree = _cover(node, made)
    else:
        tree = m.clone_tree(pristine, rel)
        made.append(tree)
        if rule.access == "read":  # write: the original's own flags (a parent rule's are not on the copy)
            m.set_attrs(tree, m.MOUNT_ATTR_RDONLY)
    for child in node.children:
        sub = _build(child, pristine, made)
        target = m.open_exact(tree, posixpath.relpath(child.rule.path, rule.path))
        try:
            if rule.access != "none":  # in a cover, the place is our skeleton's
                child.check(target)
            if child.rule.access != "none":  # a copy of the original place, not a cover
                child.check(sub)
            m.attach(sub, target)
        finally:
            os.close(target)
    return tree


def _cover(node: _Node, made: list[int]) -> int:
    """An empty, read-only, host-root-owned tmpfs directory (mode 000) or file (mode 000) for a none
    rule. Nested rules need their path inside: those directories get mode 0111 (search, no listing),
    their last component the type of the original (covered in turn by the nested mount)."""
    skeleton: list[tuple[str, bool]] = []
    for child in node.children:
        rel = posixpath.relpath(child.rule.path, node.rule.path)
        parts = rel.split("/")
        for k in range(1, len(parts)):
            skeleton.append(("/".join(parts[:k]), True))
        skeleton.append((rel, child.is_dir))
    fs = m.new_tmpfs({"mode": "0111" if skeleton else "0", "size": "64k", "nr_inodes": str(len(skeleton) + 4),
                      "uid": "0", "gid": "0"}, 0)
    made.append(fs)
    top = m.open_exact(fs, "")
    try:
        entry = "c"
        if node.is_dir:
            os.mkdir(entry, 0, dir_fd=top)
            _chmod_at(top, entry, 0o111 if skeleton else 0)
        else:
            os.close(os.open(entry, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0, dir_fd=top))
        for rel, is_dir in skeleton:
            path = f"{entry}/{rel}"
            try:
                if is_dir:
                    os.mkdir(path, 0o111, dir_fd=top)
                    _chmod_at(top, path, 0o111)
                else:
                    os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0, dir_fd=top))
            except FileExistsError:
                pass
        tree = m.clone_tree(top, entry, recursive=False)
    finally:
        os.close(top)
    made.append(tree)
    m.set_attrs(tree, _COVER_ATTRS, recursive=False)
    return tree


def _chmod_at(dir_fd: int, rel: str, mode: int) -> None:
    fd = m.open_exact(dir_fd, rel, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fchmod(fd, mode)  # mkdir's mode went through the umask
    finally:
        os.close(fd)


def _switch(roots: dict[str, _Node], trees: dict[str, int], old: dict[str, _Root], applied: Applied,
            proc_fd: int) -> None:
    """Attach the new trees, then detach the old ones (see the module's docstring). `old` (the previous
    Applied's roots) is emptied on success; after a failure it holds what still is in place."""
    live = m.open_exact(m.AT_FDCWD, "/")
    attached: list[_Root] = []  # roots given a new tree in this call
    swapped: list[_Root] = []  # of those, the ones whose old top is still to be detached
    try:
        for path, node in roots.items():
            signature = node.signature(path)
            same = old.get(path)
            if same is not None and same.signature == signature:
                applied.roots[path] = old.pop(path)  # unchanged: keep its mounts
                continue
            if same is not None:  # beneath the old top: shows once that one is detached
                m.attach(trees[path], same.fds[-1], beneath=True)
                same.fds.insert(len(same.fds) - 1, trees[path])
                root = applied.roots[path] = old.pop(path)
                attached.append(root)
                swapped.append(root)
                root.signature, root.old_signature = signature, same.signature
                continue
            outer = next((r for p, r in old.items() if path.startswith(p + "/")), None)
            if outer is not None:  # inside rules that go away: on the original place beneath them
                under = m.open_exact(outer.under_fd, posixpath.relpath(path, outer.path))
            else:
                under = m.open_exact(live, path.lstrip("/"))
            try:
                node.check(under)
                if node.rule.access != "none":
                    node.check(trees[path])
                m.attach(trees[path], under)
            except BaseException:
                os.close(under)
                raise
            root = applied.roots[path] = _Root(path, signature, [trees[path]], under)
            attached.append(root)
    except BaseException as e:
        _undo(attached, swapped, old, applied, proc_fd)
        if isinstance(e, OSError):
            raise FileRulesError(None, f"the kernel refused a mount ({e}); the previous rules stay") from e
        raise
    finally:
        os.close(live)
    failures = []
    for root in swapped:  # the old top of a swapped stack
        try:
            m.umount_fd(proc_fd, root.fds[-1])
            _close(root.fds.pop())
        except OSError as e:
            failures.append(f"{root.path}: {e}")
            root.signature = root.old_signature
    for path, root in list(old.items()):  # rules that went away
        try:
            _detach_stack(root, proc_fd)
            _close(root.under_fd)
            del old[path]
        except OSError as e:
            failures.append(f"{path}: {e}")
            applied.roots[path + "\0old"] = old.pop(path)  # still there: the next update or clear removes it
    if failures:
        raise FileRulesApplyError(f"could not remove earlier rule mounts ({'; '.join(failures)})", applied)


def _undo(attached: list[_Root], swapped: list[_Root], old: dict[str, _Root], applied: Applied,
          proc_fd: int) -> None:
    """After a failed attach: the old rules stay. A new tree that sits alone is detached; one beneath an
    old top stays there, invisible, in the old root's stack (detached with it later)."""
    for root in attached:
        if root in swapped:
            root.signature = root.old_signature
        else:
            try:
                m.umount_fd(proc_fd, root.fds[0])
            except OSError:
                pass
            _close(root.under_fd)
            del applied.roots[root.path]
            root.fds.clear()
    old.update(applied.roots)  # unchanged and swapped ones: back with the previous rules
    applied.roots.clear()


def _close(fd: int) -> None:
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
