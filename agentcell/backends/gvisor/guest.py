"""The sandbox's init inside gVisor: prepares the guest as its root, then becomes the agent as uid 1000.

runsc starts it (pid 1 of the guest kernel) as the guest's root, with the sandbox's socket as stdin
and stdout (a host socket the sentry imported: unlike a host UDS it survives checkpoint and restore,
each restore getting the new sandbox's socket). It reads its *preparation* frame on that socket (the
sandbox id, its limits), writes the sandbox's own /etc/hosts, /etc/hostname and sudo through the root's
memory overlay, sets the rlimits (RLIMIT_NPROC stands for the pids limit: a host pids.max would count
the sentry's threads and kill the whole sandbox), then drops to what the linux backend's agent is
(sandbox_init.py): uid 1000, the root capability set permitted only, no_new_privs, the same seccomp
filter, and serves the agent protocol.

Once a sandbox is claimed, CAP_SYS_ADMIN (kept permitted so a restored template can take its new host
name, `claimed`) is gone from every set: nothing the tenant runs can ever hold it.
"""

from __future__ import annotations

import base64
import ctypes
import errno
import fcntl
import os
import socket
import sys
from typing import Any

from agentcell.backends.base import Limits
from agentcell.backends.linux import ns_limits, rootfs, sandbox_init, seccomp_filter
from agentcell.backends.linux import syscalls as sc
from agentcell.runtime import forkstate, rootcaps
from agentcell.runtime.protocol import recv_frame

SOCK_FD = 3
CAP_SETPCAP = 8
CAP_SYS_ADMIN = 21
# held until the claim only: the host name of a restored template (SYS_ADMIN), and dropping it from
# the bounding set (SETPCAP)
_CLAIM_CAPS = (1 << CAP_SYS_ADMIN) | (1 << CAP_SETPCAP)
_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n127.0.1.1\t{name}\n"


def _write(path: str, text: str, mode: int = 0o644) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _name_files(sandbox_id: str) -> None:
    _write("/etc/hostname", sandbox_id + "\n")
    _write("/etc/hosts", _HOSTS.format(name=sandbox_id))


def _set_rlimits(limits: Limits) -> None:
    """ns_limits' values, each clamped to the hard limit runsc gave the init (raising it is refused)."""
    import resource

    inf = resource.RLIM_INFINITY
    for which, (soft, hard) in ns_limits.rlimits(limits).items():
        _, cur = resource.getrlimit(which)
        if cur != inf and (hard == inf or hard > cur):
            hard = cur
        if hard != inf and (soft == inf or soft > hard):
            soft = hard
        try:
            resource.setrlimit(which, (soft, hard))
        except ValueError:
            # the sentry refuses some it does not implement (RLIMIT_SIGPENDING reads 0/0 and cannot be
            # set): those bound nothing here; the ones that are limits must hold
            if which in (resource.RLIMIT_NPROC, resource.RLIMIT_NOFILE, resource.RLIMIT_FSIZE):
                raise


def claimed(header: dict[str, Any]) -> dict[str, str]:
    """At the claim (agent.serve's hook): a sandbox restored from a template takes its own name, its
    generators are redrawn, and CAP_SYS_ADMIN goes for good. The env vars it returns join the claim's."""
    name = header.get("hostname")
    extra: dict[str, str] = {}
    if isinstance(name, str) and name and name != socket.gethostname():
        with rootcaps._effective((1 << CAP_SYS_ADMIN) | (1 << rootcaps.CAP_DAC_OVERRIDE)):
            sc.sethostname(name)
            _name_files(name)
        extra["HOSTNAME"] = name
        forkstate.refresh()
    with rootcaps._effective(1 << CAP_SETPCAP):
        for cap in (CAP_SYS_ADMIN, CAP_SETPCAP):
            if not sandbox_init.ROOT_CAPS_MASK & (1 << cap):
                sc.prctl(sc.PR_CAPBSET_DROP, cap)
    permitted, _ = rootcaps._get()
    rootcaps._set(permitted & (sandbox_init.ROOT_CAPS_MASK & ~(1 << CAP_SYS_ADMIN)), 0)
    return extra


