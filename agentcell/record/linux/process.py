"""The behaviour record's collectors in a process of their own (issue 10): the server's event loop only
stores the events they send.

Why: reading the kernel's queues (tracer ring, audit netlink, fanotify), parsing, resolving paths and
coalescing a build's ~2,800 raw notifications into ~800 events took ~17 ms of the server's event loop
per build (py-spy), and slices of it landed on the next requests (a create right after a build +3 to
+10 %). Here that work runs in a child process at a lower CPU priority (nice NICE): on the other core
when one is free, behind the server and the sandboxes when none is. The server receives finished
events in batches and stores them (a few µs an event).

Trust: the child is host root like the server (audit control, BPF, fanotify need it), runs no tenant
code and holds nothing of a tenant's but its events. It dies with the server (PR_SET_PDEATHSIG, and EOF
on its socket), restoring the kernel's audit state as it goes; if it dies first, the server says so in
every record from then on (record.dropped) and goes on serving.

Protocol: a SOCK_SEQPACKET socketpair, one orjson array per packet.
  server -> child: ["watch", target] (+ the disk's root fd, SCM_RIGHTS), ["claimed", id],
                   ["unwatch", id, n], ["close"]
  child -> server: ["started", [[collector name, why it is missing] ...]], ["events", [[id, event] ...]],
                   ["unwatched", n] (after every event of that sandbox the collectors had)
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from typing import Any

import orjson

from agentcell import allocator
from agentcell.backends.linux import cgroups, child_link
from agentcell.errors import BackendUnavailableError
from agentcell.record import quiet
from agentcell.record.events import EventSink, event
from agentcell.record.linux.audit_events import AuditCollector
from agentcell.record.linux.file_events import FileCollector
from agentcell.record.linux.limit_events import LimitsCollector
from agentcell.record.linux.target import Collector, WatchTarget

MODULE = "agentcell.record.linux.process"  # the child runs `python -m MODULE`
NICE = 10  # the child's niceness: a tenth of a core's weight against the server when both want one
START_TIMEOUT_S = 300.0  # the first start compiles the kernel tracer (clang: up to 120 s)
UNWATCH_TIMEOUT_S = 2.0  # a kill waits this long at most for a sandbox's last events
CLOSE_TIMEOUT_S = 15.0
BATCH_EVENTS = 64  # events per packet (~0.3 ms for the server to store)
BATCH_DELAY_S = 0.005  # the child gathers events this long before sending them
SLICE_S = 0.0005  # the server stores this long at a time, then serves what else is ready
READ_DELAY_S = 0.02  # ... and starts this long after a packet arrives (batches pile up)
SOCKET_BUFFER = 4 << 20  # each direction's queue: ~10,000 events the server has not read yet
MAX_PACKET = 1 << 20  # a packet's bytes at most (BATCH_EVENTS of the largest events fit)
RESTARTS, RESTART_PERIOD_S = 5, 600.0  # a child that died is started again, this often a period at most
RESTART_DELAY_S = 0.5


class RecordProcessError(BackendUnavailableError):
    """The record's process could not start, or is gone."""


def make_collectors(sink: EventSink, uid_first: int, uid_last: int, *, names: frozenset[str] | tuple[str, ...],
                    denials: str = "failures", tune_sysctl: bool = True) -> dict[str, Collector]:
    """The linux backend's host-side collectors named in `names` (config.COLLECTOR_NAMES), by name; the
    audit rules cover host uids `uid_first`..`uid_last` (this server's range)."""
    made: dict[str, Collector] = {
        "processes": AuditCollector(sink, uid_first, uid_last, denials=denials),
        "files": FileCollector(sink, tune_sysctl=tune_sysctl),
        "limits": LimitsCollector(sink),
    }
    return {name: c for name, c in made.items() if name in names}


def processes_of(server_pid: int) -> list[int]:
    """The pids of a server's record process (none, or one while it is started again), from /proc."""
    return child_link.processes_of(server_pid, MODULE)


def _target_message(target: WatchTarget) -> list[Any]:
    cg = target.cgroup
    return ["watch", {"sandbox_id": target.sandbox_id, "host_pid": target.host_pid, "host_uids": list(target.host_uids),
                      "cgroup": [cg.sandbox_id, cg.v2, cg.dirs]}]


def _target_of(fields: dict[str, Any], disk_fd: int) -> WatchTarget:
    rel, v2, dirs = fields["cgroup"]
    return WatchTarget(fields["sandbox_id"], fields["host_pid"], tuple(fields["host_uids"]),
                       cgroups.Cgroups(rel, v2, dirs), disk_fd)


