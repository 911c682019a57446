"""agentcell: millisecond Linux sandboxes for code that AI agents write, over the E2B protocol.

    from agentcell import Sandbox
    with Sandbox.create() as sbx:
        print(sbx.run_code("1 + 1").text)
"""

from typing import TYPE_CHECKING

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
    SecretException,
    SecretNotFoundException,
    ServerUnreachableException,
    TimeoutException,
)

if TYPE_CHECKING:
    from agentcell.sdk import (
        AsyncCommandHandle,
        AsyncSandbox,
        AsyncSecret,
        AsyncSecretPaginator,
        AsyncVolume,
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
        Secret,
        SecretInfo,
        SecretPaginator,
        Volume,
        VolumeAndToken,
        VolumeEntryStat,
        VolumeException,
        VolumeInfo,
        VolumeNotFoundException,
        VolumePathNotFoundException,
        WriteInfo,
    )

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    # The SDK (httpx and the rest) is imported on first use: the server and the sandboxes' runtime
    # import `agentcell` too, and must not pay for the SDK on their start.
    if name in __all__:  # the SDK's names (the errors are imported above)
        from agentcell import sdk

        value = getattr(sdk, name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'agentcell' has no attribute {name!r}")


__all__ = [
    "AsyncCommandHandle",
    "AsyncSandbox",
    "AsyncSecret",
    "AsyncSecretPaginator",
    "AsyncVolume",
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
    "Secret",
    "SecretException",
    "SecretInfo",
    "SecretNotFoundException",
    "SecretPaginator",
    "ServerUnreachableException",
    "TimeoutException",
    "Volume",
    "VolumeAndToken",
    "VolumeEntryStat",
    "VolumeException",
    "VolumeInfo",
    "VolumeNotFoundException",
    "VolumePathNotFoundException",
    "WriteInfo",
]
