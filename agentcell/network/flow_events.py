"""Connection events from the egress router (issue 7): one event per connection attempt, kept per sandbox.

Two kernel sources, both read from netlink sockets that live in the router namespace (made by a thread
that has setns()'d there; a socket stays in the namespace it was created in, so the event loop then
reads it from anywhere, as docs/network.md describes for the DNS and proxy sockets):

* **conntrack events** (ctnetlink, groups NFNLGRP_CONNTRACK_NEW and _DESTROY): a connection the router
  forwarded. NEW -> `{"state": "open", "verdict": "allowed"}`; DESTROY -> `{"state": "closed"}` with the
  bytes each way (L3 bytes, IP headers included). Counters need `nf_conntrack_acct=1` in the router
  namespace (`enable_accounting()`). Only connections whose original source is a sandbox's address
  (10.77.x.2 of its /30) are reported. The kernel reports a TCP connection's DESTROY only when its
  conntrack entry goes away, i.e. after TIME_WAIT (120 s by default; `enable_accounting(tcp_time_wait=)`).
* **NFLOG** (nfnetlink_log, one group): a denied attempt. nftables rules log it with the fragment from
  `deny_log(rule)`; the rule's name travels in the log prefix and comes back as the event's `rule`.

The nft fragment is rate limited (`limit rate ...`), and a `limit` that is over its rate *ends the
rule there*: whatever follows it in the same rule does not run. So the fragment must be a rule of its
own, without a verdict, placed just before the rule that drops (`deny_rules()` returns the pair):

    ip daddr @never4 ct state new limit rate 50/second burst 100 packets log prefix "acdeny:never4 " group 7
    ip daddr @never4 drop

It matches `ct state new` only, so an attempt is logged once (its first packet; a TCP SYN the sandbox
retransmits is a new attempt to the kernel and logged again, within the rate).

Splicing into network/router.py's ruleset (checked with `nft -c` on nftables 1.0.6; the never4 and sbx_<slot>
forms are in tests/test_egress_events.py with real traffic). In the shared forward chain, give each
logging rule its own meter (`deny_log(rule, meter="acdeny_never4")`) so the budget is per ingress link
and one sandbox's flood cannot hide its neighbours' refusals; in a sandbox's own sbx_<slot> chain a
plain limit is per sandbox already:

    chain forward {
      type filter hook forward priority filter; policy drop;
      ct state established,related accept
      oifname != "up0" <deny_log("not-uplink", meter="acdeny_nup")>
      oifname != "up0" drop
      ip daddr @never4 <deny_log("never4", meter="acdeny_never4")>
      ip daddr @never4 drop
      ip6 daddr @never6 <deny_log("never6", meter="acdeny_never6")>
      ip6 daddr @never6 drop
      iifname vmap @links
      <deny_log("policy", meter="acdeny_policy")>     # a closed link, or an allow list that missed
    }
    chain sbx_<slot> {                                 # Router.set_policy's deny rules
      ip daddr { ... } <deny_log("deny")>
      ip daddr { ... } drop
      ...
    }

A meter name may be used by one rule only; `flush chain` and re-adding the same meter in one
transaction works (Router.set_policy's pattern).

Wiring (the integrator's part): after `Router.create()`, `enable_accounting(router.path)`; then
`EventCollector(event_log.add).start(router.path, loop)` on the server's loop, and `event_log.close(slot
or sandbox id)` when a sandbox goes. Slots are reused, so the server should map slot -> sandbox id in
its callback rather than keep events under the slot.

Attribution. A denied packet belongs to the link it came in on (NFLOG's indev, `s<slot>`). A conntrack
event has no interface, so it belongs to the sandbox whose address is its source; the router drops a
packet whose source is not its link's own (network/router.py: a strict reverse-path check in prerouting),
so a sandbox cannot put events into a neighbour's log.

Slots are reused, so an event is the tenant's that held the slot when its connection started, not the
slot owner's when the event is read (network/service.py `_owner_at`: a DESTROY carries its entry's start
timestamp; other events are of their packet or of the moment they are read). Before a slot is given to
another sandbox its address's conntrack entries are flushed (network/conntrack.py) and `drain()` reads
what the kernel has queued, the flush's DESTROY events among them.

`EventCollector` ties the two readers to an asyncio loop; the events go to the server's behaviour
record (record/store.py), which keeps them per sandbox, bounded.

Nothing here uses pyroute2 (its sockets open lazily in the caller's namespace) or touches the calling
process's own namespace.
"""

