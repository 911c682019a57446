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
_END = object()


async def with_keepalive(source: AsyncIterator[T], interval: float) -> AsyncIterator[T | object]:
    """Yield the items of `source`, and KEEPALIVE whenever it stays quiet for `interval` seconds.

    The source runs in its own task, so a keepalive never cancels a pending read of it. Leaving the
    loop early cancels that task, which closes `source` (its finally blocks run: the agent call is
    cancelled).
    """
    queue: asyncio.Queue[object] = asyncio.Queue(maxsize=16)  # bounded: a slow client slows the pump

    async def pump() -> None:
        try:
            async for item in source:
                await queue.put(item)
            await queue.put(_END)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # handed to the consumer, which re-raises it
            await queue.put(e)
        finally:
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(BaseException):
                    await aclose()

    task = asyncio.get_running_loop().create_task(pump())
    try:
        while True:
            try:
                item = await asyncio.wait_for(queue.get(), interval)
            except TimeoutError:
                yield KEEPALIVE
                continue
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


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
