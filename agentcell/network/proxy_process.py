"""The egress proxy in a process of its own (proxy.py says what it does; this is where it runs).

Why: terminating TLS and relaying bytes for one sandbox is CPU work that scales with what the sandbox
does. On the server's event loop, one sandbox's handshake flood moved another tenant's
`commands.run` p50 from 3 ms to 115 ms. Here it runs in a child process at a lower CPU priority (nice
NICE), inside the router's network namespace (it enters it before anything else, so every socket it
makes is there), with per-sandbox budgets (proxy.py); the server's loop only answers one small
question per connection (may it go on?) and stores the events that come back.

Trust: the child is host root like the server (it enters the router namespace), runs no tenant code,
holds the egress CA's key and the values of the secrets of the sandboxes it serves (the server sends
them at claim; they never enter a sandbox). It dies with the server (PR_SET_PDEATHSIG, and EOF on its
socket). If it dies first, its connections are gone, the server says so in the log, starts it again
(RESTARTS a period at most) and tells it every sandbox's state again.

Protocol: a SOCK_SEQPACKET socketpair, one orjson array per packet.
  server -> child: ["slot", slot, owner, secrets, names, ask_s, tunnel or null], ["forget", slot],
                   ["verdict", id, allowed, rule, plain_ok, address instead or null], ["close"]
  child -> server: ["started"], ["decide", id, slot, dst, dport, claim kind, claim host],
                   ["undecide", id] (its client left while it waited: no verdict wanted),
                   ["events", [[owner, event] ...]]
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import itertools
import os
import signal
import socket
import ssl
import sys
from collections.abc import Awaitable, Callable
from typing import Any

import orjson

from agentcell import allocator
from agentcell.backends.linux import child_link
from agentcell.backends.linux import syscalls as sc
from agentcell.network.ca import EgressCA
from agentcell.network.claims import Claim
from agentcell.network.proxy import Interceptor, listening_socket
from agentcell.network.router import EgressError, NeverList, slot_of
from agentcell.network.secrets import HeaderRule, Secret, SecretSet
from agentcell.network.tunnel import EgressTunnel, forbidden_by, tunnel_resolver

MODULE = "agentcell.network.proxy_process"  # the child runs `python -m MODULE`
NICE = 10
START_TIMEOUT_S = 30.0
CLOSE_TIMEOUT_S = 10.0
SOCKET_BUFFER = 4 << 20
MAX_PACKET = 1 << 20  # 32 secrets of 8 KiB and their hosts fit many times over
BATCH_EVENTS, BATCH_DELAY_S = 64, 0.005
RESTARTS, RESTART_PERIOD_S, RESTART_DELAY_S = 5, 600.0, 0.5

# allowed, the rule that decided, plain HTTP may carry this host's secrets, the address to connect to
# instead of the connection's own (None: its own; a network ask stand-in's: the name's real address)
Verdict = tuple[bool, str, bool, str | None]
DecideFn = Callable[[int, str, int, Claim], "Verdict | Awaitable[Verdict]"]  # awaitable: a held connection
EventFn = Callable[[str, dict[str, Any]], None]


class ProxyProcessError(EgressError):
    """The egress proxy's process could not start."""


def secrets_message(secrets: SecretSet) -> list[Any]:
    return [[[s.name, s.value, list(s.hosts), s.placeholder, s.bodies] for s in secrets.secrets],
            [[r.host, [list(h) for h in r.headers]] for r in secrets.rules]]


def secrets_of(raw: list[Any]) -> SecretSet:
    secrets, rules = raw
    return SecretSet(tuple(Secret(n, v, tuple(h), p, b) for n, v, h, p, b in secrets),
                     tuple(HeaderRule(host, tuple((n, v) for n, v in headers)) for host, headers in rules))


