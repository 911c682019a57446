"""LinuxBackend: sandboxes are namespaces + cgroups + Landlock + seccomp, forked from a zygote.

The server never forks untrusted code itself: one zygote process per template (a subprocess of the
server) forks each sandbox; see sandbox_init.py for what the child does. Here we only send spawn
requests, read the child's handshake on the sandbox's socket, and kill/measure via pidfd and cgroups.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import re
import select
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import asdict, replace
from typing import Any

from agentcell import rootless
from agentcell.backends import disk_archive
from agentcell.backends.base import (
    Asker,
    Backend,
    ImageRoot,
    Limits,
    RunningSandbox,
    SandboxSpec,
    VolumeMount,
    check_pids_max,
    new_cell_sandbox_id,
)
from agentcell.backends.cgroup_backend import CgroupSandboxes, check_create
from agentcell.backends.linux import (
    cgroup_delegation,
    cgroups,
    host,
    image_root,
    rootfs,
    runtime_prefetch,
    runtime_store,
    uids,
    volume_mounts,
    watchdog,
)
from agentcell.backends.linux.zygote_process import DEFAULT_ENTRY, ZygoteProcess
from agentcell.backends.pool import StandbyPool
from agentcell.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    SandboxError,
    SandboxGoneError,
    error_from_code,
)
from agentcell.network.policy import NetworkPolicy
from agentcell.network.router import EgressError
from agentcell.network.secrets import HeaderRule
from agentcell.network.service import Egress, EgressSettings
from agentcell.network.tunnel import EgressTunnel, TunnelConfigError
from agentcell.policy.linux.enforcer import LinuxPolicies
from agentcell.policy.model import Policy
from agentcell.record.events import event, not_recorded
from agentcell.record.linux.process import RecordProcess, RecordProcessError
from agentcell.record.linux.target import WatchTarget
from agentcell.runtime import statedir
from agentcell.runtime.protocol import PREFIX, encode_frame
from agentcell.server import progress

READY_TIMEOUT = 10.0
STANDBYS = 4  # prepared sandboxes kept ready per template (--standbys)
IMAGE_POOLS = 8  # image templates with standbys at once (the least recently used beyond: none)
PREPARE_PARALLEL = 4  # standbys prepared at once: enough to overlap each one's cgroup-join wait
log = logging.getLogger("agentcell.backend")
TIMING = os.environ.get("AGENTCELL_TIMING") == "1"  # debug: per-step create() stamps on stderr
# a sandbox made from a disk archive extracts it before its agent starts: this much more time to be ready
# (generous: ~5,000 entries/s on a slow core, an entry 512 bytes at the least)
EXTRACT_BYTES_PER_S = 2e6
NO_EGRESS = ("this server gives sandboxes no internet (its operator started it with --egress-uplink none); "
             "create the sandbox with allow_internet_access=False")


class LinuxSandbox(RunningSandbox):
    def __init__(self, sandbox_id: str, sock: socket.socket, host_pid: int, pidfd: int, slot: int,
                 cgroup: str, limits: Limits) -> None:
        self.sandbox_id = sandbox_id
        self.limits = limits  # as prepared; a claim may change memory and CPU (cgroups.retune)
        self.sock = sock
        self.host_pid = host_pid
        self.pidfd = pidfd
        self.slot = slot
        self.cgroups = cgroups.Cgroups.at(cgroup)
        self.killed = False
        self.linked = False  # has a link to the egress router (and rules there to remove at kill)
        self.watched = False  # the record's collectors watch it (a standby: since it was prepared)
        self.kill_lock = asyncio.Lock()
        # the root of its disk tmpfs (O_PATH, from sandbox_init's "disk" frame): export_files walks it
        self.disk_fd = -1
        self.owners = disk_archive.Owners(-1, -1)  # its user's host ids
        self.host_uids: tuple[int, ...] = ()  # the host uids its processes run as (its user's, its root's)
        self.image = False  # its root is an image template's (image_root.py): one overlay, of "/"

    def alive(self) -> bool:
        if self.killed or self.pidfd < 0:
            return False
        poller = select.poll()  # not select(): a server with 1,000 sandboxes holds fds past FD_SETSIZE
        poller.register(self.pidfd, select.POLLIN)
        return not poller.poll(0)  # readable = exited


def _send_layers(sock: socket.socket, layers: tuple[str, ...]) -> None:
    """Detached clones of an image's layer trees (image_root.open_layers), one message, then ours closed."""
    fds = image_root.open_layers(layers)
    try:
        socket.send_fds(sock, [b"L"], fds)
    finally:
        for fd in fds:
            os.close(fd)


async def _read_frame(loop: asyncio.AbstractEventLoop, sock: socket.socket,
                      fds: list[int] | None = None) -> dict[str, Any] | None:
    """Read exactly one frame (never past it: the rest of the stream belongs to the server). With
    `fds`, the file descriptors that come with it (SCM_RIGHTS) are appended there."""

    async def exact(n: int) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            if fds is None:
                chunk = await loop.sock_recv(sock, n - len(buf))
            else:
                chunk = await _recv_with_fds(sock, n - len(buf), fds)
            if not chunk:
                return None
            buf += chunk
        return bytes(buf)

    prefix = await exact(PREFIX.size)
    if prefix is None:
        return None
    head_len, payload_len = PREFIX.unpack(prefix)
    if head_len > 1 << 16 or payload_len:
        raise SandboxError("the sandbox sent a malformed handshake")
    head = await exact(head_len)
    if head is None:
        return None
    header = json.loads(head)
    if not isinstance(header, dict):
        raise SandboxError("the sandbox sent a malformed handshake")
    return header


