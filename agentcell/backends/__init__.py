"""Isolation backends. `get_backend(name)` returns one by name; "linux" is the default."""

from __future__ import annotations

from typing import Any

from agentcell.backends.base import Backend, Limits, RunningSandbox, SandboxSpec, SandboxStats


def get_backend(name: str = "linux", **options: Any) -> Backend:
    """The backend `name`, built with `options` (for linux: uid_base, max_sandboxes, ...)."""
    if name == "linux":
        from agentcell.backends.linux.backend import LinuxBackend

        return LinuxBackend(**options)
    if name == "gvisor":
        from agentcell.backends.gvisor.backend import GvisorBackend

        return GvisorBackend(**options)
    if name == "microvm":
        from agentcell.backends.microvm.backend import MicrovmBackend

        return MicrovmBackend(**options)
    raise ValueError(f"unknown backend {name!r}; available: linux, gvisor, microvm")


__all__ = ["Backend", "Limits", "RunningSandbox", "SandboxSpec", "SandboxStats", "get_backend"]
