"""Python contexts of a template whose image has its own Python: a kernel on the image's interpreter.

The default Python context is a fork of the agent (kernel.py): the runtime's Python 3.11 with its
data-science libraries. An image such as python:3.12-slim brings its own interpreter and packages
(and `pip install` puts more there at run time), which the runtime's Python cannot import (another
ABI, another site-packages). So when the agent's config names the image's interpreter
(``config["python"]``, a path inside the sandbox), Python contexts run image_kernel/kernel.py on it:
a standalone, standard-library-only kernel that speaks the protocol of every exec'd kernel
(kernel_exec.py) and answers with the lines the forked IPython context gives.

The interpreter runs without -I/-E/-s: the image's PYTHONPATH (an ENV of its Dockerfile) and the
user site directory (where `pip install` goes when site-packages is not writable, as for the
sandbox user in python:3.12-slim) must count. Only what points into the runtime is kept from it:
PYTHONPATH and PATH entries under the runtime's package or prefixes, a PYTHONHOME of the runtime's.
"""

from __future__ import annotations

import os
import re
import stat
import sys

from agentcell.runtime.kernel_exec import KernelSpec, exec_kernel, framed_env

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "image_kernel", "kernel.py")
MIN_VERSION = (3, 8)  # the script's oldest Python
_RUNTIME_LIB = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_VERSION_NAME = re.compile(r"python(\d+)\.(\d+)")


def _runtime_roots() -> tuple[str, ...]:
    roots = {_RUNTIME_LIB, sys.prefix, sys.base_prefix, sys.exec_prefix}
    return tuple(os.path.realpath(r) for r in roots if r and r != "/" and r != "/usr")


def _is_runtime_path(path: str, roots: tuple[str, ...]) -> bool:
    real = os.path.realpath(path) if path else path
    return any(real == r or real.startswith(r + os.sep) for r in roots)


def kernel_env(env: dict[str, str]) -> dict[str, str]:
    """The sandbox's env without what would make the image's Python load the runtime's packages, or
    `!pip`/`!python` in a cell find the runtime's instead of the image's (PATH)."""
    roots = _runtime_roots()
    out = dict(env)
    if "PATH" in out:
        out["PATH"] = os.pathsep.join(p for p in out["PATH"].split(os.pathsep) if not _is_runtime_path(p, roots))
    if "PYTHONPATH" in out:
        kept = [p for p in out["PYTHONPATH"].split(os.pathsep) if p and not _is_runtime_path(p, roots)]
        if kept:
            out["PYTHONPATH"] = os.pathsep.join(kept)
        else:
            del out["PYTHONPATH"]
    if "PYTHONHOME" in out and _is_runtime_path(out["PYTHONHOME"], roots):
        del out["PYTHONHOME"]
    return out


def version_of(interpreter: str) -> tuple[int, int] | None:
    """The version an interpreter's name says (/usr/local/bin/python3 -> python3.12), or None."""
    try:
        name = os.path.basename(os.path.realpath(interpreter))
    except OSError:
        return None
    m = _VERSION_NAME.fullmatch(name) or _VERSION_NAME.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def usable(interpreter: str | None) -> bool:
    """Whether `interpreter` can run the image kernel: executable here and not older than 3.8 (an
    image's python2 or python3.7 leaves its template with the runtime's Python contexts)."""
    if not interpreter or not os.path.isabs(interpreter) or not os.access(interpreter, os.X_OK):
        return False
    version = version_of(interpreter)
    return version is None or version >= MIN_VERSION


def _resolve_in(root: str, path: str, hops: int = 40) -> str | None:
    """`path` (absolute, as the sandbox sees it) with its symlinks followed inside `root`, the image's
    unpacked tree; None if it leads nowhere. Never follows a link out of `root`: `..` stops at it,
    an absolute target starts again at it, as inside the sandbox."""
    parts = [p for p in path.split("/") if p]
    resolved: list[str] = []
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            if resolved:
                resolved.pop()
            continue
        host = os.path.join(root, *resolved, part)
        try:
            st = os.lstat(host)
        except OSError:
            return None
        if stat.S_ISLNK(st.st_mode):
            hops -= 1
            if hops < 0:
                return None
            target = os.readlink(host)
            if target.startswith("/"):
                resolved = []
            parts = [p for p in target.split("/") if p] + parts
            continue
        resolved.append(part)
    return "/" + "/".join(resolved)


def find_in_image(root: str, path_env: str | None = None) -> str | None:
    """The image's Python for its code contexts: the first ``python3`` (then ``python``) on the image
    config's PATH, then in /usr/local/bin, /usr/bin, /bin, that is an executable regular file inside
    `root` (its unpacked tree) of version >= 3.8 by its name. The path as found (a venv's
    bin/python3 stays a venv's), or None: the template keeps the runtime's Python contexts."""
    dirs = [d for d in (path_env or "").split(":") if d.startswith("/")]
    dirs += [d for d in ("/usr/local/bin", "/usr/bin", "/bin") if d not in dirs]
    for name in ("python3", "python"):
        for d in dirs:
            candidate = os.path.join(d, name)
            real = _resolve_in(root, candidate)
            if real is None:
                continue
            host = os.path.join(root, real.lstrip("/"))
            try:
                st = os.lstat(host)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or not st.st_mode & 0o111:
                continue
            m = _VERSION_NAME.match(os.path.basename(real))
            if m and (int(m.group(1)), int(m.group(2))) < MIN_VERSION:
                continue
            return candidate
    return None


def image_python_spec(interpreter: str) -> KernelSpec:
    """The Python kernel on `interpreter` (a path inside the sandbox)."""

    def launch(ctrl_fd: int, out_w: int, err_w: int, cwd: str, env: dict[str, str], oom: int) -> int:
        return exec_kernel([interpreter, SCRIPT], ctrl_fd, out_w, err_w, cwd, kernel_env(env), oom)

    def missing() -> str | None:
        if not os.access(interpreter, os.X_OK):
            return f"python contexts of this template run {interpreter}, which is not an executable in the sandbox"
        return None

    def encode_env(envs: dict[str, str]) -> bytes:  # the claim's env vars: the same filter as at the start
        return framed_env(kernel_env(envs))

    return KernelSpec("python", launch, missing, encode_env=encode_env)
