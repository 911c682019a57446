"""Results as MCP content: text for output, values and errors; images for PNG, JPEG and SVG charts.

Every text is capped (Bounds.max_text characters, the head kept) and says so where it was cut, so a
model knows there is more and how to get it; images beyond the size or count bound are named instead.
"""

from __future__ import annotations

import base64

from mcp.types import CallToolResult, ContentBlock, ImageContent, TextContent

from agentcell.mcp.bounds import Bounds
from agentcell.sdk.models import CommandResult, Execution

_IMAGES = (("png", "image/png"), ("jpeg", "image/jpeg"), ("svg", "image/svg+xml"))


def capped(text: str, bounds: Bounds, what: str) -> str:
    if len(text) <= bounds.max_text:
        return text
    more = len(text) - bounds.max_text
    return (text[:bounds.max_text] + f"\n[... {more} more characters of {what} not shown: answers are capped at "
            f"{bounds.max_text} characters; write large output to a file and read it in parts]")


def text(value: str) -> TextContent:
    return TextContent(type="text", text=value)


class _Images:
    """Images of one answer, within the count and size bounds."""

    def __init__(self, bounds: Bounds) -> None:
        self.bounds = bounds
        self.count = 0

    def block(self, data: str, mime: str) -> ContentBlock:
        """`data`: base64 (png, jpeg, as results carry them) or SVG text."""
        encoded = base64.b64encode(data.encode()).decode() if mime == "image/svg+xml" else data
        size = len(encoded) * 3 // 4
        if self.count >= self.bounds.max_images:
            return text(f"[{mime} image not sent: at most {self.bounds.max_images} images an answer]")
        if size > self.bounds.max_image_bytes:
            return text(f"[{mime} image of {size} bytes not sent: images are capped at "
                        f"{self.bounds.max_image_bytes} bytes; save it to a file instead]")
        self.count += 1
        return ImageContent(type="image", data=encoded, mime_type=mime)


def execution(ex: Execution, bounds: Bounds) -> CallToolResult:
    """run_code's answer: stdout, stderr, each result (its text, and its image if it has one), the error.
    An error in the code is the code's outcome, not the tool's: the answer is not marked as an error."""
    blocks: list[ContentBlock] = []
    images = _Images(bounds)
    stdout, stderr = "".join(ex.logs.stdout), "".join(ex.logs.stderr)
    if stdout:
        blocks.append(text(capped(stdout, bounds, "stdout")))
    if stderr:
        blocks.append(text("stderr:\n" + capped(stderr, bounds, "stderr")))
    for result in ex.results:
        for name, mime in _IMAGES:
            data = getattr(result, name, None)
            if data:
                blocks.append(images.block(data, mime))
        value = result.text or result.markdown or result.html
        if value and not (result.png or result.jpeg or result.svg):  # a figure's text is "<Figure ...>": noise
            blocks.append(text(("Out: " if result.is_main_result else "") + capped(value, bounds, "the result")))
    if ex.error is not None:
        report = f"{ex.error.name}: {ex.error.value}\n{ex.error.traceback}"
        blocks.append(text("Error: " + capped(report, bounds, "the traceback")))
    if not blocks:
        blocks.append(text("(no output)"))
    return CallToolResult(content=blocks)


def command(result: CommandResult, bounds: Bounds) -> CallToolResult:
    """run_command's answer: exit code, stdout, stderr. A non-zero exit is the command's outcome."""
    parts = [f"exit code: {result.exit_code}"]
    if result.error:
        parts.append(f"error: {result.error}")
    if result.stdout:
        parts.append("stdout:\n" + capped(result.stdout, bounds, "stdout"))
    if result.stderr:
        parts.append("stderr:\n" + capped(result.stderr, bounds, "stderr"))
    return CallToolResult(content=[text("\n".join(parts))])
