"""The linux backend's egress: one router namespace, its uplink, the sandboxes' resolver, and each
sandbox's policy and pinned addresses (docs/network.md).

Lifecycle, per sandbox slot:
- `connect(slot, pid)` while the sandbox is a standby (off the request path): its veth link, closed;
- `apply(slot, policy)` at claim and at every `update_network`: one nft transaction;
- the resolver pins the addresses it answers for an allowed name (`_pin`), before the answer leaves;
- `disconnect(slot)` at kill: the sets' elements and the pins go; once the link has died with the
  namespace, everything else of the sandbox's address goes too (conntrack entries, the resolver's work,
  its events read and handed on), so the slot's next sandbox never meets anything of this one's.
Events are handed to the tenant that held the slot when their connection started (`_owner_at`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import os
import re
import socket
import ssl
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import dns.exception
import dns.name

from agentcell import rootless
from agentcell.network import netns_files, usermode
from agentcell.network import uplink as uplinks
from agentcell.network.ask import DEFAULT_TIMEOUT_S, Answer, Asker, AskGate, Question, StandIns, is_stand_in
from agentcell.network.ca import EgressCA
from agentcell.network.claims import Claim
from agentcell.network.conntrack import ConntrackError, Flusher, netfilter_socket
from agentcell.network.flow_events import EventCollector
from agentcell.network.policy import NetworkPolicy, PolicyError, split_rules
from agentcell.network.proxy_process import ProxyProcess, Verdict
from agentcell.network.resolver import DomainRules, Pin, PolicyResolver, serve_tcp
from agentcell.network.router import (
    PIN_SET_SIZE,
    RESOLVER,
    EgressError,
    NeverList,
    Router,
    link_addresses,
    slot_of,
)
from agentcell.network.secrets import HeaderRule, SecretSet, host_matches
from agentcell.network.tunnel import EgressTunnel, check_address, forbidden_by
from agentcell.runtime import statedir

log = logging.getLogger("agentcell.egress")
T = TypeVar("T")
NETNS_PREFIX = "agentcell-"
CLOSED = NetworkPolicy()
NO_SECRETS = SecretSet()
LINK_GONE_TIMEOUT_S = 5.0  # at kill, how long the dead namespace's link may take to go before the flush
TENANCIES_KEPT = 4  # past owners of a slot whose late events can still be told apart (per slot)


@dataclass(frozen=True)
class EgressSettings:
    """`uplink`: "host" (masqueraded out of the host's interfaces), "netns:PATH" (into that
    namespace: a test's "internet", or an operator's own routing), "usermode" (slirp4netns: a
    rootless server's, network/usermode.py), or "none" (no sandbox has internet). `dns`: upstream resolvers for the sandboxes' resolver; empty = the host's
    /etc/resolv.conf, minus loopback stubs the router cannot reach."""

    uplink: str = "host"
    dns: tuple[str, ...] = ()
    ca_bundle: str | None = None  # extra CAs to trust for the hosts secrets go to (their real certificates)
    allow_ranges: tuple[str, ...] = ()  # never-list ranges the operator opens (an internal mirror ...)
    state_dir: str | None = None  # the server's --state-dir: its egress CA lives there (None: the user's default)
    plain_http_hosts: tuple[str, ...] = ()  # hosts whose secrets may go over plain HTTP (to answered addresses)
    proxy_ranges: tuple[str, ...] = ()  # never-list ranges a sandbox's SOCKS5 proxy may be in (tunnel.py)

    @property
    def enabled(self) -> bool:
        return self.uplink != "none"

    def check(self) -> None:
        if self.uplink not in ("host", "none", "usermode") and not self.uplink.startswith("netns:"):
            raise ValueError(f"egress uplink must be host, usermode, none or netns:PATH, got {self.uplink!r}")
        if self.uplink.startswith("netns:") and not os.path.exists(self.uplink[6:]):
            raise ValueError(f"egress uplink namespace {self.uplink[6:]} does not exist")


def host_resolvers(path: str = "/etc/resolv.conf") -> tuple[str, ...]:
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        return ()
    found = [m.group(1) for line in lines if (m := re.match(r"\s*nameserver\s+(\S+)", line))]
    return tuple(a for a in found if not a.startswith("127.") and a != "::1")


class Egress:
    def __init__(self, settings: EgressSettings, instance: str) -> None:
        self.settings = settings
        self.instance = instance
        self.router: Router | None = None
        self.uplink: uplinks.Uplink | usermode.SlirpUplink | None = None
        self.policies: dict[int, NetworkPolicy] = {}
        self._rules: dict[int, DomainRules | None] = {}
        self._pins: dict[int, dict[str, _Pinned]] = {}  # slot -> address -> what its resolver answered
        self.resolver: PolicyResolver | None = None  # once started
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None
        self._tenancies: dict[int, deque[_Tenancy]] = {}  # slot -> who held it when (events go by time)
        self._flusher: Flusher | None = None
        # where connection and DNS events go, by sandbox id (slots are reused): the server's behaviour
        # record (issue 10) once the backend attached it; nowhere without one (--no-record)
        self.sink: Callable[[str, dict[str, object]], None] = lambda owner, event: None
        self._collector: EventCollector | None = None
        self.proxy: ProxyProcess | None = None  # the egress proxy's process (proxy_process.py)
        self._secrets: dict[int, SecretSet] = {}
        # the CA is this server's own: another server on the host (another --state-dir) has its own
        ca_dir = (statedir.owned_dir(os.path.join(settings.state_dir, "egress-ca")) if settings.state_dir
                  else statedir.private_dir(statedir.default_state_dir("egress-ca")))
        self.ca = EgressCA.load_or_create(ca_dir)
        self.ca_path = os.path.join(ca_dir, "ca.pem")
        self._locks: dict[int, asyncio.Lock] = {}
        # network ask (ask.py): which slots ask, the decisions under way, what approvals remembered, and
        # the stand-in addresses the resolver answered for names to be asked about
        self.ask = AskGate(self._remember)
        self._effective: dict[int, NetworkPolicy] = {}  # the policy plus what approvals remembered
        self._askable: dict[int, DomainRules] = {}  # slots that ask: the names they may ask about (not denied)
        self._stand_ins: dict[int, StandIns] = {}
        self._remembered: dict[int, tuple[set[str], set[str]]] = {}  # slot -> (names, addresses) approved

    # -- the router ---------------------------------------------------------------------------

    @staticmethod
    def remove_stale(alive: Callable[[str], bool]) -> list[str]:
        """Router namespaces (and host uplink tables) of servers that are gone."""
        gone = []
        for name in sorted(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else []:
            if name.startswith(NETNS_PREFIX) and not alive(name[len(NETNS_PREFIX):]):
                Router(name).destroy()
                uplinks.remove_stale(name[len(NETNS_PREFIX):])
                gone.append(name)
        uplinks.sweep_forwarding()  # forwarding back off if only dead servers had turned it on
        return gone

    async def start(self) -> None:
        self.never = NeverList(self.settings.allow_ranges)
        # where a sandbox's network.egressProxy may be (tunnel.py): the never-list's ceiling, with what the
        # operator opened for everyone and for proxies only
        self.proxy_ranges = (*self.settings.allow_ranges, *self.settings.proxy_ranges)
        try:
            self.proxy_never = NeverList(self.proxy_ranges)
        except EgressError as e:  # (NeverList names only the first flag)
            raise EgressError(str(e).replace("--egress-allow-range", "--egress-proxy-range", 1)) from None
        if self.settings.uplink == "usermode":  # a rootless server: its namespace where host root's are not
            netns_dir = statedir.private_dir(rootless.netns_dir())
            stale = netns_files.remove_stale(netns_dir, NETNS_PREFIX)  # files of this user's servers that died
            if stale:
                log.info("removed the network namespace files of dead rootless server(s): %s", ", ".join(stale))
            router = await asyncio.to_thread(Router.create, NETNS_PREFIX + self.instance, self.never, netns_dir)
        else:
            router = await asyncio.to_thread(Router.create, NETNS_PREFIX + self.instance, self.never)
        self.router = router
        try:
            if self.settings.uplink == "usermode":
                self.uplink = await asyncio.to_thread(usermode.SlirpUplink, router)
            elif self.settings.uplink == "host":
                # (the host's table lets the router reach the proxies' ranges too: the router's own forward
                # chain keeps sandboxes out of them, tunnel.py)
                self.uplink = await asyncio.to_thread(uplinks.attach_host, router, self.instance, self.proxy_never)
            else:
                self.uplink = await asyncio.to_thread(uplinks.attach_netns, router, self.settings.uplink[6:],
                                                      self.instance)
            upstream = (self.settings.dns or host_resolvers() or ("",))[0]
            if not upstream:
                log.warning("no upstream DNS server (pass --egress-dns): sandboxes' names will not resolve")
            resolver = self.resolver = PolicyResolver((upstream, 53), self._rules_for, self._pin, self._socket,
                                                      on_refused=self._refused, never_list=self.never,
                                                      on_answered=self._answered, stand_in=self._stand_in)
            loop = asyncio.get_running_loop()
            udp = await self._in_router(lambda: _bound(socket.SOCK_DGRAM))
            self._udp, _ = await loop.create_datagram_endpoint(lambda: resolver, sock=udp)
            tcp = await self._in_router(lambda: _bound(socket.SOCK_STREAM))
            self._tcp = await serve_tcp(resolver, sock=tcp)
            self._collector = EventCollector(self._on_event)
            self._collector.start(router.path, loop)
            self._flusher = Flusher(await self._in_router(netfilter_socket))
            if self.settings.ca_bundle:  # said now, not by a child that cannot start
                ssl.create_default_context().load_verify_locations(self.settings.ca_bundle)
            self.proxy = ProxyProcess({"router": router.path, "ca_dir": os.path.dirname(self.ca_path),
                                       "ca_bundle": self.settings.ca_bundle,
                                       "tunnel": {"dns": upstream, "ranges": list(self.proxy_ranges)}},
                                      self.decide, self._proxy_event)
            await self.proxy.start()
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        self.ask.close()
        if self.proxy is not None:
            await self.proxy.close()
            self.proxy = None
        if self._collector is not None:
            self._collector.close()
            self._collector = None
        if self._flusher is not None:
            self._flusher.close()
            self._flusher = None
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
        if self.uplink is not None:
            await asyncio.to_thread(self.uplink.close)
            self.uplink = None
        if self.router is not None:
            await asyncio.to_thread(self.router.destroy)
            self.router = None

    async def _in_router(self, fn: Callable[[], T]) -> T:
        assert self.router is not None
        return await asyncio.wrap_future(self.router.worker.submit(fn))

    async def _nft(self, commands: str) -> None:
        assert self.router is not None
        worker = self.router.worker
        await self._in_router(lambda: worker.run_nft(commands))

    async def _socket(self, family: int, kind: int) -> socket.socket:
        return await self._in_router(lambda: socket.socket(family, kind))

    # -- sandboxes ----------------------------------------------------------------------------

    async def connect(self, slot: int, pid: int) -> None:
        """The standby's link, closed until its claim."""
        assert self.router is not None
        await asyncio.to_thread(self.router.connect, slot, f"/proc/{pid}/ns/net")
        await self.apply(slot, CLOSED)

    async def connect_tap(self, slot: int) -> int:
        """A VM's link (Router.connect_tap), closed until its claim: the fd of its TAP device."""
        assert self.router is not None
        fd = await asyncio.to_thread(self.router.connect_tap, slot)
        try:
            await self.apply(slot, CLOSED)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _lock(self, slot: int) -> asyncio.Lock:
        """One change at a time per slot: a policy and the pins of an answer found under the one before
        must not cross (the answer's name is checked again, under the lock, against the policy in force)."""
        return self._locks.setdefault(slot, asyncio.Lock())

    async def apply(self, slot: int, policy: NetworkPolicy, sandbox_id: str | None = None,
                    secrets: SecretSet | None = None, rules: tuple[HeaderRule, ...] | None = None,
                    tunnel: EgressTunnel | None = None) -> None:
        """Replace the sandbox's way out; pins of names the new policy still allows stay. A claim
        names the sandbox the slot now serves (its events are kept under that id) and its secrets
        (and its SOCKS5 proxy, `secrets.tunnel`); an update (`rules` given) replaces the rules and the
        proxy (`tunnel`, None: none)."""
        async with self._lock(slot):
            await self._apply(slot, policy, sandbox_id, secrets, rules, tunnel)

    async def check_tunnel(self, tunnel: EgressTunnel) -> None:
        """TunnelConfigError unless the proxy's address is within the operator's ceiling (tunnel.py)."""
        await check_address(tunnel, self._proxy_answers, forbidden_by(self.proxy_never))

    async def _proxy_answers(self, name: str) -> list[str]:
        if self.resolver is None:
            raise EgressError("the egress is not started")
        return await self.resolver.answers(name)

    async def _apply(self, slot: int, policy: NetworkPolicy, sandbox_id: str | None,
                     secrets: SecretSet | None, rules: tuple[HeaderRule, ...] | None,
                     tunnel: EgressTunnel | None = None) -> None:
        assert self.router is not None
        if sandbox_id is not None:
            self._claimed(slot, sandbox_id)
        if secrets is not None:
            self._secrets[slot] = secrets
        if rules is not None:  # update_network: E2B's rules and proxy replaced, the secrets kept
            self._secrets[slot] = dataclasses.replace(self._secrets.get(slot, NO_SECRETS), rules=rules, tunnel=tunnel)
        asking = self.ask.enabled(slot) and policy.internet and policy.restricted
        effective = self._with_remembered(slot, policy) if asking else policy
        names = effective.names_allowed()
        rules = DomainRules(*names) if names is not None else None
        now = time.monotonic()
        pins: dict[str, _Pinned] = {}  # what the new policy still allows of the old answers
        if rules is not None:
            for address, pinned in self._pins.get(slot, {}).items():
                names = {n for n in pinned.names if rules.allows(dns.name.from_text(n))}
                if names and pinned.expires > now + 1:
                    pins[address] = _Pinned(names, pinned.last if pinned.last in names else min(names), pinned.expires)
        kept = [(a, int(p.expires - now)) for a, p in pins.items()] if policy.restricted else []
        name_rules = bool(policy.allow_domains or policy.deny_domains)
        tunneled = self._secrets.get(slot, NO_SECRETS).tunnel is not None
        intercept = name_rules or self._secrets.get(slot, NO_SECRETS).inspects or asking or tunneled
        owner = self._owner_now(slot)
        if intercept and owner is not None and self.proxy is not None:
            # before the router sends it anything: the proxy knows the sandbox before its first connection
            self.proxy.set_slot(slot, owner, self._secrets.get(slot, NO_SECRETS), name_rules,
                                self.ask.timeout(slot) if asking else 0.0)
        commands = self.router.policy_commands(slot, effective, kept, intercept=intercept, ask=asking, tunnel=tunneled)
        if commands:
            await self._nft(commands)
        self.router.committed(slot)
        self.policies[slot] = policy
        self._effective[slot] = effective
        self._rules[slot] = rules
        self._pins[slot] = pins
        if asking:  # every name but a denied one may be asked about (the resolver answers a stand-in)
            self._askable[slot] = DomainRules((), effective.deny_domains)
        else:
            self._askable.pop(slot, None)

    async def disconnect(self, slot: int) -> None:
        async with self._lock(slot):
            await self._disconnect(slot)
        self._locks.pop(slot, None)

    async def _disconnect(self, slot: int) -> None:
        assert self.router is not None
        self.ask.forget(slot)  # its held connections are refused, the asker's tasks cancelled
        self.policies.pop(slot, None)
        self._effective.pop(slot, None)
        self._rules.pop(slot, None)
        self._askable.pop(slot, None)
        self._stand_ins.pop(slot, None)
        self._remembered.pop(slot, None)
        self._secrets.pop(slot, None)
        if self.proxy is not None:  # its intercepted connections end with it, before the slot serves another
            self.proxy.forget(slot)
        try:
            commands = self.router.disconnect_commands(slot)
            if commands:
                await self._nft(commands)
            self.router.committed(slot)
        except EgressError as e:
            log.warning("could not remove the egress rules of slot %d: %s", slot, e)
        await self._forget_address(slot)
        self._pins.pop(slot, None)  # (after: the last events still get their domains)
        self._released(slot)

    async def _forget_address(self, slot: int) -> None:
        """Everything of the slot's address that outlives its sandbox, gone before the slot is reused:
        its conntrack entries (a peer that keeps sending keeps a UDP entry, and its way back to this
        address, alive for ever), the resolver's queries and TCP clients, and the events still queued
        (read now, while they are still this tenant's)."""
        _, address = link_addresses(slot)
        await self._link_gone(slot)  # no packet of the dead sandbox can come in after this
        if self._flusher is not None:
            try:
                await asyncio.to_thread(self._flusher.flush, address)
            except (ConntrackError, OSError) as e:
                log.warning("could not flush the connections of slot %d (%s): %s", slot, address, e)
        if self._collector is not None:
            await self._collector.drain()
        if self.resolver is not None:
            self.resolver.forget(address)

    async def _link_gone(self, slot: int) -> None:
        """Wait (bounded) until the router's end of the slot's link is gone: it goes when the kernel
        has torn the dead sandbox's namespace down, a little after its last process exited."""
        name = f"s{slot}"

        def present() -> bool:
            try:
                socket.if_nametoindex(name)
            except OSError:
                return False
            return True

        deadline = time.monotonic() + LINK_GONE_TIMEOUT_S
        delay = 0.002
        while await self._in_router(present):
            if time.monotonic() > deadline:
                log.warning("the link of slot %d is still there %g s after its sandbox died; flushing anyway",
                            slot, LINK_GONE_TIMEOUT_S)
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.05)

    # -- who held a slot when ---------------------------------------------------------------------

    def _claimed(self, slot: int, sandbox_id: str) -> None:
        tenancies = self._tenancies.setdefault(slot, deque(maxlen=TENANCIES_KEPT))
        if not tenancies or tenancies[-1].owner != sandbox_id or tenancies[-1].until is not None:
            tenancies.append(_Tenancy(sandbox_id, time.time()))
        if self.resolver is not None:
            self.resolver.admit(link_addresses(slot)[1])

    def _released(self, slot: int) -> None:
        tenancies = self._tenancies.get(slot)
        if tenancies and tenancies[-1].until is None:
            tenancies[-1].until = time.time()

    def _owner_now(self, slot: int) -> str | None:
        """The sandbox the slot serves now (None: a standby, or nobody)."""
        tenancies = self._tenancies.get(slot)
        return tenancies[-1].owner if tenancies and tenancies[-1].until is None else None

    def _owner_at(self, slot: int, when: float) -> str | None:
        """The sandbox that held `slot` at unix time `when` (None: a standby, or nobody)."""
        for t in reversed(self._tenancies.get(slot, ())):
            if t.since <= when and (t.until is None or when < t.until):
                return t.owner
        return None

    # -- the proxy's decision ---------------------------------------------------------------------

    def decide(self, slot: int, address: str, port: int, claim: Claim) -> Verdict | Awaitable[Verdict]:
        """The proxy's question about one connection: may it go on (and the rule that decided), may
        plain HTTP on it carry the secrets of the host it names (only to a host the operator marked
        plain-HTTP, at an address the sandbox's resolver answered for that host), and the address to
        connect to instead of its own (a stand-in's: its name's, ask.py). For a sandbox in ask mode, a
        connection the lists do not allow but that may be asked about gets an awaitable: the answer
        once the decision came."""
        if is_stand_in(address):
            return self._stand_in_verdict(slot, address, port, claim)
        if claim.kind == "none" and self._secrets.get(slot, NO_SECRETS).tunnel is not None:
            allowed, rule = self._check_tunneled(slot, address)  # (what the router forwards, were it not tunneled)
        else:
            allowed, rule = self.check_claim(slot, address, port, claim)
        if not allowed:
            asked = self._question(slot, address, port, claim)
            if asked is not None:
                return self._asked_verdict(slot, asked)
        return allowed, rule, allowed and claim.kind == "http" and self._plain_ok(slot, address, claim.host), None

    async def _asked_verdict(self, slot: int, question: Question) -> Verdict:
        answer: Answer = await self.ask.ask(slot, question)
        return answer.allowed, answer.rule, False, None  # an asked host's secrets never go over plain HTTP

    def _question(self, slot: int, address: str, port: int, claim: Claim) -> Question | None:
        """What to ask about a connection to a real address the lists refused, or None when it may not be
        asked about: the sandbox does not ask, the address is on the never-list or denied, or the
        connection names a host (a name is asked about through its stand-in, never at an address the
        sandbox found by itself: an approval must not send a name's bytes where the name never led)."""
        policy, owner = self._effective.get(slot), self._owner_now(slot)
        if owner is None or policy is None or slot not in self._askable:
            return None
        ip = ipaddress.ip_address(address)
        if ip in self.never or any(ip in net for net in policy.deny_nets):
            return None
        if claim.host is not None and claim.host != address:
            return None
        return Question(owner, None, address, port)

    def _stand_in_verdict(self, slot: int, address: str, port: int, claim: Claim) -> Verdict | Awaitable[Verdict]:
        """A connection to a stand-in address: to the name it stands for, once allowed (asked about, or
        allowed already: remembered since, or on the allow list), at an address the name resolves to now."""
        stand_ins, owner = self._stand_ins.get(slot), self._owner_now(slot)
        name = stand_ins.name_of(address) if stand_ins is not None else None
        if name is None or owner is None:
            return False, "policy", False, None
        if claim.host is not None and claim.host not in (name, address):
            return False, "host-mismatch", False, None  # names another host than the one it stands for
        rules, askable = self._rules.get(slot), self._askable.get(slot)
        if rules is not None and rules.allows(dns.name.from_text(name)):
            return self._resolved(slot, name, (True, "domain", False, None))
        if askable is None or not askable.allows(dns.name.from_text(name)):
            return False, "domain", False, None  # denied, or the sandbox no longer asks
        return self._asked_name(slot, Question(owner, name, None, port))

    async def _asked_name(self, slot: int, question: Question) -> Verdict:
        answer: Answer = await self.ask.ask(slot, question)
        if not answer.allowed:
            return False, answer.rule, False, None
        assert question.host is not None
        return await self._resolved(slot, question.host, (True, answer.rule, False, None), "ask:unresolved")

    async def _resolved(self, slot: int, name: str, verdict: Verdict, unresolved: str = "unresolved") -> Verdict:
        """`verdict` with the address `name` resolves to now (never-list and denied addresses left out),
        or a refusal (rule `unresolved`) when it resolves to none of those."""
        policy = self._effective.get(slot)
        try:
            found = await self.resolver.lookup(name) if self.resolver is not None else []
        except (dns.exception.DNSException, OSError, TimeoutError) as e:
            log.info("resolving %s for slot %d failed: %s", name, slot, e)
            found = []
        usable = [a for a in found if policy is not None
                  and not any(ipaddress.ip_address(a) in net for net in policy.deny_nets)]
        if not usable:
            return False, unresolved, False, None
        return verdict[0], verdict[1], verdict[2], usable[0]

    async def _remember(self, slot: int, question: Question) -> None:
        """An approval that says remember: the host (its name, or the address when it has none) joins
        the slot's allowed set: the resolver answers the name for real from now on (and pins its
        addresses, as an allowed name's), an address is allowed as such."""
        async with self._lock(slot):
            if self._owner_now(slot) != question.owner or slot not in self.policies:
                return  # the sandbox is gone
            names, addresses = self._remembered.setdefault(slot, (set(), set()))
            if question.host is not None:
                names.add(question.host)
            elif question.address is not None:
                addresses.add(question.address)
            await self._apply(slot, self.policies[slot], None, None, None)

    def _with_remembered(self, slot: int, policy: NetworkPolicy) -> NetworkPolicy:
        names, addresses = self._remembered.get(slot, (set(), set()))
        if not names and not addresses:
            return policy
        return dataclasses.replace(
            policy, allow_domains=policy.allow_domains + tuple(sorted(names - set(policy.allow_domains))),
            allow_nets=policy.allow_nets + tuple(ipaddress.ip_network(a) for a in sorted(addresses)))

    async def set_ask(self, slot: int, enabled: bool, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        """Network ask on or off for the sandbox on `slot` (its policy's `network.default == "ask"`), and
        how long a held connection waits for a decision (then it is refused). Applies to new connections
        at once. Off: connections held now still get their decision; approvals remembered are kept for
        the sandbox's life but only open anything while it asks. Before or after the claim's apply (a
        standby's closed policy asks nothing); at kill, disconnect turns it off."""
        async with self._lock(slot):
            self.ask.configure(slot, enabled, timeout_s)
            if slot in self.policies:
                await self._apply(slot, self.policies[slot], None, None, None)

    def set_asker(self, asker: Asker | None) -> None:
        """Who decides: `asker(sandbox_id, host, address, port)` -> (allow, remember), awaited on the
        server's loop; None: every held connection is refused (rule ask:no-asker)."""
        self.ask.set_asker(asker)

    def slot_serving(self, sandbox_id: str) -> int | None:
        """The slot whose link the sandbox uses now (None: not connected here)."""
        for slot, tenancies in self._tenancies.items():
            if tenancies and tenancies[-1].owner == sandbox_id and tenancies[-1].until is None:
                return slot
        return None

    def ask_stats(self) -> dict[str, int]:
        """Counts of held connections' outcomes (approved, remembered, denied, timeout, flood, ...)."""
        return dict(self.ask.counts)

    def _plain_ok(self, slot: int, address: str, host: str | None) -> bool:
        if not host or not any(host_matches(host, h) for h in self.settings.plain_http_hosts):
            return False
        pinned = self._pins.get(slot, {}).get(address)
        return pinned is not None and host in pinned.names and pinned.expires > time.monotonic()

    def _address_refusal(self, policy: NetworkPolicy | None, address: str) -> str | None:
        """The rule that refuses `address` before any name is looked at (as the router's forward chain
        would: a closed policy, the never-list, the deny list), or None."""
        if policy is None or not policy.open:
            return "policy"
        ip = ipaddress.ip_address(address)
        if ip in self.never:
            return "never4"
        if any(ip in net for net in policy.deny_nets):
            return "deny"
        return None

    def _check_tunneled(self, slot: int, address: str) -> tuple[bool, str]:
        """A tunneled connection that names no host: allowed as the router's forward chain would allow it
        (the never-list, the deny list, and under an allow list an allowed or answered address)."""
        policy = self._effective.get(slot)
        if (refusal := self._address_refusal(policy, address)) is not None:
            return False, refusal
        assert policy is not None
        if not policy.restricted or any(ipaddress.ip_address(address) in net for net in policy.allow_nets):
            return True, "policy"
        pinned = self._pins.get(slot, {}).get(address)
        if pinned is not None and pinned.expires > time.monotonic():
            return True, "domain"
        return False, "policy"

    def check_claim(self, slot: int, address: str, port: int, claim: Claim) -> tuple[bool, str]:
        """Whether an intercepted connection to address:port that names `claim` may go on, and the rule
        that decided. It never crossed the router's forward chain, so the address rules apply here too."""
        policy, rules = self._effective.get(slot), self._rules.get(slot)
        if (refusal := self._address_refusal(policy, address)) is not None:
            return False, refusal
        assert policy is not None
        ip = ipaddress.ip_address(address)
        name = dns.name.from_text(claim.host) if claim.host else None
        if name is not None and rules is not None and any(r.matches(name) for r in rules.deny):
            return False, "domain"  # a denied name, wherever it is
        if not policy.restricted or any(ip in net for net in policy.allow_nets):
            return True, "policy"  # an address allowed as such: any name but a denied one
        if name is not None and (rules is None or not rules.allows(name)):
            return False, "domain"
        if name is None:
            return False, "no-host"  # an allow list of names: the connection must name one
        pinned = self._pins.get(slot, {}).get(address)
        if pinned is None or claim.host not in pinned.names or pinned.expires <= time.monotonic():
            return False, "host-mismatch"  # a name this address was not answered for
        return True, "domain"

    # -- events -------------------------------------------------------------------------------------

    def event_stats(self) -> dict[str, int]:
        """The connection-event collector's counts (flow_events.EventCollector.stats: lost_conntrack,
        lost_nflog, ...); empty before start."""
        return dict(self._collector.stats) if self._collector is not None else {}

    def _proxy_event(self, owner: str, event: dict[str, object]) -> None:
        """An event of the proxy's, for the sandbox the connection's slot served when it began."""
        kind = event.pop("kind", None) or ("net.deny" if event.get("verdict") == "denied" else "net.connect")
        if event.get("stand_in") and not event.get("domain"):  # a held connection that named no host: the
            slot = self.slot_serving(owner)                    # name its stand-in stands for
            stand_ins = self._stand_ins.get(slot) if slot is not None else None
            event["domain"] = stand_ins.name_of(str(event["stand_in"])) if stand_ins is not None else None
        self.sink(owner, {"kind": kind, "source": "host", "pid": None, "ppid": None, **event})

    def _on_event(self, slot: int, event: dict[str, object]) -> None:
        # the tenant that held the slot when the connection started (a closed event's conntrack entry
        # says when; other events are of the moment they were read or made), never the slot's owner now:
        # an event read late must not land in the record of the slot's next sandbox
        when = event.get("start") or event.get("time")
        owner = self._owner_at(slot, when if isinstance(when, (int, float)) else time.time())
        if owner is None:
            return  # a standby's (it runs nothing of a tenant's) or a slot already given back
        pinned = self._pins.get(slot, {}).get(str(event.get("dst"))) if owner == self._owner_now(slot) else None
        if pinned is not None:
            event = {**event, "domain": pinned.last}
        kind = "net.deny" if event.get("verdict") == "denied" else "net.connect"
        self.sink(owner, {"kind": kind, "source": "host", "pid": None, "ppid": None, **event})

    def _dns_event(self, source: str, **fields: object) -> None:
        slot = slot_of(source)
        owner = self._owner_now(slot) if slot is not None else None
        if owner is not None:
            self.sink(owner, {"time": time.time(), "kind": "dns.query", "source": "host", "pid": None, "ppid": None,
                              "proto": "dns", **fields})

    def _refused(self, source: str, name: str) -> None:
        self._dns_event(source, domain=name, verdict="denied", rule="domain", state="denied")

    def _answered(self, source: str, name: str, rdtype: str, addresses: list[str], rcode: str) -> None:
        self._dns_event(source, domain=name, type=rdtype, answers=addresses, rcode=rcode, verdict="allowed",
                        state="answered")

    # -- the resolver's callbacks ---------------------------------------------------------------

    def _rules_for(self, source: str) -> DomainRules | None:
        slot = slot_of(source)
        return None if slot is None else self._rules.get(slot)

    def _stand_in(self, source: str, name: str, for_a: bool) -> str | None:
        """For the resolver, a name the sandbox's rules refuse: a stand-in address when the sandbox asks
        and the name is not denied (ask.py; "": no records, for a query of another type), else None
        (refused)."""
        slot = slot_of(source)
        askable = self._askable.get(slot) if slot is not None else None
        if slot is None or askable is None or not _host_name(name) or not askable.allows(dns.name.from_text(name)):
            return None  # (a stand-in only for a host name: what an approval may remember as a rule)
        if not for_a:
            return ""
        address = self._stand_ins.setdefault(slot, StandIns()).address_for(name)
        self._dns_event(source, domain=name, answers=[address], verdict="held", rule="ask", state="stand-in")
        return address

    async def _pin(self, source: str, pins: list[Pin]) -> None:
        slot = slot_of(source)
        if slot is None:
            raise EgressError(f"{source} is no sandbox")
        async with self._lock(slot):
            await self._pin_locked(slot, source, pins)

    async def _pin_locked(self, slot: int, source: str, pins: list[Pin]) -> None:
        policy, rules = self._effective.get(slot), self._rules.get(slot)
        if policy is None or not policy.open or rules is None:
            raise EgressError(f"{source} has no way out to pin anything for")
        if not all(rules.allows(dns.name.from_text(name)) for _, _, name in pins):
            raise EgressError(f"{source}'s policy changed while its answer was on its way")
        table = self._pins.setdefault(slot, {})
        now = time.monotonic()
        if len(table) + len(pins) > PIN_SET_SIZE:
            for address in [a for a, p in table.items() if p.expires <= now]:
                del table[address]
        fresh = []
        for address, seconds, name in pins:
            if len(table) >= PIN_SET_SIZE and str(address) not in table:
                raise EgressError(f"slot {slot} has {PIN_SET_SIZE} addresses pinned already")
            pinned = table.setdefault(str(address), _Pinned(set(), name, 0.0))
            pinned.names.add(name.lower())
            pinned.last, pinned.expires = name.lower(), max(pinned.expires, now + seconds)
            fresh.append((str(address), seconds))
        if policy.restricted:  # an open policy reaches every public address anyway
            assert self.router is not None
            await self._nft(Router.pin_commands(slot, fresh))
            self.router.pinned(slot, (a for a, _ in fresh))


def _host_name(name: str) -> bool:
    """Whether `name` is a host name a policy could name (no wildcard, no address, no `_` labels)."""
    try:
        nets, domains = split_rules([name], "name")
    except PolicyError:
        return False
    return not nets and not domains[0].startswith("*.")


@dataclass
class _Tenancy:
    """One sandbox's time on a slot (unix times; `until` None while it still holds it)."""

    owner: str
    since: float
    until: float | None = None


@dataclass
class _Pinned:
    """An address the sandbox's resolver answered: for which names, the latest one, until when."""

    names: set[str]
    last: str
    expires: float  # time.monotonic()


def _bound(kind: int) -> socket.socket:
    """The resolver's socket on RESOLVER:53, made in the router's namespace (the worker's thread)."""
    sock = socket.socket(socket.AF_INET, kind)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((RESOLVER, 53))
    if kind == socket.SOCK_STREAM:
        sock.listen(128)
    sock.setblocking(False)
    return sock
