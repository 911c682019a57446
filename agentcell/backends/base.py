"""The interface every isolation backend implements.

A backend turns a `SandboxSpec` into a running sandbox whose agent (agentcell.runtime.agent) listens on
one end of a socketpair; the server keeps the other end. The backend owns everything about the
isolation (namespaces, filters, cgroups, root view) and the sandbox's lifetime; the server only
speaks the agent protocol over the socket.
"""

from __future__ import annotations

import abc
import socket
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-sandbox resource limits. Every one is enforced by the kernel, not by the agent."""

    memory_mb: int = 512  # cgroup memory limit (tmpfs pages count too)
    pids: int = 256  # cgroup pids limit: processes + threads
    cpu_count: float = 1.0  # CPU quota in cores (cfs quota / cpu.max)
    disk_mb: int = 1024  # size of the writable tmpfs for /home/user and of /tmp each
    open_files: int = 1024  # RLIMIT_NOFILE
    file_size_mb: int = 1024  # RLIMIT_FSIZE: no single file bigger than this

    def validate(self) -> None:
        for name, (low, high) in LIMIT_RANGES.items():
            value = getattr(self, name)
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


@dataclass(frozen=True, slots=True)
class SandboxSpec:
    sandbox_id: str  # ^[a-z0-9]+$, also the sandbox's hostname
    template: str = "base"
    limits: Limits = field(default_factory=Limits)
    envs: dict[str, str] = field(default_factory=dict)  # default environment of every process and context


@dataclass(slots=True)
class SandboxStats:
    memory_bytes: int  # current cgroup memory usage
    memory_limit_bytes: int
    cpu_seconds: float  # cumulative CPU time of the sandbox
    pids: int


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
