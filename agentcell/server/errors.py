"""JSON error responses, in the shapes the E2B SDKs parse."""

from __future__ import annotations

import contextvars
import errno
import logging
import secrets
from collections.abc import Callable

from starlette.responses import JSONResponse

from agentcell.errors import SandboxError

# Connect code name -> HTTP status, for plain-HTTP (non-Connect) data-plane endpoints.
HTTP_STATUS = {
    "invalid_argument": 400,
    "unauthenticated": 401,
    "permission_denied": 403,
    "not_found": 404,
    "already_exists": 409,
    "resource_exhausted": 507,  # /files: disk full -> NotEnoughSpaceException
    "deadline_exceeded": 504,
    "unavailable": 502,
    "unimplemented": 501,
    "internal": 500,
}


class HTTPError(Exception):
    """Raised by a handler to answer with `{"code": status, "message": ...}`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


log = logging.getLogger("agentcell.server")
# who counts a request's incidents by exception type (server/access_log.py sets it per request: /metrics)
incident_counter: contextvars.ContextVar[Callable[[BaseException], None] | None] = contextvars.ContextVar(
    "incident_counter", default=None)


def log_incident(what: str, exc: BaseException) -> str:
    """Log `exc` with its traceback under a fresh incident id, and return the id for the client.

    Exception text can name host paths, cgroups, uids or internals: it goes to the log, never to the
    client, who gets the id to quote to the operator.
    """
    incident = secrets.token_hex(6)
    if (count := incident_counter.get()) is not None:
        count(exc)
    log.error("incident %s: %s failed", incident, what, exc_info=exc)
    return incident


def _no_space(exc: BaseException | None) -> bool:
    """Whether the server's own disk (or quota) ran out somewhere in `exc`'s chain."""
    seen = 0
    while exc is not None and seen < 10:
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def internal_error(what: str, exc: BaseException, prefix: str = "internal server error") -> HTTPError:
    incident = log_incident(what, exc)
    if _no_space(exc):  # the operator's to mend, not a bug: say so (507, what E2B answers for a full disk)
        return HTTPError(507, f"{prefix}: the server's disk is full (incident {incident}); its operator must make "
                              "room under the server's state dir, then try again")
    return HTTPError(500, f"{prefix} (incident {incident}; the server log has the details)")


def json_error(status: int, message: str, **extra: object) -> JSONResponse:
    return JSONResponse({"code": status, "message": message, **extra}, status_code=status)


def from_sandbox_error(e: SandboxError) -> HTTPError:
    return HTTPError(HTTP_STATUS.get(e.code, 500), e.message)


def sandbox_not_found(sandbox_id: str, why: str | None = None) -> JSONResponse:
    # The SDK looks for "was not found" and raises SandboxNotRunningException; is_running() -> False.
    # `why`: what else is known (the gateway: the sandbox's cell does not answer now, it may come back).
    message = "The sandbox was not found" + (f": {why}" if why else "")
    return JSONResponse({"sandboxId": sandbox_id, "message": message, "code": 502}, status_code=502)