class RecordProcess(child_link.ChildProcess):
    """The server's end: a Collector (target.py) whose collectors run in the child; `start()` returns
    why any of them could not start here. A child that dies is started again (RESTARTS a period at
    most), watching the same sandboxes; their records say what went missing meanwhile."""

    module = MODULE
    what = "behaviour record's process"
    error = RecordProcessError
    without = "the behaviour record goes on without the kernel's events"
    start_timeout_s = START_TIMEOUT_S
    close_timeout_s = CLOSE_TIMEOUT_S
    restart_delay_s = RESTART_DELAY_S

    def __init__(self, sink: EventSink, uid_first: int, uid_last: int, *, names: frozenset[str] | tuple[str, ...],
                 denials: str = "failures", tune_sysctl: bool = True) -> None:
        super().__init__({"first": uid_first, "last": uid_last, "names": sorted(names), "denials": denials,
                          "tune_sysctl": tune_sysctl}, buffer=SOCKET_BUFFER, max_packet=MAX_PACKET,
                         restarts=RESTARTS, period_s=RESTART_PERIOD_S)
        self.sink = sink
        self._acks: dict[int, asyncio.Future[None]] = {}
        self._next_ack = 0
        self._targets: dict[str, list[Any]] = {}  # sandbox id -> [its WatchTarget, claimed]

    async def start(self) -> list[tuple[str, str]]:
        """Once the child runs: the collectors that could not start there, each with why."""
        try:
            return [(name, why) for name, why in await super().start()]
        except RecordProcessError:
            await self.close()
            raise

    async def _respawned(self, why: str) -> None:
        for sandbox_id, (target, claimed) in list(self._targets.items()):
            self.sink(sandbox_id, event("record.dropped", count=0, reason=f"the record's collectors were started "
                                        f"again ({why}): what the kernel reported meanwhile is missing"))
            with contextlib.suppress(OSError):
                self._send(_target_message(target), (target.disk_fd,))
                if claimed:
                    self._send(["claimed", sandbox_id])

    # -- to the child ------------------------------------------------------------------------------

    def _send(self, message: list[Any], fds: tuple[int, ...] = ()) -> None:
        self._send_packet(orjson.dumps(message), fds)

    def _send_unless_restarting(self, message: list[Any], fds: tuple[int, ...] = ()) -> None:
        if self.gone is not None and self._restarting is not None and not self._restarting.done():
            return  # the new child is told of every watched sandbox once it runs
        self._send(message, fds)

    def watch(self, target: WatchTarget) -> None:
        self._targets[target.sandbox_id] = [target, False]
        self._send_unless_restarting(_target_message(target), (target.disk_fd,))

    def claimed(self, sandbox_id: str) -> None:
        if sandbox_id in self._targets:
            self._targets[sandbox_id][1] = True
        self._send_unless_restarting(["claimed", sandbox_id])

    async def unwatch(self, sandbox_id: str) -> None:
        """Once the sandbox's last events (its processes' exits, its last writes) are stored."""
        assert self._loop is not None
        self._targets.pop(sandbox_id, None)
        self._next_ack += 1
        n = self._next_ack
        try:
            self._send(["unwatch", sandbox_id, n])
        except OSError:
            return
        fut = self._acks[n] = self._loop.create_future()
        self._store_soon()  # nothing waits for a quiet moment while a kill waits
        try:
            await asyncio.wait_for(fut, UNWATCH_TIMEOUT_S)
        except TimeoutError:
            pass
        finally:
            self._acks.pop(n, None)

    # -- from the child ----------------------------------------------------------------------------

    def _readable(self) -> None:
        assert self._loop is not None and self._sock is not None
        self._loop.remove_reader(self._sock.fileno())
        if self._urgent():
            self._store_soon()
        else:
            self._loop.call_later(READ_DELAY_S, self._drain, time.monotonic() + READ_DELAY_S)

    def _urgent(self) -> bool:
        """A kill waits for a sandbox's last events, or the start for the child's word."""
        return bool(self._acks) or (self._started is not None and not self._started.done())

    def _store_soon(self) -> None:
        assert self._loop is not None
        self._loop.call_soon(self._drain, time.monotonic() - quiet.MAX_WAIT_S)  # due long ago: now

    def _drain(self, due: float) -> None:
        if self._sock is None:
            return
        assert self._loop is not None
        if not self._urgent() and quiet.put_off(self._loop, due, self._drain):
            return  # the server is serving requests: after them
        until = time.monotonic() + SLICE_S
        while self._receive():
            if time.monotonic() > until:  # more may be waiting: after what else is ready
                self._loop.call_soon(self._drain, due)
                return
        if self._sock is not None:
            self._loop.add_reader(self._sock.fileno(), self._readable)

    def _handle(self, message: list[Any]) -> None:
        op = message[0]
        if op == "events":
            for sandbox_id, ev in message[1]:
                self.sink(sandbox_id, ev)
        elif op == "unwatched":
            fut = self._acks.get(message[1])
            if fut is not None and not fut.done():
                fut.set_result(None)

    def _gone(self) -> None:
        for fut in self._acks.values():
            if not fut.done():
                fut.set_result(None)


