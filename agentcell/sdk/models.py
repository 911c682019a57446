"""Result types, named and shaped like the e2b / e2b-code-interpreter SDKs' so code moving over keeps working."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import Enum
from typing import Any

# --- commands ---------------------------------------------------------------------------------------


@dataclass
class CommandResult:
    stderr: str
    stdout: str
    exit_code: int
    error: str | None


@dataclass
class PtySize:
    """A terminal's size (e2b's PtySize)."""

    rows: int
    cols: int


@dataclass
class SandboxMetrics:
    """One metrics sample of a sandbox (e2b's SandboxMetrics)."""

    timestamp: datetime
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    disk_used: int
    disk_total: int
    mem_cache: int = 0

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SandboxMetrics:
        return cls(
            timestamp=datetime.fromisoformat(str(d["timestamp"]).replace("Z", "+00:00")),
            cpu_count=int(d["cpuCount"]), cpu_used_pct=float(d["cpuUsedPct"]),
            mem_used=int(d["memUsed"]), mem_total=int(d["memTotal"]), disk_used=int(d["diskUsed"]),
            disk_total=int(d["diskTotal"]), mem_cache=int(d.get("memCache", 0)),
        )


@dataclass
class ProcessInfo:
    pid: int
    tag: str | None
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str | None


# --- filesystem -------------------------------------------------------------------------------------


class FileType(Enum):
    FILE = "file"
    DIR = "dir"
    SYMLINK = "symlink"


_FILE_TYPES = {
    "FILE_TYPE_FILE": FileType.FILE,
    "FILE_TYPE_DIRECTORY": FileType.DIR,
    "FILE_TYPE_SYMLINK": FileType.SYMLINK,
    1: FileType.FILE,
    2: FileType.DIR,
    3: FileType.SYMLINK,
    "file": FileType.FILE,
    "dir": FileType.DIR,
}


@dataclass
class WriteInfo:
    name: str
    type: FileType | None
    path: str
    metadata: dict[str, str] | None = field(default=None, kw_only=True)


@dataclass
class EntryInfo(WriteInfo):
    size: int
    mode: int
    permissions: str
    owner: str
    group: str
    modified_time: datetime
    symlink_target: str | None = None


def parse_time(value: str | None) -> datetime:
    """RFC 3339 with up to nanosecond precision (fromisoformat takes at most microseconds)."""
    if not value:
        return datetime.fromtimestamp(0, UTC)
    v = value.replace("Z", "+00:00")
    dot = v.find(".")
    if dot != -1:
        end = dot + 1
        while end < len(v) and v[end].isdigit():
            end += 1
        v = v[: dot + 1] + v[dot + 1 : end][:6] + v[end:]
    return datetime.fromisoformat(v)


def entry_from_json(e: dict[str, Any]) -> EntryInfo:
    """An EntryInfo from its ProtoJSON form (camelCase, int64 as strings, zero values omitted)."""
    ftype = FileType.SYMLINK if e.get("isSymlink") else _FILE_TYPES.get(e.get("type"))  # type: ignore[arg-type]
    return EntryInfo(
        name=e.get("name", ""),
        type=ftype,
        path=e.get("path", ""),
        size=int(e.get("size", 0)),
        mode=int(e.get("mode", 0)),
        permissions=e.get("permissions", ""),
        owner=e.get("owner", ""),
        group=e.get("group", ""),
        modified_time=parse_time(e.get("modifiedTime")),
        symlink_target=e.get("symlinkTarget") or None,
        metadata=e.get("metadata") or None,
    )


class FilesystemEventType(Enum):
    """What happened to an entry of a watched directory (e2b's FilesystemEventType)."""

    CHMOD = "chmod"
    CREATE = "create"
    REMOVE = "remove"
    RENAME = "rename"
    WRITE = "write"


_EVENT_TYPES = {
    "EVENT_TYPE_CREATE": FilesystemEventType.CREATE, "EVENT_TYPE_WRITE": FilesystemEventType.WRITE,
    "EVENT_TYPE_REMOVE": FilesystemEventType.REMOVE, "EVENT_TYPE_RENAME": FilesystemEventType.RENAME,
    "EVENT_TYPE_CHMOD": FilesystemEventType.CHMOD, 1: FilesystemEventType.CREATE, 2: FilesystemEventType.WRITE,
    3: FilesystemEventType.REMOVE, 4: FilesystemEventType.RENAME, 5: FilesystemEventType.CHMOD,
}


@dataclass
class FilesystemEvent:
    """One event of a watched directory: `name` is relative to it ("sub/file.txt" when recursive);
    `entry` is the entry's info when the watch asked for it (include_entry) and it still existed."""

    name: str
    type: FilesystemEventType
    entry: EntryInfo | None = None


def event_from_json(e: dict[str, Any]) -> FilesystemEvent | None:
    """A FilesystemEvent from its ProtoJSON form; None for a type this SDK does not know."""
    kind = _EVENT_TYPES.get(e.get("type"))  # type: ignore[arg-type]
    if kind is None:
        return None
    entry = e.get("entry")
    return FilesystemEvent(name=e.get("name", ""), type=kind, entry=entry_from_json(entry) if entry else None)


def write_info_from_json(e: dict[str, Any]) -> WriteInfo:
    return WriteInfo(name=e["name"], type=_FILE_TYPES.get(e.get("type")), path=e["path"], metadata=e.get("metadata") or None)  # type: ignore[arg-type]


# --- sandboxes --------------------------------------------------------------------------------------


@dataclass
class SandboxInfo:
    sandbox_id: str
    template_id: str
    name: str | None
    metadata: dict[str, str]
    started_at: datetime
    end_at: datetime
    state: str
    cpu_count: int
    memory_mb: int
    envd_version: str
    sandbox_domain: str | None = None
    disk_size_mb: int | None = None
    limits: dict[str, Any] | None = None  # agentcell extension: the sandbox's enforced limits
    allow_internet_access: bool | None = None
    network: dict[str, Any] | None = None  # allowOut, denyOut, allowPublicTraffic, as the server has them
    lifecycle: dict[str, Any] | None = None  # {"onTimeout": "kill" | "pause", "autoResume": bool}
    pause_mode: str | None = None  # a paused sandbox's: "full" (memory kept) | "filesystem"

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SandboxInfo:
        return cls(
            sandbox_id=d["sandboxID"],
            template_id=d.get("templateID", ""),
            name=d.get("alias"),
            metadata=d.get("metadata") or {},
            started_at=parse_time(d.get("startedAt")),
            end_at=parse_time(d.get("endAt")),
            state=d.get("state", "running"),
            cpu_count=int(d.get("cpuCount", 0)),
            memory_mb=int(d.get("memoryMB", 0)),
            envd_version=d.get("envdVersion", ""),
            sandbox_domain=d.get("domain"),
            disk_size_mb=d.get("diskSizeMB"),
            limits=d.get("limits"),
            allow_internet_access=d.get("allowInternetAccess"),
            network=d.get("network"),
            lifecycle=d.get("lifecycle"),
            pause_mode=d.get("pauseMode"),
        )


@dataclass
class SnapshotInfo:
    """e2b's SnapshotInfo: the id to create sandboxes from, its names; plus agentcell's mode and size."""

    snapshot_id: str
    names: list[str] = field(default_factory=list)
    mode: str | None = None  # "full" | "filesystem"
    sandbox_id: str | None = None
    size_bytes: int | None = None

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SnapshotInfo:
        return cls(snapshot_id=d["snapshotID"], names=list(d.get("names") or []), mode=d.get("mode"),
                   sandbox_id=d.get("sandboxID"), size_bytes=d.get("sizeBytes"))


# --- code interpreter -------------------------------------------------------------------------------


@dataclass
class OutputMessage:
    line: str
    timestamp: int  # unix epoch in nanoseconds
    error: bool = False

    def __str__(self) -> str:
        return self.line


class ExecutionError:
    """An error raised by the executed code: name, value and the joined traceback."""

    def __init__(self, name: str, value: str, traceback: str, **kwargs: Any) -> None:
        self.name = name
        self.value = value
        self.traceback = traceback

    def __repr__(self) -> str:
        return f"ExecutionError(name={self.name!r}, value={self.value!r})"

    def to_json(self) -> str:
        return json.dumps({"name": self.name, "value": self.value, "traceback": self.traceback})


_FORMATS = ("text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "json", "javascript", "data", "chart")


class Result:
    """One displayed value: the cell's value (`is_main_result`) or a display call (e.g. a chart)."""

    text: str | None
    html: str | None
    markdown: str | None
    svg: str | None
    png: str | None
    jpeg: str | None
    pdf: str | None
    latex: str | None
    json: dict | None
    javascript: str | None
    data: dict | None
    chart: dict | None  # the e2b chart dict, as sent (not deserialized into classes)
    is_main_result: bool
    extra: dict | None

    def __init__(self, is_main_result: bool = False, extra: dict | None = None, **kwargs: Any) -> None:
        for name in _FORMATS:
            setattr(self, name, kwargs.get(name))
        self.is_main_result = is_main_result
        self.extra = extra

    def __getitem__(self, item: str) -> Any:
        return getattr(self, item)

    def formats(self) -> list[str]:
        out = [name for name in _FORMATS if getattr(self, name)]
        if self.extra:
            out.extend(self.extra)
        return out

    def __repr__(self) -> str:
        if self.text:
            return f"Result({self.text})"
        return "Result(Formats: " + ", ".join(self.formats()) + ")"

    __str__ = __repr__

    def _repr_html_(self) -> str | None:
        return self.html

    def _repr_png_(self) -> str | None:
        return self.png

    def _repr_svg_(self) -> str | None:
        return self.svg

    def _repr_markdown_(self) -> str | None:
        return self.markdown


@dataclass(repr=False)
class Logs:
    stdout: list[str] = field(default_factory=list)
    stderr: list[str] = field(default_factory=list)

    def __repr__(self) -> str:
        return f"Logs(stdout: {self.stdout}, stderr: {self.stderr})"

    def to_json(self) -> str:
        return json.dumps({"stdout": self.stdout, "stderr": self.stderr})


@dataclass(repr=False)
class Execution:
    results: list[Result] = field(default_factory=list)
    logs: Logs = field(default_factory=Logs)
    error: ExecutionError | None = None
    execution_count: int | None = None

    def __repr__(self) -> str:
        return f"Execution(Results: {self.results}, Logs: {self.logs}, Error: {self.error})"

    @property
    def text(self) -> str | None:
        """The main result's text (the value of the cell's last expression), if any."""
        for r in self.results:
            if r.is_main_result:
                return r.text
        return None

    def to_json(self) -> str:
        results = [{k: r[k] for k in r.formats() if k in _FORMATS} | {"text": r.text} for r in self.results]
        return json.dumps({"results": results, "logs": self.logs.to_json(), "error": self.error.to_json() if self.error else None})


class Context:
    """A code context: its own interpreter state, language and working directory."""

    def __init__(self, context_id: str, language: str, cwd: str, **kwargs: Any) -> None:
        self.id = context_id
        self.language = language
        self.cwd = cwd

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Context:
        return cls(context_id=data["id"], language=data.get("language", "python"), cwd=data.get("cwd", "/home/user"))

    def __repr__(self) -> str:
        return f"Context(id={self.id!r}, language={self.language!r}, cwd={self.cwd!r})"


@dataclass
class SandboxQuery:
    """Filters of Sandbox.list()."""

    metadata: dict[str, str] | None = None
    state: list[str] | None = None  # "running" / "paused"
