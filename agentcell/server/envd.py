"""envd's Connect-RPC services (process.Process, filesystem.Filesystem) backed by agent ops.

The transport is the e2b wheel's generated Connect server classes; this module only maps each method
to the agent protocol (docs/internal-protocol.md). The sandbox comes from `current_sandbox`, set by
the root router after it checked the access token.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

from connectrpc.code import Code
from connectrpc.codec import proto_binary_codec, proto_json_codec
from connectrpc.errors import ConnectError
from connectrpc.request import RequestContext
from e2b.envd.filesystem import filesystem_pb as fs
from e2b.envd.filesystem.filesystem_connect import FilesystemASGIApplication
from e2b.envd.process import process_pb as pb
from e2b.envd.process.process_connect import ProcessASGIApplication
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from agentcell.errors import InvalidArgumentError, SandboxError, SandboxGoneError
from agentcell.runtime.protocol import KEEPALIVE
from agentcell.server import api_events, auth, validate
from agentcell.server.errors import log_incident
from agentcell.server.streams import agent_call, current_sandbox, drop_connection

_CODES = {
    "not_found": Code.NOT_FOUND,
    "invalid_argument": Code.INVALID_ARGUMENT,
    "already_exists": Code.ALREADY_EXISTS,
    "permission_denied": Code.PERMISSION_DENIED,
    "resource_exhausted": Code.RESOURCE_EXHAUSTED,
    "deadline_exceeded": Code.DEADLINE_EXCEEDED,
    "unavailable": Code.UNAVAILABLE,
    "unimplemented": Code.UNIMPLEMENTED,
    "internal": Code.INTERNAL,
}
DEFAULT_KEEPALIVE_S = 30.0
MAX_LIST_DEPTH = 64


def connect_error(e: SandboxError) -> ConnectError:
    return ConnectError(_CODES.get(e.code, Code.INTERNAL), e.message)


def check_user(ctx: RequestContext, root_ok: bool = False) -> str:
    """Run-as user from `Authorization: Basic base64("<user>:")`: `user`, or `root` where `root_ok`
    (the sandbox's root, uid 0 of its own user namespace)."""
    try:
        name = auth.basic_user(ctx.request_headers.get("authorization"))
        if name is None and root_ok:  # no user named: the template's default (an image's last USER)
            name = default_user(current_sandbox.get(None))
        user = auth.run_as(name)
    except auth.MalformedAuthorization as e:
        raise ConnectError(Code.INVALID_ARGUMENT, str(e)) from None
    except ValueError as e:
        raise ConnectError(Code.PERMISSION_DENIED, str(e)) from None
    if user == "root" and not root_ok:
        raise ConnectError(Code.PERMISSION_DENIED, "this call cannot run as root: leave the user out")
    return user


def default_user(rec: Any) -> str | None:
    """The user a call runs as when it names none: "root" when the sandbox's template (an image's last
    USER, E2B's semantics) says so, else None (`user`)."""
    root = getattr(getattr(rec, "spec", None), "image_root", None)
    return "root" if root is not None and root.user == "root" else None


def _keepalive_interval(ctx: RequestContext) -> float:
    raw = ctx.request_headers.get("keepalive-ping-interval")
    try:
        return min(max(float(raw), 1.0), 300.0) if raw else DEFAULT_KEEPALIVE_S
    except ValueError:
        return DEFAULT_KEEPALIVE_S


def _selector(sel: pb.ProcessSelector | None) -> dict[str, Any]:
    if sel is None or sel.selector is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "a process selector (pid or tag) is required")
    if sel.selector.field == "pid":
        return {"pid": int(sel.selector.value)}
    return {"tag": str(sel.selector.value)}


async def _call(op: str, payload: bytes = b"", **fields: Any) -> dict[str, Any]:
    try:
        return await agent_call(op, payload, **fields)
    except SandboxError as e:
        raise connect_error(e) from None


