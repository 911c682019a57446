"""The sandbox's Python runtime at neutral paths, so that nothing in a sandbox names a host path.

Binding the host's Python prefixes and the agentcell checkout into each sandbox would show where
they live on the host, in /proc/self/mountinfo (both the mount point and the mount's root inside its
filesystem), in every ``__file__``, ``sys.path`` entry, traceback and ``/proc/self/maps`` line, and
in file contents (pyvenv.cfg, script shebangs, editable-install finders, .pyc files, ELF RUNPATHs).
Instead the server keeps a *runtime store* and every zygote and sandbox sees it at fixed paths:

  /opt/agentcell/python         the interpreter and its standard library (``sys.base_prefix``),
                                unless it lives under /usr (bound into every sandbox as it is)
  /opt/agentcell/venv           the virtualenv (``sys.prefix``), if the server runs from one
  /opt/agentcell/lib/agentcell  the agentcell package alone, not the repository around it

Each of these *parts* is built once into <store>/<part>-<key>/ (``--runtime-store``, default
/var/lib/agentcell/runtime: root's, 0700 above the parts; one store per host, shared by every server and
every venv). Its files are hard links to the store's *objects* (store_objects.py), stored once by
content: a file whose content can stay is the host's own file (linked, not copied), one that names a host
path is a rewritten copy: text files get the neutral path instead, .pyc files get their code objects'
file names and constants rewritten (their headers made to match the sources as placed, so they stay
valid), and binaries are patched in place without moving a byte (see _Rewriter.binary: ELF RUNPATHs
become the neutral path, padded with slashes). The package is copied, and compiled for its neutral path.
So two venvs of the same packages share every file that is equal once the host path is neutral (a
second 1.9 GB venv adds ~13 MB of files and its directories).

The key hashes the layout and the *content* of what goes in (names, modes, sha256 digests, link
targets): a venv made again with the same packages finds its part. Digests come from a cache keyed by
(device, inode, size, mtime) so an unchanged file is never read twice, and a cheaper *stat key* (the
file list with sizes, mtimes and inodes) leads straight to the part, so an unchanged start reads no
file and loads no cache (~0.5 s for a 70,000-file venv). A start that must look further checks and
builds in a process of its own (store_build_process.py: the cache and the build's memory never enter
the server's heap). A new part is hashed while it is built (each file read once). A server holds a
shared lock on each part it uses; parts no server holds are removed when unused for a day or, least
recently used first, while the store is over its budget
(``--runtime-store-max-gb``; store_collect.py), then the objects no part names. Every wait of a second
or more says how far it is (server/progress.py).

The zygote runs from the neutral paths too (``launch``): its launcher takes a private mount
namespace, puts the parts on /opt/agentcell (a tmpfs over /opt, in that namespace only) and execs
the interpreter from there, so the zygote's memory, and every sandbox forked from it, never held a
host path. The launcher also gives it an empty network namespace and a UTS namespace named
"agentcell", so no host interface address or host name can be cached in it either.
"""

from __future__ import annotations

import contextlib
import fcntl
import fnmatch
import functools
import glob
import hashlib
import importlib.util
import json
import marshal
import os
import py_compile
import re
import shutil
import stat
import struct
import subprocess
import sys
import sysconfig
import threading
import time
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import agentcell
from agentcell.backends.linux import store_build_process, store_collect, store_objects, store_workers
from agentcell.backends.linux import syscalls as sc
from agentcell.backends.linux.store_objects import HashCache, Objects
from agentcell.errors import BackendUnavailableError
from agentcell.runtime import statedir
from agentcell.server import progress

NEUTRAL_ROOT = "/opt/agentcell"
# The host's /usr again, for what the runtime loads or runs later in a sandbox whose root is an image's
# (image_root.py); the zygote's loader searches its library directory first (launch()).
SYSTEM_USR = f"{NEUTRAL_ROOT}/system/usr"
SYSTEM_LIBS = f"{SYSTEM_USR}/lib/{sysconfig.get_config_var('MULTIARCH') or os.uname().machine + '-linux-gnu'}"
STORE_DIR = "/var/lib/agentcell/runtime"  # store_dir(): AGENTCELL_RUNTIME_STORE overrides it
ZYGOTE_HOSTNAME = "agentcell"
FORMAT = 2  # bump whenever the layout or a rewriting rule changes: every part is rebuilt
KEEP_UNUSED_S = store_collect.KEEP_UNUSED_S  # an unheld part is removed at a start this long after its last use
_SYSTEM = ("/usr",)  # bound into every sandbox at its own path: nothing there needs hiding
_VERSION = f"python{sys.version_info.major}.{sys.version_info.minor}"
_ZYGOTE_MODULE = "agentcell.backends.linux.zygote"
_LAUNCH_MODULE = "agentcell.backends.linux.runtime_store"
_DROPPED_FILES = ("__editable__*", "direct_url.json", "*.egg-link")  # name the host checkouts they point to


# The JS contexts' node_modules (runtime/js, kernel_node.py): of TypeScript only typescript.js runs
# (transpileModule); its compiler CLI, language server, type declarations and translations (~14 MB) stay out.
_TS_LIB = "runtime/js/node_modules/typescript/lib/"
_JS_UNUSED = tuple(_TS_LIB + p for p in ("*.d.ts", "_*.js", "tsc.js", "tsserver*.js", "typingsInstaller.js",
                                         "watchGuard.js", "*/diagnosticMessages.generated.json"))

# marshal's string types (Python/marshal.c): a 4-byte length (unicode, ascii, interned ascii, interned)
# or a 1-byte one (short ascii, interned short ascii); the top bit of the type byte flags a reference
_MARSHAL_STR4 = frozenset(b"uaAt")
_MARSHAL_STR1 = frozenset(b"zZ")

