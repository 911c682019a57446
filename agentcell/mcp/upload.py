"""upload_url: a URL fetched from inside the sandbox, so the sandbox's network policy (and egress
inspection, and its record) applies to it, never this host's network."""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import urlsplit

from mcp.server.mcpserver.exceptions import ToolError

from agentcell.errors import CommandExitException
from agentcell.sdk.sandbox_async import AsyncSandbox

# Run by the sandbox's python3: the URL, path and bound come in the environment (never in a command line
# a shell would parse). Streams to the file, stops past the bound (and removes what it wrote).
_FETCH = r"""
import json, os, sys, urllib.request
url, dest, cap = os.environ["AC_URL"], os.environ["AC_DEST"], int(os.environ["AC_MAX"])
os.makedirs(os.path.dirname(dest) or ".", exist_ok=True)
n = 0
try:
    with urllib.request.urlopen(url, timeout=60) as r, open(dest, "wb") as f:
        while chunk := r.read(1 << 16):
            n += len(chunk)
            if n > cap:
                f.close(); os.unlink(dest)
                sys.exit(f"{url} is larger than {cap} bytes, the most upload_url fetches")
            f.write(chunk)
        print(json.dumps({"path": dest, "bytes": n, "status": r.status,
                          "content_type": r.headers.get("content-type")}))
except OSError as e:
    sys.exit(f"fetching {url} failed: {getattr(e, 'reason', None) or e}")
"""

_RUN = """exec python3 -c 'import os; exec(os.environ["AC_FETCH"])'"""  # the record shows this short argv


async def fetch_into(sbx: AsyncSandbox, url: str, path: str, max_bytes: int) -> dict[str, Any]:
    if urlsplit(url).scheme not in ("http", "https"):
        raise ToolError(f"upload_url: {url!r} is not an http(s) URL")
    envs = {"AC_URL": url, "AC_DEST": path, "AC_MAX": str(max_bytes), "AC_FETCH": _FETCH}
    try:
        result = await sbx.commands.run(_RUN, envs=envs, timeout=120)
    except CommandExitException as e:
        raise ToolError(f"upload_url: {(e.stderr or e.stdout).strip() or f'exit code {e.exit_code}'}") from None
    return json.loads(result.stdout.strip().splitlines()[-1])
