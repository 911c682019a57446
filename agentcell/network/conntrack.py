"""Forget a sandbox address's connections in the router's conntrack table (at kill, before its slot is
reused; docs/network.md, "Lifecycle").

Why: a conntrack entry outlives the sandbox that made it. A UDP flow whose peer keeps sending keeps its
entry alive for as long as the peer does, and with it the masquerade mapping back to the sandbox's
address (10.77.x.2). The next sandbox given that slot has that address, so without a flush it would
receive the old tenant's datagrams, and the entry's DESTROY event would land in its record.

How: ctnetlink cannot flush by address (a flush filters by family, mark and zone only), so the entries
are dumped with a filter the kernel applies (CTA_FILTER, Linux 5.10+: original source, then original
destination, equal to the address) and each is deleted by its original tuple and id, in batches of
messages. A kernel without the filter gets a full dump, filtered here. The deletes raise the
entries' DESTROY events on the event collector's socket (network/flow_events.py), which the caller
reads before the slot changes hands.

Every socket here is made in the router namespace (`call_in`) and used from one thread at a time.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
import struct
import threading

from agentcell.network.flow_events import (
    CTA_ID,
    CTA_TUPLE_IP,
    CTA_TUPLE_ORIG,
    IPCTNL_MSG_CT_DELETE,
    IPCTNL_MSG_CT_GET,
    NFNL_SUBSYS_CTNETLINK,
    NLA_F_NESTED,
    NLM_F_ACK,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    _attr,
    _messages,
    parse_conntrack,
)

NETLINK_NETFILTER = 12
NLM_F_DUMP = 0x300  # NLM_F_ROOT | NLM_F_MATCH
CTA_IP_V4_SRC, CTA_IP_V4_DST = 1, 2
CTA_FILTER = 25
CTA_FILTER_ORIG_FLAGS = 1
CTA_FILTER_FLAG_IP_SRC, CTA_FILTER_FLAG_IP_DST = 1 << 0, 1 << 1
BATCH_BYTES = 48 << 10  # delete messages per send: well under the socket's send buffer
RCVBUF = 4 << 20


class ConntrackError(RuntimeError):
    """The router's conntrack table could not be read or changed; the message names the step."""


class Flusher:
    """Deletes every conntrack entry of an IPv4 address, both directions, in the namespace `sock` was
    made in (a NETLINK_NETFILTER socket, `netfilter_socket()`; the flusher owns it). Thread-safe: one
    flush at a time."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock: socket.socket | None = sock
        self._seq = 0
        self._lock = threading.Lock()
        self.filtered = True  # whether the kernel filters dumps (CTA_FILTER); else every entry is read here

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def flush(self, address: str) -> int:
        """Delete the entries whose original source or destination is `address`; the number deleted.
        Blocking (run it off the event loop)."""
        ip = ipaddress.IPv4Address(address)
        with self._lock:
            if self._sock is None:
                raise ConntrackError("the flusher is closed")
            entries: dict[int, bytes] = {}
            for flag, attr in ((CTA_FILTER_FLAG_IP_SRC, CTA_IP_V4_SRC), (CTA_FILTER_FLAG_IP_DST, CTA_IP_V4_DST)):
                for ct in self._dump(ip, flag, attr):
                    if ct["id"] is not None and address in (ct["src"], ct["dst"]):
                        entries[ct["id"]] = ct["tuple"]
            return self._delete(entries)

    def _next_seq(self) -> int:
        self._seq = self._seq % 0x7FFFFFFF + 1
        return self._seq

    def _request(self, msg_type: int, flags: int, body: bytes) -> tuple[int, bytes]:
        seq = self._next_seq()
        return seq, struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_CTNETLINK << 8) | msg_type, flags, seq, 0) + body

    def _dump(self, ip: ipaddress.IPv4Address, flag: int, attr: int) -> list[dict]:
        """The entries the kernel lists for a filter on one end of the original tuple (all entries of
        IPv4 when the kernel has no filters)."""
        assert self._sock is not None
        header = struct.pack("!BBH", socket.AF_INET, 0, 0)
        body = header
        if self.filtered:
            tuple_ip = _attr(CTA_TUPLE_IP | NLA_F_NESTED, _attr(attr, ip.packed))
            body += (_attr(CTA_TUPLE_ORIG | NLA_F_NESTED, tuple_ip)
                     + _attr(CTA_FILTER | NLA_F_NESTED, _attr(CTA_FILTER_ORIG_FLAGS, struct.pack("=I", flag))))
        seq, msg = self._request(IPCTNL_MSG_CT_GET, NLM_F_REQUEST | NLM_F_DUMP, body)
        self._sock.send(msg)
        found: list[dict] = []
        while True:
            data = self._sock.recv(1 << 20)
            for kind, flags, mseq, payload in _messages(data):
                if mseq != seq:
                    continue  # a late answer to an earlier request
                if kind == NLMSG_DONE:
                    return found
                if kind == NLMSG_ERROR:
                    code = -struct.unpack_from("=i", payload)[0]
                    if code in (errno.EOPNOTSUPP, errno.EINVAL) and self.filtered:
                        self.filtered = False  # a kernel before 5.10: read everything, filter here
                        return self._dump(ip, flag, attr)
                    if code:
                        raise ConntrackError(f"listing the router's connections failed: {errno.errorcode.get(code, code)}")
                    return found
                ct = parse_conntrack(kind, flags, payload)
                if ct is not None:
                    found.append(ct)

    def _delete(self, entries: dict[int, bytes]) -> int:
        """Delete the entries (id -> raw original tuple) in batches; an entry gone meanwhile is fine."""
        assert self._sock is not None
        deleted = 0
        pending: dict[int, int] = {}  # seq -> 1 while its ack is due
        batch = b""
        items = list(entries.items())
        for i, (cid, tuple_attr) in enumerate(items):
            body = struct.pack("!BBH", socket.AF_INET, 0, 0) + tuple_attr + _attr(CTA_ID, struct.pack(">I", cid))
            seq, msg = self._request(IPCTNL_MSG_CT_DELETE, NLM_F_REQUEST | NLM_F_ACK, body)
            pending[seq] = 1
            batch += msg
            if len(batch) >= BATCH_BYTES or i == len(items) - 1:
                self._sock.send(batch)
                batch = b""
                deleted += self._acks(pending)
        return deleted

    def _acks(self, pending: dict[int, int]) -> int:
        assert self._sock is not None
        ok = 0
        while pending:
            data = self._sock.recv(1 << 20)
            for kind, _flags, seq, payload in _messages(data):
                if kind != NLMSG_ERROR or pending.pop(seq, None) is None:
                    continue
                code = -struct.unpack_from("=i", payload)[0]
                if code == 0:
                    ok += 1
                elif code != errno.ENOENT:
                    raise ConntrackError(f"deleting a connection of the router failed: {errno.errorcode.get(code, code)}")
        return ok


def netfilter_socket() -> socket.socket:
    """A NETLINK_NETFILTER socket for requests (no event groups); call it in the target namespace."""
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER)
    try:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RCVBUF)
        s.bind((0, 0))
        s.settimeout(10.0)  # the kernel answers at once; a stuck socket must not hang a kill forever
    except BaseException:
        s.close()
        raise
    return s
