"""The sandbox registry: creates, finds, times out and kills sandboxes.

One record per live sandbox. A sandbox leaves the registry when it is killed, when its `endAt` passes
(the reaper), or when its agent channel closes (the agent died); in every case the backend kills it.
Killing one sandbox never touches another: each kill is its own task and errors are contained.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

from agentcell.backends.base import Backend, Limits, RunningSandbox, SandboxSpec
from agentcell.backends.network_policy import NetworkPolicy
from agentcell.backends.secrets import SecretSet
from agentcell.runtime.protocol import AgentChannel
from agentcell.server.metrics import SAMPLE_INTERVAL_S, MetricsHistory, sample_due

log = logging.getLogger("agentcell.server")

class CapacityError(Exception):
    """The server cannot take another sandbox now (count, committed limits, or use)."""


@dataclass(frozen=True)
class Admission:
    """How much the sandboxes' limits together may promise, against what the backend enforces for all
    of them (the parent cgroup). Limits are promises most sandboxes never use (an idle sandbox holds
    ~10 MiB of its 512), so they may add up to more than the budget; the budget itself is enforced by
    the kernel, and no new sandbox starts while the ones running use most of it."""

    memory_overcommit: float = 32.0  # sum of memory limits <= this x the memory budget
    pids_overcommit: float = 4.0  # sum of pids limits <= this x the pids budget
    high_water: float = 0.9  # no new sandbox while all of them use more than this share of a budget


@dataclass
class SandboxRecord:
    sandbox_id: str
    template_id: str
    alias: str | None
    metadata: dict[str, str]
    envs: dict[str, str]
    limits: Limits
    started_at: datetime
    end_at: datetime
    running: RunningSandbox
    channel: AgentChannel
    client_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    access_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    public_traffic: bool = True  # its served-out ports need no traffic token (E2B's allowPublicTraffic)
    network: NetworkPolicy = field(default_factory=NetworkPolicy)  # its way out, as last set
    internet_at_create: bool = False  # update_network's default for allow_internet_access
    secret_hosts: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # names and hosts, no values
    rules_info: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # network.rules, values redacted

    metrics: MetricsHistory = field(init=False)  # on the record: it goes when the sandbox goes

    def __post_init__(self) -> None:
        self.metrics = MetricsHistory(self.started_at.timestamp())

    def alive(self) -> bool:
        return not self.channel.closed.is_set()

    async def sample(self, backend: Backend, gap: float) -> None:
        """Add a metrics sample if the last is at least `gap` seconds old (raises as backend.stats)."""
        now = time.time()
        if sample_due(self.metrics, now, gap):
            self.metrics.add(now, await backend.stats(self.running), self.limits.cpu_count)


def _now() -> datetime:
    return datetime.now(UTC)


class SandboxManager:
    def __init__(self, backend: Backend, max_sandboxes: int = 1000, admission: Admission | None = None) -> None:
        self.backend = backend
        self.max_sandboxes = max_sandboxes
        self.admission = admission or Admission()
        self._sandboxes: dict[str, SandboxRecord] = {}
        self._pending: list[Limits] = []  # creations in flight count as if they ran
        self._tasks: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()

    # lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())
        self._sampler = asyncio.get_running_loop().create_task(self._sample_loop())

    async def close(self) -> None:
        for task in (self._reaper, self._sampler):
            if task:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        await asyncio.gather(*(self.kill(sid) for sid in list(self._sandboxes)), return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()

    # queries ---------------------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        rec = self._sandboxes.get(sandbox_id)
        if rec is None or not rec.alive() or rec.end_at <= _now():
            return None
        return rec

    def list(self) -> list[SandboxRecord]:
        return [r for r in self._sandboxes.values() if r.alive() and r.end_at > _now()]

    # mutations -------------------------------------------------------------------------------------

    async def create(
        self,
        *,
        template_id: str,
        alias: str | None,
        timeout: int,
        metadata: dict[str, str],
        envs: dict[str, str],
        limits: Limits,
        network: NetworkPolicy | None = None,
        secrets: SecretSet | None = None,
    ) -> SandboxRecord:
        if len(self._sandboxes) + len(self._pending) >= self.max_sandboxes:
            raise CapacityError(f"the server already runs its maximum of {self.max_sandboxes} sandboxes")
        await self._admit(limits)
        self._pending.append(limits)
        try:
            # The backend picks the id: it is a standby's, prepared before this request.
            spec = SandboxSpec(sandbox_id="", template="base", limits=limits, envs=dict(envs),
                               network=network or NetworkPolicy(), secrets=secrets or SecretSet())
            running = await self.backend.create(spec)
            sandbox_id = running.sandbox_id
            try:
                running.sock.setblocking(False)
                channel = await AgentChannel.open(running.sock)
            except BaseException:
                with contextlib.suppress(Exception):
                    await self.backend.kill(running)
                raise
        finally:
            self._pending.remove(limits)
        now = _now()
        rec = SandboxRecord(
            sandbox_id=sandbox_id,
            template_id=template_id,
            alias=alias,
            metadata=dict(metadata),
            envs=dict(envs),
            limits=limits,
            started_at=now,
            end_at=now + timedelta(seconds=timeout),
            running=running,
            channel=channel,
            network=spec.network,
            secret_hosts=spec.secrets.public(),
        )
        self._sandboxes[sandbox_id] = rec
        self._spawn(self._watch_channel(rec))
        self._wake.set()
        return rec

    async def _admit(self, limits: Limits) -> None:
        """Raise CapacityError if a sandbox with `limits` would promise or take too much."""
        cap = await self.backend.capacity()
        if cap is None:
            return
        adm = self.admission
        held = [r.limits for r in self._sandboxes.values()] + self._pending
        memory = (sum(x.memory_mb for x in held) + limits.memory_mb) << 20
        pids = sum(x.pids for x in held) + limits.pids
        mib = 1 << 20
        if memory > cap.memory_bytes * adm.memory_overcommit:
            raise CapacityError(
                f"the sandboxes on this server already hold {(memory >> 20) - limits.memory_mb} MiB of memory "
                f"limits, the most it promises is {int(cap.memory_bytes * adm.memory_overcommit) // mib} MiB: "
                "ask for less memoryMB, or retry once sandboxes are killed")
        if pids > cap.pids * adm.pids_overcommit:
            raise CapacityError(
                f"the sandboxes on this server already hold {pids - limits.pids} pids of limits, the most it "
                f"promises is {int(cap.pids * adm.pids_overcommit)}: ask for fewer pids, or retry later")
        if cap.memory_used > cap.memory_bytes * adm.high_water:
            raise CapacityError(
                f"this server's sandboxes use {cap.memory_used // mib} MiB of the {cap.memory_bytes // mib} MiB "
                "they may share: no new sandbox until some are killed or use less")
        if cap.pids_used > cap.pids * adm.high_water:
            raise CapacityError(f"this server's sandboxes run {cap.pids_used} of the {cap.pids} tasks they may "
                                "share: no new sandbox until some are killed")

    async def kill(self, sandbox_id: str) -> bool:
        """Kill a sandbox; False if there is no such live sandbox."""
        rec = self._sandboxes.pop(sandbox_id, None)
        if rec is None:
            return False
        was_alive = rec.alive() and rec.end_at > _now()
        await self._destroy(rec, "the sandbox was killed")
        return was_alive

    def set_timeout(self, rec: SandboxRecord, timeout: int) -> None:
        rec.end_at = _now() + timedelta(seconds=timeout)
        self._wake.set()

    def extend_timeout(self, rec: SandboxRecord, timeout: int) -> None:
        """connect: extend endAt, never shorten it."""
        new_end = _now() + timedelta(seconds=timeout)
        if new_end > rec.end_at:
            rec.end_at = new_end
            self._wake.set()

    # internals ---------------------------------------------------------------------------------------

    def _spawn(self, coro) -> None:  # type: ignore[no-untyped-def]
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _destroy(self, rec: SandboxRecord, reason: str) -> None:
        try:
            await rec.channel.close(reason)
        except Exception:
            log.exception("closing the channel of %s failed", rec.sandbox_id)
        try:
            await self.backend.kill(rec.running)
        except Exception:
            log.exception("killing sandbox %s failed", rec.sandbox_id)

    async def _watch_channel(self, rec: SandboxRecord) -> None:
        await rec.channel.closed.wait()
        if self._sandboxes.get(rec.sandbox_id) is rec:
            log.warning("sandbox %s: agent channel closed (%s); removing it", rec.sandbox_id, rec.channel.close_reason)
            del self._sandboxes[rec.sandbox_id]
            await self._destroy(rec, rec.channel.close_reason)

    async def _sample_loop(self) -> None:
        """Every sandbox's metrics every SAMPLE_INTERVAL_S (a few cgroup file reads each), yielding
        to requests between sandboxes."""
        while True:
            await asyncio.sleep(SAMPLE_INTERVAL_S)
            for rec in list(self._sandboxes.values()):
                if rec.alive():
                    try:
                        await rec.sample(self.backend, SAMPLE_INTERVAL_S / 2)
                    except Exception as e:  # a sandbox going away meanwhile
                        log.debug("sandbox %s: no metrics sample: %s", rec.sandbox_id, e)
                await asyncio.sleep(0)

    async def _reap_loop(self) -> None:
        while True:
            try:
                now = _now()
                expired = [r for r in self._sandboxes.values() if r.end_at <= now]
                for rec in expired:
                    if self._sandboxes.get(rec.sandbox_id) is rec:
                        del self._sandboxes[rec.sandbox_id]
                        log.info("sandbox %s timed out", rec.sandbox_id)
                        self._spawn(self._destroy(rec, "the sandbox timed out"))
                upcoming = [r.end_at for r in self._sandboxes.values()]
                delay = min(((min(upcoming) - now).total_seconds(), 1.0)) if upcoming else 1.0
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), max(delay, 0.05))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reaper iteration failed")
                await asyncio.sleep(1)
