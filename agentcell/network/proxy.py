"""The egress proxy: connections on ports 80 and 443 of sandboxes whose policy names domains, or that
have secrets or E2B `network.rules`, held until their first bytes name a host, checked, then read
request by request (docs/network.md, "The proxy, secrets and E2B's rules").

Why: a domain rule the router enforces by pinned addresses alone trusts the address; many names share
one (CDNs, virtual hosting), so a sandbox allowed `api.example.com` could reach `evil.example.net` on
the same address, or a denied name at an address it learned elsewhere (DoH, a hard-coded IP). Here the
name a connection claims (TLS SNI, HTTP Host; claims.py) must itself be allowed, and, under an allow
list, must be a name the address was answered for; then every request on the connection must name that
same host (inspection.py; TLS is terminated to read them), and secrets go in only where they may.

How the connections get here: the router's prerouting chain hands new TCP connections to ports 80 and
443 from intercepted links to this proxy's transparent socket (nftables `tproxy`, a fwmark and a local
route in the router namespace), so the original destination is the accepted socket's own address.
Only those connections reach it: the router marks a sandbox's later packets for local delivery only
when they belong to a connection the proxy accepted (`socket wildcard 0`: never the listener itself).
Since intercepted connections never cross the router's forward chain, the decision (the server's
`Egress.check_claim`) applies the never-list and the address rules too.

Where it runs: in a process of its own (proxy_process.py), inside the router namespace, at a lower
CPU priority than the server, so that TLS handshakes and bytes relayed for one sandbox never wait on,
or hold up, the event loop that serves the API. The server keeps the policy and answers one question
per connection (the decision); the process keeps what each sandbox's connections need (its secrets,
whether it has name rules) and sends the events back.

Budgets, per sandbox first and shared second (quota.py), so that no sandbox, nor a handful together,
can take the proxy from the others: connections held at once (MAX_PER_SANDBOX, a RESERVE each sandbox
always has, MAX_CONNECTIONS in all), new connections per second, and TLS handshakes per second (the
costly part: a certificate is minted once per host name and cached, ca.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from agentcell.network.ask import is_stand_in
from agentcell.network.ca import EgressCA
from agentcell.network.claims import MAX_PEEK, MORE, NONE, Claim, claimed_host
from agentcell.network.inspection import Connection, serve_inspected
from agentcell.network.quota import KeyedQuota
from agentcell.network.secrets import SecretSet, placeholder_in
from agentcell.network.tunnel import EgressTunnel, Resolve
from agentcell.network.tunnel import dial as tunnel_dial

log = logging.getLogger("agentcell.egress")

PROXY_PORT = 15001  # in the router namespace only
FWMARK = 0x1
ROUTE_TABLE = 100
INTERCEPTED_PORTS = (80, 443)
CLAIM_TIMEOUT_S = 10.0  # a client that names no host within this is dropped
CONNECT_TIMEOUT_S = 10.0
DECIDE_TIMEOUT_S = 5.0  # the server's answer; none in time: refused
CHUNK = 256 << 10
MAX_CONNECTIONS = 4096  # intercepted connections at once, all sandboxes together ...
MAX_PER_SANDBOX = 128  # ... of one sandbox ...
RESERVE = 16  # ... and what each sandbox gets whatever the others hold
NEW_PER_SECOND, NEW_BURST = 100.0, 200  # new intercepted connections of one sandbox
HANDSHAKES_PER_SECOND, HANDSHAKE_BURST = 20.0, 40  # TLS handshakes the proxy does for one sandbox
HANDSHAKE_WAIT_S = 1.0  # a handshake over budget waits this long for its turn, then the connection ends
IP_TRANSPARENT = 19

# -> (allowed, rule, plain ok, the address to connect to instead (network ask's stand-ins) or None)
Decide = Callable[[int, str, int, Claim], Awaitable[tuple[bool, str, bool, str | None]]]
Emit = Callable[[str, dict[str, Any]], None]  # (the sandbox id the slot served, event)


def listening_socket() -> socket.socket:
    """The proxy's transparent socket; call it in the router namespace."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_IP, IP_TRANSPARENT, 1)
    sock.bind(("0.0.0.0", PROXY_PORT))
    sock.listen(1024)
    sock.setblocking(False)
    return sock


def tproxy_statement() -> str:
    ports = ", ".join(str(p) for p in INTERCEPTED_PORTS)
    return f"meta l4proto tcp th dport {{ {ports} }} tproxy ip to :{PROXY_PORT} meta mark set {FWMARK:#x} accept"


