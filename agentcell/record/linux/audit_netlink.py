"""The kernel audit subsystem over netlink (NETLINK_AUDIT), without auditctl or libaudit: status,
rules and the record stream, as much as the behaviour record (record/linux/audit_events.py) needs.

Structures are the kernel's uapi (include/uapi/linux/audit.h): `struct audit_status` and
`struct audit_rule_data`, packed with `struct`. Everything here needs host root (CAP_AUDIT_CONTROL
for status and rules, CAP_AUDIT_READ for the read-only multicast group).
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket
import struct
from dataclasses import dataclass, fields

NETLINK_AUDIT = 9
AUDIT_NLGRP_READLOG = 1

# message types
AUDIT_GET, AUDIT_SET, AUDIT_LIST_RULES, AUDIT_ADD_RULE, AUDIT_DEL_RULE = 1000, 1001, 1013, 1011, 1012
NLMSG_ERROR, NLMSG_DONE = 2, 3
# record types
SYSCALL, PATH, CWD, EXECVE, EOE, SECCOMP, PROCTITLE = 1300, 1302, 1307, 1309, 1320, 1326, 1327
LANDLOCK_ACCESS, LANDLOCK_DOMAIN = 1423, 1424
REPLACE = 1329  # to the audit daemon: another process asks to be the daemon

NLM_F_REQUEST, NLM_F_ACK = 1, 4
_NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid

# struct audit_status's mask bits
S_ENABLED, S_FAILURE, S_PID, S_RATE_LIMIT, S_BACKLOG_LIMIT, S_BACKLOG_WAIT_TIME = 1, 2, 4, 8, 0x10, 0x20
S_LOST = 0x40  # alone in a request: reset the lost counter


@dataclass
class Status:
    mask: int = 0
    enabled: int = 0
    failure: int = 0
    pid: int = 0
    rate_limit: int = 0
    backlog_limit: int = 0
    lost: int = 0
    backlog: int = 0
    feature_bitmap: int = 0
    backlog_wait_time: int = 0
    backlog_wait_time_actual: int = 0

    def pack(self) -> bytes:
        return struct.pack("=11I", *(getattr(self, f.name) for f in fields(self)))

    @classmethod
    def unpack(cls, data: bytes) -> Status:
        data = data[:44].ljust(44, b"\0")  # older kernels send fewer fields
        return cls(*struct.unpack("=11I", data))


# rules (struct audit_rule_data)
FILTER_TASK, FILTER_EXIT, FILTER_EXCLUDE = 0x01, 0x04, 0x05  # exclude: by record type and task, before writing
NEVER, ALWAYS = 0, 2
F_UID, F_ARCH, F_MSGTYPE, F_EXIT, F_SUCCESS, F_FILTERKEY = 1, 11, 12, 103, 104, 210
OP_EQ, OP_LT, OP_GT = 0x40000000, 0x10000000, 0x20000000
OP_GE, OP_LE = OP_GT | OP_EQ, OP_LT | OP_EQ
ARCH_X86_64 = 0xC000003E
_BITMASK_WORDS, _MAX_FIELDS = 64, 64
_RULE_HEAD = struct.Struct(f"=3I{_BITMASK_WORDS}I{_MAX_FIELDS}I{_MAX_FIELDS}I{_MAX_FIELDS}II")


@dataclass(frozen=True)
class Rule:
    """One rule: `list` (FILTER_EXIT ...), `action`, the syscall numbers it applies to (none: all),
    (field, op, value) conditions and a key (the `-k` of auditctl) that names its owner."""

    list: int
    action: int
    syscalls: tuple[int, ...]
    conditions: tuple[tuple[int, int, int], ...]
    key: str = ""

    def pack(self) -> bytes:
        mask = [0] * _BITMASK_WORDS
        if self.syscalls:
            for nr in self.syscalls:
                mask[nr // 32] |= 1 << (nr % 32)
        else:
            mask = [0xFFFFFFFF] * _BITMASK_WORDS
        conds = list(self.conditions)
        buf = self.key.encode()
        if buf:
            conds.append((F_FILTERKEY, OP_EQ, len(buf)))
        names = [c[0] for c in conds] + [0] * (_MAX_FIELDS - len(conds))
        values = [c[2] & 0xFFFFFFFF for c in conds] + [0] * (_MAX_FIELDS - len(conds))
        ops = [c[1] for c in conds] + [0] * (_MAX_FIELDS - len(conds))
        return _RULE_HEAD.pack(self.list, self.action, len(conds), *mask, *names, *values, *ops, len(buf)) + buf



def rule_head(data: bytes) -> tuple[int, int]:
    """(list, action) of a rule as AUDIT_LIST_RULES sends it."""
    flags, action = struct.unpack_from("=II", data)
    return flags & ~0x10, action  # less AUDIT_FILTER_PREPEND


def rule_conditions(data: bytes) -> list[tuple[int, int, int]]:
    """(field, op, value) of each condition of a rule as AUDIT_LIST_RULES sends it."""
    head = _RULE_HEAD.unpack_from(data)
    count = head[2]
    at = 3 + _BITMASK_WORDS
    names = head[at:at + count]
    values = head[at + _MAX_FIELDS:at + _MAX_FIELDS + count]
    ops = head[at + 2 * _MAX_FIELDS:at + 2 * _MAX_FIELDS + count]
    return list(zip(names, ops, values, strict=True))


def rule_key(data: bytes) -> str:
    """The key (`-k`) of a rule as AUDIT_LIST_RULES sends it ("" if none)."""
    head = _RULE_HEAD.unpack_from(data)
    count = head[2]
    at = 3 + _BITMASK_WORDS
    names, values = head[at:at + count], head[at + _MAX_FIELDS:at + _MAX_FIELDS + count]
    offset = 0
    for name, value in zip(names, values, strict=True):
        if name in _STRING_FIELDS:
            if name == F_FILTERKEY:
                return data[_RULE_HEAD.size + offset:_RULE_HEAD.size + offset + value].decode(errors="replace")
            offset += value
    return ""


# fields whose value is a length into the rule's string buffer (LSM labels, watch, dir, exe, key)
_STRING_FIELDS = frozenset((13, 14, 15, 16, 17, 19, 20, 21, 22, 23, 105, 107, 112, F_FILTERKEY))


class AuditError(OSError):
    """The kernel refused an audit request (errno and what was asked)."""


class AuditSocket:
    """A NETLINK_AUDIT socket: requests with acks, and (optionally) the record stream."""

    def __init__(self, groups: int = 0, rcvbuf: int = 4 << 20) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_AUDIT)
        self.sock.bind((0, groups))
        # SO_RCVBUFFORCE (root): past net.core.rmem_max, so a burst waits here rather than being lost
        try:
            self.sock.setsockopt(socket.SOL_SOCKET, 33, rcvbuf)
        except OSError:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.port = self.sock.getsockname()[0]
        self._seq = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def close(self) -> None:
        self.sock.close()

    def request(self, msg_type: int, payload: bytes = b"", what: str = "") -> list[tuple[int, bytes]]:
        """Send one request and collect its answers up to the ack (or NLMSG_DONE for a dump). Records
        that arrive in between (this socket may also be the audit daemon's) are returned too, typed."""
        self._seq += 1
        seq = self._seq
        self.sock.send(_NLMSG.pack(_NLMSG.size + len(payload), msg_type, NLM_F_REQUEST | NLM_F_ACK, seq, 0) + payload)
        answers: list[tuple[int, bytes]] = []
        while True:
            data = self.sock.recv(1 << 16)
            for mtype, mseq, body in split(data):
                if mseq != seq:
                    continue  # a record, or an answer to an earlier request
                if mtype == NLMSG_ERROR:
                    err = -struct.unpack_from("=i", body)[0]
                    if err > 0:  # (resetting the lost counter acks with its old value: not an error)
                        raise AuditError(err, f"audit {what or msg_type}: {os.strerror(err)}")
                    if msg_type not in (AUDIT_GET, AUDIT_LIST_RULES):
                        return answers
                    continue  # the kernel acks first and answers from a thread of its own
                if mtype == NLMSG_DONE:
                    return answers
                answers.append((mtype, body))
                if msg_type == AUDIT_GET:
                    return answers

    def status(self) -> Status:
        for mtype, body in self.request(AUDIT_GET, what="get status"):
            if mtype == AUDIT_GET:
                return Status.unpack(body)
        raise AuditError(errno.EPROTO, "audit get status: no answer")

    def set_status(self, **values: int) -> None:
        bits = {"enabled": S_ENABLED, "failure": S_FAILURE, "pid": S_PID, "rate_limit": S_RATE_LIMIT,
                "backlog_limit": S_BACKLOG_LIMIT, "backlog_wait_time": S_BACKLOG_WAIT_TIME, "lost": S_LOST}
        st = Status(mask=sum(bits[k] for k in values), **values)
        self.request(AUDIT_SET, st.pack(), what=f"set {', '.join(values)}")

    def rules(self) -> list[bytes]:
        """Every loaded rule, as the kernel sends it (`rule_key` reads its key; `delete_rule` takes it)."""
        return [body for mtype, body in self.request(AUDIT_LIST_RULES, what="list rules")
                if mtype == AUDIT_LIST_RULES]

    def add_rule(self, rule: Rule) -> None:
        try:
            self.request(AUDIT_ADD_RULE, rule.pack(), what=f"add rule {rule.key}")
        except AuditError as e:
            if e.errno != errno.EEXIST:
                raise

    def delete_rule(self, rule: Rule | bytes) -> bool:
        try:
            self.request(AUDIT_DEL_RULE, rule if isinstance(rule, bytes) else rule.pack(), what="delete rule")
            return True
        except AuditError as e:
            if e.errno != errno.ENOENT:
                raise
            return False


def split(data: bytes) -> list[tuple[int, int, bytes]]:
    """(type, seq, payload) of each netlink message in one datagram."""
    out = []
    at = 0
    while at + _NLMSG.size <= len(data):
        length, mtype, _flags, seq, _pid = _NLMSG.unpack_from(data, at)
        if mtype >= 1100:  # a record: the kernel puts the payload's length there, not the message's
            length += _NLMSG.size
        if length < _NLMSG.size:
            break
        out.append((mtype, seq, data[at + _NLMSG.size:at + length]))
        at += (length + 3) & ~3
    return out


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


class _MsgHdr(ctypes.Structure):
    _fields_ = [("name", ctypes.c_void_p), ("namelen", ctypes.c_uint32), ("iov", ctypes.POINTER(_IOVec)),
                ("iovlen", ctypes.c_size_t), ("control", ctypes.c_void_p), ("controllen", ctypes.c_size_t),
                ("flags", ctypes.c_int)]


class _MMsgHdr(ctypes.Structure):
    _fields_ = [("hdr", _MsgHdr), ("len", ctypes.c_uint)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.recvmmsg.argtypes = (ctypes.c_int, ctypes.POINTER(_MMsgHdr), ctypes.c_uint, ctypes.c_int, ctypes.c_void_p)
_libc.recvmmsg.restype = ctypes.c_int
MSG_DONTWAIT = 0x40
MAX_RECORD = 9 << 10  # the kernel's MAX_AUDIT_MESSAGE_LENGTH (8970) and its header


class BatchReader:
    """Up to `count` datagrams of a non-blocking socket per system call (recvmmsg): the kernel sends
    each audit record as a datagram of its own, ~7 per exec, and one recv each cost more than the
    parsing (a syscall, and the GIL given up and taken back)."""

    def __init__(self, fd: int, count: int = 64, size: int = MAX_RECORD) -> None:
        self.fd, self.count, self.size = fd, count, size
        self._bufs = ctypes.create_string_buffer(count * size)
        self._iovs = (_IOVec * count)()
        self._msgs = (_MMsgHdr * count)()
        self._view = memoryview(self._bufs).cast("B")
        base = ctypes.addressof(self._bufs)
        for i in range(count):
            self._iovs[i].base, self._iovs[i].len = base + i * size, size
            self._msgs[i].hdr.iov = ctypes.pointer(self._iovs[i])
            self._msgs[i].hdr.iovlen = 1

    def read(self) -> list[bytes]:
        """What is queued, up to `count` datagrams ([] if none); OSError(ENOBUFS) on an overrun."""
        got = _libc.recvmmsg(self.fd, self._msgs, self.count, MSG_DONTWAIT, None)
        if got < 0:
            err = ctypes.get_errno()
            if err in (errno.EAGAIN, errno.EINTR):
                return []
            raise OSError(err, os.strerror(err))
        view, size, msgs = self._view, self.size, self._msgs
        return [bytes(view[i * size:i * size + min(msgs[i].len, size)]) for i in range(got)]
