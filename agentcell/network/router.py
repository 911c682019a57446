"""The egress router: one network namespace per server, between its sandboxes and an uplink.

docs/network.md has the design. What this module does:

* `Router.create()` makes the router namespace (a named netns, /run/netns/<name>) with forwarding on
  and the base nftables ruleset: a sandbox's packets must carry its own link's address (strict
  reverse-path check), reach the router itself only for DNS to `RESOLVER`, and are forwarded only to
  the uplink, never to the never-list (private, loopback, link-local, CGNAT, multicast, reserved,
  cloud metadata; IPv4 and IPv6), never as DNS/DoT/QUIC to anyone but the resolver.
* `attach_uplink()` links it to the namespace that stands for "the internet": the host's (masqueraded
  there, `network/uplink.py`) or a namespace an operator or a test names.
* `connect()` gives a sandbox's namespace a veth link to the router (eth0 there, `s<slot>` here) and a
  default route; `set_policy()` writes its way out (a `NetworkPolicy`) as elements of shared sets
  keyed by its link, and `pin_commands()` opens the addresses its resolver answered for an allowed
  name, for the answer's lifetime.

Every command runs *inside* a namespace named by path: `ip` under `nsenter --net=PATH`, nftables
through libnftables in a thread that lives in the router namespace (`NetnsWorker`). Nothing here runs
in, or changes, the namespace of the calling process (see docs/network.md: a netlink library that
opens its socket lazily acts in the caller's namespace; the tests check the host's links, addresses,
routes and ruleset are unchanged).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import ctypes
import ipaddress
import os
import queue
import re
import subprocess
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from agentcell.backends.linux import syscalls as sc
from agentcell.network import netns_files
from agentcell.network.ask import STAND_IN_NET
from agentcell.network.policy import Network, NetworkPolicy
from agentcell.network.proxy import FWMARK as PROXY_MARK
from agentcell.network.proxy import routing_commands as proxy_routing
from agentcell.network.proxy import tproxy_any_statement, tproxy_statement

TABLE = "agentcell"
UPLINK = "up0"
LINK_NET = ipaddress.IPv4Network("10.77.0.0/16")  # a /30 per sandbox slot: router .1, sandbox .2
MAX_SLOTS = LINK_NET.num_addresses // 4 - 1  # the last /30 holds the resolver's address
RESOLVER = "10.77.255.254"  # every sandbox's nameserver: one address on the router's lo, one resolv.conf
PIN_SET_SIZE = 512  # addresses one sandbox's allowed names may pin at once (the server enforces it)

# Never forwarded, whatever a sandbox's policy says.
NEVER_V4 = (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/3",
)
NEVER_V6 = (
    "::/127", "::ffff:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48", "100::/64", "2001::/23", "2002::/16",
    "fc00::/7", "fe80::/10", "ff00::/8",
)
# the links' own ranges (sandboxes, uplinks) and network ask's stand-in addresses: never exempt
RESERVED = ("10.77.0.0/16", "100.127.0.0/16", str(STAND_IN_NET))


class NeverList:
    """The never-list minus what the operator exempts (`--egress-allow-range`, e.g. an internal
    package mirror at 10.5.0.0/16). The same list drives the router, the resolver's rebinding filter
    and the proxy."""

    def __init__(self, exempt: Sequence[str] = ()) -> None:
        try:
            self.exempt = [ipaddress.ip_network(e, strict=False) for e in exempt]
        except ValueError as e:
            raise EgressError(f"--egress-allow-range: {e}") from None
        for net in self.exempt:
            clash = [r for r in RESERVED if net.overlaps(ipaddress.ip_network(r))]  # type: ignore[arg-type]
            if clash:
                raise EgressError(f"--egress-allow-range {net} overlaps agentcell's own links ({clash[0]})")
        self.v4 = self._minus([ipaddress.IPv4Network(n) for n in NEVER_V4], 4)
        self.v6 = self._minus([ipaddress.IPv6Network(n) for n in NEVER_V6], 6)

    def _minus(self, nets: list[Any], kind: int) -> list[Any]:
        for ex in (e for e in self.exempt if e.version == kind):
            out = []
            for net in nets:
                if ex.supernet_of(net):
                    continue
                if net.supernet_of(ex):
                    out += list(net.address_exclude(ex))
                else:
                    out.append(net)
            nets = out
        return list(ipaddress.collapse_addresses(nets))

    def __contains__(self, addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
            addr = addr.ipv4_mapped
        return any(addr in net for net in (self.v4 if addr.version == 4 else self.v6))


# Per sandbox: the router's connection-tracking table is the host's too, so one sandbox must not fill it.
MAX_CONNECTIONS = 1024  # open at once (opening or established; the kernel does not count closed ones)
NEW_PER_SECOND = 500  # new connections (and UDP flows) per second, burst twice that
OVER_MARK = 0x2  # a packet past either, marked to be logged and dropped (a meter lives in one rule only)

# Refusals become events (network/flow_events.py reads them): NFLOG group and the prefix naming the rule.
LOG_GROUP = 7
PREFIX = "acdeny:"  # PREFIX + rule name + " "
_RULE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,48}")

# Resolvers other than ours (DNS, DoT, DoQ) and QUIC: dropped for every sandbox. QUIC is UDP that the
# SNI/Host checks cannot read; clients fall back to TCP.
BLOCKED_UDP_PORTS = (53, 443, 853)
BLOCKED_TCP_PORTS = (53, 853)

T = TypeVar("T")


class EgressError(RuntimeError):
    """A router step failed; the message names the step and what the tool said."""


# --- nftables, in-process ------------------------------------------------------------------------------


class _Nft:
    """libnftables (Debian's libnftables1, from the nftables package) through ctypes."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libnftables.so.1")
        except OSError as e:
            raise EgressError("libnftables.so.1 is missing: install Debian's nftables package") from e
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_output_buffer.restype = ctypes.c_char_p
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        self.lib = lib

    def context(self) -> int:
        """A context: its netlink socket is opened now, in the calling thread's network namespace, and
        kept. (libnftables waits on it with select(), which aborts the process for an fd past 1,023:
        a context made early keeps a low fd however many sandboxes the server holds later.)"""
        ctx = self.lib.nft_ctx_new(0)
        if not ctx:
            raise EgressError("nft_ctx_new failed")
        self.lib.nft_ctx_buffer_output(ctx)
        self.lib.nft_ctx_buffer_error(ctx)
        return int(ctx)

    def free(self, ctx: int) -> None:
        self.lib.nft_ctx_free(ctx)

    def run(self, commands: str, ctx: int | None = None) -> str:
        """One transaction (all of `commands` or none), in the namespace of `ctx` (made by context()),
        or of the calling thread with a context of its own."""
        lib = self.lib
        own = ctx is None
        if ctx is None:
            ctx = self.context()
        try:
            if lib.nft_run_cmd_from_buffer(ctx, commands.encode()) != 0:
                err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace").strip()
                raise EgressError(f"nftables refused the transaction: {err}")
            return (lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
        finally:
            if own:
                lib.nft_ctx_free(ctx)


_nft: _Nft | None = None


def _lib() -> _Nft:
    global _nft
    if _nft is None:
        _nft = _Nft()
    return _nft


class NetnsWorker:
    """One thread that lives in a network namespace and runs what it is given there: nftables
    transactions, and creating sockets (a socket stays in the namespace it was made in, so the event
    loop can use it afterwards). Nothing else ever runs in that thread."""

    def __init__(self, netns_path: str) -> None:
        self.netns_path = netns_path
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], concurrent.futures.Future[Any]] | None] = (
            queue.SimpleQueue())
        fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
        entered: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._main, args=(fd, entered), name="agentcell-netns", daemon=True)
        self._thread.start()
        try:
            entered.result(timeout=10)
        finally:
            os.close(fd)

    def _main(self, fd: int, entered: concurrent.futures.Future[None]) -> None:
        try:
            sc.setns(fd, sc.CLONE_NEWNET)
        except BaseException as e:
            entered.set_exception(e)
            return
        try:
            self.ctx: int | None = _lib().context()  # this namespace's, with a low fd (see _Nft.context)
        except EgressError:
            self.ctx = None  # nftables missing: nft() says so when called
        entered.set_result(None)
        while (job := self._jobs.get()) is not None:
            fn, fut = job
            if fut.set_running_or_notify_cancel():
                try:
                    fut.set_result(fn())
                except BaseException as e:
                    fut.set_exception(e)
        if self.ctx is not None:
            _lib().free(self.ctx)

    def submit(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()
        if not self._thread.is_alive():
            fut.set_exception(EgressError(f"the worker for {self.netns_path} has stopped"))
        else:
            self._jobs.put((fn, fut))
        return fut

    def call(self, fn: Callable[[], T]) -> T:
        return self.submit(fn).result()

    def nft(self, commands: str) -> str:
        return self.call(lambda: self.run_nft(commands))

    def run_nft(self, commands: str) -> str:
        """nft(), for code already running in this worker's thread."""
        return _lib().run(commands, self.ctx)

    def stop(self) -> None:
        self._jobs.put(None)
        self._thread.join(timeout=5)


def run_here(commands: str) -> str:
    """An nftables transaction in the calling thread's own namespace (only the host uplink's table)."""
    return _lib().run(commands)


def call_in(netns_path: str, fn: Callable[[], T]) -> T:
    """Run `fn` inside the network namespace at `netns_path`, in a thread of its own that is gone
    afterwards (long-lived users keep a NetnsWorker): for making a socket there, or one transaction."""
    worker = NetnsWorker(netns_path)
    try:
        return worker.call(fn)
    finally:
        worker.stop()


def nft_in(netns_path: str, commands: str) -> str:
    """Run an nftables transaction inside the network namespace at `netns_path`."""
    return call_in(netns_path, lambda: _lib().run(commands))


# --- ip(8), inside a namespace ----------------------------------------------------------------------


def ip_in(netns_path: str, commands: Iterable[str]) -> None:
    """Run `ip -batch` commands inside the network namespace at `netns_path` (one exec)."""
    batch = "\n".join(commands) + "\n"
    r = subprocess.run(["nsenter", f"--net={netns_path}", "ip", "-batch", "-"], input=batch, text=True,
                       capture_output=True, check=False)
    if r.returncode != 0:
        raise EgressError(f"ip in {netns_path} failed: {r.stderr.strip() or r.stdout.strip()}")


def sysctl_in(netns_path: str, *settings: str) -> None:
    r = subprocess.run(["nsenter", f"--net={netns_path}", "sysctl", "-qw", *settings],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise EgressError(f"sysctl {' '.join(settings)} in {netns_path} failed: {r.stderr.strip()}")


# --- the router ------------------------------------------------------------------------------------------


def link_addresses(slot: int) -> tuple[str, str]:
    """(router side, sandbox side) of slot `slot`'s /30."""
    if not 0 <= slot < MAX_SLOTS:
        raise EgressError(f"slot {slot} is outside 0..{MAX_SLOTS - 1}")
    base = int(LINK_NET.network_address) + 4 * slot
    return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))


