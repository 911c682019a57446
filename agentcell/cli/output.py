"""What commands print: JSON for scripts (`--json`), aligned columns and key: value lines for people.

Every value in a text output passes through text_escape.escape (ids, templates, metadata, paths: a
tenant or a client chose them), so none can act on the terminal; JSON is JSON (its encoder escapes
control characters).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from datetime import datetime
from enum import Enum
from typing import Any

import click

from agentcell.cli.errors import META_JSON
from agentcell.text_escape import escape


def _note_json(ctx: click.Context, _param: click.Parameter, value: bool) -> bool:
    if value:  # an error then prints its JSON object on stdout too (errors.py)
        ctx.meta[META_JSON] = True
    return value


json_option = click.option("--json", "as_json", is_flag=True, callback=_note_json,
                           help="Print JSON (for scripts) instead of text; an error also prints "
                                '{"error": {...}} on stdout.')


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def print_json(value: Any) -> None:
    """`value` (dataclasses, datetimes and enums included) as indented JSON."""
    click.echo(json.dumps(_plain(value), indent=2))


def print_json_line(value: Any) -> None:
    click.echo(json.dumps(_plain(value), separators=(",", ":")))


def when(t: datetime | None) -> str:
    return t.isoformat(timespec="seconds") if t else "-"


def metadata_text(metadata: dict[str, str] | None) -> str:
    return ",".join(f"{k}={v}" for k, v in (metadata or {}).items())


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Columns as wide as their widest (escaped) value, the last one left ragged."""
    cells = [[escape(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    for row in [list(headers), *cells]:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row[:-1], widths[:-1], strict=True)) + "  " + row[-1]
                   if len(row) > 1 else row[0])


def fields(pairs: Sequence[tuple[str, Any]]) -> None:
    """`key: value` lines, the keys aligned."""
    width = max(len(k) for k, _ in pairs) + 1
    for key, value in pairs:
        click.echo(f"{key + ':':<{width}} {escape('-' if value is None or value == '' else value)}")
