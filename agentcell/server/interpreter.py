"""The code-interpreter API (port 49999): POST /execute (NDJSON stream) and /contexts.

The root router has already checked the sandbox's token and the JSON content type.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from agentcell.errors import InvalidArgumentError, SandboxError, SandboxGoneError
from agentcell.runtime.protocol import Frame
from agentcell.server import api_events, validate
from agentcell.server.bodies import EXECUTE_LIMIT
from agentcell.server.control import json_body
from agentcell.server.errors import HTTPError, from_sandbox_error
from agentcell.server.streams import (
    HTTP_PIECE,
    CutConnection,
    LiveStream,
    agent_call,
    client_gone,
    current_sandbox,
    first_batch,
)

KEEPALIVE_S = 5.0
MAX_RUN_TIMEOUT_S = 24 * 3600
_LANGUAGES = {None: None, "": None, "python": "python", "js": "javascript", "ts": "typescript"}


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


_KEEPALIVE_LINE = _line({"type": "keepalive"})
_END_LINE = _line({"type": "end_of_execution"})


def _opt_str(body: dict[str, Any], key: str) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise HTTPError(400, f"'{key}' must be a string or null")
    return value


async def _call(op: str, **fields: Any) -> dict[str, Any]:
    try:
        return await agent_call(op, **fields)
    except SandboxError as e:
        raise from_sandbox_error(e) from None


def _timeout_ms(body: dict[str, Any]) -> int:
    """agentcell's `timeout` (seconds, 0 or absent = none): a total deadline enforced in the sandbox."""
    value = body.get("timeout")
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= MAX_RUN_TIMEOUT_S:
        raise HTTPError(400, f"'timeout' must be a number of seconds between 0 and {MAX_RUN_TIMEOUT_S}")
    return int(value * 1000)


async def execute(request: Request) -> Response:
    rec = current_sandbox.get()
    body = await json_body(request, limit=EXECUTE_LIMIT)
    code = body.get("code")
    if not isinstance(code, str):
        raise HTTPError(400, "'code' must be a string")
    context_id = _opt_str(body, "context_id")
    language = _opt_str(body, "language")
    if context_id and language:
        raise HTTPError(400, "Only one of context_id or language can be provided")
    language = _LANGUAGES.get(language, language)
    api_events.note(language=language or ("python" if not context_id else None), context_id=context_id,
                    code=api_events.excerpt(code))
    try:
        env_vars = validate.env_map(body.get("env_vars"), "env_vars") or None
    except InvalidArgumentError as e:
        raise HTTPError(400, e.message) from None
    gone = asyncio.ensure_future(client_gone(request.receive))
    batches = rec.channel.batches("code.run", code.encode("utf-8", "surrogatepass"), KEEPALIVE_S, gone,
                                  context_id=context_id or None, language=language, env_vars=env_vars,
                                  timeout_ms=_timeout_ms(body))
    # The first frame decides the status: an unknown context is a 404, not a 200 stream.
    try:
        first = await first_batch(batches, gone, cut_if_gone=True)
    except SandboxGoneError as e:
        return CutConnection(e)
    return LiveStream(_ndjson(first, batches), gone, media_type="application/x-ndjson")


async def _ndjson(first: list[Frame] | None, batches: AsyncIterator[list[Frame]]) -> AsyncIterator[bytes]:
    """The run's lines as NDJSON, then end_of_execution. Lines arrive as JSON text in one or more
    frames and go out as they come (the frames that arrived together in one piece): the server never
    holds a whole result. Leaving early (the client went away) closes `batches`, which cancels the
    agent call and so interrupts the run."""
    line_open = False
    try:
        batch = first
        while batch is not None:
            out = bytearray()
            if not batch and not line_open:  # quiet for a while; never in the middle of a line
                out += _KEEPALIVE_LINE
            for frame in batch:
                if frame.header.get("event") == "line":
                    # json.dumps never writes a raw newline; one from a broken agent must not split lines
                    out += frame.payload.replace(b"\n", b" ")
                    line_open = bool(frame.header.get("more"))
                    if not line_open:
                        out += b"\n"
            ended = bool(batch) and batch[-1].done
            if ended:  # in the same piece as the last lines
                out += _end(line_open)
            for i in range(0, len(out), HTTP_PIECE):
                yield bytes(out[i:i + HTTP_PIECE])
            if ended:
                return
            try:
                batch = await anext(batches)
            except StopAsyncIteration:
                batch = None
    except SandboxGoneError:
        raise  # LiveStream cuts the connection
    except SandboxError as e:
        yield _end(line_open, {"type": "error", "name": type(e).__name__, "value": e.message, "traceback": ""})
        return
    finally:
        await batches.aclose()
    yield _end(line_open)


def _end(line_open: bool, error: dict[str, Any] | None = None) -> bytes:
    """The last lines: an error (if any), then end_of_execution, after a line left open by the agent."""
    return (b"\n" if line_open else b"") + (_line(error) if error else b"") + _END_LINE


async def create_context(request: Request) -> Response:
    body = await json_body(request, required=False)
    language = _opt_str(body, "language")
    cwd = _opt_str(body, "cwd")
    header = await _call("code.context_create", language=_LANGUAGES.get(language, language), cwd=cwd)
    return JSONResponse(header.get("context", {}))


async def list_contexts(request: Request) -> Response:
    header = await _call("code.context_list")
    return JSONResponse(header.get("contexts", []))


async def delete_context(request: Request) -> Response:
    await _call("code.context_delete", context_id=request.path_params["context_id"])
    return Response(status_code=204)


async def restart_context(request: Request) -> Response:
    await _call("code.context_restart", context_id=request.path_params["context_id"])
    return Response(status_code=204)


def routes() -> list[Route]:
    return [
        Route("/execute", execute, methods=["POST"]),
        Route("/contexts", create_context, methods=["POST"]),
        Route("/contexts", list_contexts, methods=["GET"]),
        Route("/contexts/{context_id}", delete_context, methods=["DELETE"]),
        Route("/contexts/{context_id}/restart", restart_context, methods=["POST"]),
        Route("/health", lambda request: Response(status_code=204), methods=["GET"]),
    ]