def slot_of(address: str) -> int | None:
    """The slot whose sandbox side is `address`, or None (the router side, the resolver, a stranger)."""
    try:
        ip = ipaddress.IPv4Address(address)
    except ValueError:
        return None
    if ip not in LINK_NET:
        return None
    offset = int(ip) - int(LINK_NET.network_address)
    slot, host = divmod(offset, 4)
    return slot if host == 2 and slot < MAX_SLOTS else None


def _ports(ports: Iterable[int]) -> str:
    return ", ".join(str(p) for p in ports)


def base_ruleset(never: NeverList | None = None) -> str:
    """The router's whole ruleset. A sandbox's policy is nothing but elements of the shared sets below,
    keyed by its link's name (`s<slot>`): a claim or an update changes elements only, which costs
    ~0.5 ms, where adding a rule or a chain costs ~12 ms (the kernel's commit waits for RCU)."""
    tproxy = tproxy_statement()
    held = tproxy_any_statement()
    never = never or NeverList()
    return f"""
table inet {TABLE} {{
  set never4 {{ type ipv4_addr; flags interval; elements = {{ {", ".join(map(str, never.v4))} }} }}
  set never6 {{ type ipv6_addr; flags interval; elements = {{ {", ".join(map(str, never.v6))} }} }}
  set open {{ type ifname; }}                 # internet, no allow list
  set restricted {{ type ifname; }}           # internet, only the allow list and pins
  set intercepted {{ type ifname; }}          # domain rules or secrets: ports 80/443 to the proxy
  set asking {{ type ifname; }}               # network ask: TCP to what the lists do not allow, held there
  set tunneled {{ type ifname; }}             # network.egressProxy: every TCP connection to the proxy (tunnel.py)
  set deny4 {{ type ifname . ipv4_addr; flags interval; }}
  set deny6 {{ type ifname . ipv6_addr; flags interval; }}
  set allow4 {{ type ifname . ipv4_addr; flags interval; }}
  set allow6 {{ type ifname . ipv6_addr; flags interval; }}
  set pins4 {{ type ifname . ipv4_addr; flags timeout; }}  # <= PIN_SET_SIZE per link, service.py
  set pins6 {{ type ifname . ipv6_addr; flags timeout; }}
  chain prerouting {{
    type filter hook prerouting priority raw; policy accept;
    iifname "s*" meta nfproto ipv6 drop
    iifname "s*" fib saddr . iif oif missing drop
  }}
  chain intercept {{
    type filter hook prerouting priority mangle; policy accept;
    iifname "s*" meta l4proto tcp socket transparent 1 socket wildcard 0 meta mark set {PROXY_MARK:#x} accept
    iifname "s*" ct state new meter acct_conns {{ iifname ct count over {MAX_CONNECTIONS} }} meta mark set {OVER_MARK:#x}
    iifname "s*" ct state new meta mark != {OVER_MARK:#x} meter acct_rate {{ iifname limit rate over {NEW_PER_SECOND}/second burst {NEW_PER_SECOND * 2} packets }} meta mark set {OVER_MARK:#x}
    {_logged(f"meta mark {OVER_MARK:#x}", "too-many-connections", "over")}
    iifname != @intercepted return
    iifname . ip daddr @deny4 return
    iifname @tunneled iifname @restricted iifname . ip daddr @allow4 {held}
    iifname @tunneled iifname @restricted iifname . ip daddr @pins4 {held}
    iifname @tunneled iifname @open ip daddr != @never4 {held}
    iifname @restricted iifname . ip daddr @allow4 {tproxy}
    iifname @restricted iifname . ip daddr @pins4 {tproxy}
    iifname @open ip daddr != @never4 {tproxy}
    iifname @asking iifname . ip daddr @allow4 return
    iifname @asking iifname . ip daddr @pins4 return
    iifname @asking ip daddr {STAND_IN_NET} {held}
    iifname @asking ip daddr != @never4 {held}
  }}
  chain input {{
    type filter hook input priority filter; policy drop;
    iif "lo" accept
    iifname "s*" meta mark {PROXY_MARK:#x} accept
    iifname "{UPLINK}" ct state established,related accept
    iifname "s*" ip daddr {RESOLVER} meta l4proto {{ udp, tcp }} th dport 53 accept
    iifname "s*" icmp type echo-request limit rate 10/second accept
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    {_logged('oifname != "' + UPLINK + '"', "not-uplink", "nup")}
    {_logged("ip daddr @never4", "never4", "never4")}
    {_logged("ip6 daddr @never6", "never6", "never6")}
    {_logged("udp dport { " + _ports(BLOCKED_UDP_PORTS) + " }", "dns-dot-quic", "udp")}
    {_logged("tcp dport { " + _ports(BLOCKED_TCP_PORTS) + " }", "dns-dot", "tcp")}
    {_logged("iifname . ip daddr @deny4", "deny", "deny4")}
    {_logged("iifname . ip6 daddr @deny6", "deny", "deny6")}
    {_logged("iifname @open meta l4proto udp", "udp", "openudp")}
    {_logged("iifname @tunneled iifname @open meta l4proto tcp", "tunnel-only", "tunopen")}
    {_logged("iifname @tunneled meta l4proto tcp iifname . ip daddr @allow4", "tunnel-only", "tunallow")}
    {_logged("iifname @tunneled meta l4proto tcp iifname . ip daddr @pins4", "tunnel-only", "tunpins")}
    iifname @open accept
    iifname @restricted iifname . ip daddr @allow4 accept
    iifname @restricted iifname . ip6 daddr @allow6 accept
    iifname @restricted iifname . ip daddr @pins4 accept
    iifname @restricted iifname . ip6 daddr @pins6 accept
    {deny_log("policy", meter="acdeny_policy")}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "{UPLINK}" masquerade
  }}
}}
"""


