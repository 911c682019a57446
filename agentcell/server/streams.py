"""Helpers shared by the data-plane handlers: the current sandbox and keepalive-interleaved streams."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator
from typing import TypeVar

from agentcell.errors import DeadlineExceededError
from agentcell.server.registry import SandboxRecord

T = TypeVar("T")

# Set by the root router for every data-plane request, read by the handlers.
current_sandbox: contextvars.ContextVar[SandboxRecord] = contextvars.ContextVar("current_sandbox")

AGENT_CALL_TIMEOUT_S = 120.0  # a unary agent op that takes longer means a wedged agent, not slow work

KEEPALIVE = object()  # yielded by with_keepalive when the source was idle for `interval` seconds
HTTP_PIECE = 64 << 10  # data goes to uvicorn in pieces this big, so its write buffer stays small


async def with_keepalive(source: AsyncIterator[T], interval: float) -> AsyncIterator[T | object]:
    """Yield the items of `source`, and KEEPALIVE whenever it stays quiet for `interval` seconds.

    Nothing is read ahead: the one pending read of `source` completes only when the source has an
    item, which is yielded at once, so flow control reaches back to the producer in the sandbox.
    A keepalive never cancels that pending read. Leaving the loop early closes `source` (its finally
    blocks run: the agent call is cancelled).
    """
    pending: asyncio.Task[T] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(source))
            done, _ = await asyncio.wait({pending}, timeout=interval)
            if not done:
                yield KEEPALIVE
                continue
            task, pending = pending, None
            try:
                item = task.result()
            except StopAsyncIteration:
                return
            yield item
    finally:
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        aclose = getattr(source, "aclose", None)
        if aclose is not None:
            with contextlib.suppress(BaseException):
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
