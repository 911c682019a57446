"""The code cell: run code in one console context per sandbox, stream its output as NDJSON, keep a
short history.

The first cell on a sandbox (per language) creates a context in its code interpreter (POST
/contexts, cwd /home/user); every later cell runs in it (POST /execute), so state carries from cell
to cell. The interpreter's lines are passed on as the contract's objects as they arrive. The history
(the last HISTORY cells of each of at most MAX_SANDBOXES sandboxes, each cell's outputs capped at
OUTPUT_CAP bytes) lives in the server's memory only.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict, deque
from typing import Any

from agentcell.console.responses import error
from agentcell.console.upstream import INTERPRETER, Upstream, UpstreamError, error_message

HISTORY = 50
OUTPUT_CAP = 256 << 10
MAX_SANDBOXES = 1000
RESULT_KEYS = ("text", "html", "markdown", "svg", "png", "jpeg", "pdf", "latex", "json", "javascript", "data",
               "chart", "extra")


def translate(line: dict[str, Any]) -> dict[str, Any] | None:
    """One interpreter line as the contract's object (None: nothing to show)."""
    kind = line.get("type")
    if kind in ("stdout", "stderr"):
        return {"type": kind, "text": line.get("text", "")}
    if kind == "result":
        out = {"type": "result", "is_main_result": bool(line.get("is_main_result"))}
        out.update({k: line[k] for k in RESULT_KEYS if line.get(k) is not None})
        return out
    if kind == "error":
        return {"type": "error", "name": line.get("name", ""), "value": line.get("value", ""),
                "traceback": line.get("traceback", "")}
    return None


class CodeCells:
    def __init__(self, upstream: Upstream) -> None:
        self.upstream = upstream
        self.contexts: OrderedDict[tuple[str, str], str] = OrderedDict()  # (sandbox, language) -> context id
        self.history: OrderedDict[str, deque[dict[str, Any]]] = OrderedDict()

    def cells(self, sandbox_id: str) -> list[dict[str, Any]]:
        return list(self.history.get(sandbox_id, ()))

    def _remember(self, sandbox_id: str, cell: dict[str, Any]) -> None:
        cells = self.history.get(sandbox_id)
        if cells is None:
            cells = self.history[sandbox_id] = deque(maxlen=HISTORY)
            while len(self.history) > MAX_SANDBOXES:
                self.history.popitem(last=False)
        self.history.move_to_end(sandbox_id)
        cells.append(cell)

    async def _context(self, outer: dict[str, Any], sandbox_id: str, language: str, fresh: bool) -> str:
        key = (sandbox_id, language)
        if not fresh and key in self.contexts:
            return self.contexts[key]
        scope = await self.upstream.sandbox_scope(outer, sandbox_id, INTERPRETER, "POST", "/contexts",
                                                  headers=[(b"content-type", b"application/json")])
        reply = await self.upstream.request(scope, json.dumps({"language": language, "cwd": "/home/user"}).encode())
        reply.raise_for_status()
        context_id = str((reply.json() or {}).get("id"))
        self.contexts[key] = context_id
        while len(self.contexts) > MAX_SANDBOXES * 2:
            self.contexts.popitem(last=False)
        return context_id

    async def run(self, outer: dict[str, Any], receive: Any, send: Any, sandbox_id: str, code: str,
                  language: str) -> None:
        stream = None
        for fresh in (False, True):  # a context gone (the sandbox restarted its interpreter): a new one, once
            context_id = await self._context(outer, sandbox_id, language, fresh)
            scope = await self.upstream.sandbox_scope(outer, sandbox_id, INTERPRETER, "POST", "/execute",
                                                      headers=[(b"content-type", b"application/json")])
            stream = await self.upstream.stream(scope, json.dumps({"code": code, "context_id": context_id}).encode())
            if stream.status != 404 or fresh:
                break
            await stream.close()
        assert stream is not None
        try:
            if stream.status != 200:
                body = await stream.read(64 << 10)
                await error(stream.status if stream.status < 500 else 502,
                            error_message(body, stream.status))(outer, receive, send)
                return
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-store")]})
            outputs: list[dict[str, Any]] = []
            kept = 0
            count: int | None = None
            pending = b""
            async for chunk in stream.chunks():
                pending += chunk
                *lines, pending = pending.split(b"\n")
                out = bytearray()
                for raw in lines:
                    if not raw.strip():
                        continue
                    try:
                        line = json.loads(raw)
                    except ValueError:
                        continue
                    if line.get("type") == "number_of_executions":
                        count = line.get("execution_count")
                        continue
                    obj = translate(line)
                    if obj is None:
                        continue
                    data = json.dumps(obj, separators=(",", ":")).encode()
                    out += data + b"\n"
                    if kept + len(data) <= OUTPUT_CAP:
                        outputs.append(obj)
                        kept += len(data)
                    elif not outputs or outputs[-1].get("type") != "truncated":
                        outputs.append({"type": "truncated", "text": f"outputs past {OUTPUT_CAP} bytes not kept"})
                if out:
                    await send({"type": "http.response.body", "body": bytes(out), "more_body": True})
            end = {"type": "end", "execution_count": count}
            await send({"type": "http.response.body", "body": json.dumps(end).encode() + b"\n", "more_body": False})
            self._remember(sandbox_id, {"code": code, "language": language, "outputs": outputs, "at": time.time()})
        finally:
            await stream.close()


def parse_cell(body: bytes) -> tuple[str, str]:
    try:
        parsed = json.loads(body or b"{}")
    except ValueError:
        raise UpstreamError(400, "the body must be JSON: {\"code\": \"...\", \"language\": \"python\"}") from None
    code = parsed.get("code") if isinstance(parsed, dict) else None
    if not isinstance(code, str):
        raise UpstreamError(400, "'code' must be a string")
    language = parsed.get("language") or "python"
    if not isinstance(language, str):
        raise UpstreamError(400, "'language' must be a string")
    return code, language
