"""What a freshly forked zygote child does to become a sandbox.

A (host root, host namespaces): joins the sandbox's cgroups, builds the root filesystem in a private
mount namespace, becomes the sandbox's unprivileged host id, unshares every namespace, maps id 1000,
forks B, reports B's host pid and exits.

B (pid 1 of the new pid namespace): enters the root, sets hostname/loopback/rlimits, confines itself
(Landlock, no capabilities, no_new_privs, seccomp) and only then runs the entry point, which is the
sandbox's agent. Nothing the sandbox runs ever has a capability or the host's view of anything.
"""

from __future__ import annotations

import fcntl
import os
import resource
import signal
import socket
import struct
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from agentcell.backends.base import Limits
from agentcell.backends.linux import landlock, rootfs
from agentcell.backends.linux import syscalls as sc
from agentcell.backends.linux.cgroups import Cgroups
from agentcell.runtime.protocol import encode_frame

SOCK_FD = 3
_SIOCGIFFLAGS, _SIOCSIFFLAGS = 0x8913, 0x8914
_IFF_UP, _IFF_RUNNING = 0x1, 0x40


def _send(fd: int, header: dict[str, Any]) -> None:
    data = encode_frame(header)
    while data:
        data = data[os.write(fd, data):]


def _fail(fd: int, step: str, exc: BaseException) -> NoReturn:
    msg = f"sandbox setup failed at {step}: {exc}"
    try:
        traceback.print_exc(file=sys.stderr)
        _send(fd, {"id": 0, "event": "error", "message": msg})
    finally:
        os._exit(1)


def _write_file(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _lower_oom_score() -> int:
    """Make the agent the OOM killer's last choice; returns what its children should set.

    Lowering needs CAP_SYS_RESOURCE, which some container hosts withhold: then the agent stays at
    its score and its children raise theirs instead (raising is always allowed).
    """
    try:
        _write_file("/proc/self/oom_score_adj", "-900")
        return 0
    except PermissionError:
        return 500


def _lo_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP | _IFF_RUNNING))


def _set_rlimit(which: int, value: int) -> None:
    _, hard = resource.getrlimit(which)
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    resource.setrlimit(which, (value, value))


def _drop_capabilities() -> None:
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        sc.prctl(sc.PR_CAPBSET_DROP, cap)
    sc.prctl(sc.PR_CAP_AMBIENT, sc.PR_CAP_AMBIENT_CLEAR_ALL)
    sc.capset_zero()


def default_envs(sandbox_id: str) -> dict[str, str]:
    return {
        "PATH": f"{sys.prefix}/bin:/usr/local/bin:/usr/bin:/bin",
        "HOME": rootfs.HOME,
        "USER": "user",
        "LOGNAME": "user",
        "SHELL": "/bin/bash",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TERM": "xterm-256color",
        "HOSTNAME": sandbox_id,
        "PYTHONUNBUFFERED": "1",
        "MPLBACKEND": "Agg",
        "MPLCONFIGDIR": "/tmp/.matplotlib",
        "OPENBLAS_NUM_THREADS": "1",
        "TMPDIR": "/tmp",
    }


def run_child_a(sock_fd: int, req: dict[str, Any], entry: Callable[..., Any], seccomp_filter: Any) -> NoReturn:
    """Runs in the zygote's fresh child. Never returns."""
    step = "start"
    try:
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        if sock_fd != SOCK_FD:
            os.dup2(sock_fd, SOCK_FD)
        os.closerange(SOCK_FD + 1, 1 << 16)
        os.set_inheritable(SOCK_FD, False)
        devnull = os.open("/dev/null", os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)  # fd 2 stays the zygote's stderr until B runs the entry point
        os.close(devnull)
    except BaseException as e:  # noqa: BLE001 - the child must report, never unwind into the zygote
        _fail(sock_fd, step, e)
    fd = SOCK_FD
    try:
        sandbox_id: str = req["sandbox_id"]
        limits = Limits(**req["limits"])
        uid, gid = int(req["host_uid"]), int(req["host_gid"])
        if uid <= 0 or gid <= 0:
            raise ValueError("refusing to run a sandbox as host root")
        step = "cgroups"
        Cgroups.for_sandbox(sandbox_id).create_and_join(limits, os.getpid())
        step = "oom_score_adj"
        child_oom = _lower_oom_score()
        step = "root filesystem"
        sc.unshare(sc.CLONE_NEWNS)
        rootfs.build(sandbox_id, limits.disk_mb, uid, gid, req.get("staging", rootfs.STAGING))
        step = "drop to the sandbox's host id"
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
        sc.prctl(sc.PR_SET_DUMPABLE, 1)  # else /proc/self/uid_map belongs to root and is not writable
        step = "unshare"
        sc.unshare(sc.CLONE_NEW_ALL)
        step = "id maps"
        _write_file("/proc/self/setgroups", "deny")
        _write_file("/proc/self/uid_map", f"{rootfs.SANDBOX_UID} {uid} 1")
        _write_file("/proc/self/gid_map", f"{rootfs.SANDBOX_UID} {gid} 1")
        step = "fork pid 1"
        release_r, release_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(release_w)
            req["child_oom_score_adj"] = child_oom
            _run_b(fd, release_r, req, limits, entry, seccomp_filter)
        os.close(release_r)
        _send(fd, {"id": 0, "event": "spawned", "host_pid": pid})
        os.write(release_w, b"go")
        os._exit(0)
    except BaseException as e:  # noqa: BLE001
        _fail(fd, step, e)


def _run_b(fd: int, release_fd: int, req: dict[str, Any], limits: Limits, entry: Callable[..., Any],
           seccomp_filter: Any) -> NoReturn:
    step = "enter root"
    sandbox_id = req["sandbox_id"]
    try:
        rootfs.enter(req.get("staging", rootfs.STAGING))
        step = "hostname"
        sc.sethostname(sandbox_id)
        step = "loopback"
        _lo_up()
        step = "rlimits"
        _set_rlimit(resource.RLIMIT_NOFILE, limits.open_files)
        _set_rlimit(resource.RLIMIT_FSIZE, limits.file_size_mb << 20)
        _set_rlimit(resource.RLIMIT_CORE, 0)
        step = "no_new_privs"
        sc.prctl(sc.PR_SET_NO_NEW_PRIVS, 1)
        step = "landlock"
        landlock_abi = landlock.restrict()
        step = "capabilities"
        _drop_capabilities()
        step = "seccomp"
        seccomp_filter.load()
    except BaseException as e:  # noqa: BLE001
        os.read(release_fd, 2)  # A's "spawned" frame goes first
        _fail(fd, step, e)
    step = "entry point"
    try:
        os.read(release_fd, 2)
        os.close(release_fd)
        devnull = os.open("/dev/null", os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(devnull, i)
        os.close(devnull)
        os.closerange(SOCK_FD + 1, 1 << 16)
        envs = default_envs(sandbox_id)
        envs.update(req.get("envs") or {})
        os.environ.clear()
        os.environ.update(envs)
        os.chdir(rootfs.HOME)
        sock = socket.socket(fileno=fd)
        config = {"sandbox_id": sandbox_id, "envs": envs, "home": rootfs.HOME, "landlock_abi": landlock_abi,
                  "child_oom_score_adj": req["child_oom_score_adj"]}
        entry(sock, config)
        os._exit(0)
    except SystemExit as e:
        os._exit(e.code if isinstance(e.code, int) else 1)
    except BaseException as e:  # noqa: BLE001
        _fail(fd, step, e)