async def _recv_with_fds(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    while True:
        try:
            data, got, _, _ = socket.recv_fds(sock, n, 1)
            fds.extend(got)
            return data
        except BlockingIOError:
            await _wait_readable(sock.fileno(), timeout=60.0)  # the caller's own timeout ends it sooner


def _open_archive(path: str) -> int:
    """The server's disk archive file, opened for the child (SCM_RIGHTS)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise InvalidArgumentError(f"cannot open the filesystem snapshot {path}: {e.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise InvalidArgumentError(f"the filesystem snapshot {path} is not a file")
    return fd


def _export(disk_fd: int, dest: str, max_bytes: int, owners: disk_archive.Owners, image: bool) -> int:
    """write_archive into a new file at `dest` (removed again on failure). `image`: a sandbox of an
    image template, whose one overlay is its whole root (image_root.py)."""
    overlays = [image_root.ROOT] if image else [path for path, _ in rootfs.OVERLAYS]
    try:
        with open(dest, "wb") as out:
            return disk_archive.write_archive(disk_fd, out, max_bytes, owners, overlays=overlays,
                                              mount_points=image_root.MOUNT_POINTS if image else ())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(dest)
        raise


class LinuxBackend(CgroupSandboxes, Backend):
    name = "linux"
    files_while_frozen = True  # export_files walks the disk through fds from the host: nothing runs

    def __init__(self, entry_point: str = DEFAULT_ENTRY, uid_base: int | None = None, max_sandboxes: int = 1000,
                 staging: str = rootfs.STAGING, ready_timeout: float = READY_TIMEOUT,
                 preload: bool | None = None, zygote_timeout: float = 120.0,
                 host_tuning: host.HostTuning | None = None, standbys: int = STANDBYS,
                 standby_limits: Limits | None = None, prepare_parallel: int = PREPARE_PARALLEL,
                 egress: EgressSettings | None = None, record_denials: str = "failures",
                 **host_options: Any) -> None:
        if max_sandboxes < 1:
            raise ValueError("max_sandboxes must be at least 1")
        if standbys < 0 or prepare_parallel < 1:
            raise ValueError("standbys must be at least 0 and prepare_parallel at least 1")
        self.standbys = standbys
        self.egress_settings = egress or EgressSettings(uplink="none")
        self.egress_settings.check()
        self.egress: Egress | None = None  # the router, once start() made it
        self.standby_limits = standby_limits or Limits()  # what a create without limits asks for
        self.prepare_parallel = prepare_parallel
        self._pools: dict[str, StandbyPool[LinuxSandbox]] = {}
        self._owned: dict[str, LinuxSandbox] = {}  # every sandbox with a process: standbys and claimed
        self.entry_point = entry_point
        self.requested_uid_base = uid_base  # None: the lowest free range (see uids.reserve)
        self.uid_base = -1  # known once start() reserved the range
        self._uid_range: uids.UidRange | None = None
        self.max_sandboxes = max_sandboxes
        self.staging = staging
        self.ready_timeout = ready_timeout
        # agent.preload() (numpy, pandas, IPython...) only helps the real agent
        self.preload = entry_point.startswith("agentcell.runtime.agent:") if preload is None else preload
        self.zygote_timeout = zygote_timeout
        self._zygotes: dict[str, ZygoteProcess] = {}
        self._images: dict[str, ImageRoot] = {}  # "image:<key>" -> the image root its sandboxes have
        self._runtime: runtime_store.Store | None = None  # held from start() to close()
        self._state_dir = ""
        self._sandboxes: dict[str, LinuxSandbox] = {}
        self._slots: set[int] = set()
        self._unlinking: set[asyncio.Task[None]] = set()  # killed sandboxes' slots on their way back
        self._closing_pools: set[asyncio.Task[None]] = set()  # image templates' pools beyond IMAGE_POOLS
        self._next_slot = 0
        self.last_create_ms = 0.0
        self.instance = cgroups.new_instance_id()  # cgroups live in agentcell/<instance>/...
        self.cgroup_parent = f"{cgroups.GROUP}/{self.instance}"
        # host_options: HostTuning's fields (tune_sysctls, ptys_per_sandbox ...), as the server passes them
        self.host_tuning = host_tuning or host.HostTuning(**host_options)
        # what all sandboxes together may use (the parent cgroup's limits), known once start() set them
        self.host_budget: host.HostBudget | None = None
        # the behaviour record's host-side collectors (record/linux/target.py) in their process, started by start()
        # once a recorder is attached
        self.record_process: RecordProcess | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self.missing_collectors: list[tuple[str, str]] = []  # (name, why) of those that could not start here
        self.policies = LinuxPolicies(self)  # sandboxes' policies (issue 28): exec, files, processes, network ask
        self.record_denials = record_denials  # what the kernel tracer sees of refused path syscalls (serve --record-denials)

    async def _start_collectors(self) -> None:
        """The behaviour record's host-side collectors (issue 10), in a process of their own
        (record/linux/process.py); the audit rules name this server's host uid range, so they start once
        start() reserved it. A collector that cannot run here (the kernel's audit locked, no fanotify
        ...) is left out and said so, in the log and in each record (record.dropped at the claim): a
        record with a gap rather than no sandboxes."""
        assert self.recorder is not None
        if rootless.active():  # audit, BPF, fanotify of the host: none of them for an ordinary user
            why = "rootless mode: the host's audit, BPF and fanotify need root"
            self.missing_collectors = [(name, why) for name in sorted(self.record_collectors)]
            return
        proc = RecordProcess(self.recorder.add, self.uid_base, self.uid_base + 2 * self._slot_count - 1,
                             names=self.record_collectors, denials=self.record_denials,
                             tune_sysctl=self.host_tuning.tune_sysctls)
        try:
            self.missing_collectors = await proc.start()
        except RecordProcessError as e:
            print(f"agentcell: behaviour record without its host-side collectors: {e}", file=sys.stderr)
            self.missing_collectors = [(name, str(e)) for name in sorted(self.record_collectors)]
            return
        self.record_process = proc

    def _watch(self, sandbox: LinuxSandbox) -> None:
        """A tenant's sandbox: its record starts, and the collectors watch it, before its claim."""
        if self.recorder is None:
            return
        self.recorder.begin(sandbox.sandbox_id)
        for name, why in self.missing_collectors:  # (the report says "not recorded" for its part: report.py)
            self.recorder.add(sandbox.sandbox_id, not_recorded(name, why))
        # The collectors are told of the claim (a standby: they watch it since it was prepared; else
        # their watch, ~0.5 ms: a fanotify group, cgroup files) right after the create's answer is on its
        # way, before the loop reads any further request: no code of the tenant's can run before it.
        asyncio.get_running_loop().call_soon(self._watch_now, sandbox)

    async def _prepare_standby(self, template: str, yield_cpu: bool = True) -> LinuxSandbox:
        """A standby, watched by the record's collectors from now on (off any request's path). Its
        events before a claim are not kept: a record starts at the claim (EventStore.begin).
        `yield_cpu` False: a create waits for it (pool.py), so it runs at the default CPU weight."""
        sandbox = await self._prepare(template, self.standby_limits, self._new_id(), yield_cpu=yield_cpu)
        self._watch_now(sandbox)
        return sandbox

    def _watch_now(self, sandbox: LinuxSandbox) -> None:
        """The collectors start watching the sandbox; if they already do (a standby), it was claimed."""
        proc = self.record_process
        if sandbox.killed or sandbox.disk_fd < 0 or self.recorder is None or proc is None:
            return
        claimed, sandbox.watched = sandbox.watched, True
        try:
            if claimed:
                proc.claimed(sandbox.sandbox_id)
            else:
                proc.watch(WatchTarget(sandbox.sandbox_id, sandbox.host_pid, sandbox.host_uids, sandbox.cgroups,
                                       sandbox.disk_fd))
        except OSError as e:  # a record with a gap, said in the record, rather than no sandbox
            self.recorder.add(sandbox.sandbox_id, event("record.dropped", count=0, reason=str(e)))

    async def _unwatch(self, sandbox: LinuxSandbox) -> None:
        if self.record_process is not None:
            with contextlib.suppress(Exception):
                await self.record_process.unwatch(sandbox.sandbox_id)

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if os.geteuid() != 0:
            raise BackendUnavailableError("the linux backend must run as root (it creates namespaces and cgroups)")
        try:
            with open("/proc/sys/user/max_user_namespaces") as f:
                if int(f.read()) < 10:
                    raise BackendUnavailableError("user namespaces are disabled: sysctl -w user.max_user_namespaces=65536")
        except FileNotFoundError:
            raise BackendUnavailableError("this kernel has no user namespaces (CONFIG_USER_NS)") from None
        if os.path.exists("/proc/sys/kernel/unprivileged_userns_clone"):
            with open("/proc/sys/kernel/unprivileged_userns_clone") as f:
                if f.read().strip() == "0":
                    raise BackendUnavailableError(
                        "unprivileged user namespaces are off: sysctl -w kernel.unprivileged_userns_clone=1")
        try:
            # Two host ids per sandbox slot (its user's and its root's), disjoint from every other server's.
            self._uid_range = uids.reserve(2 * self._slot_count, self.requested_uid_base,
                                           **(rootless_ids() if rootless.active() else {}))
        except uids.UidRangeError as e:
            raise BackendUnavailableError(str(e)) from None
        self.uid_base = self._uid_range.base
        if rootless.active():
            await self._start_rootless()
            return
        # The Python runtime at neutral paths (checked in a thread meanwhile: ~0.5 s warm, built once),
        # and maybe a zygote already importing it, launched by `serve` from the last start's parts
        early = runtime_prefetch.take() if self._runtime is None else None
        runtime = self._check_runtime(early) if self._runtime is None else None
        early_zygote = early.zygote if early is not None else None
        zygote: asyncio.Future[ZygoteProcess] | None = None
        try:
            await self._start_cgroups_and_egress()
            if runtime is not None:
                self._state_dir = statedir.private_dir(statedir.default_state_dir("zygote"))
                self._runtime, runtime = await runtime, None
            self._adopt_early_zygote(early_zygote)
            early_zygote = None
            # the zygote imports the sandboxes' Python runtime (~1.5 s) in its own process meanwhile
            zygote = asyncio.ensure_future(self._zygote("base"))
            await self._start_collectors_and_limits()
            await self.policies.start()
            self.policies.start_network()
            await zygote
        except BaseException:
            if zygote is not None and not zygote.done():
                zygote.cancel()
            if early_zygote is not None:
                early_zygote.discard()
                early_zygote.runtime.close()
            if runtime is not None:
                with contextlib.suppress(Exception):
                    (await runtime).close()
            raise
        self._pool("base").fill()

    @staticmethod
    def _check_runtime(early: runtime_prefetch.Early | None) -> asyncio.Future[runtime_store.Store]:
        """The runtime store's check: the one `serve` began before its imports (runtime_prefetch), else
        a new one in a thread."""
        if early is not None:
            return asyncio.wrap_future(early.check)
        return asyncio.ensure_future(asyncio.to_thread(runtime_store.ensure))

    async def _start_cgroups_and_egress(self) -> None:
        """What the zygote needs besides the runtime store (checked meanwhile, in a thread): this
        server's cgroups, the staging directory, the egress router (its CA goes into the zygote)."""
        try:
            stale = await asyncio.to_thread(cgroups.remove_stale_instances)  # servers that died
            if stale:
                print(f"agentcell: removed the cgroups of {len(stale)} dead server(s): {', '.join(stale)}",
                      file=sys.stderr)
            cgroups.prepare_instance(self.instance)
        except cgroups.CgroupError as e:
            raise BackendUnavailableError(str(e)) from e
        if not rootless.active() or cgroups.delegated_root() is not None:  # paused sandboxes die with us: watchdog.py
            self._watchdog = watchdog.start("agentcell.backends.linux.watchdog", self.cgroup_parent)
        os.makedirs(self.staging, mode=0o755, exist_ok=True)
        os.chmod(self.staging, 0o755)
        gone = await asyncio.to_thread(Egress.remove_stale, cgroups.instance_alive)
        if gone:
            print(f"agentcell: removed the egress routers of dead server(s): {', '.join(gone)}", file=sys.stderr)
        await self._start_egress()

    async def _start_egress(self) -> None:
        if self.egress_settings.enabled and self.egress is None:
            egress = Egress(self.egress_settings, self.instance)
            try:
                with progress.step("starting the sandboxes' egress router"):
                    await egress.start()
            except (EgressError, OSError) as e:
                raise BackendUnavailableError(
                    f"cannot set up the sandboxes' egress router: {e} (start with --egress-uplink none to run "
                    "without internet for sandboxes)") from e
            self.egress = egress

    async def _start_collectors_and_limits(self) -> None:
        """The record's collectors and the host's limits: while the zygote starts."""
        if self.egress is not None and self.recorder is not None:
            self.egress.sink = self.recorder.add  # connection and DNS events join the behaviour record
        if self.recorder is not None and self.record_process is None:
            with progress.step("starting the behaviour record's collectors"):
                await self._start_collectors()
        try:  # host-wide pools and the parent cgroup's limits (see host.py)
            self.host_budget = await asyncio.to_thread(host.prepare, self.cgroup_parent, self.max_sandboxes,
                                                       self.host_tuning)
        except OSError as e:
            raise BackendUnavailableError(f"cannot limit what sandboxes take from the host: {e}") from e

    async def _start_zygotes(self) -> None:
        """Rootless: the runtime store (runtime_store.store_dir(): the user's own), then the zygote."""
        os.makedirs(self.staging, mode=0o755, exist_ok=True)
        os.chmod(self.staging, 0o755)
        if self._runtime is None:
            self._state_dir = statedir.private_dir(statedir.default_state_dir("zygote"))
            self._runtime = await asyncio.to_thread(runtime_store.ensure)
        await self._zygote("base")
        self._pool("base").fill()

    async def _start_rootless(self) -> None:
        """start() in an ordinary user's namespace (rootless.py): no cgroups, host sysctls or host-side
        record collectors; the egress router's uplink is user-mode networking (network/usermode.py);
        the user's own directories for the runtime and staging."""
        if self.egress_settings.uplink not in ("none", "usermode"):
            raise BackendUnavailableError("rootless mode's only uplink is user-mode networking: start it with "
                                          "--egress-uplink usermode (or none)")
        await self._start_egress()
        if self.recorder is not None:
            if self.egress is not None:
                self.egress.sink = self.recorder.add  # connection and DNS events join the behaviour record
            await self._start_collectors()
        controllers = await asyncio.to_thread(self._start_delegated_cgroups)
        self.host_budget = host.prepare_rootless(self.host_tuning, controllers)
        if controllers:  # all sandboxes together, as a root server's parent cgroup (host.prepare)
            with contextlib.suppress(OSError):
                cgroup_delegation.set_instance_limits(self.instance, self.host_budget.memory_bytes,
                                                      self.host_budget.pids)
        if self.staging == rootfs.STAGING:
            self.staging = rootless.staging_dir()
        await self.policies.start()  # (it notes what rootless mode cannot enforce)
        self.policies.start_network()
        await self._start_zygotes()

    def _start_delegated_cgroups(self) -> frozenset[str] | None:
        """Rootless: the sandboxes' cgroups below the cgroup v2 directory delegated to the user, if the
        launcher found one (cgroup_delegation.py); else none (no_cgroups.py). Says which. Returns the
        controllers that limit sandboxes (None: no cgroups at all)."""
        if cgroups.delegated_root() is None:
            why = cgroup_delegation.probe()[1] or "the launcher could not enter the delegated cgroup: see above"
            print(f"agentcell: rootless mode: no cgroups ({why}): limits by rlimits, no pause", file=sys.stderr,
                  flush=True)
            return None
        try:
            stale = cgroup_delegation.remove_stale_instances()
            if stale:
                print(f"agentcell: removed the cgroups of {len(stale)} dead rootless server(s): {', '.join(stale)}",
                      file=sys.stderr)
            delegation = cgroup_delegation.prepare_instance(self.instance)
        except OSError as e:
            print(f"agentcell: rootless mode: cannot use the delegated cgroup {cgroups.delegated_root()} ({e}): "
                  "no cgroups, limits by rlimits, no pause", file=sys.stderr, flush=True)
            os.environ.pop(cgroups.DELEGATED_ENV, None)  # the zygotes and their sandboxes: NoCgroups
            return None
        print(f"agentcell: rootless mode: {delegation.describe()}", file=sys.stderr, flush=True)
        return delegation.controllers

    @property
    def _slot_count(self) -> int:
        """Host ids needed: one per sandbox, plus the standbys ready or being prepared, plus the
        preparations for creates that wait (pool.py's prepare_now: at most prepare_parallel more)."""
        return self.max_sandboxes + self.standbys + 2 * self.prepare_parallel

    def standby_pools(self) -> dict[str, StandbyPool[LinuxSandbox]]:
        return dict(self._pools)

    def _pool(self, template: str) -> StandbyPool[LinuxSandbox]:
        pool = self._pools.get(template)
        if pool is not None and template.startswith("image:"):
            self._pools[template] = self._pools.pop(template)  # the most recently used last
        if pool is None and template.startswith("image:"):
            self._bound_image_pools()
        if pool is None:
            pool = StandbyPool(lambda: self._prepare_standby(template),
                               self.kill, LinuxSandbox.alive, self.standbys, self.prepare_parallel,
                               prepare_now=lambda: self._prepare_standby(template, yield_cpu=False))
            self._pools[template] = pool
        return pool

    def _bound_image_pools(self) -> None:
        """At most IMAGE_POOLS image templates keep standbys: a new one closes the least recently used
        one's pool (its standbys are killed), so templates a client makes cannot pile up prepared
        sandboxes (their memory and host ids)."""
        images = [key for key in self._pools if key.startswith("image:")]
        for key in images[:max(0, len(images) - IMAGE_POOLS + 1)]:
            task = asyncio.get_running_loop().create_task(self._pools.pop(key).close())
            self._closing_pools.add(task)
            task.add_done_callback(self._closing_pools.discard)

    def _new_id(self) -> str:
        sandbox_id = new_cell_sandbox_id()
        while sandbox_id in self._owned:
            sandbox_id = new_cell_sandbox_id()
        return sandbox_id

    def _template_key(self, spec: SandboxSpec) -> str:
        """What a sandbox is prepared from: the template's name, or for a template made from an image
        "image:<its key>" (one zygote, "base", serves them all: image_root.py)."""
        if spec.image_root is None:
            return spec.template
        if rootless.active():
            raise InvalidArgumentError("templates made from images need a server running as root (not rootless mode)")
        key = f"image:{spec.image_root.key}"
        self._images[key] = spec.image_root
        return key

    async def _spawn(self, template: str, sock_fd: int, yield_cpu: bool) -> None:
        if template.startswith("image:"):
            template = "base"
        z = await self._zygote(template)
        try:
            z.spawn(sock_fd, yield_cpu)
            return
        except OSError as e:
            if z.alive():  # a live zygote refused the message: this create fails, nothing else
                raise SandboxError(f"the {template!r} zygote refused the spawn request: {e}") from None
        # The zygote died since the last create: a new one. Sandboxes it forked keep running.
        if self._zygotes.get(template) is z:
            del self._zygotes[template]
        z.stop()
        (await self._zygote(template)).spawn(sock_fd, yield_cpu)

    async def _zygote(self, template: str) -> ZygoteProcess:
        z = self._zygotes.get(template)
        if z is None or not z.alive():
            if z is not None:
                z.stop()
            assert self._runtime is not None, "start() first"
            z = ZygoteProcess(template, self.entry_point, self.preload, self._runtime, self._state_dir)
            self._place(z)
            self._zygotes[template] = z
        await z.wait_ready(self.zygote_timeout)
        return z

    def _place(self, z: ZygoteProcess) -> None:
        z.place(self.cgroup_parent, self.staging, self.host_tuning.ptys_per_sandbox,
                self.egress.ca_path if self.egress is not None else None)

    def _adopt_early_zygote(self, early: ZygoteProcess | None) -> None:
        """The zygote `serve` launched from the last start's runtime parts (runtime_prefetch): ours if
        the check found the same parts, placed now; else it goes, and _zygote() launches one."""
        if early is None:
            return
        assert self._runtime is not None
        if early.launched_like("base", self.entry_point, self.preload, self._runtime, self._state_dir):
            self._place(early)
            self._zygotes["base"] = early
            log.debug("the 'base' zygote launched early from the last start's runtime: kept")
        else:
            early.discard()
            log.debug("the 'base' zygote launched early from the last start's runtime: discarded (the runtime "
                      "changed since)")
        early.runtime.close()  # its parts are held by self._runtime's locks now (or not needed)

    async def close(self) -> None:
        for pool in self._pools.values():
            await pool.close()
        self._pools.clear()
        for sb in list(self._owned.values()):
            with contextlib.suppress(Exception):
                await self.kill(sb)
        for z in self._zygotes.values():
            z.stop()  # EOF: the zygote kills its standby
        self._zygotes.clear()
        if self._unlinking:
            await asyncio.gather(*self._unlinking, return_exceptions=True)
        self.policies.close()
        if self.egress is not None:
            await self.egress.close()
            self.egress = None
        if self.record_process is not None:
            with contextlib.suppress(Exception):
                await self.record_process.close()
            self.record_process = None
        with contextlib.suppress(OSError):
            await asyncio.to_thread(cgroups.remove_tree, self.cgroup_parent)
        if self._watchdog is not None:  # it removes what is left (nothing, normally) and exits
            assert self._watchdog.stdin is not None
            self._watchdog.stdin.close()
            await asyncio.to_thread(self._watchdog.wait)
            self._watchdog = None
        cgroup_delegation.release(self.instance)  # rootless with a delegated cgroup: its directory's lock
        await asyncio.to_thread(host.release, self.cgroup_parent)  # the sysctls it raised, if it was the last
        if self._uid_range is not None:
            self._uid_range.release()
            self._uid_range = None
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None

    # -- sandboxes -------------------------------------------------------------------------------

    def _alloc_slot(self) -> int:
        count = self._slot_count
        if len(self._slots) >= count:
            raise SandboxError("too many sandboxes on this host", "resource_exhausted")
        while self._next_slot in self._slots:
            self._next_slot = (self._next_slot + 1) % count
        slot = self._next_slot
        self._slots.add(slot)
        self._next_slot = (slot + 1) % count
        return slot

    async def create(self, spec: SandboxSpec) -> RunningSandbox:
        """A standby of the pool, claimed for `spec`; or, for an id or limits no standby has, one
        prepared for it now (the same steps, on the request's path)."""
        t0 = time.perf_counter()
        check_create(spec, self._owned, len(self._sandboxes), self.host_budget, self.max_sandboxes)
        if (spec.network.internet or spec.secrets) and self.egress is None:
            raise InvalidArgumentError(NO_EGRESS)
        await self._check_tunnel(spec.secrets.tunnel)  # before a standby is taken for it
        sandbox = None
        # a sandbox that starts from a disk archive is prepared for it: a standby's disk is mounted already
        template = self._template_key(spec)
        if spec.volumes and rootless.active():
            raise InvalidArgumentError("volumes need a server run as root (a rootless server cannot mount them)")
        if (not spec.sandbox_id and not spec.files and not spec.volumes and spec.pooled and self.standbys
                and _claimable(self.standby_limits, spec.limits)):
            sandbox = await self._pool(template).take()
            try:
                sandbox.cgroups.retune(sandbox.limits, spec.limits)
            except OSError:  # e.g. less memory than the standby already uses: prepare one instead
                await self.kill(sandbox)
                sandbox = None
        if sandbox is None:
            sandbox = await self._prepare(template, spec.limits, spec.sandbox_id or self._new_id(), spec.files,
                                          spec.volumes, yield_cpu=False)  # on the request's path
        try:
            sandbox.limits = spec.limits
            sandbox.cgroups.set_cpu_weight(standby=False)
            if self.egress is not None:  # before the claim: the tenant's first code meets its policy
                await self.egress.apply(sandbox.slot, spec.network, sandbox.sandbox_id, spec.secrets)
            self._watch(sandbox)
            # The claim: the tenant's env vars go to this sandbox's agent and nowhere else.
            # secrets: their placeholders only; the values stay here, with the egress proxy
            envs = {**spec.envs, **spec.secrets.envs()}
            await asyncio.get_running_loop().sock_sendall(
                sandbox.sock, encode_frame({"id": 0, "op": "claim", "envs": envs}))
        except BaseException:
            await self.kill(sandbox)
            raise
        sandbox.sock.setblocking(True)
        self._sandboxes[sandbox.sandbox_id] = sandbox
        self.last_create_ms = (time.perf_counter() - t0) * 1000
        return sandbox

    async def _prepare(self, template: str, limits: Limits, sandbox_id: str, files: str | None = None,
                       volumes: tuple[VolumeMount, ...] = (), yield_cpu: bool = True) -> LinuxSandbox:
        """Fork and prepare a sandbox up to its agent's "ready"; it waits for its claim. `files`: a disk
        archive its disk starts with (extracted by the child, see rootfs.finish). `yield_cpu`: the
        preparation runs at the lowest CPU weight (a standby nobody waits for yet)."""
        t0_ns = time.perf_counter_ns()
        files_fd = _open_archive(files) if files else -1
        timeout = self.ready_timeout + (os.fstat(files_fd).st_size / EXTRACT_BYTES_PER_S if files else 0)
        try:
            return await self._prepare_with(template, limits, sandbox_id, files_fd, timeout, t0_ns, volumes,
                                            yield_cpu)
        finally:
            if files_fd >= 0:
                os.close(files_fd)

    async def _prepare_with(self, template: str, limits: Limits, sandbox_id: str, files_fd: int, timeout: float,
                            t0_ns: int, volumes: tuple[VolumeMount, ...] = (), yield_cpu: bool = True) -> LinuxSandbox:
        slot = self._alloc_slot()
        host_id = self.uid_base + slot
        root_id = self.uid_base + self._slot_count + slot  # the sandbox's root: a host id of its own too
        # Nothing of a tenant's here: the server picked the id, the slot picked the host ids.
        request = {"sandbox_id": sandbox_id, "limits": asdict(limits), "host_uid": host_id, "host_gid": host_id,
                   "root_uid": root_id, "root_gid": root_id, "entry": self.entry_point}  # fmt: skip
        if TIMING:
            request["t0_ns"] = t0_ns
        if files_fd >= 0:
            request["files"] = True  # the archive's fd follows the frame
        image = self._images.get(template) if template.startswith("image:") else None
        if template.startswith("image:") and image is None:
            raise SandboxError(f"sandbox {sandbox_id}: no image root is known for {template}")
        if image is not None:  # its layers follow the frame (and the archive)
            request["image"] = {"layers": len(image.layers), "env": dict(image.env), "workdir": image.workdir,
                                "python": image.python, "start_cmd": image.start_cmd, "ready_cmd": image.ready_cmd}
        if volumes:  # their mounts follow the frame (and the archive, and the layers)
            request["volumes"] = volume_mounts.request_part(volumes)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sandbox: LinuxSandbox | None = None
        try:
            await self._spawn(template, theirs.fileno(), yield_cpu)
            theirs.close()
            ours.setblocking(False)
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(timeout):
                await loop.sock_sendall(ours, encode_frame(request))
                if files_fd >= 0:  # one byte on a fresh socket: never blocks
                    socket.send_fds(ours, [b"F"], [files_fd])
                if image is not None:
                    _send_layers(ours, image.layers)
                if volumes:
                    volume_mounts.send(ours, volumes)
                first = await _read_frame(loop, ours)
                if first is None or first.get("event") != "spawned":
                    raise _setup_failure(sandbox_id, first)
                t_spawned = time.perf_counter_ns()
                pid = int(first["host_pid"])
                cgroup = str(first.get("cgroup", ""))
                if not _cgroup_re(self.cgroup_parent).match(cgroup):
                    raise SandboxError(f"sandbox {sandbox_id}: the zygote named a foreign cgroup {cgroup!r}")
                sandbox = LinuxSandbox(sandbox_id, ours, pid, os.pidfd_open(pid), slot, cgroup, limits)
                sandbox.owners = disk_archive.Owners(host_id, host_id)
                sandbox.host_uids = (host_id, root_id)
                sandbox.image = image is not None
                self._owned[sandbox_id] = sandbox
                fds: list[int] = []
                disk = await _read_frame(loop, ours, fds)  # from the child, before any sandbox code ran
                for extra in fds[1:]:
                    os.close(extra)
                if fds:
                    sandbox.disk_fd = fds[0]
                if disk is None or disk.get("event") != "disk" or sandbox.disk_fd < 0:
                    raise _setup_failure(sandbox_id, disk)
                ready = await _read_frame(loop, ours)
                if ready is None or ready.get("event") != "ready":
                    raise _setup_failure(sandbox_id, ready)
                if self.egress is not None:
                    await self.egress.connect(slot, pid)
                    sandbox.linked = True
        except BaseException as e:
            theirs.close()
            if sandbox is not None:
                await self.kill(sandbox)
            else:  # nothing was forked for it (or the zygote's frame was bad)
                ours.close()
                self._slots.discard(slot)
            if isinstance(e, TimeoutError):
                raise SandboxError(
                    f"sandbox {sandbox_id} did not become ready within {timeout:g} s; "
                    "check the server log for the agent's error") from None
            raise
        if TIMING:
            t_ready = time.perf_counter_ns()
            print(f"agentcell timing {sandbox_id}: spawned={(t_spawned - t0_ns) / 1e6:.2f} "
                  f"ready={(t_ready - t0_ns) / 1e6:.2f}", file=sys.stderr, flush=True)
        return sandbox

    async def kill(self, sandbox: RunningSandbox) -> None:
        assert isinstance(sandbox, LinuxSandbox)
        async with sandbox.kill_lock:
            if sandbox.killed:
                return
            await self.policies.release(sandbox)  # held execs answered, marks and pins gone
            if sandbox.pidfd >= 0:
                with contextlib.suppress(OSError):  # its teardown yields to sandboxes that serve someone
                    sandbox.cgroups.set_cpu_weight(standby=True)
                with contextlib.suppress(ProcessLookupError, OSError):
                    signal.pidfd_send_signal(sandbox.pidfd, signal.SIGKILL)  # pid 1 dies: the whole ns dies
                sandbox.cgroups.thaw_quietly()  # a paused sandbox's tasks die only once thawed (v1)
                await _wait_readable(sandbox.pidfd, timeout=5.0)
            await self._unwatch(sandbox)  # its last events (exits, the last writes) are in: before its disk goes
            with contextlib.suppress(OSError):
                sandbox.sock.close()
            if sandbox.disk_fd >= 0:  # the last reference to its disk's pages: before its cgroup goes
                os.close(sandbox.disk_fd)
                sandbox.disk_fd = -1
            await _remove_cgroups(sandbox.cgroups)
            if sandbox.pidfd >= 0:
                os.close(sandbox.pidfd)
                sandbox.pidfd = -1
            sandbox.killed = True
            if sandbox.linked and self.egress is not None:
                # taking its elements out of the router's sets waits for the kernel (~12 ms): done after
                # the kill returns, and the slot is reused only then
                task = asyncio.get_running_loop().create_task(self._unlink(sandbox.slot))
                self._unlinking.add(task)
                task.add_done_callback(self._unlinking.discard)
                sandbox.linked = False
            else:
                self._slots.discard(sandbox.slot)
            for table in (self._sandboxes, self._owned):
                if table.get(sandbox.sandbox_id) is sandbox:
                    del table[sandbox.sandbox_id]

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
        assert isinstance(sandbox, LinuxSandbox)
        if sandbox.killed:
            raise SandboxGoneError(f"sandbox {sandbox.sandbox_id} was killed")
        if self.egress is None:
            if policy.internet or rules or tunnel:
                raise InvalidArgumentError(NO_EGRESS)
            return
        await self._check_tunnel(tunnel)
        await self.egress.apply(sandbox.slot, policy, rules=rules, tunnel=tunnel)

    async def _check_tunnel(self, tunnel: EgressTunnel | None) -> None:
        """network.egressProxy within the operator's ceiling (network/tunnel.py), before anything changes."""
        if tunnel is not None and self.egress is not None:
            try:
                await self.egress.check_tunnel(tunnel)
            except TunnelConfigError as e:
                raise InvalidArgumentError(str(e)) from None

    def check_policy(self, policy: Policy) -> None:
        self.policies.check(policy)

    async def enforce_policy(self, sandbox: RunningSandbox, policy: Policy, previous: Policy, asker: Asker) -> None:
        assert isinstance(sandbox, LinuxSandbox)
        if sandbox.killed:
            raise SandboxGoneError(f"sandbox {sandbox.sandbox_id} was killed")
        await self.policies.enforce(sandbox, policy, previous, asker)

    async def release_policy(self, sandbox: RunningSandbox) -> None:
        assert isinstance(sandbox, LinuxSandbox)
        await self.policies.release(sandbox)

    def sandbox_of_uid(self, uid: int) -> str | None:
        """The claimed sandbox whose processes run as host uid `uid` (None: a standby's, or none)."""
        for sb in self._sandboxes.values():
            if uid in sb.host_uids:
                return sb.sandbox_id
        return None

    async def set_pids_max(self, sandbox: RunningSandbox, n: int) -> None:
        """The sandbox's cgroup pids.max (v1 or v2) set to `n`, at most its own pids limit. Rootless
        without a pids cgroup: NotImplementedError (its RLIMIT_NPROC cannot change at run time)."""
        assert isinstance(sandbox, LinuxSandbox)
        try:
            check_pids_max(n, sandbox.limits.pids)
        except ValueError as e:
            raise InvalidArgumentError(str(e)) from None
        async with sandbox.kill_lock:  # never against a kill: its cgroups are going away
            if sandbox.killed:
                raise SandboxGoneError(f"sandbox {sandbox.sandbox_id} was killed")
            try:
                sandbox.cgroups.set_pids_max(n)
            except cgroups.CgroupError as e:
                if e.errno == errno.EOPNOTSUPP:
                    raise NotImplementedError(e.strerror or str(e)) from None
                raise SandboxError(f"sandbox {sandbox.sandbox_id}: pids.max not set: {e.strerror or e}") from e
            except OSError as e:
                raise SandboxError(f"sandbox {sandbox.sandbox_id}: pids.max not set: {e.strerror or e}") from e

    async def export_files(self, sandbox: RunningSandbox, dest: str, max_bytes: int) -> int:
        assert isinstance(sandbox, LinuxSandbox)
        async with sandbox.kill_lock:  # a kill waits: it closes the disk fd
            if sandbox.killed or sandbox.disk_fd < 0:
                raise SandboxGoneError(f"sandbox {sandbox.sandbox_id} was killed")
            disk_fd = os.dup(sandbox.disk_fd)
        try:  # the walk (host root, through fds only: disk_archive.py) runs off the event loop
            return await asyncio.to_thread(_export, disk_fd, dest, max_bytes, sandbox.owners, sandbox.image)
        finally:
            os.close(disk_fd)


    async def export_layer(self, sandbox: RunningSandbox, dest: str, max_bytes: int) -> str:
        """What an image sandbox changed (its root's upper layer and /home/user) as an OCI layer tar at
        `dest` (templates/capture.py); returns its diff_id. For template builds: each step's layer."""
        from agentcell.templates import capture

        assert isinstance(sandbox, LinuxSandbox)
        async with sandbox.kill_lock:
            if sandbox.killed or sandbox.disk_fd < 0:
                raise SandboxGoneError(f"sandbox {sandbox.sandbox_id} was killed")
            disk_fd = os.dup(sandbox.disk_fd)
        try:
            def write() -> str:
                with open(dest, "wb") as out:
                    return capture.write_layer(disk_fd, out, max_bytes, sandbox.owners)
            return await asyncio.to_thread(write)
        finally:
            os.close(disk_fd)


def rootless_ids() -> dict[str, Any]:
    """uids.reserve's options inside a rootless namespace: the sandbox ids come from the ids mapped
    there (the user's subordinate ids), reserved in the user's own lock directory."""
    return {"lock_dir": rootless.uid_lock_dir(), "account_files": (), "start": rootless.FIRST_SANDBOX_ID,
            "end": uids.mapped_ids_end(), "align": 1024}


def _claimable(prepared: Limits, wanted: Limits) -> bool:
    """Whether a standby prepared with `prepared` can serve `wanted`: memory and CPU are cgroup
    settings the claim can change; the disk's size, rlimits and pids (also an rlimit) are not."""
    same_rest = replace(wanted, memory_mb=prepared.memory_mb, cpu_count=prepared.cpu_count, disk_mb=None)
    return same_rest == replace(prepared, disk_mb=None) and wanted.disk_limit_mb == prepared.disk_limit_mb


def _cgroup_re(parent: str) -> re.Pattern[str]:
    return re.compile("^" + re.escape(parent) + r"/s[0-9]+-[0-9]+$")


def _setup_failure(sandbox_id: str, frame: dict[str, Any] | None) -> SandboxError:
    """The error for a bad handshake frame: the child's own code (e.g. invalid_argument for a bad disk
    archive) when it sent one."""
    message = _setup_error(sandbox_id, frame)
    code = frame.get("code") if frame is not None and frame.get("event") == "error" else None
    return error_from_code(code, message) if isinstance(code, str) else SandboxError(message)


def _setup_error(sandbox_id: str, frame: dict[str, Any] | None) -> str:
    if frame is None:
        return f"sandbox {sandbox_id} exited during setup; check the server log"
    if frame.get("event") == "error":
        return f"sandbox {sandbox_id}: {frame.get('message')}"
    return f"sandbox {sandbox_id} sent an unexpected handshake frame {frame!r}"


async def _wait_readable(fd: int, timeout: float) -> None:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
    try:
        async with asyncio.timeout(timeout):
            await fut
    except TimeoutError:
        pass
    finally:
        loop.remove_reader(fd)


async def _remove_cgroups(cg: cgroups.Cgroups) -> None:
    """rmdir the cgroups; retry briefly while the dead tasks are still being reaped (EBUSY)."""
    delay = 0.002
    deadline = time.monotonic() + 5.0
    while True:
        try:
            if cg.remove():
                return
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                raise
        if time.monotonic() > deadline:
            cg.kill_all()  # stragglers (should not happen: they all died with pid 1)
            if time.monotonic() > deadline + 2:
                raise SandboxError(f"cgroups of sandbox {cg.sandbox_id} stay busy; remove them by hand")
        await asyncio.sleep(delay)
        delay = min(delay * 2, 0.05)
