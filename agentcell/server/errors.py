"""JSON error responses, in the shapes the E2B SDKs parse."""

from __future__ import annotations

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


def json_error(status: int, message: str, **extra: object) -> JSONResponse:
    return JSONResponse({"code": status, "message": message, **extra}, status_code=status)


def from_sandbox_error(e: SandboxError) -> HTTPError:
    return HTTPError(HTTP_STATUS.get(e.code, 500), e.message)


def sandbox_not_found(sandbox_id: str) -> JSONResponse:
    # The SDK looks for "was not found" and raises SandboxNotRunningException; is_running() -> False.
    return JSONResponse(
        {"sandboxId": sandbox_id, "message": "The sandbox was not found", "code": 502}, status_code=502
    )
