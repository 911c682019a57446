"""The sandbox's init inside the microVM: pid 1 of the guest kernel, after the initramfs (initramfs.py).

It stays the guest's root for the VM's whole life and does two things:
  * it serves the host's *control* port (virtio-serial "control", guest root only): the preparation at a
    cold boot, and after every restore the clone's identity (host name, RNG reseed, clock step, disk
    size), the disk's export and import as tar. Everything it says is guest-reported: the host treats
    it as tenant data (backend.py).
  * it starts the agent as a child, with the "agentcell" port as its channel, in a guest cgroup whose
    pids.max is the sandbox's pids limit, dropped to what the linux backend's agent is (uid 1000, the
    root capability set permitted only, no_new_privs, the same seccomp filter). When the agent ends, the
    guest powers off: the host sees the VMM exit.

The guest kernel is the boundary here (the host never runs the tenant's code in its own kernel); the
agent's drop of privileges keeps the sandbox's behaviour the same as on the other backends (sudo to the
guest's root).
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import dataclasses
import fcntl
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from agentcell.backends.base import LIMIT_RANGES, Limits
from agentcell.backends.linux import rootfs, runtime_store, sandbox_etc
from agentcell.backends.linux import syscalls as sc
from agentcell.runtime.protocol import encode_frame

PORTS = "/sys/class/virtio-ports"
DISK = "/run/agentcell-disk"  # the initramfs moved the overlay's tmpfs here: the sandbox's disk
CGROUP = "/sys/fs/cgroup/agent"
BOOT_ID = "/run/agentcell-boot-id"
RNDADDENTROPY = 0x40085203
RNDRESEEDCRNG = 0x5207
RB_POWER_OFF = 0x4321FEDC
_MAX_CONTROL = 1 << 16


def _port(name: str) -> str:
    """The /dev node of the virtio-serial port `name` (no udev here to make /dev/virtio-ports/)."""
    for entry in os.listdir(PORTS):
        with open(os.path.join(PORTS, entry, "name")) as f:
            if f.read().strip() == name:
                return f"/dev/{entry}"
    raise RuntimeError(f"no virtio-serial port named {name}")


def _mounts() -> None:
    rw = sc.MS_NOSUID | sc.MS_NODEV
    sc.mount("proc", "/proc", "proc", rw | sc.MS_NOEXEC, None)
    sc.mount("sysfs", "/sys", "sysfs", rw | sc.MS_NOEXEC | sc.MS_RDONLY, None)
    sc.mount("cgroup2", "/sys/fs/cgroup", "cgroup2", rw | sc.MS_NOEXEC, None)
    os.makedirs("/dev/pts", exist_ok=True)
    sc.mount("devpts", "/dev/pts", "devpts", sc.MS_NOSUID | sc.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620,gid=5")
    with contextlib.suppress(FileNotFoundError):
        os.unlink("/dev/ptmx")
    os.symlink("pts/ptmx", "/dev/ptmx")
    os.makedirs("/dev/shm", exist_ok=True)
    # /dev/shm and /tmp live on the disk (the overlay's tmpfs), as on the other backends
    os.chmod("/tmp", 0o1777)
    os.makedirs(f"{DISK}/shm", mode=0o1777, exist_ok=True)
    os.chmod(f"{DISK}/shm", 0o1777)
    sc.mount(f"{DISK}/shm", "/dev/shm", None, sc.MS_BIND, None)
    # the guest's loopback: code that serves on 127.0.0.1 reaches itself
    subprocess.run(["/usr/sbin/ip", "link", "set", "lo", "up"], check=False, stderr=subprocess.DEVNULL)


class Control:
    """Frames (runtime/protocol.py's encoding) on the control port, read with a plain fd."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        self.buf = b""

    def _fill(self) -> bool:
        chunk = os.read(self.fd, 1 << 16)
        if not chunk:
            time.sleep(0.01)  # the host end not connected (yet): the port reads EOF until it is
            return False
        self.buf += chunk
        return True

    def has_frame(self) -> bool:
        if len(self.buf) < 8:
            return False
        hlen, plen = struct.unpack(">II", self.buf[:8])
        return len(self.buf) >= 8 + hlen + plen

    def recv(self) -> tuple[dict[str, Any], bytes]:
        import json

        while len(self.buf) < 8:
            self._fill()
        hlen, plen = struct.unpack(">II", self.buf[:8])
        if hlen > _MAX_CONTROL or plen > (64 << 20):
            raise ValueError("control frame too large")
        while len(self.buf) < 8 + hlen + plen:
            self._fill()
        header = json.loads(self.buf[8:8 + hlen])
        payload = self.buf[8 + hlen:8 + hlen + plen]
        self.buf = self.buf[8 + hlen + plen:]
        return header, payload

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        data = memoryview(encode_frame(header, payload))
        while data:
            data = data[os.write(self.fd, data):]


def _frame_layout_matches() -> None:
    """encode_frame's layout is what Control.recv reads: two big-endian lengths, header, payload."""
    probe = encode_frame({"a": 1}, b"xy")
    hlen, plen = struct.unpack(">II", probe[:8])
    assert plen == 2 and len(probe) == 8 + hlen + plen, "runtime/protocol.py's framing changed"


def _identity(req: dict[str, Any], entropy: bytes) -> None:
    """This guest is the sandbox `req["hostname"]` now: name, /etc files, fresh randomness, the host's
    time, the disk's size."""
    name = str(req.get("hostname") or "")
    if entropy:  # credited, then the CRNG rekeyed at once: a clone draws nothing its template drew
        buf = struct.pack("ii", len(entropy) * 8, len(entropy)) + entropy
        with open("/dev/random", "wb", buffering=0) as f:
            fcntl.ioctl(f, RNDADDENTROPY, buf)
            fcntl.ioctl(f, RNDRESEEDCRNG)
    if name:
        sc.sethostname(name)
        rootfs.write_file("/etc/hostname", name + "\n")
        rootfs.write_file("/etc/hosts", rootfs.etc_hosts(name))
        _new_machine_ids()
    if "time_ns" in req:
        _settime(int(req["time_ns"]))
    if req.get("disk_mb"):
        sc.mount(None, DISK, None, sc.MS_REMOUNT | sc.MS_NOSUID | sc.MS_NODEV, f"size={int(req['disk_mb'])}m")
    if "net" in req:
        _network(req["net"])
    if req.get("pids") and os.path.isdir(CGROUP):
        with open(f"{CGROUP}/pids.max", "w") as f:
            f.write(str(int(req["pids"])))
    if req.get("memory_max") and os.path.isdir(CGROUP):  # the tenant's processes and files, and the agent
        with open(f"{CGROUP}/memory.max", "w") as f:
            f.write(str(int(req["memory_max"])))


def _new_machine_ids() -> None:
    """A machine id and a boot id of its own: the kernel's boot_id was drawn once, at the template's boot,
    so every clone would share it; a file bound over it (its first time) holds the clone's."""
    rootfs.write_file("/etc/machine-id", os.urandom(16).hex() + "\n", 0o444)
    rootfs.write_file(BOOT_ID, str(uuid.UUID(bytes=os.urandom(16), version=4)) + "\n", 0o444)
    with open("/proc/self/mountinfo") as f:
        bound = " /proc/sys/kernel/random/boot_id " in f.read()
    if not bound:
        sc.mount(BOOT_ID, "/proc/sys/kernel/random/boot_id", None, sc.MS_BIND, None)
        sc.mount(None, "/proc/sys/kernel/random/boot_id", None,
                 sc.MS_REMOUNT | sc.MS_BIND | sc.MS_RDONLY | sc.MS_NOSUID | sc.MS_NODEV | sc.MS_NOEXEC, None)


def _network(net: dict[str, str] | None) -> None:
    """eth0 as the host says: the sandbox side of its link on the egress router (address, gateway, MAC,
    the router's resolver), or down with no address (no link). A clone restored from a template or a
    snapshot drops whatever its original had. The guest's root could change all this: the router only
    forwards what carries the link's own address (network/router.py)."""
    def ip(*args: str) -> None:
        subprocess.run(["/usr/sbin/ip", *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    with contextlib.suppress(OSError):  # the router has no IPv6 for anyone
        with open("/proc/sys/net/ipv6/conf/eth0/disable_ipv6", "w") as f:
            f.write("1")
    ip("link", "set", "eth0", "down")
    ip("addr", "flush", "dev", "eth0")
    if not net:
        rootfs.write_file("/etc/resolv.conf", "")
        return
    ip("link", "set", "eth0", "address", net["mac"])
    ip("addr", "add", net["address"], "dev", "eth0")
    ip("link", "set", "eth0", "up")
    ip("route", "replace", "default", "via", net["gateway"], "dev", "eth0")
    rootfs.write_file("/etc/resolv.conf", f"nameserver {net['resolver']}\noptions timeout:2 attempts:2 edns0\n")


def _trust(pem: str) -> None:
    """The egress proxy's CA in the guest's trust store, as the linux backend's sandboxes have it: the
    system bundle, its own file, and certifi's bundle (requests, httpx and pip read that one)."""
    import glob

    path = "/run/agentcell-egress-ca.pem"
    rootfs.write_file(path, pem)
    sandbox_etc.trust("/etc", path)
    for bundle in glob.glob(f"{runtime_store.NEUTRAL_ROOT}/venv/lib/python*/site-packages/certifi/cacert.pem"):
        shutil.copyfile(f"/etc/{sandbox_etc.SYSTEM_BUNDLE}", bundle)


def _settime(ns: int) -> None:
    class Timespec(ctypes.Structure):
        _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

    libc = ctypes.CDLL(None, use_errno=True)
    ts = Timespec(ns // 1_000_000_000, ns % 1_000_000_000)
    if libc.clock_settime(0, ctypes.byref(ts)) != 0:  # CLOCK_REALTIME
        raise OSError(ctypes.get_errno(), "clock_settime")


def _agent_cgroup(limits: Limits) -> None:
    """The agent and all it starts in one guest cgroup: pids.max is the sandbox's pids limit, memory.max
    its memory limit (the VM's RAM may be more: a standby's is the template's, whatever the claim's)."""
    with contextlib.suppress(OSError):
        with open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
            f.write("+pids +memory")
    os.makedirs(CGROUP, exist_ok=True)
    with open(f"{CGROUP}/pids.max", "w") as f:
        f.write(str(limits.pids))


def _start_agent(channel: str, sandbox_id: str, limits: Limits, req: dict[str, Any]) -> int:
    """Fork the agent: in the guest cgroup, pid 1 of a pid namespace of its own (as on the linux backend:
    nothing it starts can signal it, `kill -9 -1` included), dropped to the linux agent's identity,
    serving `channel`. The pid returned is a small parent that waits for it and ends with it."""
    pid = os.fork()
    if pid:
        return pid
    try:
        with open(f"{CGROUP}/cgroup.procs", "w") as f:
            f.write("0")
        os.setsid()
        sc.unshare(sc.CLONE_NEWPID | sc.CLONE_NEWNS)
        agent_pid = os.fork()
        if agent_pid:
            # pid 1 watches this parent: were the guest OOM killer to take it (a tenant's hog in the same
            # cgroup), the VM would power off. It holds nothing: never its victim
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("-1000")
            _, status = os.waitpid(agent_pid, 0)
            os._exit(os.waitstatus_to_exitcode(status) & 0xFF)
        # pid 1 now: a /proc of this namespace, in a mount namespace of its own
        sc.mount(None, "/", None, sc.MS_REC | sc.MS_PRIVATE, None)
        sc.mount("proc", "/proc", "proc", sc.MS_NOSUID | sc.MS_NODEV | sc.MS_NOEXEC, None)
        # the guest's OOM killer takes the tenant's processes before the agent (its children set 0)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("-900")
        fd = os.open(channel, os.O_RDWR | os.O_CLOEXEC)  # before /dev is replaced
        from agentcell.backends.gvisor import guest as gvisor_guest

        _agent_view(gvisor_guest._seal)
        # the guest cgroup's pids.max is the process bound (set again at each claim); an RLIMIT_NPROC,
        # fixed at the template's boot, could not follow a claim's pids limit
        gvisor_guest._set_rlimits(dataclasses.replace(limits, pids=int(LIMIT_RANGES["pids"][1])))
        envs = gvisor_guest.drop_to_agent(base64.b64decode(req["seccomp"]), sandbox_id)
        from agentcell.backends.linux import seccomp_filter
        from agentcell.runtime import agent

        _register_ops()
        config: dict[str, Any] = {"sandbox_id": sandbox_id, "envs": envs, "home": rootfs.HOME,
                                  "child_oom_score_adj": 0, "channel_fd": fd}
        if req.get("seccomp_strict"):
            config["strict_seccomp"] = seccomp_filter.Filter.of_program(base64.b64decode(req["seccomp_strict"]))
        if req.get("preload"):
            agent.preload()
        devnull = os.open("/dev/null", os.O_RDWR)
        for i in (0, 1, 2):
            os.dup2(devnull, i)
        os.close(devnull)
        agent.serve(None, config)
    except BaseException:  # noqa: BLE001 - a child of pid 1: say why on the console, then end
        import traceback

        traceback.print_exc()
    finally:
        os._exit(1)


def _agent_view(seal: Callable[[], None]) -> None:
    """In the agent's mount namespace, before any tenant code: what the linux backend's sandbox sees, so
    the guest's root meets the same walls (the guest kernel is the boundary; this keeps the behaviour).
    A /dev of the devices a program needs (never the disks, consoles or the host's ports), no /sys, the
    disk's own tmpfs out of sight, then gvisor/guest.py's seal: / read-only but for the overlays, the
    home and /tmp; /proc masked as procfs.py says, but its boot_id the clone's own and its sysrq-trigger
    left to the guest's root."""
    flags = sc.MS_NOSUID | sc.MS_NOEXEC
    for path in (rootfs.HOME, "/tmp"):  # on the root's overlay here: their own mounts, left writable
        sc.mount(path, path, None, sc.MS_BIND, None)
    sc.mount("tmpfs", "/sys", "tmpfs", flags | sc.MS_NODEV, "size=64k,mode=0755")  # over sysfs, in here only
    dev = "/sys/dev"
    os.mkdir(dev)
    sc.mount("tmpfs", dev, "tmpfs", flags, "size=64k,mode=0755")
    for name in rootfs.DEVICES:
        with open(f"{dev}/{name}", "w"):
            pass
        sc.mount(f"/dev/{name}", f"{dev}/{name}", None, sc.MS_BIND, None)
    for name in ("pts", "shm"):
        os.mkdir(f"{dev}/{name}")
        sc.mount(f"/dev/{name}", f"{dev}/{name}", None, sc.MS_BIND, None)
    for link, target in (("ptmx", "pts/ptmx"), ("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"),
                         ("stdout", "/proc/self/fd/1"), ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{dev}/{link}")
    sc.mount(dev, "/dev", None, sc.MS_MOVE, None)
    os.rmdir(dev)
    sc.mount(None, "/sys", None, sc.MS_REMOUNT | sc.MS_RDONLY | flags | sc.MS_NODEV, None)
    sc.mount("tmpfs", DISK, "tmpfs", sc.MS_RDONLY | flags | sc.MS_NODEV, "size=4k,mode=0555")
    seal()
    # the one difference: the guest's root may crash or reboot its own VM, as on any VM (the host sees
    # its VMM end; tests/test_microvm.py's panic)
    sc.umount2("/proc/sysrq-trigger", sc.MNT_DETACH)
    sc.mount(BOOT_ID, "/proc/sys/kernel/random/boot_id", None, sc.MS_BIND, None)
    sc.mount(None, "/proc/sys/kernel/random/boot_id", None,
             sc.MS_REMOUNT | sc.MS_BIND | sc.MS_RDONLY | flags | sc.MS_NODEV, None)


def _register_ops() -> None:
    """``microvm.rename``: a sandbox restored from a memory image under another id (a fork, a resume):
    pid 1 renamed the guest over the control port; the contexts get the new HOSTNAME and redraw their
    generators."""
    from agentcell.runtime import agent, forkstate

    @agent.op("microvm.claim")
    async def _claim(ag: Any, call: Any, frame: Any) -> dict[str, Any]:
        """A warm standby's claim (gvisor/standby.py's): its tenant's env vars."""
        envs = frame.header.get("envs") or {}
        if not isinstance(envs, dict):
            raise ValueError("envs must be an object")
        ag.claim({str(k): str(v) for k, v in envs.items()})
        ag.contexts.forget_warm_up()
        return {}

    @agent.op("microvm.rename")
    async def _rename(ag: Any, call: Any, frame: Any) -> dict[str, Any]:
        name = str(frame.header.get("hostname") or "")
        forkstate.refresh()
        if name:
            ag.claim({"HOSTNAME": name})
        return {}


def _export(ctl: Control) -> None:
    """tar as the guest's root: its output goes to the host in "data" frames, then "done"."""
    proc = subprocess.Popen(EXPORT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd="/")
    assert proc.stdout is not None and proc.stderr is not None
    while chunk := proc.stdout.read(1 << 20):
        ctl.send({"event": "data"}, chunk)
    err = proc.stderr.read()
    ctl.send({"event": "done", "code": proc.wait(), "error": err.decode(errors="replace")[-1000:]})


EXPORT = ["/usr/bin/tar", "--format=pax", "--numeric-owner", "--sparse", "-C", "/",
          "--transform=s,^home/user,home,", "-cf", "-", "home/user", "tmp"]
IMPORT = ["/usr/bin/tar", "-x", "--numeric-owner", "--same-permissions", "-C", "/", "--anchored",
          "--exclude=root", "--transform=s,^home,home/user,", "-f", "-"]


class _Import:
    """tar reading an archive on its stdin. Its complaints go to a file, never a pipe nobody reads
    while the archive is still coming: a pipe would fill, tar stop reading, and both wait forever."""

    def __init__(self) -> None:
        import tempfile

        self.err = tempfile.TemporaryFile(dir="/run")
        self.proc = subprocess.Popen(IMPORT, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=self.err,
                                     cwd="/")

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.write(data)

    def end(self) -> tuple[int, str]:
        """tar's exit code and the last of what it said."""
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()
        code = self.proc.wait()
        self.err.seek(0, os.SEEK_END)
        self.err.seek(max(0, self.err.tell() - 1000))
        said = self.err.read().decode(errors="replace")
        self.err.close()
        return code, said


def _serve_control(ctl: Control, agent_pid: int) -> None:
    """The host's requests, one at a time, until the agent ends; then power off."""
    pidfd = os.pidfd_open(agent_pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    poller.register(ctl.fd, select.POLLIN)
    importing: _Import | None = None
    while True:
        # a frame already read whole (one read may bring several: an archive's last chunk and "import")
        # is served before waiting on the port, which has nothing more to say about it
        waiting = ctl.has_frame()
        ready = dict(poller.poll(0 if waiting else None))
        if pidfd in ready:
            return
        if not waiting and ctl.fd not in ready:
            continue
        if not ctl.buf and not ctl._fill():
            continue
        try:
            header, payload = ctl.recv()
            op = header.get("op")
            if op == "identity":
                _identity(header, payload)
                ctl.send({"event": "ok"})
            elif op == "export":
                _export(ctl)
            elif op == "import-chunk":  # the archive comes in chunks into tar's stdin; "import" ends it
                importing = importing or _Import()
                importing.write(payload)
            elif op == "import":
                code, said = (importing or _Import()).end()
                ctl.send({"event": "done", "code": code, "error": said})
                importing = None
            else:
                ctl.send({"event": "error", "error": f"unknown op {op!r}"})
        except Exception as e:  # noqa: BLE001 - one bad request must not end the guest
            ctl.send({"event": "error", "error": f"{type(e).__name__}: {e}"})


def main() -> None:
    _frame_layout_matches()
    _mounts()
    ctl = Control(_port("control"))
    req, _ = ctl.recv()  # the preparation: sandbox id, limits, filters
    sandbox_id = str(req["sandbox_id"])
    limits = Limits(**req["limits"])
    _identity({"hostname": sandbox_id, "disk_mb": limits.disk_limit_mb,
               **({"net": req["net"]} if "net" in req else {})}, b"")
    if req.get("ca"):
        _trust(str(req["ca"]))
    rootfs.write_file(rootfs.SUDO_PATH, rootfs.SUDO_SHIM, 0o755)
    shutil.chown(rootfs.HOME, rootfs.SANDBOX_UID, rootfs.SANDBOX_UID)
    _agent_cgroup(limits)
    _identity({"memory_max": req.get("memory_max")}, b"")
    pid = _start_agent(_port("agentcell"), sandbox_id, limits, req)
    ctl.send({"event": "started"})
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _serve_control(ctl, pid)
    os.sync()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.reboot(RB_POWER_OFF)


if __name__ == "__main__":
    try:
        main()
    except BaseException as e:  # noqa: BLE001 - pid 1: say why on the console, then power off
        import traceback

        traceback.print_exception(e, file=sys.stderr)
        sys.stderr.flush()
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).reboot(RB_POWER_OFF)
        os._exit(1)
