"""Console sign-in: opaque session cookies, CSRF tokens, roles, a bounded in-memory store.

The page never holds the API key: signing in trades it for an opaque session id in an HttpOnly,
SameSite=Strict cookie; the store maps the id (by its SHA-256) to a role and a CSRF token. Keys are
compared in constant time. At most MAX_SESSIONS of each role live at once (the least recently used of
that role goes first: a viewer signing in again and again pushes out only viewers); one idle for IDLE_S
expires. A restart signs everyone out.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field

COOKIE = "agentcell_console"
MAX_SESSIONS = 1000  # per role
IDLE_S = 12 * 3600.0
ADMIN, VIEWER = "admin", "viewer"


@dataclass
class Session:
    role: str
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    last: float = field(default_factory=time.monotonic)

    @property
    def admin(self) -> bool:
        return self.role == ADMIN


def _equal(given: str, expected: str) -> bool:
    return hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode())


def role_of(key: str, api_key: str | None, viewer_key: str | None) -> str | None:
    """The role a key signs in as: the server's API key (any key when it has none) is admin, the
    viewer key viewer; None for anything else. Both comparisons always run (constant time)."""
    admin = api_key is None or _equal(key, api_key)
    viewer = viewer_key is not None and _equal(key, viewer_key)
    if admin:
        return ADMIN
    return VIEWER if viewer else None


def _digest(session_id: str) -> bytes:
    return hashlib.sha256(session_id.encode("utf-8", "surrogateescape")).digest()


class SessionStore:
    def __init__(self, max_sessions: int = MAX_SESSIONS, idle_s: float = IDLE_S) -> None:
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self._by_digest: OrderedDict[bytes, Session] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_digest)

    def create(self, role: str) -> tuple[str, Session]:
        """A new session: (the cookie's value, the session)."""
        self._expire()
        same_role = [d for d, s in self._by_digest.items() if s.role == role]  # least recently used first
        for d in same_role[:max(0, len(same_role) - self.max_sessions + 1)]:
            del self._by_digest[d]
        session_id = secrets.token_urlsafe(32)
        session = Session(role)
        self._by_digest[_digest(session_id)] = session
        return session_id, session

    def get(self, session_id: str | None) -> Session | None:
        if not session_id:
            return None
        d = _digest(session_id)
        session = self._by_digest.get(d)
        if session is None:
            return None
        now = time.monotonic()
        if now - session.last > self.idle_s:
            del self._by_digest[d]
            return None
        session.last = now
        self._by_digest.move_to_end(d)
        return session

    def forget(self, session_id: str | None) -> None:
        if session_id:
            self._by_digest.pop(_digest(session_id), None)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._by_digest:
            d, oldest = next(iter(self._by_digest.items()))
            if now - oldest.last <= self.idle_s:
                return
            del self._by_digest[d]


def csrf_ok(session: Session, token: str | None) -> bool:
    return token is not None and _equal(token, session.csrf)


class SignInThrottle:
    """Wrong keys are counted per client address: after FAILURES of them within WINDOW_S, that address's
    sign-ins are refused (429) until the window passes, so a key cannot be guessed at the page's pace.
    At most MAX_ADDRESSES are tracked (the least recently failed forgotten first). A right key does not
    clear the count: a viewer key's holder could otherwise guess at the admin key without end."""

    FAILURES = 10
    WINDOW_S = 60.0
    MAX_ADDRESSES = 4096

    def __init__(self) -> None:
        self._failed: OrderedDict[str, list[float]] = OrderedDict()

    def wait_s(self, address: str) -> float:
        """Seconds before this address may try again (0: now)."""
        times = self._recent(address)
        return 0.0 if len(times) < self.FAILURES else times[0] + self.WINDOW_S - time.monotonic()

    def failed(self, address: str) -> None:
        times = self._recent(address)
        times.append(time.monotonic())
        self._failed[address] = times[-self.FAILURES:]
        self._failed.move_to_end(address)
        while len(self._failed) > self.MAX_ADDRESSES:
            self._failed.popitem(last=False)

    def _recent(self, address: str) -> list[float]:
        cutoff = time.monotonic() - self.WINDOW_S
        return [t for t in self._failed.get(address, ()) if t > cutoff]
