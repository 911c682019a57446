"""A template's start command (E2B's `set_start_cmd(start, ready)`): started in every sandbox of the
template while it is still a standby, and the sandbox is ready only once the ready command exits 0.

E2B starts it at build time and snapshots the running sandbox; here each standby starts it before any
request names it, so a create still gets a sandbox whose service is up, and nothing of a tenant's
(its env vars come with the claim) is in the command's environment.
"""

from __future__ import annotations

import asyncio
import os

from agentcell.runtime.processes import ProcessTable

READY_POLL_S = 0.2


def _shell() -> str:
    return "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"


async def _exit_code(processes: ProcessTable, command: str, user: str, tag: str | None = None) -> int | None:
    sub = processes.start({"cmd": _shell(), "args": ["-l", "-c", command], "user": user, "tag": tag})
    try:
        while True:
            item = await sub.get()
            if item is None:
                return None
            header, _ = item
            if header.get("event") == "end":
                return int(header.get("exit_code", -1))
    finally:
        sub.close()


async def start(processes: ProcessTable, start_cmd: str, ready_cmd: str, user: str = "user") -> None:
    """Start `start_cmd` in the background (tag "start_cmd"), then wait until `ready_cmd` exits 0
    (polled; the server's ready timeout bounds the wait)."""
    sub = processes.start({"cmd": _shell(), "args": ["-l", "-c", start_cmd], "user": user, "tag": "start_cmd"})
    sub.close()  # nobody reads its output: it runs on, as a service
    while ready_cmd and await _exit_code(processes, ready_cmd, user) != 0:
        await asyncio.sleep(READY_POLL_S)
