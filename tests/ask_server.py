"""`python -m tests.ask_server [serve options]`: a real `agentcell serve` whose egress asks a test.

The egress seen alone, without the server's approvals (those: tests/test_policy_network.py): this wraps
the real server and wires `Egress.set_asker` and `Egress.set_ask` to a unix socket a test connects to
(AGENTCELL_TEST_ASK_SOCKET), one JSON object a line:
  test -> server: {"op": "ask", "sandbox": id, "enabled": bool, "timeout": s}  -> {"op": "done", "slot": n}
                  {"op": "answer", "id": n, "allow": bool, "remember": bool}
                  {"op": "stats"}                                               -> {"op": "stats", ...}
  server -> test: {"op": "question", "id": n, "sandbox": id, "host": h, "address": a, "port": p, "t": unix time}
                  {"op": "cancelled", "id": n}   (the egress dropped that decision: its sandbox is gone)
Everything else is the real server: the asker is what the approvals will be, seen from the egress.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import sys
import time
from typing import Any

import orjson

from agentcell.backends.linux.backend import LinuxBackend
from agentcell.network.service import Egress
from agentcell.policy.linux.enforcer import LinuxPolicies

SOCKET_ENV = "AGENTCELL_TEST_ASK_SOCKET"


class Harness:
    def __init__(self, egress: Egress) -> None:
        self.egress = egress
        self.writer: asyncio.StreamWriter | None = None
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future[tuple[bool, bool]]] = {}
        if hasattr(egress, "set_asker"):  # (without it: the tests run, and fail, against egress that never asks)
            egress.set_asker(self.asker)

    async def asker(self, sandbox_id: str, host: str | None, address: str, port: int) -> tuple[bool, bool]:
        if self.writer is None:
            return False, False
        ident = next(self.ids)
        fut = self.waiting[ident] = asyncio.get_running_loop().create_future()
        try:
            self.send({"op": "question", "id": ident, "sandbox": sandbox_id, "host": host, "address": address,
                       "port": port, "t": time.time()})
            return await fut
        except asyncio.CancelledError:  # the egress dropped the decision (its sandbox was killed)
            self.send({"op": "cancelled", "id": ident})
            raise
        finally:
            self.waiting.pop(ident, None)

    def send(self, message: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.write(orjson.dumps(message) + b"\n")

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.writer = writer
        try:
            while line := await reader.readline():
                message = orjson.loads(line)
                if message["op"] == "answer":
                    fut = self.waiting.get(message["id"])
                    if fut is not None and not fut.done():
                        fut.set_result((bool(message["allow"]), bool(message["remember"])))
                elif message["op"] == "ask":
                    slot = self.egress.slot_serving(message["sandbox"]) if hasattr(self.egress, "set_ask") else -1
                    if slot is not None and slot >= 0:
                        await self.egress.set_ask(slot, bool(message["enabled"]), float(message["timeout"]))
                    self.send({"op": "done", "slot": slot})
                elif message["op"] == "stats":
                    self.send({"op": "stats", "counts": self.egress.ask_stats() if hasattr(self.egress, "ask_stats")
                               else {}})
        finally:
            self.writer = None


_original = LinuxBackend._start_egress


async def _start_egress(self: LinuxBackend) -> None:
    await _original(self)
    if self.egress is not None and not hasattr(self, "_ask_harness"):
        harness = Harness(self.egress)
        self._ask_harness = await asyncio.start_unix_server(harness.serve, os.environ[SOCKET_ENV])  # type: ignore[attr-defined]


LinuxBackend._start_egress = _start_egress  # type: ignore[method-assign]
# the server's own asker (its approvals: tests/test_policy_network.py) gives way to the harness's
LinuxPolicies.start_network = lambda self: None  # type: ignore[method-assign]

if __name__ == "__main__":
    from agentcell.cli import main

    main(["serve", *sys.argv[1:]], prog_name="python -m tests.ask_server")
