"""What one MCP session, and one MCP endpoint, may take: sandboxes, sessions, and the size of what a
tool answers (a model's context is small, and a client holds each answer in memory)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Bounds:
    max_sandboxes: int = 10  # live sandboxes one session may hold (created through it, not yet killed)
    max_sessions: int = 100  # concurrent streamable-HTTP sessions of one endpoint (more: 503)
    session_idle_timeout: float = 1800.0  # seconds an HTTP session may go without a request, then it ends
    max_text: int = 100_000  # characters of one stream (stdout, stderr, a result, a file) in an answer
    max_image_bytes: int = 4 << 20  # one image (PNG, JPEG, SVG) in an answer; larger ones are named, not sent
    max_images: int = 8  # images in one answer
    max_upload_bytes: int = 100 << 20  # what upload_url may fetch into the sandbox
    cleanup_timeout: float = 4.0  # seconds to kill a session's sandboxes when it ends

    def __post_init__(self) -> None:
        for name in ("max_sandboxes", "max_sessions", "max_text", "max_image_bytes", "max_images", "max_upload_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if self.session_idle_timeout <= 0:
            raise ValueError("session_idle_timeout must be a positive number of seconds")
