"""Build a converted Dockerfile on a server, through E2B's template-build API, as E2B's SDK does.

`e2b.Template.build_in_background` requests the build (POST /v3/templates), uploads the COPY steps'
files the server does not have yet (GET /templates/{id}/files/{hash} → PUT), and starts it (POST
/v2/templates/{id}/builds/{buildID}); the status is then polled here (GET .../status?logsOffset=) rather
than by `Template.build`, so that a failed step's `reason.step` can be named as a Dockerfile line.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx
from e2b import Template
from e2b.exceptions import AuthenticationException, BuildException, SandboxException, ServiceBusyException
from e2b.template.logger import LogEntry
from e2b.template.types import TemplateBuildStatus

from agentcell.errors import AgentcellError
from agentcell.templates.dockerfile import ConvertedDockerfile

POLL_INTERVAL_S = 0.2
# E2B's client refuses to send a request without a key; a server without one accepts any
NO_KEY = "agentcell-no-key"


class TemplateBuildError(AgentcellError):
    """The server refused the build or the build failed; the message names the step's Dockerfile line."""

    def __init__(self, message: str, line: int | None = None, step: str | None = None) -> None:
        super().__init__(message)
        self.line = line
        self.step = step


@dataclass
class BuildResult:
    template_id: str
    build_id: str
    name: str
    tags: list[str] = field(default_factory=list)


def build_on_server(converted: ConvertedDockerfile, name: str, *, api_url: str, api_key: str | None,
                    tags: list[str] | None = None, skip_cache: bool = False,
                    on_log: Callable[[LogEntry], None] | None = None,
                    request_timeout: float | None = None) -> BuildResult:
    """Build `converted` as template `name` (`name:tag` allowed) on the server at `api_url`, passing each
    log entry to `on_log`. Raises TemplateBuildError when the build fails."""
    opts = {"api_url": api_url, "api_key": api_key or NO_KEY, "request_timeout": request_timeout}
    try:
        info = Template.build_in_background(converted.template, name, tags=tags or None, skip_cache=skip_cache,
                                            on_build_logs=on_log, **opts)  # type: ignore[arg-type]
        offset = 0
        while True:
            status = Template.get_build_status(info, logs_offset=offset, **opts)  # type: ignore[arg-type]
            offset += len(status.log_entries)
            for entry in status.log_entries:
                if on_log:
                    on_log(entry)
            if status.status in (TemplateBuildStatus.READY, TemplateBuildStatus.ERROR) and not status.log_entries:
                break  # the last logs drained (a status answer carries at most 100 entries)
            if status.status not in (TemplateBuildStatus.READY, TemplateBuildStatus.ERROR):
                time.sleep(POLL_INTERVAL_S)
    except (SandboxException, BuildException, AuthenticationException, ServiceBusyException) as e:
        raise TemplateBuildError(f"{type(e).__name__}: {e}") from None  # e2b's API errors, with the server's
    except (httpx.HTTPError, OSError) as e:
        raise TemplateBuildError(f"cannot reach the server at {api_url}: {e}") from None
    if status.status == TemplateBuildStatus.ERROR:
        reason = status.reason
        step = reason.step if reason else None
        line = converted.line_of_step(step)
        where = f"{converted.label}:{line}: " if line is not None else (f"step {step}{_default_step(converted, step)}: "
                                                                        if step else "")
        raise TemplateBuildError(f"the build failed: {where}{reason.message if reason else 'no reason given'}",
                                 line, step)
    return BuildResult(info.template_id, info.build_id, info.name, list(info.tags or []))


def _default_step(converted: ConvertedDockerfile, step: str) -> str:
    """A step no Dockerfile line made: E2B's default user and workdir after the Dockerfile."""
    if step.isdigit() and 1 <= int(step) <= len(converted.step_lines):
        spec = converted.template._template._instructions[int(step) - 1]
        kind = getattr(spec["type"], "value", spec["type"])  # e2b's InstructionType
        return f" ({kind} {' '.join(spec['args'])}, E2B's default after the Dockerfile)"
    return ""
