"""Which server a command talks to: --api-url / --api-key, else the SDK's own resolution (AGENTCELL_URL,
AGENTCELL_API_KEY ...; sdk/config.py). A command about a sandbox that outlives it needs a server that
outlives it too: where the SDK would start an embedded one, it refuses with a hint instead.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from agentcell.cli.errors import META_SANDBOX, META_TARGET, CliError

F = TypeVar("F", bound=Callable[..., Any])

NO_SERVER_HINT = ("start one with `agentcell serve` (as root; then AGENTCELL_URL=http://127.0.0.1:49982), "
                  "or set AGENTCELL_URL / pass --api-url")


@dataclass(frozen=True)
class Target:
    api_url: str | None
    api_key: str | None
    request_timeout: float | None = None

    @property
    def sdk(self) -> dict[str, Any]:
        """The keywords of the SDK's class methods (Sandbox.list, Sandbox.kill ...)."""
        return {"api_url": self.api_url, "api_key": self.api_key, "request_timeout": self.request_timeout}

    def describe(self) -> str | None:
        return self.api_url or os.environ.get("AGENTCELL_URL") or None

    def require_server(self, command: str) -> None:
        """A sandbox made or touched here lives on in the server: an embedded server, gone with this
        process, would take it along."""
        from agentcell.sdk.config import needs_embedded  # here: the SDK is not imported by every command

        if needs_embedded(self.api_url):
            raise CliError(f"`agentcell {command}` needs a running agentcell server, and none is configured",
                           NO_SERVER_HINT)


def server_options(f: F) -> F:
    """--api-url, --api-key and --request-timeout, passed to the command as `target`."""

    @click.option("--api-url", default=None, metavar="URL", help="The server (default: AGENTCELL_URL).")
    @click.option("--api-key", default=None, metavar="KEY",
                  help="Its API key (default: AGENTCELL_API_KEY, else E2B_API_KEY).")
    @click.option("--request-timeout", type=click.FloatRange(min=0.1), default=None, metavar="S",
                  help="Seconds to wait for the server to answer a request (default: 60).")
    @functools.wraps(f)
    def wrapper(*args: Any, api_url: str | None, api_key: str | None, request_timeout: float | None,
                **kwargs: Any) -> Any:
        target = Target(api_url, api_key, request_timeout)
        click.get_current_context().meta[META_TARGET] = target
        return f(*args, target=target, **kwargs)

    return wrapper  # type: ignore[return-value]


def about(sandbox_id: str) -> str:
    """Name the sandbox a command is about, for its error messages."""
    click.get_current_context().meta[META_SANDBOX] = sandbox_id
    return sandbox_id


def connect_running(target: Target, sandbox_id: str, command: str) -> Any:
    """A Sandbox handle (with its access token) on a running sandbox, without changing its life: a
    paused one is refused (resume it first), a running one's timeout is left as it is."""
    from agentcell import Sandbox

    target.require_server(command)
    about(sandbox_id)
    info = Sandbox.get_info(sandbox_id, **target.sdk)
    if info.state == "paused":
        raise CliError(f"sandbox {sandbox_id} is paused", f"`agentcell resume {sandbox_id}` first")
    # connect never shortens a sandbox's life: a 1 s timeout leaves a running one's end where it is
    return Sandbox.connect(sandbox_id, timeout=1, **target.sdk)


def complete_sandbox_ids(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """Shell completion of a sandbox id: the ids of the configured server's sandboxes."""
    from agentcell.sdk.config import needs_embedded

    if needs_embedded(ctx.params.get("api_url")):
        return []
    try:
        from agentcell import Sandbox
        from agentcell.sdk.models import SandboxQuery

        rows = Sandbox.list(SandboxQuery(state=["running", "paused"]), api_url=ctx.params.get("api_url"),
                            api_key=ctx.params.get("api_key"), request_timeout=2)
        return [s.sandbox_id for s in rows if s.sandbox_id.startswith(incomplete)]
    except Exception:  # noqa: BLE001 - completion must never fail loudly
        return []
