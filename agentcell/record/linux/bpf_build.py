"""Compiling agentcell's eBPF programs (SOURCES: the kernel tracer's bpf/kernel_trace.bpf.c, the exec
policy's guard, policy/linux/bpf/exec_guard.bpf.c) with clang: when a wheel is built (setup.py ships each
object next to its source, so hosts need no clang) and, where no shipped object fits, when a server
first loads it (bpf_objects.compiled, into its cache).

One object fits every kernel of its machine: it is compiled with BTF (-g), and libbpf relocates its
struct offsets against the running kernel's BTF when it loads it (CO-RE). It is not portable across
machines (the source reads x86_64 syscall registers), so its name carries the machine, and its source's
hash: a shipped object is used only for the source next to it. Its name starts with the source's stem
(kernel_trace-..., exec_guard-...).

Standard library only: setup.py loads this file by its path, before agentcell's dependencies exist.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

SOURCE_NAME = "kernel_trace.bpf.c"  # the kernel tracer's
SUFFIX = ".bpf.c"
# every source a wheel ships compiled, relative to the project's root
SOURCES = ("agentcell/record/linux/bpf/kernel_trace.bpf.c", "agentcell/policy/linux/bpf/exec_guard.bpf.c")
WHAT = {"kernel_trace": "the kernel tracer", "exec_guard": "the exec policy's guard"}  # by stem, for messages
CLANGS = ("clang", "clang-19", "clang-18", "clang-17", "clang-16", "clang-15", "clang-14")
_TARGET_ARCH = {"x86_64": "x86", "aarch64": "arm64"}  # uname's machine -> libbpf's __TARGET_ARCH_*
CLANG_TIMEOUT_S = 120


class BpfBuildError(RuntimeError):
    """A program could not be compiled here (no clang, or clang failed); the message says which."""


def machine() -> str:
    return os.uname().machine


def stem_of(source_name: str) -> str:
    """`exec_guard` of `exec_guard.bpf.c`: the start of its objects' names."""
    return source_name.removesuffix(SUFFIX)


def object_name(source: bytes, for_machine: str | None = None, stem: str = "kernel_trace") -> str:
    """The compiled object's file name for this source text (of the source named `stem`.bpf.c) on
    `for_machine` (default: this one)."""
    return f"{stem}-{hashlib.sha256(source).hexdigest()[:16]}-{for_machine or machine()}.bpf.o"


def what(source: Path) -> str:
    return WHAT.get(stem_of(source.name), source.name)


def find_clang() -> str | None:
    return next((c for c in CLANGS if shutil.which(c)), None)


def compile_object(source: Path, out: Path, clang: str | None = None) -> None:
    """Compile `source` into `out` (written whole or not at all) for this machine."""
    clang = clang or find_clang()
    if clang is None:
        raise BpfBuildError(f"no clang to build {what(source)} (apt install clang libbpf-dev)")
    includes = [f"-I/usr/include/{d}" for d in ("x86_64-linux-gnu", "aarch64-linux-gnu")
                if Path(f"/usr/include/{d}").is_dir()]
    arch = _TARGET_ARCH.get(machine(), machine())
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        try:
            done = subprocess.run([clang, "-O2", "-g", "-target", "bpf", f"-D__TARGET_ARCH_{arch}", *includes,
                                   "-c", str(source), "-o", str(tmp)],
                                  capture_output=True, text=True, timeout=CLANG_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise BpfBuildError(f"building {what(source)} with {clang} failed: {e}") from None
        if done.returncode != 0:
            raise BpfBuildError(f"building {what(source)} with {clang} failed (the headers come with "
                                f"apt install libbpf-dev linux-libc-dev): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
