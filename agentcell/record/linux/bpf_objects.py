"""Finding and loading agentcell's compiled eBPF objects: libbpf (libbpf1, through ctypes) with the
prototypes of the functions agentcell calls, declared in one place, and the object for a source
(bpf_build.py): the one shipped next to it (a wheel's), else the cache's, else compiled now with
clang into the cache. The kernel tracer (kernel_trace.py) and the exec policy
(policy/linux/exec_guard.py) both load through here.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from collections.abc import Callable
from pathlib import Path

from agentcell.errors import BackendUnavailableError
from agentcell.record.linux import bpf_build
from agentcell.server import progress

# ring_buffer_sample_fn: (ctx, data, size) -> int (< 0 stops the consume after this sample)
CALLBACK = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def compiled(source: Path, cache: Path, error: type[BackendUnavailableError]) -> Path:
    """The compiled object for `source`: the one shipped next to it (compiled when the wheel was built:
    setup.py), else the cache's, else compiled now with clang into `cache`. `error`: what to raise."""
    what = bpf_build.what(source)
    try:
        text = source.read_bytes()
    except OSError as e:
        raise error(f"{what}: the source is missing ({e}): reinstall agentcell") from None
    name = bpf_build.object_name(text, stem=bpf_build.stem_of(source.name))
    shipped = source.parent / name
    if shipped.exists():
        return shipped
    obj = cache / name
    if obj.exists():
        return obj
    try:
        cache.mkdir(parents=True, exist_ok=True)
        with progress.step(f"compiling {what} (clang -target bpf, once per version)"):
            bpf_build.compile_object(source, obj)
    except bpf_build.BpfBuildError as e:
        raise error(f"this install has {what} compiled for no {bpf_build.machine()}, and {e}") from None
    except OSError as e:
        raise error(f"cannot build {what} into {cache} ({e}): set AGENTCELL_BPF_CACHE to a writable "
                    "directory") from None
    return obj


def libbpf(error: type[BackendUnavailableError]) -> ctypes.CDLL:
    """libbpf, its functions' prototypes declared; `error` (with what to install) if it is missing."""
    try:
        return _libbpf()
    except OSError as e:
        raise error(f"no libbpf ({e}): apt install libbpf1") from None


@functools.cache
def _libbpf() -> ctypes.CDLL:
    lib = ctypes.CDLL(ctypes.util.find_library("bpf") or "libbpf.so.1", use_errno=True)
    p, s, i = ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int
    for fn, res, args in (
            ("bpf_object__open_file", p, (s, p)), ("bpf_object__load", i, (p,)), ("bpf_object__close", None, (p,)),
            ("bpf_object__find_program_by_name", p, (p, s)), ("bpf_object__find_map_by_name", p, (p, s)),
            ("bpf_map__fd", i, (p,)), ("bpf_map__set_max_entries", i, (p, ctypes.c_uint32)),
            ("bpf_program__attach", p, (p,)), ("bpf_object__next_program", p, (p, p)),
            ("bpf_program__name", s, (p,)), ("bpf_program__set_autoload", i, (p, ctypes.c_bool)),
            ("bpf_link__destroy", i, (p,)), ("libbpf_num_possible_cpus", i, ()),
            ("libbpf_get_error", ctypes.c_long, (p,)),
            ("bpf_map_update_elem", i, (i, p, p, ctypes.c_uint64)), ("bpf_map_lookup_elem", i, (i, p, p)),
            ("bpf_map_delete_elem", i, (i, p)),
            ("ring_buffer__new", p, (i, CALLBACK, p, p)), ("ring_buffer__consume", i, (p,)),
            ("ring_buffer__epoll_fd", i, (p,)), ("ring_buffer__free", None, (p,))):
        f = getattr(lib, fn)
        f.restype, f.argtypes = res, args
    return lib


class BpfObject:
    """A compiled object opened, loaded and its programs attached (all but `skip`), with a ring buffer
    map `ring` read through `callback`. `what` names it in errors (of type `error`); `sizes`: map
    name -> max_entries, set before the load; `load_hint`: said when the load fails, with errno ->
    a message of its own in `refusals`; `configure(self)` runs between the load and the attach."""

    def __init__(self, path: Path, error: type[BackendUnavailableError], what: str, ring: str,
                 callback: Callable[[int | None, int, int], int], skip: tuple[str, ...] = (),
                 sizes: dict[str, int] | None = None, load_hint: str = "", refusals: dict[int, str] | None = None,
                 configure: Callable[[BpfObject], None] | None = None) -> None:
        self.lib = lib = libbpf(error)
        self._error_type, self._what = error, what
        self._obj = self._ring = None
        self._links: list[int] = []
        self._callback = CALLBACK(callback)  # kept: libbpf calls it
        try:
            self._obj = lib.bpf_object__open_file(str(path).encode(), None)
            if not self._obj or lib.libbpf_get_error(self._obj):
                self._obj = None
                raise self.error(f"opening {what}")
            for name in skip:
                lib.bpf_program__set_autoload(lib.bpf_object__find_program_by_name(self._obj, name.encode()), False)
            for name, size in (sizes or {}).items():
                lib.bpf_map__set_max_entries(lib.bpf_object__find_map_by_name(self._obj, name.encode()), size)
            if lib.bpf_object__load(self._obj) != 0:
                known = (refusals or {}).get(ctypes.get_errno())
                raise error(known) if known else self.error(f"loading {what}{load_hint}")
            if configure:
                configure(self)
            prog = lib.bpf_object__next_program(self._obj, None)
            while prog:
                name = (lib.bpf_program__name(prog) or b"?").decode()
                if name not in skip:
                    link = lib.bpf_program__attach(prog)
                    if not link or lib.libbpf_get_error(link):
                        raise self.error(f"attaching {what}'s {name}")
                    self._links.append(link)
                prog = lib.bpf_object__next_program(self._obj, prog)
            self._ring = lib.ring_buffer__new(self.map_fd(ring), self._callback, None, None)
            if not self._ring:
                raise self.error(f"opening {what}'s ring buffer")
        except BaseException:
            self.close()
            raise

    def error(self, doing: str) -> BackendUnavailableError:
        err = ctypes.get_errno()
        return self._error_type(f"{doing}: {os.strerror(err) if err else 'failed'}")

    def map_fd(self, name: str) -> int:
        return self.lib.bpf_map__fd(self.lib.bpf_object__find_map_by_name(self._obj, name.encode()))

    def ring_fd(self) -> int:
        """Readable when the ring holds records (consume() hands them to the callback)."""
        assert self._ring is not None
        return self.lib.ring_buffer__epoll_fd(self._ring)

    def consume(self) -> None:
        assert self._ring is not None
        self.lib.ring_buffer__consume(self._ring)

    def close(self) -> None:
        """Detach the programs and free the object (idempotent)."""
        if self._ring:
            self.lib.ring_buffer__free(self._ring)
            self._ring = None
        for link in self._links:
            self.lib.bpf_link__destroy(link)
        self._links.clear()
        if self._obj:
            self.lib.bpf_object__close(self._obj)
            self._obj = None
