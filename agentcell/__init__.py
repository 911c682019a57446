"""agentcell: millisecond Linux sandboxes for code that AI agents write, over the E2B protocol.

    from agentcell import Sandbox
    with Sandbox.create() as sbx:
        print(sbx.run_code("1 + 1").text)
"""

from agentcell.errors import (
    AuthenticationException,
    CommandExitException,
    EmbeddedServerError,
    FileNotFoundException,
    InvalidArgumentException,
    NotEnoughSpaceException,
    NotFoundException,
    RateLimitException,
    SandboxException,
    SandboxNotFoundException,
    SandboxNotRunningException,
    ServerUnreachableException,
    TimeoutException,
)
from agentcell.sdk import (
    AsyncCommandHandle,
    AsyncSandbox,
    CommandHandle,
    CommandResult,
    Context,
    EntryInfo,
    Execution,
    ExecutionError,
    FileType,
    Logs,
    OutputMessage,
    ProcessInfo,
    Result,
    Sandbox,
    SandboxInfo,
    SandboxQuery,
    WriteInfo,
)

__version__ = "0.1.0"

__all__ = [
    "AsyncCommandHandle",
    "AsyncSandbox",
    "AuthenticationException",
    "CommandExitException",
    "CommandHandle",
    "CommandResult",
    "Context",
    "EmbeddedServerError",
    "EntryInfo",
    "Execution",
    "ExecutionError",
    "FileNotFoundException",
    "FileType",
    "InvalidArgumentException",
    "Logs",
    "NotEnoughSpaceException",
    "NotFoundException",
    "OutputMessage",
    "ProcessInfo",
    "RateLimitException",
    "Result",
    "Sandbox",
    "SandboxException",
    "SandboxInfo",
    "SandboxNotFoundException",
    "SandboxNotRunningException",
    "SandboxQuery",
    "ServerUnreachableException",
    "TimeoutException",
    "WriteInfo",
]
