"""What the embedded server says while it starts, passed on to the program that started it.

The embedded server (sdk/embedded.py) writes its log to a file. While the SDK waits for it, its own
lines ("agentcell: ...": progress of the runtime store's build, the tracer's compile, the zygote's start,
and what it changes on the host) go to Python logging, logger "agentcell", at INFO. A start that takes
longer than NOTICE_S is said once on stderr too, as pip and docker do, with the latest line: a first
`Sandbox.create()` after an install builds the runtime store and is not silent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import sys
import time
from typing import TextIO

log = logging.getLogger("agentcell")

NOTICE_S = 3.0
PREFIX = "agentcell: "


# the server's text log format (agentcell/logs.py TextFormatter): `<time> <LEVEL> agentcell.<part>: <message>`
_TEXT_LINE = re.compile(r"^\S+Z [A-Z]+\s+agentcell(?:\.[\w.]+)?: (.*)$")


def _own_line(line: str) -> str | None:
    """The message of one of the server's own lines (not uvicorn's access log), or None."""
    if line.startswith(PREFIX):
        return line[len(PREFIX):]
    if m := _TEXT_LINE.match(line):
        return m.group(1)
    if line.startswith("{"):  # a structured (JSON) log line
        try:
            rec = json.loads(line)
        except ValueError:
            return None
        if isinstance(rec, dict) and str(rec.get("logger", rec.get("name", ""))).startswith("agentcell"):
            msg = rec.get("message", rec.get("msg"))
            return msg if isinstance(msg, str) else None
    return None


class StartupLog:
    """Follows the server's log file from its start; call poll() while waiting, finish() once ready."""

    def __init__(self, path: str, stream: TextIO | None = None) -> None:
        self.path = path
        self.stream = stream
        self.started = time.monotonic()
        self.noticed = False
        self.last: str | None = None
        self.last_at = self.started  # when the server last said something: it is working, not stuck
        self._offset = 0
        self._partial = b""

    def poll(self, notice: bool = True) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            data = b""
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        for raw in lines:
            msg = _own_line(raw.decode("utf-8", "replace").rstrip("\r"))
            if msg is not None:
                self.last, self.last_at = msg, time.monotonic()
                log.info("%s", msg)
        if notice and not self.noticed and time.monotonic() - self.started >= NOTICE_S:
            self.noticed = True
            now = f" ({self.last})" if self.last else ""
            print(f"agentcell: starting the local sandbox server, {time.monotonic() - self.started:.0f} s so far"
                  f"{now}. A first start after an install builds its runtime store (~10-30 s); later ones take "
                  "~2 s. Progress goes to the Python logger 'agentcell'.", file=self.stream or sys.stderr, flush=True)

    def finish(self) -> float:
        """The server is ready: pass on what is left; the seconds the start took."""
        self.poll(notice=False)
        return time.monotonic() - self.started


DEFAULT_UPLINK = "host"  # the embedded server's: sandboxes reach the internet, as on E2B (README, Quick start)
_NOTICE_FILE = "~/.cache/agentcell/embedded-uplink-notice"


def first_use_notice(uplink: str, stream: TextIO | None = None) -> bool:
    """Say once per user on stderr (a marker file in ~/.cache/agentcell) what the embedded server's defaults
    do to the host; logged at INFO every other time. True if it was printed now."""
    if uplink == "none":
        return False
    text = ("the local sandbox server routes its sandboxes' internet traffic out through this host (NAT, private "
            f"ranges refused: --egress-uplink {uplink}); AGENTCELL_EGRESS_UPLINK=none turns it off. What it changes "
            "on the host, and undoes at stop: docs/host-changes.md")
    marker = os.path.expanduser(_NOTICE_FILE)
    if os.path.exists(marker):
        log.info("%s", text)
        return False
    print(f"agentcell: {text} (said once)", file=stream or sys.stderr, flush=True)
    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(marker), mode=0o700, exist_ok=True)
        with open(marker, "w") as f:
            f.write(f"{uplink}\n")
    return True
