"""RUN steps of template builds in real sandboxes (executor.BuildSandboxes, on the server's manager).

One step, one sandbox: its root is the layers so far (an image root: backends/linux/image_root.py),
its limits the build's CPU and memory, its network the build's (all traffic out when the server gives
sandboxes the internet by default, else none). The command runs through the agent as any
`commands.run` does, its output streamed into the build's log; then the sandbox's changes (root upper
layer and /home/user) are exported as an OCI layer tar (LinuxBackend.export_layer, templates/
capture.py) and the sandbox is killed. The executor stores the layer.

A step's sandbox is one-off (SandboxSpec.pooled=False): no standby pool is made for a step's layers.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from typing import Any

from agentcell.backends.base import ImageRoot, Limits
from agentcell.errors import InvalidArgumentError, SandboxError
from agentcell.network.policy import NetworkPolicy
from agentcell.runtime.protocol import KEEPALIVE
from agentcell.templates.executor import RunOutcome, RunRequest

KEEPALIVE_S = 30.0
AGENT_USERS = {0: "root", 1000: "user"}  # who the agent runs commands as (the sandbox's root and user)


class ManagerBuildSandboxes:
    def __init__(self, manager: Any) -> None:
        self.manager = manager

    def _limits(self, request: RunRequest) -> Limits:
        return Limits(memory_mb=request.memory_mb or 1024, cpu_count=float(request.cpu_count or 1))

    async def run(self, request: RunRequest, output: Callable[[str, str], None]) -> RunOutcome:
        user = AGENT_USERS.get(request.uid)
        if user is None:
            raise InvalidArgumentError(f"a build step runs as root or as uid 1000 here, not as {request.user} "
                                       f"(uid {request.uid})")
        key = hashlib.sha256("\n".join(request.layers).encode()).hexdigest()[:24]
        root = ImageRoot(key=f"build-{key}", layers=request.layers, env=tuple(sorted(request.env.items())),
                         workdir=request.cwd, shell=request.argv[0])
        network = NetworkPolicy.parse(request.internet)
        rec = await self.manager.create(template_id="build-step", alias=None, timeout=int(request.timeout_s) + 60,
                                        metadata={"agentcell.build": "step"}, envs=dict(request.env),
                                        limits=self._limits(request), network=network, root=root, pooled=False)
        try:
            code = await self._command(rec, request, user, output)
            diff_id: str = await rec.backend.export_layer(rec.running, request.layer_tar, request.max_layer_bytes)
            return RunOutcome(code, diff_id)
        finally:
            with contextlib.suppress(SandboxError, OSError):
                await self.manager.kill(rec.sandbox_id)

    async def _command(self, rec: Any, request: RunRequest, user: str, output: Callable[[str, str], None]) -> int:
        partial = {"stdout": b"", "stderr": b""}
        code = -1
        async for item in rec.channel.stream(
                "proc.start", keepalive=KEEPALIVE_S, cmd=request.argv[0], args=list(request.argv[1:]),
                envs=dict(request.env), cwd=request.cwd, tag=None, stdin=False, pty=None,
                timeout_ms=int(request.timeout_s * 1000), user=user):
            if item is KEEPALIVE:
                continue
            header = item.header
            kind = header.get("event")
            if kind in partial:
                data = partial[kind] + item.payload
                *lines, partial[kind] = data.split(b"\n")
                for line in lines:
                    output(kind, line.decode("utf-8", "replace"))
            elif kind == "end":
                code = int(header.get("exit_code", -1))
                if header.get("error") and code == 0:
                    code = -1
            if header.get("timed_out"):
                raise InvalidArgumentError(f"the command did not finish within {request.timeout_s:.0f} s")
        for kind, rest in partial.items():
            if rest:
                output(kind, rest.decode("utf-8", "replace"))
        return code
