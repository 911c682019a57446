"""The log of `agentcell serve` and `agentcell gateway`: one handler on the root logger, in text or JSON
lines (`--log-format`), for every `agentcell.*` logger (lifecycle, access, policy, progress ...) and
uvicorn's.

A line may carry fields: `log.info("sandbox created", extra=fields(sandbox_id=sid, template="base"))`.
The JSON format writes them as keys of the line's object (time, level, logger, message, sandbox_id,
then the fields); the text format appends them as `key=value`. A line logged while a request for a sandbox
is served (`sandbox_context`), or whose message starts with "sandbox %s" (the registry's older lines),
gets the sandbox's id as `sandbox_id` without saying so.

Both formats go to stderr through text_escape.SafeStream: a value a client or a sandbox chose cannot act
on the operator's terminal. JSON is escaped by construction (ensure_ascii), and SafeStream's escapes are
JSON escapes, so a JSON line stays the same JSON.
"""

from __future__ import annotations

import atexit
import contextvars
import json
import logging
import os
import re
import sys
import threading
from datetime import UTC, datetime
from typing import Any

from agentcell import text_escape

FORMATS = ("text", "json")
FIELDS = "agentcell_fields"  # the LogRecord attribute `fields()` sets
BLOCK = "agentcell_block"  # lines the text format writes under the message (the banner)
TEXT_HIDDEN = "agentcell_text_hidden"  # fields the text format leaves out (its message says them already)


class Serving:
    """The sandbox a request is for, while it is served (server/access_log.py). A task the request
    started keeps a copy of the context: `active` turns False when the request ends, so that the task's
    later lines do not name a sandbox they may not concern. `noted`: fields for the request's access
    line (server/access_log.py note)."""

    __slots__ = ("sandbox_id", "active", "noted")

    def __init__(self, sandbox_id: str | None) -> None:
        self.sandbox_id = sandbox_id
        self.active = True
        self.noted: dict[str, Any] = {}


sandbox_context: contextvars.ContextVar[Serving | None] = contextvars.ContextVar("agentcell_sandbox", default=None)
# a record's own attributes, and uvicorn's colour copy of its message: not fields
_RECORD_KEYS = frozenset(logging.makeLogRecord({}).__dict__) | {"message", "asctime", "color_message", FIELDS, BLOCK,
                                                                 TEXT_HIDDEN}


def fields(sandbox_id: str | None = None, block: list[str] | None = None, text_hidden: tuple[str, ...] = (),
           **values: Any) -> dict[str, Any]:
    """`extra=` for a log call: the line's structured fields (None values are left out); `block`: lines
    the text format writes instead of the fields; `text_hidden`: fields only the JSON format writes."""
    out = {k: v for k, v in values.items() if v is not None}
    if sandbox_id is not None:
        out = {"sandbox_id": sandbox_id, **out}
    extra: dict[str, Any] = {FIELDS: out}
    if block is not None:
        extra[BLOCK] = block
    if text_hidden:
        extra[TEXT_HIDDEN] = text_hidden
    return extra


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """A record's fields, with the sandbox id found where the line did not give it."""
    found: dict[str, Any] = dict(getattr(record, FIELDS, None) or {})
    # extra={...} given without fields(): its keys are fields too
    for key in record.__dict__.keys() - _RECORD_KEYS:
        if not key.startswith("_"):
            found[key] = record.__dict__[key]
    if "sandbox_id" not in found:
        serving = sandbox_context.get()
        sandbox_id = serving.sandbox_id if serving is not None and serving.active else None
        if sandbox_id is None and isinstance(record.msg, str) and record.msg.startswith("sandbox %s") \
                and isinstance(record.args, tuple) and record.args and isinstance(record.args[0], str):
            sandbox_id = record.args[0]
        if sandbox_id is not None:
            found = {"sandbox_id": sandbox_id, **found}
    return found


_PLAIN = re.compile(r'^[^\s"=\\]+$')  # a value written as it is; others in JSON's quotes


