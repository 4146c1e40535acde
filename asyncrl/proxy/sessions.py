"""Sessions of the proxy: keys, lifetimes, admission, and the session's export.

Every agent run is one session with its own bearer key `sk-asyncrl-<id>-<secret>`; the secret is
compared in constant time, so a key never leaks through timing. The admin key (start, end, export)
is compared the same way. A session idle for `session_timeout_s` expires and its data is dropped.
Admission is bounded twice: `max_sessions`, and an optional `admission()` callback (the rollout
executor's staleness capacity) telling how many more may start now; over either bound a start is
refused (HTTP 429) so agents cannot produce data older than the staleness bound allows. An ended
session's key is refused everywhere (HTTP 403) except to set its own reward.
"""

from __future__ import annotations

import hmac
import secrets
import threading
import time
from collections.abc import Callable

from asyncrl.api import Sample
from asyncrl.proxy.errors import AuthError, CapacityError, NotFoundError, SessionEndedError
from asyncrl.proxy.export import ExportStyle, export_session
from asyncrl.proxy.records import Session, SessionStatus
from asyncrl.reward.returns import raw_rewards, session_returns

KEY_PREFIX = "sk-asyncrl-"


class SessionStore:
    def __init__(self, admin_key: str, timeout_s: float, max_sessions: int,
                 admission: Callable[[], int] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.admin_key, self.timeout_s, self.max_sessions = admin_key, timeout_s, max_sessions
        self.admission, self.clock = admission, clock
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self.expired = 0

    # ---- keys ---------------------------------------------------------------------------------

    def check_admin(self, key: str | None) -> None:
        if not hmac.compare_digest((key or "").encode(), self.admin_key.encode()):
            raise AuthError("missing or wrong admin key")

    def by_key(self, key: str | None, ended_ok: bool = False) -> Session:
        """The session a session key belongs to: AuthError for a wrong or expired key,
        SessionEndedError when the session has ended (unless `ended_ok`: setting its reward)."""
        sid, _, secret = (key or "").removeprefix(KEY_PREFIX).partition("-")
        self.expire()
        session = self._sessions.get(sid) if (key or "").startswith(KEY_PREFIX) else None
        # Compare against a dummy when the id is unknown, so both paths cost the same.
        expected = session.secret if session else "x" * len(secret)
        if not hmac.compare_digest(secret.encode(), expected.encode()) or session is None:
            raise AuthError("missing, wrong or expired session key")
        if session.status != SessionStatus.ACTIVE and not ended_ok:
            raise SessionEndedError(session.id)
        session.last_used = self.clock()
        return session

    def get(self, sid: str) -> Session:
        self.expire()
        if sid not in self._sessions:
            raise NotFoundError(f"session {sid!r} does not exist (never started, exported or "
                                "expired)")
        return self._sessions[sid]

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self) -> Session:
        self.expire()
        with self._lock:
            active = sum(s.status == SessionStatus.ACTIVE for s in self._sessions.values())
            if active >= self.max_sessions:
                raise CapacityError(f"{active} sessions are active; max_sessions="
                                    f"{self.max_sessions}")
            if self.admission is not None and self.admission() <= 0:
                raise CapacityError("the staleness bound allows no new session now; retry after "
                                    "the trainer's next step")
            session = Session(id=secrets.token_hex(8), secret=secrets.token_hex(24),
                              created=self.clock(), last_used=self.clock())
            self._sessions[session.id] = session
        return session

    def end(self, sid: str) -> Session:
        session = self.get(sid)
        session.status = SessionStatus.ENDED
        return session

    def drop(self, sid: str) -> None:
        with self._lock:
            self._sessions.pop(sid, None)

    def export(self, sid: str, style: ExportStyle, turn_discount: float) -> list[Sample]:
        """The session's samples; the session is removed (its data is handed over once)."""
        session = self.get(sid)
        raw = raw_rewards(session.turns, session.rewards, session.last_reward)
        returns = session_returns(session.turns, raw, turn_discount)
        samples = export_session(list(session.completions.values()), raw, returns, style)
        self.drop(sid)
        return samples

    def expire(self) -> None:
        now = self.clock()
        with self._lock:
            old = [sid for sid, s in self._sessions.items()
                   if now - s.last_used > self.timeout_s]
            for sid in old:
                del self._sessions[sid]
            self.expired += len(old)

    @property
    def active(self) -> int:
        return sum(s.status == SessionStatus.ACTIVE for s in self._sessions.values())
