"""E2B's `network.egressProxy`: a sandbox's outbound TCP tunneled through a SOCKS5 proxy the tenant
names (docs/network.md, "The egress proxy (SOCKS5)").

Where it happens: host-side, in the egress proxy's process (proxy.py), after the router and the server
decided the connection may go (allow/deny lists, never-list, name rules, secrets, E2B's header rules).
Only the dial changes: instead of connecting to the destination, the proxy's process connects to the
SOCKS5 proxy (optionally over TLS) and asks it to CONNECT to the destination's address. The sandbox sees
nothing of it and cannot route around it: every TCP packet of a tunneled sandbox goes to the proxy's
process or is dropped (router.py's `tunneled` set). UDP (DNS to the sandbox's resolver, QUIC) is not
tunneled, as on E2B.

Fail closed: a proxy that cannot be reached, refuses the credentials, does not speak SOCKS5 or refuses
the CONNECT ends the sandbox's connection (an HTTP 502 where the proxy reads HTTP); nothing falls back
to a direct connection.

The operator's ceiling on where a proxy may be: like every address a sandbox reaches, never the
never-list (the host's networks, private ranges, loopback, link-local, metadata, CGNAT ...), minus
what `--egress-allow-range` opens for everyone and `--egress-proxy-range` opens for proxies only. A
name is resolved at create/update (refused if it resolves to nothing allowed) and again at each dial,
that connection pinned to the address it got (a DNS change cannot redirect it to a forbidden address).
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
import ssl
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import dns.asyncquery
import dns.flags
import dns.message
import dns.rdatatype
from socksio import socks5
from socksio.exceptions import ProtocolError

from agentcell.network.policy import PolicyError, _domain

MAX_CREDENTIAL = 255  # bytes, RFC 1929
MAX_SERVER_NAME = 253
MAX_CA_CERT = 8192  # bytes of PEM, as E2B
DIAL_TIMEOUT_S = 10.0  # reaching the proxy, TLS and the SOCKS5 exchange together
_FIELDS = {"address", "username", "password", "tls"}
_TLS_FIELDS = {"enabled", "serverName", "server_name", "caCert", "ca_cert"}

Resolve = Callable[[str], Awaitable[list[str]]]  # a name -> its IPv4 addresses (unfiltered)


class TunnelError(ConnectionError):
    """The tunnel could not be opened (the message says which step failed); the connection ends."""


class TunnelConfigError(ValueError):
    """A `network.egressProxy` this server will not use; the message says why (a 400)."""


@dataclass(frozen=True)
class EgressTunnel:
    """One sandbox's SOCKS5 proxy. The password and CA certificate are never shown back (info())."""

    host: str  # an IPv4 literal or a host name (lower case)
    port: int
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    server_name: str | None = None
    ca_cert: str | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def literal(self) -> bool:
        try:
            ipaddress.IPv4Address(self.host)
        except ValueError:
            return False
        return True

    @classmethod
    def parse(cls, raw: Any) -> EgressTunnel | None:
        """E2B's `network.egressProxy` ({address, username?, password?, tls?: {enabled, serverName?,
        caCert?}}); None or absent: no tunnel."""
        if raw is None:
            return None
        if not isinstance(raw, Mapping):
            raise TunnelConfigError("'network.egressProxy' must be an object like {\"address\": \"host:1080\"}")
        unknown = set(raw) - _FIELDS
        if unknown:
            raise TunnelConfigError(f"'network.egressProxy' has an unknown field {sorted(unknown)[0]!r}")
        host, port = _host_port(raw.get("address"))
        username, password = raw.get("username"), raw.get("password")
        for name, value in (("username", username), ("password", password)):
            if value is not None and (not isinstance(value, str) or not 1 <= len(value.encode()) <= MAX_CREDENTIAL):
                raise TunnelConfigError(f"'network.egressProxy.{name}' must be a string of 1 to {MAX_CREDENTIAL} bytes")
        if password is not None and username is None:
            raise TunnelConfigError("'network.egressProxy.password' needs a username (SOCKS5 sends both, RFC 1929)")
        tls, server_name, ca_cert = _tls(raw.get("tls"))
        return cls(host, port, username, password, tls, server_name, ca_cert)

    def info(self) -> dict[str, Any]:
        """E2B's info shape: no password, no CA certificate."""
        out: dict[str, Any] = {"address": self.address}
        if self.username is not None:
            out["username"] = self.username
        if self.tls:
            out["tls"] = {"enabled": True, **({"serverName": self.server_name} if self.server_name else {})}
        return out

    def to_message(self) -> list[Any]:
        """For the proxy's process (proxy_process.py)."""
        return [self.host, self.port, self.username, self.password, self.tls, self.server_name, self.ca_cert]

    @classmethod
    def from_message(cls, raw: list[Any] | None) -> EgressTunnel | None:
        return None if raw is None else cls(*raw)

    def ssl_context(self) -> ssl.SSLContext:
        """TLS to the proxy: verified, TLS 1.2 or newer; a CA certificate given replaces the system's."""
        ctx = ssl.create_default_context(cadata=self.ca_cert) if self.ca_cert else ssl.create_default_context()
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        return ctx