def tproxy_any_statement() -> str:
    """Every TCP port (network ask: a connection the lists do not allow waits here for a decision)."""
    return f"meta l4proto tcp tproxy ip to :{PROXY_PORT} meta mark set {FWMARK:#x} accept"


def routing_commands() -> list[str]:
    """ip(8) commands that deliver marked packets locally (tproxy's other half)."""
    return [f"rule add fwmark {FWMARK} lookup {ROUTE_TABLE}", f"route add local 0.0.0.0/0 dev lo table {ROUTE_TABLE}"]


class TokenBucket:
    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens, self.at = float(burst), time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.at) * self.rate)
        self.at = now

    def take(self) -> bool:
        self._refill()
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True

    def wait_s(self) -> float:
        """How long until a token is there."""
        self._refill()
        return max(0.0, (1 - self.tokens) / self.rate)


@dataclass
class SlotState:
    """What the proxy knows of the sandbox a slot serves (sent by the server at claim and update)."""

    owner: str
    secrets: SecretSet
    names: bool  # the policy has name rules: what names no host is refused
    ask_s: float = 0.0  # network ask: how long the server may take to decide (0: the sandbox does not ask)
    tunnel: EgressTunnel | None = None  # network.egressProxy: every connection dialed through it (tunnel.py)
    connections: TokenBucket = field(default_factory=lambda: TokenBucket(NEW_PER_SECOND, NEW_BURST))
    handshakes: TokenBucket = field(default_factory=lambda: TokenBucket(HANDSHAKES_PER_SECOND, HANDSHAKE_BURST))
    live: set[asyncio.Task[Any]] = field(default_factory=set)
    over_budget: int = 0  # connections ended by a budget since the last note
    noted_at: float = 0.0

    @property
    def reads_requests(self) -> bool:
        """Whether connections to ports 80/443 are held until they name a host. A tunneled sandbox with
        nothing to check or put in requests is relayed as it is (its TLS never terminated here)."""
        return self.tunnel is None or self.names or self.secrets.inspects or bool(self.ask_s)


