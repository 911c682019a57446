"""The sandbox registry: creates, finds, pauses, resumes, times out and kills sandboxes.

One record per sandbox, running or paused. A running sandbox leaves the registry when it is killed,
when its `endAt` passes (the reaper; or it is paused then, if its lifecycle says so), or when its agent
channel closes (the agent died); in every case the backend kills it. A paused sandbox is either
frozen ("full": its processes stopped where they were, memory resident) or only its files are kept
("filesystem": a disk archive in the state dir, nothing running); it is kept `paused_ttl` seconds,
then removed. Killing one sandbox never touches another: each kill is its own task and errors are
contained.

Where a sandbox is in that life is its record's one state (server/sandbox_state.py: running, pausing,
paused, persisting, resuming, killing, gone), moved only through that module's transitions. Time moves
it too, at the moment of the first look (`_advance`, from a lookup or the reaper): a running sandbox
past its end is "pausing" (on_timeout "pause") or killed from then on, never in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import shutil
import time
import uuid
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentcell import durable
from agentcell.backends.base import Backend, ImageRoot, Limits, RunningSandbox, SandboxSpec, VolumeMount
from agentcell.errors import SandboxGoneError
from agentcell.network.policy import NetworkPolicy
from agentcell.network.secrets import SecretSet
from agentcell.policy import model as policy_model
from agentcell.policy.approvals import Approvals
from agentcell.policy.model import Policy
from agentcell.record.events import event
from agentcell.record.store import EventStore
from agentcell.runtime.protocol import AgentChannel
from agentcell.server import clock, policies
from agentcell.server.metrics import SAMPLE_INTERVAL_S, MetricsHistory, sample_due
from agentcell.server.sandbox_state import SandboxLife, SandboxState

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from agentcell.server.observer import Observer

DAMAGED = "damaged"  # under paused/: kept records and archives the server cannot use, for the operator
_KEPT_REMEDY = ("that sandbox cannot be resumed; its record and disk archive (if any) are kept in paused/damaged/ "
                "for you: the archive is a tar of its files (`tar -tf` lists them); delete both once you no longer "
                "need them")
RECORD_GRACE_S = 1.0  # a killed sandbox's record takes events this long after the kill

log = logging.getLogger("agentcell.server")

class CapacityError(Exception):
    """The server cannot take another sandbox now (count, committed limits, or use)."""


class _OtherBackendError(ValueError):
    """A kept record of a sandbox whose backend this server does not run."""


class AlreadyPausedError(Exception):
    """pause() of a sandbox that is paused (E2B answers 409)."""


@dataclass(frozen=True)
class Lifecycle:
    """E2B's lifecycle: what a timeout does, and whether traffic resumes a paused sandbox."""

    on_timeout: str = "kill"  # "kill" | "pause"
    auto_resume: bool = False  # a data-plane request to the paused sandbox resumes it
    pause_memory: bool = True  # an auto-pause keeps memory ("full") or only the files ("filesystem")


@dataclass(frozen=True)
class Retention:
    """How many paused sandboxes the server keeps, and for how long (the operator's choice)."""

    paused_ttl: float = 86400.0  # seconds a paused sandbox is kept, then removed
    max_paused: int = 100  # more explicit pauses are refused (429); a timeout's pause kills instead
    # a sandbox paused with its memory this long is written to disk and its memory freed (backends
    # with memory snapshots: hibernation); None: never
    hibernate_after: float | None = 600.0
    shutdown_budget: float = 10.0  # seconds a stopping server spends keeping paused sandboxes on disk


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
    running: RunningSandbox | None  # None: a paused sandbox kept on disk that a previous server run left
    channel: AgentChannel | None
    backend: Backend  # the one that runs it (a server may have several: per template, per create)
    client_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])
    access_token: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    public_traffic: bool = True  # its served-out ports need no traffic token (E2B's allowPublicTraffic)
    mask_request_host: str | None = None  # the Host its served ports present to it (E2B's maskRequestHost)
    fork_mode: str | None = None  # a fork's: "memory" (processes carried) | "filesystem" (files only)
    network: NetworkPolicy = field(default_factory=NetworkPolicy)  # its way out, as last set
    internet_at_create: bool = False  # update_network's default for allow_internet_access
    secret_hosts: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # names and hosts, no values
    rules_info: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # network.rules, values redacted
    # what it was started with (envs, secrets, network and rules as last set): a cold resume starts it
    # again from it. Held in memory only: secrets never reach the disk.
    spec: SandboxSpec = field(default_factory=SandboxSpec)
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    timeout_s: int = 300  # its last timeout: what an auto-resume gives it
    pause_mode: str | None = None  # "full" (frozen) | "filesystem" (its files in `files`, nothing running)
    paused_at: datetime | None = None
    files: Path | None = None  # the disk archive of a sandbox paused with mode "filesystem"
    image: Path | None = None  # the checkpoint of a hibernated sandbox (paused "full", its memory on disk)
    # the files of a sandbox paused with its memory, kept in case this server dies: a restarted server
    # resumes the sandbox from them (backends with files_while_frozen; gone at its resume or kill)
    crash_copy: Path | None = None
    owner: str | None = None  # the tenant that created it (server/tenancy.py); None: the server has no tenancy

    metrics: MetricsHistory = field(init=False)  # on the record: it goes when the sandbox goes
    lock: asyncio.Lock = field(init=False)  # one pause, resume, write to disk or snapshot at a time
    life: SandboxLife = field(init=False)  # its lifecycle state: server/sandbox_state.py

    def __post_init__(self) -> None:
        self.metrics = MetricsHistory(self.started_at.timestamp())
        self.lock = asyncio.Lock()
        self.life = SandboxLife(self.sandbox_id)

    @property
    def state(self) -> SandboxState:
        return self.life.state

    def alive(self) -> bool:
        """Its agent channel is open (a frozen sandbox's stays open; one kept on disk has none)."""
        return self.channel is not None and not self.channel.closed.is_set()

    @property
    def on_disk(self) -> bool:
        """Paused with nothing running: its files (mode "filesystem") or its checkpoint (hibernated)."""
        return self.files is not None or self.image is not None

    def holds_memory(self) -> bool:
        """Running, or paused with its memory resident: its limits count against the server's budget."""
        return not self.on_disk

    async def sample(self, backend: Backend, gap: float) -> None:
        """Add a metrics sample if the last is at least `gap` seconds old (raises as backend.stats)."""
        now = time.time()
        if sample_due(self.metrics, now, gap):
            self.metrics.add(now, await backend.stats(self.running), self.limits.cpu_count)