def _host_port(address: Any) -> tuple[str, int]:
    if not isinstance(address, str) or not address or len(address) > MAX_SERVER_NAME + 6:
        raise TunnelConfigError("'network.egressProxy.address' must be a string 'host:port'")
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise TunnelConfigError(f"'network.egressProxy.address' {address!r} is not 'host:port' (port 1-65535)")
    if host.startswith("["):
        raise TunnelConfigError("'network.egressProxy.address': IPv6 proxies are not supported (agentcell's "
                                "egress is IPv4 only); use an IPv4 address or a name with an A record")
    try:
        ipaddress.IPv4Address(host)
        return host, int(port_text)
    except ValueError:
        pass
    try:
        name = _domain(host)
    except PolicyError:
        raise TunnelConfigError(f"'network.egressProxy.address': {host!r} is neither an IPv4 address nor a host name") from None
    if name.startswith("*."):
        raise TunnelConfigError("'network.egressProxy.address' must name one host, not a wildcard")
    return name, int(port_text)


def _tls(raw: Any) -> tuple[bool, str | None, str | None]:
    if raw is None or raw is False:
        return False, None, None
    if raw is True:
        return True, None, None
    if not isinstance(raw, Mapping) or set(raw) - _TLS_FIELDS:
        raise TunnelConfigError("'network.egressProxy.tls' must be {\"enabled\": bool, \"serverName\"?, \"caCert\"?}")
    enabled = raw.get("enabled", True)
    if not isinstance(enabled, bool):
        raise TunnelConfigError("'network.egressProxy.tls.enabled' must be a boolean")
    server_name = raw.get("serverName", raw.get("server_name"))
    ca_cert = raw.get("caCert", raw.get("ca_cert"))
    if not enabled:
        return False, None, None
    if server_name is not None and (not isinstance(server_name, str) or not 1 <= len(server_name) <= MAX_SERVER_NAME):
        raise TunnelConfigError(f"'network.egressProxy.tls.serverName' must be a name of 1 to {MAX_SERVER_NAME} characters")
    if ca_cert is not None:
        if not isinstance(ca_cert, str) or not 1 <= len(ca_cert.encode()) <= MAX_CA_CERT:
            raise TunnelConfigError(f"'network.egressProxy.tls.caCert' must be PEM of at most {MAX_CA_CERT} bytes")
        try:
            ssl.create_default_context(cadata=ca_cert)
        except (ssl.SSLError, ValueError) as e:
            raise TunnelConfigError(f"'network.egressProxy.tls.caCert' is not a PEM CA certificate: {e}") from None
    return True, server_name, ca_cert


# -- where a proxy may be ---------------------------------------------------------------------------


