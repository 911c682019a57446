"""The interface every isolation backend implements.

A backend turns a `SandboxSpec` into a running sandbox whose agent (agentcell.runtime.agent) listens on
one end of a socketpair; the server keeps the other end. The backend owns everything about the
isolation (namespaces, filters, cgroups, root view) and the sandbox's lifetime; the server only
speaks the agent protocol over the socket.
"""

from __future__ import annotations

import abc
import secrets
import socket
import string
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from agentcell.network.policy import NetworkPolicy
from agentcell.network.secrets import HeaderRule, SecretSet
from agentcell.network.tunnel import EgressTunnel
from agentcell.policy.model import Policy, PolicyError
from agentcell.record.events import Recorder

if TYPE_CHECKING:
    from agentcell.backends.pool import StandbyPool

# The disk is a tmpfs: its pages are memory, charged to the sandbox's memory cgroup. A full disk must
# leave this much of the memory limit to the agent (~30 MiB with a Python context) and the user's
# processes, so that a writer gets ENOSPC instead of the OOM killer taking the agent.
DISK_HEADROOM_MB = 128


# The behaviour record's host-side collectors an operator may turn off (serve --record-collectors):
# processes (execs, exits, refused syscalls and writes: the kernel's audit), files (fanotify), limits.
COLLECTOR_NAMES = ("processes", "files", "limits")


def disk_headroom_mb(memory_mb: int) -> int:
    """The memory a full disk leaves free: DISK_HEADROOM_MB, or half the memory of a smaller sandbox."""
    return min(DISK_HEADROOM_MB, memory_mb // 2)


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-sandbox resource limits. Every one is enforced by the kernel, not by the agent."""

    memory_mb: int = 512  # cgroup memory limit (the disk's tmpfs pages count too)
    pids: int = 256  # cgroup pids limit: processes + threads
    cpu_count: float = 1.0  # CPU quota in cores (cfs quota / cpu.max)
    # size of the one memory-backed tmpfs behind /home/user, /tmp and /dev/shm together;
    # None: memory_mb - disk_headroom_mb(memory_mb) (384 for the default 512)
    disk_mb: int | None = None
    open_files: int = 1024  # RLIMIT_NOFILE
    file_size_mb: int = 1024  # RLIMIT_FSIZE: no single file bigger than this

    @property
    def disk_limit_mb(self) -> int:
        """The disk size in effect (disk_mb, or what the memory leaves when disk_mb is None)."""
        if self.disk_mb is not None:
            return self.disk_mb
        return max(1, self.memory_mb - disk_headroom_mb(self.memory_mb))

    @property
    def archive_max_bytes(self) -> int:
        """The most a disk archive of the sandbox's files may take: twice its disk (a tar's headers and
        padding around many small files) and 64 MiB."""
        return (self.disk_limit_mb << 20) * 2 + (64 << 20)

    @property
    def checkpoint_max_bytes(self) -> int:
        """The most a checkpoint of the sandbox (memory, processes, files) may take: its memory and a disk
        archive's most."""
        return (self.memory_mb << 20) + self.archive_max_bytes

    def validate(self) -> None:
        """What one sandbox may have: every value in range, and the disk inside the memory."""
        self.validate_ranges()
        most = self.memory_mb - disk_headroom_mb(self.memory_mb)
        if self.disk_limit_mb > most:
            raise ValueError(
                f"disk_mb must be at most memory_mb - {disk_headroom_mb(self.memory_mb)} = {most}, got "
                f"{self.disk_limit_mb}: the disk is held in the sandbox's memory, and a full disk must leave "
                "room for its processes (raise memory_mb for a bigger disk)")

    def validate_ranges(self) -> None:
        """Every value within what the backend can enforce (LIMIT_RANGES); disk_mb may be None."""
        for name, (low, high) in LIMIT_RANGES.items():
            value = getattr(self, name)
            if value is None and name == "disk_mb":
                continue
            if not low <= value <= high:
                raise ValueError(f"{name} must be between {low} and {high}, got {value}")