_DROPPED_RX = re.compile("|".join(fnmatch.translate(p) for p in _DROPPED_FILES))


@functools.cache
def _glob_rx(patterns: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile("|".join(fnmatch.translate(p) for p in patterns))


class RuntimeStoreError(BackendUnavailableError):
    """The runtime store cannot be built or used."""


def _under(path: str, roots: tuple[str, ...] | list[str]) -> bool:
    return any(path == r or path.startswith(r.rstrip("/") + "/") for r in roots)


@dataclass(frozen=True)
class Part:
    name: str  # python | venv | agentcell
    source: str  # the host directory (real path)
    target: str  # where the zygote and every sandbox see it
    copy: bool = False  # copy instead of hard-linking (the checkout: later edits must not leak in)
    drop_dirs: frozenset[str] = frozenset()  # relative paths left out
    drop_files: tuple[str, ...] = ()  # fnmatch patterns on relative paths
    bin_keep: tuple[str, ...] | None = None  # keep only bin/ entries starting with one of these

    def keeps(self, rel: str, name: str) -> bool:
        if rel in self.drop_dirs or _DROPPED_RX.match(name) or (self.drop_files and _glob_rx(self.drop_files).match(rel)):
            return False
        if self.bin_keep is not None and rel.startswith("bin/") and "/" not in rel[4:]:
            return name.startswith(self.bin_keep)
        return not (self.copy and name == "__pycache__")


@dataclass(frozen=True)
class Layout:
    parts: tuple[Part, ...]
    executable: str  # the interpreter, at its neutral path
    pythonpath: str  # the directory holding the agentcell package, neutral
    mapping: tuple[tuple[str, str], ...]  # host path -> neutral path, longest first
    pth: tuple[str, str] | None  # (part, site-packages dir in it): gets a .pth naming `pythonpath`


def _venv_config(prefix: str) -> dict[str, str]:
    conf: dict[str, str] = {}
    with contextlib.suppress(OSError), open(os.path.join(prefix, "pyvenv.cfg")) as f:
        for line in f:
            key, sep, value = line.partition("=")
            if sep:
                conf[key.strip()] = value.strip()
    return conf


def plan() -> Layout:
    """The layout for the interpreter and agentcell package this process runs from."""
    pkg_abs = os.path.dirname(os.path.abspath(agentcell.__file__))
    pkg = os.path.realpath(pkg_abs)
    base, prefix = os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)
    venv = prefix != base
    system_site = not venv or _venv_config(prefix).get("include-system-site-packages", "false").lower() == "true"
    site = f"lib/{_VERSION}/site-packages"
    parts: list[Part] = []
    pth: tuple[str, str] | None = None
    if not _under(base, _SYSTEM):
        drop = {f"lib/{_VERSION}/test"}  # the standard library's own test suite: 120 MB nobody imports
        if not system_site:
            drop.add(site)  # the venv does not see the base's packages
        parts.append(Part(
            "python", base, f"{NEUTRAL_ROOT}/python", drop_dirs=frozenset(drop),
            drop_files=(f"lib/{_VERSION}/config-*/*.a",),  # the static libpython, for embedding only
            # without the base's packages their console scripts are dead; keep the interpreter's own
            bin_keep=None if system_site else ("python", "pydoc", "2to3", "idle"),
        ))
        if not venv:
            pth = ("python", site)
    if venv and not _under(prefix, _SYSTEM):
        parts.append(Part("venv", prefix, f"{NEUTRAL_ROOT}/venv"))
        pth = ("venv", site)
    parts.append(Part("agentcell", pkg, f"{NEUTRAL_ROOT}/lib/agentcell", copy=True, drop_files=_JS_UNUSED))
    # each part by its real path and by the paths this process was given (they differ by symlinks,
    # pyenv's "3.11" alias, say, which the venv's pyvenv.cfg may name)
    given = {"python": [sys.base_prefix], "venv": [sys.prefix], "agentcell": [pkg_abs]}
    if venv:
        given["python"] += [os.path.dirname(_venv_config(prefix).get("home", "/"))]
    mapping: dict[str, str] = {}
    for part in parts:
        mapping[part.source] = part.target
        for path in given[part.name]:
            path = os.path.abspath(path)
            if os.path.realpath(path) == part.source and not _under(path, _SYSTEM):
                mapping.setdefault(path, part.target)
    # the checkout around the package (named by editable installs, say), unless a part holds it
    checkout = os.path.dirname(pkg)
    if not _under(checkout, _SYSTEM) and not any(_under(checkout, [p.source]) for p in parts):
        mapping.setdefault(checkout, f"{NEUTRAL_ROOT}/lib")
    ordered = tuple(sorted(mapping.items(), key=lambda kv: len(kv[0]), reverse=True))
    executable = _map_path(os.path.abspath(sys.executable), ordered)
    return Layout(tuple(parts), executable, f"{NEUTRAL_ROOT}/lib", ordered, pth)


def _map_path(path: str, mapping: tuple[tuple[str, str], ...]) -> str:
    for host, neutral in mapping:
        if _under(path, [host]):
            return neutral + path[len(host):]
    return path


# -- rewriting ------------------------------------------------------------------------------------