async def usable_addresses(tunnel: EgressTunnel, resolve: Resolve,
                           forbidden: Callable[[ipaddress.IPv4Address], bool]) -> list[str]:
    """The proxy's addresses the operator's ceiling allows (an IP literal: itself), in answer order."""
    found = [tunnel.host] if tunnel.literal else await resolve(tunnel.host)
    return [a for a in found if not forbidden(ipaddress.IPv4Address(a))]


async def check_address(tunnel: EgressTunnel, resolve: Resolve,
                        forbidden: Callable[[ipaddress.IPv4Address], bool]) -> None:
    """TunnelConfigError unless the proxy's address is somewhere this server lets a proxy be: a literal
    off the never-list; a name that resolves, and only to such addresses (E2B: "resolves into a private
    or otherwise internal range, is rejected")."""
    try:
        found = [tunnel.host] if tunnel.literal else await resolve(tunnel.host)
    except Exception as e:  # noqa: BLE001 - a resolver fails in many ways: each one is "could not be resolved"
        raise TunnelConfigError(f"network.egressProxy: {tunnel.host} could not be resolved ({type(e).__name__})") from None
    if not found:
        raise TunnelConfigError(f"network.egressProxy: {tunnel.host} does not resolve to an IPv4 address")
    bad = [a for a in found if forbidden(ipaddress.IPv4Address(a))]
    if bad:
        raise TunnelConfigError(
            f"network.egressProxy: {tunnel.address} is (or resolves to) {bad[0]}, an address sandboxes' proxies may not "
            "be at on this server (private, loopback, link-local, metadata ...; the operator opens ranges with "
            "--egress-proxy-range)")


# -- the dial ---------------------------------------------------------------------------------------


