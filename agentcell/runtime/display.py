"""The IPython shell of code contexts, and how its output becomes E2B result/error lines.

One InteractiveShell is built in the zygote (``build_shell``); every context process is a fork of the
agent and so starts with its own pristine copy. Instead of a Jupyter kernel's ZMQ messages, a custom
displayhook (the last expression), display publisher (``display()``, figures) and traceback hook hand
mime bundles straight to ``sink``, the current run's emitter.
"""

from __future__ import annotations

import base64
import datetime
import json
import math
import numbers
from collections.abc import Callable
from typing import Any

from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.interactiveshell import InteractiveShell
from traitlets import Type
from traitlets.config import Config

from agentcell.runtime import e2b_formatters

INLINE_BACKEND = "module://matplotlib_inline.backend_inline"

# Jupyter mime type -> E2B result field (e2b-protocol.md §4); the rest goes to "extra".
MIME_FIELDS = {
    "text/plain": "text",
    "text/html": "html",
    "text/markdown": "markdown",
    "image/svg+xml": "svg",
    "image/png": "png",
    "image/jpeg": "jpeg",
    "application/pdf": "pdf",
    "text/latex": "latex",
    "application/json": "json",
    "application/javascript": "javascript",
    "e2b/data": "data",
    "e2b/chart": "chart",
}
_BINARY = {"png", "jpeg", "pdf"}

Sink = Callable[[dict[str, Any]], None]


def _discard(line: dict[str, Any]) -> None:
    pass


sink: Sink = _discard  # set by the context process to the current run's emitter


def _json_default(obj: Any) -> Any:
    """What json cannot encode by itself, as Jupyter's message packer does: NumPy and other numbers
    as numbers, dates as ISO strings, arrays as lists; anything else as its repr."""
    if isinstance(obj, numbers.Integral):
        return int(obj)
    if isinstance(obj, numbers.Real):
        return float(obj)
    if isinstance(obj, datetime.date | datetime.time):
        return obj.isoformat()
    if isinstance(obj, bytes | bytearray):
        return base64.b64encode(obj).decode()
    tolist = getattr(obj, "tolist", None)  # NumPy arrays (a pandas column's values, say)
    if callable(tolist):
        try:
            return tolist()
        except Exception:
            pass
    return repr(obj)


def _finite(obj: Any) -> Any:
    """`obj` with NaN and infinities as null: JSON has no such numbers (JSON.parse of the JS SDK fails)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_finite(v) for v in obj]
    if isinstance(obj, numbers.Real) and not isinstance(obj, numbers.Integral):
        return _finite(float(obj))
    if not isinstance(obj, str | int | bool | type(None)):
        converted = _json_default(obj)
        return converted if isinstance(converted, str) else _finite(converted)
    return obj


def encode_line(line: dict[str, Any]) -> bytes:
    """One E2B line as compact, valid JSON."""
    try:
        return json.dumps(line, separators=(",", ":"), default=_json_default, allow_nan=False).encode()
    except ValueError:  # a NaN or infinity somewhere (a DataFrame's missing values, say)
        return json.dumps(_finite(line), separators=(",", ":"), default=_json_default, allow_nan=False).encode()


def result_line(data: dict[str, Any], is_main_result: bool) -> dict[str, Any]:
    """An E2B ``result`` line from a mime bundle."""
    line: dict[str, Any] = {"type": "result"}
    extra: dict[str, Any] = {}
    for mime, value in data.items():
        key = MIME_FIELDS.get(mime)
        if isinstance(value, bytes | bytearray):
            value = base64.b64encode(value).decode() if key in _BINARY or key is None else value.decode()
        if value is None:
            continue
        if key is None:
            extra[mime] = value
        else:
            line[key] = value
    text = line.get("text")
    if isinstance(text, str) and len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
        line["text"] = text[1:-1]  # as E2B's code interpreter: a string's repr without its quotes
    line["extra"] = extra
    line["is_main_result"] = is_main_result
    return line


class CapturingDisplayHook(DisplayHook):
    """The last expression of a cell -> a main result (instead of printing ``Out[n]:``)."""

    def start_displayhook(self) -> None:
        pass

    def write_output_prompt(self) -> None:
        pass

    def write_format_data(self, format_dict: dict[str, Any], md_dict: Any = None) -> None:
        sink(result_line(format_dict, True))

    def finish_displayhook(self) -> None:
        pass


class CapturingDisplayPublisher(DisplayPublisher):
    """``display()``, ``plt.show()`` and inline figures -> result lines."""

    def publish(self, data: dict[str, Any], metadata: Any = None, source: Any = None, *,  # noqa: D417
                transient: Any = None, update: bool = False, **kwargs: Any) -> None:  # fmt: skip
        sink(result_line(data, False))

    def clear_output(self, wait: bool = False) -> None:
        pass


class ContextShell(InteractiveShell):
    displayhook_class = Type(CapturingDisplayHook)
    display_pub_class = Type(CapturingDisplayPublisher)

    def enable_gui(self, gui: str | None = None) -> None:  # the inline backend needs no event loop
        pass

    def _showtraceback(self, etype: type, evalue: BaseException, stb: list[str]) -> None:
        sink({"type": "error", "name": etype.__name__, "value": str(evalue), "traceback": "\n".join(stb)})


def build_shell() -> ContextShell:
    """The shared shell: no history file, no colours, matplotlib inline. Call once, in the zygote."""
    config = Config()
    config.HistoryManager.enabled = False  # no sqlite file, no saving thread (the zygote forks)
    config.InteractiveShell.colors = "nocolor"
    config.InteractiveShell.xmode = "Context"
    config.InteractiveShell.autocall = 0
    config.PlainTextFormatter.max_seq_length = 0  # as E2B's kernels: long lists' text is not cut at 1000
    shell = ContextShell.instance(config=config)
    shell.enable_matplotlib("inline")
    e2b_formatters.install(shell)
    return shell
