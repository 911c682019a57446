"""API calls on a sandbox, in its behaviour record (issue 10): `api.call` events with the caller's key
id, so the record tells the platform's doing (an upload, a command the agent's host app started)
apart from what the code in the sandbox did on its own.

The root router wraps each call (`recorded`); the handler that understands the request adds what it
was about (`note(cmd=..., path=...)`), and the event is stored once the response starts, with its
status as the outcome. The caller (`key_id`) is the credential the router's check verified
(auth.Credential, left in the scope), never a header the request merely carried: a hash prefix,
never the credential.
"""

from __future__ import annotations

import contextvars
import hashlib
import re
from typing import Any

from agentcell.record.events import event
from agentcell.server import auth

_details: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("api_call_details", default=None)
_EXCERPT = 200  # characters of code or a command line kept in an event

_CONTROL_RE = re.compile(r"^/(?:v\d+/)?sandboxes/([a-z0-9]{1,64})(?:/([a-z]+))?$")
_INTERPRETER_ACTIONS = {("POST", "/execute"): "run_code", ("POST", "/contexts"): "contexts.create",
                        ("GET", "/contexts"): "contexts.list"}


UNVERIFIED = "unverified"  # a call that reached a handler without the router's check (a bug): said so


def caller_id(scope: dict[str, Any]) -> str:
    """The id of the credential the router verified for this call (auth.Credential.id)."""
    credential = scope.get(auth.CREDENTIAL)
    return credential.id if isinstance(credential, auth.Credential) else UNVERIFIED


def data_plane_action(method: str, path: str, interpreter: bool) -> str | None:
    """The action a data-plane request is; None for those not worth a record (health checks)."""
    if path.startswith(("/process.", "/filesystem.")):  # Connect: /process.Process/Start -> process.Start
        service, _, rpc = path[1:].partition("/")
        return f"{service.split('.')[0]}.{rpc}"
    if interpreter:
        if (method, path) in _INTERPRETER_ACTIONS:
            return _INTERPRETER_ACTIONS[(method, path)]
        if path.startswith("/contexts/"):
            return "contexts.restart" if path.endswith("/restart") else "contexts.delete"
        return None
    if path == "/files":
        return "files.write" if method == "POST" else "files.read"
    return None


def control_action(method: str, path: str) -> tuple[str, str] | None:
    """(sandbox id, action) for a control-plane call that acts on one sandbox; reads are not recorded."""
    if method == "GET":
        return None
    m = _CONTROL_RE.match(path)
    if m is None:
        return None
    return m.group(1), f"sandbox.{m.group(2) or ('kill' if method == 'DELETE' else 'update')}"


def note(**fields: Any) -> None:
    """Add what the current call is about (a handler's part): cmd, path, language ..."""
    details = _details.get()
    if details is not None:
        for k, v in fields.items():
            details[k] = v[:_EXCERPT] if isinstance(v, str) else v


def excerpt(text: str) -> dict[str, Any]:
    return {"excerpt": text[:_EXCERPT], "length": len(text), "sha256": hashlib.sha256(text.encode()).hexdigest()}


async def recorded(sink: Any, sandbox_id: str, action: str, app: Any, scope: Any, receive: Any,
                   send: Any) -> None:
    """Run `app` for this call and add one `api.call` event to the sandbox's record when its
    response starts (or when it fails without one), naming the verified caller. (A secret's value
    the caller put in the call is stored as its placeholder: EventStore.redact.)"""
    key = caller_id(scope)
    details: dict[str, Any] = {}
    token = _details.set(details)
    done = False

    def emit(status: int) -> None:
        nonlocal done
        if not done:
            done = True
            sink(sandbox_id, event("api.call", source="api", action=action, key_id=key, status=status, **details))

    async def send_and_record(message: Any) -> None:
        if message["type"] == "http.response.start":
            emit(int(message["status"]))
        await send(message)

    try:
        await app(scope, receive, send_and_record)
    except BaseException:
        emit(500)
        raise
    finally:
        _details.reset(token)