class _Rewriter:
    """Replaces host paths by neutral ones in text, binaries and code objects."""

    def __init__(self, mapping: tuple[tuple[str, str], ...]) -> None:
        self.pairs = [(h.encode(), n.encode()) for h, n in mapping]
        self.table = dict(self.pairs)
        # a whole path: the host prefix, then anything but more of a file name
        self.rx = re.compile(b"(?:" + b"|".join(re.escape(h) for h, _ in self.pairs) + rb")(?![\w.+-])")
        self.unfit = 0  # host paths in binaries shorter than their neutral path (left as they are)

    def maybe(self, data: bytes) -> bool:
        """Does `data` name a host path? (One regex scan: faster than a substring search per path.)"""
        return self.rx.search(data) is not None

    def names(self, data: bytes) -> bool:
        return self.rx.search(data) is not None

    def _sub(self, m: re.Match[bytes]) -> bytes:
        return self.table[m.group()]

    def text(self, data: bytes) -> bytes:
        return self.rx.sub(self._sub, data)

    def string(self, s: str) -> str:
        if "/" not in s or not self.maybe(s.encode("utf-8", "surrogateescape")):  # (most constants: no "/")
            return s
        return self.text(s.encode("utf-8", "surrogateescape")).decode("utf-8", "surrogateescape")

    def binary(self, data: bytes) -> bytes:
        """Rewrite host paths in a binary without moving a byte.

        Linkers merge a string constant into the tail of a longer one ("3.11.7" is the tail of
        libpython's ".../versions/3.11.7") and code refers to it by address, so only the host path's
        own bytes change, and only where no other string can start inside them:
        * in the ELF dynamic string table (RUNPATH, RPATH), where every reference is known: the
          neutral path padded with slashes to the same length ("/opt/agentcell/python///////lib" is
          the same directory), unless some other name starts inside it;
        * anywhere else: all but the host path's last component, which stays where it was
          (".../versions/3.11.7" becomes "/opt/agentcell/python/3.11.7": no host path, and not used
          either: such strings are build-time fallbacks, like libpython's configured prefix).
        """
        out = bytearray(data)
        dynstr = _elf_dynstr(data)
        for m in self.rx.finditer(data):
            host, new = m.group(), self.table[m.group()]
            if dynstr is not None and dynstr[0] <= m.start() < dynstr[0] + dynstr[1] and len(new) <= len(host):
                inside = range(m.start() - dynstr[0] + 1, m.end() - dynstr[0])
                if dynstr[2] is not None and not any(r in inside for r in dynstr[2]):
                    out[m.start():m.end()] = new.ljust(len(host), b"/")
                    continue
            head = host.rindex(b"/") + 1
            if len(new) + 1 > head:
                self.unfit += 1  # the neutral path has no spelling this short
                continue
            out[m.start():m.start() + head] = (new + b"/").ljust(head, b"/")
        return bytes(out)

    def code(self, code: types.CodeType) -> types.CodeType:
        return code.replace(co_filename=self.string(code.co_filename),
                            co_consts=tuple(self._const(c) for c in code.co_consts))

    def _const(self, c: Any) -> Any:
        if isinstance(c, types.CodeType):
            return self.code(c)
        if isinstance(c, str):
            return self.string(c)
        if isinstance(c, bytes):
            return self.text(c) if self.maybe(c) else c
        if isinstance(c, tuple):
            return tuple(self._const(x) for x in c)
        if isinstance(c, frozenset):
            return frozenset(self._const(x) for x in c)
        return c

    def pyc_body(self, body: bytes, target: str, py_rel: str) -> bytes | None:
        """A .pyc's marshalled code with host paths rewritten; None if one would stay."""
        fast = self._pyc_filename(body, target, py_rel)
        if fast is not None:
            return fast
        try:
            new = marshal.dumps(self.code(marshal.loads(body)))
        except (ValueError, EOFError, TypeError):
            return None
        return None if self.names(new) else new

    def _pyc_filename(self, body: bytes, target: str, py_rel: str) -> bytes | None:
        """Fast (no unmarshalling): when the only host path is the code's file name, the source's host
        path (marshal stores it once and refers back to it), that string is patched in the bytes, its
        length with it. None when it is not so."""
        hits = list(self.rx.finditer(body))
        if len(hits) != 1:
            return None
        m = hits[0]
        host, pos = m.group(), m.start()
        if self.table[host] != target.encode():
            return None
        rel = py_rel.encode("utf-8", "surrogateescape")
        want, new = host + b"/" + rel, target.encode() + b"/" + rel
        if body[pos:pos + len(want)] != want:
            return None
        end = pos + len(want)
        if pos >= 5 and body[pos - 5] & 0x7F in _MARSHAL_STR4 and int.from_bytes(body[pos - 4:pos], "little") == len(want):
            return body[:pos - 4] + len(new).to_bytes(4, "little") + new + body[end:]
        if pos >= 2 and body[pos - 2] & 0x7F in _MARSHAL_STR1 and body[pos - 1] == len(want) and len(new) < 256:
            return body[:pos - 1] + bytes([len(new)]) + new + body[end:]
        return None

    def pth(self, data: bytes) -> bytes:
        """A .pth file: host paths mapped; absolute paths the sandbox does not have dropped."""
        keep = []
        for line in self.text(data).splitlines(keepends=True):
            path = line.strip().decode("utf-8", "surrogateescape")
            if path.startswith("/") and not _under(path, [NEUTRAL_ROOT, *_SYSTEM]):
                continue
            keep.append(line)
        return b"".join(keep)