# What the backend can enforce at all; a server's operator sets its own, lower maximums.
LIMIT_RANGES: dict[str, tuple[float, float]] = {
    "memory_mb": (32, 65536),
    "pids": (8, 32768),
    "cpu_count": (0.05, 256),
    "disk_mb": (1, 1 << 20),
    "open_files": (64, 1 << 20),
    "file_size_mb": (1, 1 << 20),
}


def check_pids_max(n: object, ceiling: int) -> int:
    """A policy's processes.max for a sandbox whose own pids limit is `ceiling`: an int from the
    lowest pids limit a sandbox may have (LIMIT_RANGES) up to `ceiling`. Raises ValueError."""
    low = int(LIMIT_RANGES["pids"][0])
    if isinstance(n, bool) or not isinstance(n, int):
        raise ValueError(f"processes.max must be an integer, got {n!r}")
    if not low <= n <= ceiling:
        raise ValueError(f"processes.max must be between {low} and the sandbox's pids limit {ceiling}, got {n}")
    return n


_ID_ALPHABET = string.ascii_lowercase + string.digits


def new_sandbox_id() -> str:
    """A fresh, unguessable sandbox id (E2B's shape: 20 lowercase letters and digits)."""
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(20))


_cell_prefix = ""  # this server's cell id (server/cell.py), the first characters of its sandboxes' ids


def set_sandbox_id_prefix(prefix: str) -> None:
    """Every sandbox id made from now on starts with `prefix` (a gateway routes by it; "": none)."""
    global _cell_prefix
    _cell_prefix = prefix


def new_cell_sandbox_id() -> str:
    """A new sandbox's id: the cell id, if the server has one, then new_sandbox_id()."""
    return _cell_prefix + new_sandbox_id()


@dataclass(frozen=True)
class ImageRoot:
    """A template made from an image (agentcell/templates/): the sandbox's root is an overlay of its
    layers, with a copy-on-write upper layer on the sandbox's disk."""

    key: str  # what identifies these exact layers and settings: the standby pool's key
    layers: tuple[str, ...]  # host paths of the layer trees, top first (the store's, owners shifted)
    env: tuple[tuple[str, str], ...] = ()  # the image's Env, over the sandbox's defaults
    workdir: str = ""  # the image's WorkingDir ("": the user's home)
    python: str = ""  # the image's own python3, for run_code ("": the runtime's)
    shell: str = "/bin/bash"  # what commands run through: /bin/bash, else /bin/sh
    user: str = ""  # "root": the image's last USER is root, the default user of its commands (E2B); "": `user`
    start_cmd: str = ""  # E2B's start command, run at the sandbox's start as root ...
    ready_cmd: str = ""  # ... and the sandbox is ready once this exits 0


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    sandbox_id: str = ""  # ^[a-z0-9]+$, also the sandbox's hostname; "": the backend picks one
    template: str = "base"
    limits: Limits = field(default_factory=Limits)
    envs: dict[str, str] = field(default_factory=dict)  # default environment of every process and context
    network: NetworkPolicy = field(default_factory=NetworkPolicy)  # its way out; default: none
    secrets: SecretSet = field(default_factory=SecretSet)  # values the egress puts in its requests
    # a disk archive (backends/disk_archive.py) the sandbox starts with: E2B's filesystem snapshot,
    # or the files of a sandbox paused with mode="filesystem" that is resumed (a cold start)
    files: str | None = None
    image_root: ImageRoot | None = None  # a template made from an image; None: the backend's own root
    pooled: bool = True  # False: prepared for this create alone, never through (or making) a standby pool
    policy: Policy = field(default_factory=Policy)  # what its code may run, touch and reach (issue 28)
    volumes: tuple[VolumeMount, ...] = ()  # volumes mounted into it at create (agentcell/volumes/)