def _event(header: dict[str, Any], payload: bytes) -> pb.ProcessEvent | None:
    kind = header.get("event")
    if kind == "start":
        return pb.ProcessEvent(event=Oneof("start", pb.ProcessEvent.StartEvent(pid=int(header.get("pid", 0)))))
    if kind in ("stdout", "stderr", "pty"):
        return pb.ProcessEvent(event=Oneof("data", pb.ProcessEvent.DataEvent(output=Oneof(kind, payload))))
    if kind == "end":
        end = pb.ProcessEvent.EndEvent(
            exit_code=int(header.get("exit_code", 0)),
            exited=bool(header.get("exited", False)),
            status=str(header.get("status", "")),
        )
        if header.get("error"):
            end.error = str(header["error"])
        return pb.ProcessEvent(event=Oneof("end", end))
    return None  # unknown events are skipped


_KEEPALIVE_EVENT = pb.ProcessEvent(event=Oneof("keepalive", pb.ProcessEvent.KeepAlive()))


async def _process_stream(op: str, ctx: RequestContext, **fields: Any) -> AsyncIterator[pb.ProcessEvent]:
    channel = current_sandbox.get().channel
    try:
        async for item in channel.stream(op, keepalive=_keepalive_interval(ctx), **fields):
            if item is KEEPALIVE:
                yield _KEEPALIVE_EVENT
                continue
            if item.header.get("timed_out"):
                # envd ends a stream past its Connect-Timeout-Ms with deadline_exceeded; SDKs raise
                # TimeoutException on it (not CommandExitException).
                raise ConnectError(Code.DEADLINE_EXCEEDED, str(item.header.get("error", "deadline exceeded")))
            event = _event(item.header, item.payload)
            if event is not None:
                yield event
    except SandboxGoneError:
        drop_connection()  # as envd behind E2B's proxy: the stream is cut, the SDK probes the sandbox
        raise ConnectError(Code.UNAVAILABLE, "the sandbox was killed while the stream was open") from None
    except SandboxError as e:
        raise connect_error(e) from None


