"""Typed errors shared by the SDK, the server and the runtime.

Every error carries a message a user can act on. `code` is the Connect error code name
(``not_found``, ``invalid_argument`` ...) used on the wire between the server and the in-sandbox agent.
"""

from __future__ import annotations


class AgentcellError(Exception):
    """Base class of every agentcell error."""


class SandboxError(AgentcellError):
    """A sandbox operation failed."""

    code = "internal"

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class NotFoundError(SandboxError):
    code = "not_found"


class InvalidArgumentError(SandboxError):
    code = "invalid_argument"


class PermissionDeniedError(SandboxError):
    code = "permission_denied"


class AlreadyExistsError(SandboxError):
    code = "already_exists"


class ResourceExhaustedError(SandboxError):
    code = "resource_exhausted"


class DeadlineExceededError(SandboxError):
    code = "deadline_exceeded"


class SandboxGoneError(SandboxError):
    """The sandbox was killed, timed out, or its agent died."""

    code = "unavailable"


class BackendUnavailableError(AgentcellError):
    """The isolation backend cannot run on this machine (missing kernel feature, not root, ...)."""


_BY_CODE: dict[str, type[SandboxError]] = {
    cls.code: cls
    for cls in (
        NotFoundError,
        InvalidArgumentError,
        PermissionDeniedError,
        AlreadyExistsError,
        ResourceExhaustedError,
        DeadlineExceededError,
        SandboxGoneError,
    )
}


def error_from_code(code: str, message: str) -> SandboxError:
    """Rebuild a typed error from its wire code and message."""
    return _BY_CODE.get(code, SandboxError)(message, code)