@dataclass(frozen=True)
class VolumeMount:
    """A volume in a sandbox: `source`, the host directory where the server has it mounted; `path`,
    where the sandbox sees it (absolute, normalised); read-only or not."""

    volume_id: str
    name: str
    source: str
    path: str
    read_only: bool = False


@dataclass(slots=True)
class SandboxStats:
    memory_bytes: int  # current cgroup memory usage
    memory_limit_bytes: int
    cpu_seconds: float  # cumulative CPU time of the sandbox
    pids: int
    cache_bytes: int = 0  # page cache charged to it (of which its disk's pages, on a tmpfs disk)
    disk_bytes: int = 0  # what its writable disk holds


@dataclass(frozen=True, slots=True)
class Capacity:
    """What all sandboxes of one backend together may use (enforced by the backend, e.g. a parent
    cgroup) and what they use now: the server's admission control compares requests against it."""

    memory_bytes: int
    pids: int
    memory_used: int
    pids_used: int


# How an enforcement point asks for a decision: (kind "exec" | "network", what) -> (allowed, remember)
Asker = Callable[[str, dict[str, Any]], Awaitable[tuple[bool, bool]]]


def policy_parts(policy: Policy) -> list[tuple[str, bool]]:
    """Each part of a policy, and whether it asks for anything beyond the default."""
    return [("policy.exec", policy.exec_rules), ("policy.files", bool(policy.files)),
            ("policy.syscalls", policy.syscalls != "default"), ("policy.processes", policy.processes_max is not None),
            ("policy.network", policy.network_ask)]


class RunningSandbox(abc.ABC):
    """A live sandbox as its backend sees it."""

    sandbox_id: str
    sock: socket.socket  # server end of the agent socket (blocking mode; the server makes it async)
    host_pid: int  # the sandbox's init (the agent), as the host sees it

    @abc.abstractmethod
    def alive(self) -> bool: ...


