"""Progress lines for the waits of a server's start (the runtime store's build, the tracer's compile, the
zygote's start ...): a wait that lasts over a second says what it is, how far it is and how long it has
taken, on the logger "agentcell.progress", so that nobody stares at a silent terminal.

    with progress.step("runtime store: building /opt/agentcell/venv", total=n, unit="files") as s:
        for ...:
            s.advance()

Nothing is printed for a step that ends within a second. After that, a line every few seconds while it
runs, and one when it ends. Every line starts with the step's name, so that a reader (the embedded SDK,
sdk/embedded.py, which forwards them to Python logging) can follow one step.

Where no one configured logging for "agentcell" (or the root logger), the lines go to stderr as
"agentcell: <line>", the server's other messages' form.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from types import TracebackType

log = logging.getLogger("agentcell.progress")

# a step that ends sooner says nothing (AGENTCELL_PROGRESS_QUIET_S=0: every step, to see where a start goes)
QUIET_S = float(os.environ.get("AGENTCELL_PROGRESS_QUIET_S", "1"))
EVERY_S = 3.0  # then a line at most this often while it runs


class _Fallback(logging.StreamHandler):  # type: ignore[type-arg]
    """stderr, unless the application configured a handler of its own for these lines."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("agentcell: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger("agentcell").handlers or logging.getLogger().handlers:
            return  # theirs formats and routes it (the logging of wp-ops, an application's basicConfig ...)
        self.stream = sys.stderr  # as it is now (tests swap it)
        super().emit(record)


if not any(isinstance(h, _Fallback) for h in log.handlers):
    log.addHandler(_Fallback())
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)


class Step:
    """One wait. Thread-safe: advance() may be called from a worker thread while a timer reports."""

    def __init__(self, what: str, total: int | None = None, unit: str = "") -> None:
        self.what = what
        self.total = total
        self.unit = unit
        self.done = 0
        self.started = time.monotonic()
        self._said = False  # any line printed: the end is said too
        self._next = self.started + QUIET_S
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _how_far(self) -> str:
        if self.total:
            pct = 100 * min(self.done, self.total) // self.total
            return f"{self.done:,}/{self.total:,} {self.unit} ({pct} %), ".replace(" ,", ",")
        if self.done:
            return f"{self.done:,} {self.unit}, ".replace(" ,", ",")
        return ""

    def _report(self, force: bool = False) -> None:
        now = time.monotonic()
        with self._lock:
            if not force and now < self._next:
                return
            self._next = now + EVERY_S
            self._said = True
            line = f"{self.what}: {self._how_far()}{now - self.started:.1f} s"
        log.info("%s", line)

    def advance(self, n: int = 1) -> None:
        self.done += n
        if time.monotonic() >= self._next:
            self._report()

    def set_total(self, total: int) -> None:
        self.total = total

    def _tick(self) -> None:  # the timer: a wait with nothing to advance is still said
        self._report()
        with self._lock:
            if self._timer is None:
                return
            self._timer = threading.Timer(max(0.05, self._next - time.monotonic()), self._tick)
            self._timer.daemon = True
            self._timer.start()

    def __enter__(self) -> Step:
        self.started = time.monotonic()
        self._next = self.started + QUIET_S
        self._timer = threading.Timer(QUIET_S, self._tick)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        with self._lock:
            timer, self._timer = self._timer, None
        if timer is not None:
            timer.cancel()
        if self._said or self.elapsed >= QUIET_S:
            outcome = "done" if exc_type is None else f"failed ({exc_type.__name__})"
            total = f", {self.done:,} {self.unit}".replace(" ,", ",") if self.done and self.unit else ""
            log.info("%s: %s in %.1f s%s", self.what, outcome, self.elapsed, total)


def step(what: str, total: int | None = None, unit: str = "") -> Step:
    """A context manager for one wait (see the module's doc)."""
    return Step(what, total, unit)