class ProcessService:
    async def start(self, request: pb.StartRequest, ctx: RequestContext) -> AsyncIterator[pb.StartResponse]:
        user = check_user(ctx, root_ok=True)
        proc = request.process
        if proc is None or not proc.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is required")
        pty = None
        if request.has_field("pty") and request.pty is not None:
            size = request.pty.size
            pty = {"cols": int(size.cols) if size else 80, "rows": int(size.rows) if size else 24}
        remaining = ctx.timeout_ms
        try:
            envs = validate.env_map(dict(proc.envs), "process.envs")
        except InvalidArgumentError as e:
            raise ConnectError(Code.INVALID_ARGUMENT, e.message) from None
        fields = {
            "cmd": proc.cmd,
            "args": list(proc.args),
            "envs": envs,
            "cwd": proc.cwd if proc.has_field("cwd") and proc.cwd else None,
            "tag": request.tag if request.has_field("tag") and request.tag else None,
            # A missing stdin flag means true (legacy SDKs).
            "stdin": bool(request.stdin) if request.has_field("stdin") else True,
            "pty": pty,
            "timeout_ms": max(int(remaining), 1) if remaining is not None else 0,
            "user": user,
        }
        api_events.note(cmd=" ".join([proc.cmd, *proc.args]), cwd=fields["cwd"], user=user)
        async for event in _process_stream("proc.start", ctx, **fields):
            yield pb.StartResponse(event=event)

    async def connect(self, request: pb.ConnectRequest, ctx: RequestContext) -> AsyncIterator[pb.ConnectResponse]:
        check_user(ctx, root_ok=True)
        sel = _selector(request.process)
        async for event in _process_stream("proc.connect", ctx, **sel):
            yield pb.ConnectResponse(event=event)

    async def list(self, request: pb.ListRequest, ctx: RequestContext) -> pb.ListResponse:
        check_user(ctx, root_ok=True)
        header = await _call("proc.list")
        out = []
        processes = header.get("processes")
        for p in processes if isinstance(processes, list) else []:
            if not isinstance(p, dict):
                continue
            info = pb.ProcessInfo(
                pid=int(p.get("pid", 0)),
                config=pb.ProcessConfig(
                    cmd=str(p.get("cmd", "")),
                    args=[str(a) for a in p.get("args", [])],
                    envs={str(k): str(v) for k, v in (p.get("envs") or {}).items()},
                    cwd=p.get("cwd") or None,
                ),
            )
            if p.get("tag"):
                info.tag = str(p["tag"])
            out.append(info)
        return pb.ListResponse(processes=out)

    async def send_input(self, request: pb.SendInputRequest, ctx: RequestContext) -> pb.SendInputResponse:
        check_user(ctx, root_ok=True)
        sel = _selector(request.process)
        inp = request.input
        if inp is None or inp.input is None:
            return pb.SendInputResponse()
        await _call("proc.input", bytes(inp.input.value), pty=inp.input.field == "pty", **sel)
        return pb.SendInputResponse()

    async def stream_input(self, request: AsyncIterator[pb.StreamInputRequest], ctx: RequestContext) -> pb.StreamInputResponse:
        check_user(ctx, root_ok=True)
        sel: dict[str, Any] | None = None
        async for msg in request:
            ev = msg.event
            if ev is None:
                continue
            if ev.field == "start":
                sel = _selector(ev.value.process)
            elif ev.field == "data":
                if sel is None:
                    raise ConnectError(Code.INVALID_ARGUMENT, "the stream must start with a start event")
                inp = ev.value.input
                if inp is not None and inp.input is not None:
                    await _call("proc.input", bytes(inp.input.value), pty=inp.input.field == "pty", **sel)
        return pb.StreamInputResponse()

    async def send_signal(self, request: pb.SendSignalRequest, ctx: RequestContext) -> pb.SendSignalResponse:
        check_user(ctx, root_ok=True)
        sel = _selector(request.process)
        signal = int(request.signal)
        if signal not in (9, 15):
            raise ConnectError(Code.INVALID_ARGUMENT, "signal must be SIGNAL_SIGKILL or SIGNAL_SIGTERM")
        await _call("proc.signal", signal=signal, **sel)
        return pb.SendSignalResponse()

    async def close_stdin(self, request: pb.CloseStdinRequest, ctx: RequestContext) -> pb.CloseStdinResponse:
        check_user(ctx, root_ok=True)
        await _call("proc.close_stdin", **_selector(request.process))
        return pb.CloseStdinResponse()

    async def update(self, request: pb.UpdateRequest, ctx: RequestContext) -> pb.UpdateResponse:
        check_user(ctx, root_ok=True)
        sel = _selector(request.process)
        if request.pty is not None and request.pty.size is not None:
            size = request.pty.size
            await _call("proc.resize", cols=int(size.cols), rows=int(size.rows), **sel)
        return pb.UpdateResponse()


_FILE_TYPES = {"file": fs.FileType.FILE, "dir": fs.FileType.DIRECTORY, "symlink": fs.FileType.SYMLINK}


def entry_info(e: Any) -> fs.EntryInfo:
    if not isinstance(e, dict):
        raise ConnectError(Code.INTERNAL, "the sandbox agent sent a malformed entry")
    mtime = float(e.get("modified_time") or 0.0)
    seconds = int(mtime)
    info = fs.EntryInfo(
        name=str(e.get("name", "")),
        type=_FILE_TYPES.get(str(e.get("type")), fs.FileType.UNSPECIFIED),
        path=str(e.get("path", "")),
        size=int(e.get("size", 0)),
        mode=int(e.get("mode", 0)),
        permissions=str(e.get("permissions", "")),
        owner=str(e.get("owner", "")),
        group=str(e.get("group", "")),
        modified_time=Timestamp(seconds=seconds, nanos=int((mtime - seconds) * 1e9)),
        metadata={str(k): str(v) for k, v in (e.get("metadata") or {}).items()},
        is_symlink=bool(e.get("is_symlink")) or e.get("type") == "symlink",
    )
    if e.get("symlink_target"):
        info.symlink_target = str(e["symlink_target"])
    return info


def _path(path: str) -> str:
    if not path:
        raise ConnectError(Code.INVALID_ARGUMENT, "path is required")
    return path


