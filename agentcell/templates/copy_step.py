"""A COPY step as a new layer, made on the host without a sandbox: Docker's COPY semantics over the
files the SDK uploaded.

The upload is a tar (maybe gzipped) of the build context's files that match the step's source, under
their paths relative to the context (e2b/template/utils.py tar_file_stream). Two stages:

1. the archive is unpacked into a private staging directory by unpack.py's extractor (directory fds,
   O_NOFOLLOW, no absolute names, no `..`, bounded bytes, entries and headers); devices, whiteout
   names and foreign owners are refused or ignored: every copied file belongs to the step's user;
2. the entries the source pattern matches (glob per path component, `*` never crosses a `/`) are moved
   into the new layer's tree at the destination, Docker's way: a directory's contents go into the
   destination; a file goes to `dest/NAME` when the destination ends in `/`, is an existing directory or
   gets several sources, else to `dest` itself. The destination is resolved in the root so far
   (rootview.py: /bin -> usr/bin is followed, inside the root), and every directory the layer must hold
   on the way repeats the mode and owner of the one beneath (an overlay upper directory's metadata is
   what the sandbox sees); new ones belong to the step's user.

Owners are stored shifted (unpack.ID_BASE + the image id), as the importer stores them.
"""

from __future__ import annotations

import fnmatch
import os
import stat
import tarfile
from dataclasses import dataclass

from agentcell.errors import InvalidArgumentError
from agentcell.templates import unpack
from agentcell.templates.rootview import RootView

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass
class CopyResult:
    files: int = 0
    bytes: int = 0


class _UploadExtractor(unpack._Extractor):
    """unpack.py's extractor for an upload: the uploader's ids do not matter (owner set later), and names
    that overlayfs would read as whiteouts, and device nodes, are refused."""

    def add(self, member: tarfile.TarInfo, tf: tarfile.TarFile) -> None:
        leaf = member.name.rstrip("/").rsplit("/", 1)[-1]
        if leaf.startswith(unpack.WHITEOUT):
            raise InvalidArgumentError(f"the upload holds {member.name!r}: names starting with '.wh.' cannot be "
                                       "copied into a template (overlayfs reads them as deletions)")
        if member.ischr() or member.isblk():
            raise InvalidArgumentError(f"the upload holds the device node {member.name!r}: refused")
        member.uid = member.gid = 0
        super().add(member, tf)


def unpack_upload(archive: str, dest_fd: int, *, max_bytes: int, max_entries: int) -> int:
    """Unpack the uploaded archive into the empty directory `dest_fd`; the bytes of its files."""
    with open(archive, "rb") as raw:
        gz = raw.read(2) == b"\x1f\x8b"
        raw.seek(0)
        import gzip
        import zlib

        stream = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
        counted = unpack._Counted(stream, max_bytes, "the uploaded files")  # type: ignore[arg-type]
        ex = _UploadExtractor(dest_fd, unpack.Unpacked("sha256:" + "0" * 64), max_bytes, max_entries)
        try:
            try:
                with tarfile.open(fileobj=counted, mode="r|", tarinfo=unpack._BoundedInfo) as tf:  # type: ignore[call-overload]
                    while (member := unpack._next(tf)) is not None:
                        ex.add(member, tf)
                        tf.members.clear()
                ex.finish()
            except (tarfile.TarError, EOFError, UnicodeError, OverflowError, ValueError, gzip.BadGzipFile,
                    zlib.error) as e:
                raise InvalidArgumentError(f"the uploaded files are not a valid tar archive: {e}") from None
        finally:
            ex.close()
    return ex.result.file_bytes


def _matches(staging: str, pattern: str) -> list[tuple[str, ...]]:
    """The staged entries `pattern` names, component by component (never through a symlink)."""
    parts = [p for p in pattern.split("/") if p not in ("", ".")]
    found: list[tuple[str, ...]] = [()]
    for i, part in enumerate(parts):
        nxt: list[tuple[str, ...]] = []
        for rel in found:
            here = os.path.join(staging, *rel)
            if not stat.S_ISDIR(os.lstat(here).st_mode):
                continue
            for name in sorted(os.listdir(here)):
                if fnmatch.fnmatchcase(name, part):  # a dotfile too, as Docker's COPY (Go's filepath.Match)
                    nxt.append((*rel, name))
        found = nxt
        if not found:
            raise InvalidArgumentError(f"COPY {pattern}: no uploaded file matches {'/'.join(parts[:i + 1])!r}")
    return found