class Backend(abc.ABC):
    """Creates, measures and kills sandboxes. Implementations must be safe to call from asyncio."""

    name: str

    @abc.abstractmethod
    async def start(self) -> None:
        """Prepare (e.g. start template zygotes). Raise BackendUnavailableError with a fix if impossible."""

    @abc.abstractmethod
    async def create(self, spec: SandboxSpec) -> RunningSandbox:
        """Start a sandbox; return once its agent is ready to take requests on `sock`."""

    @abc.abstractmethod
    async def kill(self, sandbox: RunningSandbox) -> None:
        """Kill every process of the sandbox and free its resources. Idempotent."""

    @abc.abstractmethod
    async def stats(self, sandbox: RunningSandbox) -> SandboxStats: ...

    @abc.abstractmethod
    async def close(self) -> None:
        """Kill every sandbox and stop helper processes."""

    @property
    def isolation(self) -> str:
        """How its sandboxes are isolated, as /health and each sandbox's info say it (microvm under TCG:
        "emulated — no hardware isolation claim")."""
        return self.name

    @property
    def has_egress(self) -> bool:
        """Whether a sandbox can be given a way out at all (an uplink is configured)."""
        return False

    async def set_network(self, sandbox: RunningSandbox, policy: NetworkPolicy,
                          rules: tuple[HeaderRule, ...] = (), tunnel: EgressTunnel | None = None) -> None:
        """Replace a running sandbox's way out, E2B's header rules and its SOCKS5 proxy (`tunnel`, None:
        none; network/tunnel.py). New connections follow at once."""
        raise NotImplementedError(f"the {self.name} backend has no egress")

    # -- the sandbox's policy (issue 28; agentcell/policy/) ------------------------------------------

    def check_policy(self, policy: Policy) -> None:
        """Raise PolicyError naming the first part of `policy` this backend cannot enforce here (asked
        before any sandbox exists, so a create fails before it starts anything). By default: none."""
        for part, used in policy_parts(policy):
            if used:
                raise PolicyError(part, f"the {self.name} backend cannot enforce this; leave it out or create the "
                                        "sandbox on the linux backend")

    async def enforce_policy(self, sandbox: RunningSandbox, policy: Policy, previous: Policy,
                             asker: Asker) -> None:
        """Make `policy` (after `previous`, Policy() for a new sandbox) hold for the sandbox's processes;
        `asker` is how a held operation asks for a decision. check_policy() came first."""
        if not policy.empty:
            raise NotImplementedError(f"the {self.name} backend enforces no policy")

    async def release_policy(self, sandbox: RunningSandbox) -> None:
        """What the sandbox's policy held on the host (kernel marks, pins, held operations): gone."""
        return None

    recorder: Recorder | None = None
    record_collectors: frozenset[str] = frozenset(COLLECTOR_NAMES)

    def attach_recorder(self, recorder: Recorder, collectors: frozenset[str] | None = None) -> None:
        """Where this backend's events go (issue 10; before start()), and which of its host-side
        collectors run (COLLECTOR_NAMES; backends with none, like gvisor, record the server's events)."""
        self.recorder = recorder
        if collectors is not None:
            self.record_collectors = collectors

    async def capacity(self) -> Capacity | None:
        """The budget all sandboxes share and its use now; None if the backend cannot tell."""
        return None

    def standby_pools(self) -> Mapping[str, StandbyPool[Any]]:
        """Its pools of prepared sandboxes by template (/metrics reads their depth); none by default."""
        return {}

    # lifecycle: pause/resume, filesystem and memory snapshots -------------------------------------

    # whether checkpoint() / restore() work: E2B's memory snapshots (pause to disk, fork, snapshots
    # with mode="full"); a backend without them answers those with a clear error, never a silent
    # filesystem-only copy
    memory_snapshots: bool = False
    # whether export_files() reads a paused (frozen) sandbox's files without letting it run: then the
    # server keeps a copy of a memory-paused sandbox's files on disk, which a server restarted after a
    # crash resumes it from (its memory is lost with the server that held it)
    files_while_frozen: bool = False

    @abc.abstractmethod
    async def pause(self, sandbox: RunningSandbox) -> None:
        """Stop every process of the sandbox where it is (the cgroup freezer): no CPU, memory stays
        resident, its agent answers nothing until resume(). Idempotent."""

    @abc.abstractmethod
    async def resume(self, sandbox: RunningSandbox) -> None:
        """Undo pause(): every process runs on from where it stopped. Idempotent."""

    @abc.abstractmethod
    async def export_files(self, sandbox: RunningSandbox, dest: str, max_bytes: int) -> int:
        """Write the sandbox's writable files (/home/user, /tmp, the writable root's upper layers) to
        `dest` as a disk archive (backends/disk_archive.py); the size written. The caller pauses the
        sandbox first so that the archive is consistent. Raises ResourceExhaustedError past max_bytes."""

    async def set_pids_max(self, sandbox: RunningSandbox, n: int) -> None:
        """Limit the running sandbox to `n` processes + threads from now on (a policy's processes.max),
        at most its own pids limit (the operator's ceiling: check_pids_max). Raises NotImplementedError,
        saying why, where the backend cannot enforce that."""
        raise NotImplementedError(f"the {self.name} backend cannot change a running sandbox's process limit")

    async def checkpoint(self, sandbox: RunningSandbox, image_dir: str, leave_running: bool) -> int:
        """Save the whole sandbox (memory, processes, files) to `image_dir` (which must not exist);
        its size on disk. Without `leave_running`, the sandbox is gone afterwards (hibernation)."""
        raise NotImplementedError(f"the {self.name} backend cannot save a sandbox's memory")

    async def restore(self, image_dir: str, spec: SandboxSpec) -> RunningSandbox:
        """A new sandbox from a checkpoint(): the image's memory and files, `spec`'s id (new, or the
        hibernated sandbox's own), limits and envs; random generators reseeded. Like create(), it
        returns once the agent is ready and claimed."""
        raise NotImplementedError(f"the {self.name} backend cannot save a sandbox's memory")