class FilesystemService:
    async def stat(self, request: fs.StatRequest, ctx: RequestContext) -> fs.StatResponse:
        user = check_user(ctx, root_ok=True)
        header = await _call("fs.stat", user=user, path=_path(request.path))
        return fs.StatResponse(entry=entry_info(header.get("entry")))

    async def make_dir(self, request: fs.MakeDirRequest, ctx: RequestContext) -> fs.MakeDirResponse:
        user = check_user(ctx, root_ok=True)
        api_events.note(path=request.path, user=user)
        header = await _call("fs.mkdir", user=user, path=_path(request.path))
        return fs.MakeDirResponse(entry=entry_info(header.get("entry")))

    async def move(self, request: fs.MoveRequest, ctx: RequestContext) -> fs.MoveResponse:
        user = check_user(ctx, root_ok=True)
        api_events.note(path=request.source, to=request.destination, user=user)
        header = await _call("fs.move", user=user, source=_path(request.source), destination=_path(request.destination))
        return fs.MoveResponse(entry=entry_info(header.get("entry")))

    async def list_dir(self, request: fs.ListDirRequest, ctx: RequestContext) -> fs.ListDirResponse:
        user = check_user(ctx, root_ok=True)
        depth = int(request.depth) or 1
        if depth > MAX_LIST_DEPTH:
            raise ConnectError(Code.INVALID_ARGUMENT, f"depth must be at most {MAX_LIST_DEPTH}")
        header = await _call("fs.list", user=user, path=_path(request.path), depth=depth)
        entries = header.get("entries")
        return fs.ListDirResponse(entries=[entry_info(e) for e in entries] if isinstance(entries, list) else [])

    async def remove(self, request: fs.RemoveRequest, ctx: RequestContext) -> fs.RemoveResponse:
        user = check_user(ctx, root_ok=True)
        api_events.note(path=request.path, user=user)
        await _call("fs.remove", user=user, path=_path(request.path))
        return fs.RemoveResponse()

    # Directory watchers (runtime/watcher.py): WatchDir streams (async SDK); the sync SDK polls with
    # CreateWatcher / GetWatcherEvents / RemoveWatcher, whose watchers live in the agent until removed
    # or the sandbox ends.
    async def watch_dir(self, request: fs.WatchDirRequest, ctx: RequestContext) -> AsyncIterator[fs.WatchDirResponse]:
        check_user(ctx)
        channel = current_sandbox.get().channel
        stream = channel.stream("fs.watch", keepalive=_keepalive_interval(ctx), path=_path(request.path),
                                recursive=bool(request.recursive), include_entry=bool(request.include_entry))
        # envd ends the stream at the request's deadline (the SDK's watch `timeout`, 60 s by default).
        loop = asyncio.get_running_loop()
        remaining = ctx.timeout_ms
        deadline = loop.time() + remaining / 1000 if remaining else None
        try:
            while True:
                try:
                    item = await asyncio.wait_for(anext(stream), None if deadline is None else deadline - loop.time())
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise ConnectError(Code.DEADLINE_EXCEEDED, "the watch reached its timeout") from None
                if item is KEEPALIVE:
                    yield _WATCH_KEEPALIVE
                elif item.header.get("event") == "start":
                    yield fs.WatchDirResponse(event=Oneof("start", fs.WatchDirResponse.StartEvent()))
                else:
                    for event in watch_events(item.header.get("events")):
                        yield fs.WatchDirResponse(event=Oneof("filesystem", event))
        except SandboxError as e:
            raise connect_error(e) from None
        finally:
            await stream.aclose()  # type: ignore[attr-defined]

    async def create_watcher(self, request: fs.CreateWatcherRequest, ctx: RequestContext) -> fs.CreateWatcherResponse:
        check_user(ctx)
        header = await _call("fs.watcher_create", path=_path(request.path), recursive=bool(request.recursive),
                             include_entry=bool(request.include_entry))
        return fs.CreateWatcherResponse(watcher_id=str(header.get("watcher_id", "")))

    async def get_watcher_events(self, request: fs.GetWatcherEventsRequest, ctx: RequestContext) -> fs.GetWatcherEventsResponse:
        check_user(ctx)
        header = await _call("fs.watcher_events", watcher_id=request.watcher_id)
        return fs.GetWatcherEventsResponse(events=list(watch_events(header.get("events"))))

    async def remove_watcher(self, request: fs.RemoveWatcherRequest, ctx: RequestContext) -> fs.RemoveWatcherResponse:
        check_user(ctx)
        await _call("fs.watcher_remove", watcher_id=request.watcher_id)
        return fs.RemoveWatcherResponse()