def _elf_dynstr(data: bytes) -> tuple[int, int, set[int] | None] | None:
    """The dynamic string table of a 64-bit little-endian ELF file: (file offset, size, the offsets
    into it that something refers to, or None if the section headers are gone)."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return None
    try:
        phoff, shoff = struct.unpack_from("<QQ", data, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", data, 0x36)
        loads, dyn = [], None
        for i in range(phnum):
            p_type, _fl, p_offset, p_vaddr, _pa, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
            if p_type == 1:  # PT_LOAD
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == 2:  # PT_DYNAMIC
                dyn = (p_offset, p_filesz)
        if dyn is None:
            return None
        tags: dict[int, int] = {}
        refs: set[int] = set()
        for j in range(dyn[1] // 16):
            tag, val = struct.unpack_from("<qQ", data, dyn[0] + 16 * j)
            if tag == 0:
                break
            tags.setdefault(tag, val)
            if tag in (1, 14, 15, 29, 0x7FFFFFFD, 0x7FFFFFFF):  # NEEDED SONAME RPATH RUNPATH AUXILIARY FILTER
                refs.add(val)
        strtab, strsz = tags.get(5), tags.get(10, 0)  # DT_STRTAB (an address), DT_STRSZ
        start = next((strtab - v + o for v, o, n in loads if strtab is not None and v <= strtab < v + n), None)
        if start is None:
            return None
        if not shnum:
            return start, strsz, None
        for k in range(shnum):
            sh_type, = struct.unpack_from("<I", data, shoff + k * shentsize + 4)
            sh_offset, sh_size = struct.unpack_from("<QQ", data, shoff + k * shentsize + 0x18)
            if sh_type == 11:  # SHT_DYNSYM: st_name of each symbol
                refs.update(struct.unpack_from("<I", data, sh_offset + e)[0] for e in range(0, sh_size, 24))
            elif sh_type == 0x6FFFFFFE:  # SHT_GNU_verneed: file names and version names
                refs.update(_version_names(data, sh_offset, need=True))
            elif sh_type == 0x6FFFFFFD:  # SHT_GNU_verdef
                refs.update(_version_names(data, sh_offset, need=False))
        return start, strsz, refs
    except (struct.error, ValueError):
        return None


def _version_names(data: bytes, offset: int, need: bool) -> Iterator[int]:
    while True:
        if need:  # Elf64_Verneed: version, count, file, aux, next; Elf64_Vernaux: hash, flags, other, name, next
            _v, count, file, aux, nxt = struct.unpack_from("<HHIII", data, offset)
            yield file
            a = offset + aux
            for _ in range(count):
                _h, _f, _o, name, anext = struct.unpack_from("<IHHII", data, a)
                yield name
                a += anext
        else:  # Elf64_Verdef: version, flags, ndx, count, hash, aux, next; Elf64_Verdaux: name, next
            _v, _f, _n, count, _h, aux, nxt = struct.unpack_from("<HHHHIII", data, offset)
            a = offset + aux
            for _ in range(count):
                name, anext = struct.unpack_from("<II", data, a)
                yield name
                a += anext
        if not nxt:
            return
        offset += nxt


# -- building -------------------------------------------------------------------------------------


@dataclass
class _Stats:
    files: int = 0
    rewritten: int = 0
    dropped_pyc: int = 0
    # placed .py files (their path in the part) -> (the host file's mtime and size, the placed file's
    # mtime and size, its content if rewritten): what a .pyc header must say to stay valid for it
    sources: dict[str, tuple[int, int, int, int, bytes | None]] = field(default_factory=dict)


def _key(part: Part, layout: Layout, hashes: HashCache, step: progress.Step | None = None,
         entries: list[tuple[str, os.stat_result, str]] | None = None) -> str:
    """The part's key: its layout and the content of what goes in (names, modes, digests, link
    targets). Digests come from the hash cache: an unchanged file is not read again."""
    h = hashlib.sha256()
    h.update(json.dumps([FORMAT, sys.version, importlib.util.MAGIC_NUMBER.hex(), part.__dict__ | {
        "drop_dirs": sorted(part.drop_dirs)}, layout.mapping, layout.pth]).encode())
    for rel, st, link in entries if entries is not None else _walk(part):
        digest = hashes.digest(os.path.join(part.source, rel), st).hex() if stat.S_ISREG(st.st_mode) else ""
        h.update(f"{rel}\0{st.st_mode}\0{digest}\0{link}\n".encode("utf-8", "surrogateescape"))
        if step is not None:
            step.advance()
    return h.hexdigest()[:16]


def _stat_key(part: Part, layout: Layout, entries: list[tuple[str, os.stat_result, str]]) -> str:
    """A cheap key (names, modes, sizes, mtimes, inodes: one stat each, nothing read) that leads to the
    content key through the store's keys/ directory, so an unchanged start needs no hash cache."""
    h = hashlib.sha256()
    h.update(json.dumps([FORMAT, sys.version, part.__dict__ | {"drop_dirs": sorted(part.drop_dirs)},
                         layout.mapping, layout.pth]).encode())
    for rel, st, link in entries:
        h.update(f"{rel}\0{st.st_mode}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\0{link}\n".encode(
            "utf-8", "surrogateescape"))
    return h.hexdigest()[:32]


def _walk(part: Part) -> Iterator[tuple[str, os.stat_result, str]]:
    """(relative path, lstat, symlink target) of everything the part keeps; a directory's files
    before its subdirectories (a .py before its __pycache__)."""
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(os.path.join(part.source, rel_dir)) as it:
            entries = sorted(it, key=lambda e: e.name)
        subdirs = []
        for e in entries:
            rel = f"{rel_dir}/{e.name}" if rel_dir else e.name
            if not part.keeps(rel, e.name):
                continue
            st = e.stat(follow_symlinks=False)
            link = os.readlink(e.path) if e.is_symlink() else ""
            yield rel, st, link
            if e.is_dir(follow_symlinks=False):
                subdirs.append(rel)
        stack.extend(reversed(subdirs))