def deny_log(rule: str, group: int = LOG_GROUP, *, rate: int = 50, burst: int = 100,
             meter: str | None = None) -> str:
    """An nft statement fragment that logs a new connection attempt to NFLOG `group`, naming `rule`.

    Rate limited: `rate` per second with `burst`, over all sandboxes, or per ingress link (`iifname`)
    when `meter` names a meter (each meter name may appear in one rule only: nftables refuses a meter
    shared by two rules). The fragment has no verdict and must be a rule of its own before the rule
    that drops: a `limit` over its rate ends its rule, so a `drop` after it would be skipped."""
    if not _RULE_NAME.fullmatch(rule):
        raise ValueError(f"rule name {rule!r}: 1-48 of A-Z a-z 0-9 _ . : -")
    if not 0 <= group <= 65535 or rate <= 0 or burst <= 0:
        raise ValueError("group must be 0..65535, rate and burst positive")
    limit = f"limit rate {rate}/second burst {burst} packets"
    if meter is not None:
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]{0,30}", meter):
            raise ValueError(f"meter name {meter!r}")
        limit = f"meter {meter} size {MAX_SLOTS + 1} {{ iifname {limit} }}"
    return f'ct state new {limit} log prefix "{PREFIX}{rule} " group {group}'


def deny_rules(match: str, rule: str, group: int = LOG_GROUP, **limits: Any) -> list[str]:
    """The two rule bodies for a logged refusal: `<match> <deny_log>` then `<match> drop`."""
    return [f"{match} {deny_log(rule, group, **limits)}", f"{match} drop"]


