"""What a zygote child does to become a sandbox.

The zygote forks one child per ``spawn`` message, straight into a new pid namespace (the child is the
sandbox's pid 1 from the start), and goes back to waiting: everything else happens in the child, so
children of a burst prepare in parallel. The child reports itself (a "spawned" frame with its host pid
and cgroup) on the sandbox's socket, then, as host root, does what does not depend on the sandbox: it
joins its own cgroup (on cgroup v1 the first move of a process costs an RCU grace period, ~10 ms),
takes a private copy of the zygote's mount namespace and pivots into the template root (rootfs.enter).

Then it reads the *preparation* from the server on its socket: the sandbox id the server picked, the
host id of its slot, the limits, the entry point. None of it is a tenant's: the server prepares
standbys (backend.StandbyPool) before any request names them. With it the child sets the cgroup limits,
makes the sandbox's user namespace with its two host ids mapped (root 0, user 1000), mounts the
private parts of the root and its copy-on-write overlays (rootfs.finish; a sandbox created from a
filesystem snapshot gets the archive's fd right after its request frame and extracts it there), sends
the server an O_PATH fd of its disk's root (a "disk" frame, for LinuxBackend.export_files) and closes
its own, enters that namespace,
unshares mount+net+ipc+uts+cgroup namespaces (owned by it, so the kernel locks the mounts), becomes
uid 1000 with the root capability set permitted only (for commands run as the sandbox's root,
runtime/rootcaps.py), and confines itself (Landlock, no_new_privs, seccomp) before it runs the entry
point, the sandbox's agent. The agent
starts its default code context, says "ready", and waits for the server's ``claim`` (the tenant's env
vars), which only ever reaches this one sandbox: the zygote never holds a request, so nothing of one
tenant's request is in the memory another sandbox inherits. Nothing the sandbox runs ever has a
host capability or the host's view of anything.
"""

from __future__ import annotations

import fcntl
import os
import select
import signal
import socket
import struct
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

from agentcell import rootless
from agentcell.backends.base import Limits
from agentcell.backends.linux import image_root, landlock, ns_limits, rootfs, volume_mounts
from agentcell.backends.linux import syscalls as sc
from agentcell.backends.linux.cgroups import Cgroups
from agentcell.errors import SandboxError
from agentcell.runtime.protocol import encode_frame, recv_frame

SOCK_FD = 3  # the sandbox's socket to the server
SERVER_FD = 4  # a pidfd of the server: readable once it is gone (a sandbox dies with its server)
_SIOCGIFFLAGS, _SIOCSIFFLAGS = 0x8913, 0x8914
_IFF_UP, _IFF_RUNNING = 0x1, 0x40
_marks: list[tuple[str, int]] = []  # (step, perf_counter_ns), printed when the request asks for timing


def _mark(step: str) -> None:
    _marks.append((step, time.perf_counter_ns()))


def _send(fd: int, header: dict[str, Any]) -> None:
    data = encode_frame(header)
    while data:
        data = data[os.write(fd, data):]


def _fail(fd: int, step: str, exc: BaseException) -> NoReturn:
    msg = f"sandbox setup failed at {step}: {exc}"
    # a typed error's code (e.g. a disk archive that is invalid or too big) reaches the creator as such
    code = {"code": exc.code} if isinstance(exc, SandboxError) else {}
    try:
        traceback.print_exception(exc, file=sys.stderr)
        _send(fd, {"id": 0, "event": "error", "message": msg, **code})
    finally:
        os._exit(1)


def _lower_oom_score() -> int:
    """Make the agent the OOM killer's last choice; returns what its children should set.

    Lowering needs CAP_SYS_RESOURCE, which some container hosts withhold: then the agent stays at
    its score and its children raise theirs instead (raising is always allowed).
    """
    try:
        sc.write_file("/proc/self/oom_score_adj", "-900")
        return 0
    except PermissionError:
        return 500


def _lo_up() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        ifreq = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, _SIOCGIFFLAGS, ifreq))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | _IFF_UP | _IFF_RUNNING))


