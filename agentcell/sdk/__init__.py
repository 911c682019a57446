"""agentcell's Python SDK: E2B's API shapes over E2B's wire protocol, plus an embedded local server."""

from agentcell.sdk.commands_async import AsyncCommandHandle
from agentcell.sdk.commands_sync import CommandHandle
from agentcell.sdk.models import (
    CommandResult,
    Context,
    EntryInfo,
    Execution,
    ExecutionError,
    FilesystemEvent,
    FilesystemEventType,
    FileType,
    Logs,
    OutputMessage,
    ProcessInfo,
    Result,
    SandboxInfo,
    SandboxQuery,
    WriteInfo,
)
from agentcell.sdk.sandbox_async import AsyncSandbox
from agentcell.sdk.sandbox_sync import Sandbox
from agentcell.sdk.secret import AsyncSecret, AsyncSecretPaginator, Secret, SecretInfo, SecretPaginator
from agentcell.sdk.volume import (
    AsyncVolume,
    Volume,
    VolumeAndToken,
    VolumeEntryStat,
    VolumeException,
    VolumeInfo,
    VolumeNotFoundException,
    VolumePathNotFoundException,
)

__all__ = [
    "AsyncCommandHandle", "AsyncSandbox", "CommandHandle", "CommandResult", "Context", "EntryInfo", "Execution",
    "ExecutionError", "FilesystemEvent", "FilesystemEventType", "FileType", "Logs", "OutputMessage", "ProcessInfo", "Result", "Sandbox", "SandboxInfo",
    "SandboxQuery", "WriteInfo", "Secret", "AsyncSecret", "SecretInfo", "SecretPaginator", "AsyncSecretPaginator",
    "AsyncVolume", "Volume", "VolumeAndToken", "VolumeEntryStat", "VolumeException",
    "VolumeInfo", "VolumeNotFoundException", "VolumePathNotFoundException",
]
