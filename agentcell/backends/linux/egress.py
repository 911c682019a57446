"""The egress router: one network namespace per server, between its sandboxes and an uplink.

docs/network.md has the design; this module is its first building block (issue 7) and is not wired
into sandboxes yet: a sandbox still has loopback only. What it does now:

* `Router.create()` makes the router namespace (a named netns, /run/netns/<name>) with forwarding on
  and the base nftables ruleset: the input chain drops everything from sandboxes, the forward chain
  drops everything but sandbox -> uplink, and never forwards to the never-list (private, loopback,
  link-local, CGNAT, multicast, reserved, cloud metadata; IPv4 and IPv6).
* `attach_uplink()` links it to the namespace that stands for "the internet" (in tests, a namespace the
  test built on documentation ranges; the host's uplink is a later step, docs/network.md).
* `connect()` gives a sandbox's namespace a veth link to the router (eth0 there, `s<slot>` here) and a
  default route; `set_policy()` opens (or closes) its way out, with CIDR allow and deny lists.

Every command runs *inside* a namespace named by path: `ip` under `nsenter --net=PATH`, nftables
through libnftables in a thread that has setns()'d there. Nothing here runs in, or changes, the
namespace of the calling process (see docs/network.md: a netlink library that opens its socket
lazily acts in the caller's namespace; the tests check the host's links, addresses, routes and
ruleset are unchanged).
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import subprocess
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from agentcell.backends.linux import syscalls as sc

TABLE = "agentcell"
UPLINK = "up0"
LINK_NET = ipaddress.IPv4Network("10.77.0.0/16")  # a /30 per sandbox slot: router .1, sandbox .2
MAX_SLOTS = LINK_NET.num_addresses // 4

# Never forwarded, whatever a sandbox's policy says (operator exceptions come later, from config).
NEVER_V4 = (
    "0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
    "192.0.0.0/24", "192.168.0.0/16", "198.18.0.0/15", "224.0.0.0/3",
)
NEVER_V6 = (
    "::/127", "::ffff:0:0/96", "64:ff9b::/96", "64:ff9b:1::/48", "100::/64", "2001::/23", "2002::/16",
    "fc00::/7", "fe80::/10", "ff00::/8",
)


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

    def run(self, commands: str) -> str:
        """One transaction (all of `commands` or none), in the calling thread's network namespace."""
        lib = self.lib
        ctx = lib.nft_ctx_new(0)
        if not ctx:
            raise EgressError("nft_ctx_new failed")
        try:
            lib.nft_ctx_buffer_output(ctx)
            lib.nft_ctx_buffer_error(ctx)
            if lib.nft_run_cmd_from_buffer(ctx, commands.encode()) != 0:
                err = (lib.nft_ctx_get_error_buffer(ctx) or b"").decode(errors="replace").strip()
                raise EgressError(f"nftables refused the transaction: {err}")
            return (lib.nft_ctx_get_output_buffer(ctx) or b"").decode(errors="replace")
        finally:
            lib.nft_ctx_free(ctx)


_nft: _Nft | None = None


def nft_in(netns_path: str, commands: str) -> str:
    """Run an nftables transaction inside the network namespace at `netns_path`."""
    global _nft
    if _nft is None:
        _nft = _Nft()
    nft = _nft
    fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
    result: list[str] = []
    error: list[BaseException] = []

    def work() -> None:
        # This thread alone moves; it ends afterwards, so no other code ever runs in that namespace.
        try:
            sc.setns(fd, sc.CLONE_NEWNET)
            result.append(nft.run(commands))
        except BaseException as e:  # re-raised in the caller
            error.append(e)

    try:
        t = threading.Thread(target=work, name="agentcell-nft")
        t.start()
        t.join()
    finally:
        os.close(fd)
    if error:
        raise error[0]
    return result[0]


# --- ip(8), inside a namespace ----------------------------------------------------------------------


def ip_in(netns_path: str, commands: Iterable[str]) -> None:
    """Run `ip -batch` commands inside the network namespace at `netns_path` (one exec)."""
    batch = "\n".join(commands) + "\n"
    r = subprocess.run(["nsenter", f"--net={netns_path}", "ip", "-batch", "-"], input=batch, text=True,
                       capture_output=True, check=False)
    if r.returncode != 0:
        raise EgressError(f"ip in {netns_path} failed: {r.stderr.strip() or r.stdout.strip()}")