# What the sandbox's root holds, in its own user namespace only (host ids, host files and the kernel
# are out of its reach whatever it holds there): Docker's default set less NET_RAW (seccomp refuses
# raw sockets anyway), MKNOD (device nodes are useless on nodev mounts and refused in a user namespace),
# AUDIT_WRITE (no audit from a user namespace), SYS_CHROOT (seccomp refuses chroot) and SETFCAP (file
# capabilities mean nothing under no_new_privs). No SYS_ADMIN, SYS_PTRACE, NET_ADMIN ...
# linux/capability.h's numbers (2, CAP_DAC_READ_SEARCH, is not in the set: it was, by a range(8) that
# numbered these names from 0, which also left CAP_SETPCAP out)
CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID, CAP_KILL, CAP_SETGID, CAP_SETUID, CAP_SETPCAP = 0, 1, 3, 4, 5, 6, 7, 8
CAP_NET_BIND_SERVICE = 10
ROOT_CAPS = (CAP_CHOWN, CAP_DAC_OVERRIDE, CAP_FOWNER, CAP_FSETID, CAP_KILL, CAP_SETGID, CAP_SETUID, CAP_SETPCAP,
             CAP_NET_BIND_SERVICE)
ROOT_CAPS_MASK = sum(1 << c for c in ROOT_CAPS)


def _bound_capabilities(keep: tuple[int, ...]) -> None:
    """Drop every capability but `keep` from the bounding set, and all ambient ones."""
    with open("/proc/sys/kernel/cap_last_cap") as f:
        last = int(f.read())
    for cap in range(last + 1):
        if cap not in keep:
            sc.prctl(sc.PR_CAPBSET_DROP, cap)
    sc.prctl(sc.PR_CAP_AMBIENT, sc.PR_CAP_AMBIENT_CLEAR_ALL)


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
        # the system bundle (with the egress CA when the server has one, sandbox_etc.trust): requests
        # and httpx would otherwise read certifi's own copy, which lacks it
        "SSL_CERT_FILE": "/etc/ssl/certs/ca-certificates.crt",
        "REQUESTS_CA_BUNDLE": "/etc/ssl/certs/ca-certificates.crt",
        "NODE_EXTRA_CA_CERTS": "/etc/ssl/certs/ca-certificates.crt",
    }


# what an image's Env may not change: who the sandbox's user is and where its home is
_KEPT_ENVS = ("HOME", "USER", "LOGNAME", "HOSTNAME", "TMPDIR")


def image_envs(image: dict[str, Any]) -> dict[str, str]:
    """The image's Env (its PATH first of all), over the sandbox's defaults; never the runtime's venv
    on the PATH (an image's `python` is its own)."""
    envs = {str(k): str(v) for k, v in (image.get("env") or {}).items() if k not in _KEPT_ENVS}
    envs.setdefault("PATH", "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    return envs


def _place_fds(sock_fd: int, server_pidfd: int) -> None:
    """The sandbox's socket -> SOCK_FD, the server's pidfd -> SERVER_FD, stdin/stdout -> /dev/null,
    nothing else open. fd 2 stays the zygote's stderr until the entry point runs."""
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 64) for fd in (sock_fd, server_pidfd)]
    for fd, want in zip(high, (SOCK_FD, SERVER_FD), strict=True):
        os.dup2(fd, want, inheritable=False)
    os.closerange(SERVER_FD + 1, 1 << 16)  # every zygote fd, incl. the copies above
    devnull = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)


def _recv_archive(fd: int) -> int:
    """The disk archive the server opened for this sandbox (SandboxSpec.files): one byte + SCM_RIGHTS
    right after the request frame."""
    with socket.socket(fileno=os.dup(fd)) as sock:
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
    if len(fds) != 1:
        raise RuntimeError("the server announced a disk archive but sent none")
    return fds[0]


def _send_disk(fd: int, disk_fd: int) -> None:
    """The disk's root (O_PATH) to the server, for its exports (LinuxBackend.export_files); the
    sandbox never holds it: closed right after."""
    data = encode_frame({"id": 0, "event": "disk"})
    try:
        with socket.socket(fileno=os.dup(fd)) as sock:
            if socket.send_fds(sock, [data], [disk_fd]) != len(data):
                raise RuntimeError("the disk frame was cut short")
    finally:
        os.close(disk_fd)


