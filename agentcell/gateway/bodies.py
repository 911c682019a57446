"""The one request body the gateway holds: a create's JSON, read whole so that a create a cell refuses
can be sent to another. Every other body streams through (forward.py).

What that body may cost is bounded as on a server (server/bodies.py): at most MAX_CREATE_BODY each
(Content-Length checked before a byte is read, then counted), and all of them together at most the
gateway's `--max-body-memory-mb`: a create reserves its Content-Length (its cap when chunked) before
reading and waits while the budget is spent (503 after the body timeout), its bytes meanwhile in the
kernel. The body deadline of the gateway's edge (server/edge.py BodyDeadline) bounds how long it takes.
"""

from __future__ import annotations

from typing import Any

from agentcell.gateway.forward import ClientLeft
from agentcell.server.asgi import declared_length
from agentcell.server.bodies import BodyBudget
from agentcell.server.errors import HTTPError

MAX_CREATE_BODY = 1 << 20


def _too_large(most: int) -> HTTPError:
    return HTTPError(413, f"a create's body is at most {most >> 10} KiB")


async def read_held(scope: dict[str, Any], receive: Any, budget: BodyBudget,
                    most: int = MAX_CREATE_BODY) -> tuple[bytes, int]:
    """(the whole body, the bytes of `budget` it holds: release them when the body is dropped).
    HTTPError 413 past `most`, 503 when the budget stayed spent; ClientLeft when the body stopped short
    (the client left, or missed the deadline and got its 408)."""
    declared = declared_length(scope)
    if declared is not None and declared > most:
        raise _too_large(most)
    taken = await budget.acquire(declared if declared is not None else most)
    try:
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise ClientLeft
            data = message.get("body", b"")
            size += len(data)
            if size > most:
                raise _too_large(most)
            chunks.append(data)
            if not message.get("more_body", False):
                break
    except BaseException:
        await budget.release(taken)
        raise
    body = b"".join(chunks)
    if taken > len(body):  # a chunked body reserved its cap: keep what it holds
        await budget.release(taken - len(body))
        taken = len(body)
    return body, taken