class ProxyProcess(child_link.ChildProcess):
    """The server's end. `decide(slot, dst, dport, claim)` answers each connection's question (the
    policy lives in the server); `on_event(owner, event)` receives the proxy's events."""

    module = MODULE
    what = "egress proxy's process"
    error = ProxyProcessError
    cut = "; intercepted connections were cut"
    without = "intercepted connections are refused until the server restarts"
    start_timeout_s = START_TIMEOUT_S
    close_timeout_s = CLOSE_TIMEOUT_S
    restart_delay_s = RESTART_DELAY_S

    def __init__(self, config: dict[str, Any], decide: DecideFn, on_event: EventFn) -> None:
        super().__init__(config, buffer=SOCKET_BUFFER, max_packet=MAX_PACKET, restarts=RESTARTS,
                         period_s=RESTART_PERIOD_S)  # config: router (netns path), ca_dir, ca_bundle
        self.decide = decide
        self.on_event = on_event
        self._slots: dict[int, list[Any]] = {}  # what the child must know again after a restart
        self._deciding: dict[int, set[asyncio.Task[None]]] = {}  # slot -> held connections' decisions
        self._held: dict[int, asyncio.Task[None]] = {}  # the same, by the child's question id

    async def _respawned(self, why: str) -> None:
        for message in self._slots.values():
            self._send(message)

    # -- to the child ------------------------------------------------------------------------------

    def _send(self, message: list[Any]) -> None:
        if self._sock is None:
            return  # gone: it learns everything again when it is started again
        try:
            self._send_packet(orjson.dumps(message))
        except OSError as e:
            print(f"agentcell: {e}; ending it", file=sys.stderr, flush=True)
            self._shut(str(e))

    def set_slot(self, slot: int, owner: str, secrets: SecretSet, names: bool, ask_s: float = 0.0) -> None:
        tunnel = secrets.tunnel.to_message() if secrets.tunnel is not None else None
        message = ["slot", slot, owner, secrets_message(secrets), names, ask_s, tunnel]
        self._slots[slot] = message
        self._send(message)

    def forget(self, slot: int) -> None:
        self._slots.pop(slot, None)
        for task in self._deciding.pop(slot, set()):
            task.cancel()
        self._send(["forget", slot])

    # -- from the child ----------------------------------------------------------------------------

    def _readable(self) -> None:
        for _ in range(256):  # then what else the loop has to do, and on
            if not self._receive():
                return

    def _handle(self, message: list[Any]) -> None:
        op = message[0]
        if op == "decide":
            _, ident, slot, dst, dport, kind, host = message
            try:
                verdict = self.decide(slot, dst, dport, Claim(kind, host))
            except Exception as e:  # a question it cannot answer is a no
                verdict = False, f"error: {type(e).__name__}", False, None
            if inspect.isawaitable(verdict):  # held until a decision: the loop goes on meanwhile
                task = asyncio.ensure_future(self._verdict_later(ident, verdict))
                tasks = self._deciding.setdefault(slot, set())
                tasks.add(task)
                self._held[ident] = task
                task.add_done_callback(tasks.discard)
                task.add_done_callback(lambda _: self._held.pop(ident, None))
                return
            self._send(["verdict", ident, *verdict])
        elif op == "undecide":
            task = self._held.get(message[1])
            if task is not None:
                task.cancel()
        elif op == "events":
            for owner, event in message[1]:
                self.on_event(owner, event)


    async def _verdict_later(self, ident: int, pending: Awaitable[Verdict]) -> None:
        try:
            verdict = await pending
        except asyncio.CancelledError:  # the sandbox is gone (its connections are cut anyway)
            verdict = False, "ask:gone", False, None
        except Exception as e:
            verdict = False, f"error: {type(e).__name__}", False, None
        self._send(["verdict", ident, *verdict])

    async def close(self) -> None:
        for tasks in self._deciding.values():
            for task in tasks:
                task.cancel()
        self._deciding.clear()
        await super().close()


# -- the child --------------------------------------------------------------------------------------


