"""GvisorBackend: every sandbox is a gVisor sandbox (runsc), its agent on a socket the sentry imported.

A sandbox is `runsc run --detach` of a bundle whose root is the backend's read-only tree (rootfs.py)
under a memory overlay, whose init is guest.py. Its stdin and stdout are one end of a socketpair; the
server keeps the other (RunningSandbox.sock) and speaks the agent protocol on it, as with the linux
backend. That socket is a host fd the sentry imported as the init's stdio, which checkpoint and restore
handle (a restored sandbox gets the restoring runsc's stdio), unlike host UDS endpoints, which block a
checkpoint.

runsc puts the sandbox's host processes (sentry, gofer, systrap stubs) in the cgroup the spec names,
/agentcell/<instance>/<sandbox id> in every hierarchy, with its memory limit and CPU quota: capacity
accounting, stats, pause (the freezer) and kill (SIGKILL every task there) all work on that cgroup, as
with the linux backend. A sandbox has its own runsc state directory, so removing it is all the cleanup
runsc needs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import select
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from agentcell.backends.base import (
    Asker,
    Backend,
    Limits,
    RunningSandbox,
    SandboxSpec,
    VolumeMount,
    policy_parts,
)
from agentcell.backends.cgroup_backend import CgroupSandboxes, OwnSandboxes, kill_cgroup
from agentcell.backends.gvisor import reap, rootfs, seccomp_extra, spec, standby, volume_points
from agentcell.backends.gvisor.runsc import Runsc, private_null
from agentcell.backends.linux import cgroups, host, runtime_store, watchdog
from agentcell.backends.linux import syscalls as sc
from agentcell.backends.linux.backend import _claimable, _read_frame
from agentcell.backends.pool import StandbyPool
from agentcell.errors import (
    BackendUnavailableError,
    InvalidArgumentError,
    ResourceExhaustedError,
    SandboxError,
    SandboxGoneError,
)
from agentcell.policy.model import Policy, PolicyError
from agentcell.runtime.protocol import encode_frame
from agentcell.server import progress

STATE_BASE = "/run/agentcell/gvisor"
READY_TIMEOUT = 60.0
PREPARE_PARALLEL = 2  # standbys restored at once (each restore is ~0.3-0.6 s of CPU)
STANDBYS = 4  # sandboxes restored from the template and kept frozen, ready for a create (--standbys)  # a fresh sandbox imports the whole data-science stack under gVisor (~2-4 s)
_RENAME_CALL = (1 << 31) - 1  # the call id of restore()'s rename: never one of the server's (they count from 1)
NO_NETWORK = ("the gvisor backend gives sandboxes no network at all (runsc --network=none: gVisor's netstack "
              "cannot be attached to a network namespace in this runsc, google/gvisor#10704); create the "
              "sandbox with allow_internet_access=False and no secrets, or use the linux backend")


# A policy's processes.max (Backend.set_pids_max): the guest's limit is its RLIMIT_NPROC, set at the start
# (each process keeps its own, and may raise its soft limit back to its hard one; a hard limit, once
# lowered, cannot go up again); the host's pids cgroup counts the sentry's threads, and a sandbox that
# reaches it dies whole (spec.py). Neither can serve as a run-time limit.
NO_PIDS_MAX = ("the gvisor backend cannot change a running sandbox's process limit: inside the guest it is the "
               "RLIMIT_NPROC set at the start, and the host's pids cgroup counts the sentry's own threads "
               "(reaching it kills the whole sandbox); create the sandbox with the pids limit it needs")


# Why each part of a sandbox policy but its syscalls cannot be enforced here: the guest's execs, files and
# processes are the sentry's, which no host mechanism (fanotify, mounts, cgroups) sees one by one.
GVISOR_POLICY = {
    "policy.exec": "the gvisor backend cannot enforce exec rules: a guest's execs happen inside the sentry, out of "
                   "reach of the host's fanotify and BPF; use the linux backend for exec rules",
    "policy.files": "the gvisor backend cannot enforce file rules on a running sandbox (its mounts are the sentry's); "
                    "use the linux backend for file rules",
    "policy.processes": NO_PIDS_MAX,
    "policy.network": "gvisor sandboxes get no internet on this server, so there is no connection to ask about",
}


class GvisorSandbox(RunningSandbox):
    def __init__(self, sandbox_id: str, sock: socket.socket, directory: str, cgroup: str, limits: Limits) -> None:
        self.sandbox_id = sandbox_id
        self.sock = sock
        self.dir = directory  # bundle (config.json) and runsc's --root
        self.cgroups = cgroups.Cgroups.at(cgroup.lstrip("/"), every_hierarchy=True)  # runsc makes them all
        self.limits = limits
        self.host_pid = -1
        self.pidfd = -1
        self.killed = False
        self.kill_lock = asyncio.Lock()
        self.volumes: tuple[VolumeMount, ...] = ()  # mounted at its boot (their mount points: volume_points.py)

    @property
    def runsc_root(self) -> str:
        return os.path.join(self.dir, "runsc")

    def alive(self) -> bool:
        if self.killed or self.pidfd < 0:
            return False
        poller = select.poll()
        poller.register(self.pidfd, select.POLLIN)
        return not poller.poll(0)


class GvisorBackend(OwnSandboxes, CgroupSandboxes, Backend):
    name = "gvisor"
    memory_snapshots = True

    def __init__(self, max_sandboxes: int = 1000, platform: str | None = None, directfs: bool = False,
                 ready_timeout: float = READY_TIMEOUT, state_base: str = STATE_BASE,
                 host_tuning: host.HostTuning | None = None, standbys: int = STANDBYS,
                 standby_limits: Limits | None = None, egress: Any = None, uid_base: int | None = None,
                 state_dir: str | None = None, record_denials: str = "failures", **host_options: Any) -> None:
        """The server passes the linux backend's options: `egress` must be none (no uplink), and
        `uid_base` means nothing here (the guest kernel has its own ids). `state_dir` (the server's
        snapshots) is not used: runsc's state and the template image live in `state_base`, on /run,
        as they do not outlive a boot (images the server keeps go where checkpoint() is told)."""
        if max_sandboxes < 1:
            raise ValueError("max_sandboxes must be at least 1")
        if egress is not None and getattr(egress, "enabled", False):
            raise BackendUnavailableError("the gvisor backend gives sandboxes no network: start the server with "
                                          "--egress-uplink none")
        platform = platform or os.environ.get("AGENTCELL_GVISOR_PLATFORM") or "systrap"
        self.standbys = standbys
        self.standby_limits = standby_limits or Limits()
        self.max_sandboxes = max_sandboxes
        self.platform = platform
        self.directfs = directfs
        self.ready_timeout = ready_timeout
        self.instance = cgroups.new_instance_id()
        self.cgroup_parent = f"{cgroups.GROUP}/{self.instance}"
        self.state_base = state_base
        self.state = os.path.join(state_base, self.instance)
        self.root = os.path.join(self.state, "root")
        self.mount_points = volume_points.MountPoints(self.root)
        self.host_tuning = host_tuning or host.HostTuning(**host_options)
        self.host_budget: host.HostBudget | None = None
        self.runsc: Runsc | None = None
        self._runtime: runtime_store.Store | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._sandboxes: dict[str, GvisorSandbox] = {}  # every sandbox with a process: standbys too
        self.claimed: set[str] = set()
        self._pool: StandbyPool[GvisorSandbox] | None = None
        self.template = os.path.join(self.state, "template")  # the standbys' checkpoint image
        self._seccomp = ""
        self._seccomp_strict = ""
        self.last_create_ms = 0.0

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        if os.geteuid() != 0:
            raise BackendUnavailableError("the gvisor backend must run as root (runsc, cgroups, the root tree's mounts)")
        if self.runsc is not None:
            return
        self.runsc = await asyncio.to_thread(Runsc.find, self.platform, self.directfs)
        try:
            stale = await asyncio.to_thread(cgroups.remove_stale_instances)
            if stale:
                print(f"agentcell: removed the cgroups of {len(stale)} dead server(s): {', '.join(stale)}",
                      file=sys.stderr)
            await asyncio.to_thread(rootfs.remove_stale, self.state_base, cgroups.instance_alive)
            cgroups.prepare_instance(self.instance)
        except cgroups.CgroupError as e:
            raise BackendUnavailableError(str(e)) from e
        try:
            self.host_budget = await asyncio.to_thread(host.prepare, self.cgroup_parent, self.max_sandboxes,
                                                       self.host_tuning)
        except OSError as e:
            raise BackendUnavailableError(f"cannot limit what sandboxes take from the host: {e}") from e
        reap.become_subreaper()
        os.makedirs(self.state, mode=0o700, exist_ok=True)
        os.makedirs(os.path.join(self.state, "sandboxes"), mode=0o700, exist_ok=True)
        self.runsc = self.runsc.with_private_null(self.state)
        # sandboxes die with the server: see watchdog.py
        self._watchdog = watchdog.start("agentcell.backends.gvisor.watchdog", self.cgroup_parent, self.state)
        self._runtime = await asyncio.to_thread(runtime_store.ensure)
        with progress.step("gvisor: preparing the sandboxes' root tree"):
            await asyncio.to_thread(rootfs.build, self.root, self._runtime)
        # the linux backend's filter and more (seccomp_extra.py), loaded by the guest init (guest.py)
        self._seccomp = base64.b64encode(seccomp_extra.build()).decode()
        self._seccomp_strict = base64.b64encode(seccomp_extra.build_strict()).decode()  # a policy's "strict"
        if self.standbys:
            with progress.step("gvisor: booting and saving the template the standbys are restored from"):
                await self._build_template()
            self._pool = StandbyPool(self._prepare_standby, self.kill, GvisorSandbox.alive, self.standbys,
                                     PREPARE_PARALLEL, prepare_now=lambda: self._prepare_standby(yield_cpu=False))
            self._pool.fill()

    def standby_pools(self) -> dict[str, StandbyPool[GvisorSandbox]]:
        return {"base": self._pool} if self._pool is not None else {}

    async def close(self) -> None:
        if self._pool is not None:
            await self._pool.close()
            self._pool = None
        for sb in list(self._sandboxes.values()):
            with contextlib.suppress(Exception):
                await self.kill(sb)
        await asyncio.to_thread(rootfs.remove, self.root)
        with contextlib.suppress(OSError):
            await asyncio.to_thread(cgroups.remove_tree, self.cgroup_parent)
        await asyncio.to_thread(host.release, self.cgroup_parent)  # the sysctls it raised, if it was the last
        if self._watchdog is not None:  # it removes what is left (nothing, normally) and exits
            assert self._watchdog.stdin is not None
            self._watchdog.stdin.close()
            await asyncio.to_thread(self._watchdog.wait)
            self._watchdog = None
        if self._runtime is not None:
            self._runtime.close()
            self._runtime = None
        self.runsc = None

    # -- sandboxes -------------------------------------------------------------------------------

    def _check(self, spec_: SandboxSpec) -> None:
        self._check_basics(spec_)
        if spec_.network.internet or spec_.secrets:
            raise InvalidArgumentError(NO_NETWORK)
        volume_points.check(spec_.volumes)

    def _make_sandbox(self, sandbox_id: str, limits: Limits, sock: socket.socket,
                      volumes: tuple[VolumeMount, ...] = (), yield_cpu: bool = False) -> GvisorSandbox:
        directory = os.path.join(self.state, "sandboxes", sandbox_id)
        os.makedirs(directory, mode=0o700)
        cgroup = f"/{self.cgroup_parent}/{sandbox_id}"
        assert self._runtime is not None, "start() first"
        config = spec.build(sandbox_id, self.root, cgroup, limits, self._runtime.layout, yield_cpu)
        config["mounts"] += spec.volume_mounts(volumes)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(config, f)
        sb = GvisorSandbox(sandbox_id, sock, directory, cgroup, limits)
        self._sandboxes[sandbox_id] = sb
        return sb

    async def _started(self, sb: GvisorSandbox) -> None:
        """After runsc run/restore: the sandbox process's pid and a pidfd of it."""
        with open(os.path.join(sb.dir, "pid")) as f:
            sb.host_pid = int(f.read().strip())
        sb.pidfd = os.pidfd_open(sb.host_pid)

    async def create(self, spec_: SandboxSpec) -> RunningSandbox:
        """A standby restored from the template, thawed and claimed; or, for an id or limits no standby
        has, a sandbox booted for it now (seconds: it imports the whole runtime)."""
        t0 = time.perf_counter()
        self._check(spec_)
        sb: GvisorSandbox | None = None
        # a sandbox with volumes is booted with them (a standby's mounts were fixed at its checkpoint)
        if (not spec_.sandbox_id and not spec_.volumes and self._pool is not None
                and _claimable(self.standby_limits, spec_.limits)):
            sb = await self._pool.take()
            try:  # thawed first: the sentry wakes while the cgroup is retuned
                await asyncio.to_thread(_thaw_and_retune, sb.cgroups, sb.limits, spec_.limits)
            except OSError:  # e.g. less memory than the standby already holds: boot one instead
                await self.kill(sb)
                sb = None
        warm = sb is not None  # a standby: named, reseeded and warmed already (standby.py)
        if sb is None:
            sb = await self._boot(spec_.sandbox_id or self._new_id(), spec_.limits, spec_.volumes)
        try:
            sb.limits = spec_.limits
            if spec_.files:  # before the claim: the tenant's code finds its files in place
                await self._untar(sb, spec_.files)
            if warm:  # one round trip: the tenant's env vars
                await standby.claim(sb.sock, sb.sandbox_id, dict(spec_.envs), self.ready_timeout)
            else:  # the claim of a booted sandbox: the tenant's env vars, its name (its own already)
                await asyncio.get_running_loop().sock_sendall(sb.sock, encode_frame(
                    {"id": 0, "op": "claim", "envs": dict(spec_.envs), "hostname": sb.sandbox_id}))
        except BaseException:
            await self.kill(sb)
            raise
        sb.sock.setblocking(True)
        self.claimed.add(sb.sandbox_id)
        self.last_create_ms = (time.perf_counter() - t0) * 1000
        return sb

    async def _boot(self, sandbox_id: str, limits: Limits, volumes: tuple[VolumeMount, ...] = ()) -> GvisorSandbox:
        """`runsc run` a sandbox up to its agent's "ready" (it then waits for its claim)."""
        assert self.runsc is not None, "start() first"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sb = self._make_sandbox(sandbox_id, limits, ours, volumes)
        self.mount_points.take(volumes)
        sb.volumes = volumes
        try:
            try:
                await self.runsc.call(sb.runsc_root, "run", "--detach", f"--bundle={sb.dir}",
                                      f"--pid-file={os.path.join(sb.dir, 'pid')}", sandbox_id, stdio=theirs.fileno())
            finally:
                theirs.close()
            await self._started(sb)
            ours.setblocking(False)
            loop = asyncio.get_running_loop()
            request = {"sandbox_id": sandbox_id, "limits": asdict(limits), "preload": True,
                       "seccomp": self._seccomp, "seccomp_strict": self._seccomp_strict}
            async with asyncio.timeout(self.ready_timeout):
                await loop.sock_sendall(ours, encode_frame(request))
                ready = await _read_frame(loop, ours)
            if ready is None or ready.get("event") != "ready":
                raise SandboxError(f"sandbox {sandbox_id} exited during setup: {self._log_tail(sb)}")
        except BaseException as e:
            await self.kill(sb)
            if isinstance(e, TimeoutError):
                raise SandboxError(f"sandbox {sandbox_id} did not become ready within {self.ready_timeout:g} s") from None
            raise
        return sb

    # -- the warm pool: standbys restored from a template image ---------------------------------

    async def _build_template(self) -> None:
        """Boot one sandbox whose agent has imported everything, its default context warm, waiting
        for its claim, and save it; standbys are restored from it. A restored copy redraws its random
        generators at the claim (guest.claimed, and the context on the claim's env vars: kernel.py)."""
        assert self.runsc is not None
        t0 = time.perf_counter()
        sb = await self._boot(self._new_id(), self.standby_limits)
        try:
            shutil.rmtree(self.template, ignore_errors=True)
            await self.runsc.call(sb.runsc_root, "checkpoint", f"--image-path={self.template}", "--compression=none",
                                  sb.sandbox_id, timeout=120)
        finally:
            await self.kill(sb)
        print(f"agentcell: gvisor template saved in {time.perf_counter() - t0:.1f} s "
              f"({_du(self.template) >> 20} MiB)", file=sys.stderr)

    async def _restore(self, image: str, sandbox_id: str, limits: Limits, yield_cpu: bool = False) -> GvisorSandbox:
        """A new sandbox from a checkpoint image: its own id, bundle, cgroup (limits) and socket;
        `yield_cpu`: restored at the lowest CPU weight (a standby nobody waits for yet)."""
        assert self.runsc is not None, "start() first"
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        sb = self._make_sandbox(sandbox_id, limits, ours, yield_cpu=yield_cpu)
        try:
            try:
                await self.runsc.call(sb.runsc_root, "restore", "--detach", f"--image-path={image}",
                                      f"--bundle={sb.dir}", f"--pid-file={os.path.join(sb.dir, 'pid')}", sandbox_id,
                                      stdio=theirs.fileno(), timeout=120)
            finally:
                theirs.close()
            await self._started(sb)
        except BaseException:
            await self.kill(sb)
            raise
        return sb

    async def _prepare_standby(self, yield_cpu: bool = True) -> GvisorSandbox:
        """Restored from the template, named, reseeded and warmed for no tenant (standby.py), frozen.
        `yield_cpu`: at the lowest CPU weight, so that the pool's refill after a burst yields to the
        burst's creates and to sandboxes serving someone; a create that waits for its own preparation
        (the pool's prepare_now) gets the default weight. The claim gives every standby the default."""
        sb = await self._restore(self.template, self._new_id(), self.standby_limits, yield_cpu)
        try:
            sb.sock.setblocking(False)
            await standby.warm(sb.sock, sb.sandbox_id, self.ready_timeout)
            # idle systrap stubs spin (2-7 % of a core each): a standby waits frozen
            await asyncio.to_thread(sb.cgroups.freeze)
        except BaseException:
            await self.kill(sb)
            raise
        return sb

    def _log_tail(self, sb: GvisorSandbox, name: str = "runsc.err") -> str:
        try:
            with open(os.path.join(sb.runsc_root, name), errors="replace") as f:
                return f.read()[-1500:].strip() or "no output"
        except OSError:
            return "no output"

    async def kill(self, sandbox: RunningSandbox) -> None:
        assert isinstance(sandbox, GvisorSandbox)
        sb = sandbox
        async with sb.kill_lock:
            if sb.killed:
                return
            sb.killed = True
            with contextlib.suppress(OSError):
                sb.sock.close()
            await asyncio.to_thread(kill_cgroup, sb.cgroups, reap.reap)
            if sb.pidfd >= 0:
                os.close(sb.pidfd)
                sb.pidfd = -1
            reap.reap()
            await asyncio.to_thread(shutil.rmtree, sb.dir, True)
            self.mount_points.give_back(sb.volumes)
            if self._sandboxes.get(sb.sandbox_id) is sb:
                del self._sandboxes[sb.sandbox_id]
                self.claimed.discard(sb.sandbox_id)

    async def export_files(self, sandbox: RunningSandbox, dest: str, max_bytes: int) -> int:
        """/home/user and /tmp as a pax tar with top directories home/ and tmp/ (disk_archive.py's
        names; the root overlay's changes are not in it), made by tar inside the guest (runsc exec, as
        the guest's root) and written here as it comes, cut off past `max_bytes`. The guest has to
        run for it: a paused sandbox is thawed for the export, and frozen again after it."""
        assert isinstance(sandbox, GvisorSandbox) and self.runsc is not None
        sb = sandbox
        async with sb.kill_lock:
            if sb.killed:
                raise SandboxGoneError(f"sandbox {sb.sandbox_id} was killed")
            frozen = await asyncio.to_thread(sb.cgroups.frozen)
            if frozen:
                await asyncio.to_thread(sb.cgroups.thaw)
            try:
                return await self._tar(sb, dest, max_bytes)
            finally:
                if frozen:
                    await asyncio.to_thread(sb.cgroups.freeze)

    async def _untar(self, sb: GvisorSandbox, archive: str) -> None:
        """A disk archive's home/ and tmp/ into the sandbox, by tar inside the guest (as its root, so
        the archive's owners and modes are kept): whatever the archive holds lands in the sandbox's own
        memory-backed files and nowhere else. The archive is fed through a pipe, never donated as a
        file (runsc chowns the stdio it hands the guest)."""
        assert self.runsc is not None
        argv = self.runsc.argv(sb.runsc_root, "exec", "--user=0:0", sb.sandbox_id, "/usr/bin/tar", "-x",
                               "--numeric-owner", "--same-permissions", "-C", "/", "--anchored", "--exclude=root",
                               "--transform=s,^home,home/user,", "-f", "-")
        with open(os.path.join(sb.runsc_root, "import.err"), "wb") as err, private_null(sb.runsc_root) as null:
            proc = await asyncio.create_subprocess_exec(*argv, stdin=subprocess.PIPE, stdout=null, stderr=err, cwd="/")
        assert proc.stdin is not None
        try:
            with open(archive, "rb") as f:
                while chunk := await asyncio.to_thread(f.read, 1 << 20):
                    proc.stdin.write(chunk)
                    await proc.stdin.drain()
            proc.stdin.close()
            code = await proc.wait()
        except BaseException:
            proc.stdin.close()  # else wait() waits for a pipe the sentry holds open
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            raise
        if code != 0:
            tail = self._log_tail(sb, "import.err")
            if "No space left" in tail:
                raise ResourceExhaustedError(f"the archive's files do not fit in sandbox {sb.sandbox_id}'s disk")
            raise InvalidArgumentError(f"the disk archive could not be extracted in sandbox {sb.sandbox_id}: {tail}")

    async def _tar(self, sb: GvisorSandbox, dest: str, max_bytes: int) -> int:
        """The guest's tar written to `dest`. Its stdout is a pipe of our own, not asyncio's: runsc
        hands the write end to the sentry, which holds it as long as the guest's tar runs, so the only
        way to stop a tar that passes `max_bytes` is to close the read end (its next write fails and it
        exits); waiting on a killed `runsc exec` with an asyncio pipe would wait for that pipe forever."""
        assert self.runsc is not None
        argv = self.runsc.argv(sb.runsc_root, "exec", "--user=0:0", sb.sandbox_id, "/usr/bin/tar", "--format=pax",
                               "--numeric-owner", "--sparse", "-C", "/", "--transform=s,^home/user,home,",
                               "-cf", "-", "home/user", "tmp")
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        written = 0
        read_end, write_end = os.pipe2(os.O_CLOEXEC)
        try:
            with open(os.path.join(sb.runsc_root, "export.err"), "wb") as err, private_null(sb.runsc_root) as null:
                proc = await asyncio.create_subprocess_exec(*argv, stdin=null, stdout=write_end, stderr=err, cwd="/")
        except BaseException:
            os.close(read_end)
            os.close(fd)
            os.unlink(dest)
            raise
        finally:
            os.close(write_end)
        try:
            while chunk := await asyncio.to_thread(os.read, read_end, 1 << 20):
                written += len(chunk)
                if written > max_bytes:
                    raise ResourceExhaustedError(f"the files of sandbox {sb.sandbox_id} are over {max_bytes} bytes")
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view):]
            if await proc.wait() not in (0, 1):  # 1: a file changed while it was read
                raise SandboxError(f"tar in sandbox {sb.sandbox_id} failed: {self._log_tail(sb, 'export.err')}")
        except BaseException:
            os.close(read_end)  # the guest's tar gets EPIPE and ends
            read_end = -1
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            os.close(fd)
            fd = -1
            with contextlib.suppress(OSError):
                os.unlink(dest)
            raise
        finally:
            if read_end >= 0:
                os.close(read_end)
            if fd >= 0:
                os.close(fd)
        return written

    # -- memory snapshots: runsc checkpoint / restore --------------------------------------------

    def check_policy(self, policy: Policy) -> None:
        """What a gvisor sandbox's policy can hold: its syscalls (the guest's agent loads the strict filter
        into the sentry's seccomp). The rest names why not (docs/security.md, "Sandbox policy")."""
        for part, used in policy_parts(policy):
            if used and part != "policy.syscalls":
                raise PolicyError(part, GVISOR_POLICY[part])

    async def enforce_policy(self, sandbox: RunningSandbox, policy: Policy, previous: Policy, asker: Asker) -> None:
        self.check_policy(policy)  # syscalls: the server's call to the agent did it

    async def set_pids_max(self, sandbox: RunningSandbox, n: int) -> None:
        raise NotImplementedError(NO_PIDS_MAX)

    async def checkpoint(self, sandbox: RunningSandbox, image_dir: str, leave_running: bool) -> int:
        assert isinstance(sandbox, GvisorSandbox) and self.runsc is not None
        sb = sandbox
        if os.path.exists(image_dir):
            raise InvalidArgumentError(f"{image_dir} exists already")
        async with sb.kill_lock:
            if sb.killed:
                raise SandboxGoneError(f"sandbox {sb.sandbox_id} was killed")
            frozen = await asyncio.to_thread(sb.cgroups.frozen)
            if frozen:  # the sentry saves the sandbox itself: it has to run
                await asyncio.to_thread(sb.cgroups.thaw)
            try:
                args = ["checkpoint", f"--image-path={image_dir}", "--compression=none"]
                if leave_running:
                    args.append("--leave-running")
                await self.runsc.call(sb.runsc_root, *args, sb.sandbox_id, timeout=300)
                with open(os.path.join(image_dir, "agentcell.json"), "w") as f:
                    json.dump({"sandbox_id": sb.sandbox_id, "limits": asdict(sb.limits)}, f)
            finally:
                if frozen and leave_running:
                    await asyncio.to_thread(sb.cgroups.freeze)
        if not leave_running:  # hibernated: its processes are gone, what is left of it goes too
            await self.kill(sb)
        return _du(image_dir)

    async def restore(self, image_dir: str, spec_: SandboxSpec) -> RunningSandbox:
        """A new sandbox from a checkpoint of a claimed one: its memory, processes and files, and
        `spec_`'s id and limits (memory and CPU: the disk's size and the rlimits are the image's).
        Its agent serves at once (it was claimed); it takes its own host name and redraws its
        generators (guest.py's gvisor.rename) before this returns."""
        self._check(spec_)
        sandbox_id = spec_.sandbox_id or self._new_id()
        sb = await self._restore(image_dir, sandbox_id, spec_.limits)
        try:
            sb.sock.setblocking(False)
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(self.ready_timeout):
                await loop.sock_sendall(sb.sock, encode_frame({"id": _RENAME_CALL, "op": "gvisor.rename",
                                                               "hostname": sandbox_id}))
                answer = await _read_frame(loop, sb.sock)
            if answer is None or answer.get("id") != _RENAME_CALL or answer.get("error"):
                raise SandboxError(f"sandbox {sandbox_id} restored from {image_dir} did not take its name: {answer}")
        except BaseException:
            await self.kill(sb)
            raise
        sb.sock.setblocking(True)
        self.claimed.add(sandbox_id)
        return sb


def _du(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
    return total


def _thaw_and_retune(cg: cgroups.Cgroups, old: Limits, new: Limits) -> None:
    """A standby, thawed, with the memory limit and CPU quota of its claim (runsc wrote the
    standby's at restore) and the default CPU weight (a standby's was the lowest)."""
    cg.thaw()
    cg.set_cpu_weight(standby=False)
    if new.cpu_count != old.cpu_count:
        quota = str(max(1000, int(new.cpu_count * 100_000)))
        if cg.v2:
            sc.write_file(f"{cg.dirs['unified']}/cpu.max", f"{quota} 100000")
        else:
            sc.write_file(f"{cg.dirs['cpu']}/cpu.cfs_quota_us", quota)
    if new.memory_mb != old.memory_mb:
        path = f"{cg.dirs['unified']}/memory.max" if cg.v2 else f"{cg.dirs['memory']}/memory.limit_in_bytes"
        sc.write_file(path, str(spec.host_memory_bytes(new)))
