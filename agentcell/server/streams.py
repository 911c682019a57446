"""Helpers shared by the data-plane handlers: the current sandbox, unary agent calls, streamed responses."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import Response

from agentcell.errors import DeadlineExceededError, SandboxError, SandboxGoneError
from agentcell.runtime.protocol import Frame
from agentcell.server.errors import from_sandbox_error
from agentcell.server.registry import SandboxRecord

# Set by the root router for every data-plane request, read by the handlers.
current_sandbox: contextvars.ContextVar[SandboxRecord] = contextvars.ContextVar("current_sandbox")
# The request's DROP_EXTENSION (set beside current_sandbox), for handlers deep in connectrpc's stack.
current_drop: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("current_drop", default=None)

AGENT_CALL_TIMEOUT_S = 120.0  # a unary agent op that takes longer means a wedged agent, not slow work

HTTP_PIECE = 64 << 10  # data goes to uvicorn in pieces this big, so its write buffer stays small


def drop_connection() -> None:
    """End the current response by cutting its connection, as E2B's proxy does when the sandbox
    behind a stream dies: the SDKs then probe the sandbox and raise "killed or reached its end of
    life" (an in-band error line or Connect end would read as an error of the code instead)."""
    drop = current_drop.get()
    if drop is not None:
        drop()


async def client_gone(receive: Any) -> None:
    """Returns once the client has gone away (call it after the request body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class LiveStream(Response):
    """A streamed response, like Starlette's StreamingResponse, for a body that ends by itself once
    `gone` (a client_gone task, which the body watches) is done. StreamingResponse watches for the
    client leaving with an anyio task group, which costs more CPU than the rest of a trivial run_code."""

    def __init__(self, content: AsyncIterator[bytes], gone: asyncio.Task[None], media_type: str,
                 headers: dict[str, str] | None = None) -> None:
        self.body_iterator = content
        self.gone = gone
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers(headers)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            try:
                async for chunk in self.body_iterator:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except SandboxGoneError:
                drop_connection()
                return
            if not self.gone.done():
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.gone.cancel()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def agent_call(op: str, payload: bytes = b"", **fields: object) -> dict[str, object]:
    """A unary call to the current sandbox's agent, bounded so a wedged agent cannot hang a request."""
    try:
        frame = await asyncio.wait_for(
            current_sandbox.get().channel.call(op, payload, **fields), AGENT_CALL_TIMEOUT_S
        )
    except TimeoutError:
        raise DeadlineExceededError(
            f"the sandbox did not answer {op} within {AGENT_CALL_TIMEOUT_S:.0f} s"
        ) from None
    return frame.header


class CutConnection(Response):
    """No answer at all: the connection is cut (drop_connection), for a stream whose sandbox died
    before its first byte, where E2B's server had already answered 200."""

    def __init__(self, error: SandboxGoneError) -> None:
        self.error = error

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if current_drop.get() is None:  # not behind agentcell's HTTP protocol: say it in HTTP instead
            raise from_sandbox_error(self.error)
        drop_connection()


async def first_batch(batches: AsyncIterator[list[Frame]], gone: asyncio.Task[None],
                      cut_if_gone: bool = False) -> list[Frame] | None:
    """The call's first frames (None: it ended at once), before any response starts: an error there
    (not found, a directory...) becomes an HTTP error, not a 200 stream; with `cut_if_gone`, a
    SandboxGoneError is raised as it is (the caller answers CutConnection)."""
    try:
        return await anext(batches)
    except StopAsyncIteration:
        return None
    except BaseException as e:
        gone.cancel()
        await batches.aclose()  # type: ignore[attr-defined]
        if isinstance(e, SandboxError) and not (cut_if_gone and isinstance(e, SandboxGoneError)):
            raise from_sandbox_error(e) from None
        raise