class Interceptor:
    def __init__(self, slot_of: Callable[[str], int | None], decide: Decide, emit: Emit, ca: EgressCA,
                 upstream_ssl: ssl.SSLContext,
                 upstream_socket: Callable[[], Awaitable[socket.socket]] | None = None,
                 resolve: Resolve | None = None,
                 proxy_forbidden: Callable[[ipaddress.IPv4Address], bool] | None = None) -> None:
        self.slot_of = slot_of
        self.decide = decide
        self.emit = emit
        self.ca = ca
        self.upstream_ssl = upstream_ssl
        self.upstream_socket = upstream_socket or _plain_socket
        self.resolve = resolve or _no_names  # the tunnels' proxy names (tunnel.py)
        self.proxy_forbidden = proxy_forbidden or (lambda address: True)  # where no proxy may be
        self.slots: dict[int, SlotState] = {}
        self.quota = KeyedQuota(MAX_CONNECTIONS, MAX_PER_SANDBOX, RESERVE)
        self.server: asyncio.Server | None = None

    async def start(self, sock: socket.socket) -> None:
        self.server = await asyncio.start_server(self._handle, sock=sock, limit=CHUNK)

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
        for slot in list(self.slots):
            self.forget(slot)

    # -- what the server says -------------------------------------------------------------------------

    def set_slot(self, slot: int, owner: str, secrets: SecretSet, names: bool, ask_s: float = 0.0,
                 tunnel: EgressTunnel | None = None) -> None:
        state = self.slots.get(slot)
        if state is not None and state.owner != owner:
            self.forget(slot)  # a new tenant: nothing of the old one's goes on
            state = None
        if state is None:
            self.slots[slot] = SlotState(owner, secrets, names, ask_s, tunnel)
        else:  # (connections already open keep the way they were dialed)
            state.secrets, state.names, state.ask_s, state.tunnel = secrets, names, ask_s, tunnel

    def forget(self, slot: int) -> None:
        """The slot's sandbox is gone: its connections end now, before the slot serves anyone else."""
        state = self.slots.pop(slot, None)
        if state is not None:
            for task in list(state.live):
                task.cancel()

    # -- connections ----------------------------------------------------------------------------------

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        src = writer.get_extra_info("peername")[0]
        dst, dport = writer.get_extra_info("sockname")[:2]  # the original destination (tproxy)
        slot = self.slot_of(src)
        state = self.slots.get(slot) if slot is not None else None
        if slot is None or state is None or (dport not in INTERCEPTED_PORTS and not state.ask_s and not state.tunnel) \
                or not self.quota.take(slot):
            if state is not None:
                self._over_budget(state, "connections")
            writer.transport.abort()
            return
        task = asyncio.current_task()
        assert task is not None
        state.live.add(task)
        try:
            if not state.connections.take():
                self._over_budget(state, "new connections per second")
                writer.transport.abort()
                return
            await self._serve(slot, state, dst, dport, reader, writer)
        except (OSError, asyncio.IncompleteReadError, TimeoutError, ssl.SSLError, ConnectionError,
                asyncio.CancelledError):
            writer.transport.abort()
        finally:
            state.live.discard(task)
            self.quota.give(slot)
            writer.close()

    async def _serve(self, slot: int, state: SlotState, dst: str, dport: int, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        first = b""
        # another port: a held one (network ask) or a tunneled one, named by its address alone
        claim: Claim | None = MORE if dport in INTERCEPTED_PORTS and state.reads_requests else NONE
        async with asyncio.timeout(CLAIM_TIMEOUT_S):
            while claim is MORE:
                chunk = await reader.read(MAX_PEEK)
                if not chunk:
                    return
                first += chunk
                claim = claimed_host(first)
        assert claim is not None
        try:
            async with asyncio.timeout(DECIDE_TIMEOUT_S + state.ask_s):  # a held one waits for its decision
                verdict, first = await self._decision(slot, state, dst, dport, claim, first, reader)
        except (TimeoutError, ConnectionError):
            verdict = False, "no-decision", False, None
        if verdict is None:
            return  # the client left while its connection was held
        allowed, rule, plain_ok, instead = verdict
        asked = rule.startswith("ask:")
        if allowed and claim.kind == "none" and state.names and not asked and dport in INTERCEPTED_PORTS:
            allowed, rule = False, "unnamed"  # name rules, and the connection names no host
        base = {"time": time.time(), "proto": "tcp", "dst": dst, "dport": dport}
        tunnel = state.tunnel
        if tunnel is not None:
            base["via"] = tunnel.address  # (the event says which proxy it went through)
        if is_stand_in(dst):  # network ask: the connection goes to what the name resolved to once allowed
            base = {**base, "dst": instead or dst, "stand_in": dst}
            dst = instead or dst
        if asked:  # held, then decided: rule "ask", and what the decision was
            self.emit(state.owner, {**base, "kind": "net.connect" if allowed else "net.deny", "domain": claim.host,
                                    "claim": claim.kind, "verdict": "allowed" if allowed else "denied",
                                    "rule": "ask", "decision": rule[4:],
                                    "state": "approved" if allowed else "denied"})
        elif not allowed:
            self.emit(state.owner, {**base, "kind": "net.deny", "domain": claim.host, "claim": claim.kind,
                                    "verdict": "denied", "rule": rule, "state": "denied"})
        if not allowed:
            if claim.kind == "http":  # say why; a TLS client just sees the connection end
                body = f"agentcell: {claim.host} is not allowed from this sandbox ({rule})\n".encode()
                writer.write(b"HTTP/1.1 403 Forbidden\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                with contextlib.suppress(OSError):
                    await writer.drain()
            return
        if claim.kind == "none":  # secrets, no name rules: bytes both ways, no placeholder out
            await self._relay(state, base, first, reader, writer)
            return
        assert claim.host is not None
        tls = claim.kind == "tls"
        server_ctx = None
        if tls:
            if not await self._handshake_turn(state):
                return
            server_ctx = self.ca.server_context(claim.host)
        conn = Connection(host=claim.host, dst=dst, dport=dport, tls=tls, secrets=state.secrets,
                          may_send_secrets=tls or plain_ok, upstream_socket=self.upstream_socket,
                          upstream_ssl=self.upstream_ssl if tls else None,
                          on_event=lambda event: self.emit(state.owner, event),
                          dial=self._tunnel_dial(tunnel, dst, dport) if tunnel is not None else None)
        await serve_inspected(first, reader, writer, conn, server_ctx)

    async def _decision(self, slot: int, state: SlotState, dst: str, dport: int, claim: Claim, first: bytes,
                        reader: asyncio.StreamReader) -> tuple[tuple[bool, str, bool, str | None] | None, bytes]:
        """The server's verdict, and the bytes read so far. While a sandbox that asks waits for one, what
        its client sends is read on (up to MAX_PEEK, kept for later): a client that leaves lets go of its
        place among the sandbox's held connections at once (None), rather than at the decision."""
        deciding = asyncio.ensure_future(self.decide(slot, dst, dport, claim))
        try:
            while state.ask_s and not deciding.done() and len(first) < MAX_PEEK:
                reading = asyncio.ensure_future(reader.read(MAX_PEEK - len(first)))
                await asyncio.wait({deciding, reading}, return_when=asyncio.FIRST_COMPLETED)
                if not reading.done():
                    reading.cancel()  # (a StreamReader keeps what it has not handed out) ...
                    with contextlib.suppress(asyncio.CancelledError):
                        await reading  # ... and is read from again only once this read is over
                if reading.cancelled():
                    break
                chunk = reading.result()
                if not chunk:
                    return None, first
                first += chunk
            return await deciding, first
        finally:
            deciding.cancel()  # (done already, or the client left: the server is told to let go)

    async def _handshake_turn(self, state: SlotState) -> bool:
        """A TLS handshake for this sandbox, within its budget (waiting a moment for its turn)."""
        if state.handshakes.take():
            return True
        wait = state.handshakes.wait_s()
        if wait <= HANDSHAKE_WAIT_S:
            await asyncio.sleep(wait)
            if state.handshakes.take():
                return True
        self._over_budget(state, "TLS handshakes per second")
        return False

    def _over_budget(self, state: SlotState, which: str) -> None:
        """Counted; one event a second at most says how many connections a budget ended."""
        state.over_budget += 1
        now = time.monotonic()
        if now - state.noted_at >= 1.0:
            self.emit(state.owner, {"time": time.time(), "kind": "net.deny", "proto": "tcp", "verdict": "denied",
                                    "rule": "proxy-budget", "budget": which, "count": state.over_budget,
                                    "state": "denied"})
            state.over_budget, state.noted_at = 0, now

    async def _relay(self, state: SlotState, base: dict[str, Any], first: bytes, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
        """A connection that names no host, from a sandbox with secrets but no name rules: its bytes
        both ways, scanned on the way out so that no placeholder leaves."""
        placeholders = list(state.secrets.secrets)
        if (found := placeholder_in(first, placeholders)) is not None:
            self.emit(state.owner, {**base, "kind": "secret.refused", "verdict": "denied", "rule": "secret-elsewhere",
                                    "secret": found.name, "state": "denied"})
            return
        if state.tunnel is not None:
            try:
                up_reader, up_writer = await self._tunnel_dial(state.tunnel, base["dst"], base["dport"])()
            except ConnectionError as e:  # fail closed: the connection ends, nothing goes out directly
                self.emit(state.owner, {**base, "kind": "net.deny", "verdict": "denied", "rule": "egress-proxy",
                                        "error": str(e)[:200], "state": "denied"})
                raise
        else:
            sock = await self.upstream_socket()
            sock.setblocking(False)
            try:
                async with asyncio.timeout(CONNECT_TIMEOUT_S):
                    await asyncio.get_running_loop().sock_connect(sock, (base["dst"], base["dport"]))
            except BaseException:
                sock.close()
                raise
            up_reader, up_writer = await asyncio.open_connection(sock=sock, limit=CHUNK)
        keep = max((len(s.placeholder) for s in placeholders), default=1) - 1

        async def outbound() -> None:
            tail = first[-keep:] if keep > 0 else b""
            up_writer.write(first)
            while chunk := await reader.read(CHUNK):
                window = tail + chunk
                if (found := placeholder_in(window, placeholders)) is not None:
                    self.emit(state.owner, {**base, "kind": "secret.refused", "verdict": "denied",
                                            "rule": "secret-elsewhere", "secret": found.name, "state": "denied"})
                    raise ConnectionError("a placeholder on its way out")
                up_writer.write(chunk)
                await up_writer.drain()
                tail = window[-keep:] if keep > 0 else b""
            if up_writer.can_write_eof():
                up_writer.write_eof()

        try:
            await asyncio.gather(outbound(), _pipe(up_reader, writer))
        finally:
            up_writer.transport.abort()


    def _tunnel_dial(self, tunnel: EgressTunnel, dst: str, dport: int,
                     ) -> Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]:
        async def dial() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
            return await tunnel_dial(tunnel, dst, dport, self.resolve, self.proxy_forbidden, CHUNK,
                                     self.upstream_socket)
        return dial


async def _no_names(name: str) -> list[str]:
    raise ConnectionError(f"no resolver for the egress proxy's name {name}")


async def _plain_socket() -> socket.socket:
    return socket.socket(socket.AF_INET, socket.SOCK_STREAM)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close; the other direction goes on."""
    try:
        while chunk := await reader.read(CHUNK):
            writer.write(chunk)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, ConnectionError):
        writer.transport.abort()