async def dial(tunnel: EgressTunnel, dst: str, dport: int, resolve: Resolve,
               forbidden: Callable[[ipaddress.IPv4Address], bool], limit: int,
               make_socket: Callable[[], Awaitable[socket.socket]] | None = None,
               ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to dst:dport through the sandbox's proxy, ready for the connection's bytes; TunnelError
    (a ConnectionError) otherwise. Runs in the proxy's process, in the router's namespace."""
    try:
        async with asyncio.timeout(DIAL_TIMEOUT_S):
            return await _dial(tunnel, dst, dport, resolve, forbidden, limit, make_socket)
    except TimeoutError:
        raise TunnelError(f"the egress proxy {tunnel.address} did not answer within {DIAL_TIMEOUT_S:g} s") from None


async def _dial(tunnel: EgressTunnel, dst: str, dport: int, resolve: Resolve,
                forbidden: Callable[[ipaddress.IPv4Address], bool], limit: int,
                make_socket: Callable[[], Awaitable[socket.socket]] | None,
                ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    try:
        addresses = await usable_addresses(tunnel, resolve, forbidden)
    except Exception as e:  # noqa: BLE001 - a resolver fails in many ways: each one is "could not be resolved"
        raise TunnelError(f"the egress proxy's name {tunnel.host} could not be resolved ({type(e).__name__})") from None
    if not addresses:
        raise TunnelError(f"the egress proxy {tunnel.host} resolves to no address a proxy may be at")
    sock = await make_socket() if make_socket is not None else socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, (addresses[0], tunnel.port))  # pinned: this one
    except OSError as e:
        sock.close()
        raise TunnelError(f"the egress proxy {tunnel.address} could not be reached: {e.strerror or e}") from None
    try:
        if tunnel.tls:
            reader, writer = await asyncio.open_connection(
                sock=sock, ssl=tunnel.ssl_context(), server_hostname=tunnel.server_name or tunnel.host, limit=limit)
        else:
            reader, writer = await asyncio.open_connection(sock=sock, limit=limit)
    except (OSError, ssl.SSLError) as e:
        sock.close()
        raise TunnelError(f"TLS to the egress proxy {tunnel.address} failed: {e}") from None
    try:
        await _negotiate(tunnel, dst, dport, reader, writer)
    except BaseException:
        writer.transport.abort()
        raise
    return reader, writer


async def _negotiate(tunnel: EgressTunnel, dst: str, dport: int, reader: asyncio.StreamReader,
                     writer: asyncio.StreamWriter) -> None:
    """SOCKS5 (RFC 1928, RFC 1929 credentials), the bytes made and checked by socksio."""
    conn = socks5.SOCKS5Connection()
    method = (socks5.SOCKS5AuthMethod.USERNAME_PASSWORD if tunnel.username is not None
              else socks5.SOCKS5AuthMethod.NO_AUTH_REQUIRED)
    try:
        conn.send(socks5.SOCKS5AuthMethodsRequest([method]))  # only that one: no downgrade to no credentials
        writer.write(conn.data_to_send())
        auth = conn.receive_data(await reader.readexactly(2))
        if not isinstance(auth, socks5.SOCKS5AuthReply) or auth.method != method:
            raise TunnelError(f"the egress proxy {tunnel.address} refused the authentication method")
        if method == socks5.SOCKS5AuthMethod.USERNAME_PASSWORD:
            conn.send(socks5.SOCKS5UsernamePasswordRequest((tunnel.username or "").encode(),
                                                           (tunnel.password or "").encode()))
            writer.write(conn.data_to_send())
            verdict = conn.receive_data(await reader.readexactly(2))
            if not isinstance(verdict, socks5.SOCKS5UsernamePasswordReply) or not verdict.success:
                raise TunnelError(f"the egress proxy {tunnel.address} refused the credentials")
        conn.send(socks5.SOCKS5CommandRequest.from_address(socks5.SOCKS5Command.CONNECT, (dst, dport)))
        writer.write(conn.data_to_send())
        head = await reader.readexactly(4)
        kind = head[3]
        if kind == 1:
            rest = await reader.readexactly(4 + 2)
        elif kind == 4:
            rest = await reader.readexactly(16 + 2)
        elif kind == 3:
            length = await reader.readexactly(1)
            rest = length + await reader.readexactly(length[0] + 2)
        else:
            raise TunnelError(f"the egress proxy {tunnel.address} sent a malformed reply")
        reply = conn.receive_data(head + rest)
        if not isinstance(reply, socks5.SOCKS5Reply) or reply.reply_code != socks5.SOCKS5ReplyCode.SUCCEEDED:
            code = getattr(reply, "reply_code", None)
            raise TunnelError(f"the egress proxy {tunnel.address} refused CONNECT {dst}:{dport}"
                              + (f" ({code.name.lower()})" if code is not None else ""))
    except ProtocolError:
        raise TunnelError(f"the egress proxy {tunnel.address} does not speak SOCKS5") from None
    except asyncio.IncompleteReadError:
        raise TunnelError(f"the egress proxy {tunnel.address} closed the connection during the SOCKS5 exchange") from None


def forbidden_by(never: Any) -> Callable[[ipaddress.IPv4Address], bool]:
    """A never-list (router.NeverList) as the predicate above."""
    return lambda address: address in never


def tunnel_resolver(upstream: str, timeout: float = 2.0) -> Resolve:
    """Resolving a proxy's name at dial time, in the proxy's process (the router's namespace): the
    server's upstream DNS server, asked directly (the sandboxes' resolver answers sandboxes only)."""
    async def resolve(name: str) -> list[str]:
        if not upstream:
            raise TunnelError("no upstream DNS server to resolve the egress proxy's name (--egress-dns)")
        query = dns.message.make_query(name, dns.rdatatype.A)
        reply = await dns.asyncquery.udp(query, upstream, timeout=timeout)
        if reply.flags & dns.flags.TC:
            reply = await dns.asyncquery.tcp(query, upstream, timeout=timeout)
        return [rd.address for rrset in reply.answer if rrset.rdtype == dns.rdatatype.A for rd in rrset]
    return resolve