from __future__ import annotations

import asyncio
import errno
import fcntl
import ipaddress
import os
import re
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from agentcell.network.router import (
    LOG_GROUP,
    MAX_SLOTS,
    PREFIX,
    call_in,
    deny_log,
    deny_rules,
    slot_of,
    sysctl_in,
)

__all__ = ["EventCollector", "EventsError", "deny_log", "deny_rules", "enable_accounting", "slot_of"]


# --- netlink constants (linux/netlink.h, linux/netfilter/nfnetlink*.h) ----------------------------------

NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP = 1
SO_RCVBUFFORCE = 33
NLMSG_ERROR, NLMSG_DONE, NLMSG_OVERRUN = 2, 3, 4
NLM_F_REQUEST, NLM_F_ACK, NLM_F_EXCL, NLM_F_CREATE = 0x1, 0x4, 0x200, 0x400
NLA_F_NESTED = 0x8000
NLA_TYPE_MASK = 0x3FFF  # strips NLA_F_NESTED and NLA_F_NET_BYTEORDER

NFNL_SUBSYS_CTNETLINK = 1
NFNL_SUBSYS_ULOG = 4
IPCTNL_MSG_CT_NEW, IPCTNL_MSG_CT_GET, IPCTNL_MSG_CT_DELETE = 0, 1, 2
NFNLGRP_CONNTRACK_NEW, NFNLGRP_CONNTRACK_UPDATE, NFNLGRP_CONNTRACK_DESTROY = 1, 2, 3

CTA_TUPLE_ORIG, CTA_TIMEOUT, CTA_COUNTERS_ORIG, CTA_COUNTERS_REPLY, CTA_ID, CTA_TIMESTAMP = 1, 7, 9, 10, 12, 20
CTA_TUPLE_IP, CTA_TUPLE_PROTO = 1, 2
CTA_IP_V4_SRC, CTA_IP_V4_DST, CTA_IP_V6_SRC, CTA_IP_V6_DST = 1, 2, 3, 4
CTA_PROTO_NUM, CTA_PROTO_SRC_PORT, CTA_PROTO_DST_PORT = 1, 2, 3
CTA_COUNTERS_PACKETS, CTA_COUNTERS_BYTES = 1, 2
CTA_TIMESTAMP_START, CTA_TIMESTAMP_STOP = 1, 2

NFULNL_MSG_PACKET, NFULNL_MSG_CONFIG = 0, 1
NFULA_CFG_CMD, NFULA_CFG_MODE, NFULA_CFG_NLBUFSIZ, NFULA_CFG_TIMEOUT, NFULA_CFG_QTHRESH = 1, 2, 3, 4, 5
NFULNL_CFG_CMD_BIND = 1
NFULNL_COPY_PACKET = 2
NFULA_PACKET_HDR, NFULA_TIMESTAMP, NFULA_IFINDEX_INDEV, NFULA_PAYLOAD, NFULA_PREFIX = 1, 3, 4, 9, 10

COPY_RANGE = 96  # enough for an IPv4 header with options or an IPv6 header, plus the L4 ports
RCVBUF = 4 << 20
PROBE_MAX = 300  # s: a connection whose conntrack timeout is at most this gets a reap probe (see EventCollector)
MAX_PROBES = 65536
SIOCGIFNAME = 0x8910
PROTOS = {1: "icmp", 6: "tcp", 17: "udp", 58: "icmpv6", 132: "sctp", 136: "udplite"}
_RULE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,48}")


class EventsError(RuntimeError):
    """Setting up an event source failed; the message names the step."""


# --- sysctls -----------------------------------------------------------------------------------------


