"""The SDK's errors as MCP tool errors, carrying the agentcell server's message (a 404 sandbox, a bad
language, a refused network rule ...), so a model reads what went wrong instead of a crash."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from mcp.server.mcpserver.exceptions import ToolError

from agentcell.errors import AgentcellError


@contextmanager
def sdk_errors(what: str) -> Iterator[None]:
    try:
        yield
    except ToolError:
        raise
    except AgentcellError as e:
        raise ToolError(f"{what}: {e}") from e
    except TimeoutError as e:
        raise ToolError(f"{what}: timed out") from e
