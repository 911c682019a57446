"""What every backend whose sandboxes each have a cgroup of their own does the same way (linux,
gvisor): measure a sandbox, the budget all of them share, pause and resume with the freezer."""

from __future__ import annotations

import asyncio
from typing import Any

from agentcell.backends.base import Capacity, RunningSandbox, SandboxStats
from agentcell.backends.linux import cgroups
from agentcell.errors import SandboxError, SandboxGoneError


class CgroupSandboxes:
    """Mixed into a Backend whose sandboxes have `cgroups` (cgroups.Cgroups), `killed` and
    `kill_lock`, and which has `host_budget` (host.HostBudget | None) and `cgroup_parent`."""

    host_budget: Any
    cgroup_parent: str

    async def stats(self, sandbox: RunningSandbox) -> SandboxStats:
        sb: Any = sandbox
        if sb.killed:
            raise SandboxGoneError(f"sandbox {sb.sandbox_id} was killed")
        try:
            return sb.cgroups.stats()
        except OSError as e:
            raise SandboxGoneError(f"sandbox {sb.sandbox_id} has no cgroup any more: {e}") from e

    async def capacity(self) -> Capacity | None:
        if self.host_budget is None:
            return None
        try:
            used = cgroups.Cgroups.at(self.cgroup_parent).stats()
        except OSError:
            return None
        return Capacity(self.host_budget.memory_bytes, self.host_budget.pids, used.memory_bytes, used.pids)

    async def pause(self, sandbox: RunningSandbox) -> None:
        await self._freeze(sandbox, True)

    async def resume(self, sandbox: RunningSandbox) -> None:
        await self._freeze(sandbox, False)

    async def _freeze(self, sandbox: RunningSandbox, frozen: bool) -> None:
        """The host freezer (gvisor: `runsc pause` would leave systrap's stubs spinning)."""
        sb: Any = sandbox
        async with sb.kill_lock:  # never against a kill: its cgroups are going away
            if sb.killed:
                raise SandboxGoneError(f"sandbox {sb.sandbox_id} was killed")
            try:  # waits (ms) for the last task to stop: off the event loop
                await asyncio.to_thread(sb.cgroups.freeze if frozen else sb.cgroups.thaw)
            except OSError as e:
                raise SandboxError(f"sandbox {sb.sandbox_id} could not be {'paused' if frozen else 'resumed'}: "
                                   f"{e.strerror or e}") from e
