"""R contexts: one R process per context (r/runner.R under the host's ``Rscript``), as E2B's IRkernel.

Debian's ``r-base-core`` is enough (``apt install r-base-core``; ``r-cran-ggplot2`` for ggplot2): the
runner uses base R only. Requests are binary, so R reads them with ``readBin`` and needs no JSON
parser: ``R`` + the run's env vars + the code, or ``E`` + the context's env vars (each a u32 count of
pairs, each string a u32 byte length and its UTF-8 bytes). A context costs one R process (~60 MiB
resident, ~0.2 s to start) and two ``cat``s that carry its socket, charged to the sandbox.
"""

from __future__ import annotations

import os
import struct

from agentcell.runtime.kernel_exec import KernelSpec, exec_kernel, find_program

RUNNER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "r", "runner.R")
_RSCRIPT = ("Rscript",)
MISSING = "r contexts need R (`Rscript`), which this host does not have: apt install r-base-core"
_LOCALE_VARS = ("LC_ALL", "LC_CTYPE", "LANG")


def _str(text: str) -> bytes:
    # NULs dropped: an R string cannot hold one
    data = text.encode("utf-8", "surrogatepass").replace(b"\0", b"")
    return struct.pack(">I", len(data)) + data


def _pairs(env: dict[str, str]) -> bytes:
    pairs = [(k, v) for k, v in env.items() if k and "=" not in k]  # names setenv() refuses are left out
    return struct.pack(">I", len(pairs)) + b"".join(_str(k) + _str(v) for k, v in pairs)


def encode_run(code: str, env_vars: dict[str, str]) -> bytes:
    return b"R" + _pairs(env_vars) + _str(code)


def encode_env(envs: dict[str, str]) -> bytes:
    return b"E" + _pairs(envs)


def _missing() -> str | None:
    return MISSING if find_program(_RSCRIPT) is None else None


def _launch(ctrl_fd: int, out_w: int, err_w: int, cwd: str, env: dict[str, str], oom: int) -> int:
    rscript = find_program(_RSCRIPT, env) or "/usr/bin/Rscript"
    if not any(env.get(k) for k in _LOCALE_VARS):
        env = {**env, "LC_CTYPE": "C.UTF-8"}  # R in the C locale escapes every non-ASCII character it prints
    return exec_kernel([rscript, "--no-save", "--no-restore", RUNNER], ctrl_fd, out_w, err_w, cwd, env, oom)


R = KernelSpec("r", _launch, _missing, encode_run, encode_env, interrupt_group=True, whole_lines=True)