def enable_accounting(netns_path: str, *, timestamps: bool = True, tcp_time_wait: int | None = None) -> None:
    """Per-namespace sysctls the events need, set inside the namespace at `netns_path`:
    `net.netfilter.nf_conntrack_acct=1` (byte counters), `nf_conntrack_timestamp=1` (start/stop
    times) and, if given, `nf_conntrack_tcp_timeout_time_wait` (how long after a TCP close the DESTROY
    event comes; the kernel default is 120 s). Router.create sets them for the server's router."""
    values = ["net.netfilter.nf_conntrack_acct=1"]
    if timestamps:
        values.append("net.netfilter.nf_conntrack_timestamp=1")
    if tcp_time_wait is not None:
        values.append(f"net.netfilter.nf_conntrack_tcp_timeout_time_wait={int(tcp_time_wait)}")
    sysctl_in(netns_path, *values)


def _netlink_socket(groups: tuple[int, ...] = ()) -> socket.socket:
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)
    try:
        try:
            s.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RCVBUF)
        except OSError:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        s.bind((0, 0))
        for g in groups:
            s.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, g)
    except BaseException:
        s.close()
        raise
    return s


def ctnetlink_socket(netns_path: str, *, updates: bool = True) -> socket.socket:
    """A NETLINK_NETFILTER socket in the namespace at `netns_path`, subscribed to conntrack NEW and
    DESTROY events (and UPDATE, used for the reap probes). Blocking; the caller may set it non-blocking."""
    groups = (NFNLGRP_CONNTRACK_NEW, NFNLGRP_CONNTRACK_DESTROY, *((NFNLGRP_CONNTRACK_UPDATE,) if updates else ()))
    return call_in(netns_path, lambda: _netlink_socket(groups))


def nflog_socket(netns_path: str, group: int = LOG_GROUP, copy_range: int = COPY_RANGE) -> socket.socket:
    """A NETLINK_NETFILTER socket in the namespace at `netns_path`, bound to NFLOG `group` (packet
    copies of `copy_range` bytes, each packet delivered at once). One socket per group and namespace:
    a second bind fails (the kernel says EPERM; raised as EventsError "bound by another socket")."""
    s = call_in(netns_path, _netlink_socket)
    try:
        _nflog_config(s, group, [
            _attr(NFULA_CFG_CMD, struct.pack("B", NFULNL_CFG_CMD_BIND)),
            _attr(NFULA_CFG_MODE, struct.pack(">IBB", copy_range, NFULNL_COPY_PACKET, 0)),
            _attr(NFULA_CFG_QTHRESH, struct.pack(">I", 1)),
            _attr(NFULA_CFG_TIMEOUT, struct.pack(">I", 1)),  # 1/100 s
        ])
    except BaseException:
        s.close()
        raise
    return s


def _attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def _nflog_config(s: socket.socket, group: int, attrs: list[bytes]) -> None:
    """Send one NFULNL_MSG_CONFIG per attribute (the bind first) and wait for each one's ack."""
    for seq, attr in enumerate(attrs, start=1):
        body = struct.pack("!BBH", socket.AF_UNSPEC, 0, group) + attr
        msg = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_CONFIG,
                          NLM_F_REQUEST | NLM_F_ACK, seq, 0) + body
        s.send(msg)
        s.settimeout(2.0)
        try:
            while True:
                data = s.recv(65536)
                done = False
                for kind, _flags, mseq, payload in _messages(data):
                    if kind == NLMSG_ERROR and mseq == seq:
                        code = -struct.unpack_from("=i", payload)[0]
                        if code == errno.EPERM and seq == 1:
                            raise EventsError(f"NFLOG group {group} is bound by another socket in this namespace")
                        if code:
                            raise EventsError(f"NFLOG group {group} config step {seq}: {os.strerror(code)}")
                        done = True
                if done:
                    break
        finally:
            s.settimeout(None)


# --- parsing -------------------------------------------------------------------------------------------