def _secret_pairs(secrets: SecretSet) -> list[tuple[str, str]]:
    """(value, placeholder) of a sandbox's secrets and header rules: what its record must not hold."""
    return [(v.decode(), p.decode()) for v, p in secrets.values()] + [
        (value, f"[{name} header for {rule.host}]") for rule in secrets.rules for name, value in rule.headers] + (
        [(secrets.tunnel.password, "[egress proxy password]")] if secrets.tunnel and len(secrets.tunnel.password or "") >= 8 else [])


def _make_durable(path: Path) -> None:
    """An archive or checkpoint just written, and its name in its directory, on disk."""
    durable.fsync_tree(path)
    durable.fsync_dir(path.parent)


def _now() -> datetime:
    return datetime.fromtimestamp(clock.STEADY.now(), UTC)  # deaf to steps of the host's clock (clock.py)


def _image_root(d: dict[str, Any] | None) -> ImageRoot | None:
    if not d:
        return None
    return ImageRoot(**{**d, "layers": tuple(d["layers"]), "env": tuple(tuple(kv) for kv in d["env"])})


class SandboxManager:
    def __init__(self, backend: Backend, max_sandboxes: int = 1000, admission: Admission | None = None,
                 retention: Retention | None = None, state_dir: Path | None = None,
                 others: dict[str, Backend] | None = None, events: EventStore | None = None) -> None:
        self.backend = backend  # the default one
        self.events = events  # every sandbox's behaviour record (issue 10); None: none kept
        self.backends = {backend.name: backend, **(others or {})}
        self.max_sandboxes = max_sandboxes
        self.admission = admission or Admission()
        self.retention = retention or Retention()
        self.state_dir = state_dir or Path("/var/lib/agentcell")
        self.paused_dir = self.state_dir / "paused"  # the disk archives of sandboxes paused with mode "filesystem"
        self._sandboxes: dict[str, SandboxRecord] = {}
        self._pending: list[tuple[Backend, Limits]] = []  # creations in flight count as if they ran
        self._tasks: set[asyncio.Task[None]] = set()
        self._reaper: asyncio.Task[None] | None = None
        self._sampler: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self.observer: Observer | None = None  # lifecycle log lines and metrics (server/observer.py)
        # the requests of sandboxes whose policy asks (issue 28), in their records too
        self.approvals = Approvals(lambda sandbox_id, e: self.events.add(sandbox_id, e) if self.events else None)

    # lifecycle -----------------------------------------------------------------------------------

    async def start(self) -> None:
        # a fork's copy lives only while its sandboxes are made (fork()): any here is a dead server's
        await asyncio.to_thread(shutil.rmtree, self.state_dir / "forks", True)
        self._load_kept()
        if self.events is not None:  # records a previous run left open, but for the sandboxes kept paused
            self.events.close_lost(self._sandboxes)
        self._reaper = asyncio.get_running_loop().create_task(self._reap_loop())
        self._sampler = asyncio.get_running_loop().create_task(self._sample_loop())

    async def close(self) -> None:
        for task in (self._reaper, self._sampler):
            if task:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        await self._keep_paused_on_disk()
        kept = [sid for sid, r in self._sandboxes.items()
                if r.state is SandboxState.PAUSED and r.on_disk and self._persisted(r)]
        for sid in kept:  # a later server run resumes them
            self._sandboxes.pop(sid)
        await asyncio.gather(*(self.kill(sid, "the server stopped") for sid in list(self._sandboxes)),
                             return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()

    # paused sandboxes across server runs -------------------------------------------------------------

    def _record_path(self, sandbox_id: str) -> Path:
        return self.paused_dir / f"{sandbox_id}.json"

    def _persisted(self, rec: SandboxRecord) -> bool:
        return self._record_path(rec.sandbox_id).exists()

    def _persist(self, rec: SandboxRecord) -> None:
        """Write what a later server run needs to resume a sandbox kept on disk: never its secrets,
        so a sandbox with secrets or header rules is not kept across runs."""
        if (data := self._kept_record(rec)) is not None:
            # its archive or checkpoint is on disk already (_export, _write_to_disk): the record points at it
            durable.write_json(self._record_path(rec.sandbox_id), data)

    def _kept_record(self, rec: SandboxRecord) -> dict | None:
        """_persist's record (None for a sandbox with secrets: never kept)."""
        if rec.spec.secrets:
            return None
        return {
            "sandbox_id": rec.sandbox_id, "template_id": rec.template_id, "alias": rec.alias,
            "metadata": rec.metadata, "envs": rec.envs, "limits": asdict(rec.limits),
            "started_at": rec.started_at.isoformat(), "timeout_s": rec.timeout_s, "client_id": rec.client_id,
            "access_token": rec.access_token, "public_traffic": rec.public_traffic,
            "mask_request_host": rec.mask_request_host,
            "network": [rec.network.internet, list(rec.network.allow_out), list(rec.network.deny_out)],
            "internet_at_create": rec.internet_at_create, "lifecycle": asdict(rec.lifecycle),
            # a memory-paused sandbox's crash copy is, for the run that loads it, a pause of its files
            "pause_mode": rec.pause_mode if rec.on_disk else "filesystem",
            "paused_at": rec.paused_at.isoformat() if rec.paused_at else None,
            "files": str(files) if (files := rec.files or rec.crash_copy) else None,
            "image": str(rec.image) if rec.image else None,
            "backend": rec.backend.name, "owner": rec.owner,
            # an image template's root (its layers' paths in the template store), to resume on it
            "image_root": asdict(rec.spec.image_root) if rec.spec.image_root else None,
            "policy": rec.spec.policy.to_json() if not rec.spec.policy.empty else None,
            "volumes": [asdict(m) for m in rec.spec.volumes],  # mounted again at its resume
        }

    def _unpersist(self, rec: SandboxRecord) -> None:
        with contextlib.suppress(OSError):
            self._record_path(rec.sandbox_id).unlink()

    def _load_kept(self) -> None:
        """The paused sandboxes a previous server run kept on disk, paused again here."""
        if not self.paused_dir.is_dir():
            return
        durable.remove_temps(self.paused_dir)  # a crash in the middle of a record's write
        for path in self.paused_dir.glob("*.json"):
            try:
                d = durable.read_json(path, "the record of a paused sandbox", _KEPT_REMEDY)
                backend = self.backends.get(d["backend"])
                if backend is None:  # not damaged: kept in damaged/ all the same, the message says why
                    raise _OtherBackendError(
                        f"{path}: it ran on the {d['backend']} backend, which this server does not run (--backend, "
                        "--create-backends): start one that does and move its record and archive back from "
                        "paused/damaged/ to resume it")
                internet, allow, deny = d["network"]
                root = d.get("image_root")
                spec = SandboxSpec(sandbox_id=d["sandbox_id"], limits=Limits(**d["limits"]), envs=d["envs"],
                                   network=NetworkPolicy.parse(internet, allow, deny),
                                   template=d["template_id"] if root else "base", image_root=_image_root(root),
                                   policy=policy_model.parse(d.get("policy")),
                                   volumes=tuple(VolumeMount(**m) for m in d.get("volumes", [])))
                rec = SandboxRecord(
                    sandbox_id=d["sandbox_id"], template_id=d["template_id"], alias=d["alias"], metadata=d["metadata"],
                    envs=d["envs"], limits=spec.limits, started_at=datetime.fromisoformat(d["started_at"]),
                    end_at=_now(), running=None, channel=None, backend=backend, client_id=d["client_id"],
                    access_token=d["access_token"], public_traffic=d["public_traffic"], network=spec.network,
                    mask_request_host=d.get("mask_request_host"),
                    internet_at_create=d["internet_at_create"], spec=spec, lifecycle=Lifecycle(**d["lifecycle"]),
                    timeout_s=d["timeout_s"], pause_mode=d["pause_mode"],
                    paused_at=datetime.fromisoformat(d["paused_at"]),
                    files=Path(d["files"]) if d["files"] else None, image=Path(d["image"]) if d["image"] else None,
                    owner=d.get("owner"))
                rec.life = SandboxLife(rec.sandbox_id, SandboxState.PAUSED)
                if not rec.on_disk or not (rec.files or rec.image).exists():  # type: ignore[union-attr]
                    raise durable.TornFileError(
                        path, "the record of a paused sandbox", f"what it points at, {rec.files or rec.image}, "
                        "is missing: a crash just after its resume or kill leaves this; that sandbox is gone",
                        "nothing is left to resume: delete the record")
            except (OSError, ValueError, KeyError, TypeError) as e:
                self._set_aside(path, e)
                continue
            self._sandboxes[rec.sandbox_id] = rec
            log.info("sandbox %s: kept paused from a previous run", rec.sandbox_id)
        self._set_aside_orphans()

    def _set_aside(self, record: Path, error: Exception) -> None:
        """A kept record that cannot be loaded, and the archive or checkpoint of its name, moved into
        paused/damaged/ (never deleted: the operator may want the files in the archive)."""
        why = str(error) if isinstance(error, durable.TornFileError | _OtherBackendError) else \
            f"{record}: the record of a paused sandbox cannot be used ({type(error).__name__}: {error}); {_KEPT_REMEDY}"
        moved = []
        for p in (record, *self._archives(record.stem)):
            try:
                moved.append(str(durable.move_aside(p, self.paused_dir / DAMAGED)))
            except OSError as e:
                log.error("%s could not be moved aside (%s): left where it is", p, e)
        log.error("a kept paused sandbox cannot be resumed: %s. Moved to: %s", why, ", ".join(moved) or "nowhere")

    def _archives(self, sandbox_id: str) -> list[Path]:
        found = [self.paused_dir / f"{sandbox_id}.{suffix}" for suffix in ("tar", "crash.tar", "image")]
        return [p for p in found if p.exists()]

    def _set_aside_orphans(self) -> None:
        """Archives and checkpoints without a record (a crash after one was written, before its record
        was): no sandbox can be resumed from them (its token, template and limits are in the record),
        but the files in them are someone's: moved into paused/damaged/, said in the log."""
        kept = {p.name for r in self._sandboxes.values() for p in (r.files, r.image) if p is not None}
        for p in sorted(self.paused_dir.iterdir()):
            if p.name in kept:
                continue
            if p.name.endswith(".crash.tar") and p.name.removesuffix(".crash.tar") in self._sandboxes:
                p.unlink()  # a crash copy its sandbox's newer archive replaced (a crash before it was removed)
                continue
            if p.suffix in (".tar", ".image"):
                try:
                    dest = durable.move_aside(p, self.paused_dir / DAMAGED)
                except OSError as e:
                    log.error("%s has no record and could not be moved aside (%s)", p, e)
                    continue
                log.error("%s has no record (a crash between writing it and its record): no sandbox can be "
                          "resumed from it; moved to %s. Its files are there for you (`tar -tf` lists an "
                          "archive); delete it once you no longer need it", p, dest)
        damaged = self.paused_dir / DAMAGED
        if damaged.is_dir() and (count := len(list(damaged.iterdir()))):
            log.warning("%d damaged or orphaned paused-sandbox files wait in %s for you to look at and delete",
                        count, damaged)

    async def _keep_paused_on_disk(self) -> None:
        """A stopping server writes its frozen sandboxes to disk (a checkpoint where the backend can,
        else their files) so that they can be resumed after it, within the shutdown budget. One whose
        pause or write to disk is under way is waited for first."""
        frozen = [r for r in self._sandboxes.values()
                  if r.state is not SandboxState.RUNNING and not r.on_disk and not r.spec.secrets]
        if not frozen:
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.retention.shutdown_budget):
                for rec in frozen:
                    try:
                        await self._to_disk(rec)
                    except Exception as e:  # noqa: BLE001 - that one is lost, the others go on
                        log.warning("sandbox %s: could not be kept on disk at shutdown: %s", rec.sandbox_id, e)

    async def _to_disk(self, rec: SandboxRecord) -> None:
        """A frozen sandbox's memory (hibernation) or, without memory snapshots, its files to disk;
        nothing of it runs afterwards."""
        async with self._settled(rec):
            if rec.state is not SandboxState.PAUSED or rec.on_disk:
                return
            rec.life.to(SandboxState.PERSISTING)
            await self._persisting(rec)

    async def _hibernate(self, rec: SandboxRecord) -> None:
        """The reaper's hibernation of a sandbox it moved to "persisting"."""
        async with rec.lock:
            if rec.state is not SandboxState.PERSISTING:  # killed meanwhile
                return
            try:
                await self._persisting(rec)
            except Exception as e:  # noqa: BLE001 - it stays paused in memory
                log.warning("sandbox %s: hibernation failed, it stays paused in memory: %s", rec.sandbox_id, e)
        self._wake.set()

    async def _persisting(self, rec: SandboxRecord) -> None:
        """Write a "persisting" sandbox to disk (its lock held); paused afterwards, on disk or, if that
        failed, still in memory. Its agent channel closing meanwhile is the write stopping it (a
        checkpoint does), not it dying: the channel watcher leaves a "persisting" sandbox alone."""
        try:
            await self._write_to_disk(rec)
        finally:
            if not rec.life.ended():
                rec.life.to(SandboxState.PAUSED)
                self._check_channel(rec)  # a failed write may have stopped it

    async def _write_to_disk(self, rec: SandboxRecord) -> None:
        """_persisting's work, under the record's lock."""
        if rec.backend.memory_snapshots:
            image = self.paused_dir / f"{rec.sandbox_id}.image"
            durable.make_dirs(self.paused_dir)
            await rec.backend.resume(rec.running)  # type: ignore[arg-type]
            try:
                await rec.backend.checkpoint(rec.running, str(image), leave_running=False)  # type: ignore[arg-type]
                await asyncio.to_thread(_make_durable, image)  # before its record points at it
            except BaseException:
                shutil.rmtree(image, ignore_errors=True)
                with contextlib.suppress(Exception):
                    await rec.backend.pause(rec.running)  # type: ignore[arg-type]
                raise
            rec.image = image
            log.info("sandbox %s hibernated: its memory is on disk", rec.sandbox_id)
        else:
            rec.files = await self._export(rec)
            rec.pause_mode = "filesystem"
        await self._destroy_running(rec, "the sandbox was written to disk")
        if rec.life.ended():  # killed meanwhile: what was written goes too, no record of it is kept
            await self._discard_disk(rec)
            raise SandboxGoneError(f"sandbox {rec.sandbox_id} was killed while it was written to disk")
        self._persist(rec)  # points at what was just written, not at the crash copy
        self._discard_crash_copy(rec)

    @contextlib.asynccontextmanager
    async def _settled(self, rec: SandboxRecord) -> AsyncIterator[None]:
        """Its lock, once no transition is under way (a pause, a write to disk, a resume): the task
        carrying one out may need the lock first, so the wait is outside it."""
        while True:
            await rec.life.settled()
            await rec.lock.acquire()
            if not rec.state.under_way:
                break
            rec.lock.release()
        try:
            yield
        finally:
            rec.lock.release()

    # queries ---------------------------------------------------------------------------------------

    def get(self, sandbox_id: str) -> SandboxRecord | None:
        """The running sandbox of that id (None for a paused one, or one on its way to or from a pause)."""
        rec = self._current(sandbox_id)
        return rec if rec is not None and rec.state is SandboxState.RUNNING else None

    def find(self, sandbox_id: str) -> SandboxRecord | None:
        """The sandbox of that id, running, paused, or on its way to or from a pause."""
        return self._current(sandbox_id)

    def _current(self, sandbox_id: str) -> SandboxRecord | None:
        """The record, its time-made transitions applied first (a lookup never sees a sandbox that is
        past its end and still "running")."""
        rec = self._sandboxes.get(sandbox_id)
        if rec is None:
            return None
        self._advance(rec, _now())
        return None if rec.life.ended() else rec

    def _all(self) -> list[SandboxRecord]:
        now = _now()
        for rec in list(self._sandboxes.values()):
            self._advance(rec, now)
        return list(self._sandboxes.values())

    def list(self) -> list[SandboxRecord]:
        """The running sandboxes."""
        return [r for r in self._all() if r.state is SandboxState.RUNNING]

    def list_paused(self) -> list[SandboxRecord]:
        """The paused ones, and those on their way to or from a pause (E2B's state "paused")."""
        return [r for r in self._all() if r.state is not SandboxState.RUNNING]

    def counts(self) -> dict[str, int]:
        """Sandboxes by state (for /metrics): starting, running, paused, paused_on_disk."""
        out = {"starting": len(self._pending), "running": 0, "paused": 0, "paused_on_disk": 0}
        for r in self._all():
            out["running" if r.state is SandboxState.RUNNING else "paused_on_disk" if r.on_disk else "paused"] += 1
        return out

    def shown_end(self, rec: SandboxRecord) -> datetime:
        """E2B's endAt: a paused sandbox's is when the server stops keeping it."""
        return self.paused_until(rec) if rec.paused_at is not None else rec.end_at

    def paused_until(self, rec: SandboxRecord) -> datetime:
        """When a paused sandbox is removed (the operator's retention)."""
        assert rec.paused_at is not None
        return rec.paused_at + timedelta(seconds=self.retention.paused_ttl)

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
        lifecycle: Lifecycle | None = None,
        files: Path | None = None,
        image: Path | None = None,
        backend: Backend | None = None,
        caller: str | None = None,
        origin: str | None = None,
        owner: str | None = None,
        root: ImageRoot | None = None,
        pooled: bool = True,
        policy: Policy | None = None,
        volumes: tuple[VolumeMount, ...] = (),
    ) -> SandboxRecord:
        """A new sandbox; with `files`, it starts with that disk archive's files; with `image`, it is
        restored from that checkpoint (memory and files)."""
        # The backend picks the id: it is a standby's, prepared before this request.
        # `root`: a template made from an image (agentcell/templates/): the sandbox's root is its layers
        spec = SandboxSpec(sandbox_id="", template=template_id if root else "base", limits=limits, envs=dict(envs),
                           network=network or NetworkPolicy(), secrets=secrets or SecretSet(),
                           files=str(files) if files else None, image_root=root, pooled=pooled,
                           policy=policy or Policy(), volumes=volumes)
        backend = backend or self.backend
        started = time.monotonic()
        try:
            running, channel = await self._start(backend, spec, image)
        except Exception as e:
            if self.observer is not None:
                self.observer.create_failed(e)
            raise
        now = _now()
        rec = SandboxRecord(
            sandbox_id=running.sandbox_id,
            template_id=template_id,
            alias=alias,
            metadata=dict(metadata),
            envs=dict(envs),
            limits=limits,
            started_at=now,
            end_at=now + timedelta(seconds=timeout),
            running=running,
            channel=channel,
            backend=backend,
            network=spec.network,
            secret_hosts=spec.secrets.public(),
            spec=replace(spec, sandbox_id=running.sandbox_id, files=None),
            lifecycle=lifecycle or Lifecycle(),
            timeout_s=timeout,
            owner=owner,
        )
        self._sandboxes[rec.sandbox_id] = rec
        self.redact_secrets(rec)  # before the tenant has the id: no call of theirs yet
        self._record(rec.sandbox_id, "sandbox.created", begin=True, template=template_id, backend=backend.name,
                     limits=asdict(limits), timeout_s=timeout, key_id=caller, origin=origin, owner=owner,
                     policy=None if spec.policy.empty else spec.policy.to_json())
        if self.observer is not None:
            self.observer.created(rec.sandbox_id, time.monotonic() - started, {
                "template": template_id, "backend": backend.name, "limits": asdict(limits), "timeout_s": timeout,
                "key_id": caller, "origin": origin, "owner": owner})
        self._spawn(self._watch_channel(rec, channel))
        self._wake.set()
        return rec

    def redact_secrets(self, rec: SandboxRecord) -> None:
        """The record stores the sandbox's secrets' values (and header rules' values) as placeholders."""
        if self.events is not None and rec.spec.secrets:
            self.events.begin(rec.sandbox_id)
            self.events.redact(rec.sandbox_id, _secret_pairs(rec.spec.secrets))

    def _record(self, sandbox_id: str, kind: str, *, begin: bool = False, **fields: Any) -> None:
        """An event of the sandbox's life as the server sees it, in its behaviour record (and the log)."""
        if self.observer is not None and kind != "sandbox.created":
            self.observer.life(sandbox_id, kind, fields)
        if self.events is None:
            return
        if begin:
            self.events.begin(sandbox_id)
        self.events.add(sandbox_id, event(kind, source="api", **{k: v for k, v in fields.items() if v is not None}))

    def note(self, sandbox_id: str, kind: str, **fields: Any) -> None:
        """An API event of the sandbox's (a policy set ...) in its behaviour record."""
        self._record(sandbox_id, kind, **fields)

    def _end_record(self, sandbox_id: str) -> None:
        """The record closes a moment after the kill, so that the kernel's last events (the exits of
        the killed processes) still land in it."""
        if self.events is not None:
            asyncio.get_running_loop().call_later(RECORD_GRACE_S, self.events.end, sandbox_id)

    async def _start(self, backend: Backend, spec: SandboxSpec,
                     image: Path | None = None) -> tuple[RunningSandbox, AgentChannel]:
        """Admission, then the backend's create (or restore), then the agent channel."""
        if self._live_count() + len(self._pending) >= self.max_sandboxes:
            raise CapacityError(f"the server already runs its maximum of {self.max_sandboxes} sandboxes")
        limits = spec.limits
        await self._admit(limits, backend)
        pending = (backend, limits)
        self._pending.append(pending)
        try:
            if image is not None:
                running = await backend.restore(str(image), spec)
            else:
                running = await backend.create(spec)
            try:
                running.sock.setblocking(False)
                channel = await AgentChannel.open(running.sock)
                if not spec.policy.empty:  # before the tenant has the sandbox: nothing of theirs ran yet
                    await policies.enforce(backend, running, channel, self.approvals, spec.policy, Policy())
            except BaseException:
                with contextlib.suppress(Exception):
                    await backend.kill(running)
                raise
        finally:
            self._pending.remove(pending)
        return running, channel

    def _live_count(self) -> int:
        """Sandboxes that hold a slot of the backend: running, or paused with memory."""
        return sum(1 for r in self._sandboxes.values() if r.holds_memory())

    async def _admit(self, limits: Limits, backend: Backend) -> None:
        """Raise CapacityError if a sandbox with `limits` would promise or take too much of `backend`'s budget."""
        cap = await backend.capacity()
        if cap is None:
            return
        adm = self.admission
        held = [r.limits for r in self._sandboxes.values() if r.holds_memory() and r.backend is backend]
        held += [lim for b, lim in self._pending if b is backend]
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

    async def kill(self, sandbox_id: str, reason: str = "the sandbox was killed") -> bool:
        """Kill a sandbox, running or paused (or on its way to or from a pause: that task gives up);
        False if there is no such sandbox (one past its end that its timeout kills is none)."""
        rec = self._current(sandbox_id)
        if rec is None:
            return False
        self._take_out(rec)
        await self._destroy(rec, reason)
        return True

    # pause and resume ---------------------------------------------------------------------------------

    async def pause(self, rec: SandboxRecord, memory: bool) -> None:
        """Pause a running sandbox: frozen (memory resident, ms) or, without `memory`, its files kept
        and everything else stopped. Raises AlreadyPausedError, CapacityError (too many paused)."""
        async with self._settled(rec):
            if rec.state is not SandboxState.RUNNING:
                if rec.life.ended():
                    raise SandboxGoneError(f"sandbox {rec.sandbox_id} is gone")
                raise AlreadyPausedError(f"sandbox {rec.sandbox_id} is already paused")
            rec.life.to(SandboxState.PAUSING)
            await self._pausing(rec, memory, by_timeout=False)
        self._wake.set()

    async def _pausing(self, rec: SandboxRecord, memory: bool, *, by_timeout: bool) -> None:
        """Carry out the pause of a "pausing" sandbox (its lock held): paused afterwards, or running
        again if it failed (raised)."""
        try:
            if rec.life.ended() or not rec.alive():
                raise SandboxGoneError(f"sandbox {rec.sandbox_id} is gone")
            paused = sum(1 for r in self._sandboxes.values() if r is not rec and r.state is not SandboxState.RUNNING)
            if paused >= self.retention.max_paused:
                raise CapacityError(f"this server keeps at most {self.retention.max_paused} paused sandboxes: "
                                    "kill or resume some first")
            await rec.backend.pause(rec.running)  # type: ignore[arg-type]
            if not memory:
                try:
                    rec.files = await self._export(rec)
                except BaseException:
                    with contextlib.suppress(Exception):
                        await rec.backend.resume(rec.running)  # type: ignore[arg-type]
                    raise
            if rec.life.ended():  # killed meanwhile
                await self._discard_disk(rec)
                raise SandboxGoneError(f"sandbox {rec.sandbox_id} was killed while it was paused")
        except BaseException:
            if not rec.life.ended():
                rec.life.to(SandboxState.RUNNING)
                self._check_channel(rec)
            raise
        rec.pause_mode, rec.paused_at = "full" if memory else "filesystem", _now()
        rec.life.to(SandboxState.PAUSED)
        if not memory:  # nothing of it runs any more: its files are all that is kept
            await self._destroy_running(rec, "the sandbox was paused")
            self._persist(rec)
        else:
            self._check_channel(rec)  # it died while it was being frozen
            if rec.backend.files_while_frozen and not rec.spec.secrets:
                self._spawn(self._keep_crash_copy(rec))
        self._record(rec.sandbox_id, "sandbox.paused", mode=rec.pause_mode, at_timeout=by_timeout or None)

    async def _keep_crash_copy(self, rec: SandboxRecord) -> None:
        """After a pause with memory: its files and its record on disk too, so that if this server dies
        (kill -9, a crash, a power cut) the next one resumes the sandbox from its files instead of losing
        it. A resume or a kill meanwhile comes first; one later waits for the copy (ms to seconds, by
        the disk's size)."""
        async with self._settled(rec):
            if rec.life.ended() or rec.state is not SandboxState.PAUSED or rec.on_disk or rec.crash_copy:
                return
            try:
                rec.crash_copy = await self._export(rec, "crash.tar")
                if (data := self._kept_record(rec)) is not None:  # its fsyncs off the event loop
                    await asyncio.to_thread(durable.write_json, self._record_path(rec.sandbox_id), data)
            except Exception as e:  # noqa: BLE001 - it stays paused in memory, as before
                log.warning("sandbox %s: no copy of its files for a crash of this server: %s", rec.sandbox_id, e)
                self._discard_crash_copy(rec)

    def _discard_crash_copy(self, rec: SandboxRecord) -> None:
        if rec.crash_copy is not None:
            with contextlib.suppress(OSError):
                rec.crash_copy.unlink()
            rec.crash_copy = None

    async def resume(self, rec: SandboxRecord, timeout: int | None, memory: bool | None = None) -> bool:
        """Resume a paused sandbox (False if it was running: then only its timeout is extended); one
        being paused is resumed once its pause is done. `memory` False (E2B's on_resume="reboot")
        cold-starts it from its files even when its memory was kept. The timeout counts from now;
        None: its last one."""
        async with self._settled(rec):
            if rec.state is SandboxState.RUNNING:
                self.extend_timeout(rec, timeout if timeout is not None else rec.timeout_s)
                return False
            if rec.state is not SandboxState.PAUSED:
                raise SandboxGoneError(f"sandbox {rec.sandbox_id} is gone")
            rec.life.to(SandboxState.RESUMING)
            try:
                if rec.image is not None and memory is not False:
                    await self._restore_hibernated(rec)
                elif rec.pause_mode == "full" and memory is not False:
                    await rec.backend.resume(rec.running)  # type: ignore[arg-type]
                else:
                    await self._cold_start(rec)
                if rec.life.ended():  # killed meanwhile: what was started goes too
                    await self._destroy_running(rec, "the sandbox was killed")
                    raise SandboxGoneError(f"sandbox {rec.sandbox_id} was killed while it was resumed")
            except BaseException:
                if not rec.life.ended():
                    rec.life.to(SandboxState.PAUSED)
                raise
            self._unpersist(rec)
            self._discard_crash_copy(rec)
            rec.pause_mode, rec.paused_at = None, None
            rec.timeout_s = timeout if timeout is not None else rec.timeout_s
            rec.end_at = _now() + timedelta(seconds=rec.timeout_s)
            rec.life.to(SandboxState.RUNNING)
            self._check_channel(rec)
        self._wake.set()
        self._record(rec.sandbox_id, "sandbox.resumed", begin=True, memory=memory is not False)
        return True

    async def _restore_hibernated(self, rec: SandboxRecord) -> None:
        assert rec.image is not None
        running, channel = await self._start(rec.backend, replace(rec.spec, sandbox_id=rec.sandbox_id), rec.image)
        rec.running, rec.channel = running, channel
        self._spawn(self._watch_channel(rec, channel))
        await asyncio.to_thread(shutil.rmtree, rec.image, True)
        rec.image = None

    async def _cold_start(self, rec: SandboxRecord) -> None:
        """Start a paused sandbox again from its files: the same id, token, limits, envs and network."""
        if rec.pause_mode == "full" and rec.image is not None:  # a reboot of a hibernated sandbox
            raise SandboxGoneError(f"sandbox {rec.sandbox_id} is hibernated: its files are inside its checkpoint; "
                                   "resume it with its memory (on_resume=\"restore\")")
        if rec.pause_mode == "full":  # a reboot of a frozen sandbox: its files first, then it goes
            rec.files = await self._export(rec)
            self._discard_crash_copy(rec)
            await self._destroy_running(rec, "the sandbox was rebooted")
            rec.pause_mode = "filesystem"
        assert rec.files is not None
        running, channel = await self._start(rec.backend,
                                             replace(rec.spec, sandbox_id=rec.sandbox_id, files=str(rec.files)))
        rec.running, rec.channel = running, channel
        self._spawn(self._watch_channel(rec, channel))
        with contextlib.suppress(OSError):
            rec.files.unlink()
        rec.files = None

    async def _export(self, rec: SandboxRecord, suffix: str = "tar") -> Path:
        """The disk archive of a frozen sandbox, in the state dir."""
        durable.make_dirs(self.paused_dir)
        path = self.paused_dir / f"{rec.sandbox_id}.{suffix}"
        try:
            await rec.backend.export_files(rec.running, str(path), rec.limits.archive_max_bytes)
            await asyncio.to_thread(_make_durable, path)  # before any record points at it
        except BaseException:
            with contextlib.suppress(OSError):
                path.unlink()
            raise
        return path

    async def snapshot_files(self, rec: SandboxRecord, dest: Path, max_bytes: int) -> None:
        """Its files as a disk archive at `dest`; a running sandbox is paused meanwhile (ms to
        seconds, by its disk's size) so that the archive is consistent."""
        async with self._settled(rec):
            if rec.life.ended():
                raise SandboxGoneError(f"sandbox {rec.sandbox_id} is gone")
            if rec.image is not None:
                raise SandboxGoneError(f"sandbox {rec.sandbox_id} is hibernated: resume it to snapshot its files")
            if rec.pause_mode == "filesystem":
                assert rec.files is not None
                if rec.files.stat().st_size > max_bytes:
                    raise CapacityError("the snapshot would pass this server's snapshot quota")
                shutil.copyfile(rec.files, dest)
                return
            freeze = rec.state is SandboxState.RUNNING  # (a timeout meanwhile pauses it after, lock in hand)
            if freeze:
                await rec.backend.pause(rec.running)  # type: ignore[arg-type]
            try:
                await rec.backend.export_files(rec.running, str(dest), max_bytes)  # type: ignore[arg-type]
            finally:
                if freeze:
                    await rec.backend.resume(rec.running)  # type: ignore[arg-type]

    async def checkpoint(self, rec: SandboxRecord, image_dir: Path, max_bytes: int | None = None) -> int:
        """Its memory, processes and files at `image_dir`; it runs on (a frozen one stays frozen).
        With `max_bytes`, refused before anything is written when the image cannot fit: its memory
        file's pages in use (the cgroup's cache: gVisor's guest memory is a memfd) are all in it."""
        async with self._settled(rec):
            if rec.life.ended():
                raise SandboxGoneError(f"sandbox {rec.sandbox_id} is gone")
            if rec.on_disk:
                raise SandboxGoneError(f"sandbox {rec.sandbox_id} is kept on disk, not running: resume it first")
            if max_bytes is not None:
                least = (await rec.backend.stats(rec.running)).cache_bytes  # type: ignore[arg-type]
                if least > max_bytes:
                    raise CapacityError(f"its memory alone ({least >> 20} MiB) would pass the {max_bytes >> 20} MiB "
                                        "left of this server's snapshot quota")
            frozen = rec.state is SandboxState.PAUSED
            if frozen:
                await rec.backend.resume(rec.running)  # type: ignore[arg-type]
            try:
                return await rec.backend.checkpoint(rec.running, str(image_dir), leave_running=True)  # type: ignore[arg-type]
            finally:
                if frozen:
                    await rec.backend.pause(rec.running)  # type: ignore[arg-type]

    async def fork(self, rec: SandboxRecord, count: int, timeout: int) -> list[SandboxRecord | BaseException]:
        """`count` new sandboxes from one copy of `rec`, each with its own id, hostname and cgroup, its
        template, metadata, envs, limits, network, ingress options and lifecycle. On a backend that saves
        memory (gvisor): restored from one checkpoint (memory, processes, files). Otherwise a
        filesystem fork (`fork_mode`): one consistent copy of its files (its disk), and its processes
        started afresh, as a sandbox resumed from a filesystem pause is."""
        image = self.state_dir / "forks" / uuid.uuid4().hex
        image.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        memory = rec.backend.memory_snapshots
        files = image.with_suffix(".tar")

        async def one() -> SandboxRecord:
            new = await self.create(
                template_id=rec.template_id, alias=rec.alias, timeout=timeout, metadata=rec.metadata,
                envs=rec.spec.envs, limits=rec.limits, network=rec.network, secrets=rec.spec.secrets,
                lifecycle=rec.lifecycle, image=image if memory else None, files=None if memory else files,
                root=None if memory else rec.spec.image_root, policy=None if memory else rec.spec.policy,
                volumes=() if memory else rec.spec.volumes,  # the same volumes, shared (gvisor refuses those)
                backend=rec.backend, origin=f"fork of {rec.sandbox_id}", owner=rec.owner)
            # who may reach its ports, as for the original: set before anything else runs (no await
            # since create put it in the registry)
            new.public_traffic, new.mask_request_host = rec.public_traffic, rec.mask_request_host
            new.rules_info, new.internet_at_create = rec.rules_info, rec.internet_at_create
            new.fork_mode = "memory" if memory else "filesystem"
            return new

        try:
            if memory:
                await self.checkpoint(rec, image)
            else:
                await self.snapshot_files(rec, files, rec.limits.archive_max_bytes)
            results = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
        finally:
            await asyncio.to_thread(shutil.rmtree, image, True)
            with contextlib.suppress(OSError):
                files.unlink()
        for r in results:
            if isinstance(r, BaseException) and not isinstance(r, Exception):
                raise r  # a cancellation
        return list(results)

    async def resume_on_traffic(self, rec: SandboxRecord) -> SandboxRecord | None:
        """E2B's auto_resume: a request to a paused sandbox resumes it (with its last timeout).
        None if it cannot be (not set to, or the resume failed)."""
        if rec.state is SandboxState.RUNNING:
            return rec
        if not rec.lifecycle.auto_resume:
            return None
        try:
            await self.resume(rec, None)
        except Exception as e:  # noqa: BLE001 - the request gets E2B's "not found"
            log.warning("sandbox %s: resume on traffic failed: %s", rec.sandbox_id, e)
            return None
        return self.get(rec.sandbox_id)

    def set_timeout(self, rec: SandboxRecord, timeout: int) -> None:
        """endAt = now + timeout; of a paused sandbox, the timeout it gets when it is resumed.
        0 is E2B's "expire now": a running sandbox reaches its end of life (killed, or pausing
        under on_timeout "pause") before this returns; the last nonzero timeout is what a
        resume gives it, and a paused sandbox stays as it is."""
        now = _now()
        if timeout == 0:
            if rec.state is SandboxState.RUNNING:
                rec.end_at = now
                self._advance(rec, now)
            return
        rec.timeout_s = timeout
        rec.end_at = now + timedelta(seconds=timeout)
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

    def _take_out(self, rec: SandboxRecord) -> None:
        """Out of the registry, "killing": whatever task is under way on it gives up."""
        if self._sandboxes.get(rec.sandbox_id) is rec:
            del self._sandboxes[rec.sandbox_id]
        rec.life.to(SandboxState.KILLING)

    async def _destroy(self, rec: SandboxRecord, reason: str) -> None:
        """Everything of a "killing" sandbox: its processes and its kept files; then it is gone."""
        self._record(rec.sandbox_id, "sandbox.killed", reason=reason)
        self.approvals.forget(rec.sandbox_id)
        await self._destroy_running(rec, reason)
        self._end_record(rec.sandbox_id)
        await self._discard_disk(rec)
        rec.life.to(SandboxState.GONE)

    async def _discard_disk(self, rec: SandboxRecord) -> None:
        """Its files, its checkpoint and its kept record, if any."""
        if rec.files is not None:
            with contextlib.suppress(OSError):
                rec.files.unlink()
            rec.files = None
        if rec.image is not None:
            await asyncio.to_thread(shutil.rmtree, rec.image, True)
            rec.image = None
        self._discard_crash_copy(rec)
        self._unpersist(rec)

    async def _destroy_running(self, rec: SandboxRecord, reason: str) -> None:
        if rec.channel is not None:
            try:
                await rec.channel.close(reason)
            except Exception:
                log.exception("closing the channel of %s failed", rec.sandbox_id)
        if rec.running is not None:
            try:
                await rec.backend.kill(rec.running)
            except Exception:
                log.exception("killing sandbox %s failed", rec.sandbox_id)

    async def _watch_channel(self, rec: SandboxRecord, channel: AgentChannel) -> None:
        if self.events is not None:
            events, sandbox_id = self.events, rec.sandbox_id
            channel.on_report = lambda h: events.add(sandbox_id, event(
                "self.report", source="self", pid=h.get("pid") if isinstance(h.get("pid"), int) else None,
                what=str(h.get("what"))[:200], data=h.get("data") if isinstance(h.get("data"), dict) else None))
        await channel.closed.wait()
        self._check_channel(rec, channel)

    def _check_channel(self, rec: SandboxRecord, channel: AgentChannel | None = None) -> None:
        """A closed agent channel is the sandbox dying when it runs or is frozen in memory. During a
        pause, a write to disk or a resume the task carrying it out closes channels itself (a
        checkpoint stops the sandbox) and calls this when done; a channel replaced by a resume, or
        of a sandbox kept on disk, is not its death either."""
        channel = channel or rec.channel
        if channel is None or not channel.closed.is_set() or rec.channel is not channel \
                or self._sandboxes.get(rec.sandbox_id) is not rec:
            return
        if rec.state is SandboxState.RUNNING or (rec.state is SandboxState.PAUSED and not rec.on_disk):
            log.warning("sandbox %s: agent channel closed (%s); removing it", rec.sandbox_id, channel.close_reason)
            self._remove(rec, channel.close_reason)

    async def _sample_loop(self) -> None:
        """Every sandbox's metrics every SAMPLE_INTERVAL_S (a few cgroup file reads each), yielding
        to requests between sandboxes."""
        while True:
            await asyncio.sleep(SAMPLE_INTERVAL_S)
            for rec in list(self._sandboxes.values()):
                if rec.state is SandboxState.RUNNING and rec.alive():
                    try:
                        await rec.sample(rec.backend, SAMPLE_INTERVAL_S / 2)
                    except Exception as e:  # a sandbox going away meanwhile
                        log.debug("sandbox %s: no metrics sample: %s", rec.sandbox_id, e)
                await asyncio.sleep(0)

    async def _reap_loop(self) -> None:
        while True:
            try:
                now = _now()
                for rec in list(self._sandboxes.values()):
                    self._advance(rec, now)
                upcoming = [d for r in self._sandboxes.values() if (d := self._due(r)) is not None]
                delay = min(((min(upcoming) - now).total_seconds(), 1.0)) if upcoming else 1.0
                self._wake.clear()
                # (not wait_for: on 3.11 it swallows a cancel that comes as the wake is set, and
                # close() would wait for a reaper that never stops)
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(max(delay, 0.05)):
                        await self._wake.wait()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reaper iteration failed")
                await asyncio.sleep(1)

    def _advance(self, rec: SandboxRecord, now: datetime) -> None:
        """The transitions time makes, made by whoever looks first (the reaper or a lookup): a running
        sandbox past its end is "pausing" (on_timeout "pause") or killed from that moment on; a paused
        one past the retention goes; a frozen one due for hibernation is "persisting"."""
        if self._sandboxes.get(rec.sandbox_id) is not rec:
            return
        if rec.state is SandboxState.RUNNING and rec.end_at <= now:
            if rec.lifecycle.on_timeout == "pause":
                rec.life.to(SandboxState.PAUSING)
                self._spawn(self._pause_at_timeout(rec))
            else:
                self._record(rec.sandbox_id, "limit.timeout", timeout_s=rec.timeout_s)
                self._remove(rec, "the sandbox timed out")
        elif rec.state is SandboxState.PAUSED:
            if self.paused_until(rec) <= now:
                self._remove(rec, "the paused sandbox reached the end of its retention")
            elif self._hibernation_due(rec, now):
                rec.life.to(SandboxState.PERSISTING)
                self._spawn(self._hibernate(rec))

    def _due(self, rec: SandboxRecord) -> datetime | None:
        """When time next moves this sandbox on (None: a transition is under way)."""
        if rec.state is SandboxState.RUNNING:
            return rec.end_at
        if rec.state is SandboxState.PAUSED:
            return self.paused_until(rec)
        return None

    def _hibernation_due(self, rec: SandboxRecord, now: datetime) -> bool:
        after = self.retention.hibernate_after
        return (after is not None and not rec.on_disk and rec.backend.memory_snapshots
                and rec.paused_at is not None and rec.paused_at + timedelta(seconds=after) <= now)

    def _remove(self, rec: SandboxRecord, reason: str) -> None:
        if self._sandboxes.get(rec.sandbox_id) is rec:
            self._take_out(rec)
            self._spawn(self._destroy(rec, reason))

    async def _pause_at_timeout(self, rec: SandboxRecord) -> None:
        """E2B's on_timeout "pause" of a sandbox _advance moved to "pausing"; one that cannot be
        paused (too many paused, a failure) is killed, as a timeout would without it."""
        try:
            async with rec.lock:
                await self._pausing(rec, rec.lifecycle.pause_memory, by_timeout=True)
        except Exception as e:  # noqa: BLE001
            if not rec.life.ended():
                log.warning("sandbox %s: pausing at its timeout failed (%s): killing it", rec.sandbox_id, e)
            self._remove(rec, "the sandbox timed out")
        finally:
            self._wake.set()

