"""A code context's sys.stdout and sys.stderr: line-buffered, and text without a newline goes out soon.

A line-buffered stream keeps ``print("a", end="")`` in its buffer until a newline comes, so a client
would see nothing while the cell sleeps or computes. Jupyter's streams (what E2B runs) flush on a
timer instead. Here a write that leaves text in the buffer wakes one daemon thread, which flushes
FLUSH_DELAY later: partial output reaches the agent within ~10 ms, writes that follow right away
(print's ``end``, the rest of the line) still go out together, and full lines cost what they cost
before. The thread starts on the first such write, so a context that never needs it has none.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
import threading
import time
from typing import Any

FLUSH_DELAY = 0.01  # seconds between a write that leaves text unflushed and its flush


class _Flusher:
    """The thread that flushes the streams some time after a partial write."""

    def __init__(self) -> None:
        self.streams: list[io.TextIOBase] = []
        self._wake = threading.Event()
        self.pending = False  # kicked, not yet flushed: writes until then need not kick again
        self._started = False
        self._hooked = False

    def _forked(self) -> None:  # a fork (user code's) has no thread: it starts its own on need
        self._wake = threading.Event()
        self.pending = self._started = False

    def kick(self) -> None:
        if not self._started:
            self._started = True
            if not self._hooked:
                self._hooked = True
                os.register_at_fork(after_in_child=self._forked)
            threading.Thread(target=self._run, args=(self._wake,), name="agentcell-stdio-flush", daemon=True).start()
        self.pending = True
        self._wake.set()

    def _run(self, wake: threading.Event) -> None:
        while True:
            wake.wait()
            time.sleep(FLUSH_DELAY)
            wake.clear()  # before pending: a kick between the two would be lost the other way round
            self.pending = False  # a write after this kicks again; one before it is in the flush below
            for stream in self.streams:
                with contextlib.suppress(Exception):  # closed or replaced by user code
                    stream.flush()


_flusher = _Flusher()


class PromptStream(io.TextIOWrapper):
    """A line-buffered text stream whose unterminated writes are flushed by _flusher."""

    def write(self, s: Any, _write: Any = io.TextIOWrapper.write) -> int:  # a local: print calls this a lot
        n = _write(self, s)
        if s[-1:] != "\n" and not _flusher.pending:  # line buffering flushed up to a newline already
            _flusher.kick()
        return n


def open_stream(fd: int) -> PromptStream:
    stream = PromptStream(open(fd, "wb", closefd=False), encoding="utf-8", errors="backslashreplace",  # noqa: SIM115
                          line_buffering=True)  # fmt: skip
    _flusher.streams.append(stream)
    return stream


def install() -> None:
    """sys.stdin from fd 0, sys.stdout and sys.stderr on fds 1 and 2 (the agent's pipes)."""
    sys.stdin = open(0, encoding="utf-8", closefd=False)  # noqa: SIM115
    sys.stdout = open_stream(1)
    sys.stderr = open_stream(2)
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