def _text_value(value: Any) -> str:
    if isinstance(value, str):
        return value if _PLAIN.match(value) else json.dumps(value, ensure_ascii=False)
    if value is None or isinstance(value, bool):
        return "null" if value is None else "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(value, ensure_ascii=False, default=str, separators=(",", ":"))


class TextFormatter(logging.Formatter):
    """`2026-01-02T03:04:05.678Z INFO    agentcell.lifecycle: sandbox created sandbox_id=... template=base`"""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_time(record.created)} {record.levelname:<7} {record.name}: {record.getMessage()}"
        block = getattr(record, BLOCK, None)
        if block:  # the block says what the fields would
            line += "".join(f"\n  {text_escape.escape(entry)}" for entry in block)
        elif pairs := record_fields(record):
            hidden = getattr(record, TEXT_HIDDEN, ())
            shown = [f"{k}={_text_value(v)}" for k, v in pairs.items() if k not in hidden]
            if shown:
                line += " " + " ".join(shown)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, sandbox_id (when the line concerns one),
    then the line's fields; `exception` with the traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"time": _time(record.created), "level": record.levelname.lower(),
                               "logger": record.name, "message": record.getMessage()}
        for key, value in record_fields(record).items():
            out.setdefault(key, value)  # a field never replaces the line's own keys
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=True, default=str, separators=(",", ":"))


_second: tuple[int, str] = (-1, "")  # the last second formatted (lines come many a second)


def _time(created: float) -> str:
    global _second
    whole = int(created)
    if _second[0] != whole:
        _second = (whole, datetime.fromtimestamp(whole, UTC).strftime("%Y-%m-%dT%H:%M:%S"))
    return f"{_second[1]}.{int((created - whole) * 1000):03d}Z"


def configure(level: str = "info", fmt: str = "text") -> None:
    """The process's log: `agentcell.*` and uvicorn's loggers at `level`, everything else at warning,
    one handler on stderr (a SafeStream) in `fmt`. Idempotent: a second call replaces the handler.

    JSON: what else reaches the process's stderr (a helper process's or a library's plain line, a
    traceback) is made a JSON line too (logger `agentcell.stderr`), so that every line is JSON."""
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: choose from {', '.join(FORMATS)}")
    text_escape.protect_std_streams()
    handler = logging.StreamHandler(_json_stderr() if fmt == "json" else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    handler.set_name("agentcell")
    root = logging.getLogger()
    for old in [h for h in root.handlers if h.get_name() == "agentcell"]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    numeric = logging.getLevelName(level.upper())
    for name in ("agentcell", "uvicorn"):
        logging.getLogger(name).setLevel(numeric)


_captured: Any = None  # the real stderr once fd 2 is a pipe read by _relay (JSON format)
_STDERR_LINE_MAX = 64 << 10


def _json_stderr() -> Any:
    """The process's real stderr, for the JSON handler; fd 2 becomes a pipe whose lines are relayed as
    JSON (those that are not JSON already). Children inherit the pipe as their stderr."""
    global _captured
    if _captured is not None:
        return _captured
    sys.stderr.flush()
    real = os.fdopen(os.dup(2), "w", buffering=1, encoding="utf-8", errors="backslashreplace")
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)
    _captured = real
    relay = threading.Thread(target=_relay, args=(read_end,), name="agentcell-stderr", daemon=True)
    relay.start()

    def restore() -> None:  # at exit: the last lines (a traceback) are not lost in the pipe
        sys.stderr.flush()
        os.dup2(real.fileno(), 2)
        relay.join(0.5)

    atexit.register(restore)
    return real


def _relay(read_end: int) -> None:
    log = logging.getLogger("agentcell.stderr")
    pending = b""
    while True:
        try:
            chunk = os.read(read_end, 65536)
        except OSError:
            return
        if not chunk:
            return
        pending += chunk
        *lines, pending = pending.split(b"\n")
        if len(pending) > _STDERR_LINE_MAX:
            lines.append(pending)
            pending = b""
        for raw in lines:
            text = raw.decode("utf-8", "replace").rstrip("\r")
            if text.strip():  # (a JSON-looking line too: a message, so none can pose as a line of ours)
                log.warning("%s", text)
