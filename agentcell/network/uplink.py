"""The router's way to the internet: a veth into the host's namespace, masqueraded there, or into a
namespace an operator (or a test) names.

Host mode changes the host, so it changes as little as it can, all of it undone at close:
- a veth `acu<id>` with the host side of a /30 from 100.127.0.0/16;
- one nftables table `ip agentcell_<id>` that masquerades the router's address out of every other
  interface, drops anything arriving from the router that is not from its address, never lets the
  router reach the host itself (input), and, when IPv4 forwarding was off before any agentcell server
  turned it on, forwards nothing that does not come from or go to an agentcell uplink (`acu*`: every
  server's, so that one server's table never cuts another's sandboxes off);
- `net.ipv4.ip_forward=1` when it was 0. Several servers may rely on it at once, so it is a shared host
  setting (backends/linux/host_settings.py): the first server saves the original, the last one to stop
  puts it back, and a server that finds only dead holders (crashed servers) puts it back at its start.
The router's own rules (network/router.py) already stop every packet to a private, link-local or metadata
address, so the host only ever forwards sandbox traffic to public addresses.
"""

from __future__ import annotations

import hashlib
import ipaddress
import os
import subprocess
from dataclasses import dataclass

from agentcell.backends.linux import host_settings
from agentcell.network import router as egress
from agentcell.network.router import EgressError, NeverList, Router, ip_in

UPLINK_NETS = ipaddress.IPv4Network("100.127.0.0/16")  # a /30 per server: router .1, the other side .2
PEER_PREFIX = "acu"  # every server's host side of its uplink: acu<hash of its instance>


def _addresses_in_use() -> str:
    return subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True, check=False).stdout


def pick_net(instance: str, in_use: str) -> ipaddress.IPv4Network:
    """A /30 for this server, derived from its instance id, not one the other side already has."""
    subnets = UPLINK_NETS.num_addresses // 4
    start = int.from_bytes(hashlib.sha256(instance.encode()).digest()[:4], "big") % subnets
    for i in range(subnets):
        net = ipaddress.IPv4Network((int(UPLINK_NETS.network_address) + 4 * ((start + i) % subnets), 30))
        if f" {net[1]}/" not in in_use and f" {net[2]}/" not in in_use:
            return net
    raise EgressError(f"no free /30 in {UPLINK_NETS} for the egress uplink")


def forwarding() -> host_settings.Setting:
    """IPv4 forwarding of this process's network namespace (the host's, or a test's stand-in for it)."""
    return host_settings.sysctl("net.ipv4.ip_forward", host_settings.netns_key("net.ipv4.ip_forward"))


@dataclass
class Uplink:
    mode: str  # "host" or "netns"
    peer_ifname: str
    net: ipaddress.IPv4Network
    table: str = ""
    forwarding_was: str | None = None  # host mode: ip_forward before any agentcell server set it
    holder: host_settings.Holder | None = None  # host mode: this server's hold on ip_forward

    def close(self) -> None:
        if self.mode != "host":
            return
        if self.holder is not None:  # forwarding back off first (if this server was its last user) ...
            self.holder.close()
            self.holder = None
        if self.table:  # ... then the table that kept other forwarding out while it was on
            try:
                egress.run_here(f"delete table ip {self.table}")
            except EgressError:
                pass
        subprocess.run(["ip", "link", "del", self.peer_ifname], capture_output=True, check=False)


def peer_name(instance: str) -> str:
    return PEER_PREFIX + hashlib.sha256(instance.encode()).hexdigest()[:10]  # within IFNAMSIZ


def table_name(instance: str) -> str:
    return "agentcell_" + instance.replace("-", "_")


def remove_stale(instance: str) -> None:
    """What a dead server's host uplink left (its veth died with its router namespace): its table.
    (Forwarding goes back off in `sweep_forwarding` once no live server holds it.)"""
    try:
        egress.run_here(f"delete table ip {table_name(instance)}")
    except EgressError:
        pass


def sweep_forwarding() -> bool:
    """Put IPv4 forwarding back as it was if every server that turned it on here is dead; True if so."""
    return host_settings.sweep(forwarding())


def attach_netns(router: Router, peer_netns_path: str, instance: str) -> Uplink:
    """veth from the router into the namespace at `peer_netns_path`: the router's default route goes
    there, masqueraded as the router's side of the /30. The namespace routes the rest (a test's
    "internet" answers on its own addresses)."""
    peer = peer_name(instance)
    in_use = subprocess.run(["nsenter", f"--net={peer_netns_path}", "ip", "-o", "addr"], capture_output=True,
                            text=True, check=False).stdout
    net = pick_net(instance, in_use)
    router.attach_uplink(peer_netns_path, peer, f"{net[1]}/30", str(net[2]))
    ip_in(peer_netns_path, [f"addr add {net[2]}/30 dev {peer}", f"link set {peer} up"])
    return Uplink("netns", peer, net)


def attach_host(router: Router, instance: str, never: NeverList | None = None) -> Uplink:
    """veth from the router into this process's namespace (the host), masqueraded out of the host's
    own interfaces. See the module's docstring for everything it changes."""
    peer = peer_name(instance)
    here = f"/proc/{os.getpid()}/ns/net"
    net = pick_net(instance, _addresses_in_use())
    router.attach_uplink(here, peer, f"{net[1]}/30", str(net[2]))
    uplink = Uplink("host", peer, net)
    try:
        r = subprocess.run(["ip", "-batch", "-"], input=f"addr add {net[2]}/30 dev {peer}\nlink set {peer} up\n",
                           text=True, capture_output=True, check=False)
        if r.returncode != 0:
            raise EgressError(f"configuring {peer} failed: {r.stderr.strip()}")
        uplink.table = table_name(instance)

        def turn_on(original: str, holders: host_settings.Holders) -> None:
            # the table first: forwarding is never on without it. Whether to isolate is the original's
            # call (not what this server found: another server may have turned forwarding on already)
            egress.run_here(host_ruleset(uplink.table, peer, str(net[1]), isolate=original == "0",
                                         never=never or NeverList()))
            if original == "0":
                host_settings.write_sysctl("net.ipv4.ip_forward", "1")

        uplink.holder = host_settings.Holder(instance)
        uplink.forwarding_was = uplink.holder.hold(forwarding(), turn_on)
    except BaseException:
        uplink.close()
        raise
    return uplink


def host_ruleset(table: str, peer: str, router_address: str, isolate: bool, never: NeverList) -> str:
    # while agentcell keeps forwarding on for its uplinks, nothing else of the host is forwarded; every
    # server's uplink (acu*) passes every server's table, so one server's table never drops another's
    isolation = f'iifname != "{PEER_PREFIX}*" oifname != "{PEER_PREFIX}*" drop' if isolate else ""
    return f"""
table ip {table} {{
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{peer}" ct state established,related accept
    iifname "{peer}" drop
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{peer}" ip saddr != {router_address} drop
    iifname "{peer}" ip daddr {{ {", ".join(map(str, never.v4))} }} drop
    {isolation}
  }}
  chain postrouting {{
    type nat hook postrouting priority srcnat; policy accept;
    ip saddr {router_address} oifname != "{peer}" masquerade
  }}
}}
"""