def _sysctl_in(netns_path: str, name: str, value: str) -> None:
    r = subprocess.run(["nsenter", f"--net={netns_path}", "sysctl", "-qw", f"{name}={value}"],
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise EgressError(f"sysctl {name} in {netns_path} failed: {r.stderr.strip()}")


# --- the router ------------------------------------------------------------------------------------------


def link_addresses(slot: int) -> tuple[str, str]:
    """(router side, sandbox side) of slot `slot`'s /30."""
    if not 0 <= slot < MAX_SLOTS:
        raise EgressError(f"slot {slot} is outside 0..{MAX_SLOTS - 1}")
    base = int(LINK_NET.network_address) + 4 * slot
    return str(ipaddress.IPv4Address(base + 1)), str(ipaddress.IPv4Address(base + 2))


@dataclass(frozen=True)
class Policy:
    """A sandbox's way out. `internet` False: nothing leaves. Else every public address, minus `deny`,
    and, when `allow` is given, only `allow` (the never-list applies first, whatever these say)."""

    internet: bool = False
    allow: Sequence[str] = field(default_factory=tuple)
    deny: Sequence[str] = field(default_factory=tuple)

    def networks(self) -> tuple[list[ipaddress.IPv4Network | ipaddress.IPv6Network], ...]:
        try:
            return ([ipaddress.ip_network(c, strict=False) for c in self.allow],
                    [ipaddress.ip_network(c, strict=False) for c in self.deny])
        except ValueError as e:
            raise EgressError(f"not a CIDR or IP address: {e}") from None


def _elements(nets: Iterable[ipaddress.IPv4Network | ipaddress.IPv6Network]) -> str:
    return ", ".join(str(n) for n in nets)


def base_ruleset() -> str:
    return f"""
table inet {TABLE} {{
  set never4 {{ type ipv4_addr; flags interval; elements = {{ {", ".join(NEVER_V4)} }} }}
  set never6 {{ type ipv6_addr; flags interval; elements = {{ {", ".join(NEVER_V6)} }} }}
  map links {{ type ifname : verdict; }}
  chain input {{
    type filter hook input priority filter; policy drop;
    iif "lo" accept
    iifname "{UPLINK}" ct state established,related accept
  }}
  chain forward {{
    type filter hook forward priority filter; policy drop;
    ct state established,related accept
    oifname != "{UPLINK}" drop
    ip daddr @never4 drop
    ip6 daddr @never6 drop
    iifname vmap @links
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    oifname "{UPLINK}" masquerade
  }}
}}
"""


class Router:
    def __init__(self, name: str) -> None:
        self.name = name
        self.path = f"/run/netns/{name}"

    @classmethod
    def create(cls, name: str) -> Router:
        """A fresh router namespace with the base ruleset (an existing one of that name is an error)."""
        if os.path.exists(f"/run/netns/{name}"):
            raise EgressError(f"network namespace {name} exists already (a server that did not clean up?)")
        r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise EgressError(f"ip netns add {name} failed: {r.stderr.strip()}")
        router = cls(name)
        try:
            ip_in(router.path, ["link set lo up"])
            _sysctl_in(router.path, "net.ipv4.ip_forward", "1")
            nft_in(router.path, base_ruleset())
        except BaseException:
            router.destroy()
            raise
        return router

    def destroy(self) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, check=False)

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
        ip_in(self.path, [
            f"link add {ifname} type veth peer name eth0 netns {_ns_arg(sandbox_netns_path)}",
            f"addr add {ours}/30 dev {ifname}",
            f"link set {ifname} up",
        ])
        ip_in(sandbox_netns_path, [
            f"addr add {theirs}/30 dev eth0",
            "link set eth0 up",
            f"route add default via {ours} dev eth0",
        ])

    def set_policy(self, slot: int, policy: Policy) -> None:
        """Replace the sandbox's way out in one transaction: new connections follow it at once;
        connections already established keep going."""
        allow, deny = policy.networks()
        chain, ifname = f"sbx_{slot}", f"s{slot}"
        cmds = [*_unlinked(slot), f"flush chain inet {TABLE} {chain}"]
        if policy.internet:
            for family, kind in (("ip", 4), ("ip6", 6)):
                d = [n for n in deny if n.version == kind]
                a = [n for n in allow if n.version == kind]
                if d:
                    cmds.append(f"add rule inet {TABLE} {chain} {family} daddr {{ {_elements(d)} }} drop")
                if a:
                    cmds.append(f"add rule inet {TABLE} {chain} {family} daddr {{ {_elements(a)} }} accept")
            if not allow:
                cmds.append(f"add rule inet {TABLE} {chain} accept")
            cmds.append(f'add element inet {TABLE} links {{ "{ifname}" : jump {chain} }}')
        nft_in(self.path, "\n".join(cmds))

    def disconnect(self, slot: int) -> None:
        """Forget a sandbox's policy (its link goes away with its namespace)."""
        nft_in(self.path, "\n".join([*_unlinked(slot), f"delete chain inet {TABLE} sbx_{slot}"]))
        if _link_exists(self.path, f"s{slot}"):
            ip_in(self.path, [f"link del s{slot}"])

    def ruleset(self) -> str:
        return nft_in(self.path, "list ruleset")


def _unlinked(slot: int) -> list[str]:
    """nft commands that leave the slot's chain in place and its link out of the `links` map (closed).
    Deleting a map element that is not there fails a transaction: it is added first, then deleted."""
    chain, ifname = f"sbx_{slot}", f"s{slot}"
    return [f"add chain inet {TABLE} {chain}",
            f'add element inet {TABLE} links {{ "{ifname}" : jump {chain} }}',
            f'delete element inet {TABLE} links {{ "{ifname}" }}']


def _ns_arg(netns_path: str) -> str:
    """How `ip ... netns X` names a namespace: a name under /run/netns, or a pid (/proc/<pid>/ns/net)."""
    if netns_path.startswith("/run/netns/"):
        return netns_path.removeprefix("/run/netns/")
    parts = netns_path.split("/")
    if len(parts) == 5 and parts[1] == "proc" and parts[2].isdigit() and parts[3:] == ["ns", "net"]:
        return parts[2]
    raise EgressError(f"cannot name the namespace {netns_path} to ip(8): use /run/netns/NAME or /proc/PID/ns/net")


def _link_exists(netns_path: str, ifname: str) -> bool:
    r = subprocess.run(["nsenter", f"--net={netns_path}", "ip", "link", "show", ifname], capture_output=True,
                       check=False)
    return r.returncode == 0