def _bound_capabilities(keep: tuple[int, ...]) -> None:
    """sandbox_init's, less the ambient set: the sentry has none to clear (PR_CAP_AMBIENT is EINVAL)."""
    for cap in range(64):
        if cap not in keep:
            try:
                sc.prctl(sc.PR_CAPBSET_DROP, cap)
            except OSError as e:
                if e.errno != errno.EINVAL:  # past the last capability
                    raise
                break


def _load_seccomp(bpf: bytes) -> None:
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = seccomp_filter._SockFprog(len(bpf) // 8, ctypes.addressof(buf))
    sc.prctl(sc.PR_SET_NO_NEW_PRIVS, 1)
    sc.prctl(seccomp_filter.PR_SET_SECCOMP, seccomp_filter.SECCOMP_MODE_FILTER, ctypes.addressof(prog))


def main() -> None:
    # the socket away from 0/1/2, which every child inherits
    fd = fcntl.fcntl(0, fcntl.F_DUPFD_CLOEXEC, SOCK_FD)
    devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    for i in (0, 1):
        os.dup2(devnull, i)
    sock = socket.socket(fileno=fd)
    frame = recv_frame(sock)
    if frame is None:
        os._exit(0)
    req = frame.header
    sandbox_id = str(req["sandbox_id"])
    limits = Limits(**req["limits"])
    # as the guest's root, through the root's memory overlay
    _name_files(sandbox_id)
    _write(rootfs.SUDO_PATH, rootfs.SUDO_SHIM, 0o755)
    _set_rlimits(limits)
    # built by the backend on the host: libseccomp probes the kernel's actions, and the sentry's
    # answers make it refuse the filter's; the program itself the sentry runs as Linux does
    bpf = base64.b64decode(req["seccomp"])
    # the linux agent's identity: uid 1000, the root set permitted only (runtime/rootcaps.py)
    keep = (*sandbox_init.ROOT_CAPS, CAP_SYS_ADMIN, CAP_SETPCAP)
    _bound_capabilities(keep)
    sc.prctl(sc.PR_SET_KEEPCAPS, 1)
    os.setgroups([])
    os.setresgid(rootfs.SANDBOX_UID, rootfs.SANDBOX_UID, rootfs.SANDBOX_UID)
    os.setresuid(rootfs.SANDBOX_UID, rootfs.SANDBOX_UID, rootfs.SANDBOX_UID)
    sc.prctl(sc.PR_SET_KEEPCAPS, 0)
    sc.prctl(sc.PR_SET_NO_NEW_PRIVS, 1)
    sc.capset(sandbox_init.ROOT_CAPS_MASK | _CLAIM_CAPS, 0)
    sc.prctl(sc.PR_SET_DUMPABLE, 1)
    _load_seccomp(bpf)
    rootcaps.GUEST_KERNEL = True  # uid 0 here is the guest kernel's root, never the host's
    envs = sandbox_init.default_envs(sandbox_id)
    os.environ.clear()
    os.environ.update(envs)
    os.chdir(rootfs.HOME)
    from agentcell.runtime import agent

    config = {"sandbox_id": sandbox_id, "envs": envs, "home": rootfs.HOME, "child_oom_score_adj": 0,
              "on_claim": claimed}
    if req.get("preload"):
        agent.preload()
    os.dup2(devnull, 2)  # the host's log file until now: nothing the sandbox runs may write there
    os.close(devnull)
    agent.serve(sock, config)


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # noqa: BLE001 - pid 1: say why on the host's log, then end the sandbox
        import traceback

        traceback.print_exception(e, file=sys.stderr)
        sys.stderr.flush()
        os._exit(1)
