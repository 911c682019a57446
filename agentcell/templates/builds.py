"""Template builds as E2B's build API sees them: templates (an id, names, tags pointing at builds) and
builds (a state machine with a log), persisted under the server's state directory.

    <root>/templates/<template id>.json   {"templateID", "owner", "names", "tags": {tag: {"buildID",
                                          "createdAt"}}, "builds": [ids], "cpuCount", "memoryMB", ...}
    <root>/builds/<build id>.json         {"buildID", "templateID", "status", "reason", "tags" (to assign
                                          when ready), "storeName" (the template store's record) ...}
    <root>/builds/<build id>.log          one JSON log entry per line

A build is `waiting` from its request (POST /v3/templates) until its spec arrives and a build slot is
free, then `building`, then `ready` (its tags now name it; `default` when none were asked for) or
`error` (with a reason naming the step). At most `concurrent` builds run at once; more wait, up to
`queue` of them, and more are refused (429). Each build has a time limit. A build that was running when
the server stopped is `error` at the next start.

Names (E2B's aliases) are per owner: with tenancy on, each tenant has its own namespace, and another
tenant's template is "not found", exactly like one that never existed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypeVar

from agentcell import durable
from agentcell.errors import InvalidArgumentError, NotFoundError, ResourceExhaustedError

log = logging.getLogger("agentcell.templates")

ALIAS = re.compile(r"[a-z0-9][a-z0-9._-]{0,62}")
TAG = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,127}")
DEFAULT_TAG = "default"
LEVELS = ("debug", "info", "warn", "error")
DAMAGED = "damaged"  # under templates/ and builds/: records the server cannot read, for the operator
_DAMAGED_REMEDY = ("what it recorded is unknown to this server; it is kept in {kind}/damaged/ for you to look at "
                   "and delete (build the template again if it is missing)")
R = TypeVar("R")
MAX_LOG_ENTRIES = 100_000  # one build's; later lines are counted, not kept
MAX_LOG_LINE = 8192
_ID_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789"


class BuildsBusyError(ResourceExhaustedError):
    """As many builds as the operator allows are running and waiting: try again later."""


class ConflictError(InvalidArgumentError):
    """The name is taken (a built-in template's)."""


def now_iso(t: float | None = None) -> str:
    return datetime.fromtimestamp(time.time() if t is None else t, UTC).isoformat().replace("+00:00", "Z")


def split_name(name: str) -> tuple[str, str | None]:
    """E2B's "alias[:tag]" (a namespace "team/" before the alias is dropped: one server, one team)."""
    alias, sep, tag = name.partition(":")
    alias = alias.rsplit("/", 1)[-1]
    if not ALIAS.fullmatch(alias):
        raise InvalidArgumentError(f"template name {alias!r}: 1-63 of a-z 0-9 . _ -, starting with a letter or digit")
    if sep and not TAG.fullmatch(tag):
        raise InvalidArgumentError(f"tag {tag!r}: 1-128 of A-Z a-z 0-9 . _ -, not starting with '-'")
    return alias, (tag if sep else None)


def check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not TAG.fullmatch(tag):
        raise InvalidArgumentError(f"tag {tag!r}: 1-128 of A-Z a-z 0-9 . _ -, not starting with '-' (no ':')")
    return tag


@dataclass
class Build:
    build_id: str
    template_id: str
    status: str = "waiting"
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    reason: dict[str, Any] | None = None
    tags: list[str] = field(default_factory=list)  # assigned when ready
    cpu_count: int = 2
    memory_mb: int = 1024
    store_name: str = ""
    cell: str = ""  # the server that runs it (serve --cell-id): only it may call it interrupted
    log: list[dict[str, Any]] = field(default_factory=list, repr=False)
    dropped_lines: int = 0

    def doc(self) -> dict[str, Any]:
        return {"buildID": self.build_id, "templateID": self.template_id, "status": self.status,
                "createdAt": self.created_at, "updatedAt": self.updated_at, "finishedAt": self.finished_at,
                "reason": self.reason, "tags": self.tags, "cpuCount": self.cpu_count, "memoryMB": self.memory_mb,
                "storeName": self.store_name, "cell": self.cell}

    def api_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"buildID": self.build_id, "status": self.status, "createdAt": now_iso(self.created_at),
                               "updatedAt": now_iso(self.updated_at), "cpuCount": self.cpu_count,
                               "memoryMB": self.memory_mb, "diskSizeMB": 0}
        if self.finished_at is not None:
            out["finishedAt"] = now_iso(self.finished_at)
        return out