class _Child:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.done = self.loop.create_future()
        self.ids = itertools.count(1)
        self.waiting: dict[int, asyncio.Future[Verdict]] = {}
        self.batch: list[list[Any]] = []
        self.flush_at: asyncio.TimerHandle | None = None
        self.interceptor: Interceptor | None = None

    def send(self, message: list[Any]) -> None:
        # blocking: a server that does not read holds the proxy up, never grows it
        self.sock.sendall(orjson.dumps(message, default=str, option=orjson.OPT_NON_STR_KEYS))

    async def decide(self, slot: int, dst: str, dport: int, claim: Claim) -> Verdict:
        ident = next(self.ids)
        fut = self.waiting[ident] = self.loop.create_future()
        try:
            self.send(["decide", ident, slot, dst, dport, claim.kind, claim.host])
            return await fut
        except asyncio.CancelledError:
            if self.waiting.get(ident) is fut and not self.done.done():
                with contextlib.suppress(OSError):
                    self.send(["undecide", ident])
            raise
        finally:
            self.waiting.pop(ident, None)

    def emit(self, owner: str, event: dict[str, Any]) -> None:
        self.batch.append([owner, event])
        if len(self.batch) >= BATCH_EVENTS:
            self.flush()
        elif self.flush_at is None:
            self.flush_at = self.loop.call_later(BATCH_DELAY_S, self.flush)

    def flush(self) -> None:
        if self.flush_at is not None:
            self.flush_at.cancel()
            self.flush_at = None
        if self.batch:
            batch, self.batch = self.batch, []
            self.send(["events", batch])

    def readable(self) -> None:
        while True:
            try:
                data = self.sock.recv(MAX_PACKET, socket.MSG_DONTWAIT)
            except BlockingIOError:
                return
            if not data:  # the server is gone
                self.stop()
                return
            self.order(orjson.loads(data))

    def order(self, message: list[Any]) -> None:
        op = message[0]
        assert self.interceptor is not None
        if op == "verdict":
            fut = self.waiting.get(message[1])
            if fut is not None and not fut.done():
                fut.set_result((bool(message[2]), str(message[3]), bool(message[4]),
                                str(message[5]) if message[5] else None))
        elif op == "slot":
            _, slot, owner, secrets, names, ask_s, tunnel = message
            tunnel = EgressTunnel.from_message(tunnel)
            self.interceptor.set_slot(slot, owner, dataclasses.replace(secrets_of(secrets), tunnel=tunnel), bool(names),
                                      float(ask_s), tunnel)
        elif op == "forget":
            self.interceptor.forget(message[1])
        elif op == "close":
            self.stop()

    def stop(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    async def run(self, config: dict[str, Any]) -> None:
        ca = EgressCA.load_or_create(config["ca_dir"])
        upstream_ssl = ssl.create_default_context()
        if config.get("ca_bundle"):
            upstream_ssl.load_verify_locations(config["ca_bundle"])
        proxies = config.get("tunnel") or {}  # network.egressProxy: its names' resolver, where a proxy may be
        self.interceptor = Interceptor(slot_of, self.decide, self.emit, ca, upstream_ssl,
                                       resolve=tunnel_resolver(proxies.get("dns") or ""),
                                       proxy_forbidden=forbidden_by(NeverList(proxies.get("ranges") or ())))
        await self.interceptor.start(listening_socket())
        self.send(["started"])
        self.loop.add_reader(self.sock.fileno(), self.readable)
        self.loop.add_signal_handler(signal.SIGTERM, self.stop)
        await self.done
        self.loop.remove_reader(self.sock.fileno())
        self.interceptor.close()
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_exception(ConnectionError("the server is gone"))
        with contextlib.suppress(OSError):
            self.flush()


def _enter(netns_path: str) -> None:
    fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        sc.setns(fd, sc.CLONE_NEWNET)  # (one thread yet: the whole process is there from now on)
    finally:
        os.close(fd)


def main() -> None:
    if not child_link.die_with_parent():
        return
    allocator.pin_thresholds()  # a helper lives as long as the server (allocator.py)
    with contextlib.suppress(OSError):
        os.nice(NICE)
    config = orjson.loads(sys.argv[2])
    _enter(config["router"])
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.setblocking(True)

    async def run() -> None:
        await _Child(sock).run(config)

    asyncio.run(run())


if __name__ == "__main__":
    main()