def _pyc_header(header: bytes, source: tuple[int, int, int, int, bytes | None] | None) -> bytes:
    """A .pyc header valid for its placed source if it was valid for the host's (a timestamp pyc: the
    placed file's mtime and size, which differ when the source's object came from another tree)."""
    if source is None:
        return header
    host_mtime, host_size, mtime, size, rewritten = source
    flags = int.from_bytes(header[4:8], "little")
    if flags == 0:  # timestamp-based: mtime, then the source's size
        valid = header[8:16] == ((host_mtime // 10**9) & 0xFFFFFFFF).to_bytes(4, "little") + (
            host_size & 0xFFFFFFFF).to_bytes(4, "little")
        if not valid:
            return header  # stale already: Python compiles the source instead, as it would on the host
        return header[:8] + ((mtime // 10**9) & 0xFFFFFFFF).to_bytes(4, "little") + (size & 0xFFFFFFFF).to_bytes(4, "little")
    if flags & 0b10 and rewritten is not None:  # checked hash-based
        return header[:8] + importlib.util.source_hash(rewritten)
    return header


def _pyc_source(dst: str, name: str, stats: _Stats) -> tuple[int, int, int, int, bytes | None] | None:
    module = name.split(".", 1)[0]
    return stats.sources.get(os.path.join(os.path.dirname(os.path.dirname(dst)), module + ".py"))


def _place_file(src: str, dst: str, rel: str, st: os.stat_result, part: Part, rw: _Rewriter,
                objects: Objects, stats: _Stats) -> None:
    name = os.path.basename(rel)
    with open(src, "rb") as f:
        data = f.read()
    if name.endswith(".pyc"):
        if data[:4] != importlib.util.MAGIC_NUMBER:
            return  # another Python version's: never loaded
        header = _pyc_header(data[:16], _pyc_source(dst, name, stats))
        body: bytes | None = memoryview(data)[16:].tobytes()
        if rw.maybe(body):
            py = rel[:rel.rfind("__pycache__/")] + name.split(".", 1)[0] + ".py"
            body = rw.pyc_body(body, part.target, py)
        if body is None:
            stats.dropped_pyc += 1  # a host path rewriting could not reach: Python compiles the source instead
            return
        new = header + body
    else:
        new = data
        if name.endswith(".pth"):
            new = rw.pth(data)
        elif rw.maybe(data):
            new = rw.binary(data) if b"\0" in data else rw.text(data)
    if new == data and not part.copy:
        objects.place_host_file(src, st, dst, data)
    else:
        objects.hashes.digest_data(st, data)  # the host file's digest, for the part's key (read once)
        objects.place_bytes(new, st, dst)
        stats.rewritten += 1
    stats.files += 1
    if name.endswith(".py"):
        placed = os.lstat(dst)
        stats.sources[dst] = (st.st_mtime_ns, st.st_size, placed.st_mtime_ns, placed.st_size,
                              new if new != data else None)


def _build(part: Part, layout: Layout, dest: str, objects: Objects, step: progress.Step | None = None,
           entries: list[tuple[str, os.stat_result, str]] | None = None) -> _Stats:
    rw = _Rewriter(layout.mapping)
    stats = _Stats()
    os.mkdir(dest, 0o755)
    files: list[tuple[str, os.stat_result]] = []
    for rel, st, link in entries if entries is not None else _walk(part):
        dst = os.path.join(dest, rel)
        if link:
            os.symlink(_map_path(link, layout.mapping) if link.startswith("/") else link, dst)
        elif stat.S_ISDIR(st.st_mode):
            os.mkdir(dst, 0o755)
            os.chmod(dst, st.st_mode & 0o755)
        elif stat.S_ISREG(st.st_mode):  # sockets, fifos, devices: left out
            files.append((rel, st))
            continue
        if step is not None:
            step.advance()
    store_workers.place_all(files, lambda rel, st: _place_file(
        os.path.join(part.source, rel), os.path.join(dest, rel), rel, st, part, rw, objects, stats), objects, stats, step)
    if part.copy:  # the package: compiled here, for the path it has in the sandbox
        for rel, _st, link in entries if entries is not None else list(_walk(part)):
            if rel.endswith(".py") and not link:
                path = os.path.join(dest, rel)
                cfile = importlib.util.cache_from_source(path)
                py_compile.compile(path, cfile=cfile, dfile=f"{part.target}/{rel}", doraise=True,
                                   invalidation_mode=py_compile.PycInvalidationMode.TIMESTAMP)
                objects.adopt(cfile)
    if layout.pth is not None and layout.pth[0] == part.name and os.path.isdir(os.path.join(dest, layout.pth[1])):
        # agentcell stays importable in the sandbox's Python (the editable install's finder is gone)
        with open(os.path.join(dest, layout.pth[1], "_agentcell_runtime.pth"), "w") as f:
            f.write(layout.pythonpath + "\n")
    if rw.unfit:
        print(f"agentcell: runtime store: {rw.unfit} host path(s) in binaries of {part.source} are shorter than "
              "their neutral path and stay as they are: sandboxes can read them there (and the interpreter "
              "may not find its libpython); a Python installed under a longer prefix avoids this",
              file=sys.stderr)
    return stats


# -- the store ------------------------------------------------------------------------------------


class Store:
    """The parts one server uses, held (shared locks) until close()."""

    def __init__(self, layout: Layout, mounts: list[tuple[str, str]], locks: list[int]) -> None:
        self.layout = layout
        self.mounts = mounts  # (store directory, neutral path)
        self._locks = locks

    def close(self) -> None:
        for fd in self._locks:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._locks = []

    def zygote_env(self) -> dict[str, str]:
        """What the zygote's environment must say (no host path in it, since every sandbox inherits
        its memory). PYTHONPATH is the launcher's: it sets the neutral one before the exec."""
        bin_dirs = [os.path.dirname(self.layout.executable), "/usr/local/bin", "/usr/bin", "/bin"]
        return {"PATH": ":".join(dict.fromkeys(bin_dirs)),
                "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.abspath(agentcell.__file__)))}

    def launcher_command(self) -> list[str]:
        """Starts the zygote, through the launcher (see launch())."""
        spec = {"mounts": self.mounts, "pythonpath": self.layout.pythonpath,
                "argv": [self.layout.executable, "-s", "-P", "-m", _ZYGOTE_MODULE]}
        return [sys.executable, "-s", "-P", "-m", _LAUNCH_MODULE, json.dumps(spec)]


def _hold(lock_path: str) -> int:
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_SH)
    os.utime(fd)  # the part's last use, for the garbage collection
    return fd


@contextlib.contextmanager
def _exclusive(path: str) -> Iterator[int]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield fd
    finally:
        os.close(fd)


def store_dir() -> str:
    """The store's directory: AGENTCELL_RUNTIME_STORE, else STORE_DIR (one per host: every server and
    every venv shares it, which is what makes a second venv cheap); a rootless server's is the user's own."""
    from agentcell import rootless

    return os.environ.get("AGENTCELL_RUNTIME_STORE") or (rootless.runtime_store_dir() if rootless.active() else STORE_DIR)


def max_bytes() -> int:
    """The store's size budget: AGENTCELL_RUNTIME_STORE_MAX_GB (serve --runtime-store-max-gb)."""
    raw = os.environ.get("AGENTCELL_RUNTIME_STORE_MAX_GB")
    try:
        return int(float(raw) * (1 << 30)) if raw else store_collect.DEFAULT_MAX_BYTES
    except ValueError:
        raise RuntimeStoreError(f"AGENTCELL_RUNTIME_STORE_MAX_GB={raw!r} is not a number of GB") from None


def ensure(layout: Layout | None = None, root: str | None = None, log: Callable[[str], None] | None = None,
           budget: int | None = None, collect: str = "background", stat_keys: dict[str, str] | None = None) -> Store:
    """Build what is missing of the runtime store and hold its parts. Raises RuntimeStoreError.

    Then parts no server holds are collected (store_collect.collect: by age, and beyond `budget`):
    collect="background" in a thread (off the server's start; it holds the build lock meanwhile) when
    this call built a part or the last collection is over COLLECT_EVERY_S old, "now" before
    returning, "never" not at all. `stat_keys`: the parts' stat keys (stat_keys()) taken just before,
    in another process (runtime_prefetch), so that this one need not walk the trees when nothing
    changed."""
    layout = layout or plan()
    root = root or store_dir()
    budget = max_bytes() if budget is None else budget
    log = log or (lambda msg: progress.log.info("%s", msg))
    try:
        statedir.private_dir(root)
        keys_dir = os.path.join(root, store_collect.KEYS)
        os.makedirs(keys_dir, mode=0o700, exist_ok=True)
        held = _held_unchanged(layout, root, keys_dir, stat_keys or {})  # the usual start: no lock to wait for
        built = held is None
        mounts, locks = held if held is not None else _check_and_build(layout, root, log)
        _write_key(_last_path(root, layout), json.dumps([[os.path.basename(d), t] for d, t in mounts]))
        keep = {os.path.basename(d) for d, _ in mounts}
        if collect == "now":
            with _exclusive(os.path.join(root, ".build.lock")):
                _collect(root, keep, budget, log)
        elif collect == "background" and (built or _collection_due(root)):
            # in a thread, off the start (it waits for the build lock there): a scan of every object
            threading.Thread(target=_collect_when_free, args=(root, keep, budget, log),
                             name="agentcell-store-collect", daemon=True).start()
    except statedir.UnsafeDirectoryError as e:
        raise RuntimeStoreError(str(e)) from None
    except OSError as e:
        raise RuntimeStoreError(f"cannot build the runtime store in {root}: {e}; it needs root and about "
                                "500 MB of disk for a first venv (hard links where it can)") from e
    return Store(layout, mounts, locks)


def stat_keys(layout: Layout) -> dict[str, str]:
    """Each part's stat key (a walk of its tree: one stat a file)."""
    return {part.name: _stat_key(part, layout, list(_walk(part))) for part in layout.parts}


def _held_unchanged(layout: Layout, root: str, keys_dir: str,
                    known: dict[str, str]) -> tuple[list[tuple[str, str]], list[int]] | None:
    """Every part found unchanged by its quick key (one stat a file) and held; None at the first
    part that is not: then _check_and_build() does it under the build lock.
    No lock is waited for here, so a start is not held up by another server's build or collection:
    a part the collector removes meanwhile is seen gone once held, and sends us the slow way."""
    mounts: list[tuple[str, str]] = []
    locks: list[int] = []
    try:
        for part in layout.parts:
            with progress.step(f"runtime store: checking {part.target} ({part.source})"):
                key = known.get(part.name)
                if key is None:
                    key = _stat_key(part, layout, list(_walk(part)))
                name = _read_key(os.path.join(keys_dir, f"{part.name}-{key}"))
            if name is None:
                raise LookupError(part.name)
            dest = os.path.join(root, name)
            locks.append(_hold(dest + ".lock"))
            if not os.path.isdir(dest):
                raise LookupError(name)
            mounts.append((dest, part.target))
    except (LookupError, OSError):
        for fd in locks:
            os.close(fd)
        return None
    return mounts, locks


def _check_and_build(layout: Layout, root: str, log: Callable[[str], None]) -> tuple[list[tuple[str, str]], list[int]]:
    """Under the build lock (one builder at a time, and no collector): each part found or built, in a
    process of its own (store_build_process.py: the hash cache and the build's memory stay out of the
    server's heap), handed the lock; then held here, before the lock is let go."""
    mounts: list[tuple[str, str]] = []
    locks: list[int] = []
    try:
        with _exclusive(os.path.join(root, ".build.lock")) as lock_fd:
            try:
                names = store_build_process.run(layout, root, lock_fd, log)
            except store_build_process.BuildRefused as e:
                raise RuntimeStoreError(str(e)) from None
            for part, name in zip(layout.parts, names, strict=True):
                dest = os.path.join(root, name)  # (no collector runs meanwhile: the build lock is ours)
                locks.append(_hold(dest + ".lock"))
                if not os.path.isdir(dest):
                    raise RuntimeStoreError(f"the runtime store's build named {dest}, which is not there")
                mounts.append((dest, part.target))
    except BaseException:
        for fd in locks:
            os.close(fd)
        raise
    return mounts, locks


def find_or_build(layout: Layout, root: str, log: Callable[[str], None]) -> list[str]:
    """Each part's directory name: found by its quick key, else by its content key from the hash cache,
    else built. In store_build_process's process, whose caller holds the build lock."""
    keys_dir = os.path.join(root, store_collect.KEYS)
    names: list[str] = []
    hashes: HashCache | None = None  # loaded only if a part changed (its file: ~1 s for a few venvs)
    objects: Objects | None = None
    for part in layout.parts:
        with progress.step(f"runtime store: checking {part.target} ({part.source})", unit="files") as s:
            entries = list(_walk(part))
            quick = os.path.join(keys_dir, f"{part.name}-{_stat_key(part, layout, entries)}")
            name = _read_key(quick)
            if name is not None and not os.path.isdir(os.path.join(root, name)):
                name = None
            if name is None:
                if hashes is None:
                    hashes = HashCache(os.path.join(root, store_objects.HASHES))
                    objects = Objects(root, hashes)
                if hashes.covers([st for _, st, _ in entries if stat.S_ISREG(st.st_mode)]):
                    name = f"{part.name}-{_key(part, layout, hashes, s, entries)}"  # nothing to read
        if name is None or not os.path.isdir(os.path.join(root, name)):
            # new content: built, and hashed on the way (each file read once), then keyed
            assert objects is not None and hashes is not None
            name = _build_part(part, layout, root, objects, log, entries)
        _write_key(quick, name)
        names.append(name)
    if hashes is not None:
        hashes.save()
    return names


COLLECT_EVERY_S = 3600  # a start that built nothing collects if the last collection is older than this
_COLLECTED = ".collected"  # its mtime: the last collection's end


def _collection_due(root: str) -> bool:
    try:
        return time.time() - os.stat(os.path.join(root, _COLLECTED)).st_mtime > COLLECT_EVERY_S
    except FileNotFoundError:
        return True


def _collect_when_free(root: str, keep: set[str], budget: int, log: Callable[[str], None]) -> None:
    try:
        with _exclusive(os.path.join(root, ".build.lock")) as lock_fd:
            _collect(root, keep, budget, log, apart_holding=lock_fd)
    except (OSError, subprocess.SubprocessError, ValueError) as e:
        log(f"runtime store: cleaning {root} failed: {e}")


def _last_path(root: str, layout: Layout) -> str:
    """Where ensure() notes the parts it found for this layout (last_store() reads it)."""
    h = hashlib.sha256(json.dumps([FORMAT, sys.version, [p.__dict__ | {"drop_dirs": sorted(p.drop_dirs)}
                                                         for p in layout.parts],
                                   layout.executable, layout.pythonpath, layout.mapping, layout.pth]).encode())
    return os.path.join(root, f".last-{h.hexdigest()[:32]}")


def last_store(layout: Layout | None = None, root: str | None = None) -> Store | None:
    """The parts the last ensure() of this layout found, held, without checking them against the
    host's files: what a zygote may start importing from while ensure() checks. The caller must use
    it only if ensure() then returns the same mounts. None if there is no such note, or a part is
    gone or being removed (the collector holds its lock: we do not wait for it)."""
    layout = layout or plan()
    root = root or store_dir()
    recorded = _read_key(_last_path(root, layout))
    if recorded is None:
        return None
    try:
        named = [(str(name), str(target)) for name, target in json.loads(recorded)]
    except (ValueError, TypeError):
        return None
    if [t for _, t in named] != [p.target for p in layout.parts]:
        return None
    mounts: list[tuple[str, str]] = []
    locks: list[int] = []
    try:
        for name, target in named:
            dest = os.path.join(root, name)
            fd = os.open(dest + ".lock", os.O_RDWR | os.O_CLOEXEC)
            locks.append(fd)
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)  # the collector renames a part away under LOCK_EX
            if not os.path.isdir(dest):
                raise FileNotFoundError(dest)
            mounts.append((dest, target))
    except OSError:
        for fd in locks:
            os.close(fd)
        return None
    return Store(layout, mounts, locks)


def _read_key(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _write_key(path: str, name: str) -> None:
    if _read_key(path) == name:
        return
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(name)
    os.replace(tmp, path)


def _build_part(part: Part, layout: Layout, root: str, objects: Objects, log: Callable[[str], None],
                entries: list[tuple[str, os.stat_result, str]]) -> str:
    """Build `part` (hashing its files as they are read), key it by its content; its name in the store.
    If a part of that content is there already (a venv made again, equal), the new build goes."""
    t0 = time.perf_counter()
    tmp = os.path.join(root, f"{part.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    new_before, written_before = objects.new_bytes, objects.written_bytes
    objects.take_used()
    with progress.step(f"runtime store: building {part.target} from {part.source}", total=len(entries),
                       unit="files") as s:
        stats = _build(part, layout, tmp, objects, s, entries)
    name = f"{part.name}-{_key(part, layout, objects.hashes, entries=entries)}"
    dest = os.path.join(root, name)
    if os.path.isdir(dest):
        shutil.rmtree(tmp, ignore_errors=True)
        return name
    with open(dest + store_collect.MANIFEST, "w") as f:  # before the part exists: collect() trusts it
        f.write("\n".join(sorted(objects.take_used())))
    os.rename(tmp, dest)
    log(f"runtime store: built {part.target} from {part.source} in {time.perf_counter() - t0:.1f} s: "
        f"{stats.files:,} files ({stats.rewritten:,} rewritten), {(objects.written_bytes - written_before) >> 20} MiB "
        f"written, {(objects.new_bytes - objects.written_bytes - new_before + written_before) >> 20} MiB linked to "
        "the host's files, the rest shared with other parts")
    return name


def _collect(root: str, keep: set[str], budget: int, log: Callable[[str], None],
             apart_holding: int | None = None) -> store_collect.Collected:
    if apart_holding is not None:  # from a server: the scan's memory must not stay in it (collect_apart)
        out = store_collect.collect_apart(root, keep, budget, KEEP_UNUSED_S, build_lock_fd=apart_holding)
    else:
        out = store_collect.collect(root, keep, budget, KEEP_UNUSED_S)
    with open(os.path.join(root, _COLLECTED), "w"):
        pass  # its mtime: when the next start that builds nothing collects again (_collection_due)
    if out.removed_parts:
        log(f"runtime store: removed {len(out.removed_parts)} part(s) no server held "
            f"({out.freed_bytes >> 20} MiB of files only they used); {out.size_bytes >> 20} MiB kept in {root}")
    if out.over_budget:
        log(f"runtime store: {out.size_bytes >> 20} MiB in {root}, over its budget of {budget >> 20} MiB: "
            "the rest is held by running servers")
    return out


def running_paths() -> tuple[str, ...]:
    """In the zygote: the runtime tree every sandbox root binds (at the same path). Refuses to hand
    out host paths: the zygote must run from the store (LinuxBackend starts it through launch())."""
    pkg = os.path.dirname(os.path.abspath(agentcell.__file__))
    for what, path in (("the agentcell package", pkg), ("sys.prefix", sys.prefix), ("sys.base_prefix", sys.base_prefix)):
        if not _under(path, [NEUTRAL_ROOT, *_SYSTEM]):
            raise RuntimeStoreError(f"{what} is {path}: the zygote must run from the runtime store under "
                                    f"{NEUTRAL_ROOT} (start it through LinuxBackend), or sandboxes would see host paths")
    if _under(sys.base_prefix, [NEUTRAL_ROOT]):
        # a RUNPATH the store could not rewrite makes the loader fall back to the system's libpython
        with open("/proc/self/maps") as f:
            wrong = {line.split()[-1] for line in f if "/libpython" in line and NEUTRAL_ROOT not in line}
        if wrong:
            raise RuntimeStoreError(f"the interpreter in {sys.base_prefix} loaded {', '.join(sorted(wrong))}, not its "
                                    "own libpython: its RUNPATH names a host path too short to be rewritten; "
                                    "use a Python installed under a longer prefix")
    return (NEUTRAL_ROOT,)


# -- the launcher ---------------------------------------------------------------------------------


def launch(spec: dict[str, Any]) -> NoReturn:
    """Become the zygote, from the neutral paths: a private mount namespace with the store's parts
    on NEUTRAL_ROOT, an empty network namespace, a neutral host name, then exec the interpreter.
    The zygote stays in this mount namespace: its interpreter and libpython are mapped from it."""
    sc.unshare(sc.CLONE_NEWNS | sc.CLONE_NEWUTS | sc.CLONE_NEWNET)
    sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE)
    sc.sethostname(ZYGOTE_HOSTNAME)
    top = os.path.dirname(NEUTRAL_ROOT)  # the host's /opt is out of sight in this namespace only
    os.makedirs(top, mode=0o755, exist_ok=True)
    base = sc.MS_NOSUID | sc.MS_NODEV
    sc.mount("tmpfs", top, "tmpfs", base, "size=64k,mode=0755")
    for src, dst in spec["mounts"]:
        os.makedirs(dst, mode=0o755, exist_ok=True)
        sc.mount(src, dst, None, sc.MS_BIND)
        sc.mount(None, dst, None, sc.MS_REMOUNT | sc.MS_BIND | sc.MS_RDONLY | base)
    if os.path.isdir("/usr"):
        os.makedirs(SYSTEM_USR, mode=0o755, exist_ok=True)
        sc.mount("/usr", SYSTEM_USR, None, sc.MS_BIND)
        sc.mount(None, SYSTEM_USR, None, sc.MS_REMOUNT | sc.MS_BIND | sc.MS_RDONLY | base)
    sc.mount(None, top, None, sc.MS_REMOUNT | sc.MS_RDONLY | base)
    env = dict(os.environ)
    env["PYTHONPATH"] = spec["pythonpath"]
    argv = spec["argv"]
    # the same libraries as /usr's, by a path an image sandbox has too (its /usr is the image's); after
    # the interpreter's own lib directory in the store, whose libpython must win over the host's
    own = sorted({os.path.dirname(p) for p in glob.glob(f"{NEUTRAL_ROOT}/*/lib/libpython*.so*")})
    env["LD_LIBRARY_PATH"] = ":".join(p for p in (*own, SYSTEM_LIBS, env.get("LD_LIBRARY_PATH", "")) if p)
    os.execve(argv[0], argv, env)


if __name__ == "__main__":
    launch(json.loads(sys.argv[1]))