@dataclass
class TemplateRecord:
    template_id: str
    owner: str | None
    names: list[str]
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)
    tags: dict[str, dict[str, Any]] = field(default_factory=dict)  # tag -> {"buildID", "createdAt"}
    builds: list[str] = field(default_factory=list)
    cpu_count: int = 2
    memory_mb: int = 1024

    def doc(self) -> dict[str, Any]:
        return {"templateID": self.template_id, "owner": self.owner, "names": self.names,
                "createdAt": self.created_at, "updatedAt": self.updated_at, "tags": self.tags,
                "builds": self.builds, "cpuCount": self.cpu_count, "memoryMB": self.memory_mb}


class BuildRegistry:
    """The records, their files, and the build slots."""

    def __init__(self, root: str, *, concurrent: int = 2, queue: int = 16, timeout_s: float = 3600,
                 cell: str = "", shared: bool = False) -> None:
        self.root = root
        self.cell = cell
        self.shared = shared  # other servers write here too (cells sharing a template store): re-read to resolve
        self.concurrent = concurrent
        self.queue = queue
        self.timeout_s = timeout_s
        self.templates: dict[str, TemplateRecord] = {}
        self.builds: dict[str, Build] = {}
        self._slots: asyncio.Semaphore | None = None
        self._pending = 0
        self.running: set[str] = set()  # builds this server runs (never re-read from disk meanwhile)
        self.tasks: set[asyncio.Task[None]] = set()
        for d in ("templates", "builds"):  # their entries synced too: a power cut keeps what is written below
            durable.make_dirs(Path(root, d))
        os.chmod(root, 0o700)
        self._load()

    # persistence -----------------------------------------------------------------------------------

    def _load(self, startup: bool = True) -> None:
        if not startup:  # what is gone on disk is gone here too; the builds this server runs stay its own
            self.templates = {}
            self.builds = {k: b for k, b in self.builds.items() if k in self.running}
        for t in self._records("templates", _template_from, startup):
            self.templates[t.template_id] = t
        for b in self._records("builds", _build_from, startup):
            if not startup and b.build_id in self.running:
                continue
            b.log = self._read_log(b.build_id)
            if startup and b.status in ("waiting", "building") and b.cell == self.cell:
                self.fail(b, "the server restarted before this build finished: build again", None)
            self.builds[b.build_id] = b

    def _records(self, kind: str, parse: Callable[[dict[str, Any]], R], startup: bool) -> Iterator[R]:
        """The records under templates/ or builds/. At the start, one that cannot be read (a disk's fault,
        a hand edit: this module's own writes are atomic) is moved into <kind>/damaged/ and said in the
        log; at a refresh it is only skipped (the next start moves it). A temporary file a crash left is
        removed at the start, unless other servers write here too (it may be one of theirs)."""
        directory = Path(self.root, kind)
        if startup and not self.shared:
            durable.remove_temps(directory)
        what, remedy = f"the record of a {kind[:-1]}", _DAMAGED_REMEDY.format(kind=kind)
        for path in sorted(directory.glob("*.json")):
            try:
                d = durable.read_json(path, what, remedy)
                try:
                    record = parse(d)
                except (KeyError, TypeError, ValueError, AttributeError) as e:
                    raise durable.TornFileError(path, what, f"not the fields of one ({type(e).__name__}: {e})",
                                                remedy) from None
            except (OSError, ValueError) as e:
                if startup:
                    log.error("%s. Moved to: %s", e, durable.set_aside(path, directory / DAMAGED))
                continue
            yield record
        damaged = directory / DAMAGED
        if startup and damaged.is_dir() and (count := len(list(damaged.iterdir()))):
            log.warning("%d damaged %s records wait in %s for you to look at and delete", count, kind[:-1], damaged)

    def refresh(self) -> None:
        """Re-read what other servers sharing this directory wrote (a no-op unless shared)."""
        if self.shared:
            self._load(startup=False)

    def _read_log(self, build_id: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        with contextlib.suppress(OSError):
            with open(os.path.join(self.root, "builds", build_id + ".log")) as f:
                for line in f:
                    with contextlib.suppress(ValueError):
                        out.append(json.loads(line))
        return out

    def save_template(self, t: TemplateRecord) -> None:
        t.updated_at = time.time()
        _write(os.path.join(self.root, "templates", t.template_id + ".json"), t.doc())

    def save_build(self, b: Build) -> None:
        b.updated_at = time.time()
        _write(os.path.join(self.root, "builds", b.build_id + ".json"), b.doc())

    # lookups ---------------------------------------------------------------------------------------

    @staticmethod
    def sees(caller: str | None, owner: str | None) -> bool:
        from agentcell.server.tenancy import Tenancy

        return Tenancy.sees(caller, owner)

    def visible(self, caller: str | None) -> list[TemplateRecord]:
        return [t for t in self.templates.values() if self.sees(caller, t.owner)]

    def find(self, ref: str, caller: str | None) -> TemplateRecord | None:
        """A template by id or name (an "alias:tag" or "team/alias" also names its template)."""
        found = self._find(ref, caller)
        if found is None and self.shared:
            self.refresh()
            found = self._find(ref, caller)
        return found

    def _find(self, ref: str, caller: str | None) -> TemplateRecord | None:
        t = self.templates.get(ref)
        if t is not None and self.sees(caller, t.owner):
            return t
        alias = ref.partition(":")[0].rsplit("/", 1)[-1]
        mine = [t for t in self.templates.values() if alias in t.names and t.owner == caller]
        if mine:
            return mine[0]
        if caller is not None:  # the administrator (uid 0) also finds others' by name
            others = [t for t in self.templates.values() if alias in t.names and self.sees(caller, t.owner)]
            return others[0] if others else None
        return None

    def get(self, ref: str, caller: str | None) -> TemplateRecord:
        t = self.find(ref, caller)
        if t is None:
            raise NotFoundError(f"template '{ref}' not found")
        return t

    def build_of(self, t: TemplateRecord, build_id: str) -> Build:
        b = self.builds.get(build_id)
        if b is None or b.template_id != t.template_id:
            raise NotFoundError(f"build '{build_id}' of template '{t.template_id}' not found")
        return b

    def tagged_build(self, ref: str, caller: str | None) -> tuple[TemplateRecord, Build]:
        """The build `ref` ("alias[:tag]" or "id[:tag]") names: its tag's, else for no tag `default`, else
        the newest ready build."""
        t = self.get(ref, caller)
        _, sep, tag = ref.partition(":")
        if sep:
            hit = t.tags.get(tag)
            if hit is None:
                raise NotFoundError(f"template '{ref}': no tag '{tag}' (it has {', '.join(sorted(t.tags)) or 'none'})")
            return t, self.builds[hit["buildID"]]
        if DEFAULT_TAG in t.tags:
            return t, self.builds[t.tags[DEFAULT_TAG]["buildID"]]
        ready = [self.builds[b] for b in t.builds if b in self.builds and self.builds[b].status == "ready"]
        if not ready:
            raise NotFoundError(f"template '{ref}' has no finished build")
        return t, ready[-1]

    # changes ---------------------------------------------------------------------------------------

    def request(self, name: str, tags: list[str], caller: str | None, cpu_count: int, memory_mb: int,
                reserved: set[str]) -> tuple[TemplateRecord, Build]:
        """A new build of the template `name` ("alias[:tag]"): the caller's template of that alias, or a new
        one. `reserved`: names that are not the caller's to take (the built-in templates)."""
        alias, tag = split_name(name)
        if alias in reserved:
            raise ConflictError(f"'{alias}' is the name of a built-in template: choose another name")
        wanted = [tag] if tag else []
        for extra in tags:
            check_tag(extra)
            if extra not in wanted:
                wanted.append(extra)
        t = next((t for t in self.templates.values() if alias in t.names and t.owner == caller), None)
        if t is None:
            t = TemplateRecord("".join(secrets.choice(_ID_CHARS) for _ in range(20)), caller, [alias])
            self.templates[t.template_id] = t
        t.cpu_count, t.memory_mb = cpu_count, memory_mb
        b = Build(str(uuid.uuid4()), t.template_id, tags=wanted or [DEFAULT_TAG], cpu_count=cpu_count,
                  memory_mb=memory_mb, cell=self.cell)
        self.running.add(b.build_id)
        b.store_name = f"{t.template_id}.{b.build_id}"
        t.builds.append(b.build_id)
        self.builds[b.build_id] = b
        self.save_build(b)
        self.save_template(t)
        return t, b

    def log(self, b: Build, level: str, message: str, step: str | None = None) -> None:
        for line in (message.splitlines() or [""]):
            if len(b.log) >= MAX_LOG_ENTRIES:
                b.dropped_lines += 1
                continue
            entry: dict[str, Any] = {"timestamp": now_iso(), "level": level if level in LEVELS else "info",
                                     "message": line[:MAX_LOG_LINE]}
            if step is not None:
                entry["step"] = step
            b.log.append(entry)
            with contextlib.suppress(OSError):
                with open(os.path.join(self.root, "builds", b.build_id + ".log"), "a") as f:
                    f.write(json.dumps(entry) + "\n")

    def fail(self, b: Build, message: str, step: str | None) -> None:
        self.log(b, "error", message, step)
        b.status = "error"
        b.finished_at = time.time()
        b.reason = {"message": message, **({"step": step} if step is not None else {}),
                    "logEntries": [e for e in b.log if e["level"] == "error"][-20:]}
        self.save_build(b)

    def succeed(self, b: Build) -> None:
        t = self.templates[b.template_id]
        b.status = "ready"
        b.finished_at = time.time()
        self.save_build(b)
        for tag in b.tags:
            t.tags[tag] = {"buildID": b.build_id, "createdAt": time.time()}
        self.save_template(t)

    def assign(self, target: str, tags: list[str], caller: str | None) -> tuple[Build, list[str]]:
        for tag in tags:
            check_tag(tag)
        t, b = self.tagged_build(target, caller)
        if b.status != "ready":
            raise InvalidArgumentError(f"build {b.build_id} is {b.status}: only a finished build can be tagged")
        for tag in tags:
            t.tags[tag] = {"buildID": b.build_id, "createdAt": time.time()}
        self.save_template(t)
        return b, tags

    def untag(self, name: str, tags: list[str], caller: str | None) -> None:
        t = self.get(name, caller)
        missing = [tag for tag in tags if tag not in t.tags]
        if missing:
            raise NotFoundError(f"template '{name}' has no tag {', '.join(map(repr, missing))}")
        for tag in tags:
            del t.tags[tag]
        self.save_template(t)

    def delete(self, t: TemplateRecord) -> list[str]:
        """Forget the template and its builds; the store names of its builds (for the store to drop)."""
        gone = []
        for bid in t.builds:
            b = self.builds.pop(bid, None)
            if b is not None:
                gone.append(b.store_name)
            for suffix in (".json", ".log"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(self.root, "builds", bid + suffix))
        self.templates.pop(t.template_id, None)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(self.root, "templates", t.template_id + ".json"))
        return gone

    # running ---------------------------------------------------------------------------------------

    def start(self, b: Build, work: Callable[[Build], Awaitable[None]]) -> None:
        """Run `work(b)` when a slot is free (`b` stays `waiting` until then), within the time limit."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.concurrent)
        if self._pending >= self.concurrent + self.queue:
            raise BuildsBusyError(f"{self.concurrent} builds are running and {self.queue} waiting on this server: "
                                  "try again later")
        if self._pending < self.concurrent:
            b.status = "building"  # it takes a slot at once: say so before the caller polls
        self.save_build(b)
        self._pending += 1
        task = asyncio.get_running_loop().create_task(self._run(b, work))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, b: Build, work: Callable[[Build], Awaitable[None]]) -> None:
        assert self._slots is not None
        try:
            async with self._slots:
                b.status = "building"
                self.save_build(b)
                try:
                    await asyncio.wait_for(work(b), self.timeout_s)
                except TimeoutError:
                    self.fail(b, f"the build took longer than the {self.timeout_s:.0f} s a build may take on this "
                                 "server (serve --build-timeout)", None)
        finally:
            self._pending -= 1


def _template_from(d: dict[str, Any]) -> TemplateRecord:
    return TemplateRecord(d["templateID"], d.get("owner"), list(d["names"]), d["createdAt"], d["updatedAt"],
                          dict(d["tags"]), list(d["builds"]), d.get("cpuCount", 2), d.get("memoryMB", 1024))


def _build_from(d: dict[str, Any]) -> Build:
    return Build(d["buildID"], d["templateID"], d["status"], d["createdAt"], d["updatedAt"], d.get("finishedAt"),
                 d.get("reason"), list(d.get("tags") or []), d.get("cpuCount", 2), d.get("memoryMB", 1024),
                 d.get("storeName", ""), d.get("cell", ""))


def _write(path: str, doc: dict[str, Any]) -> None:
    """Atomic and durable (agentcell/durable.py): after a crash or a power cut, the old record or the new."""
    durable.write_json(Path(path), doc)
