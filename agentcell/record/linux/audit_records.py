"""Kernel audit records as text, parsed: `audit(<time>:<serial>): key=value ...`.

The kernel writes every string a process controls (comm, exe, paths, argv, cwd) either in double
quotes, when it holds no space, quote or control character, or as hex otherwise
(audit_log_untrustedstring), so splitting on spaces cannot be fooled by what a sandbox names its
files or passes as arguments.
"""

from __future__ import annotations

import re

_HEAD = re.compile(r"^audit\((\d+)\.(\d+):(\d+)\): ?")
_FIELD = re.compile(r" ([\w\[\]-]+)=([^ ]*)")
_HEAD_B = re.compile(rb"^audit\((\d+)\.(\d+):(\d+)\)")
# fields the kernel may hex-encode (audit_log_untrustedstring / audit_log_n_hex)
_UNTRUSTED = re.compile(r"^(comm|exe|name|cwd|path|proctitle|a\d+(\[\d+\])?)$")
_HEX = re.compile(r"^[0-9A-F]+$")


class Record:
    """One record: its type, time and serial at once; its fields (`raw`: values as the kernel wrote
    them) parsed on first use, since most records of an exec are only looked at for a field or two."""

    __slots__ = ("type", "time", "serial", "_text", "_raw")

    def __init__(self, rtype: int, time: float, serial: int, text: str = "", raw: dict[str, str] | None = None) -> None:
        self.type, self.time, self.serial = rtype, time, serial
        self._text, self._raw = text, raw

    @property
    def raw(self) -> dict[str, str]:
        if self._raw is None:
            # reversed: the first of duplicate names wins (a later one cannot override it)
            self._raw = dict(reversed(_FIELD.findall(self._text)))
        return self._raw

    def get(self, name: str, default: str | None = None) -> str | None:
        value = self.raw.get(name)
        return default if value is None else decode(name, value)

    def int(self, name: str, base: int = 10) -> int | None:
        try:
            return int(self.raw[name], base)
        except (KeyError, ValueError):
            return None


_UNTRUSTED_NAMES = frozenset(("comm", "exe", "name", "cwd", "path", "proctitle"))


def decode(name: str, value: str) -> str:
    if len(value) >= 2 and value[0] == '"' and value[-1] == '"':
        return value[1:-1]
    untrusted = name in _UNTRUSTED_NAMES or (name[0] == "a" and _UNTRUSTED.match(name) is not None)
    if untrusted and len(value) % 2 == 0 and _HEX.match(value):
        return bytes.fromhex(value).decode(errors="replace")
    return value


def head(text: bytes) -> tuple[float, int] | None:
    """(time, serial) of a record."""
    m = _HEAD_B.match(text)
    return None if m is None else (int(m.group(1)) + int(m.group(2)) / 1000, int(m.group(3)))


def parse(rtype: int, text: bytes) -> Record | None:
    """One record (None if it is not a record's text). Fields are parsed when first read (`raw`),
    values decoded when read (`get`)."""
    s = text.rstrip(b"\0\n").decode(errors="replace")
    m = _HEAD.match(s)
    if m is None:
        return None
    return Record(rtype, int(m.group(1)) + int(m.group(2)) / 1000, int(m.group(3)), " " + s[m.end():])


def argv(records: list[Record]) -> list[str]:
    """The arguments of an exec from its EXECVE record(s); a long argument comes in pieces
    (a3_len=N a3[0]=.. a3[1]=..), possibly over several records."""
    args: dict[int, str] = {}
    pieces: dict[int, dict[int, str]] = {}
    argc = 0
    for rec in records:
        for name, raw in rec.raw.items():
            value = decode(name, raw)
            if name == "argc":
                argc = max(argc, int(value)) if value.isdigit() else argc
            elif name[0] == "a" and name[1:].isdigit():
                args[int(name[1:])] = value
            elif name[0] == "a" and "[" in name:
                idx, _, part = name[1:].partition("[")
                if idx.isdigit() and part[:-1].isdigit():
                    pieces.setdefault(int(idx), {})[int(part[:-1])] = value
    for idx, parts in pieces.items():
        args[idx] = "".join(parts[i] for i in sorted(parts))
    return [args.get(i, "") for i in range(argc or (max(args) + 1 if args else 0))]
