"""The per-template zygote: imports everything once, then forks one child per sandbox.

Run as ``python -m agentcell.backends.linux.zygote --fd N``. fd N is a SOCK_SEQPACKET socket to the
backend; each message is a JSON spawn request with the sandbox's socket attached (SCM_RIGHTS).
The zygote never answers on the control socket: the child reports (spawned / error) on the
sandbox's own socket. It must stay single-threaded (unshare(CLONE_NEWUSER) refuses threaded callers
and fork keeps only the calling thread), and it reaps every child: it is a child subreaper, so each
sandbox's pid 1 is re-parented here when its short-lived parent exits.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from agentcell.backends.linux import sandbox_init, seccomp_filter
from agentcell.backends.linux import syscalls as sc

MAX_REQUEST = 1 << 20
_entries: dict[str, Callable[..., Any]] = {}


def resolve_entry(spec: str) -> Callable[..., Any]:
    fn = _entries.get(spec)
    if fn is None:
        module, _, name = spec.partition(":")
        fn = getattr(importlib.import_module(module), name or "serve")
        _entries[spec] = fn
    return fn


def _reap(_signum: int = 0, _frame: Any = None) -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _preload(default_entry: str) -> None:
    try:
        from agentcell.runtime import agent  # written by another part of the project

        agent.preload()
    except Exception as e:  # noqa: BLE001 - a broken agent must not stop the probe from working
        print(f"agentcell zygote: agent preload unavailable: {e!r}", file=sys.stderr)
    try:
        resolve_entry(default_entry)
    except Exception as e:  # noqa: BLE001
        print(f"agentcell zygote: cannot import entry point {default_entry}: {e!r}", file=sys.stderr)


def _spawn(raw: bytes, fds: list[int], seccomp: Any, default_entry: str) -> None:
    if not fds:
        return
    sock_fd = fds[0]
    for extra in fds[1:]:
        os.close(extra)
    try:
        req = json.loads(raw)
        entry = resolve_entry(req.get("entry") or default_entry)
        pid = os.fork()
    except Exception as e:  # noqa: BLE001 - report on the sandbox's socket, keep serving others
        try:
            sandbox_init._send(sock_fd, {"id": 0, "event": "error", "message": f"zygote could not spawn: {e}"})
        except OSError:
            pass
        os.close(sock_fd)
        return
    if pid == 0:
        sandbox_init.run_child_a(sock_fd, req, entry, seccomp)
    os.close(sock_fd)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="agentcell-zygote")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--entry", default="agentcell.runtime.agent:serve")
    parser.add_argument("--no-preload", action="store_true", help="skip agent.preload() (probe-only zygotes)")
    args = parser.parse_args(argv)
    ctl = socket.socket(fileno=args.fd)
    ctl.setblocking(True)
    sc.prctl(sc.PR_SET_PDEATHSIG, signal.SIGKILL)  # the server died: the zygote goes with it
    sc.prctl(sc.PR_SET_CHILD_SUBREAPER, 1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on the server: the backend closes us
    if args.no_preload:
        resolve_entry(args.entry)
    else:
        _preload(args.entry)
    seccomp = seccomp_filter.build()
    if threading.active_count() > 1:
        print("agentcell zygote: preload started threads; forks keep only the main one", file=sys.stderr)
    gc.collect()
    gc.freeze()  # keep the preloaded heap shared copy-on-write with every sandbox
    signal.signal(signal.SIGCHLD, _reap)
    ctl.send(b"ready")  # start() waits for this, so the first create() is as fast as the others
    while True:
        try:
            raw, fds, _flags, _addr = socket.recv_fds(ctl, MAX_REQUEST, 4)
        except OSError as e:
            print(f"agentcell zygote: control socket failed: {e}", file=sys.stderr)
            return 1
        if not raw and not fds:
            return 0  # the backend closed the control socket
        _spawn(raw, fds, seccomp, args.entry)
        _reap()


if __name__ == "__main__":
    sys.exit(main())