_WATCH_KEEPALIVE = fs.WatchDirResponse(event=Oneof("keepalive", fs.WatchDirResponse.KeepAlive()))
_EVENT_TYPES = {1: fs.EventType.CREATE, 2: fs.EventType.WRITE, 3: fs.EventType.REMOVE, 4: fs.EventType.RENAME,
                5: fs.EventType.CHMOD}


def watch_events(raw: Any) -> Iterator[fs.FilesystemEvent]:
    """envd's FilesystemEvents from the agent's event dicts (malformed ones are skipped)."""
    for e in raw if isinstance(raw, list) else []:
        if not isinstance(e, dict) or e.get("type") not in _EVENT_TYPES:
            continue
        event = fs.FilesystemEvent(name=str(e.get("name", "")), type=_EVENT_TYPES[e["type"]])
        if isinstance(e.get("entry"), dict):
            event.entry = entry_info(e["entry"])
        yield event


READ_MAX_BYTES = 16 << 20  # an RPC message is small; file data goes over /files


@contextlib.contextmanager
def _hide_internal_errors(ctx: RequestContext) -> Iterator[None]:
    try:
        yield
    except ConnectError:
        raise
    except Exception as e:
        incident = log_incident(f"{ctx.method.service_name}/{ctx.method.name}", e)
        raise ConnectError(Code.INTERNAL, f"internal error (incident {incident}; the server log has the details)") from None


class HideInternalErrors:
    """connectrpc answers an unexpected exception with `unknown` and the exception's text, which can
    name host internals. This interceptor logs it under an incident id and answers `internal` instead.
    """

    async def intercept_unary(self, call_next: Any, request: Any, ctx: RequestContext) -> Any:
        with _hide_internal_errors(ctx):
            return await call_next(request, ctx)

    async def intercept_client_stream(self, call_next: Any, request: Any, ctx: RequestContext) -> Any:
        with _hide_internal_errors(ctx):
            return await call_next(request, ctx)

    async def intercept_server_stream(self, call_next: Any, request: Any, ctx: RequestContext) -> AsyncIterator[Any]:
        with _hide_internal_errors(ctx):
            async for item in call_next(request, ctx):
                yield item


class _StrictCodec:
    """A codec whose decode failures are `invalid_argument` instead of an unhandled 500."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner

    def name(self) -> str:
        return self._inner.name()

    def encode(self, message: Any) -> bytes:
        return self._inner.encode(message)

    def decode(self, data: bytes | bytearray, message_class: type[Any]) -> Any:
        try:
            return self._inner.decode(data, message_class)
        except ConnectError:
            raise
        except Exception as e:
            raise ConnectError(Code.INVALID_ARGUMENT, f"the request is not a valid {message_class.__name__}: {e}") from None


def _codecs() -> list[Any]:
    return [_StrictCodec(proto_binary_codec()), _StrictCodec(proto_json_codec())]


def process_app() -> ProcessASGIApplication:
    return ProcessASGIApplication(ProcessService(), read_max_bytes=READ_MAX_BYTES, codecs=_codecs(),  # type: ignore[arg-type]
                                  interceptors=[HideInternalErrors()])


def filesystem_app() -> FilesystemASGIApplication:
    return FilesystemASGIApplication(FilesystemService(), read_max_bytes=READ_MAX_BYTES, codecs=_codecs(),  # type: ignore[arg-type]
                                     interceptors=[HideInternalErrors()])
