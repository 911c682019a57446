"""What a command in a sandbox writes, as the bytes it wrote.

envd's process stream carries output as bytes (base64 in each data event); the SDK's handle decodes
them as UTF-8 for its str callbacks (E2B's API), which would mangle binary output (`exec ID -- cat
image.png > out.png`). `relay` reads the same stream and hands each chunk on undecoded; the end event
still goes through the handle's own bookkeeping, so its exit code, signal and timeout are the SDK's.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

OnBytes = Callable[[bytes], Any]


def relay(handle: Any, on_stdout: OnBytes, on_stderr: OnBytes) -> Any:
    """Stream `handle`'s (a background CommandHandle's) stdout and stderr chunks to the callbacks as
    bytes; then its CommandResult, or the SDK's CommandExitException / TimeoutException."""
    output = handle._output
    for msg in handle._events:
        data = (msg.get("event") or {}).get("data")
        if data is not None:
            if "stdout" in data:
                on_stdout(base64.b64decode(data["stdout"]))
            elif "stderr" in data:
                on_stderr(base64.b64decode(data["stderr"]))
            continue
        output.feed(msg)  # the start and end events: exit code, signal
    return output.finish(handle._timeout, handle._started)