class _Layer:
    """The new layer's tree: directories made along resolved paths, metadata copied from the root."""

    def __init__(self, tree: str, view: RootView, owner: tuple[int, int]) -> None:
        self.tree = tree
        self.view = view
        self.owner = owner

    def ensure_dir(self, canonical: str) -> str:
        """The layer's directory at the canonical path `canonical`, made with the metadata the root has
        for each component (or the step's owner and 0755 where the root has none)."""
        host = self.tree
        sofar = ""
        for part in [p for p in canonical.split("/") if p]:
            sofar += "/" + part
            host_next = os.path.join(host, part)
            try:
                st = os.lstat(host_next)
                if not stat.S_ISDIR(st.st_mode):
                    raise InvalidArgumentError(f"COPY: {sofar} is a file copied by this step, not a directory")
            except FileNotFoundError:
                below = self.view.lookup(sofar)
                os.mkdir(host_next, 0o700)
                if below is not None and stat.S_ISDIR(below.st.st_mode):
                    os.chown(host_next, below.st.st_uid, below.st.st_gid, follow_symlinks=False)
                    os.chmod(host_next, stat.S_IMODE(below.st.st_mode), follow_symlinks=False)
                else:
                    os.chown(host_next, unpack.ID_BASE + self.owner[0], unpack.ID_BASE + self.owner[1])
                    os.chmod(host_next, 0o755)
            host = host_next
        return host


def copy_layer(view: RootView, tree: str, staging: str, source: str, dest: str, workdir: str,
               owner: tuple[int, int], mode: int | None) -> CopyResult:
    """Move what `source` matches in `staging` into the layer `tree` at `dest` (relative to `workdir`)."""
    if not dest.startswith("/"):
        dest = os.path.join(workdir or "/", dest)
    matches = _matches(staging, source)
    to_dir = dest.endswith("/") or len(matches) > 1 or any(
        stat.S_ISDIR(os.lstat(os.path.join(staging, *m)).st_mode) for m in matches)
    canonical, entry = view.resolve(dest)
    if entry is not None and stat.S_ISDIR(entry.st.st_mode):
        to_dir = True
    layer = _Layer(tree, view, owner)
    result = CopyResult()
    for rel in matches:
        src = os.path.join(staging, *rel)
        st = os.lstat(src)
        if stat.S_ISDIR(st.st_mode):
            target_dir = layer.ensure_dir(canonical)
            _merge_dir(src, target_dir, owner, mode, result)
            continue
        if to_dir:
            target_dir, leaf = layer.ensure_dir(canonical), rel[-1]
        else:
            parent, _ = view.resolve(os.path.dirname(canonical) or "/")
            target_dir, leaf = layer.ensure_dir(parent), os.path.basename(canonical)
        _place(src, target_dir, leaf, owner, mode, result)
    return result


def _merge_dir(src: str, target: str, owner: tuple[int, int], mode: int | None, result: CopyResult) -> None:
    for name in sorted(os.listdir(src)):
        s = os.path.join(src, name)
        if stat.S_ISDIR(os.lstat(s).st_mode):
            t = os.path.join(target, name)
            try:
                st = os.lstat(t)
                if not stat.S_ISDIR(st.st_mode):
                    os.unlink(t)
                    raise FileNotFoundError
            except FileNotFoundError:
                os.mkdir(t, 0o700)
            _own(t, owner, mode if mode is not None else stat.S_IMODE(os.lstat(s).st_mode))
            _merge_dir(s, t, owner, mode, result)
        else:
            _place(s, target, name, owner, mode, result)


def _place(src: str, target_dir: str, leaf: str, owner: tuple[int, int], mode: int | None,
           result: CopyResult) -> None:
    dst = os.path.join(target_dir, leaf)
    try:
        st = os.lstat(dst)
        if stat.S_ISDIR(st.st_mode):
            raise InvalidArgumentError(f"COPY: {leaf} would replace a directory this step copied")
        os.unlink(dst)
    except FileNotFoundError:
        pass
    os.rename(src, dst)  # the same filesystem (the store's tmp/): the staged file itself
    st = os.lstat(dst)
    result.files += 1
    if stat.S_ISREG(st.st_mode):
        result.bytes += st.st_size
    _own(dst, owner, mode if mode is not None and not stat.S_ISLNK(st.st_mode) else None)


def _own(path: str, owner: tuple[int, int], mode: int | None) -> None:
    os.chown(path, unpack.ID_BASE + owner[0], unpack.ID_BASE + owner[1], follow_symlinks=False)
    if mode is not None:
        os.chmod(path, mode & 0o7777, follow_symlinks=False)
