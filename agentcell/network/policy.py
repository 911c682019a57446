"""A sandbox's way out, as E2B's API states it, turned into rules any backend can enforce.

E2B's create body has `allow_internet_access` and `network.allowOut` / `network.denyOut`, lists of
CIDRs, IPs and domain names (`*.` wildcards). What they mean here (docs/network.md):
- no internet: nothing leaves the sandbox;
- internet, no allow list: every public address, minus the deny list;
- an allow list: only what it names (everything else is denied), minus the deny list. A deny entry
  that names everything (`0.0.0.0/0`, `::/0`: E2B's `ALL_TRAFFIC`) only says "nothing but the allow
  list", so E2B's idiom `deny_out=[ALL_TRAFFIC], allow_out=[...]` means what it means on E2B; any
  narrower deny wins over an allow that overlaps it;
- domains are enforced through the sandbox's resolver: it answers only allowed names, and only the
  addresses it answered for an allowed name are reachable (per sandbox, for the answer's TTL);
- whatever the lists say, private, loopback, link-local, CGNAT, multicast and metadata addresses are
  never reachable (the backend's never-list).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import dns.exception
import dns.name

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
ALL_TRAFFIC = "0.0.0.0/0"  # E2B's sentinel for "everything"
MAX_ENTRIES = 256  # per list: a policy is kernel state (nft set elements, ~150 bytes each) the host pays for
_LABEL = re.compile(r"^(?!-)[a-z0-9-]{1,63}(?<!-)$")


class PolicyError(ValueError):
    """A rule that is neither a CIDR, an IP address, nor a domain name; the message says which."""


def _everything(net: Network) -> bool:
    return net.prefixlen == 0


def _domain(text: str) -> str:
    """A domain rule in canonical form (lower case, IDNA, no trailing dot; `*.` kept), or PolicyError."""
    raw = text.strip().lower().rstrip(".")
    wildcard = raw.startswith("*.")
    try:
        name = dns.name.from_text(raw[2:] if wildcard else raw).to_text(omit_final_dot=True).lower()
    except (dns.exception.DNSException, UnicodeError, ValueError):
        name = ""
    labels = name.split(".")
    if not name or len(name) > 253 or not all(_LABEL.match(label) for label in labels):
        raise PolicyError(f"{text!r} is not a CIDR, an IP address or a domain name (wildcards: *.example.com)")
    if labels[-1].isdigit():
        raise PolicyError(f"{text!r} looks like an IP address but is not one")
    return f"*.{name}" if wildcard else name


def split_rules(entries: Iterable[str], field_name: str) -> tuple[tuple[Network, ...], tuple[str, ...]]:
    """(networks, domains) of one list, each entry checked."""
    nets: list[Network] = []
    domains: list[str] = []
    count = 0
    for entry in entries:
        count += 1
        if count > MAX_ENTRIES:
            raise PolicyError(f"'{field_name}' has more than {MAX_ENTRIES} entries")
        if not isinstance(entry, str) or not entry.strip():
            raise PolicyError(f"'{field_name}' entries must be non-empty strings, got {entry!r}")
        try:
            nets.append(ipaddress.ip_network(entry.strip(), strict=False))
            continue
        except ValueError:
            pass
        domains.append(_domain(entry))
    return tuple(nets), tuple(domains)


@dataclass(frozen=True)
class NetworkPolicy:
    """What one sandbox may reach. `allow_out`/`deny_out` keep the entries as the client gave them
    (get_info shows them back); the parsed forms drive enforcement."""

    internet: bool = False
    allow_out: tuple[str, ...] = ()
    deny_out: tuple[str, ...] = ()
    allow_nets: tuple[Network, ...] = field(default=(), repr=False)
    allow_domains: tuple[str, ...] = field(default=(), repr=False)
    deny_nets: tuple[Network, ...] = field(default=(), repr=False)
    deny_domains: tuple[str, ...] = field(default=(), repr=False)
    deny_all: bool = field(default=False, repr=False)  # deny_out named everything (ALL_TRAFFIC)

    @classmethod
    def parse(cls, internet: bool, allow_out: Iterable[str] = (), deny_out: Iterable[str] = ()) -> NetworkPolicy:
        allow_out, deny_out = tuple(allow_out), tuple(deny_out)
        allow_nets, allow_domains = split_rules(allow_out, "allowOut")
        deny_nets, deny_domains = split_rules(deny_out, "denyOut")
        deny_all = any(_everything(n) for n in deny_nets)
        return cls(internet, allow_out, deny_out, allow_nets, allow_domains,
                   tuple(n for n in deny_nets if not _everything(n)), deny_domains, deny_all)

    @property
    def open(self) -> bool:
        """Whether anything may leave at all."""
        return self.internet and (self.restricted is False or bool(self.allow_nets or self.allow_domains))

    @property
    def restricted(self) -> bool:
        """Only the allow list leaves (an allow list was given, or deny named everything)."""
        return bool(self.allow_out) or self.deny_all

    def names_allowed(self) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """(allow, deny) domain rules for the resolver, or None when it must answer nothing. With a
        restricted policy only allowed domains resolve: a query for any other name would itself carry
        data to that name's servers."""
        if not self.internet:
            return None
        if self.restricted:
            if not self.allow_domains:
                return None
            return self.allow_domains, self.deny_domains
        return (), self.deny_domains

    def info(self) -> dict[str, object]:
        """E2B's shape for get_info (`network` of the detail response)."""
        return {"allowOut": list(self.allow_out), "denyOut": list(self.deny_out)}
