"""The per-template zygote: imports everything once, builds the read-only root once, forks sandboxes.

Run as ``python -m agentcell.backends.linux.zygote`` with its arguments (``--fd N --cgroup
agentcell/<instance> ...``) as a JSON list on stdin, so that no sandbox's cmdline shows them. fd N is a
SOCK_SEQPACKET socket to the backend; each message is ``spawn`` with one sandbox's socket attached
(SCM_RIGHTS), and nothing else. The zygote forks a child for it (sandbox_init.run_child) and goes
straight back to waiting: the child reports itself on its socket and prepares itself, in parallel with
the children of other spawns. What the child becomes (its id, limits, later the tenant's env vars)
comes from the server on that socket, after the fork, so no tenant's data is ever in the zygote's
memory (which every later sandbox inherits).

Its launcher (runtime_store.launch) gives it its own mount namespace; it builds the template root
there (rootfs.build_template), so each sandbox only copies it.

It must stay single-threaded (fork keeps only the calling thread). It dies with the server
(PR_SET_PDEATHSIG); children still being prepared die with it. Sandboxes past their preparation do not
depend on it: a zygote that dies or is replaced leaves them running (the server owns them: each one's
agent exits when the server's socket closes or its pidfd of the server fires).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
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

from agentcell.backends.linux import rootfs, sandbox_init, seccomp_filter
from agentcell.backends.linux import syscalls as sc

SPAWN = b"spawn"  # the backend's message: one sandbox's socket attached; its child yields the CPU
SPAWN_NOW = b"spawn-now"  # the same for a create that waits: the child keeps the default CPU weight
ZYGOTE_NICE = 10
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


def _on_sigterm(_signum: int, _frame: Any) -> None:
    raise SystemExit(0)


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


def _compact_heaps() -> None:
    """Leave the allocators so that what a sandbox allocates goes to fresh pages, not into holes.

    A child that allocates into a free block of a page it shares with the zygote copies that page;
    free blocks are scattered over the whole preloaded heap, so every small allocation costs a page.
    Measured: about 2.5 MiB less memory per idle sandbox."""
    with contextlib.suppress(OSError, AttributeError):
        # glibc: merge the fast bins now (else the child's first large malloc merges them, writing
        # chunk headers all over the shared heap) and give whole free pages back.
        ctypes.CDLL(None).malloc_trim(0)
    # pymalloc: fill the free blocks of partly used pools, so new objects go to fresh pools. The
    # filler stays allocated (~0.5 MB, shared); a child's allocations no longer land in shared pages.
    alloc = ctypes.PYFUNCTYPE(None, ctypes.c_size_t)(("PyObject_Malloc", ctypes.pythonapi))
    for _ in range(2):  # the first pass's own objects leave a few holes
        for size, count in _pymalloc_free_blocks().items():
            for _ in range(count):
                alloc(size)


def _pymalloc_free_blocks() -> dict[int, int]:
    """Free blocks in pymalloc's partly used pools by block size, from sys._debugmallocstats(), which
    prints to the C stderr; empty if pymalloc is not the allocator."""
    r, w = os.pipe()
    stderr = os.dup(2)
    try:
        os.dup2(w, 2)
        os.close(w)
        sys._debugmallocstats()
    finally:
        os.dup2(stderr, 2)
        os.close(stderr)
    with os.fdopen(r, "rb") as f:  # a few KB: fits the pipe buffer
        report = f.read().decode(errors="replace")
    free = {}
    for line in report.splitlines():  # "class size num_pools blocks_in_use avail_blocks"
        fields = line.split()
        if len(fields) == 5 and all(f.isdigit() for f in fields):
            free[int(fields[1])] = int(fields[4])
    return free


class Zygote:
    def __init__(self, cgroup_parent: str, staging: str, default_entry: str, seccomp: Any, server_pidfd: int) -> None:
        self.cgroup_parent = cgroup_parent
        self.staging = staging
        self.default_entry = default_entry
        self.seccomp = seccomp
        self.pidns = os.open("/proc/self/ns/pid", os.O_RDONLY | os.O_CLOEXEC)
        self.server_pidfd = server_pidfd
        self.seq = 0

    def _entry(self, spec: str | None) -> Callable[..., Any]:
        return resolve_entry(spec or self.default_entry)

    def spawn(self, fds: list[int], yield_cpu: bool = True) -> None:
        """Fork a child that becomes the sandbox on the socket in `fds` (it reports itself there)."""
        if not fds:
            return
        sock_fd = fds[0]
        for extra in fds[1:]:
            os.close(extra)
        self.seq += 1
        cgroup = f"{self.cgroup_parent}/s{os.getpid()}-{self.seq}"
        try:
            sc.unshare(sc.CLONE_NEWPID)  # the next child is pid 1 of a new pid namespace
            try:
                pid = os.fork()
                if pid == 0:
                    sandbox_init.run_child(sock_fd, os.getppid(), self.server_pidfd, cgroup, self.staging,
                                           self._entry, self.seccomp, yield_cpu)
            finally:
                # only the zygote gets here: its later children must not land in that namespace too
                sc.setns(self.pidns, sc.CLONE_NEWPID)
        except Exception as e:  # noqa: BLE001 - report on the sandbox's socket, keep serving others
            with contextlib.suppress(OSError):
                sandbox_init._send(sock_fd, {"id": 0, "event": "error", "message": f"zygote could not spawn: {e}"})
        finally:
            os.close(sock_fd)


def _args(line: bytes) -> list[str]:
    args = json.loads(line)
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise SystemExit("agentcell zygote: stdin lines must be JSON lists of arguments")
    return args


def main(argv: list[str] | None = None) -> int:
    """Two steps (see zygote_process.py): stdin's first line launches (entry, parent), and the zygote
    imports the runtime while the server gets ready; the second places it (cgroup, staging, CA). An
    end of stdin before the second line is the server discarding it: exit quietly."""
    parser = argparse.ArgumentParser(prog="agentcell-zygote")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--entry", default="agentcell.runtime.agent:serve")
    parser.add_argument("--parent", type=int, default=0, help="the server's pid (exit if it is gone already)")
    parser.add_argument("--no-preload", action="store_true", help="skip agent.preload() (probe-only zygotes)")
    placing = argparse.ArgumentParser(prog="agentcell-zygote (placement)")
    placing.add_argument("--cgroup", required=True, help="cgroup parent of the sandboxes, e.g. agentcell/<instance>")
    placing.add_argument("--staging", default=rootfs.STAGING)
    placing.add_argument("--extra-ca", default=None, help="a CA certificate (PEM file) sandboxes trust: the egress proxy's")
    placing.add_argument("--ptys", type=int, default=rootfs.PTYS_PER_SANDBOX, help="each sandbox's devpts max=")
    stdin = sys.stdin.buffer
    args = parser.parse_args(_args(stdin.readline()) if argv is None else argv)
    ctl = socket.socket(fileno=args.fd)
    ctl.setblocking(True)
    sc.prctl(sc.PR_SET_PDEATHSIG, signal.SIGKILL)  # the server died: the zygote goes with it
    if args.parent and os.getppid() != args.parent:
        return 1  # ... and it already had
    # Every sandbox watches this pidfd of the server: it is how a sandbox dies with its server
    # without depending on the zygote's life.
    server_pidfd = os.pidfd_open(os.getppid())
    # Preparing standbys must not slow sandboxes that serve someone: the zygote's forks run niced, and
    # each child, once in its own cgroup, yields by that cgroup's CPU weight until it is claimed.
    os.setpriority(os.PRIO_PROCESS, 0, ZYGOTE_NICE)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C on the server: the backend closes us
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGCHLD, _reap)
    try:
        os.setgroups([])  # root's supplementary groups must not reach any child
        # No unshare here: the launcher (runtime_store.launch) gave us a mount namespace of our own,
        # with the runtime mounted. Leaving it would detach the mounts our interpreter and libpython
        # were mapped from, and sandboxes' /proc/self/exe and maps would name them by their bare paths.
        if args.no_preload:
            resolve_entry(args.entry)
        else:
            _preload(args.entry)
        line = stdin.readline()
        if not line:
            return 0  # discarded before it was placed
        sys.stdin.close()
        where = placing.parse_args(_args(line))
        rootfs.PTYS_PER_SANDBOX = where.ptys
        rootfs.build_template(where.staging, where.extra_ca)
        seccomp = seccomp_filter.build_sandbox_filters()  # the default pair and the strict one
        if threading.active_count() > 1:
            print("agentcell zygote: preload started threads; forks keep only the main one", file=sys.stderr)
        gc.collect()
        gc.freeze()  # keep the preloaded heap shared copy-on-write with every sandbox
        _compact_heaps()
        zygote = Zygote(where.cgroup, where.staging, args.entry, seccomp, server_pidfd)
        ctl.send(b"ready")  # start() waits for this, so the first create() is as fast as the others
        while True:
            try:
                msg, fds, _flags, _addr = socket.recv_fds(ctl, 64, 4)
            except OSError as e:
                print(f"agentcell zygote: control socket failed: {e}", file=sys.stderr)
                return 1
            if not msg and not fds:
                return 0  # the backend closed the control socket
            if msg not in (SPAWN, SPAWN_NOW):
                for fd in fds:
                    os.close(fd)
                continue
            zygote.spawn(fds, yield_cpu=msg == SPAWN)
            _reap()
    finally:
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # children being prepared die with us (PDEATHSIG)


if __name__ == "__main__":
    sys.exit(main())