def _messages(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, seq, payload) of each netlink message in one datagram."""
    out = []
    off = 0
    while off + 16 <= len(data):
        length, kind, flags, seq, _pid = struct.unpack_from("=IHHII", data, off)
        if length < 16 or off + length > len(data):
            break
        out.append((kind, flags, seq, data[off + 16:off + length]))
        off += (length + 3) & ~3
    return out


def _attrs(data: bytes, off: int = 0) -> dict[int, bytes]:
    """Netlink attributes from `off` on, by type (flags stripped; the last one of a type wins)."""
    out: dict[int, bytes] = {}
    while off + 4 <= len(data):
        length, kind = struct.unpack_from("=HH", data, off)
        if length < 4 or off + length > len(data):
            break
        out[kind & NLA_TYPE_MASK] = data[off + 4:off + length]
        off += (length + 3) & ~3
    return out


def _ip(raw: bytes | None) -> str | None:
    if raw is None or len(raw) not in (4, 16):
        return None
    return str(ipaddress.ip_address(raw))


def parse_conntrack(kind: int, flags: int, payload: bytes) -> dict[str, Any] | None:
    """One ctnetlink event message -> a dict with the original tuple, counters and state, or None for a
    message that is not a conntrack event or entry. Keys: src, dst, sport, dport, proto, id, state
    ("open" for a NEW event, "update", "closed" for DESTROY), bytes_out, bytes_in, packets_out,
    packets_in, start, stop (unix seconds or None), timeout (s left, None in DESTROY), family and
    tuple (the raw CTA_TUPLE_ORIG attribute, to ask for this entry again)."""
    if kind >> 8 != NFNL_SUBSYS_CTNETLINK or len(payload) < 4:
        return None
    msg = kind & 0xFF
    if msg == IPCTNL_MSG_CT_NEW:
        state = "open" if flags & NLM_F_CREATE else "update"
    elif msg == IPCTNL_MSG_CT_DELETE:
        state = "closed"
    else:
        return None
    top = _attrs(payload, 4)
    tuple_ = _attrs(top.get(CTA_TUPLE_ORIG, b""))
    ipa = _attrs(tuple_.get(CTA_TUPLE_IP, b""))
    proto = _attrs(tuple_.get(CTA_TUPLE_PROTO, b""))
    num = proto.get(CTA_PROTO_NUM)
    pnum = num[0] if num else None

    def port(kind: int) -> int | None:
        raw = proto.get(kind)
        return struct.unpack(">H", raw[:2])[0] if raw and len(raw) >= 2 else None

    def counters(kind: int) -> tuple[int, int]:
        c = _attrs(top.get(kind, b""))
        b, p = c.get(CTA_COUNTERS_BYTES), c.get(CTA_COUNTERS_PACKETS)
        return (struct.unpack(">Q", b[:8])[0] if b and len(b) >= 8 else 0,
                struct.unpack(">Q", p[:8])[0] if p and len(p) >= 8 else 0)

    ts = _attrs(top.get(CTA_TIMESTAMP, b""))

    def stamp(kind: int) -> float | None:
        raw = ts.get(kind)
        return struct.unpack(">Q", raw[:8])[0] / 1e9 if raw and len(raw) >= 8 else None

    raw_id = top.get(CTA_ID)
    raw_timeout = top.get(CTA_TIMEOUT)
    bytes_out, packets_out = counters(CTA_COUNTERS_ORIG)
    bytes_in, packets_in = counters(CTA_COUNTERS_REPLY)
    return {
        "src": _ip(ipa.get(CTA_IP_V4_SRC) or ipa.get(CTA_IP_V6_SRC)),
        "dst": _ip(ipa.get(CTA_IP_V4_DST) or ipa.get(CTA_IP_V6_DST)),
        "proto": PROTOS.get(pnum, str(pnum)) if pnum is not None else None,
        "sport": port(CTA_PROTO_SRC_PORT), "dport": port(CTA_PROTO_DST_PORT),
        "id": struct.unpack(">I", raw_id[:4])[0] if raw_id and len(raw_id) >= 4 else None,
        "state": state, "bytes_out": bytes_out, "bytes_in": bytes_in,
        "packets_out": packets_out, "packets_in": packets_in,
        "start": stamp(CTA_TIMESTAMP_START), "stop": stamp(CTA_TIMESTAMP_STOP),
        "timeout": struct.unpack(">I", raw_timeout[:4])[0] if raw_timeout and len(raw_timeout) >= 4 else None,
        "family": payload[0], "tuple": _attr(CTA_TUPLE_ORIG | NLA_F_NESTED, top.get(CTA_TUPLE_ORIG, b"")),
    }


def parse_packet(raw: bytes) -> dict[str, Any] | None:
    """The start of an IPv4 or IPv6 packet -> src, dst, proto, sport, dport (ports None if absent)."""
    if not raw:
        return None
    version = raw[0] >> 4
    if version == 4 and len(raw) >= 20:
        ihl = (raw[0] & 0x0F) * 4
        pnum, src, dst, l4 = raw[9], raw[12:16], raw[16:20], ihl
        frag_off = struct.unpack_from(">H", raw, 6)[0] & 0x1FFF
        if frag_off:  # a later fragment carries no L4 header
            l4 = len(raw)
    elif version == 6 and len(raw) >= 40:
        pnum, src, dst, l4 = raw[6], raw[8:24], raw[24:40], 40
        # walk the common extension headers (hop-by-hop, routing, destination options)
        while pnum in (0, 43, 60) and l4 + 2 <= len(raw):
            pnum, l4 = raw[l4], l4 + (raw[l4 + 1] + 1) * 8
    else:
        return None
    sport = dport = None
    if pnum in (6, 17, 132, 136) and l4 + 4 <= len(raw):
        sport, dport = struct.unpack_from(">HH", raw, l4)
    return {"src": _ip(src), "dst": _ip(dst), "proto": PROTOS.get(pnum, str(pnum)),
            "sport": sport, "dport": dport}


def parse_nflog(kind: int, payload: bytes) -> dict[str, Any] | None:
    """One NFLOG packet message -> rule (from the prefix), indev (ifindex), time and the packet's
    addresses and ports; None for other messages and for prefixes that are not ours."""
    if kind != (NFNL_SUBSYS_ULOG << 8) | NFULNL_MSG_PACKET or len(payload) < 4:
        return None
    a = _attrs(payload, 4)
    prefix = a.get(NFULA_PREFIX, b"").split(b"\0", 1)[0].decode(errors="replace")
    if not prefix.startswith(PREFIX):
        return None
    pkt = parse_packet(a.get(NFULA_PAYLOAD, b"")) or {"src": None, "dst": None, "proto": None,
                                                      "sport": None, "dport": None}
    indev = a.get(NFULA_IFINDEX_INDEV)
    stamp = a.get(NFULA_TIMESTAMP)
    return {**pkt, "rule": prefix[len(PREFIX):].strip(),
            "indev": struct.unpack(">I", indev[:4])[0] if indev and len(indev) >= 4 else None,
            "time": (struct.unpack(">QQ", stamp[:16])[0] + struct.unpack(">QQ", stamp[:16])[1] / 1e6
                     if stamp and len(stamp) >= 16 else None)}


# --- the event log ------------------------------------------------------------------------------------


class EventCollector:
    """Reads conntrack events and NFLOG from the router namespace on an asyncio loop and calls
    `on_event(slot, event)` for each event of a sandbox (slot from the sandbox's /30 address; for a
    denied packet, from its ingress link `s<slot>` when known).

    Event dicts: time (unix), proto, src, dst, dport, sport, verdict ("allowed"|"denied"), rule,
    bytes_out, bytes_in, state ("open"|"closed"|"denied"), and for conntrack events id (the kernel's
    conntrack id, the same in a connection's open and closed events), start, stop.

    `stats` counts what was not delivered: `lost_conntrack`/`lost_nflog` (socket overruns, ENOBUFS:
    each is one or more events lost), `unattributed` (no sandbox slot), `callback_errors`.

    Reap probes. The kernel sends a connection's DESTROY event when it removes the conntrack entry, and
    it removes an expired entry only when its garbage collector passes (tens of seconds later) or when
    a lookup meets it. So for every sandbox connection whose conntrack timeout is short (at most
    PROBE_MAX s: a TCP connection closing or in TIME_WAIT, a UDP flow), the collector asks ctnetlink
    for that entry (IPCTNL_MSG_CT_GET by its original tuple and id) just after it should expire: the
    lookup removes it if it has, and the DESTROY event follows at once; if it is still alive, the
    reply's timeout schedules the next probe. At most MAX_PROBES are pending (the rest wait for the
    kernel's collector). UPDATE events are subscribed to for their timeouts; they make no events."""

    def __init__(self, on_event: Callable[[int, dict[str, Any]], None], *, group: int = LOG_GROUP,
                 allowed_rule: str = "policy") -> None:
        self.on_event = on_event
        self.group = group
        self.allowed_rule = allowed_rule
        self.stats = {"lost_conntrack": 0, "lost_nflog": 0, "unattributed": 0, "callback_errors": 0,
                      "conntrack": 0, "nflog": 0, "probes": 0}
        self._ct: socket.socket | None = None
        self._log: socket.socket | None = None
        self._ifq: socket.socket | None = None  # for ifindex -> name, in the router namespace
        self._ifslots: dict[int, int | None] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._probes: dict[int, asyncio.TimerHandle] = {}
        self._seq = 0

    def start(self, router_netns_path: str, loop: asyncio.AbstractEventLoop) -> None:
        """Open both sockets in the router namespace and read them on `loop` (call from its thread)."""
        if self._loop is not None:
            raise EventsError("already started")
        try:
            self._ct = ctnetlink_socket(router_netns_path)
            self._log = nflog_socket(router_netns_path, self.group)
            self._ifq = call_in(router_netns_path,
                                  lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC))
            for s in (self._ct, self._log):
                s.setblocking(False)
            loop.add_reader(self._ct.fileno(), self._read, self._ct, self._on_conntrack, "lost_conntrack")
            loop.add_reader(self._log.fileno(), self._read, self._log, self._on_nflog, "lost_nflog")
            self._loop = loop
        except BaseException:
            self._loop = loop
            self.close()
            raise

    def close(self) -> None:
        loop, self._loop = self._loop, None
        for h in self._probes.values():
            h.cancel()
        self._probes.clear()
        for s in (self._ct, self._log):
            if s is not None and loop is not None and not loop.is_closed():
                loop.remove_reader(s.fileno())
        for s in (self._ct, self._log, self._ifq):
            if s is not None:
                s.close()
        self._ct = self._log = self._ifq = None

    async def drain(self, max_slices: int = 64) -> None:
        """Read what the kernel has queued by now, 256 datagrams at a time with the loop's other work in
        between, until both sockets are empty (at most `max_slices` slices each: a flood that never
        stops cannot hold a kill up). Called before a slot changes hands (network/service.py), so that
        every event of its sandbox, the DESTROY events of a flush among them, is handed on while it is
        still that sandbox's."""
        for sock, handle, lost in ((self._ct, self._on_conntrack, "lost_conntrack"),
                                   (self._log, self._on_nflog, "lost_nflog")):
            for _ in range(max_slices):
                if sock is None or sock.fileno() < 0 or not self._read(sock, handle, lost):
                    break
                await asyncio.sleep(0)

    def _read(self, sock: socket.socket, handle: Callable[[int, int, int, bytes], None], lost_key: str) -> bool:
        """Read up to 256 datagrams; True if that limit ended it (more may be queued)."""
        for _ in range(256):  # bounded per wakeup: the loop keeps serving others during a flood
            try:
                data = sock.recv(1 << 17)
            except BlockingIOError:
                return False
            except OSError as e:
                if e.errno == errno.ENOBUFS:
                    self.stats[lost_key] += 1
                    continue
                raise
            for kind, flags, seq, payload in _messages(data):
                if kind == NLMSG_OVERRUN:
                    self.stats[lost_key] += 1
                elif kind >= 16:
                    handle(kind, flags, seq, payload)
        return True

    def _emit(self, slot: int | None, event: dict[str, Any]) -> None:
        if slot is None:
            self.stats["unattributed"] += 1
            return
        try:
            self.on_event(slot, event)
        except Exception:
            self.stats["callback_errors"] += 1

    def _on_conntrack(self, kind: int, flags: int, seq: int, payload: bytes) -> None:
        ct = parse_conntrack(kind, flags, payload)
        if ct is None:
            return
        slot = slot_of(ct["src"] or "")
        if slot is None:
            return  # the router's own traffic, or not from a sandbox link
        if ct["state"] == "closed":
            h = self._probes.pop(ct["id"], None)
            if h is not None:
                h.cancel()
        else:
            self._schedule_probe(ct)
        if seq != 0 or ct["state"] == "update":
            return  # a reply to a probe (events have seq 0), or an update: no event
        self.stats["conntrack"] += 1
        now = time.time()
        self._emit(slot, {
            "time": now, "proto": ct["proto"], "src": ct["src"], "dst": ct["dst"], "sport": ct["sport"],
            "dport": ct["dport"], "verdict": "allowed", "rule": self.allowed_rule,
            "bytes_out": ct["bytes_out"], "bytes_in": ct["bytes_in"], "state": ct["state"], "id": ct["id"],
            "start": ct["start"], "stop": ct["stop"],
        })

    def _schedule_probe(self, ct: dict[str, Any]) -> None:
        cid, timeout = ct["id"], ct["timeout"]
        old = self._probes.pop(cid, None)
        if old is not None:
            old.cancel()
        if self._loop is None or cid is None or timeout is None or timeout > PROBE_MAX:
            return
        if len(self._probes) >= MAX_PROBES:
            return
        self._probes[cid] = self._loop.call_later(timeout + 0.2, self._probe, cid, ct["family"], ct["tuple"])

    def _probe(self, cid: int, family: int, tuple_attr: bytes) -> None:
        self._probes.pop(cid, None)
        if self._ct is None:
            return
        self._seq = self._seq % 0x7FFFFFFF + 1
        body = struct.pack("!BBH", family, 0, 0) + tuple_attr + _attr(CTA_ID, struct.pack(">I", cid))
        msg = struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | IPCTNL_MSG_CT_GET,
                          NLM_F_REQUEST, self._seq, 0) + body
        try:
            self._ct.send(msg)
            self.stats["probes"] += 1
        except OSError:
            pass  # a full socket: the kernel's collector will get to it

    def _on_nflog(self, kind: int, flags: int, seq: int, payload: bytes) -> None:
        log = parse_nflog(kind, payload)
        if log is None:
            return
        self.stats["nflog"] += 1
        slot = self._slot_of_ifindex(log["indev"]) if log["indev"] else None
        if slot is None:
            slot = slot_of(log["src"] or "")
        self._emit(slot, {
            "time": log["time"] or time.time(), "proto": log["proto"], "src": log["src"], "dst": log["dst"],
            "sport": log["sport"], "dport": log["dport"], "verdict": "denied", "rule": log["rule"],
            "bytes_out": 0, "bytes_in": 0, "state": "denied",
        })

    def _slot_of_ifindex(self, index: int) -> int | None:
        """`s<slot>` -> slot, by the link's name in the router namespace (cached; names there are ours)."""
        if index in self._ifslots:
            return self._ifslots[index]
        if self._ifq is None:
            return None
        try:
            req = struct.pack("16si", b"", index) + b"\0" * 20
            name = fcntl.ioctl(self._ifq.fileno(), SIOCGIFNAME, req)[:16].split(b"\0", 1)[0].decode()
        except OSError:
            return None  # the link is gone; do not cache
        m = re.fullmatch(r"s(\d+)", name)
        slot = int(m.group(1)) if m and int(m.group(1)) < MAX_SLOTS else None
        if len(self._ifslots) > 4 * MAX_SLOTS:
            self._ifslots.clear()
        self._ifslots[index] = slot
        return slot
