"""Text for a terminal from strings a tenant controls (argv, paths, hosts, DNS names, self-reports,
metadata): every character that a terminal or a text viewer acts on instead of showing is written as
an escape, so that no value can move the cursor, rewrite or hide lines, retitle the window, or
reorder what is read (bidi overrides, "Trojan Source").

Escaped: C0 controls (``\\x00``-``\\x1f``, newline and tab included), DEL, C1 controls
(``\\x80``-``\\x9f``, ``\\x9b`` is a one-byte CSI), the bidi embeddings, overrides, isolates and marks
(U+202A-U+202E, U+2066-U+2069, U+200E, U+200F, U+061C) and the line and paragraph separators
(U+2028, U+2029). `escape` also doubles backslashes, so an escape in the output is always one this
module wrote. JSON outputs need none of this: a JSON encoder escapes them already (ensure_ascii).
"""

from __future__ import annotations

import sys
from typing import Any

_SPECIAL = [*range(0x00, 0x20), 0x7F, *range(0x80, 0xA0), *range(0x202A, 0x202F), *range(0x2066, 0x206A),
            0x200E, 0x200F, 0x061C, 0x2028, 0x2029]


def _escaped(code: int) -> str:
    return f"\\x{code:02x}" if code <= 0xFF else f"\\u{code:04x}"


_FIELD = str.maketrans({**{c: _escaped(c) for c in _SPECIAL}, ord("\\"): "\\\\"})
_LINES = str.maketrans({c: _escaped(c) for c in _SPECIAL if c != ord("\n")})


def escape(value: object) -> str:
    """One value (a path, an argv word, a host ...) as text safe for a terminal, on one line."""
    return str(value).translate(_FIELD)


def escape_text(text: str) -> str:
    """Multi-line text for a terminal: every special character escaped but the newlines, backslashes
    left as they are (text built with `escape` comes through unchanged)."""
    return text.translate(_LINES)


# the server's own streams: every special character but the newline as `\\uXXXX`, which is also a JSON
# escape, so JSON lines on them (`serve --audit-log -`) stay JSON that means the same
_STREAM = str.maketrans({c: f"\\u{c:04x}" for c in _SPECIAL if c != ord("\n")})


class SafeStream:
    """A text stream (the server's stdout or stderr) whose writes go out with every special character
    escaped: a log line that quotes what a client or a sandbox sent (an agent's parting words, a path
    the operator gave) cannot act on the operator's terminal."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(text.translate(_STREAM))

    def isatty(self) -> bool:
        return False  # (a logger that colours its output for a terminal would see its own colours escaped)

    def __getattr__(self, name: str) -> Any:  # flush, fileno, isatty, encoding ...
        return getattr(self._stream, name)


def protect_std_streams() -> None:
    """The process's sys.stdout and sys.stderr, as SafeStreams (idempotent); call it before logging
    handlers are made, since they hold on to the stream they were given."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if stream is not None and not isinstance(stream, SafeStream):
            setattr(sys, name, SafeStream(stream))