# -- the child --------------------------------------------------------------------------------------


class _Child:
    def __init__(self, sock: socket.socket, config: dict[str, Any]) -> None:
        self.sock = sock
        self.config = config
        self.collectors: list[Collector] = []
        self.batch: list[tuple[str, dict[str, Any]]] = []
        self.flush_at: asyncio.TimerHandle | None = None
        self.done = asyncio.get_running_loop().create_future()
        # (the kernel's limit on one packet is the send buffer, smaller where it could not be raised)
        self.max_packet = min(MAX_PACKET, sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2)

    def sink(self, sandbox_id: str, ev: dict[str, Any]) -> None:
        self.batch.append((sandbox_id, ev))
        if len(self.batch) >= BATCH_EVENTS:
            self.flush()
        elif self.flush_at is None:
            self.flush_at = asyncio.get_running_loop().call_later(BATCH_DELAY_S, self.flush)

    def flush(self) -> None:
        if self.flush_at is not None:
            self.flush_at.cancel()
            self.flush_at = None
        while self.batch:
            part, self.batch = self.batch[:BATCH_EVENTS], self.batch[BATCH_EVENTS:]
            self.send_events(part)

    def send_events(self, events: list[tuple[str, dict[str, Any]]]) -> None:
        data = orjson.dumps(["events", events], default=str, option=orjson.OPT_NON_STR_KEYS)
        if len(data) <= self.max_packet:
            self.send(data)
        elif len(events) > 1:
            self.send_events(events[:len(events) // 2])
            self.send_events(events[len(events) // 2:])
        else:  # one event past the packet size: not from these collectors (paths and argv are cut short)
            print(f"agentcell: a record event of {len(data)} bytes was left out", file=sys.stderr)

    def send(self, data: bytes) -> None:
        # blocking: if the server does not read, the child stops reading the kernel, whose queues
        # then overflow and count what they lose (each collector's record.dropped)
        self.sock.sendall(data)

    async def run(self) -> None:
        c = self.config
        missing: list[list[str]] = []
        for name, collector in make_collectors(self.sink, c["first"], c["last"], names=tuple(c["names"]),
                                               denials=c["denials"], tune_sysctl=c["tune_sysctl"]).items():
            try:
                await collector.start()
            except (BackendUnavailableError, OSError) as e:
                print(f"agentcell: the behaviour record has no {name} on this host: {e}", file=sys.stderr)
                missing.append([name, str(e)])
                continue
            self.collectors.append(collector)
        self.send(orjson.dumps(["started", missing]))
        loop = asyncio.get_running_loop()
        loop.add_reader(self.sock.fileno(), self.readable)
        loop.add_signal_handler(signal.SIGTERM, self.stop)
        await self.done
        loop.remove_reader(self.sock.fileno())
        for collector in self.collectors:
            with contextlib.suppress(Exception):
                await collector.close()
        with contextlib.suppress(OSError):  # (the server may be gone)
            self.flush()

    def stop(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def readable(self) -> None:
        fds = array.array("i")
        try:
            data, ancdata, _flags, _addr = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(16 * fds.itemsize),
                                                              socket.MSG_DONTWAIT)
        except BlockingIOError:
            return
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds.frombytes(payload[:len(payload) - len(payload) % fds.itemsize])
        try:
            if not data:  # the server is gone
                self.stop()
                return
            self.order(orjson.loads(data), list(fds))
        finally:
            for fd in fds:
                os.close(fd)

    def order(self, message: list[Any], fds: list[int]) -> None:
        op = message[0]
        if op == "watch" and fds:
            target = _target_of(message[1], fds[0])
            for collector in self.collectors:
                try:
                    collector.watch(target)  # (each keeps its own copy of the disk's fd)
                except OSError as e:  # a record with a gap, said in the record, rather than no sandbox
                    self.sink(target.sandbox_id, event("record.dropped", count=0, reason=f"{type(collector).__name__}: {e}"))
        elif op == "claimed":
            for collector in self.collectors:
                with contextlib.suppress(OSError):
                    collector.claimed(message[1])
        elif op == "unwatch":
            for collector in self.collectors:
                with contextlib.suppress(Exception):
                    collector.unwatch(message[1])
            self.flush()
            self.send(orjson.dumps(["unwatched", message[2]]))
        elif op == "close":
            self.stop()


async def _child_main(fd: int, config: dict[str, Any]) -> None:
    sock = socket.socket(fileno=fd)
    sock.setblocking(True)
    await _Child(sock, config).run()


def main() -> None:
    if not child_link.die_with_parent():  # the server died before we could ask
        return
    allocator.pin_thresholds()  # a helper lives as long as the server (allocator.py)
    with contextlib.suppress(OSError):
        os.nice(NICE)
    asyncio.run(_child_main(int(sys.argv[1]), orjson.loads(sys.argv[2])))


if __name__ == "__main__":
    main()