def _logged(match: str, rule: str, meter: str) -> str:
    """`match` logged (an event, rate limited per link) and dropped: two rules, see flow_events.py."""
    log, drop = deny_rules(match, rule, meter=f"acdeny_{meter}")
    return f"{log}\n    {drop}"


def _collapsed(nets: Iterable[Network], kind: int) -> list[Network]:
    """The networks of one family, merged: an interval set refuses overlapping elements."""
    return list(ipaddress.collapse_addresses(n for n in nets if n.version == kind))  # type: ignore[arg-type]


class Router:
    def __init__(self, name: str, netns_dir: str = "/run/netns") -> None:
        self.name = name
        self.path = os.path.join(netns_dir, name)
        self._ip_netns = netns_dir == "/run/netns"  # else a bind mount of ours (a rootless server's)
        self._worker: NetnsWorker | None = None
        self._held = -1  # a rootless server's hold on its netns file (network/netns_files.py)
        # what each slot has in the shared sets (policy_commands plans, committed() records)
        self._elements: dict[int, list[tuple[str, str]]] = {}
        self._pinned: dict[int, set[str]] = {}
        self._pending: dict[int, list[tuple[str, str]]] = {}
        self._pending_pins: dict[int, set[str]] = {}

    @property
    def worker(self) -> NetnsWorker:
        if self._worker is None:
            self._worker = NetnsWorker(self.path)
        return self._worker

    @classmethod
    def create(cls, name: str, never: NeverList | None = None, netns_dir: str = "/run/netns") -> Router:
        """A fresh router namespace with the base ruleset (an existing one of that name is an error).
        `netns_dir` other than /run/netns: the namespace is bind-mounted on a file there, in this
        process's mount namespace (a rootless server's own: network/usermode.py)."""
        router = cls(name, netns_dir)
        if router._ip_netns:
            if os.path.exists(router.path):
                raise EgressError(f"network namespace {name} exists already (a server that did not clean up?)")
            r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, check=False)
        else:
            router._held = netns_files.claim(router.path)  # removed at a later start if this server dies
            r = subprocess.run(["unshare", f"--net={router.path}", "true"], capture_output=True, text=True,
                               check=False)
        if r.returncode != 0:
            raise EgressError(f"creating the network namespace {router.path} failed: {r.stderr.strip()}")
        try:
            # IPv6 off on every link the router gets: a sandbox has no IPv6 way out (docs/network.md).
            sysctl_in(router.path, "net.ipv4.ip_forward=1", "net.ipv6.conf.all.disable_ipv6=1",
                      "net.ipv6.conf.default.disable_ipv6=1")
            ip_in(router.path, ["link set lo up", f"addr add {RESOLVER}/32 dev lo", *proxy_routing()])
            # byte counts for the connection events; a closed connection's event comes 10 s after its
            # close rather than conntrack's default 120 s (late packets then meet the rules afresh)
            sysctl_in(router.path, "net.netfilter.nf_conntrack_acct=1", "net.netfilter.nf_conntrack_timestamp=1",
                      "net.netfilter.nf_conntrack_tcp_timeout_time_wait=10")
            router.nft(base_ruleset(never))
        except BaseException:
            router.destroy()
            raise
        return router

    def destroy(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        if self._ip_netns:
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)
        else:
            subprocess.run(["umount", "-l", self.path], capture_output=True, check=False)
            with contextlib.suppress(OSError):
                os.unlink(self.path)
            if self._held >= 0:
                os.close(self._held)
                self._held = -1

    def nft(self, commands: str) -> str:
        return self.worker.nft(commands)

    def attach_uplink(self, peer_netns_path: str, peer_ifname: str, address: str, gateway: str) -> None:
        """veth `up0` here (address `address`, e.g. "203.0.113.1/24", default route via `gateway`) <->
        `peer_ifname` in the namespace at `peer_netns_path`, which the caller configures."""
        ip_in(self.path, [
            f"link add {UPLINK} type veth peer name {peer_ifname} netns {_ns_arg(peer_netns_path)}",
            f"addr add {address} dev {UPLINK}",
            f"link set {UPLINK} up",
            f"route add default via {gateway} dev {UPLINK}",
        ])

    def connect(self, slot: int, sandbox_netns_path: str) -> None:
        """The sandbox's link: `s<slot>` here, `eth0` there, its default route via us. Its policy starts
        closed (no element in the policy map: the forward chain drops)."""
        ours, theirs = link_addresses(slot)
        ifname = f"s{slot}"
        add = [f"link add {ifname} type veth peer name eth0 netns {_ns_arg(sandbox_netns_path)}",
               f"addr add {ours}/30 dev {ifname}", f"link set {ifname} up"]
        try:
            ip_in(self.path, add)
        except EgressError as e:
            if "exists" not in str(e):
                raise
            # the link of the slot's previous sandbox, whose namespace the kernel is still tearing down
            ip_in(self.path, [f"link del {ifname}", *add])
        ip_in(sandbox_netns_path, [
            f"addr add {theirs}/30 dev eth0",
            "link set eth0 up",
            f"route add default via {ours} dev eth0",
        ])

    def connect_tap(self, slot: int) -> int:
        """A VM's link (the microvm backend): a TAP device `s<slot>` made here, in the router namespace,
        with the router's side of the slot's /30; the returned fd is its only other end (QEMU's NIC; the
        guest takes the sandbox side, guest.py). It goes away when the last fd to it closes, as a veth
        goes with its sandbox's namespace. A link of that name left over (the slot's previous VM, or one
        it made persistent: TUNSETPERSIST needs no capability) is deleted first."""
        ours, _ = link_addresses(slot)
        ifname = f"s{slot}"
        if _link_exists(self.path, ifname):
            ip_in(self.path, [f"link del {ifname}"])
        fd = self.worker.call(lambda: _open_tap(ifname))
        try:
            ip_in(self.path, [f"addr add {ours}/30 dev {ifname}", f"link set {ifname} up"])
        except BaseException:
            os.close(fd)
            raise
        return fd

    def policy_commands(self, slot: int, policy: NetworkPolicy, pins: Iterable[tuple[str, int]] = (),
                        intercept: bool = False, ask: bool = False, tunnel: bool = False) -> str:
        """The transaction that replaces slot `slot`'s way out with `policy`, keeping `pins`
        ((address, seconds left) the resolver answered for names the policy still allows); with
        `intercept`, its new connections to ports 80 and 443 go to the proxy (network/proxy.py); with
        `ask` (a restricted policy only), its new TCP connections to what the lists do not allow go
        there too, to wait for a decision (network/ask.py); with `tunnel`, every TCP connection the lists
        allow goes there (to be tunneled through the sandbox's SOCKS5 proxy, network/tunnel.py) and no TCP
        of its is ever forwarded.
        Elements only (see base_ruleset). Call `committed(slot, commands)` once it went through."""
        link = f'"s{slot}"'
        cmds = [*self._forget(slot)]
        elements: list[tuple[str, str]] = []
        ask = ask and policy.internet and policy.restricted
        if policy.open or ask:
            elements.append(("restricted" if policy.restricted else "open", link))
            if intercept or ask or tunnel:
                elements.append(("intercepted", link))
            if tunnel:
                elements.append(("tunneled", link))
            if ask:
                elements.append(("asking", link))
            for kind in (4, 6):
                for net in _collapsed(policy.deny_nets, kind):
                    elements.append((f"deny{kind}", f"{link} . {net}"))
                if policy.restricted:
                    for net in _collapsed(policy.allow_nets, kind):
                        elements.append((f"allow{kind}", f"{link} . {net}"))
        for set_name, key in elements:
            cmds.append(f"add element inet {TABLE} {set_name} {{ {key} }}")
        self._pending[slot] = elements
        pins = list(pins)
        if (policy.open or ask) and policy.restricted and pins:
            cmds.append(self.pin_commands(slot, pins))
        self._pending_pins[slot] = {a for a, _ in pins} if (policy.open or ask) and policy.restricted else set()
        return "\n".join(c for c in cmds if c)

    def committed(self, slot: int) -> None:
        """The last policy_commands of `slot` went through: remember what is in the kernel now."""
        self._elements[slot] = self._pending.pop(slot, [])
        self._pinned[slot] = self._pending_pins.pop(slot, set())

    def pinned(self, slot: int, addresses: Iterable[str]) -> None:
        """pin_commands for `addresses` went through."""
        self._pinned.setdefault(slot, set()).update(addresses)

    def _forget(self, slot: int) -> list[str]:
        """Commands that take every element of `slot` out of the shared sets. One that is gone already
        (a pin that expired) would fail the transaction, so each is added, then deleted."""
        cmds = []
        link = f'"s{slot}"'
        gone = [*self._elements.get(slot, []),
                *((f"pins{ipaddress.ip_address(a).version}", f"{link} . {a}") for a in self._pinned.get(slot, ()))]
        for set_name, key in gone:
            cmds += [f"add element inet {TABLE} {set_name} {{ {key} }}",
                     f"delete element inet {TABLE} {set_name} {{ {key} }}"]
        return cmds

    def set_policy(self, slot: int, policy: NetworkPolicy, pins: Iterable[tuple[str, int]] = (),
                   intercept: bool = False, tunnel: bool = False) -> None:
        """Replace the sandbox's way out in one transaction: new connections follow it at once;
        connections already established keep going."""
        self.nft(self.policy_commands(slot, policy, pins, intercept, tunnel=tunnel))
        self.committed(slot)

    @staticmethod
    def pin_commands(slot: int, pins: Iterable[tuple[str, int]]) -> str:
        """Open (address, seconds) for slot `slot`. An element already there would keep its old
        timeout, so each is added, deleted and added again with the new one."""
        cmds = []
        for address, seconds in pins:
            kind = ipaddress.ip_address(address).version
            target, key = f"inet {TABLE} pins{kind}", f'"s{slot}" . {address}'
            cmds += [f"add element {target} {{ {key} }}", f"delete element {target} {{ {key} }}",
                     f"add element {target} {{ {key} timeout {max(1, int(seconds))}s }}"]
        return "\n".join(cmds)

    def disconnect_commands(self, slot: int) -> str:
        """Forget a sandbox's policy and pins (its link goes away with its namespace)."""
        self._pending[slot], self._pending_pins[slot] = [], set()
        return "\n".join(self._forget(slot))

    def disconnect(self, slot: int) -> None:
        commands = self.disconnect_commands(slot)
        if commands:
            self.nft(commands)
        self.committed(slot)



TUNSETIFF = 0x400454CA
IFF_TAP, IFF_NO_PI = 0x0002, 0x1000


def _open_tap(ifname: str) -> int:
    """A TAP device named `ifname` in the calling thread's network namespace; its fd (close-on-exec,
    handed to a VMM by pass_fds)."""
    import fcntl
    import struct

    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", ifname.encode(), IFF_TAP | IFF_NO_PI))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _link_exists(netns_path: str, ifname: str) -> bool:
    r = subprocess.run(["nsenter", f"--net={netns_path}", "ip", "link", "show", "dev", ifname],
                       capture_output=True, check=False)
    return r.returncode == 0


def _ns_arg(netns_path: str) -> str:
    """How `ip ... netns X` names a namespace: a name under /run/netns, or a pid (/proc/<pid>/ns/net)."""
    if netns_path.startswith("/run/netns/"):
        return netns_path.removeprefix("/run/netns/")
    parts = netns_path.split("/")
    if len(parts) == 5 and parts[1] == "proc" and parts[2].isdigit() and parts[3:] == ["ns", "net"]:
        return parts[2]
    raise EgressError(f"cannot name the namespace {netns_path} to ip(8): use /run/netns/NAME or /proc/PID/ns/net")
