"""The router's way to the internet: a veth into the host's namespace, masqueraded there, or into a
namespace an operator (or a test) names.

Host mode changes the host, so it changes as little as it can, all of it undone at close:
- a veth `acu<id>` with the host side of a /30 from 100.127.0.0/16;
- one nftables table `ip agentcell_<id>` that masquerades the router's address out of every other
  interface, drops anything arriving from the router that is not from its address, never lets the
  router reach the host itself (input), and, only when this server had to turn IPv4 forwarding on,
  forwards nothing that does not come from or go to the router;
- `net.ipv4.ip_forward=1` when it was 0 (restored at close).
The router's own rules (network/router.py) already stop every packet to a private, link-local or metadata
address, so the host only ever forwards sandbox traffic to public addresses.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import os
import subprocess
from dataclasses import dataclass

from agentcell.network import router as egress
from agentcell.network.router import EgressError, NeverList, Router, ip_in

UPLINK_NETS = ipaddress.IPv4Network("100.127.0.0/16")  # a /30 per server: router .1, the other side .2
FORWARD = "/proc/sys/net/ipv4/ip_forward"
STATE = "/run/agentcell"  # host mode: "forwarding was off" notes, for whoever cleans up after a dead server


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


@dataclass
class Uplink:
    mode: str  # "host" or "netns"
    peer_ifname: str
    net: ipaddress.IPv4Network
    table: str = ""
    forwarding_was: str | None = None  # host mode: ip_forward before we set it
    instance: str = ""

    def close(self) -> None:
        if self.mode != "host":
            return
        if self.table:
            try:
                egress.run_here(f"delete table ip {self.table}")
            except EgressError:
                pass
        if self.forwarding_was == "0":
            with open(FORWARD, "w") as f:
                f.write("0")
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_note(self.instance))
        subprocess.run(["ip", "link", "del", self.peer_ifname], capture_output=True, check=False)


def peer_name(instance: str) -> str:
    return "acu" + hashlib.sha256(instance.encode()).hexdigest()[:10]  # within IFNAMSIZ


def table_name(instance: str) -> str:
    return "agentcell_" + instance.replace("-", "_")


def _note(instance: str) -> str:
    return f"{STATE}/uplink-{instance}.forwarding-was-off"


def remove_stale(instance: str) -> None:
    """What a dead server's host uplink left (its veth died with its router namespace): its table,
    and forwarding if it had turned it on."""
    try:
        egress.run_here(f"delete table ip {table_name(instance)}")
    except EgressError:
        pass
    try:
        with open(_note(instance)) as f:
            netns = f.read().strip()
    except FileNotFoundError:
        return
    if netns == _this_netns():  # the note is about this host's namespace (not a test's stand-in)
        with open(FORWARD, "w") as f:
            f.write("0")
        os.unlink(_note(instance))


def _this_netns() -> str:
    return str(os.stat("/proc/self/ns/net").st_ino)


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
    uplink = Uplink("host", peer, net, instance=instance)
    try:
        r = subprocess.run(["ip", "-batch", "-"], input=f"addr add {net[2]}/30 dev {peer}\nlink set {peer} up\n",
                           text=True, capture_output=True, check=False)
        if r.returncode != 0:
            raise EgressError(f"configuring {peer} failed: {r.stderr.strip()}")
        with open(FORWARD) as f:
            uplink.forwarding_was = f.read().strip()
        uplink.table = table_name(instance)
        egress.run_here(host_ruleset(uplink.table, peer, str(net[1]), isolate=uplink.forwarding_was == "0",
                                     never=never or NeverList()))
        if uplink.forwarding_was == "0":
            os.makedirs(STATE, mode=0o700, exist_ok=True)
            with open(_note(instance), "w") as f:
                f.write(_this_netns())
            with open(FORWARD, "w") as f:
                f.write("1")
    except BaseException:
        uplink.close()
        raise
    return uplink


def host_ruleset(table: str, peer: str, router_address: str, isolate: bool, never: NeverList) -> str:
    isolation = f'iifname != "{peer}" oifname != "{peer}" drop' if isolate else ""
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
