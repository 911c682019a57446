"""MicrovmBackend: every sandbox is a virtual machine with its own guest kernel (QEMU, jailed).

A sandbox is a jailed QEMU (vmm.py) booting Debian's cloud kernel (kernel.py) with agentcell's
initramfs (initramfs.py) over a read-only root image (image.py); its pid 1 (guest.py) serves the
host's control port and starts the agent, which speaks the usual protocol over a virtio-serial port.
The host end of that port is one end of a socketpair the server keeps (RunningSandbox.sock), exactly
as with the other backends.

Creation is by restore, not boot: at start the backend boots one VM whose agent is ready, stops it and
saves its device state (~64 KiB) while its RAM stays in a file. Each standby is a new QEMU that maps
that file copy-on-write (share=off), loads the device state and runs on; it then takes an identity of
its own (host name, a reseeded RNG, the host's clock) and runs the warm cell (gvisor/standby.py) for no
tenant, and waits stopped. A create continues a standby, steps its clock and hands it the tenant's env
vars. Limits no standby has (another memory size or vCPU count) boot a VM for the create (seconds).

Accelerators: "kvm" on hosts with hardware virtualization; "tcg" (QEMU's emulator) anywhere else, much
slower, and not a hardware isolation boundary: such a server says so in /health, its banner and every
sandbox's info. "auto" boots a probe VM under KVM and refuses to start if that does not work.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

from agentcell.backends.base import (
    Asker,
    Backend,
    Limits,
    RunningSandbox,
    SandboxSpec,
    policy_parts,
)
from agentcell.backends.cgroup_backend import CgroupSandboxes, OwnSandboxes, kill_cgroup
from agentcell.backends.gvisor import seccomp_extra, standby
from agentcell.backends.gvisor.backend import GVISOR_POLICY, _du
from agentcell.backends.linux import cgroups, host, runtime_store, uids
from agentcell.backends.linux import syscalls as sc
from agentcell.backends.linux.backend import _read_frame
from agentcell.backends.microvm import image, initramfs, kernel, vmm, vmm_seccomp
from agentcell.backends.microvm.qmp import Qmp, QmpError
from agentcell.backends.pool import StandbyPool
from agentcell.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    ResourceExhaustedError,
    SandboxError,
    SandboxGoneError,
)
from agentcell.network.policy import NetworkPolicy
from agentcell.network.router import MAX_SLOTS, RESOLVER, EgressError, link_addresses
from agentcell.network.secrets import HeaderRule
from agentcell.network.service import Egress, EgressSettings
from agentcell.network.tunnel import EgressTunnel, TunnelConfigError
from agentcell.policy.model import Policy, PolicyError
from agentcell.runtime.protocol import encode_frame
from agentcell.server import progress

# The template's RAM file lives here (<state dir>/microvm/<instance>), on a disk, not in a tmpfs: a clone's
# first touch of a page the template never used reads a hole, which a tmpfs fills with a new unreclaimable
# page and a disk's page cache with a clean, reclaimable one.
STATE_SUBDIR = "microvm"
READY_TIMEOUT = 120.0  # a restore's steps, a claim
BOOT_TIMEOUT = 600.0  # a cold boot imports the whole runtime: ~30 s under TCG, minutes on a loaded host
PREPARE_PARALLEL = 2
STANDBYS = 4
PROBE_TIMEOUT = 20.0
EMULATED = "emulated — no hardware isolation claim"
_RENAME_CALL = (1 << 31) - 1
_MAX_CONTROL_PAYLOAD = 4 << 20
# The guest's own memory beside the tenant's: its kernel, page cache, pid 1, the agent and its warm context
# (~230 MiB charged in the guest cgroup at a claim under TCG, of which ~175 MiB reclaimable page cache)
GUEST_OVERHEAD_MB = 256
AGENT_BASELINE_MB = 128  # what the guest cgroup holds beyond memory_mb: the agent and its warm context
VMM_PIDS = 512
VMM_LOG_BYTES = 16 << 10  # QEMU's threads: vCPUs, I/O workers, RCU, the main loop
CMDLINE = ("console=ttyS0 quiet loglevel=1 panic=-1 8250.nr_uarts=1 random.trust_cpu=off "
           "transparent_hugepage=never")

NO_EGRESS = ("this server gives sandboxes no internet (its operator started it with --egress-uplink none); "
             "create the sandbox with allow_internet_access=False")

MICROVM_POLICY = {**GVISOR_POLICY,
                  "policy.exec": "the microvm backend cannot enforce exec rules: the guest's execs happen in its own "
                                 "kernel, out of the host's sight; use the linux backend for exec rules",
                  "policy.files": "the microvm backend cannot enforce file rules (the guest's files are its own "
                                  "kernel's); use the linux backend for file rules",
                  "policy.processes": "the microvm backend cannot change a running sandbox's process limit yet; "
                                      "create the sandbox with the pids limit it needs",
                  "policy.network": "the microvm backend cannot ask about connections yet; use the linux backend "
                                    "for network ask"}


@dataclass
class _Files:
    """What every VM of the backend is made from, opened once, read-only, passed to each VMM by fd."""

    kernel: int
    initrd: int
    image: int


class MicrovmSandbox(RunningSandbox):
    def __init__(self, sandbox_id: str, sock: socket.socket, directory: str, cgroup: str, limits: Limits,
                 uid: int) -> None:
        self.sandbox_id = sandbox_id
        self.sock = sock
        self.dir = directory
        self.cgroups = cgroups.Cgroups.at(cgroup.lstrip("/"))
        self.limits = limits  # the claim's (the guest cgroup holds the tenant to them)
        self.machine_limits = limits  # what the VM was made with: its RAM and vCPUs (a standby's: the template's)
        self.uid = uid
        self.host_pid = -1
        self.proc: subprocess.Popen[bytes] | None = None
        self.qmp: Qmp | None = None
        self.control: socket.socket | None = None
        self.control_lock = asyncio.Lock()
        self.killed = False
        self.kill_lock = asyncio.Lock()
        self.stopped = False  # QMP stop (a standby waiting, a paused sandbox)
        self.log = b""  # the last VMM_LOG_BYTES of QEMU's output
        self.log_fd = -1
        self.slot = -1  # its link on the egress router (a TAP there, its fd the VMM's NIC), if any
        self.linked = False  # rules on the router to remove at kill

    def alive(self) -> bool:
        return not self.killed and self.proc is not None and self.proc.poll() is None


class MicrovmBackend(OwnSandboxes, CgroupSandboxes, Backend):
    name = "microvm"
    memory_snapshots = True

    def __init__(self, max_sandboxes: int = 1000, accel: str = "auto", ready_timeout: float = READY_TIMEOUT,
                 state_base: str | None = None, host_tuning: host.HostTuning | None = None, standbys: int = STANDBYS,
                 standby_limits: Limits | None = None, egress: Any = None, uid_base: int | None = None,
                 state_dir: str | None = None, record_denials: str = "failures", kernel_dir: str | None = None,
                 machine: str | None = None, **host_options: Any) -> None:
        if max_sandboxes < 1:
            raise ValueError("max_sandboxes must be at least 1")
        if accel not in ("auto", "kvm", "tcg"):
            raise ValueError(f"accel must be auto, kvm or tcg, got {accel!r}")
        # q35 where -M microvm is unusable (QEMU 7.2 under TCG hangs in it): AGENTCELL_MICROVM_MACHINE=q35
        machine = machine or os.environ.get("AGENTCELL_MICROVM_MACHINE") or "microvm"
        if machine not in ("microvm", "q35"):
            raise ValueError(f"the microvm backend's machine is microvm or q35, got {machine!r}")
        self.egress_settings: EgressSettings | None = egress if egress is not None and egress.enabled else None
        if self.egress_settings is not None:
            self.egress_settings.check()
        self.egress: Egress | None = None  # the router, once start() made it
        self._slots: set[int] = set()
        self._unlinking: set[asyncio.Task[None]] = set()  # killed sandboxes' slots on their way back
        self.accel_wanted = accel
        self.accel = accel if accel != "auto" else ""
        self.machine = machine
        self.kernel_dir = kernel_dir
        self.max_sandboxes = max_sandboxes
        self.standbys = standbys
        self.standby_limits = standby_limits or Limits()
        self.ready_timeout = ready_timeout
        self.boot_timeout = max(ready_timeout, BOOT_TIMEOUT)
        self.uid_base = uid_base
        self.instance = cgroups.new_instance_id()
        self.cgroup_parent = f"{cgroups.GROUP}/{self.instance}"
        state_base = state_base or os.path.join(state_dir or "/var/lib/agentcell", STATE_SUBDIR)
        self.state = os.path.join(state_base, self.instance)
        self.template_dir = os.path.join(self.state, "template")
        self.host_tuning = host_tuning or host.HostTuning(**host_options)
        self.host_budget: host.HostBudget | None = None
        self._uids: uids.UidRange | None = None
        self._free_uids: list[int] = []
        self._files: _Files | None = None
        self._image: image.Image | None = None
        self._runtime: runtime_store.Store | None = None
        self._sandboxes: dict[str, MicrovmSandbox] = {}
        self.claimed: set[str] = set()
        self._pool: StandbyPool[MicrovmSandbox] | None = None
        self._template_limits: Limits | None = None
        self._seccomp = ""
        self._seccomp_strict = ""
        self._vmm_seccomp = b""  # the VMM's allow-list as a BPF program (vmm_seccomp.py), built at start
        self.last_create_ms = 0.0

    # -- what the server says about this backend -------------------------------------------------

    @property
    def isolation(self) -> str:
        """How sandboxes are isolated, as /health and each sandbox's info say it."""
        if self.accel == "kvm":
            return "microvm (KVM)"
        return f"microvm (TCG, {EMULATED})"

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        try:
            await self._start()
        except BaseException:
            await self.close()  # a half-started backend leaves nothing: cgroups, uids, the RAM file
            raise

    async def _start(self) -> None:
        if os.geteuid() != 0:
            raise BackendUnavailableError("the microvm backend must run as root (the VMM jail, cgroups, uids)")
        if self._files is not None:
            return
        for tool, package in ((vmm.QEMU, "qemu-system-x86 (bookworm-backports: QEMU 10)"), ("bwrap", "bubblewrap"),
                              ("setpriv", "util-linux"), ("mksquashfs", "squashfs-tools")):
            if shutil.which(tool) is None:
                raise BackendUnavailableError(f"the microvm backend needs {tool}: apt-get install {package}")
        if not os.path.exists(initramfs.BUSYBOX):
            raise BackendUnavailableError("the microvm backend needs a static busybox: apt-get install busybox-static")
        try:
            guest_kernel = kernel.find(self.kernel_dir)
        except kernel.KernelMissingError as e:
            raise BackendUnavailableError(str(e)) from None
        try:
            stale = await asyncio.to_thread(cgroups.remove_stale_instances)
            if stale:
                print(f"agentcell: removed the cgroups of {len(stale)} dead server(s): {', '.join(stale)}",
                      file=sys.stderr)
            _remove_stale_states(os.path.dirname(self.state))
            cgroups.prepare_instance(self.instance)
        except cgroups.CgroupError as e:
            raise BackendUnavailableError(str(e)) from e
        await self._start_egress()
        try:
            self.host_budget = await asyncio.to_thread(host.prepare, self.cgroup_parent, self.max_sandboxes,
                                                       self.host_tuning)
        except OSError as e:
            raise BackendUnavailableError(f"cannot limit what sandboxes take from the host: {e}") from e
        size = self.max_sandboxes + self.standbys + 4  # the template, the probe, spares for restarts
        try:
            self._uids = uids.reserve(size, self.uid_base)
        except uids.UidRangeError as e:
            raise BackendUnavailableError(str(e)) from None
        self._free_uids = list(range(self._uids.base + size - 1, self._uids.base - 1, -1))
        os.makedirs(os.path.join(self.state, "vms"), mode=0o711, exist_ok=True)
        os.chmod(self.state, 0o711)  # VMMs reach nothing here by path; their fds suffice
        self._runtime = await asyncio.to_thread(runtime_store.ensure)
        with progress.step("microvm: the guest's root image"):
            self._image = await asyncio.to_thread(image.ensure, self._runtime)
        initrd = os.path.join(self.state, "initrd.gz")
        await asyncio.to_thread(initramfs.build, guest_kernel.modules, self._runtime.layout.executable, initrd)
        self._files = _Files(_open_ro(guest_kernel.vmlinuz), _open_ro(initrd), _open_ro(self._image.path))
        self._seccomp = _b64(seccomp_extra.build())
        self._seccomp_strict = _b64(seccomp_extra.build_strict())
        self._vmm_seccomp = vmm_seccomp.build()
        if not self.accel:
            with progress.step("microvm: probing KVM (a probe VM must boot under it)"):
                await self._probe_kvm()
        if self.standbys:
            with progress.step("microvm: booting and saving the template the standbys are restored from"):
                await self._build_template()
            self._pool = StandbyPool(self._prepare_standby, self.kill, MicrovmSandbox.alive, self.standbys,
                                     PREPARE_PARALLEL)
            self._pool.fill()

    async def _start_egress(self) -> None:
        """The linux backend's egress router, unchanged: each VM's link is a TAP device on it."""
        if self.egress_settings is None or self.egress is not None:
            return
        gone = await asyncio.to_thread(Egress.remove_stale, cgroups.instance_alive)
        if gone:
            print(f"agentcell: removed the egress routers of dead server(s): {', '.join(gone)}", file=sys.stderr)
        egress = Egress(self.egress_settings, self.instance)
        try:
            with progress.step("starting the sandboxes' egress router"):
                await egress.start()
        except (EgressError, OSError) as e:
            raise BackendUnavailableError(
                f"cannot set up the sandboxes' egress router: {e} (start with --egress-uplink none to run "
                "without internet for sandboxes)") from e
        self.egress = egress
        if self.recorder is not None:
            egress.sink = self.recorder.add  # connection and DNS events join the behaviour record

    async def _probe_kvm(self) -> None:
        """--accel auto: KVM only if a VM really boots under it (a software hypervisor such as PVM exposes
        /dev/kvm but cannot run a stock guest kernel); otherwise refuse, naming --accel tcg."""
        why = ""
        if not os.path.exists("/dev/kvm"):
            why = "there is no /dev/kvm"
        else:
            self.accel = "kvm"
            try:
                sb = await self._boot(self._new_id(), Limits(), timeout=PROBE_TIMEOUT, linked=False)
                await self.kill(sb)
                return
            except (SandboxError, OSError, QmpError) as e:
                why = f"a probe VM did not boot under KVM within {PROBE_TIMEOUT:g} s ({str(e)[:200]})"
            self.accel = ""
        raise BackendUnavailableError(
            f"the microvm backend found no usable hardware virtualization: {why}. Start the server with "
            "--accel tcg to run VMs under QEMU's emulator (slow, and no hardware isolation claim), or use "
            "another backend")

    def standby_pools(self) -> dict[str, StandbyPool[MicrovmSandbox]]:
        return {"base": self._pool} if self._pool is not None else {}

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        for sb in list(self._sandboxes.values()):
            with contextlib.suppress(Exception):
                await self.kill(sb)
        if self._unlinking:
            await asyncio.gather(*self._unlinking, return_exceptions=True)
        if self.egress is not None:
            await self.egress.close()
            self.egress = None
        if self._files is not None:
            for fd in (self._files.kernel, self._files.initrd, self._files.image):
                os.close(fd)
            self._files = None
        if self._image is not None:
            self._image.close()
            self._image = None
        shutil.rmtree(self.state, ignore_errors=True)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(cgroups.remove_tree, self.cgroup_parent)
        await asyncio.to_thread(host.release, self.cgroup_parent)
        if self._uids is not None:
            self._uids.release()
            self._uids = None
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None

    # -- VMs -------------------------------------------------------------------------------------

    def _check(self, spec_: SandboxSpec) -> None:
        self._check_basics(spec_)
        if (spec_.network.internet or spec_.secrets) and self.egress is None:
            raise InvalidArgumentError(NO_EGRESS)
        if spec_.volumes:
            raise InvalidArgumentError("the microvm backend cannot mount volumes yet; use the linux backend")

    def _machine(self, limits: Limits, fds: dict[str, int]) -> vmm.Machine:
        accel = self.accel or "tcg"
        cmdline = CMDLINE + (_tsc_hint() if accel == "tcg" else "")
        return vmm.Machine(memory_mb=_ram_mb(limits), vcpus=_vcpus(limits), accel=accel,
                           cmdline=cmdline, machine=self.machine, fds=fds)

    async def _spawn(self, sandbox_id: str, limits: Limits, ram: str = "anon", ram_fd: int = -1,
                     ram_shared: bool = False, incoming: bool = False, linked: bool = True) -> MicrovmSandbox:
        """A jailed QEMU for `sandbox_id` in its own cgroup, its QMP connected. Not yet booted or loaded.
        `linked` (and an egress router): its NIC is a new link on the router, closed (_link)."""
        assert self._files is not None, "start() first"
        if not self._free_uids:
            raise SandboxError("no VMM uid left in this server's range", "resource_exhausted")
        uid = self._free_uids.pop()
        directory = os.path.join(self.state, "vms", sandbox_id)
        os.makedirs(directory, mode=0o700)
        cgroup = f"/{self.cgroup_parent}/{sandbox_id}"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        qmp_ours, qmp_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        ctl_ours, ctl_theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sb = MicrovmSandbox(sandbox_id, ours, directory, cgroup, limits, uid)
        sb.control = ctl_ours
        self._sandboxes[sandbox_id] = sb
        tap = -1
        program = -1
        try:
            fds = {"kernel": self._files.kernel, "initrd": self._files.initrd, "image": self._files.image,
                   "qmp": qmp_theirs.fileno(), "agent": theirs.fileno(), "control": ctl_theirs.fileno()}
            if linked and self.egress is not None:
                tap = fds["tap"] = await self._link(sb)
            machine = self._machine(limits, fds)
            if ram_fd >= 0:
                ram = f"/dev/fd/{ram_fd}"
            kvm = _kvm_node(directory, uid) if machine.accel == "kvm" else None
            program = vmm_seccomp.program_fd(self._vmm_seccomp)  # read by bwrap, closed here after the spawn
            argv = vmm.jail_argv(vmm.qemu_argv(machine, ram, ram_shared, incoming), uid, machine.accel, program,
                                 kvm)
            host_limits = Limits(memory_mb=_ram_mb(limits) + vmm.VMM_OVERHEAD_MB, pids=VMM_PIDS,
                                 cpu_count=limits.cpu_count)
            cg = sb.cgroups
            await asyncio.to_thread(_make_cgroup, cg, host_limits)
            # QEMU's output into a pipe whose last VMM_LOG_BYTES the server keeps: whatever the guest makes
            # QEMU print, it costs neither disk nor more memory than that
            log_r, log_w = os.pipe2(os.O_CLOEXEC)
            try:
                pass_fds = [*fds.values(), program] + ([ram_fd] if ram_fd >= 0 else [])
                sb.proc = await asyncio.to_thread(
                    subprocess.Popen, argv, stdin=subprocess.DEVNULL, stdout=log_w, stderr=log_w, pass_fds=pass_fds,
                    preexec_fn=lambda: _join(cg), cwd="/")
            except BaseException:
                os.close(log_r)
                raise
            finally:
                os.close(log_w)
            sb.log_fd = log_r
            os.set_blocking(log_r, False)
            asyncio.get_running_loop().add_reader(log_r, _read_log, sb)
            sb.host_pid = sb.proc.pid
        except BaseException:
            for s in (theirs, qmp_theirs, ctl_theirs, qmp_ours):
                s.close()
            await self.kill(sb)
            raise
        finally:
            for s in (theirs, qmp_theirs, ctl_theirs):
                with contextlib.suppress(OSError):
                    s.close()
            if tap >= 0:  # the VMM's copy is the link's only end now: the link goes when the VMM does
                os.close(tap)
            if program >= 0:
                os.close(program)
        sb.qmp = Qmp(qmp_ours)
        try:
            await sb.qmp.connect(timeout=30)
        except BaseException as e:
            if sb.proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    await asyncio.to_thread(sb.proc.wait, 1)
            tail = self._log_tail(sb)
            await self.kill(sb)
            if isinstance(e, (QmpError, TimeoutError)):
                raise SandboxError(f"the VMM of sandbox {sandbox_id} did not start: {tail}") from None
            raise
        return sb

    async def _boot(self, sandbox_id: str, limits: Limits, ram_fd: int = -1, timeout: float | None = None,
                    linked: bool = True) -> MicrovmSandbox:
        """A VM booted from the kernel up to its agent's "ready" (it then waits for its claim)."""
        sb = await self._spawn(sandbox_id, limits, ram_fd=ram_fd, ram_shared=ram_fd >= 0, linked=linked)
        try:
            async with asyncio.timeout(timeout or self.boot_timeout):
                await self._control(sb, {"sandbox_id": sandbox_id, "limits": asdict(limits), "preload": True,
                                         "memory_max": (limits.memory_mb + AGENT_BASELINE_MB) << 20,
                                         "seccomp": self._seccomp, "seccomp_strict": self._seccomp_strict,
                                         "net": self._net(sb), "ca": self._egress_ca()},
                                    expect="started")
                sb.sock.setblocking(False)
                ready = await _read_frame(asyncio.get_running_loop(), sb.sock)
            if ready is None or ready.get("event") != "ready":
                raise SandboxError(f"sandbox {sandbox_id} ended during its boot: {await self._console(sb)}")
        except BaseException as e:
            console = await self._console(sb) if isinstance(e, TimeoutError) else ""
            await self.kill(sb)
            if isinstance(e, TimeoutError):
                raise SandboxError(f"sandbox {sandbox_id} did not boot within {timeout or self.boot_timeout:g} s: "
                                   f"{console}") from None
            raise
        return sb

    async def _control(self, sb: MicrovmSandbox, request: dict[str, Any], payload: bytes = b"",
                       expect: str = "ok") -> dict[str, Any]:
        """One request to the guest's pid 1 and its answer (guest-reported: checked, never trusted)."""
        assert sb.control is not None
        async with sb.control_lock:
            loop = asyncio.get_running_loop()
            sb.control.setblocking(False)
            await loop.sock_sendall(sb.control, encode_frame(request, payload))
            header, _ = await _read_control(loop, sb.control)
        if header.get("event") != expect:
            raise SandboxError(f"sandbox {sb.sandbox_id}'s guest refused {request.get('op', 'its preparation')}: "
                               f"{str(header.get('error') or header)[:500]}")
        return header

    async def _identity(self, sb: MicrovmSandbox, limits: Limits | None = None, name: str | None = None) -> None:
        """The clone's own name and randomness, the host's time now, its disk size and process limit;
        with a new name (a clone of a template or a snapshot), its own link's addresses too."""
        request: dict[str, Any] = {"op": "identity", "time_ns": time.time_ns()}
        if name:
            request["hostname"] = name
            request["net"] = self._net(sb)
        if limits is not None:
            request["disk_mb"] = limits.disk_limit_mb
            request["pids"] = limits.pids
            request["memory_max"] = (limits.memory_mb + AGENT_BASELINE_MB) << 20
        await self._control(sb, request, os.urandom(64) if name else b"")

    @staticmethod
    async def _rename_agent(sb: MicrovmSandbox) -> None:
        """The agent of a guest restored or claimed under another id (pid 1 renamed the guest): its
        contexts take the new HOSTNAME and redraw their generators (guest.py _register_ops)."""
        sb.sock.setblocking(False)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(sb.sock, encode_frame({"id": _RENAME_CALL, "op": "microvm.rename",
                                                       "hostname": sb.sandbox_id}))
        answer = await _read_frame(loop, sb.sock)
        if answer is None or answer.get("id") != _RENAME_CALL or answer.get("error"):
            raise SandboxError(f"sandbox {sb.sandbox_id} did not take its name: {answer}")

    # -- the network: a TAP on the linux backend's egress router per VM ---------------------------

    async def _link(self, sb: MicrovmSandbox) -> int:
        """A slot and its link on the router for `sb`, closed until its claim: the TAP's fd."""
        assert self.egress is not None
        slot = next((i for i in range(MAX_SLOTS) if i not in self._slots), None)
        if slot is None:
            raise SandboxError("no egress link left on this server's router", "resource_exhausted")
        self._slots.add(slot)
        try:
            fd = await self.egress.connect_tap(slot)
        except BaseException:
            self._slots.discard(slot)
            raise
        sb.slot, sb.linked = slot, True
        return fd

    @staticmethod
    def _net(sb: MicrovmSandbox) -> dict[str, str] | None:
        """What the guest puts on eth0 (guest.py): the sandbox side of its link, or nothing."""
        if sb.slot < 0:
            return None
        ours, theirs = link_addresses(sb.slot)
        octets = [int(o) for o in theirs.split(".")]
        mac = "02:ac:" + ":".join(f"{o:02x}" for o in octets)  # locally administered, one per link
        return {"address": f"{theirs}/30", "gateway": ours, "mac": mac, "resolver": RESOLVER}

    def _egress_ca(self) -> str | None:
        """The egress proxy's CA (it terminates TLS where a secret or header rule applies): every guest
        booted here trusts it, so the template's clones do too (network/ca.py; the CA lives in the server's
        state dir: snapshots restored after a restart trust the same one)."""
        if self.egress is None:
            return None
        with open(self.egress.ca_path) as f:
            return f.read()

    async def _unlink(self, slot: int) -> None:
        try:
            if self.egress is not None:
                await self.egress.disconnect(slot)
        finally:
            self._slots.discard(slot)

    @property
    def has_egress(self) -> bool:
        return self.egress is not None

    async def set_network(self, sandbox: RunningSandbox, policy: NetworkPolicy,
                          rules: tuple[HeaderRule, ...] = (), tunnel: EgressTunnel | None = None) -> None:
        sb = self._live(sandbox)
        if self.egress is None or sb.slot < 0:
            if policy.internet or rules or tunnel:
                raise InvalidArgumentError(NO_EGRESS)
            return
        await self._check_tunnel(tunnel)
        await self.egress.apply(sb.slot, policy, rules=rules, tunnel=tunnel)

    async def _check_tunnel(self, tunnel: EgressTunnel | None) -> None:
        """network.egressProxy within the operator's ceiling (network/tunnel.py), before anything changes."""
        if tunnel is not None and self.egress is not None:
            try:
                await self.egress.check_tunnel(tunnel)
            except TunnelConfigError as e:
                raise InvalidArgumentError(str(e)) from None

    # -- the template and its standbys -------------------------------------------------------------

    async def _build_template(self) -> None:
        """Boot one VM with its RAM in a file (shared), stop it once its agent is ready, save its device
        state. Every standby maps that file privately and loads that state."""
        t0 = time.perf_counter()
        limits = self.standby_limits
        os.makedirs(self.template_dir, mode=0o711, exist_ok=True)
        ram_path = os.path.join(self.template_dir, "ram")
        state_path = os.path.join(self.template_dir, "state")
        uid_hint = self._free_uids[-1]
        ram_fd = os.open(ram_path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.fchown(ram_fd, uid_hint, uid_hint)  # the template's VMM maps it shared, read-write
            sb = await self._boot(self._new_id(), limits, ram_fd=ram_fd, linked=False)  # never on a network
        finally:
            os.close(ram_fd)
        try:
            assert sb.qmp is not None
            await sb.qmp.call("stop")
            await sb.qmp.call("migrate-set-capabilities",
                              capabilities=[{"capability": "x-ignore-shared", "state": True}])
            out = os.open(state_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                await sb.qmp.send_fd("state", out)
            finally:
                os.close(out)
            await sb.qmp.call("migrate", uri="fd:state")
            await sb.qmp.wait_migration()
        finally:
            await self.kill(sb)
        # from now on no VMM may write it: root's, read-only to all (clones map it private)
        os.chown(ram_path, 0, 0)
        os.chmod(ram_path, 0o444)
        self._template_limits = limits
        print(f"agentcell: microvm template saved in {time.perf_counter() - t0:.1f} s "
              f"({_du(self.template_dir) >> 20} MiB of RAM file used, device state "
              f"{os.path.getsize(state_path) >> 10} KiB)", file=sys.stderr)

    async def _restore_template(self, sandbox_id: str) -> MicrovmSandbox:
        """A new VM from the template: its RAM the template's file, private; its devices the saved state."""
        assert self._template_limits is not None
        ram_fd = os.open(os.path.join(self.template_dir, "ram"), os.O_RDONLY | os.O_CLOEXEC)
        try:
            sb = await self._spawn(sandbox_id, self._template_limits, ram_fd=ram_fd, incoming=True)
        finally:
            os.close(ram_fd)
        try:
            await self._load(sb, os.path.join(self.template_dir, "state"), ignore_shared=True)
        except BaseException:
            await self.kill(sb)
            raise
        return sb

    async def _load(self, sb: MicrovmSandbox, state_path: str, ignore_shared: bool) -> None:
        """Load a saved state into a VMM started with -incoming defer, and run it."""
        assert sb.qmp is not None
        if ignore_shared:
            await sb.qmp.call("migrate-set-capabilities",
                              capabilities=[{"capability": "x-ignore-shared", "state": True}])
        fd = os.open(state_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            await sb.qmp.send_fd("state", fd)
        finally:
            os.close(fd)
        await sb.qmp.call("migrate-incoming", uri="fd:state")
        await sb.qmp.wait_migration(timeout=self.ready_timeout)
        await sb.qmp.call("cont")

    async def _prepare_standby(self) -> MicrovmSandbox:
        sandbox_id = self._new_id()
        sb = await self._restore_template(sandbox_id)
        try:
            async with asyncio.timeout(self.ready_timeout):
                await self._identity(sb, self._template_limits, name=sandbox_id)
            sb.sock.setblocking(False)
            await standby.warm(sb.sock, sandbox_id, self.ready_timeout)
            assert sb.qmp is not None
            await sb.qmp.call("stop")  # waits with no vCPU running
            sb.stopped = True
        except BaseException:
            await self.kill(sb)
            raise
        return sb

    # -- sandboxes -------------------------------------------------------------------------------

    def _claimable(self, wanted: Limits) -> bool:
        """A standby's vCPUs and rlimits are the template's, and its RAM (which a claim's memory limit may
        be below: the guest cgroup holds the tenant to it); its disk, pids and memory limit are set at the
        claim."""
        t = self._template_limits
        if t is None:
            return False
        return (wanted.memory_mb <= t.memory_mb and _vcpus(wanted) == _vcpus(t)
                and replace(wanted, disk_mb=None, pids=t.pids, cpu_count=t.cpu_count, memory_mb=t.memory_mb)
                == replace(t, disk_mb=None))

    async def create(self, spec_: SandboxSpec) -> RunningSandbox:
        t0 = time.perf_counter()
        self._check(spec_)
        await self._check_tunnel(spec_.secrets.tunnel)  # before a standby is taken for it
        sb: MicrovmSandbox | None = None
        if self._pool is not None and self._claimable(spec_.limits):
            sb = await self._pool.take()
        warm = sb is not None
        # a given id (a sandbox resumed from its files, cold under the other backends): a standby renamed
        renamed = warm and bool(spec_.sandbox_id)
        if sb is None:
            sb = await self._boot(spec_.sandbox_id or self._new_id(), spec_.limits)
        elif renamed:
            del self._sandboxes[sb.sandbox_id]  # its VMM's directory and cgroup keep the standby's name
            sb.sandbox_id = spec_.sandbox_id
            self._sandboxes[sb.sandbox_id] = sb
        try:
            sb.limits = spec_.limits
            if warm:
                assert sb.qmp is not None
                await sb.qmp.call("cont")
                sb.stopped = False
                await asyncio.to_thread(_retune, sb.cgroups, spec_.limits)
                async with asyncio.timeout(self.ready_timeout):
                    # the clock (it waited stopped); a new name, boot id and randomness when renamed
                    await self._identity(sb, spec_.limits, name=sb.sandbox_id if renamed else None)
            if spec_.files:
                await self._untar(sb, spec_.files)
            if self.egress is not None and sb.slot >= 0:  # before the claim: the tenant's first code meets it
                await self.egress.apply(sb.slot, spec_.network, sb.sandbox_id, spec_.secrets)
            # secrets: their placeholders only; the values stay here, with the egress proxy
            envs = {**spec_.envs, **spec_.secrets.envs()}
            if warm:
                await standby.claim(sb.sock, sb.sandbox_id, envs, self.ready_timeout, op="microvm.claim")
                if renamed:
                    async with asyncio.timeout(self.ready_timeout):
                        await self._rename_agent(sb)
            else:
                await asyncio.get_running_loop().sock_sendall(sb.sock, encode_frame(
                    {"id": 0, "op": "claim", "envs": envs, "hostname": sb.sandbox_id}))
        except BaseException:
            await self.kill(sb)
            raise
        sb.sock.setblocking(True)
        self.claimed.add(sb.sandbox_id)
        self.last_create_ms = (time.perf_counter() - t0) * 1000
        return sb

    async def kill(self, sandbox: RunningSandbox) -> None:
        assert isinstance(sandbox, MicrovmSandbox)
        sb = sandbox
        async with sb.kill_lock:
            if sb.killed:
                return
            sb.killed = True
            for s in (sb.sock, sb.control):
                if s is not None:
                    with contextlib.suppress(OSError):
                        s.close()
            if sb.qmp is not None:
                sb.qmp.close()
            await asyncio.to_thread(kill_cgroup, sb.cgroups, functools.partial(_wait_briefly, sb.proc))
            _close_log(sb)
            if sb.linked and self.egress is not None:
                # its link went with its VMM (the TAP's last fd); its rules go after the kill returns
                task = asyncio.get_running_loop().create_task(self._unlink(sb.slot))
                self._unlinking.add(task)
                task.add_done_callback(self._unlinking.discard)
                sb.linked = False
            elif sb.slot >= 0:
                self._slots.discard(sb.slot)
            await asyncio.to_thread(shutil.rmtree, sb.dir, True)
            self._free_uids.append(sb.uid)
            if self._sandboxes.get(sb.sandbox_id) is sb:
                del self._sandboxes[sb.sandbox_id]
                self.claimed.discard(sb.sandbox_id)

    def _log_tail(self, sb: MicrovmSandbox) -> str:
        killed = ""
        if sb.proc is not None and sb.proc.poll() == 128 + signal.SIGSYS:  # bwrap: its command's signal
            killed = ("the VMM made a syscall outside its seccomp allow-list (vmm_seccomp.py) and was killed: the "
                      "kernel log's seccomp record (audit type=1326) names it. ")
        if sb.log_fd >= 0:
            with contextlib.suppress(OSError):
                _read_log(sb)  # what is in the pipe still
        return killed + (sb.log[-1500:].decode(errors="replace").strip() or "no output")

    async def _console(self, sb: MicrovmSandbox) -> str:
        """The last of the guest's console (a ring buffer inside the VMM: bounded) and the VMM's log."""
        text = ""
        if sb.qmp is not None and sb.alive():
            with contextlib.suppress(Exception):
                text = str(await sb.qmp.call("ringbuf-read", timeout=2, device="console", size=4096, format="utf8"))
        return (text[-1500:].strip() + " " + self._log_tail(sb)).strip()

    # -- pause, resume, files --------------------------------------------------------------------

    async def pause(self, sandbox: RunningSandbox) -> None:
        """The VM's vCPUs stopped (QMP stop): its guest clock stops with them."""
        sb = self._live(sandbox)
        async with sb.kill_lock:
            if sb.killed:
                raise SandboxGoneError(f"sandbox {sb.sandbox_id} was killed")
            if not sb.stopped:
                assert sb.qmp is not None
                await sb.qmp.call("stop")
                sb.stopped = True

    async def resume(self, sandbox: RunningSandbox) -> None:
        sb = self._live(sandbox)
        async with sb.kill_lock:
            if sb.killed:
                raise SandboxGoneError(f"sandbox {sb.sandbox_id} was killed")
            if sb.stopped:
                assert sb.qmp is not None
                await sb.qmp.call("cont")
                sb.stopped = False
        async with asyncio.timeout(self.ready_timeout):
            await self._identity(sb)  # the wall clock jumps to now

    def _live(self, sandbox: RunningSandbox) -> MicrovmSandbox:
        assert isinstance(sandbox, MicrovmSandbox)
        if sandbox.killed:
            raise SandboxGoneError(f"sandbox {sandbox.sandbox_id} was killed")
        return sandbox

    async def export_files(self, sandbox: RunningSandbox, dest: str, max_bytes: int) -> int:
        """/home/user and /tmp as a pax tar (disk_archive.py's names), made by tar as the guest's root and
        streamed over the control port; cut off past `max_bytes`. A stopped VM runs for it."""
        sb = self._live(sandbox)
        stopped = sb.stopped
        assert sb.qmp is not None and sb.control is not None
        if stopped:
            await sb.qmp.call("cont")
        written = 0
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            async with sb.control_lock:
                loop = asyncio.get_running_loop()
                sb.control.setblocking(False)
                await loop.sock_sendall(sb.control, encode_frame({"op": "export"}))
                while True:
                    header, payload = await _read_control(loop, sb.control)
                    if header.get("event") == "data":
                        written += len(payload)
                        if written > max_bytes:
                            await self._drain_export(sb, loop)
                            raise ResourceExhaustedError(
                                f"the files of sandbox {sb.sandbox_id} are over {max_bytes} bytes")
                        await asyncio.to_thread(_write_all, fd, payload)
                        continue
                    if header.get("event") == "done" and header.get("code") in (0, 1):
                        break
                    raise SandboxError(f"tar in sandbox {sb.sandbox_id} failed: {str(header.get('error'))[:500]}")
        except BaseException:
            os.close(fd)
            fd = -1
            with contextlib.suppress(OSError):
                os.unlink(dest)
            raise
        finally:
            if fd >= 0:
                os.close(fd)
            if stopped and not sb.killed:
                await sb.qmp.call("stop")
        return written

    async def _drain_export(self, sb: MicrovmSandbox, loop: asyncio.AbstractEventLoop) -> None:
        """The rest of an export refused for its size, read and dropped up to its "done" (at most the
        sandbox's disk), so the control port stays in step and the sandbox goes on. A guest that does
        not end it within the deadline is killed."""
        assert sb.control is not None
        try:
            async with asyncio.timeout(self.ready_timeout):
                while (await _read_control(loop, sb.control))[0].get("event") == "data":
                    pass
        except (TimeoutError, SandboxError, OSError):
            await self.kill(sb)

    async def _untar(self, sb: MicrovmSandbox, archive: str) -> None:
        """A disk archive's home/ and tmp/ into the guest (tar as its root), in chunks over the control port."""
        assert sb.control is not None
        async with sb.control_lock:
            loop = asyncio.get_running_loop()
            sb.control.setblocking(False)
            try:
                async with asyncio.timeout(self.ready_timeout):
                    with open(archive, "rb") as f:
                        while chunk := await asyncio.to_thread(f.read, 1 << 20):
                            await loop.sock_sendall(sb.control, encode_frame({"op": "import-chunk"}, chunk))
                    await loop.sock_sendall(sb.control, encode_frame({"op": "import"}))
                    header, _ = await _read_control(loop, sb.control)
            except TimeoutError:
                raise SandboxError(f"sandbox {sb.sandbox_id} did not extract its files within {self.ready_timeout:g} s: "
                                   f"{await self._console(sb)}") from None
        if header.get("event") != "done" or header.get("code") != 0:
            error = str(header.get("error") or header)[:500]
            if "No space left" in error:
                raise ResourceExhaustedError(f"the archive's files do not fit in sandbox {sb.sandbox_id}'s disk")
            raise InvalidArgumentError(f"the disk archive could not be extracted in sandbox {sb.sandbox_id}: {error}")

    # -- policy ----------------------------------------------------------------------------------

    def check_policy(self, policy: Policy) -> None:
        for part, used in policy_parts(policy):
            if used and part != "policy.syscalls":
                raise PolicyError(part, MICROVM_POLICY[part])

    async def enforce_policy(self, sandbox: RunningSandbox, policy: Policy, previous: Policy, asker: Asker) -> None:
        self.check_policy(policy)  # syscalls: the agent loads the strict filter in the guest itself

    # -- memory snapshots: migration to a file -----------------------------------------------------

    async def checkpoint(self, sandbox: RunningSandbox, image_dir: str, leave_running: bool) -> int:
        """The whole VM (RAM, devices: its processes and its disk, which lives in its RAM) to
        `image_dir`/memory, written by the VMM to a file the server opened for it."""
        sb = self._live(sandbox)
        assert sb.qmp is not None
        if os.path.exists(image_dir):
            raise InvalidArgumentError(f"{image_dir} exists already")
        os.makedirs(image_dir, mode=0o700)
        async with sb.kill_lock:
            if sb.killed:
                raise SandboxGoneError(f"sandbox {sb.sandbox_id} was killed")
            was_stopped = sb.stopped
            if not was_stopped:
                await sb.qmp.call("stop")
            try:
                await sb.qmp.call("migrate-set-capabilities",
                                  capabilities=[{"capability": "x-ignore-shared", "state": False}])
                out = os.open(os.path.join(image_dir, "memory"), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
                              0o600)
                try:
                    await sb.qmp.send_fd("snapshot", out)
                finally:
                    os.close(out)
                await sb.qmp.call("migrate", uri="fd:snapshot")
                await sb.qmp.wait_migration(timeout=300)
                assert self._image is not None
                with open(os.path.join(image_dir, "agentcell.json"), "w") as f:
                    json.dump({"backend": "microvm", "sandbox_id": sb.sandbox_id, "limits": asdict(sb.limits),
                               "machine_limits": asdict(sb.machine_limits),
                               "image": os.path.basename(self._image.path), "machine": self.machine}, f)
            finally:
                if leave_running and not was_stopped and not sb.killed:
                    await sb.qmp.call("cont")
        if not leave_running:
            await self.kill(sb)
        elif not was_stopped:
            async with asyncio.timeout(self.ready_timeout):
                await self._identity(sb)
        return _du(image_dir)

    async def restore(self, image_dir: str, spec_: SandboxSpec) -> RunningSandbox:
        """A new VM from a checkpoint: its RAM and devices; `spec_`'s id; the image's limits (RAM size and
        vCPUs are the saved machine's). It takes its own name and randomness before this returns."""
        self._check(spec_)
        try:
            with open(os.path.join(image_dir, "agentcell.json")) as f:
                meta = json.load(f)
            limits = Limits(**meta["limits"])
            machine_limits = Limits(**meta.get("machine_limits", meta["limits"]))
        except (OSError, ValueError, TypeError, KeyError) as e:
            raise InvalidArgumentError(f"{image_dir} is not a microvm memory snapshot: {e}") from None
        assert self._image is not None
        if meta.get("image") != os.path.basename(self._image.path):
            raise SandboxError("this memory snapshot was taken over another root image (agentcell or the host's "
                               "packages changed since): it cannot be restored; restore its files instead",
                               "invalid_argument")
        sandbox_id = spec_.sandbox_id or self._new_id()
        # the saved machine (RAM, vCPUs); its host cgroup keeps room for all its RAM, which is its own now
        sb = await self._spawn(sandbox_id, machine_limits, incoming=True)
        sb.limits = limits
        try:
            await self._load(sb, os.path.join(image_dir, "memory"), ignore_shared=False)
            async with asyncio.timeout(self.ready_timeout):
                await self._identity(sb, limits, name=sandbox_id)
                await self._rename_agent(sb)
            if self.egress is not None and sb.slot >= 0:  # its new link (its old address is gone): its policy
                await self.egress.apply(sb.slot, spec_.network, sandbox_id, spec_.secrets)
        except BaseException:
            await self.kill(sb)
            raise
        sb.sock.setblocking(True)
        self.claimed.add(sandbox_id)
        return sb


# -- helpers ---------------------------------------------------------------------------------------

def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def _open_ro(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)  # inherited by each VMM (pass_fds): not close-on-exec there
    os.set_inheritable(fd, False)
    return fd


def _kvm_node(directory: str, uid: int) -> str:
    """A /dev/kvm of this VMM's own: a device node owned by its uid alone (0600), bound into its jail. The
    host's /dev/kvm (root's, or group kvm's) is left as it is, and no other uid gains KVM."""
    st = os.stat("/dev/kvm")
    path = os.path.join(directory, "kvm")
    os.mknod(path, 0o600 | (st.st_mode & 0o170000), st.st_rdev)
    os.chown(path, uid, uid)
    return path


def _ram_mb(limits: Limits) -> int:
    """The VM's RAM: the tenant's memory limit and the guest's own (its kernel, the agent and its warm
    default context, which the other backends share with a zygote and do not count)."""
    return limits.memory_mb + GUEST_OVERHEAD_MB


def _tsc_hint() -> str:
    """Under TCG the guest's TSC is the host's, but the guest kernel calibrates it against the emulated
    PIT: on a loaded host that fails ("Unable to calibrate against PIT", no HPET on microvm) and the
    boot hangs there. The host's TSC rate, given on the command line, skips the calibration."""
    with contextlib.suppress(OSError, ValueError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("cpu MHz"):
                    return f" tsc_early_khz={int(float(line.split(':')[1]) * 1000)}"
    return ""


def _vcpus(limits: Limits) -> int:
    return max(1, min(os.cpu_count() or 1, math.ceil(limits.cpu_count)))


def _make_cgroup(cg: cgroups.Cgroups, limits: Limits) -> None:
    for d in dict.fromkeys(cg.dirs.values()):
        os.makedirs(d, exist_ok=True)
    cg.set_limits(limits)


def _join(cg: cgroups.Cgroups) -> None:
    """In the VMM's process before exec: into its cgroup, so that every page it takes is charged there."""
    pid = str(os.getpid())
    for d in dict.fromkeys(cg.dirs.values()):
        with open(f"{d}/cgroup.procs", "w") as f:
            f.write(pid)


def _retune(cg: cgroups.Cgroups, limits: Limits) -> None:
    """A claimed standby's host cgroup: the claim's CPU quota and memory (+ the VMM's own)."""
    quota = str(max(1000, int(limits.cpu_count * 100_000)))
    memory = str((_ram_mb(limits) + vmm.VMM_OVERHEAD_MB) << 20)
    if cg.v2:
        sc.write_file(f"{cg.dirs['unified']}/cpu.max", f"{quota} 100000")
        sc.write_file(f"{cg.dirs['unified']}/memory.max", memory)
    else:
        sc.write_file(f"{cg.dirs['cpu']}/cpu.cfs_quota_us", quota)
        sc.write_file(f"{cg.dirs['memory']}/memory.limit_in_bytes", memory)


def _read_log(sb: MicrovmSandbox) -> None:
    try:
        data = os.read(sb.log_fd, 1 << 16)
    except BlockingIOError:
        return
    if data:
        sb.log = (sb.log + data)[-VMM_LOG_BYTES:]
        return
    _close_log(sb)


def _close_log(sb: MicrovmSandbox) -> None:
    if sb.log_fd >= 0:
        with contextlib.suppress(Exception):
            asyncio.get_running_loop().remove_reader(sb.log_fd)
        os.close(sb.log_fd)
        sb.log_fd = -1


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


async def _read_control(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> tuple[dict[str, Any], bytes]:
    """One frame from the guest's control port: bounded, parsed as data (gvisor/standby.py's reader)."""
    header, payload, _ = await standby._read(loop, sock, _MAX_CONTROL_PAYLOAD)
    return header, payload


def _remove_stale_states(base: str) -> None:
    """Template RAM files and VM directories of servers that are gone (their cgroups were removed)."""
    with contextlib.suppress(FileNotFoundError):
        for name in os.listdir(base):
            if not cgroups.instance_alive(name):
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)


def _wait_briefly(proc: subprocess.Popen[bytes] | None) -> None:
    """Reap the VMM's jail (bwrap, the server's child) if it has ended."""
    if proc is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)
