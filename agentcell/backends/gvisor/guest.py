"""The sandbox's init inside gVisor: prepares the guest as its root, then becomes the agent as uid 1000.

runsc starts it (pid 1 of the guest kernel) as the guest's root, with the sandbox's socket as stdin
and stdout (a host socket the sentry imported: unlike a host UDS it survives checkpoint and restore,
each restore getting the new sandbox's socket). It reads its *preparation* frame on that socket (the
sandbox id, its limits), writes the sandbox's own /etc/hosts, /etc/hostname and sudo through the root's
memory overlay, sets the rlimits (RLIMIT_NPROC stands for the pids limit: a host pids.max would count
the sentry's threads and kill the whole sandbox), gives the guest the linux backend's mounts (_seal),
then drops to what the linux backend's agent is
(sandbox_init.py): uid 1000, the root capability set permitted only, no_new_privs, the same seccomp
filter, and serves the agent protocol.

A restored template or checkpoint takes its new host name through _Namer, a child that alone keeps
CAP_SYS_ADMIN: the agent and everything the tenant runs never hold it.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import errno
import fcntl
import os
import re
import socket
import sys
from typing import Any

from agentcell.backends.base import Limits
from agentcell.backends.linux import ns_limits, procfs, rootfs, sandbox_init, seccomp_filter
from agentcell.backends.linux import syscalls as sc
from agentcell.runtime import forkstate, rootcaps
from agentcell.runtime.protocol import recv_frame

SOCK_FD = 3
CAP_SETPCAP = 8
CAP_SYS_ADMIN = 21
_ID_RE = re.compile(r"^[a-z0-9]{1,63}$")
# pid 1's (the agent's) views of its memory: Linux lets no one without ptrace access to it open them,
# the sentry (this runsc) only checks the file's mode, which root's CAP_DAC_OVERRIDE passes. Covered by
# pid 1's own mem, whose open the sentry does check. (Its other threads' /proc/<tid> would show them
# too: the agent has none.)
_AGENT_VIEWS = ("auxv", "environ", "io", "maps", "smaps")


def _name_files(sandbox_id: str) -> None:
    rootfs.write_file("/etc/hostname", sandbox_id + "\n")
    rootfs.write_file("/etc/hosts", rootfs.etc_hosts(sandbox_id))


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


def _bind(path: str, flags: int, source: str | None = None) -> None:
    """A bind of `source` (`path` itself) on `path` with exactly `flags` (the sentry copies the
    source mount's read-only flag into a bind: the remount sets them all). /mnt's is recursive: the
    volumes mounted below it (volume_points.py) stay in sight, each with its own flags."""
    sc.mount(source or path, path, None, sc.MS_BIND | (sc.MS_REC if path == "/mnt" else 0))
    sc.mount(None, path, None, sc.MS_REMOUNT | sc.MS_BIND | flags)


def _seal() -> None:
    """The linux backend's mounts, made by the guest's root in the sentry before any tenant code runs
    (the seccomp filter then refuses mount and umount to everyone, and root lacks CAP_SYS_ADMIN): / and
    /dev read-only but for binds of what the linux backend overlays (rootfs.OVERLAYS, writable here in
    the root's memory overlay) and of the devices; the runtime read-only; /proc as procfs.py leaves it
    (but the sentry's own boot_id), and pid 1's memory views covered."""
    rw = sc.MS_NOSUID | sc.MS_NODEV
    ro = rw | sc.MS_RDONLY
    runtime = rootfs.python_paths()  # reads /proc/self/maps: before pid 1's is covered
    inside = [p for p, _ in rootfs.OVERLAYS if any(p.startswith(r + "/") for r in runtime)]  # the venv
    for path in [p for p, _ in rootfs.OVERLAYS if p not in inside] + [*runtime] + inside:
        if os.path.isdir(path):
            _bind(path, ro if path in runtime else rw)
    for name in rootfs.DEVICES:
        _bind(f"/dev/{name}", sc.MS_NOSUID | sc.MS_NOEXEC)
    for path in ("/", "/dev"):
        sc.mount(None, path, None, sc.MS_REMOUNT | sc.MS_BIND | sc.MS_RDONLY | sc.MS_NOSUID)
    files, dirs, frozen = procfs.present()
    for name in frozen:
        _bind(f"/proc/{name}", ro | sc.MS_NOEXEC)
    for name in files:
        if not name.endswith("boot_id"):
            _bind(f"/proc/{name}", ro | sc.MS_NOEXEC, "/dev/null")
    for path in [f"/proc/1/{t}{n}" for t in ("", "task/1/") for n in _AGENT_VIEWS]:
        _bind(path, ro | sc.MS_NOEXEC, "/proc/1/mem")  # opened, mem's ptrace check: EACCES as on Linux
    for name in dirs:
        sc.mount("tmpfs", f"/proc/{name}", "tmpfs", ro | sc.MS_NOEXEC, "size=4k,mode=0555")


class _Namer:
    """A child the init forks before it drops its privileges, keeping only CAP_SYS_ADMIN and
    CAP_DAC_OVERRIDE, to give the sandbox a new host name when a template or a checkpoint is restored
    as another sandbox. It reads names from a pipe only the agent holds, and does nothing else: the
    agent itself never holds CAP_SYS_ADMIN, and nothing the sandbox runs can reach the pipe."""

    def __init__(self) -> None:
        r, w = os.pipe2(os.O_CLOEXEC)
        done_r, done_w = os.pipe2(os.O_CLOEXEC)
        pid = os.fork()
        if pid == 0:
            os.close(w)
            os.close(done_r)
            self._serve(r, done_w)
        os.close(r)
        os.close(done_w)
        self._w, self._done = w, done_r

    @staticmethod
    def _serve(r: int, done: int) -> None:
        try:
            for fd in range(3, 1024):  # the sandbox's socket above all
                if fd not in (r, done):
                    with contextlib.suppress(OSError):
                        os.close(fd)
            keep = (CAP_SYS_ADMIN, 1)  # CAP_DAC_OVERRIDE: /etc/hosts is root's
            _bound_capabilities(keep)
            sc.capset(sum(1 << c for c in keep), sum(1 << c for c in keep))
            with os.fdopen(r, "rb") as f:
                for line in f:
                    name = line.strip().decode()
                    ok = _ID_RE.match(name) is not None
                    if ok:
                        sc.sethostname(name)
                        _name_files(name)
                    os.write(done, b"1" if ok else b"0")
        finally:
            os._exit(0)

    def rename(self, name: str) -> None:
        os.write(self._w, name.encode() + b"\n")
        if os.read(self._done, 1) != b"1":
            raise ValueError(f"invalid sandbox name {name!r}")


_namer: _Namer | None = None


def _renamed(name: object) -> dict[str, str]:
    """The sandbox is `name` now: host name, /etc files, redrawn generators (this process's)."""
    if not isinstance(name, str) or not name or name == socket.gethostname():
        return {}
    assert _namer is not None
    _namer.rename(name)
    forkstate.refresh()
    return {"HOSTNAME": name}


def claimed(header: dict[str, Any]) -> dict[str, str]:
    """At the claim (agent.serve's hook): a standby restored from the template takes its own name;
    the env vars returned join the claim's (the claim itself makes every context redraw its own)."""
    return _renamed(header.get("hostname"))


def _register_rename_op() -> None:
    """``gvisor.rename``: a sandbox restored from a checkpoint of a claimed one (a fork, a resumed
    hibernation under another id) takes its own name; its contexts redraw their generators.
    ``gvisor.claim``: a standby's tenant env vars."""
    from agentcell.runtime import agent

    @agent.op("gvisor.rename")
    async def _rename(ag: Any, call: Any, frame: Any) -> dict[str, Any]:
        envs = _renamed(frame.header.get("hostname"))
        if envs:
            ag.claim(envs)  # the contexts get the new HOSTNAME, and redraw their generators with it
        return {}

    @agent.op("gvisor.claim")
    async def _claim(ag: Any, call: Any, frame: Any) -> dict[str, Any]:
        """A warm standby's claim (backends/gvisor/standby.py): named and reseeded when it was
        prepared, it gets its tenant's env vars now; the contexts redraw their generators again."""
        envs = frame.header.get("envs") or {}
        if not isinstance(envs, dict):
            raise ValueError("envs must be an object")
        ag.claim({str(k): str(v) for k, v in envs.items()})
        ag.contexts.forget_warm_up()  # the code they ran was the warm cell: a policy may still reach them
        return {}


def _bound_capabilities(keep: tuple[int, ...]) -> None:
    """sandbox_init's, less the ambient set: the sentry has none to clear (PR_CAP_AMBIENT is EINVAL)."""
    for cap in [c for c in range(64) if c != CAP_SETPCAP] + [CAP_SETPCAP]:  # the one that allows it last
        if cap not in keep:
            try:
                sc.prctl(sc.PR_CAPBSET_DROP, cap)
            except OSError as e:
                if e.errno != errno.EINVAL:  # past the last capability
                    raise


def _load_seccomp(bpf: bytes) -> None:
    buf = ctypes.create_string_buffer(bpf, len(bpf))
    prog = seccomp_filter._SockFprog(len(bpf) // 8, ctypes.addressof(buf))
    sc.prctl(sc.PR_SET_NO_NEW_PRIVS, 1)
    sc.prctl(seccomp_filter.PR_SET_SECCOMP, seccomp_filter.SECCOMP_MODE_FILTER, ctypes.addressof(prog))


def drop_to_agent(bpf: bytes, sandbox_id: str) -> dict[str, str]:
    """Become the linux agent's identity in a guest kernel (this one's and the microvm guest's): uid 1000,
    the root set permitted only (runtime/rootcaps.py), no_new_privs, the seccomp program `bpf`, the
    sandbox's environment and home. Returns that environment."""
    _bound_capabilities(sandbox_init.ROOT_CAPS)
    sc.prctl(sc.PR_SET_KEEPCAPS, 1)
    os.setgroups([])
    os.setresgid(rootfs.SANDBOX_UID, rootfs.SANDBOX_UID, rootfs.SANDBOX_UID)
    os.setresuid(rootfs.SANDBOX_UID, rootfs.SANDBOX_UID, rootfs.SANDBOX_UID)
    sc.prctl(sc.PR_SET_KEEPCAPS, 0)
    sc.prctl(sc.PR_SET_NO_NEW_PRIVS, 1)
    sc.capset(sandbox_init.ROOT_CAPS_MASK, 0)
    sc.prctl(sc.PR_SET_DUMPABLE, 1)
    _load_seccomp(bpf)
    rootcaps.GUEST_KERNEL = True  # uid 0 here is the guest kernel's root, never the host's
    envs = sandbox_init.default_envs(sandbox_id)
    os.environ.clear()
    os.environ.update(envs)
    os.chdir(rootfs.HOME)
    return envs


def main() -> None:
    _seal()  # first: a file open for writing on /dev would make its remount read-only fail (EBUSY)
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
    rootfs.write_file(rootfs.SUDO_PATH, rootfs.SUDO_SHIM, 0o755)
    _set_rlimits(limits)
    # built by the backend on the host: libseccomp probes the kernel's actions, and the sentry's
    # answers make it refuse the filter's; the program itself the sentry runs as Linux does
    bpf = base64.b64decode(req["seccomp"])
    # the linux agent's identity: uid 1000, the root set permitted only (runtime/rootcaps.py)
    global _namer
    _namer = _Namer()
    _register_rename_op()
    envs = drop_to_agent(bpf, sandbox_id)
    from agentcell.runtime import agent

    config = {"sandbox_id": sandbox_id, "envs": envs, "home": rootfs.HOME, "child_oom_score_adj": 0,
              "on_claim": claimed}
    if req.get("seccomp_strict"):  # a policy's syscalls "strict" (runtime/policy.py)
        config["strict_seccomp"] = seccomp_filter.Filter.of_program(base64.b64decode(req["seccomp_strict"]))
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
