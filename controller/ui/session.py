"""Who is looking: the UI's login sessions and the scope of the token behind them.

Used by `app.py` on every /ui route. A login (`POST /ui/login`, one field `token`) checks the token as the API
does (`auth.token_matches` for the admin token, `auth.TokenBook` for scoped ones; the join token is refused) and
keeps it server-side under a random session id: the cookie holds only that id (HttpOnly, SameSite=Strict), so
no script ever reads a token. Each request checks the token again, so deleting a scoped token's file ends its
sessions. What a scoped token may read is `http/access.forbidden`'s call, the API's own rule.
"""
from __future__ import annotations

import hmac
import secrets
import time
from dataclasses import dataclass

from rolloutd.crds.names import API_PREFIX

from ..access.auth import ScopedToken, TokenBook, token_matches
from ..http.access import forbidden

COOKIE = "rolloutd_session"
SESSION_SECONDS = 12 * 3600
MAX_SESSIONS = 10_000  # beyond it, a login ends the oldest session
SESSIONS_PER_PRINCIPAL = 32  # beyond it, a login ends that token's own oldest session (never another's)


@dataclass(frozen=True)
class Principal:
    """A token the controller knows: the admin's (`scoped` None) or a scoped one."""

    name: str
    scoped: ScopedToken | None = None

    def may_read(self, namespace: str, name: str) -> str | None:
        """None when this token may read the job `namespace/name` through the API, else the API's 403 message."""
        if self.scoped is None:
            return None
        return forbidden(self.scoped, "GET", f"{API_PREFIX}/namespaces/{namespace}/rolloutjobs/{name}")


@dataclass
class _Session:
    token: str
    csrf: str
    expires: float
    who: str = ""  # the principal's name: sessions are capped per principal


class Sessions:
    """Login sessions in memory (a controller restart logs everyone out), keyed by a random id."""

    def __init__(self, admin_token: str, tokens: TokenBook):
        self.admin_token, self.tokens = admin_token, tokens
        self._by_id: dict[str, _Session] = {}

    def principal(self, token: str) -> Principal | None:
        """The principal `token` authenticates, or None (unknown, revoked, or the nodes' join token)."""
        header = f"Bearer {token}"
        if token_matches(header, self.admin_token):
            return Principal("admin")
        scoped = self.tokens.find(header)
        return None if scoped is None else Principal(scoped.name, scoped)

    @staticmethod
    def key(who: Principal) -> str:
        """The principal's key for its sessions and its login budget (a scoped token named "admin" is not the admin)."""
        return f"token/{who.name}" if who.scoped is not None else who.name

    def login(self, token: str) -> tuple[str, Principal] | None:
        """A new session id for `token`, or None when the token is not valid."""
        who = self.principal(token.strip())
        if who is None:
            return None
        now = time.time()
        self._by_id = {k: s for k, s in self._by_id.items() if s.expires > now}
        key = self.key(who)
        mine = [k for k, s in self._by_id.items() if s.who == key]  # oldest first: dicts keep insertion order
        for k in mine[:max(0, len(mine) - SESSIONS_PER_PRINCIPAL + 1)]:
            del self._by_id[k]
        while len(self._by_id) >= MAX_SESSIONS:
            self._by_id.pop(next(iter(self._by_id)))
        sid = secrets.token_urlsafe(32)
        self._by_id[sid] = _Session(token.strip(), secrets.token_urlsafe(24), now + SESSION_SECONDS, key)
        return sid, who

    def _session(self, sid: str | None) -> _Session | None:
        s = self._by_id.get(sid or "")
        if s is None or s.expires <= time.time():
            return None
        return s

    def from_cookie(self, sid: str | None) -> Principal | None:
        s = self._session(sid)
        return None if s is None else self.principal(s.token)

    def from_header(self, header: str | None) -> Principal | None:
        if not header or not header.startswith("Bearer "):
            return None
        return self.principal(header[len("Bearer "):].strip())

    def csrf(self, sid: str | None) -> str | None:
        s = self._session(sid)
        return None if s is None else s.csrf

    def csrf_ok(self, sid: str | None, sent: str | None) -> bool:
        expected = self.csrf(sid)
        return expected is not None and sent is not None and hmac.compare_digest(expected.encode(), sent.encode())

    def logout(self, sid: str | None) -> None:
        self._by_id.pop(sid or "", None)