def _host_pid() -> int:
    """Our pid as the host sees it: /proc is still the host's here (the zygote's mount namespace)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("NSpid:"):
                return int(line.split()[1])
    raise RuntimeError("/proc/self/status has no NSpid line")


def run_child(sock_fd: int, zygote_pid: int, server_pidfd: int, cgroup: str, staging: str,
              resolve_entry: Callable[[str | None], Callable[..., Any]], seccomp_filter: Any,
              yield_cpu: bool = True) -> NoReturn:
    """Runs in the zygote's fresh child (pid 1 of a new pid namespace). Never returns. `yield_cpu`: a
    standby nobody waits for yet, prepared at the lowest CPU weight."""
    step = "start"
    try:
        for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_DFL)
        # A child still being prepared dies with its zygote. The id change clears this, on purpose: a
        # prepared sandbox outlives its zygote (a replaced zygote must not take sandboxes along).
        sc.prctl(sc.PR_SET_PDEATHSIG, signal.SIGKILL)
        if not yield_cpu and not rootless.active():
            os.setpriority(os.PRIO_PROCESS, 0, 0)  # a create waits: not the zygote's nice, from the start
        _place_fds(sock_fd, server_pidfd)
        if os.getppid() != zygote_pid:
            os._exit(1)  # the zygote was gone before PDEATHSIG was set
        _send(SOCK_FD, {"id": 0, "event": "spawned", "host_pid": _host_pid(), "cgroup": cgroup})
    except BaseException:  # noqa: BLE001 - nobody to tell: the server sees the socket close
        os._exit(1)
    cg: Cgroups | None = None
    cg_fds: list[int] = []
    try:
        step = "cgroups"
        cg = Cgroups.at(cgroup)
        cg.create_and_join(0)  # 0: the writer itself
        if yield_cpu:  # a standby yields the CPU until its claim (backend.create) ...
            cg.set_cpu_weight(standby=True)
        if not rootless.active():  # (rootless: no cgroup, and lowering a nice value needs host privilege)
            os.setpriority(os.PRIO_PROCESS, 0, 0)  # ... by its cgroup's weight from now on, not the zygote's nice
        cg, cg_fds = cg.opened(SERVER_FD + 1)  # limits are written after the pivot, when /sys is out of sight
        step = "oom_score_adj"
        child_oom = _lower_oom_score()
        step = "root filesystem"
        sc.unshare(sc.CLONE_NEWNS)
        rootfs.enter(staging)
        _mark("root entered")
        step = "preparation"
        # The preparation comes from the server itself, on the sandbox's own socket.
        with socket.socket(fileno=os.dup(SOCK_FD)) as sock:
            frame = recv_frame(sock)
        if frame is None:
            os._exit(0)  # the server gave up on this sandbox before sending it
        req = frame.header
        _mark("prepared")
        entry = resolve_entry(req.get("entry"))
    except BaseException as e:  # noqa: BLE001
        _fail(SOCK_FD, step, e)
    req["child_oom_score_adj"] = child_oom
    _run_sandbox(SOCK_FD, req, cg, cg_fds, entry, seccomp_filter)


def _run_sandbox(fd: int, req: dict[str, Any], cg: Cgroups, cg_fds: list[int], entry: Callable[..., Any],
                 seccomp_filter: Any) -> NoReturn:
    step = "request"
    try:
        sandbox_id: str = req["sandbox_id"]
        limits = Limits(**req["limits"])
        uid, gid = int(req["host_uid"]), int(req["host_gid"])
        root_uid, root_gid = int(req.get("root_uid", 0)), int(req.get("root_gid", 0))
        if min(uid, gid, root_uid, root_gid) <= 0 or len({uid, root_uid}) < 2 or len({gid, root_gid}) < 2:
            raise ValueError("refusing to run a sandbox as host root, or with one host id for both of its users")
        files_fd = _recv_archive(fd) if req.get("files") else -1  # never for a standby of the pool
        image = req.get("image")  # a template made from an image: its layers follow (image_root.py)
        layer_fds = image_root.receive_layers(fd, int(image["layers"])) if image else []
        volumes = req.get("volumes") or []  # then the volumes' mounts (volume_mounts.py)
        volume_fds = volume_mounts.receive(fd, len(volumes))
        step = "cgroup limits"
        cg.set_limits(limits)
        by_cgroup = cg.controllers()  # (rootless: maybe none or some; the rlimits stand in for the others)
        for cg_fd in cg_fds:
            os.close(cg_fd)
        step = "user namespace"
        _mark(step)
        # The sandbox's user namespace, made and mapped by us (host root) so that it maps two ids:
        # its root (0) and its user (1000), each to a host id of this sandbox's own. Host root is not
        # mapped. The overlays' idmapped lower layers read host root's files as the sandbox's root.
        userns = sc.new_userns(f"0 {root_uid} 1\n{rootfs.SANDBOX_UID} {uid} 1\n",
                               f"0 {root_gid} 1\n{rootfs.SANDBOX_UID} {gid} 1\n")
        step = "private mounts"
        _mark(step)
        # rootless: no copy-on-write overlays (their idmapped lower layers need host root): /usr, /etc ... read-only
        overlays_userns = -1 if rootless.active() else userns
        if image:
            disk_fd = image_root.finish(sandbox_id, limits.disk_limit_mb, uid, gid, layer_fds, (root_uid, root_gid),
                                        files_fd)
        else:
            disk_fd = rootfs.finish(sandbox_id, limits.disk_limit_mb, uid, gid, overlays_userns, files_fd,
                                    (root_uid, root_gid))
        if volumes:
            step = "volumes"
            volume_mounts.attach(volumes, volume_fds, userns)
        step = "disk handle"
        _send_disk(fd, disk_fd)
        step = "enter the user namespace"
        _mark(step)
        os.setgroups([])
        sc.setns(userns, sc.CLONE_NEWUSER)  # every capability there, none on the host from now on
        os.close(userns)
        os.setresgid(0, 0, 0)  # the namespace's root (host root_uid) until the agent's ids are set below
        os.setresuid(0, 0, 0)
        sc.prctl(sc.PR_SET_PDEATHSIG, 0)  # (the id change cleared it too): the sandbox outlives its zygote
        step = "unshare"
        _mark(step)
        # owned by the sandbox's user namespace: the mounts copied into the new mount namespace are locked
        sc.unshare(sc.CLONE_NEW_ALL & ~sc.CLONE_NEWPID & ~sc.CLONE_NEWUSER)
        step = "hostname"
        _mark(step)
        sc.sethostname(sandbox_id)
        step = "loopback"
        _lo_up()
        step = "namespace limits"
        _mark(step)
        ns_limits.confine_namespaces()
        step = "rlimits"
        ns_limits.set_rlimits(limits, by_cgroup)
        step = "sandbox ids"
        # The agent runs as the sandbox's user (1000) and keeps ROOT_CAPS only in its permitted set, to
        # start commands as the sandbox's root (runtime/processes.py); the bounding set is ROOT_CAPS too,
        # so no process of the sandbox, root included, ever holds more.
        _bound_capabilities(ROOT_CAPS)
        sc.prctl(sc.PR_SET_KEEPCAPS, 1)
        os.setresgid(rootfs.SANDBOX_UID, rootfs.SANDBOX_UID, rootfs.SANDBOX_UID)
        os.setresuid(rootfs.SANDBOX_UID, rootfs.SANDBOX_UID, rootfs.SANDBOX_UID)
        sc.prctl(sc.PR_SET_KEEPCAPS, 0)
        step = "no_new_privs"
        sc.prctl(sc.PR_SET_NO_NEW_PRIVS, 1)
        step = "landlock"
        _mark(step)
        landlock_abi = landlock.restrict()
        step = "capabilities"
        _mark(step)
        sc.capset(ROOT_CAPS_MASK, 0)  # permitted only: nothing effective in the agent
        # the id change made us non-dumpable, which gives /proc/self/* to host root (unmapped here):
        # the agent's children could not even raise their own oom_score_adj (the agent closes itself)
        sc.prctl(sc.PR_SET_DUMPABLE, 1)
        step = "seccomp"
        _mark(step)
        seccomp_filter.load()
        step = "server alive"
        if select.select([SERVER_FD], [], [], 0)[0]:
            raise RuntimeError("the server exited")  # the agent watches SERVER_FD from now on
    except BaseException as e:  # noqa: BLE001
        _fail(fd, step, e)
    step = "entry point"
    try:
        _mark("fenced")
        if req.get("t0_ns"):
            t0 = int(req["t0_ns"])
            print("agentcell timing " + " ".join(f"{n.replace(' ', '_')}={(t - t0) / 1e6:.2f}" for n, t in _marks),
                  file=sys.stderr, flush=True)
        devnull = os.open("/dev/null", os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(devnull, i)
        os.close(devnull)
        envs = default_envs(sandbox_id)  # the tenant's own come with the server's claim (agent.serve)
        if image:
            image_root.system_paths()
            envs.update(image_envs(image))
        os.environ.clear()
        os.environ.update(envs)
        os.chdir(rootfs.HOME)
        sock = socket.socket(fileno=fd)
        config = {"sandbox_id": sandbox_id, "envs": envs, "home": rootfs.HOME, "landlock_abi": landlock_abi,
                  "child_oom_score_adj": req["child_oom_score_adj"], "server_pidfd": SERVER_FD,
                  # a policy's syscalls "strict": the agent loads it into itself (runtime/policy.py)
                  "strict_seccomp": getattr(seccomp_filter, "strict", None)}
        if image:
            config.update({"python": image.get("python", ""), "workdir": image.get("workdir", ""),
                           "start_cmd": image.get("start_cmd", ""), "ready_cmd": image.get("ready_cmd", "")})
        entry(sock, config)
        os._exit(0)
    except SystemExit as e:
        os._exit(e.code if isinstance(e.code, int) else 1)
    except BaseException as e:  # noqa: BLE001
        _fail(fd, step, e)
