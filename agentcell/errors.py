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


# --- SDK exceptions, named and shaped like the e2b SDK's so code moving from E2B keeps its handlers ---


class SandboxException(AgentcellError):
    """Base of every error the SDK raises."""


class TimeoutException(SandboxException):
    """A request, command or code run did not finish in time."""


class NotFoundException(SandboxException):
    """A sandbox, file, process or code context does not exist."""


class InvalidArgumentException(SandboxException):
    """The server rejected the request's arguments (the message says which)."""


class NotEnoughSpaceException(SandboxException):
    """The sandbox's disk is full."""


class AuthenticationException(SandboxException):
    """The API key or the sandbox access token was refused."""


class RateLimitException(SandboxException):
    """The server is at its sandbox limit; retry later or kill idle sandboxes."""


class SandboxNotRunningException(TimeoutException):
    """The sandbox was killed, timed out, or its agent died.

    A TimeoutException subclass, as in e2b, so `except TimeoutException` handlers keep catching it.
    """


class CommandExitException(SandboxException):
    """A command exited with a non-zero code; its output is attached."""

    def __init__(self, stdout: str, stderr: str, exit_code: int, error: str | None) -> None:
        detail = f": {error}" if error else ""
        tail = f" and stderr:\n{stderr[-2000:]}" if stderr else ""
        super().__init__(f"command exited with code {exit_code}{detail}{tail}")
        self.stdout = stdout
        self.stderr = stderr
        self.exit_code = exit_code
        self.error = error


class FileNotFoundException(NotFoundException):
    """A file or directory does not exist in the sandbox."""


class SandboxNotFoundException(NotFoundException):
    """No sandbox with that id exists (it may have been killed or timed out)."""


class ServerUnreachableException(SandboxException):
    """No HTTP answer from the agentcell server: it is not running, or the URL or socket is wrong."""


class EmbeddedServerError(SandboxException):
    """The embedded local server (started when no api_url / AGENTCELL_URL is set) failed to start."""


class NoLocalServerError(EmbeddedServerError):
    """No api_url / AGENTCELL_URL, no system service this user can reach, and no embedded server possible
    (it needs root): the message names the fix (docs/system-service.md)."""


class SecretException(SandboxException):
    """A call of the secrets vault (Secret.create/update/...) failed; the message says why."""


class SecretNotFoundException(SecretException, NotFoundException):
    """No secret of that id or name in the caller's vault."""
